// PyTorch's precision rule for float32 convolutions on CUDA, which the
// library's convolutions follow as conv2d does: TF32 tensor cores where
// PyTorch lets convolutions use them (torch.backends.cudnn.conv.fp32_precision
// "tf32", the default, or the older torch.backends.cudnn.allow_tf32), exact
// float32 otherwise.  It is read at each call, so torch.compile'd code sees
// the setting of the moment, and it is independent of the matmul flag
// (torch.backends.cuda.matmul.allow_tf32), which conv2d ignores too.
#pragma once

#include <ATen/Context.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

namespace torchops::cuda {

// Whether PyTorch lets float32 convolutions use TF32.
inline bool conv_allows_tf32() {
  return at::globalContext().allowTF32CuDNN(at::Float32Op::CONV);
}

// Whether a float32 convolution on the current device runs on TF32 tensor
// cores: the rule allows it and the GPU has them (sm_80 on).
inline bool conv_uses_tf32() {
  if (!conv_allows_tf32()) {
    return false;
  }
  int dev = 0, major = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  return major >= 8;
}

}  // namespace torchops::cuda
