// Registers an op's kernel and its backward operator's kernel for one
// dispatch key, which is how every CPU and CUDA kernel file ends:
//
//   TORCHOPS_REGISTER_KERNELS(CPU, d_sigmoid)
//
// registers the function `d_sigmoid` as torchops::d_sigmoid and
// `d_sigmoid_backward` as torchops::_d_sigmoid_backward at the CPU key (CUDA
// in a .cu file).  The kernel functions carry the op's name in the namespace
// where the macro stands.  It expands to a TORCH_LIBRARY_IMPL block, which
// names its registrar uniquely, so it belongs at namespace scope and a file
// may use it once per op.
#pragma once

#include <torch/library.h>

#define TORCHOPS_REGISTER_KERNELS(key, op)          \
  TORCH_LIBRARY_IMPL(torchops, key, m) {            \
    m.impl(#op, &op);                               \
    m.impl("_" #op "_backward", &op##_backward);    \
  }

// The same for an op whose host steps are written once in
// csrc/common/<op>_steps.h as `<op>_forward<Kernels>` and
// `<op>_backward<Kernels>`, with the device's `Kernels`:
//
//   TORCHOPS_REGISTER_STEPS(CUDA, sigmoid_focal_loss, CudaKernels)
#define TORCHOPS_REGISTER_STEPS(key, op, Kernels)            \
  TORCH_LIBRARY_IMPL(torchops, key, m) {                     \
    m.impl(#op, &op##_forward<Kernels>);                     \
    m.impl("_" #op "_backward", &op##_backward<Kernels>);    \
  }

// An in-place optimizer step with its two overloads, a float lr and a
// tensor lr (`<op>.tensor_lr`), at the device's key and at its sparse key, so
// that a sparse gradient reaches the kernel's check and is rejected by name:
//
//   TORCHOPS_REGISTER_STEP(CPU, fused_adam_, (&fused_adam_float_lr<impl>),
//                          (&fused_adam_tensor_lr<impl>))
#define TORCHOPS_REGISTER_STEP(key, op, float_lr, tensor_lr)  \
  TORCH_LIBRARY_IMPL(torchops, key, m) {                      \
    m.impl(#op, float_lr);                                    \
    m.impl(#op ".tensor_lr", tensor_lr);                      \
  }                                                           \
  TORCH_LIBRARY_IMPL(torchops, Sparse##key, m) {              \
    m.impl(#op, float_lr);                                    \
    m.impl(#op ".tensor_lr", tensor_lr);                      \
  }
