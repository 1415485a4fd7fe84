// Argument checks shared by every kernel, CPU and CUDA alike.
//
// Header-only on purpose: the CUDA library must not depend on symbols of the
// CPU library, so that each loads (or fails) on its own.  Every message
// starts with "torchops.<op>: " and names the argument, so a user sees which
// call and which input is wrong.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/util/safe_numerics.h>

#include <cstdint>

#include <initializer_list>
#include <limits>
#include <utility>

namespace torchops {

// A tensor argument together with the names used in error messages.
struct Arg {
  const at::Tensor& t;
  const char* name;
};

inline void check_floating(const char* op, Arg x) {
  TORCH_CHECK(
      at::isFloatingType(x.t.scalar_type()),
      "torchops.", op, ": expected '", x.name,
      "' to be a floating-point tensor (float32, float64, float16 or "
      "bfloat16), but got ", x.t.scalar_type());
}

inline void check_dim(const char* op, Arg x, int64_t dim) {
  TORCH_CHECK(
      x.t.dim() == dim, "torchops.", op, ": expected '", x.name, "' to have ",
      dim, " dimensions, but got ", x.t.dim(), " (shape ", x.t.sizes(), ")");
}

inline void check_same_dtype(const char* op, Arg x, Arg y) {
  TORCH_CHECK(
      x.t.scalar_type() == y.t.scalar_type(), "torchops.", op, ": expected '",
      y.name, "' to have the same dtype as '", x.name, "' (", x.t.scalar_type(),
      "), but got ", y.t.scalar_type());
}

inline void check_same_device(const char* op, Arg x, Arg y) {
  TORCH_CHECK(
      x.t.device() == y.t.device(), "torchops.", op, ": expected '", y.name,
      "' to be on the same device as '", x.name, "' (", x.t.device(),
      "), but got ", y.t.device());
}

inline void check_device_type(const char* op, Arg x, c10::DeviceType type) {
  TORCH_CHECK(
      x.t.device().type() == type, "torchops.", op, ": expected '", x.name,
      "' to be a ", c10::DeviceTypeName(type, /*lower_case=*/true),
      " tensor, but got one on ", x.t.device());
}

// Every tensor argument on `type`, all on one device.  Kernels call this
// first: the dispatcher picks the kernel from the highest-priority key, so a
// CUDA kernel can be handed a CPU tensor in a mixed call.
inline void check_devices(
    const char* op, c10::DeviceType type, std::initializer_list<Arg> args) {
  const Arg* first = nullptr;
  for (const Arg& a : args) {
    check_device_type(op, a, type);
    if (first == nullptr) {
      first = &a;
    } else {
      check_same_device(op, *first, a);
    }
  }
}

// The largest padding, stride or dilation a convolution-like op accepts
// (MAX_CONV_ARGUMENT in torchops/ops.py, for the fakes).  Values beyond
// int32 describe no real convolution; bounding them keeps every coordinate
// computation of the kernels (o * stride - pad + k * dilation,
// size + 2 * pad) inside int64, and the checks' messages free of wrapped
// sizes.
constexpr int64_t kConvArgumentMax = std::numeric_limits<int32_t>::max();

// Each named hyper-parameter of a convolution-like op at most
// kConvArgumentMax.
inline void check_conv_arguments(
    const char* op, std::initializer_list<std::pair<const char*, int64_t>> args) {
  for (const auto& a : args) {
    TORCH_CHECK(a.second <= kConvArgumentMax, "torchops.", op, ": expected '",
                a.first, "' to be at most ", kConvArgumentMax, " (int32), but got ",
                a.second);
  }
}

// Allocates an op's output (zero-filled when `zero`).  Output sizes come from
// arguments (pooled sizes, the input sizes a backward is told) or from
// products of input sizes (matmul's M x N when K = 0), so they can be absurd:
// without this, the failure is "Storage size calculation overflowed" or the
// allocator's bare message, naming neither the op nor the sizes.  A CUDA
// out-of-memory error keeps its type (torch.OutOfMemoryError) for callers
// that catch it.
// The byte count of an output of `sizes`, checked as new_output does (for
// kernels that allocate it in another way, e.g. channels-last).
inline uint64_t check_output_size(const char* op, c10::IntArrayRef sizes,
                                  const at::TensorOptions& options) {
  uint64_t bytes = options.dtype().itemsize();
  bool overflow = false;
  for (const int64_t d : sizes) {
    TORCH_CHECK(d >= 0, "torchops.", op, ": output shape ", sizes,
                " has a negative size");
    overflow |= c10::mul_overflows(bytes, static_cast<uint64_t>(d), &bytes);
  }
  TORCH_CHECK(
      !overflow &&
          bytes <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
      "torchops.", op, ": the output of shape ", sizes, " (", options.dtype(),
      ") is too large to allocate: its byte count overflows int64");
  return bytes;
}

inline at::Tensor new_output(const char* op, c10::IntArrayRef sizes,
                             const at::TensorOptions& options,
                             bool zero = false) {
  const uint64_t bytes = check_output_size(op, sizes, options);
  try {
    return zero ? at::zeros(sizes, options) : at::empty(sizes, options);
  } catch (const c10::OutOfMemoryError& e) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, "torchops.", op,
                     ": out of memory allocating the output of shape ", sizes,
                     " (", bytes, " bytes): ", e.what_without_backtrace());
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "torchops.", op,
                ": cannot allocate the output of shape ", sizes, " (", bytes,
                " bytes): ", e.what_without_backtrace());
  }
}

}  // namespace torchops
