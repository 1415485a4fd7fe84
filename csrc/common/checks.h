// Argument checks shared by every kernel, CPU and CUDA alike.
//
// Header-only on purpose: the CUDA library must not depend on symbols of the
// CPU library, so that each loads (or fails) on its own.  Every message
// starts with "torchops.<op>: " and names the argument, so a user sees which
// call and which input is wrong.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <initializer_list>
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

}  // namespace torchops
