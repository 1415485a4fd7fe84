// simt's harness configs: candidate tiles picked by TORCHOPS_DEV_SIMT_CFG at
// each call (run unsplit), TORCHOPS_DEV_SIMT_SPLITS (a split count) and
// TORCHOPS_DEV_SIMT90 (0: simt.cuh's own kernel on Hopper, an A/B switch for
// check.py --sweep; 2: simt90.cuh's wherever it can run, the correctness
// list's small shapes included).  Included by dev_configs.cuh after
// csrc/cuda/matmul/simt.cuh.
#pragma once

#include <cstdlib>
#include <type_traits>

namespace torchops::cuda::gemm::dev {

using namespace simt_detail;

// Candidate tiles (check.py --cfgs simt:all); 0 and 1 are the automatic
// ones.  A float config serves float only here
// (the automatic one serves half/bfloat16 too), to keep the harness build
// short.  Names: dtype, tile, per-thread tile, threads, launch bounds.
#define TORCHOPS_SIMT_DEV_CFGS(X)                                      \
  X(0, float, CfgF32, "f32", "128x128x16 8x8 t256 lb1 (auto)")        \
  X(1, double, CfgF64, "f64", "128x64x8 8x8 t128 lb2 (auto)")          \
  X(2, float, (TileCfg<128, 128, 8, 8, 8, 1>), "f32", "128x128x8 8x8 t256 lb1")    \
  X(3, float, (TileCfg<128, 128, 16, 8, 8, 2>), "f32", "128x128x16 8x8 t256 lb2")  \
  X(4, float, (TileCfg<128, 128, 16, 8, 8, 1>), "f32", "128x128x16 8x8 t256 lb1")  \
  X(5, float, (TileCfg<128, 256, 8, 8, 16, 1>), "f32", "128x256x8 8x16 t256 lb1")  \
  X(6, float, (TileCfg<256, 128, 8, 16, 8, 1>), "f32", "256x128x8 16x8 t256 lb1")  \
  X(7, float, (TileCfg<128, 256, 16, 8, 16, 1>), "f32", "128x256x16 8x16 t256 lb1") \
  X(8, float, (TileCfg<256, 128, 16, 16, 8, 1>), "f32", "256x128x16 16x8 t256 lb1") \
  X(9, float, (TileCfg<128, 128, 8, 16, 8, 2>), "f32", "128x128x8 16x8 t128 lb2")  \
  X(10, float, (TileCfg<128, 64, 8, 8, 8, 3>), "f32", "128x64x8 8x8 t128 lb3")    \
  X(11, float, (TileCfg<128, 128, 8, 8, 16, 2>), "f32", "128x128x8 8x16 t128 lb2")  \
  X(12, float, (TileCfg<256, 128, 8, 16, 8, 1, false>), "f32", "256x128x8 16x8 t256 lb1 nosplit") \
  X(13, float, (TileCfg<64, 128, 8, 8, 8, 3>), "f32", "64x128x8 8x8 t128 lb3")     \
  X(14, double, (TileCfg<128, 64, 16, 8, 4, 1>), "f64", "128x64x16 8x4 t256 lb1")  \
  X(15, double, (TileCfg<64, 128, 16, 4, 8, 1>), "f64", "64x128x16 4x8 t256 lb1")  \
  X(16, double, (TileCfg<128, 128, 8, 8, 8, 1>), "f64", "128x128x8 8x8 t256 lb1")  \
  X(17, double, (TileCfg<64, 64, 16, 8, 4, 2>), "f64", "64x64x16 8x4 t128 lb2")    \
  X(18, double, (TileCfg<128, 64, 8, 8, 8, 2>), "f64", "128x64x8 8x8 t128 lb2")   \
  X(19, float, (TileCfg<128, 128, 8, 8, 8, 2, false>), "f32", "128x128x8 8x8 t256 lb2 nosplit") \
  X(20, double, (TileCfg<64, 64, 16, 4, 4, 2, false>), "f64", "64x64x16 4x4 t256 lb2 nosplit")

template <typename C> struct Unparen;
template <typename C> struct Unparen<void(C)> { using type = C; };
#define TORCHOPS_SIMT_CFG_T(cfg) typename Unparen<void(cfg)>::type

constexpr int kDevCfgs = 21;
#define TORCHOPS_SIMT_X_NAME(i, t, cfg, dt, name) dt " " name,
#define TORCHOPS_SIMT_X_DT(i, t, cfg, dt, name) dt,
constexpr const char* kDevCfgNames[kDevCfgs] = {TORCHOPS_SIMT_DEV_CFGS(TORCHOPS_SIMT_X_NAME)};
constexpr const char* kDevCfgDtypes[kDevCfgs] = {TORCHOPS_SIMT_DEV_CFGS(TORCHOPS_SIMT_X_DT)};
#undef TORCHOPS_SIMT_X_NAME
#undef TORCHOPS_SIMT_X_DT

// Config i for element type T; a config of another dtype is an error.
template <typename T>
cudaError_t dev_launch(int cfg, const GemmArgs& g, cudaStream_t stream) {
  switch (cfg) {
#define TORCHOPS_SIMT_X_CASE(i, t, cfg, dt, name)                                 \
  case i:                                                                          \
    if constexpr (std::is_same_v<T, t>) return launch<T, TORCHOPS_SIMT_CFG_T(cfg), false>(g, g.k, nullptr, stream); \
    else return cudaErrorInvalidValue;
    TORCHOPS_SIMT_DEV_CFGS(TORCHOPS_SIMT_X_CASE)
#undef TORCHOPS_SIMT_X_CASE
    default:
      return cudaErrorInvalidValue;
  }
}

// -1: no override (env unset or empty); -2: not a valid index.
inline int dev_cfg_from_env() {
  const char* v = std::getenv("TORCHOPS_DEV_SIMT_CFG");
  if (!v || !*v) return -1;
  char* end = nullptr;
  const long i = std::strtol(v, &end, 10);
  return (*end != '\0' || i < 0 || i >= kDevCfgs) ? -2 : int(i);
}

inline Pins pins_from_env() {
  Pins pins;
  if (const char* v = std::getenv("TORCHOPS_DEV_SIMT90"); v && (v[0] == '0' || v[0] == '2')) {
    pins.simt90 = v[0] - '0';
  }
  if (const char* v = std::getenv("TORCHOPS_DEV_SIMT_SPLITS"); v && *v) {
    pins.pin_splits = true;
    pins.splits = std::atoi(v);
  }
  return pins;
}

inline bool supports(const GemmArgs& g) { return simt_supports(g); }

inline size_t workspace_bytes(const GemmArgs& g) {
  if (dev_cfg_from_env() != -1) return 0;  // harness configs run unsplit
  return simt_detail::workspace_bytes(g, pins_from_env());
}

inline cudaError_t run(const GemmArgs& g, void* workspace, cudaStream_t stream) {
  if (g.batch == 0 || g.m == 0 || g.n == 0) return cudaSuccess;
  // Read at each call, so one process can time every config.
  if (const int cfg = dev_cfg_from_env(); cfg != -1) {
    if (cfg < 0) return cudaErrorInvalidValue;
    switch (g.dtype) {
      case DType::f32: return dev_launch<float>(cfg, g, stream);
      case DType::f64: return dev_launch<double>(cfg, g, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  return simt_detail::run(g, workspace, stream, pins_from_env());
}

inline int cfg_count() { return kDevCfgs; }
inline const char* cfg_name(int i) { return i >= 0 && i < kDevCfgs ? kDevCfgNames[i] : ""; }
// The check.py dtype keys a config serves ("" would mean all).
inline const char* cfg_dtypes(int i) { return i >= 0 && i < kDevCfgs ? kDevCfgDtypes[i] : ""; }
inline const char* cfg_env() { return "TORCHOPS_DEV_SIMT_CFG"; }

}  // namespace torchops::cuda::gemm::dev
