// The sm90 path of torchops.matmul, compiled in a translation unit of its own
// so the four paths' kernels build in parallel (csrc/cuda/matmul.cu picks).
#include "cuda/matmul/sm90.cuh"
#include "cuda/matmul/paths.cuh"

namespace torchops::cuda::gemm {

const PathEntry sm90_path{"sm90", sm90_supports, sm90_workspace_bytes, sm90_run};

}  // namespace torchops::cuda::gemm
