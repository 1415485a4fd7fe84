// The simt path of torchops.matmul, compiled in a translation unit of its own
// so the four paths' kernels build in parallel (csrc/cuda/matmul/matmul.cu picks).
#include "cuda/matmul/simt.cuh"
#include "cuda/matmul/paths.cuh"

namespace torchops::cuda::gemm {

const PathEntry simt_path{"simt", simt_supports, simt_workspace_bytes, simt_run};

}  // namespace torchops::cuda::gemm
