// C++ entry points that call torchops operators *through the dispatcher*.
//
// Autograd kernels use these, never a kernel function directly: a backward
// that goes through the dispatcher picks the right device kernel, records
// itself for double backward, and is visible to torch.compile's tracer.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

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

// --- detection: RoI pooling -------------------------------------------------------

// --- losses -------------------------------------------------------------------------

}  // namespace torchops::ops
