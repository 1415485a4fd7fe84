// sm80's harness configs: the three automatic tiles (0..2, choose_cfg's
// indices) and candidates after them, picked by TORCHOPS_DEV_SM80_CFG at
// each call (check.py --sm80-cfgs).  Included by dev_configs.cuh after
// csrc/cuda/matmul/sm80.cuh.
#pragma once

#include <cstdlib>

namespace torchops::cuda::gemm::dev {

// Warp tiles stay 64x64 (32 mma per 4+4 ldmatrix.x4 per k-step); the
// candidates differ in block shape, k depth (barriers per k), stages and 4
// vs 8 warps.
using sm80_detail::TileCfg;
using CfgDev3 = TileCfg<128, 128, 64, 2, 2, 3, 2>;  // 4 warps, 2 blocks/SM
using CfgDev4 = TileCfg<256, 128, 32, 4, 2, 4, 1>;
using CfgDev5 = TileCfg<128, 256, 64, 2, 4, 3, 1>;
using CfgDev6 = TileCfg<256, 128, 64, 4, 2, 3, 1>;
using CfgDev7 = TileCfg<128, 256, 64, 2, 4, 4, 1>;
using CfgDev8 = TileCfg<128, 128, 32, 2, 2, 4, 2>;  // 4 warps, 2 blocks/SM
constexpr int kDevCfgs = 9;
constexpr const char* kDevCfgNames[kDevCfgs] = {
    "128x256x64 s3 w2x4 (auto big)", "128x128x64 s3 w2x2 2/SM (auto mid)",
    "64x64x32 s4 w2x2 (auto small)", "128x128x64 s3 w2x2 2/SM",
    "256x128x32 s4 w4x2",            "128x256x64 s3 w2x4",
    "256x128x64 s3 w4x2",            "128x256x64 s4 w2x4",
    "128x128x32 s4 w2x2 2/SM"};

template <int KIND>
cudaError_t sm80_dispatch(int cfg, const sm80_detail::Call& c, cudaStream_t s) {
  using sm80_detail::dispatch_layout;
  switch (cfg) {
    case 3: return dispatch_layout<CfgDev3, KIND>(c.p, c.a_k, c.b_k, s, c.dev);
    case 4: return dispatch_layout<CfgDev4, KIND>(c.p, c.a_k, c.b_k, s, c.dev);
    case 5: return dispatch_layout<CfgDev5, KIND>(c.p, c.a_k, c.b_k, s, c.dev);
    case 6: return dispatch_layout<CfgDev6, KIND>(c.p, c.a_k, c.b_k, s, c.dev);
    case 7: return dispatch_layout<CfgDev7, KIND>(c.p, c.a_k, c.b_k, s, c.dev);
    case 8: return dispatch_layout<CfgDev8, KIND>(c.p, c.a_k, c.b_k, s, c.dev);
    default: return sm80_detail::dispatch_cfg<KIND>(cfg, c.p, c.a_k, c.b_k, s, c.dev);
  }
}

inline bool supports(const GemmArgs& g) { return sm80_supports(g); }
inline size_t workspace_bytes(const GemmArgs& g) { return sm80_workspace_bytes(g); }

inline cudaError_t run(const GemmArgs& g, void* /*workspace*/, cudaStream_t stream) {
  using namespace sm80_detail;
  if (g.m == 0 || g.n == 0 || g.batch == 0) return cudaSuccess;
  Call c;
  if (const cudaError_t e = plan_call(g, c); e != cudaSuccess) return e;
  int cfg = c.cfg;
  // Read at each call, so one process can time every config.
  if (const char* v = std::getenv("TORCHOPS_DEV_SM80_CFG"); v && *v) {
    char* end = nullptr;
    const long i = std::strtol(v, &end, 10);
    if (*end != '\0' || i < 0 || i >= kDevCfgs) return cudaErrorInvalidValue;
    cfg = int(i);
  }
  switch (g.dtype) {
    case DType::bf16: return sm80_dispatch<kBF16>(cfg, c, stream);
    case DType::f16: return sm80_dispatch<kF16>(cfg, c, stream);
    default: return sm80_dispatch<kTF32>(cfg, c, stream);
  }
}

inline int cfg_count() { return kDevCfgs; }
inline const char* cfg_name(int i) { return i >= 0 && i < kDevCfgs ? kDevCfgNames[i] : ""; }
inline const char* cfg_dtypes(int) { return ""; }
inline const char* cfg_env() { return "TORCHOPS_DEV_SM80_CFG"; }

}  // namespace torchops::cuda::gemm::dev
