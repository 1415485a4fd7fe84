// The matmul paths as the dispatcher (csrc/cuda/matmul/matmul.cu) sees them: each is
// defined in csrc/cuda/matmul/matmul_<path>.cu, one translation unit per path, so
// their kernels compile in parallel.  The dispatcher must not include the
// path headers: their inline host functions instantiate every kernel of the
// path wherever they are defined.
#pragma once

#include "cuda/matmul/gemm_args.cuh"

namespace torchops::cuda::gemm {

struct PathEntry {
  const char* name;
  bool (*supports)(const GemmArgs&);
  size_t (*workspace_bytes)(const GemmArgs&);
  cudaError_t (*run)(const GemmArgs&, void*, cudaStream_t);
};

extern const PathEntry decode_path;
extern const PathEntry sm90_path;
extern const PathEntry sm80_path;
extern const PathEntry simt_path;
extern const PathEntry sm90_3xtf32_path;  // opt-in 3xTF32 float32 (matmul::gemm_3xtf32_out)

}  // namespace torchops::cuda::gemm
