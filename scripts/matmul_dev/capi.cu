// C entry points of one CUDA matmul path, for check.py (ctypes): the path's
// header is built alone with nvcc, without ATen, so a kernel can be checked
// and timed in seconds instead of a full extension build.
// Built once per path with -DPATH_HEADER=... -DPATH_NAME=...; the path's
// harness-only configs and pins come from dev_configs.cuh.
#include PATH_HEADER

#include "dev_configs.cuh"

using namespace torchops::cuda::gemm;

extern "C" {
int dev_supports(const GemmArgs* g) { return dev::supports(*g) ? 1 : 0; }
long long dev_workspace_bytes(const GemmArgs* g) {
  return static_cast<long long>(dev::workspace_bytes(*g));
}
int dev_run(const GemmArgs* g, void* workspace, void* stream) {
  return static_cast<int>(dev::run(*g, workspace, static_cast<cudaStream_t>(stream)));
}

// The path's config table (0 entries without one).
int dev_cfg_count() { return dev::cfg_count(); }
const char* dev_cfg_name(int i) { return dev::cfg_name(i); }
const char* dev_cfg_dtypes(int i) { return dev::cfg_dtypes(i); }
const char* dev_cfg_env() { return dev::cfg_env(); }
}
