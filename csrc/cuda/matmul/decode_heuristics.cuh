// The decode path's heuristics (cuda/matmul/decode.cuh): the automatic
// kernel shape K0 and make_plan, which checks a problem and picks its
// column slices, split-K count and split-K flavour.  Kept apart from the
// kernels, as the tuning harness (scripts/matmul_dev) passes its own
// Choice.  Included by decode.cuh, after its kernels and Plan.
#pragma once

namespace torchops::cuda::gemm {
namespace decode_detail {

// The automatic shape.  Tensor-core kernels: 8 warps, 4 loads in flight,
// nc loads with an L2 evict-first policy, the fastest of the harness's
// candidates on the 16-bit decode rows (16 warps with 2 loads in flight tie
// or trail it).  float32: UF 2 (those kernels read only UF and LD); UF 4
// is slower.  A k-contiguous B (nn.Linear's weight) takes 16 columns a CTA
// (BKT 2), not 32: twice the column slices means half the split-K, and
// where that leaves two splits they are one cluster with no second kernel,
// which wins most where N is small (N = 1024..1536).
using K0 = KCfg<8, 2, 1, 4, 4, 2, 3, 1>;

// What a call may vary: the kernel shape, the split policy (0 automatic,
// else that many splits, clamped as the automatic count is), the one-kernel
// split-K (the last CTA of a slice sums, through tickets) and cluster
// split-K.  The library runs kAutomatic; a tuning harness passes others.
struct Choice {
  Geom ge;
  int split = 0;
  bool one = false;
  bool cluster = true;
};
constexpr Choice kAutomatic{geom_of<K0>()};

// What decode_supports checks, and the launch shape (a pure function of the
// problem, the device and the config, so the split and the summation order
// are fixed).
inline Plan make_plan(const GemmArgs& g, const Choice& ch = kAutomatic) {
  Plan pl;
  const int split_policy = ch.split;
  const bool one = ch.one;
  const Geom& ge = ch.ge;
  if (g.dtype == DType::f64) return pl;
  if (g.m < 1 || g.m > kMaxM || g.n < 1 || g.k < 1 || g.batch < 1) return pl;
  if (g.n > 0x7fffff00 || g.k > 0x7fffff00) return pl;
  const bool half = g.dtype != DType::f32;
  const int64_t v = half ? 8 : 4;  // elements per 16 bytes
  // Vectors along k never straddle the end of k (or of a split).
  if (g.k % v != 0) return pl;
  if (half && device_cc_major() < 8) return pl;
  // A: k contiguous; every row and batch start 16-byte aligned.
  if (g.a.col_stride != 1 || !aligned16(g.a.ptr)) return pl;
  if (g.m > 1 && g.a.row_stride % v != 0) return pl;
  if (g.batch > 1 && g.a.batch_stride % v != 0) return pl;
  if (!aligned16(g.b.ptr) || (g.batch > 1 && g.b.batch_stride % v != 0)) return pl;
  const bool bk = g.b.row_stride == 1 && (g.n == 1 || g.b.col_stride % v == 0);
  const bool bn = g.b.col_stride == 1 && g.n % v == 0 && (g.k == 1 || g.b.row_stride % v == 0);
  int cols, warps, kstep;  // kstep: k per warp step; warps: over one column slice
  if (bk) {
    pl.kind = half ? Kind::mma_bk : Kind::f32_bk;
    cols = half ? 8 * ge.bkt : kF32BkCols;
    warps = half ? ge.nw : kF32BkWarps;
    kstep = half ? 32 * ge.uk : 128 * ge.uf;
  } else if (bn) {
    pl.kind = half ? Kind::mma_bn : Kind::f32_bn;
    cols = half ? 64 * ge.bng : kF32BnCols;
    warps = half ? ge.nw / ge.bng : kF32BnWarps;
    kstep = half ? 16 * ge.un : 4 * ge.uf;
  } else {
    return pl;
  }
  pl.col_ctas = (g.n + cols - 1) / cols;
  if (pl.col_ctas > 0x7fffffff) { pl.kind = Kind::none; return pl; }
  // Split K only while column slices x batch leave SMs idle, and never
  // below one step per warp per split.
  const int64_t ctas = pl.col_ctas * (g.batch < kMaxGridZ ? g.batch : kMaxGridZ);
  const int64_t want = (int64_t(device_sms()) * 9 + 9) / 10 * (half ? ge.minb : 1);
  int64_t s = split_policy > 0 ? split_policy : (want + ctas - 1) / ctas;
  const int64_t smax = g.k / (int64_t(warps) * kstep);
  if (s > smax) s = smax;
  if (s < 1) s = 1;
  int64_t kps = (g.k + s - 1) / s;
  kps = (kps + 63) / 64 * 64;
  s = (g.k + kps - 1) / kps;
  pl.splits = static_cast<int>(s);
  pl.kps = static_cast<int>(kps);
  // One kernel: one batch entry per CTA and a ticket per CTA column.
  pl.one_kernel = one && s > 1 && g.batch <= kMaxGridZ && ctas <= kTickets;
  // Hopper, two splits: each pair of splits of a column slice as one
  // cluster, summed through distributed shared memory in split order: one
  // kernel, no workspace, no tickets, the same bits.  It saves the reduce
  // kernel's launch and the partials' round trip through memory.  Clusters
  // of 4 and 8 are slower: they do not all fit on the GPU at once.
  pl.cluster = !pl.one_kernel && s == kClusterSplits && device_cc_major() >= 9 && ch.cluster;
  return pl;
}

}  // namespace decode_detail
}  // namespace torchops::cuda::gemm
