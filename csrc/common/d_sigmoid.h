// The math of d_sigmoid, written once for the CPU and CUDA kernels.
//
// With s = sigmoid(z):  d_sigmoid(z) = s (1 - s)
//                       d/dz d_sigmoid(z) = s (1 - s) (1 - 2 s)
// Half types are computed in float (opmath_t) and rounded once at the end.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>

#include "common/checks.h"

namespace torchops {

template <typename T>
C10_HOST_DEVICE inline T sigmoid_of(T z) {
  return T(1) / (T(1) + std::exp(-z));
}

template <typename T>
C10_HOST_DEVICE inline T d_sigmoid_value(T z) {
  const T s = sigmoid_of(z);
  return s * (T(1) - s);
}

template <typename T>
C10_HOST_DEVICE inline T d_sigmoid_grad(T grad, T z) {
  const T s = sigmoid_of(z);
  return grad * s * (T(1) - s) * (T(1) - T(2) * s);
}

inline void check_d_sigmoid(const at::Tensor& z, c10::DeviceType device) {
  check_devices("d_sigmoid", device, {{z, "z"}});
  check_floating("d_sigmoid", {z, "z"});
}

inline void check_d_sigmoid_backward(
    const at::Tensor& grad, const at::Tensor& z, c10::DeviceType device) {
  const char* op = "_d_sigmoid_backward";
  check_devices(op, device, {{z, "z"}, {grad, "grad"}});
  check_floating(op, {z, "z"});
  check_same_dtype(op, {z, "z"}, {grad, "grad"});
  TORCH_CHECK(
      grad.sizes() == z.sizes(), "torchops._d_sigmoid_backward: expected "
      "'grad' to have the shape of 'z' (", z.sizes(), "), but got ",
      grad.sizes());
}

}  // namespace torchops
