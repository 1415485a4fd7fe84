// sm90's harness pins, for both of its modes (sm90, sm90_3xtf32):
// TORCHOPS_DEV_SM90="BN,STORE[,TM]" pins the tile and epilogue ("256,0",
// "128,1,64"; a value the problem cannot take, such as "auto", keeps the
// automatic choice) and TORCHOPS_DEV_SM90_SPLITS a split count.  Read at
// each call.  Included by dev_configs.cuh after csrc/cuda/matmul/sm90.cuh.
#pragma once

#include <cstdio>
#include <cstdlib>

namespace torchops::cuda::gemm::dev {

inline bool sm90_pinned_tile(const GemmArgs& g, const sm90_detail::Layout& l,
                             sm90_detail::TileShape& t, bool& store) {
  using sm90_detail::kBM;
  const char* v = std::getenv("TORCHOPS_DEV_SM90");
  if (v == nullptr) return false;
  int bn = 0, st = 0, tm = kBM;
  const int got = std::sscanf(v, "%d,%d,%d", &bn, &st, &tm);
  const bool half = g.dtype != DType::f32;
  const bool narrow = tm == 64 && (bn == 64 || (bn == 32 && !l.b_n_major));
  if (got >= 2 && (bn == 128 || bn == 256 || (bn == 192 && half) || narrow) &&
      (tm == kBM || (tm == 64 && half && (bn == 128 || narrow)))) {
    t = {tm, bn};
    store = store && st != 0;
    return true;
  }
  return false;
}

inline sm90_detail::Pins pins_from_env() {
  sm90_detail::Pins pins;
  if (const char* v = std::getenv("TORCHOPS_DEV_SM90_SPLITS")) {
    pins.pin_splits = true;
    pins.splits = std::atoi(v);
  }
  pins.tile = sm90_pinned_tile;
  return pins;
}

#if DEV_PATH_ID == DEV_PATH_sm90_3xtf32
inline bool supports(const GemmArgs& g) { return sm90_3xtf32_supports(g); }
inline size_t workspace_bytes(const GemmArgs& g) {
  return sm90_detail::split3_workspace_bytes(g, pins_from_env());
}
inline cudaError_t run(const GemmArgs& g, void* ws, cudaStream_t stream) {
  return sm90_detail::split3_run(g, ws, stream, pins_from_env());
}
#else
inline bool supports(const GemmArgs& g) { return sm90_supports(g); }
inline size_t workspace_bytes(const GemmArgs& g) {
  return sm90_detail::workspace_bytes(g, pins_from_env());
}
inline cudaError_t run(const GemmArgs& g, void* ws, cudaStream_t stream) {
  return sm90_detail::run(g, ws, stream, pins_from_env());
}
#endif

inline int cfg_count() { return 0; }
inline const char* cfg_name(int) { return ""; }
inline const char* cfg_dtypes(int) { return ""; }
inline const char* cfg_env() { return ""; }

}  // namespace torchops::cuda::gemm::dev
