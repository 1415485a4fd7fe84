// The host steps of torchops.carafe and its backward, written once for both
// devices: the checks, the outputs and the dtype dispatch are the same; each
// device supplies its kernels (a `Kernels` type with the static members
// below).
//
//   Kernels::device                             c10::DeviceType
//   Kernels::guard(features)                    kept alive for the call
//                                               (CUDA: the device guard)
//   Kernels::features(features, p)              what the kernels read the
//                                               features from (CPU: padded
//                                               planes in the compute type;
//                                               CUDA: contiguous features
//                                               and the SM count)
//   Kernels::forward<scalar_t>(p, f, masks, out)
//   Kernels::grad_masks<scalar_t>(p, grad, f, grad_masks)
//   Kernels::grad_features<scalar_t>(p, grad, masks, f, grad_features)
//
// Header-only, like the rest of csrc/common: the CPU and CUDA libraries
// each compile their own copy.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>

#include <tuple>

#include "common/carafe.h"

namespace torchops {

template <typename Kernels>
at::Tensor carafe_forward(const at::Tensor& features_in,
                          const at::Tensor& masks_in, int64_t kernel_size,
                          int64_t group_size, int64_t scale_factor) {
  const char* op = "carafe";
  const CarafeShape p = check_carafe(op, features_in, masks_in, kernel_size,
                                     group_size, scale_factor, Kernels::device);
  [[maybe_unused]] const auto guard = Kernels::guard(features_in);
  at::Tensor out = new_output(op, {p.n, p.c, p.ho, p.wo}, features_in.options());
  if (out.numel() == 0) {
    return out;
  }
  const auto features = Kernels::features(features_in, p);
  const at::Tensor masks = masks_in.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, masks.scalar_type(), "torchops.carafe", [&] {
        Kernels::template forward<scalar_t>(p, features,
                                            masks.const_data_ptr<scalar_t>(),
                                            out.mutable_data_ptr<scalar_t>());
      });
  return out;
}

template <typename Kernels>
std::tuple<at::Tensor, at::Tensor> carafe_backward(
    const at::Tensor& grad_in, const at::Tensor& features_in,
    const at::Tensor& masks_in, int64_t kernel_size, int64_t group_size,
    int64_t scale_factor) {
  const char* op = "_carafe_backward";
  const CarafeShape p =
      check_carafe_backward(op, grad_in, features_in, masks_in, kernel_size,
                            group_size, scale_factor, Kernels::device);
  [[maybe_unused]] const auto guard = Kernels::guard(features_in);
  CarafeGrads grads = carafe_backward_outputs(op, p, features_in, masks_in);
  at::Tensor& grad_features = grads.features;
  at::Tensor& grad_masks = grads.masks;
  if (grads.done) {
    return {grad_features, grad_masks};
  }
  const at::Tensor grad = grad_in.contiguous();
  const auto features = Kernels::features(features_in, p);
  const at::Tensor masks = masks_in.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, masks.scalar_type(),
      "torchops._carafe_backward", [&] {
        const scalar_t* g = grad.const_data_ptr<scalar_t>();
        Kernels::template grad_masks<scalar_t>(
            p, g, features, grad_masks.mutable_data_ptr<scalar_t>());
        Kernels::template grad_features<scalar_t>(
            p, g, masks.const_data_ptr<scalar_t>(), features,
            grad_features.mutable_data_ptr<scalar_t>());
      });
  return {grad_features, grad_masks};
}

}  // namespace torchops
