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

// Harness config tables (-DTORCHOPS_MATMUL_DEV): a path with one defines
// TORCHOPS_<PATH>_DEV_TABLE and <path>_dev_cfg_count/name (and optionally
// <path>_dev_cfg_dtypes: the check.py dtype keys a config serves, "" = all).
// Generic exports: dev_cfg_count (0 without a table), dev_cfg_name,
// dev_cfg_dtypes, dev_cfg_env (the env var the path reads at each call).
// One path per build, so at most one table is defined.
#if defined(TORCHOPS_SM80_DEV_TABLE)
#define DEV_CFG_COUNT() sm80_dev_cfg_count()
#define DEV_CFG_NAME(i) sm80_dev_cfg_name(i)
#define DEV_CFG_DTYPES(i) ""
#define DEV_CFG_ENV "TORCHOPS_DEV_SM80_CFG"
#elif defined(TORCHOPS_SIMT_DEV_TABLE)
#define DEV_CFG_COUNT() simt_dev_cfg_count()
#define DEV_CFG_NAME(i) simt_dev_cfg_name(i)
#define DEV_CFG_DTYPES(i) simt_dev_cfg_dtypes(i)
#define DEV_CFG_ENV "TORCHOPS_DEV_SIMT_CFG"
#elif defined(TORCHOPS_DECODE_DEV_TABLE)
#define DEV_CFG_COUNT() decode_dev_cfg_count()
#define DEV_CFG_NAME(i) decode_dev_cfg_name(i)
#define DEV_CFG_DTYPES(i) ""
#define DEV_CFG_ENV "TORCHOPS_DEV_DECODE_CFG"
#else
#define DEV_CFG_COUNT() 0
#define DEV_CFG_NAME(i) ""
#define DEV_CFG_DTYPES(i) ""
#define DEV_CFG_ENV ""
#endif

extern "C" {
int dev_cfg_count() { return DEV_CFG_COUNT(); }
const char* dev_cfg_name(int i) { return (void)i, DEV_CFG_NAME(i); }
const char* dev_cfg_dtypes(int i) { return (void)i, DEV_CFG_DTYPES(i); }
const char* dev_cfg_env() { return DEV_CFG_ENV; }
}
