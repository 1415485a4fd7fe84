// Autocast for torchops operators.  Two policies:
//   AutocastFloat32 -- the detection ops, the way torchvision does it: under
//     torch.autocast the op computes in float32 and returns the dtype its
//     inputs came in (reduced-precision inputs are upcast, results cast back).
//   AutocastLowerPrecision -- matmul, the way ATen's own matmul does it: the
//     floating inputs are cast to the autocast dtype (float64 ones are left
//     alone), and the result stays in it.
//
// Usage, in the op's dispatcher glue (csrc/dispatch/<op>_dispatch.cpp):
//
//   template <c10::DeviceType D>
//   at::Tensor roi_align_autocast(const at::Tensor& input, ...) {
//     const AutocastFloat32<D> guard;            // autocast off below us
//     return guard.back(ops::roi_align(guard.up(input), ...), input);
//   }
//   ...
//   // at file scope, with the op's other registrations:
//   TORCHOPS_REGISTER_AUTOCAST("roi_align", torchops::dispatch::roi_align_autocast)
#pragma once

#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

namespace torchops {

template <c10::DeviceType Device>
class AutocastFloat32 {
 public:
  // Floating tensors to float32 (cached the same way ATen's autocast casts).
  at::Tensor up(const at::Tensor& t) const {
    return at::autocast::cached_cast(at::kFloat, t, Device);
  }
  // A floating result back to `like`'s dtype; other results unchanged.
  at::Tensor back(const at::Tensor& result, const at::Tensor& like) const {
    return result.is_floating_point() ? result.to(like.scalar_type()) : result;
  }

 private:
  c10::impl::ExcludeDispatchKeyGuard no_autocast_{
      at::autocast::get_autocast_dispatch_key_from_device_type(Device)};
};

template <c10::DeviceType Device>
class AutocastLowerPrecision {
 public:
  // float32 (and the other reduced type) to the region's dtype, cached as
  // ATen's autocast casts; float64 and non-floating tensors unchanged.
  at::Tensor down(const at::Tensor& t) const {
    return at::autocast::cached_cast(dtype_, t, Device);
  }

 private:
  at::ScalarType dtype_ = at::autocast::get_autocast_dtype(Device);
  c10::impl::ExcludeDispatchKeyGuard no_autocast_{
      at::autocast::get_autocast_dispatch_key_from_device_type(Device)};
};

}  // namespace torchops

// Registers `fn<CPU>` and `fn<CUDA>` as the op's AutocastCPU/AutocastCUDA
// kernels.  It expands to TORCH_LIBRARY_IMPL blocks, which name their
// registrars uniquely, so a file may use it more than once; it belongs at file
// scope, where every glue file makes its registrations, so `fn` is written
// fully qualified.
#define TORCHOPS_REGISTER_AUTOCAST(op_name, fn)                         \
  TORCH_LIBRARY_IMPL(torchops, AutocastCPU, m) {                        \
    m.impl(op_name, &fn<c10::DeviceType::CPU>);                         \
  }                                                                     \
  TORCH_LIBRARY_IMPL(torchops, AutocastCUDA, m) {                       \
    m.impl(op_name, &fn<c10::DeviceType::CUDA>);                        \
  }
