// The decode path of torchops.matmul, compiled in a translation unit of its own
// so the four paths' kernels build in parallel (csrc/cuda/matmul/matmul.cu picks).
#include "cuda/matmul/decode.cuh"
#include "cuda/matmul/paths.cuh"

namespace torchops::cuda::gemm {

const PathEntry decode_path{"decode", decode_supports, decode_workspace_bytes, decode_run};

}  // namespace torchops::cuda::gemm
