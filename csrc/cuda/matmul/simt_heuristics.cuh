// The simt path's heuristics (cuda/matmul/simt.cuh): its automatic tiles,
// the choice between the big and small float tiles and simt90.cuh's
// kernel, and the split-K count.  Kept apart from the kernels, as the
// tuning harness (scripts/matmul_dev) pins them (Pins).  Included by
// simt.cuh, after its kernels.
#pragma once

namespace torchops::cuda::gemm {
namespace simt_detail {

// The automatic choices, the fastest of the harness's candidates
// (scripts/matmul_dev --cfgs simt:all):
//   float: 128x128x16, 8x8 per thread, one block per SM with up to 255
//     registers (ahead of 128x128x8 at 2 blocks/SM and of 8x16 or 16x8 per
//     thread at 128 threads); problems that fill GPU waves badly with those
//     tiles take 128x64x8 with 128 threads, 3 blocks/SM (see
//     use_small_f32_tiles);
//   double: 128x64x8, 8x8 per thread, 128 threads (ahead of 64x64x16 4x4).
using CfgF32 = TileCfg<128, 128, 16, 8, 8, 1>;
using CfgF32Small = TileCfg<128, 64, 8, 8, 8, 3>;
using CfgF64 = TileCfg<128, 64, 8, 8, 8, 2>;

// Choices a tuning harness pins (scripts/matmul_dev); the library leaves
// them automatic.  simt90: 1 takes simt90.cuh's kernel where simt.cuh would
// take its big float tile, 0 never, 2 wherever it can run (and a tensor map
// it cannot encode is then an error, not a fallback).  splits: with
// pin_splits, that many k splits (at most one per BK of k; below 2 none).
struct Pins {
  int simt90 = 1;
  bool pin_splits = false;
  int64_t splits = 0;
};

// Split-K where the output's blocks fill at most half of the GPU's block
// slots (C::MIN_BLOCKS per SM) and K is long: as many splits as fill the
// slots, each at least 64 k (128 for double), at most kMaxSplits.  Returns k
// per split (a multiple of BK; g.k: no split).  Filling the idle slots
// more than pays for the partials' round trip on small-M x N problems with a
// long K (512^3, 768x768x8192, 256x256x16384).
template <typename C>
int64_t split_kps(const GemmArgs& g, int64_t min_k, const Pins& pins) {
  const int64_t blocks = g.batch * ((g.m + C::BM - 1) / C::BM) * ((g.n + C::BN - 1) / C::BN);
  const int64_t slots = int64_t(device_sms()) * C::MIN_BLOCKS;
  const int64_t kt = (g.k + C::BK - 1) / C::BK;
  const int64_t min_tiles = (min_k + C::BK - 1) / C::BK;
  int64_t s = std::min<int64_t>({slots / std::max<int64_t>(blocks, 1), kt / min_tiles, kMaxSplits});
  if (pins.pin_splits) s = std::min<int64_t>(pins.splits, kt);
  return s < 2 ? g.k : (kt + s - 1) / s * C::BK;
}

// The float tile for a problem of `big` CfgF32 tiles (one block per SM) or
// `small` CfgF32Small tiles (three per SM): the small tile when the big ones
// leave over a quarter of a single wave's SMs idle, or need a second, mostly
// idle wave where the small ones fit in one.  The big tile is faster per
// output, so it wins wherever its waves are nearly full (2048^3,
// 1280x2560x1024, 2048x1024x4096); the small one where the big tiles leave
// a wave a quarter empty or more (1000x3000x768, 1664^2x1024, 1024^3).
inline bool use_small_f32_tiles(int64_t big, int64_t small, int sms) {
  return 4 * big < 3 * int64_t(sms) || (big > sms && small <= 3 * int64_t(sms));
}

// The kernel a problem takes.
enum class Tile { f32_tma, f32_big, f32_small, f64, half };

inline Tile pick_tile(const GemmArgs& g, const Pins& pins) {
  switch (g.dtype) {
    case DType::f32: {
      const int sms = device_sms();
      const int64_t rows = g.batch * ((g.m + CfgF32::BM - 1) / CfgF32::BM);
      const int64_t big = rows * ((g.n + CfgF32::BN - 1) / CfgF32::BN);
      const int64_t small = rows * ((g.n + CfgF32Small::BN - 1) / CfgF32Small::BN);
      const bool small_tiles = use_small_f32_tiles(big, small, sms);
      const int mode = pins.simt90;
      if ((mode == 2 || (mode == 1 && !small_tiles)) && simt90_supports(g)) return Tile::f32_tma;
      return small_tiles ? Tile::f32_small : Tile::f32_big;
    }
    case DType::f64: return Tile::f64;
    default: return Tile::half;
  }
}

// k per split of that kernel (g.k: not split).  The big float tile is taken
// only where its tiles nearly fill a wave (use_small_f32_tiles), and the
// half-precision fallback, rare, is not split either: neither compiles
// split kernels.
inline int64_t plan_kps(const GemmArgs& g, Tile t, const Pins& pins) {
  switch (t) {
    case Tile::f32_small: return split_kps<CfgF32Small>(g, 64, pins);
    case Tile::f64: return split_kps<CfgF64>(g, 128, pins);
    default: return g.k;
  }
}

}  // namespace simt_detail
}  // namespace torchops::cuda::gemm
