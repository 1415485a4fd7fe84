// CUDA kernels of torchops.d_sigmoid and its backward.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "common/d_sigmoid.h"
#include "cuda/common/elementwise.cuh"

namespace torchops::cuda {
namespace {

at::Tensor d_sigmoid(const at::Tensor& z_in) {
  check_d_sigmoid(z_in, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(z_in.device());
  const at::Tensor z = z_in.contiguous();
  at::Tensor out = at::empty(z.sizes(), z.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, z.scalar_type(), "torchops.d_sigmoid", [&] {
        using opmath_t = at::opmath_type<scalar_t>;
        const scalar_t* zp = z.const_data_ptr<scalar_t>();
        scalar_t* op = out.mutable_data_ptr<scalar_t>();
        launch_map(z.numel(), op, std::array<const scalar_t*, 1>{zp},
                   [] __device__(const scalar_t(&v)[1]) {
                     return static_cast<scalar_t>(
                         d_sigmoid_value(static_cast<opmath_t>(v[0])));
                   });
      });
  return out;
}

at::Tensor d_sigmoid_backward(const at::Tensor& grad_in, const at::Tensor& z_in) {
  check_d_sigmoid_backward(grad_in, z_in, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(z_in.device());
  const at::Tensor z = z_in.contiguous();
  const at::Tensor grad = grad_in.contiguous();
  at::Tensor out = at::empty(z.sizes(), z.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, z.scalar_type(),
      "torchops._d_sigmoid_backward", [&] {
        using opmath_t = at::opmath_type<scalar_t>;
        const scalar_t* zp = z.const_data_ptr<scalar_t>();
        const scalar_t* gp = grad.const_data_ptr<scalar_t>();
        scalar_t* op = out.mutable_data_ptr<scalar_t>();
        launch_map(z.numel(), op, std::array<const scalar_t*, 2>{gp, zp},
                   [] __device__(const scalar_t(&v)[2]) {
                     return static_cast<scalar_t>(d_sigmoid_grad(
                         static_cast<opmath_t>(v[0]), static_cast<opmath_t>(v[1])));
                   });
      });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CUDA, m) {
  m.impl("d_sigmoid", &d_sigmoid);
  m.impl("_d_sigmoid_backward", &d_sigmoid_backward);
}

}  // namespace torchops::cuda
