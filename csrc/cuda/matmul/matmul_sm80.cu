// The sm80 path of torchops.matmul, compiled in a translation unit of its own
// so the four paths' kernels build in parallel (csrc/cuda/matmul/matmul.cu picks).
#include "cuda/matmul/sm80.cuh"
#include "cuda/matmul/paths.cuh"

namespace torchops::cuda::gemm {

const PathEntry sm80_path{"sm80", sm80_supports, sm80_workspace_bytes, sm80_run};

}  // namespace torchops::cuda::gemm
