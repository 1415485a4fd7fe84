// C entry points of one CUDA matmul path, for check.py (ctypes): the path's
// header is built alone with nvcc, without ATen, so a kernel can be checked
// and timed in seconds instead of a full extension build.
// Built once per path with -DPATH_HEADER=... -DPATH_NAME=...
#include PATH_HEADER

using namespace torchops::cuda::gemm;

#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)

extern "C" {
int dev_supports(const GemmArgs* g) { return CAT(PATH_NAME, _supports)(*g) ? 1 : 0; }
long long dev_workspace_bytes(const GemmArgs* g) {
  return static_cast<long long>(CAT(PATH_NAME, _workspace_bytes)(*g));
}
int dev_run(const GemmArgs* g, void* workspace, void* stream) {
  return static_cast<int>(
      CAT(PATH_NAME, _run)(*g, workspace, static_cast<cudaStream_t>(stream)));
}
}

#ifdef TORCHOPS_SM80_DEV_TABLE  // sm80.cuh in a -DTORCHOPS_MATMUL_DEV build
extern "C" {
int dev_sm80_cfg_count() { return sm80_dev_cfg_count(); }
const char* dev_sm80_cfg_name(int i) { return sm80_dev_cfg_name(i); }
}
#endif

#ifdef TORCHOPS_DECODE_DEV_TABLE  // decode.cuh in a -DTORCHOPS_MATMUL_DEV build
extern "C" {
int dev_decode_cfg_count() { return decode_dev_cfg_count(); }
const char* dev_decode_cfg_name(int i) { return decode_dev_cfg_name(i); }
}
#endif
