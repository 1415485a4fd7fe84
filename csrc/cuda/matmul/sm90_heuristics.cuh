// The sm90 path's heuristics (cuda/matmul/sm90.cuh): the tile shape (a
// wave cost model over the tiles' relative speeds), the split-K count (a
// cost model of the time a split saves against its partials' traffic) and
// the epilogue.  Kept apart from the kernels, as the tuning harness
// (scripts/matmul_dev) pins them.  Included by sm90.cuh, after Layout.
#pragma once

namespace torchops::cuda::gemm {
namespace sm90_detail {

// Tile speeds relative to 128x256 (a full wave of each): the narrower and
// shorter tiles reuse each loaded A and B value over fewer outputs.
constexpr double kSpeed192 = 0.96, kSpeed128 = 0.92;
// Each speed is the tile's, pinned in the harness (TORCHOPS_DEV_SM90), over
// 128x256's on large problems (4096^3, 8192x1024x8192).
// 64x128 tiles (16-bit only; the consumers split the columns).  64x256
// tiles never beat 128x128 (the same outputs per tile, at most its speed),
// so they are not built.
constexpr double kSpeed64x128 = 0.72;
// 64x64 tiles (16-bit; the consumers split each stage's k).
constexpr double kSpeed64x64 = 0.46;
// 64x32 tiles (16-bit, K-major B; k split like 64x64).
constexpr double kSpeed64x32 = 0.28;

struct TileShape {
  int tm, bn;
};

// Which tile: the one whose busiest CTA has the least work (whole waves of
// tiles of tm x bn outputs, each at its speed).  192 (16-bit only) fills
// one wave where 256 leaves SMs idle and 128 needs two (1000x3000x768: 128
// tiles of 128x192 on 132 SMs); 64-row tiles where the 128-row ones leave
// most SMs idle (bf16 1024^3: 64 tiles of 128x128, 128 of 64x128); 64x64
// for a few dozen rows against a large B (128x4096x4096: 128 tiles).
// narrow: the k-split tiles (64x64, and 64x32 where B is K-major).
inline TileShape pick_tile(const GemmArgs& g, const Layout& l, bool narrow = true) {
  const int sms = device_sms();
  auto cost = [&](int tm, int bn, double speed) {
    const int64_t tiles = g.batch * ((g.m + tm - 1) / tm) * ((g.n + bn - 1) / bn);
    const int64_t waves = (tiles + sms - 1) / sms;
    return static_cast<double>(waves) * tm * bn / speed;  // time ~ waves x tile work
  };
  TileShape best{kBM, 256};
  double best_cost = cost(kBM, 256, 1.0);
  const bool half = g.dtype != DType::f32;
  const struct { int tm, bn; double speed; } options[] = {
      {kBM, 192, kSpeed192}, {kBM, 128, kSpeed128}, {64, 128, kSpeed64x128},
      {64, 64, kSpeed64x64}, {64, 32, kSpeed64x32}};
  for (const auto& o : options) {
    if (((o.bn == 192 || o.tm == 64) && !half) || (o.bn <= 64 && !narrow) ||
        (o.bn == 32 && l.b_n_major)) {
      continue;
    }
    const double c = cost(o.tm, o.bn, o.speed);
    if (c < best_cost) {
      best = {o.tm, o.bn};
      best_cost = c;
    }
  }
  return best;
}

struct Choice {
  int bn;
  bool tma_store;
  int splits = 1, split_kb = 0;  // split-K: splits x split_kb k blocks
  int tm = kBM;                  // tile rows (64: 16-bit only)
};

// Choices a tuning harness pins (scripts/matmul_dev); the library leaves
// them automatic.  splits: with pin_splits, that many k splits (at most one
// per k block; below 2 none).  tile: where set, may replace the automatic
// tile and epilogue (returns true and writes them) for a problem it can
// take.
struct Pins {
  bool pin_splits = false;
  int64_t splits = 0;
  bool (*tile)(const GemmArgs& g, const Layout& l, TileShape& t, bool& store) = nullptr;
};

// Split K where the tiles leave SMs idle (small M x N with a long K: weight
// gradients, masked_conv2d's GEMM, a few dozen rows against a weight) and
// the time a split saves outweighs what its fp32 partials cost.  At most
// one wave of (tile, split) units, each at least kMinSplitKb k blocks, at
// most kMaxSplits.  Cost model (bf16 kernel times behind a dirty L2): a
// 128 x BN tile's k block takes kUsPerKb128 us x BN / 128 (TF32's 32 k the
// same), and each MB of partials kUsPerPartialMb us (written by the GEMM,
// read by sum_splits).  So s maximises kb t_kb (1 - 1/s) - 2 s MB, if
// positive: splitting as far as a wave fills would lose on square problems
// (1024^3, 512^3) whose partials cost more than the idle SMs, while a few
// rows against a large weight still split.  The partials are summed in
// split order by a second kernel: deterministic.
constexpr int kMinSplitKb = 8;
constexpr double kUsPerKb128 = 0.45, kUsPerPartialMb = 2.0;

// K in blocks of one 128-byte stage row.
inline int64_t k_blocks(const GemmArgs& g) {
  const int64_t per_kb = kRowBytes / dtype_bytes(g.dtype);
  return (g.k + per_kb - 1) / per_kb;
}

inline void pick_splits(const GemmArgs& g, Choice& c, const Pins& pins) {
  const int sms = device_sms();
  const int64_t tiles = g.batch * ((g.m + c.tm - 1) / c.tm) * ((g.n + c.bn - 1) / c.bn);
  const int64_t kb = k_blocks(g);
  const int64_t most = std::min<int64_t>({tiles > 0 ? sms / tiles : 0, kb / kMinSplitKb, kMaxSplits});
  const double unsplit_us = double(kb) * kUsPerKb128 * c.bn / 128 * c.tm / kBM;
  const double partial_mb = double(g.batch) * g.m * g.n * 4 / 1e6;
  int64_t s = 1;
  double best = 0;
  for (int64_t t = 2; t <= most; ++t) {
    const double net = unsplit_us * (1 - 1.0 / t) - kUsPerPartialMb * t * partial_mb;
    if (net > best) {
      best = net;
      s = t;
    }
  }
  if (pins.pin_splits) s = std::min<int64_t>(pins.splits, kb);
  if (s < 2) return;
  c.split_kb = static_cast<int>((kb + s - 1) / s);
  c.splits = static_cast<int>((kb + c.split_kb - 1) / c.split_kb);
  c.tma_store = false;  // partials go straight to the workspace
}

inline Choice choose(const GemmArgs& g, const Layout& l, const Pins& pins) {
  TileShape t = pick_tile(g, l);
  bool store = g.n % 8 == 0, pinned = false;
  if (pins.tile != nullptr && pins.tile(g, l, t, store)) pinned = true;
  Choice c{t.bn, store && t.bn != 32};  // 64x32: the direct epilogue only
  c.tm = t.tm;
  // The 64x64 and 64x32 tiles are themselves splits (their consumers halve
  // each stage's k and sum on chip), so they never split K again.  Where K
  // is long (at least 32 k blocks) and the model would split them, or A
  // fills at most half of their 64 rows, the wider 64x128 tile split K-wise
  // does better (17-56 rows against a 4096-deep weight); with 48-64 rows,
  // or where K is short, the narrow tiles unsplit stay ahead.
  if (!pinned && c.tm == 64 && c.bn <= 64) {
    Choice split = c;
    pick_splits(g, split, pins);
    if (k_blocks(g) >= 32 && (split.splits > 1 || g.m <= 32)) {
      t = pick_tile(g, l, /*narrow=*/false);
      c = Choice{t.bn, store};
      c.tm = t.tm;
      pick_splits(g, c, pins);
    }
    return c;
  }
  pick_splits(g, c, pins);
  return c;
}

}  // namespace sm90_detail
}  // namespace torchops::cuda::gemm
