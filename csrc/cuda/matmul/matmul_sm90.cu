// The sm90 path of torchops.matmul, compiled in a translation unit of its own
// so the four paths' kernels build in parallel (csrc/cuda/matmul/matmul.cu picks).
#include "cuda/matmul/sm90.cuh"
#include "cuda/matmul/paths.cuh"

namespace torchops::cuda::gemm {

const PathEntry sm90_path{"sm90", sm90_supports, sm90_workspace_bytes, sm90_run};
// Not one of torchops.matmul's choices: float32 at float32 accuracy on TF32
// tensor cores, for ops that opt in (matmul::gemm_3xtf32_out, api.h).
const PathEntry sm90_3xtf32_path{"sm90_3xtf32", sm90_3xtf32_supports, sm90_3xtf32_workspace_bytes,
                                 sm90_3xtf32_run};

}  // namespace torchops::cuda::gemm
