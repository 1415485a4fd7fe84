// C++ entry points that call torchops operators *through the dispatcher*.
//
// Autograd kernels use these, never a kernel function directly: a backward
// that goes through the dispatcher picks the right device kernel, records
// itself for double backward, and is visible to torch.compile's tracer.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/string_view.h>

#include <tuple>
#include <utility>

namespace torchops::ops {

namespace detail {
template <typename Signature>
c10::TypedOperatorHandle<Signature> handle(const char* name) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow(name, "")
      .template typed<Signature>();
}
}  // namespace detail

inline at::Tensor matmul(const at::Tensor& a, const at::Tensor& b) {
  static const auto op =
      detail::handle<at::Tensor(const at::Tensor&, const at::Tensor&)>(
          "torchops::matmul");
  return op.call(a, b);
}

inline at::Tensor d_sigmoid(const at::Tensor& z) {
  static const auto op =
      detail::handle<at::Tensor(const at::Tensor&)>("torchops::d_sigmoid");
  return op.call(z);
}

inline at::Tensor d_sigmoid_backward(const at::Tensor& grad, const at::Tensor& z) {
  static const auto op =
      detail::handle<at::Tensor(const at::Tensor&, const at::Tensor&)>(
          "torchops::_d_sigmoid_backward");
  return op.call(grad, z);
}

// --- detection: boxes -------------------------------------------------------------

inline at::Tensor nms(const at::Tensor& boxes, const at::Tensor& scores,
                      double iou_threshold) {
  static const auto op = detail::handle<at::Tensor(
      const at::Tensor&, const at::Tensor&, double)>("torchops::nms");
  return op.call(boxes, scores, iou_threshold);
}

inline at::Tensor batched_nms(const at::Tensor& boxes, const at::Tensor& scores,
                              const at::Tensor& idxs, double iou_threshold) {
  static const auto op = detail::handle<at::Tensor(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
      "torchops::batched_nms");
  return op.call(boxes, scores, idxs, iou_threshold);
}

inline at::Tensor box_iou(const at::Tensor& boxes1, const at::Tensor& boxes2) {
  static const auto op =
      detail::handle<at::Tensor(const at::Tensor&, const at::Tensor&)>(
          "torchops::box_iou");
  return op.call(boxes1, boxes2);
}

inline std::tuple<at::Tensor, at::Tensor> box_iou_backward(
    const at::Tensor& grad, const at::Tensor& boxes1, const at::Tensor& boxes2) {
  static const auto op = detail::handle<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
      "torchops::_box_iou_backward");
  return op.call(grad, boxes1, boxes2);
}

// --- detection: RoI pooling -------------------------------------------------------

inline at::Tensor roi_align(const at::Tensor& input, const at::Tensor& rois,
                            double spatial_scale, c10::SymInt pooled_height,
                            c10::SymInt pooled_width, int64_t sampling_ratio,
                            bool aligned) {
  static const auto op = detail::handle<at::Tensor(
      const at::Tensor&, const at::Tensor&, double, c10::SymInt, c10::SymInt,
      int64_t, bool)>("torchops::roi_align");
  return op.call(input, rois, spatial_scale, std::move(pooled_height),
                 std::move(pooled_width), sampling_ratio, aligned);
}

inline at::Tensor roi_align_backward(
    const at::Tensor& grad, const at::Tensor& rois, double spatial_scale,
    c10::SymInt pooled_height, c10::SymInt pooled_width,
    c10::SymInt batch_size, c10::SymInt channels, c10::SymInt height,
    c10::SymInt width, int64_t sampling_ratio, bool aligned) {
  static const auto op = detail::handle<at::Tensor(
      const at::Tensor&, const at::Tensor&, double, c10::SymInt, c10::SymInt,
      c10::SymInt, c10::SymInt, c10::SymInt, c10::SymInt, int64_t, bool)>(
      "torchops::_roi_align_backward");
  return op.call(grad, rois, spatial_scale, std::move(pooled_height),
                 std::move(pooled_width), std::move(batch_size),
                 std::move(channels), std::move(height), std::move(width),
                 sampling_ratio, aligned);
}

inline std::tuple<at::Tensor, at::Tensor> roi_pool(
    const at::Tensor& input, const at::Tensor& rois, double spatial_scale,
    c10::SymInt pooled_height, c10::SymInt pooled_width) {
  static const auto op = detail::handle<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, double, c10::SymInt, c10::SymInt)>(
      "torchops::roi_pool");
  return op.call(input, rois, spatial_scale, std::move(pooled_height),
                 std::move(pooled_width));
}

inline at::Tensor roi_pool_backward(
    const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& argmax,
    double spatial_scale, c10::SymInt pooled_height, c10::SymInt pooled_width,
    c10::SymInt batch_size, c10::SymInt channels, c10::SymInt height,
    c10::SymInt width) {
  static const auto op = detail::handle<at::Tensor(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
      c10::SymInt, c10::SymInt, c10::SymInt, c10::SymInt, c10::SymInt,
      c10::SymInt)>("torchops::_roi_pool_backward");
  return op.call(grad, rois, argmax, spatial_scale, std::move(pooled_height),
                 std::move(pooled_width), std::move(batch_size),
                 std::move(channels), std::move(height), std::move(width));
}

// --- losses -------------------------------------------------------------------------

inline at::Tensor sigmoid_focal_loss(
    const at::Tensor& inputs, const at::Tensor& targets, double alpha,
    double gamma, c10::string_view reduction) {
  static const auto op = detail::handle<at::Tensor(
      const at::Tensor&, const at::Tensor&, double, double, c10::string_view)>(
      "torchops::sigmoid_focal_loss");
  return op.call(inputs, targets, alpha, gamma, reduction);
}

inline at::Tensor sigmoid_focal_loss_backward(
    const at::Tensor& grad, const at::Tensor& inputs,
    const at::Tensor& targets, double alpha, double gamma,
    c10::string_view reduction) {
  static const auto op = detail::handle<at::Tensor(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double,
      c10::string_view)>("torchops::_sigmoid_focal_loss_backward");
  return op.call(grad, inputs, targets, alpha, gamma, reduction);
}

}  // namespace torchops::ops
