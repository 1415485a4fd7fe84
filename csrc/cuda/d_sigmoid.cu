// CUDA kernels of torchops.d_sigmoid and its backward.
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "common/d_sigmoid_steps.h"
#include "common/register_kernels.h"
#include "cuda/common/elementwise.cuh"

namespace torchops::cuda {
namespace {

struct CudaKernels {
  static constexpr c10::DeviceType device = c10::DeviceType::CUDA;

  static c10::cuda::CUDAGuard guard(const at::Tensor& z) {
    return c10::cuda::CUDAGuard(z.device());
  }

  template <typename scalar_t>
  static void value(const scalar_t* z, scalar_t* out, int64_t n) {
    using opmath_t = at::opmath_type<scalar_t>;
    launch_map(n, out, std::array<const scalar_t*, 1>{z},
               [] __device__(const scalar_t(&v)[1]) {
                 return static_cast<scalar_t>(
                     d_sigmoid_value(static_cast<opmath_t>(v[0])));
               });
  }

  template <typename scalar_t>
  static void grad(const scalar_t* g, const scalar_t* z, scalar_t* out, int64_t n) {
    using opmath_t = at::opmath_type<scalar_t>;
    launch_map(n, out, std::array<const scalar_t*, 2>{g, z},
               [] __device__(const scalar_t(&v)[2]) {
                 return static_cast<scalar_t>(d_sigmoid_grad(
                     static_cast<opmath_t>(v[0]), static_cast<opmath_t>(v[1])));
               });
  }
};

}  // namespace

TORCHOPS_REGISTER_STEPS(CUDA, d_sigmoid, CudaKernels)

}  // namespace torchops::cuda
