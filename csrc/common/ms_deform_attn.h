// The math and the argument checks of torchops.ms_deform_attn (multi-scale
// deformable attention), written once for the CPU and CUDA kernels.
//
// For output row (b, q, head) and each level l of size (H_l, W_l), point p
// samples value[b, start_l + y * W_l + x, head, :] bilinearly at
//   (w_im, h_im) = (loc_x * W_l - 0.5, loc_y * H_l - 0.5)
// (align_corners=False), corners outside the level reading zeros, and the
// samples are summed with weights attention_weights[b, q, head, l, p].
//
// The kernels never trust spatial_shapes and level_start_index: the CUDA
// kernels read them on the device (checking them would need a host sync),
// so every read is bounded by msda_level, whatever the values say.
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/safe_numerics.h>

#include <cmath>
#include <cstdint>

#include "common/checks.h"

namespace torchops {

// The sizes of one call: value (B, S, heads, C); sampling_locations (B, Q,
// heads, L, P, 2).
struct MsdaDims {
  int64_t batch, spatial, heads, channels, queries, levels, points;
};

// One level as the kernels use it: H and W scale the locations; `rows` is
// how many of its rows lie wholly inside value's S positions (H when the
// shapes are consistent, fewer or none when they are not), and only those
// rows are read.
struct MsdaLevel {
  int64_t height, width, start, rows;
};

C10_HOST_DEVICE inline MsdaLevel msda_level(int64_t height, int64_t width,
                                            int64_t start, int64_t spatial) {
  int64_t rows = 0;
  if (height > 0 && width > 0 && start >= 0 && start < spatial) {
    const int64_t fit = (spatial - start) / width;
    rows = height < fit ? height : fit;
  }
  return {height, width, start, rows};
}

// The bilinear taps of one sample: up to four positions (offsets from the
// level's first position, -1 for a corner outside) and their weights, with
// the fractional parts the gradient needs.
template <typename T>
struct MsdaTaps {
  int64_t pos[4];  // (y0, x0), (y0, x1), (y1, x0), (y1, x1)
  T weight[4];
  T lh, lw, hh, hw;
  bool any;  // false: the sample reads nothing (all weights 0)
};

template <typename T>
C10_HOST_DEVICE inline MsdaTaps<T> msda_taps(const MsdaLevel& lv, T loc_x, T loc_y) {
  MsdaTaps<T> t;
  t.any = false;
  t.lh = t.lw = t.hh = t.hw = T(0);
  for (int k = 0; k < 4; ++k) {
    t.pos[k] = -1;
    t.weight[k] = T(0);
  }
  const T h_im = loc_y * static_cast<T>(lv.height) - T(0.5);
  const T w_im = loc_x * static_cast<T>(lv.width) - T(0.5);
  // NaN fails every comparison; rows <= S keeps the integer casts in range.
  if (!(h_im > T(-1) && w_im > T(-1) && h_im < static_cast<T>(lv.rows) &&
        w_im < static_cast<T>(lv.width))) {
    return t;
  }
  const T fh = std::floor(h_im), fw = std::floor(w_im);
  const int64_t y0 = static_cast<int64_t>(fh), x0 = static_cast<int64_t>(fw);
  const int64_t y1 = y0 + 1, x1 = x0 + 1;
  t.lh = h_im - fh;
  t.lw = w_im - fw;
  t.hh = T(1) - t.lh;
  t.hw = T(1) - t.lw;
  t.any = true;
  const bool top = y0 >= 0, bottom = y1 < lv.rows;
  const bool left = x0 >= 0, right = x1 < lv.width;
  if (top && left) {
    t.pos[0] = y0 * lv.width + x0;
    t.weight[0] = t.hh * t.hw;
  }
  if (top && right) {
    t.pos[1] = y0 * lv.width + x1;
    t.weight[1] = t.hh * t.lw;
  }
  if (bottom && left) {
    t.pos[2] = y1 * lv.width + x0;
    t.weight[2] = t.lh * t.hw;
  }
  if (bottom && right) {
    t.pos[3] = y1 * lv.width + x1;
    t.weight[3] = t.lh * t.lw;
  }
  return t;
}

// d weight[k] / d h_im and d weight[k] / d w_im (zero for corners outside).
template <typename T>
C10_HOST_DEVICE inline void msda_tap_slopes(const MsdaTaps<T>& t, T (&dh)[4], T (&dw)[4]) {
  const T sh[4] = {-t.hw, -t.lw, t.hw, t.lw};
  const T sw[4] = {-t.hh, t.hh, -t.lh, t.lh};
  for (int k = 0; k < 4; ++k) {
    const bool in = t.pos[k] >= 0;
    dh[k] = in ? sh[k] : T(0);
    dw[k] = in ? sw[k] : T(0);
  }
}

// The shapes and dtypes of a call (what a fake sees too); not the values of
// spatial_shapes and level_start_index (check_ms_deform_attn_levels).
inline MsdaDims check_ms_deform_attn(const char* op, const at::Tensor& value,
                                     const at::Tensor& spatial_shapes,
                                     const at::Tensor& level_start_index,
                                     const at::Tensor& loc, const at::Tensor& attn,
                                     c10::DeviceType device) {
  check_devices(op, device,
                {{value, "value"},
                 {spatial_shapes, "spatial_shapes"},
                 {level_start_index, "level_start_index"},
                 {loc, "sampling_locations"},
                 {attn, "attention_weights"}});
  check_floating(op, {value, "value"});
  check_same_dtype(op, {value, "value"}, {loc, "sampling_locations"});
  check_same_dtype(op, {value, "value"}, {attn, "attention_weights"});
  TORCH_CHECK(spatial_shapes.scalar_type() == at::kLong, "torchops.", op,
              ": expected 'spatial_shapes' to be an int64 tensor, but got ",
              spatial_shapes.scalar_type());
  TORCH_CHECK(level_start_index.scalar_type() == at::kLong, "torchops.", op,
              ": expected 'level_start_index' to be an int64 tensor, but got ",
              level_start_index.scalar_type());
  check_dim(op, {value, "value"}, 4);
  TORCH_CHECK(spatial_shapes.dim() == 2 && spatial_shapes.size(1) == 2, "torchops.", op,
              ": expected 'spatial_shapes' to have shape (L, 2), but got ",
              spatial_shapes.sizes());
  const int64_t levels = spatial_shapes.size(0);
  TORCH_CHECK(level_start_index.dim() == 1 && level_start_index.size(0) == levels,
              "torchops.", op, ": expected 'level_start_index' to have shape (L,) with L = ",
              levels, " (spatial_shapes' rows), but got ", level_start_index.sizes());
  const int64_t batch = value.size(0), heads = value.size(2);
  TORCH_CHECK(loc.dim() == 6 && loc.size(0) == batch && loc.size(2) == heads &&
                  loc.size(3) == levels && loc.size(5) == 2,
              "torchops.", op, ": expected 'sampling_locations' to have shape (B, Q, heads, L, "
              "P, 2) = (", batch, ", Q, ", heads, ", ", levels, ", P, 2), but got ", loc.sizes());
  TORCH_CHECK(attn.dim() == 5 && attn.size(0) == batch && attn.size(1) == loc.size(1) &&
                  attn.size(2) == heads && attn.size(3) == levels && attn.size(4) == loc.size(4),
              "torchops.", op, ": expected 'attention_weights' to have shape (B, Q, heads, L, "
              "P) = ", loc.sizes().slice(0, 5), ", but got ", attn.sizes());
  return {batch, value.size(1), heads, value.size(3), loc.size(1), levels, loc.size(4)};
}

inline void check_ms_deform_attn_backward(const char* op, const at::Tensor& grad,
                                          const at::Tensor& value, const MsdaDims& d) {
  check_same_device(op, {value, "value"}, {grad, "grad"});
  check_same_dtype(op, {value, "value"}, {grad, "grad"});
  TORCH_CHECK(grad.dim() == 3 && grad.size(0) == d.batch && grad.size(1) == d.queries &&
                  grad.size(2) == d.heads * d.channels,
              "torchops.", op, ": expected 'grad' to have shape (B, Q, heads * C) = (", d.batch,
              ", ", d.queries, ", ", d.heads * d.channels, "), but got ", grad.sizes());
}

// The values of spatial_shapes and level_start_index, read from host memory
// (the CPU kernels; the Python wrapper for other devices): sizes >= 0, each
// level starting where the previous one ends, the levels covering value's
// S positions exactly.
inline void check_ms_deform_attn_levels(const char* op, const int64_t* shapes,
                                        const int64_t* starts, int64_t levels,
                                        int64_t spatial) {
  uint64_t total = 0;
  for (int64_t l = 0; l < levels; ++l) {
    const int64_t h = shapes[2 * l], w = shapes[2 * l + 1];
    TORCH_CHECK(h >= 0 && w >= 0, "torchops.", op, ": expected 'spatial_shapes' to hold "
                "sizes >= 0, but level ", l, " is (", h, ", ", w, ")");
    TORCH_CHECK(starts[l] >= 0 && static_cast<uint64_t>(starts[l]) == total, "torchops.", op,
                ": expected 'level_start_index[", l, "]' to be ", total,
                " (the sum of the earlier levels' H * W), but got ", starts[l]);
    uint64_t hw = 0;
    const bool overflow = c10::mul_overflows(static_cast<uint64_t>(h),
                                             static_cast<uint64_t>(w), &hw) ||
                          c10::add_overflows(total, hw, &total);
    TORCH_CHECK(!overflow && total <= static_cast<uint64_t>(spatial), "torchops.", op,
                ": expected 'spatial_shapes' to sum (H * W over levels) to value's S = ",
                spatial, ", but the levels up to ", l, " already cover more");
  }
  TORCH_CHECK(total == static_cast<uint64_t>(spatial), "torchops.", op,
              ": expected 'spatial_shapes' to sum (H * W over levels) to value's S = ", spatial,
              ", but they sum to ", total);
}

}  // namespace torchops
