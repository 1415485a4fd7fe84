// torchops.multi_tensor_l2norm and torchops.multi_tensor_scale_: the
// argument checks and the types that the CPU and CUDA kernels share.
//
// Both take one list of tensors of one floating dtype on one device (the
// callers group by device and dtype, as torch.optim and clip_grad_norm_ do).
// Each tensor is dense (contiguous or a permutation of it): the kernels read
// its storage as numel consecutive elements, which a sum of squares and an
// element-wise scale may do in any layout.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstddef>
#include <string>
#include <type_traits>
#include <unordered_set>

#include "common/multi_tensor.h"

namespace torchops {

constexpr const char* kL2NormOp = "multi_tensor_l2norm";
constexpr const char* kScaleOp = "multi_tensor_scale_";

// float for float32, float16 and bfloat16 tensors; double for float64.
template <typename scalar_t>
using norm_acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

inline at::ScalarType norm_acc_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// The list of one call: every tensor defined, dense, floating, of
// tensors[0]'s dtype and device (of `type`); with `distinct` (an op that
// writes them), none twice and no two sharing memory.  Call with a
// non-empty list; returns the dtype.
inline at::ScalarType check_tensor_list(const char* op, c10::DeviceType type,
                                        at::TensorList tensors, bool distinct) {
  const at::Tensor& t0 = tensors[0];
  TORCH_CHECK(t0.defined(), "torchops.", op, ": 'tensors[0]' is undefined");
  TORCH_CHECK(t0.device().type() == type, "torchops.", op, ": expected 'tensors[0]' to be a ",
              c10::DeviceTypeName(type, /*lower_case=*/true), " tensor, but got one on ",
              t0.device());
  const at::ScalarType dtype = t0.scalar_type();
  TORCH_CHECK(at::isFloatingType(dtype), "torchops.", op,
              ": expected 'tensors[0]' to be a floating-point tensor, but got ", dtype);
  std::unordered_set<const void*> seen;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const std::string name = multi_tensor::at_index("tensors", i);
    TORCH_CHECK(t.defined(), "torchops.", op, ": '", name, "' is undefined");
    TORCH_CHECK(t.layout() == at::kStrided, "torchops.", op, ": '", name,
                "' must be a dense (strided) tensor, but got layout ", t.layout());
    TORCH_CHECK(t.device() == t0.device(), "torchops.", op, ": '", name, "' is on ",
                t.device(), " but 'tensors[0]' is on ", t0.device(),
                " (one device per call)");
    TORCH_CHECK(t.scalar_type() == dtype, "torchops.", op, ": expected '", name,
                "' to have dtype ", dtype, " (that of 'tensors[0]'; one dtype per call), but got ",
                t.scalar_type());
    TORCH_CHECK(t.is_non_overlapping_and_dense(), "torchops.", op, ": '", name,
                "' must be dense (contiguous or a permutation of contiguous), but got shape ",
                t.sizes(), " and strides ", t.strides());
    if (distinct) {
      TORCH_CHECK(seen.insert(t.unsafeGetTensorImpl()).second &&
                      (t.numel() == 0 || seen.insert(t.data_ptr()).second),
                  "torchops.", op, ": '", name,
                  "' appears twice (or shares memory with another tensor of the list)");
    }
  }
  return dtype;
}

// multi_tensor_scale_.tensor's scale: a float32 or float64 tensor of one
// element on the tensors' device, read by the kernel.
inline void check_scale_tensor(c10::DeviceType type, const at::Tensor& t0,
                               const at::Tensor& scale) {
  TORCH_CHECK(scale.layout() == at::kStrided && scale.numel() == 1 &&
                  (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kDouble),
              "torchops.multi_tensor_scale_: expected 'scale' to be a float32 or float64 "
              "tensor of one element, but got ",
              scale.scalar_type(), " of shape ", scale.sizes());
  TORCH_CHECK(scale.device().type() == type && scale.device() == t0.device(),
              "torchops.multi_tensor_scale_: 'scale' is on ", scale.device(),
              " but 'tensors[0]' is on ", t0.device());
}

// The scale of one call, as the schema's two overloads pass it: a double, or
// a one-element tensor (null without) that the kernel reads.
struct ScaleArg {
  double value;
  const void* tensor;
  bool is_double;

  template <typename acc_t>
  C10_HOST_DEVICE acc_t get() const {
    if (tensor == nullptr) {
      return static_cast<acc_t>(value);
    }
    return is_double ? static_cast<acc_t>(*static_cast<const double*>(tensor))
                     : static_cast<acc_t>(*static_cast<const float*>(tensor));
  }
};

// The schema's two overloads over one device's `void Impl(tensors, const
// at::Tensor* scale_tensor, double scale)`.
template <auto Impl>
void multi_tensor_scale_float(at::TensorList tensors, double scale) {
  Impl(tensors, nullptr, scale);
}

template <auto Impl>
void multi_tensor_scale_tensor(at::TensorList tensors, const at::Tensor& scale) {
  Impl(tensors, &scale, 0.0);
}

}  // namespace torchops

// Registers the kernels of multi_tensor_l2norm and multi_tensor_scale_ (both
// overloads) at `key` and at its sparse key, so that a sparse tensor reaches
// the kernel's check and is rejected by name:
//
//   TORCHOPS_REGISTER_MULTI_TENSOR_NORM(CPU, l2norm, scale_impl)
#define TORCHOPS_REGISTER_MULTI_TENSOR_NORM(key, l2norm, scale_impl)                      \
  TORCH_LIBRARY_IMPL(torchops, key, m) {                                                  \
    m.impl("multi_tensor_l2norm", &l2norm);                                               \
    m.impl("multi_tensor_scale_", &torchops::multi_tensor_scale_float<scale_impl>);       \
    m.impl("multi_tensor_scale_.tensor", &torchops::multi_tensor_scale_tensor<scale_impl>); \
  }                                                                                       \
  TORCH_LIBRARY_IMPL(torchops, Sparse##key, m) {                                          \
    m.impl("multi_tensor_l2norm", &l2norm);                                               \
    m.impl("multi_tensor_scale_", &torchops::multi_tensor_scale_float<scale_impl>);       \
    m.impl("multi_tensor_scale_.tensor", &torchops::multi_tensor_scale_tensor<scale_impl>); \
  }
