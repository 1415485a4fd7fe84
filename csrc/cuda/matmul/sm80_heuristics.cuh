// The sm80 path's heuristics (cuda/matmul/sm80.cuh): its three tile configs
// and the cost model that picks one for a problem.  Kept apart from the
// kernels: the tuning harness (scripts/matmul_dev) tries other configs
// against these.
// Included by sm80.cuh, after its kernels.
#pragma once

namespace torchops::cuda::gemm {
namespace sm80_detail {

// 128x256x64, 3 stages (144 KB): the big-problem tile (warp 64x64: 16 mma
// per 8 ldmatrix.x4; 64-deep stages halve the barriers per k): the fastest
// of the harness's candidates (scripts/matmul_dev --sm80-cfgs), 32-deep
// stages with 4 of them included.  Sixteen warps of 64x32 (four a
// scheduler, 128 registers) would spill ~100 loads a k-tile.  GPUs
// with less than 144 KB of shared memory per block (sm_86, sm_89) use the
// mid tile.
using CfgBig = TileCfg<128, 256, 64, 2, 4, 3, 1>;
// 128x128x64, 3 stages, 4 warps of 64x64, 96 KB: two blocks per SM on Hopper.
using CfgMid = TileCfg<128, 128, 64, 2, 2, 3, 2>;
// 64x64: small or batched-small problems (one block per 64x64 of C).
using CfgSmall = TileCfg<64, 64, 32, 2, 2, 4, 3>;

template <class Cfg>
inline int64_t tiles_of(const GemmArgs& g) {
  return ((g.m + Cfg::BM - 1) / Cfg::BM) * ((g.n + Cfg::BN - 1) / Cfg::BN);
}

// Picks the tile with the least estimated time: waves of tiles over the
// resident block slots, each wave costing the tile's area over its relative
// per-SM throughput (bigger tiles: fewer shared-memory bytes per mma).
// Returns an index of dispatch_cfg's table (0 big, 1 mid, 2 small).
inline int choose_cfg(const GemmArgs& g, int sms, bool big_fits) {
  const int64_t area[3] = {int64_t(CfgBig::BM) * CfgBig::BN,
                           int64_t(CfgMid::BM) * CfgMid::BN,
                           int64_t(CfgSmall::BM) * CfgSmall::BN};
  const int64_t tiles[3] = {tiles_of<CfgBig>(g) * g.batch,
                            tiles_of<CfgMid>(g) * g.batch,
                            tiles_of<CfgSmall>(g) * g.batch};
  const int per_sm[3] = {CfgBig::MIN_BLOCKS, CfgMid::MIN_BLOCKS,
                         CfgSmall::MIN_BLOCKS};
  const double eff[3] = {1.0, 0.94, 0.5};  // relative speeds at bf16 4096^3 (harness)
  int best = 0;
  double best_cost = 0;
  for (int i = 0; i < 3; ++i) {
    const int64_t slots = int64_t(sms) * per_sm[i];
    const int64_t waves = (tiles[i] + slots - 1) / slots;
    const double cost = double(waves) * double(area[i]) * per_sm[i] / eff[i];
    if (i == 0 && !big_fits) continue;
    if (i == 0 || (best == 0 && !big_fits && i == 1) || cost < best_cost * 0.97) {
      best = i;
      best_cost = cost;
    }
  }
  return best;
}

}  // namespace sm80_detail
}  // namespace torchops::cuda::gemm
