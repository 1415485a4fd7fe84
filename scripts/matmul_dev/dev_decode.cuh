// decode's harness configs: kernel shapes K1..K17 beside the automatic K0,
// and a table of (shape, split policy, one kernel or two) picked by
// TORCHOPS_DEV_DECODE_CFG at each call (check.py --decode-cfgs); entry 0
// is the automatic choice.  TORCHOPS_DEV_DECODE_CLUSTER=0 keeps the
// two-kernel split-K where the library would sum two splits in a cluster.
// Included by dev_configs.cuh after csrc/cuda/matmul/decode.cuh.
#pragma once

#include <cstdlib>

namespace torchops::cuda::gemm::dev {

using decode_detail::K0;
using decode_detail::KCfg;
using K1 = KCfg<16, 4, 1, 2, 2, 2, 1, 1>;  // nc.L1::no_allocate loads
using K2 = KCfg<16, 4, 1, 2, 2, 2, 2, 1>;  // + L2::256B prefetch
using K3 = KCfg<8, 4, 1, 4, 4, 4, 0, 1>;   // 8 warps, 2x the loads per warp
using K4 = KCfg<8, 4, 1, 2, 2, 2, 0, 2>;   // 8 warps, 2 CTAs per SM
using K5 = KCfg<8, 4, 1, 8, 8, 4, 0, 1>;   // 8 warps, 4x the loads per warp
using K6 = KCfg<16, 2, 2, 2, 2, 2, 0, 1>;  // bk 16 columns, bn 128 columns
using K7 = KCfg<4, 4, 1, 2, 2, 2, 0, 4>;   // 4 warps, 4 CTAs per SM (u4 spills at 128 regs)
using K8 = KCfg<8, 4, 1, 4, 4, 4, 1, 1>;   // K3 with nc loads
using K9 = KCfg<8, 4, 1, 8, 8, 4, 1, 1>;   // K5 with nc loads
using K10 = KCfg<16, 4, 1, 2, 2, 2, 3, 1>;  // K16 with nc + L2 evict-first policy
using K11 = KCfg<16, 4, 1, 2, 2, 2, 4, 1>;  // K16 with cs + L2 evict-first policy
using K12 = KCfg<8, 4, 1, 4, 4, 4, 3, 1>;   // K3 with nc + L2 evict-first policy
using K13 = KCfg<16, 2, 2, 2, 2, 2, 3, 1>;  // K6 with nc + L2 evict-first policy
using K14 = KCfg<4, 4, 1, 8, 8, 4, 3, 1>;   // 4 warps, u8, nc + L2 evict-first policy
using K15 = KCfg<8, 4, 1, 6, 6, 4, 3, 1>;   // 8 warps, u6, nc + L2 evict-first policy
using K16 = KCfg<16, 4, 1, 2, 2, 2, 0, 1>;  // 16 warps, 2 loads in flight, ld.global.cs
using K17 = KCfg<8, 4, 1, 4, 4, 2, 3, 1>;   // K0 with 32-column bk CTAs
constexpr int kKCfgs = 18;
using decode_detail::geom_of;
constexpr decode_detail::Geom kGeoms[kKCfgs] = {
    geom_of<K0>(),  geom_of<K1>(),  geom_of<K2>(),  geom_of<K3>(),  geom_of<K4>(),  geom_of<K5>(),
    geom_of<K6>(),  geom_of<K7>(),  geom_of<K8>(),  geom_of<K9>(),  geom_of<K10>(), geom_of<K11>(),
    geom_of<K12>(), geom_of<K13>(), geom_of<K14>(), geom_of<K15>(), geom_of<K16>(), geom_of<K17>()};

// Harness table: kernel shape, split policy (0 auto, else that many splits,
// clamped as auto is), one kernel (last-CTA reduction) or two.
struct DevCfg {
  int kc, split, one;
  const char* name;
};
constexpr int kDevCfgs = 38;
constexpr DevCfg kDevCfgs_[kDevCfgs] = {
    {0, 0, 0, "w8 bk16c u4 nc L2 ef (f32 u2), split auto (auto)"},
    {16, 0, 1, "w16 u2 cs, split auto, 1 kernel"},
    {16, 1, 0, "w16 u2 cs, no split"},
    {16, 2, 1, "w16 u2 cs, split 2, 1 kernel"},
    {16, 4, 1, "w16 u2 cs, split 4, 1 kernel"},
    {16, 2, 0, "w16 u2 cs, split 2, 2 kernels"},
    {1, 0, 1, "w16 u2 nc, split auto, 1 kernel"},
    {2, 0, 1, "w16 u2 nc L2::256B, split auto, 1 kernel"},
    {3, 0, 1, "w8 u4 cs, split auto, 1 kernel"},
    {3, 1, 0, "w8 u4 cs, no split"},
    {4, 0, 1, "w8 u2 cs 2/SM, split auto, 1 kernel"},
    {5, 0, 1, "w8 u8 cs, split auto, 1 kernel"},
    {5, 1, 0, "w8 u8 cs, no split"},
    {6, 0, 1, "w16 bk16c/bn128c u2 cs, split auto, 1 kernel"},
    {7, 0, 1, "w4 u2 cs 4/SM, split auto, 1 kernel"},
    {8, 0, 1, "w8 u4 nc, split auto, 1 kernel"},
    {9, 0, 1, "w8 u8 nc, split auto, 1 kernel"},
    {9, 1, 0, "w8 u8 nc, no split"},
    {3, 4, 1, "w8 u4 cs, split 4, 1 kernel"},
    {5, 2, 1, "w8 u8 cs, split 2, 1 kernel"},
    {10, 0, 0, "w16 u2 nc L2 evict-first, split auto"},
    {11, 0, 0, "w16 u2 cs L2 evict-first, split auto"},
    {12, 0, 0, "w8 u4 nc L2 evict-first, split auto"},
    {13, 0, 0, "w16 bk16c/bn128c nc L2 ef, split auto"},
    {10, 1, 0, "w16 u2 nc L2 evict-first, no split"},
    {10, 4, 1, "w16 u2 nc L2 evict-first, split 4, 1 kernel"},
    {1, 0, 0, "w16 u2 nc, split auto"},
    {2, 0, 0, "w16 u2 nc L2::256B, split auto"},
    {3, 0, 0, "w8 u4 cs, split auto"},
    {8, 0, 0, "w8 u4 nc, split auto"},
    {5, 0, 0, "w8 u8 cs, split auto"},
    {9, 0, 0, "w8 u8 nc, split auto"},
    {14, 0, 0, "w4 u8 nc L2 evict-first, split auto"},
    {15, 0, 0, "w8 u6 nc L2 evict-first, split auto"},
    {16, 0, 0, "w16 u2 cs, split auto"},
    {0, 2, 0, "w8 bk16c u4 nc L2 ef, split 2"},
    {17, 0, 0, "w8 bk32c u4 nc L2 ef, split auto"},
    {17, 2, 0, "w8 bk32c u4 nc L2 ef, split 2"},
};

// -1 when TORCHOPS_DEV_DECODE_CFG is not an index of the table; 0 unset.
inline int decode_cfg() {
  if (const char* v = std::getenv("TORCHOPS_DEV_DECODE_CFG"); v && *v) {
    char* end = nullptr;
    const long i = std::strtol(v, &end, 10);
    if (*end != '\0' || i < 0 || i >= kDevCfgs) return -1;
    return int(i);
  }
  return 0;
}

inline decode_detail::Choice choice_of(int cfg) {
  decode_detail::Choice ch = decode_detail::kAutomatic;
  ch.ge = kGeoms[kDevCfgs_[cfg].kc];
  ch.split = kDevCfgs_[cfg].split;
  ch.one = kDevCfgs_[cfg].one != 0;
  if (const char* v = std::getenv("TORCHOPS_DEV_DECODE_CLUSTER"); v && v[0] == '0') {
    ch.cluster = false;
  }
  return ch;
}

inline bool supports(const GemmArgs& g) { return decode_supports(g); }

inline size_t workspace_bytes(const GemmArgs& g) {
  const int cfg = decode_cfg();
  return decode_detail::workspace_bytes(g, decode_detail::make_plan(g, choice_of(cfg < 0 ? 0 : cfg)));
}

inline cudaError_t run(const GemmArgs& g, void* workspace, cudaStream_t stream) {
  using namespace decode_detail;
  const int cfg = decode_cfg();
  if (cfg < 0) return cudaErrorInvalidValue;
  const Plan pl = make_plan(g, choice_of(cfg));
  switch (kDevCfgs_[cfg].kc) {
    case 0: return run_plan<K0>(g, pl, workspace, stream);
    case 1: return run_plan<K1>(g, pl, workspace, stream);
    case 2: return run_plan<K2>(g, pl, workspace, stream);
    case 3: return run_plan<K3>(g, pl, workspace, stream);
    case 4: return run_plan<K4>(g, pl, workspace, stream);
    case 5: return run_plan<K5>(g, pl, workspace, stream);
    case 6: return run_plan<K6>(g, pl, workspace, stream);
    case 7: return run_plan<K7>(g, pl, workspace, stream);
    case 8: return run_plan<K8>(g, pl, workspace, stream);
    case 9: return run_plan<K9>(g, pl, workspace, stream);
    case 10: return run_plan<K10>(g, pl, workspace, stream);
    case 11: return run_plan<K11>(g, pl, workspace, stream);
    case 12: return run_plan<K12>(g, pl, workspace, stream);
    case 13: return run_plan<K13>(g, pl, workspace, stream);
    case 14: return run_plan<K14>(g, pl, workspace, stream);
    case 15: return run_plan<K15>(g, pl, workspace, stream);
    case 16: return run_plan<K16>(g, pl, workspace, stream);
    case 17: return run_plan<K17>(g, pl, workspace, stream);
    default: return cudaErrorInvalidValue;
  }
}

inline int cfg_count() { return kDevCfgs; }
inline const char* cfg_name(int i) { return i >= 0 && i < kDevCfgs ? kDevCfgs_[i].name : ""; }
inline const char* cfg_dtypes(int) { return ""; }
inline const char* cfg_env() { return "TORCHOPS_DEV_DECODE_CFG"; }

}  // namespace torchops::cuda::gemm::dev
