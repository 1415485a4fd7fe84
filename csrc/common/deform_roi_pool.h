// The geometry and argument checks of deform_roi_pool, written once for the
// CPU and CUDA kernels (mmcv's semantics, computed in T = at::opmath_type of
// the input).
//
// A RoI is cut into bins exactly as roi_align with aligned=True cuts it
// (common/roi_align.h: coordinates * spatial_scale - 0.5, adaptive grids
// bounded by adaptive_grid), and each bin's whole sampling grid is then moved
// by gamma * (roi width, roi height) * offset[k, :, ph, pw].  Without an
// offset the op is roi_align(aligned=True).
//
// Gradient with respect to the offset: every sample of a bin moves with the
// bin, so d(bin)/d(shift_x) is the sum over its samples of the derivative of
// bilinear interpolation along x.  Along an axis a sample's weights are
// (1 - f, f) with f = v - lo, slope (-1, +1), except where roi_align_axis
// clamps it (v <= 0, or v at or past the last pixel): there the value does
// not move with v, slope 0 (roi_align_slope, common/roi_align.h).  (mmcv instead differentiates the unclamped
// formula, which at the bottom and right edges gives 0 and at the top and
// left edges the one-sided slope; ours is the derivative of what the forward
// computes, as gradcheck requires.)
#pragma once

#include <c10/macros/Macros.h>

#include <optional>
#include <tuple>

#include "common/accumulate.h"
#include "common/roi.h"
#include "common/roi_align.h"

namespace torchops {

// A RoI's aligned box and how far one unit of offset moves its bins.
template <typename T>
struct DeformRoiBox {
  RoiAlignBox<T> box;
  T gain_h, gain_w;  // gamma * roi height, gamma * roi width
};

template <typename T, typename R>
C10_HOST_DEVICE inline DeformRoiBox<T> deform_roi_box(
    const R* roi, T spatial_scale, T gamma, int64_t pooled_height,
    int64_t pooled_width, int64_t sampling_ratio, int64_t height,
    int64_t width) {
  DeformRoiBox<T> d;
  d.box = roi_align_box<T>(roi, spatial_scale, pooled_height, pooled_width,
                           sampling_ratio, /*aligned=*/true, height, width);
  // The roi size as mmcv takes it: end - start of the aligned box.
  d.gain_w = gamma * (static_cast<T>(roi[3]) * spatial_scale - T(0.5) -
                      d.box.start_w);
  d.gain_h = gamma * (static_cast<T>(roi[4]) * spatial_scale - T(0.5) -
                      d.box.start_h);
  return d;
}

// The box whose bin (ph, pw) is that bin moved by offset (dy, dx); its
// other bins are meaningless.  Bin p's samples then lie at
// roi_align_sample(start, bin, p, i, grid), as in roi_align.
template <typename T>
C10_HOST_DEVICE inline RoiAlignBox<T> shifted_box(const DeformRoiBox<T>& d,
                                                  T dy, T dx) {
  RoiAlignBox<T> b = d.box;
  b.start_h += d.gain_h * dy;
  b.start_w += d.gain_w * dx;
  return b;
}

// Forward: input (N, C, H, W), rois (K, 5), offset (K, 2, PH, PW) or none,
// all of one dtype and device.
inline void check_deform_roi_pool(const char* op, const at::Tensor& input,
                                  const at::Tensor& rois,
                                  const std::optional<at::Tensor>& offset,
                                  int64_t pooled_height, int64_t pooled_width,
                                  int64_t sampling_ratio,
                                  c10::DeviceType device) {
  check_roi_forward(op, input, rois, pooled_height, pooled_width, device);
  check_sampling_ratio(op, sampling_ratio);
  if (offset.has_value()) {
    const at::Tensor& o = *offset;
    check_devices(op, device, {{input, "input"}, {o, "offset"}});
    check_same_dtype(op, {input, "input"}, {o, "offset"});
    TORCH_CHECK(o.dim() == 4 && o.size(0) == rois.size(0) && o.size(1) == 2 &&
                    o.size(2) == pooled_height && o.size(3) == pooled_width,
                "torchops.", op, ": expected 'offset' to have shape (K, 2, "
                "pooled_height, pooled_width) = (", rois.size(0), ", 2, ",
                pooled_height, ", ", pooled_width, "), but got ", o.sizes());
  }
}

// `t` has exactly the sizes `want`, spelled `layout` in the message.
inline void check_pooled_shape(const char* op, const at::Tensor& t, const char* name,
                               const char* layout, c10::IntArrayRef want) {
  TORCH_CHECK(t.sizes() == want, "torchops.", op, ": expected '", name,
              "' to have shape ", layout, " = ", want, ", but got ", t.sizes());
}

// The forward's derivatives along x and y (_deform_roi_pool_forward):
// (2, K, C, PH, PW) of the compute type (float32 for the half types), on
// the input's device.
inline void check_deform_roi_pool_slopes(const char* op, const at::Tensor& input,
                                         const at::Tensor& rois,
                                         const at::Tensor& slopes,
                                         int64_t pooled_height,
                                         int64_t pooled_width) {
  check_devices(op, input.device().type(), {{input, "input"}, {slopes, "slopes"}});
  const at::ScalarType want = accumulate_type(input.scalar_type());
  TORCH_CHECK(slopes.scalar_type() == want, "torchops.", op,
              ": expected 'slopes' to have dtype ", want, ", but got ",
              slopes.scalar_type());
  check_pooled_shape(op, slopes, "slopes", "(2, K, C, pooled_height, pooled_width)",
                     {2, rois.size(0), input.size(1), pooled_height, pooled_width});
}

// Backward: the forward's arguments, grad (K, C, PH, PW) of their dtype and
// device, and the forward's slopes or none (then grad_offset is zeros).
inline void check_deform_roi_pool_backward(
    const char* op, const at::Tensor& grad, const at::Tensor& input,
    const at::Tensor& rois, const std::optional<at::Tensor>& offset,
    const std::optional<at::Tensor>& slopes, int64_t pooled_height,
    int64_t pooled_width, int64_t sampling_ratio, c10::DeviceType device) {
  check_deform_roi_pool(op, input, rois, offset, pooled_height, pooled_width,
                        sampling_ratio, device);
  check_devices(op, device, {{input, "input"}, {grad, "grad"}});
  check_same_dtype(op, {input, "input"}, {grad, "grad"});
  check_pooled_shape(op, grad, "grad", "(K, C, pooled_height, pooled_width)",
                     {rois.size(0), input.size(1), pooled_height, pooled_width});
  if (slopes.has_value()) {
    check_deform_roi_pool_slopes(op, input, rois, *slopes, pooled_height,
                                 pooled_width);
  }
}

// The device kernel of both forward operators: the output, and with
// `slopes` (not null) the derivatives along x and y.
using DeformRoiPoolForward = at::Tensor (*)(const char* op, const at::Tensor& input,
                                            const at::Tensor& rois,
                                            const std::optional<at::Tensor>& offset,
                                            double spatial_scale, int64_t pooled_height,
                                            int64_t pooled_width, int64_t sampling_ratio,
                                            double gamma, at::Tensor* slopes);

// deform_roi_pool on a device's forward.
template <DeformRoiPoolForward kForward>
at::Tensor deform_roi_pool_op(const at::Tensor& input, const at::Tensor& rois,
                              const std::optional<at::Tensor>& offset, double spatial_scale,
                              int64_t pooled_height, int64_t pooled_width,
                              int64_t sampling_ratio, double gamma) {
  return kForward("deform_roi_pool", input, rois, offset, spatial_scale, pooled_height,
                  pooled_width, sampling_ratio, gamma, nullptr);
}

// _deform_roi_pool_forward on a device's forward: (output, slopes).
template <DeformRoiPoolForward kForward>
std::tuple<at::Tensor, at::Tensor> deform_roi_pool_with_slopes_op(
    const at::Tensor& input, const at::Tensor& rois, const at::Tensor& offset,
    double spatial_scale, int64_t pooled_height, int64_t pooled_width,
    int64_t sampling_ratio, double gamma) {
  at::Tensor slopes;
  at::Tensor out = kForward("_deform_roi_pool_forward", input, rois, offset, spatial_scale,
                            pooled_height, pooled_width, sampling_ratio, gamma, &slopes);
  return {out, slopes};
}

}  // namespace torchops
