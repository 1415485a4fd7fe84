// CPU kernel of torchops.matmul: a packed, cache-blocked (BLIS-style) GEMM,
// parallel over parts of the output, one per thread, or for one large
// matrix on many threads over C tiles with every block packed once.
//
// Inputs are first converted to the accumulation type (float for
// float/half/bfloat16, double for double), keeping a row- or column-major
// layout (a transposed view is read in place; other strides are made
// contiguous), so one micro-kernel per accumulation type serves every input
// dtype and stride pattern; the output is rounded to the input dtype once,
// at the end.  Up to 8 rows of A (16 against a column-major B) skip the
// packing: few-row kernels stream B instead; up to 24 rows read a row-major
// B in place (read_b_direct).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <thread>
#include <type_traits>
#include <vector>

#include "common/env.h"
#include "common/matmul.h"
#include "cpu/common/cache_sizes.h"
#include "cpu/common/parallel.h"

namespace torchops::cpu {
namespace {

// BLIS-style GEMM (Goto's algorithm): C = A @ B for row-major, contiguous
// A (M x K) and B (K x N) in the accumulation type.
//
// B is packed a (kc x nc) block at a time into panels of NR columns, A a
// (mc x kc) block at a time into panels of kMr rows (sizes: Blocks), so the
// micro-kernel streams both from contiguous memory: each step loads two
// vectors of a B panel row, broadcasts kMr values of the A panel, and does
// 2 * kMr fused multiply-adds into a kMr x kNr register tile of C.  The
// kernels are written once with GCC vector extensions of W bytes and
// compiled per ISA: 64-byte vectors for AVX-512 where the CPU has it
// (checked at run time), else 32-byte vectors by function multi-versioning
// (AVX2+FMA where present, SSE2 otherwise).  Never -march=native: the
// library must run on any x86-64.
template <typename T, int W>
struct Gemm {
  typedef T Vec __attribute__((vector_size(W)));
};

// Rows of the register tile: 2 * rows accumulators plus the two B vectors
// and a broadcast must fit the vector registers (16 for AVX2, 32 for
// AVX-512).
template <int W>
constexpr int64_t tile_rows() {
  return W == 64 ? 12 : 6;
}

template <typename T, int W>
constexpr int64_t lanes() {
  return W / static_cast<int64_t>(sizeof(T));
}

template <typename T, int W>
constexpr int64_t nr() {
  return 2 * lanes<T, W>();  // columns of the register tile: two vectors
}

// Block limits, from this machine's caches once per process: the analytical
// model of BLIS (Low et al., "Analytical modeling is enough for
// high-performance BLIS") with this code's loop order, where A's micro-panel
// is the one reused from L1.  Each block gets about half its cache; the rest
// holds what streams past it.
//   kc: the A micro-panel (kMr x kc), reused by every B micro-panel, in L1d;
//       at most 2 KB deep (512 floats, 256 doubles): C's load and store per
//       depth block is amortised by then, and a longer kc only shrinks nc
//       (the 6x16 tile with a 48 KB L1d is slower at 4 KB).
//   nc: the B block (kc x nc), reused by every A micro-panel, in 15/32 of L2
//       (a bit under half: A's micro-panels and C pass through L2 too).
//   mc: the A block (mc x kc), reused by every B block, in this core's share
//       of L3; at most 2040 rows, past which B's packing (once per mc rows)
//       costs nothing measurable.
// Target (48 KB L1d, 2 MB L2, AVX-512): 512 x 480 x 2040 floats.  The sizes
// used are balanced (ceil(extent / blocks), rounded to whole tiles), so no
// block is a sliver.
struct Blocks {
  int64_t kc, nc, mc;
};

// bytes / per, rounded down to a multiple of q, in [lo, hi] (multiples of q).
inline int64_t fit(int64_t bytes, int64_t per, int64_t q, int64_t lo,
                   int64_t hi) {
  return std::clamp(bytes / per / q * q, lo, hi);
}

template <typename T, int W>
const Blocks& blocks() {
  static const Blocks b = [] {
    const CacheSizes& c = cpu_cache_sizes();
    constexpr int64_t S = sizeof(T), kMr = tile_rows<W>(), NR = nr<T, W>();
    const int64_t kc = fit(c.l1d / 2, kMr * S, 16, 64, 2048 / S);
    return Blocks{kc, fit(c.l2 * 15 / 32, kc * S, NR, 64, 4096),
                  fit(c.l3 / 2, kc * S, kMr, 96, 2040)};
  }();
  return b;
}

// c[r * ldc + j] (+)= tile for r < mr, j < ncols (a partial tile at the
// edges); `first` (the first depth block) stores without reading C, so C
// needs no zeroing and is never read when K fits one block.  Only the
// first R rows of the kMr-row A panel and the first NV of the B panel's two
// vectors are multiplied (R >= mr, NV * L >= ncols): the last tiles of a
// short M or N skip their padding (micro_tile, macro_kernel).  kDirectA: ap
// is A itself (rows lda apart), not a packed panel (see gemm_part).  B's
// rows are bs apart: 2 * L in a packed panel; kDirectB: B itself (ldb), whose
// rows, a page or more apart, the hardware prefetcher does not follow, so
// they are prefetched kPrefetchK rows ahead.
constexpr int64_t kPrefetchK = 24;

template <typename T, int W, int64_t R, bool kDirectA, int64_t NV, bool kDirectB = false>
inline __attribute__((always_inline)) void micro_kernel(
    int64_t kc, const T* __restrict__ ap, int64_t lda, const T* __restrict__ bp, int64_t bs,
    T* __restrict__ c, int64_t ldc, int64_t mr, int64_t ncols, bool first) {
  using Vec = typename Gemm<T, W>::Vec;
  constexpr int64_t L = lanes<T, W>();
  constexpr int64_t kMr = tile_rows<W>();
  if (!first) {
    // C is read only after kc steps: fetch it into L2 meanwhile (not L1,
    // where the A and B panels live).
    for (int64_t r = 0; r < mr; ++r) {
      __builtin_prefetch(c + r * ldc, 0, 2);
      __builtin_prefetch(c + r * ldc + NV * L - 1, 0, 2);
    }
  }
  Vec acc[R][NV];
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t v = 0; v < NV; ++v) {
      acc[r][v] = Vec{};
    }
  }
  for (int64_t p = 0; p < kc; ++p) {
    if constexpr (kDirectB) {
      // Past B's last row near the end: prefetches never fault.
      __builtin_prefetch(bp + (p + kPrefetchK) * bs, 0, 3);
      __builtin_prefetch(bp + (p + kPrefetchK) * bs + NV * L - 1, 0, 3);
    }
    Vec bv[NV];
    for (int64_t v = 0; v < NV; ++v) {
      __builtin_memcpy(&bv[v], bp + p * bs + v * L, sizeof(Vec));
    }
    for (int64_t r = 0; r < R; ++r) {
      const T ar = kDirectA ? ap[r * lda + p] : ap[p * kMr + r];
      for (int64_t v = 0; v < NV; ++v) {
        acc[r][v] += ar * bv[v];
      }
    }
  }
  if (mr == R && ncols == NV * L) {
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t v = 0; v < NV; ++v) {
        Vec cv = acc[r][v];
        if (!first) {
          Vec old;
          __builtin_memcpy(&old, c + r * ldc + v * L, sizeof(Vec));
          cv += old;
        }
        __builtin_memcpy(c + r * ldc + v * L, &cv, sizeof(Vec));
      }
    }
    return;
  }
  T tile[R][NV * L];
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t v = 0; v < NV; ++v) {
      __builtin_memcpy(&tile[r][v * L], &acc[r][v], sizeof(Vec));
    }
  }
  for (int64_t r = 0; r < mr; ++r) {
    for (int64_t j = 0; j < ncols; ++j) {
      c[r * ldc + j] = first ? tile[r][j] : c[r * ldc + j] + tile[r][j];
    }
  }
}

// One register tile: one vector of columns where the tile has at most L
// (100 columns as 32 + 32 + 32 + 32 spent a fifth of the FMAs on padding),
// and a whole column panel of a B read in place (bd: its panel, rows ldb
// apart) by the direct-B kernel; bp: the packed panel otherwise.
template <typename T, int W, int64_t R, bool kDirectA = false>
inline __attribute__((always_inline)) void micro_tile(
    int64_t kc, const T* __restrict__ ap, int64_t lda, const T* __restrict__ bp,
    const T* __restrict__ bd, int64_t ldb, T* __restrict__ c, int64_t ldc, int64_t mr,
    int64_t ncols, bool first) {
  constexpr int64_t NR = nr<T, W>();  // a packed panel's row
  if (bd != nullptr && ncols == NR) {
    micro_kernel<T, W, R, kDirectA, 2, true>(kc, ap, lda, bd, ldb, c, ldc, mr, ncols, first);
  } else if (ncols > lanes<T, W>()) {
    micro_kernel<T, W, R, kDirectA, 2>(kc, ap, lda, bp, NR, c, ldc, mr, ncols, first);
  } else {
    micro_kernel<T, W, R, kDirectA, 1>(kc, ap, lda, bp, NR, c, ldc, mr, ncols, first);
  }
}

// One A block against one packed B block.  Row panels outside, column
// panels inside: the A micro-panel (kMr x kc) stays in L1 while the B
// micro-panels stream from L2, and C is walked along its rows.  With
// a_direct (rows lda apart), whole row panels are read from A itself and
// only a last partial one from apack (see gemm_part); with b_direct (a
// row-major B, rows ldb apart), whole column panels are read from B itself
// and only a last partial one from bpack.
template <typename T, int W>
inline __attribute__((always_inline)) void macro_kernel(
    int64_t mc, int64_t nc, int64_t kc, const T* __restrict__ apack,
    const T* __restrict__ bpack, T* __restrict__ c, int64_t ldc, bool first,
    const T* __restrict__ a_direct = nullptr, int64_t lda = 0,
    const T* __restrict__ b_direct = nullptr, int64_t ldb = 0) {
  constexpr int64_t NR = nr<T, W>();
  constexpr int64_t kMr = tile_rows<W>();
  // A last panel of fewer rows multiplies a third, two thirds or all of
  // the tile's rows: 16 rows as 12 + 12 spent a third of the FMAs on padding.
  constexpr int64_t kPart = kMr / 3;
  for (int64_t i = 0; i < mc; i += kMr) {
    const T* ap = apack + i * kc;
    const int64_t mr = std::min(kMr, mc - i);
    for (int64_t j = 0; j < nc; j += NR) {
      const int64_t ncols = std::min(NR, nc - j);
      const T* bp = bpack + j * kc;
      const T* bd = b_direct != nullptr ? b_direct + j : nullptr;
      T* cij = c + i * ldc + j;
      if (mr == kMr && a_direct != nullptr) {
        micro_tile<T, W, kMr, true>(kc, a_direct + i * lda, lda, bp, bd, ldb, cij, ldc, mr,
                                    ncols, first);
      } else if (mr > 2 * kPart) {
        micro_tile<T, W, kMr>(kc, ap, 0, bp, bd, ldb, cij, ldc, mr, ncols, first);
      } else if (mr > kPart) {
        micro_tile<T, W, 2 * kPart>(kc, ap, 0, bp, bd, ldb, cij, ldc, mr, ncols, first);
      } else {
        micro_tile<T, W, kPart>(kc, ap, 0, bp, bd, ldb, cij, ldc, mr, ncols, first);
      }
    }
  }
}

// a[0 .. mc, 0 .. kc] (element (r, p) at a[r * rs + p * cs], row-major
// (cs == 1) or column-major (rs == 1)) into panels of kMr rows, k-major
// inside a panel; rows past mc are zero.  A column-major A (a transposed
// view, as autograd's B^T-side products make) is the cheap case: a panel's
// kMr values of each k are contiguous.
template <typename T, int W>
inline __attribute__((always_inline)) void pack_a(
    const T* __restrict__ a, int64_t rs, int64_t cs, int64_t mc, int64_t kc,
    T* __restrict__ out) {
  constexpr int64_t kMr = tile_rows<W>();
  for (int64_t i = 0; i < mc; i += kMr) {
    T* panel = out + i * kc;
    const T* src = a + i * rs;
    const int64_t rows = std::min(kMr, mc - i);
    if (cs != 1) {
      for (int64_t p = 0; p < kc; ++p) {
        for (int64_t r = 0; r < kMr; ++r) {
          panel[p * kMr + r] = r < rows ? src[p * cs + r] : T(0);
        }
      }
    } else if (rows == kMr) {
      for (int64_t p = 0; p < kc; ++p) {
        for (int64_t r = 0; r < kMr; ++r) {
          panel[p * kMr + r] = src[r * rs + p];
        }
      }
    } else {
      for (int64_t p = 0; p < kc; ++p) {
        for (int64_t r = 0; r < kMr; ++r) {
          panel[p * kMr + r] = r < rows ? src[r * rs + p] : T(0);
        }
      }
    }
  }
}

// v[i][q] <- v[q][i] for an L x L tile of L-lane vectors: log2(L) rounds of
// interleaving vector i with vector i + L/2 (the perfect-shuffle transpose),
// each a two-source shuffle.  GCC's __builtin_shuffle; other compilers pack
// element by element.
#if defined(__GNUC__) && !defined(__clang__)
#define TORCHOPS_VEC_TRANSPOSE 1
template <typename T, int W>
inline __attribute__((always_inline)) void transpose_tile(
    typename Gemm<T, W>::Vec (&v)[lanes<T, W>()]) {
  using Vec = typename Gemm<T, W>::Vec;
  constexpr int64_t L = lanes<T, W>();
  using Idx = std::conditional_t<sizeof(T) == 4, int32_t, int64_t>;
  typedef Idx Mask __attribute__((vector_size(W)));
  Mask lo, hi;
  for (int64_t i = 0; i < L / 2; ++i) {
    lo[2 * i] = static_cast<Idx>(i);
    lo[2 * i + 1] = static_cast<Idx>(L + i);
    hi[2 * i] = static_cast<Idx>(L / 2 + i);
    hi[2 * i + 1] = static_cast<Idx>(L + L / 2 + i);
  }
  for (int64_t round = 1; round < L; round *= 2) {
    Vec t[L];
    for (int64_t i = 0; i < L / 2; ++i) {
      t[2 * i] = __builtin_shuffle(v[i], v[i + L / 2], lo);
      t[2 * i + 1] = __builtin_shuffle(v[i], v[i + L / 2], hi);
    }
    for (int64_t i = 0; i < L; ++i) {
      v[i] = t[i];
    }
  }
}
#else
#define TORCHOPS_VEC_TRANSPOSE 0
#endif

// b[0 .. kc, 0 .. nc] (element (p, j) at b[p * rs + j * cs], row-major
// (cs == 1) or column-major (rs == 1)) into panels of NR columns, each a
// row-major array of NR-wide rows; panel j starts j * stride elements after
// panel 0 (stride: the whole block's depth, so a block's rows may be packed
// in several calls); columns past nc are zero.  A row-major B is read row by
// row, as whole rows: panel by panel would read NR columns at a stride of
// ldb, which the hardware prefetcher does not follow across pages.  A
// column-major B (W^T of a linear layer) is read column by column, kBk of
// its k at a time, so the kBk x NR piece of the panel being written stays
// in L1.
template <typename T, int W>
inline __attribute__((always_inline)) void pack_b(
    const T* __restrict__ b, int64_t rs, int64_t cs, int64_t kc, int64_t nc,
    T* __restrict__ out, int64_t stride) {
  using Vec = typename Gemm<T, W>::Vec;
  constexpr int64_t L = lanes<T, W>();
  constexpr int64_t NR = nr<T, W>();
  const int64_t full = nc / NR * NR;
  if (cs != 1) {
    constexpr int64_t kBk = 16;
    for (int64_t j = 0; j < nc; j += NR) {
      T* panel = out + j * stride;
      const int64_t cols = std::min(NR, nc - j);
      int64_t p = 0;
#if TORCHOPS_VEC_TRANSPOSE
      // Whole panels, L k at a time: L columns' next L values (a vector
      // each) transposed in registers into L rows of the panel.
      if (cols == NR) {
        for (; p + L <= kc; p += L) {
          for (int64_t h = 0; h < NR; h += L) {
            Vec v[L];
            for (int64_t q = 0; q < L; ++q) {
              __builtin_memcpy(&v[q], b + (j + h + q) * cs + p, sizeof(Vec));
            }
            transpose_tile<T, W>(v);
            for (int64_t i = 0; i < L; ++i) {
              __builtin_memcpy(panel + (p + i) * NR + h, &v[i], sizeof(Vec));
            }
          }
        }
      }
#endif
      for (int64_t p0 = p; p0 < kc; p0 += kBk) {
        const int64_t p1 = std::min(kc, p0 + kBk);
        for (int64_t q = 0; q < NR; ++q) {
          for (int64_t t = p0; t < p1; ++t) {
            panel[t * NR + q] = q < cols ? b[(j + q) * cs + t] : T(0);
          }
        }
      }
    }
    return;
  }
  for (int64_t p = 0; p < kc; ++p) {
    const T* row = b + p * rs;
    T* dst = out + p * NR;
    for (int64_t j = 0; j < full; j += NR) {
      Vec v0, v1;
      __builtin_memcpy(&v0, row + j, sizeof(Vec));
      __builtin_memcpy(&v1, row + j + L, sizeof(Vec));
      __builtin_memcpy(dst + j * stride, &v0, sizeof(Vec));
      __builtin_memcpy(dst + j * stride + L, &v1, sizeof(Vec));
    }
    if (full < nc) {
      T* tail = dst + full * stride;
      for (int64_t j = 0; j < NR; ++j) {
        tail[j] = full + j < nc ? row[full + j] : T(0);
      }
    }
  }
}

// Whether the micro-kernel reads A's rows where they are instead of a
// packed copy: the copy (a transposition) is a sizeable share of the time
// from 512^3 down to 100^3, while the kMr rows a micro-kernel reads stay
// in L1 as long as they fall in different cache sets -- which rows a
// multiple of 4 KB apart do not (all in one set of a 12-way L1d), so those
// are packed, unless C has at most kDirectAMaxCols columns (few_cols): then
// few column panels share each packed A panel and the copy is not paid
// back: reading in place wins clearly at 4096 x 4096 x 64, 1024 x 1024 x
// 256 and 256^3 with rows 4 KB apart, and ties on wider C (1024^3, 2048^3).
constexpr int64_t kDirectAMaxCols = 512;

template <typename T>
inline bool read_a_direct(int64_t lda, bool few_cols) {
  return few_cols || (lda * static_cast<int64_t>(sizeof(T))) % 4096 != 0;
}

// Whether the micro-kernel reads a row-major B's rows where they are
// instead of a packed copy, for a part of m rows: with one or two row panels
// to share it, the copy (B read from memory, written, read back) is not paid
// back.  force: TORCHOPS_TESTING_MATMUL_DIRECT_B as read once per call
// (direct_b_switch): 1 / 0 forces it on (any row-major B) / off, for the
// tests; -1 (unset) decides.
constexpr int64_t kDirectBRows = 24;
// Up to 24 rows (9-24 x 1024 x 1024) reading in place is well ahead of the
// packed copy.  32 rows (three row panels) win on one or two threads but
// lose on 16, and 48 rows tie: those stay packed.
// ... and only where a depth block's rows span at most kDirectBSpan bytes:
// past it the scattered reads lose to the packed copy's row-by-row stream
// (32 x 4096 x 4096, rows 16 KB apart).
constexpr int64_t kDirectBSpan = 4 << 20;

template <typename T>
inline bool read_b_direct(int64_t m, int64_t b_rs, int64_t b_cs, int64_t kc, int force) {
  if (b_cs != 1) return false;
  if (force >= 0) return force == 1;
  return m <= kDirectBRows && kc * b_rs * static_cast<int64_t>(sizeof(T)) <= kDirectBSpan;
}

inline int direct_b_switch() {
  const std::optional<bool> direct = env::flag("matmul", env::kTestingMatmulDirectB);
  return direct ? int(*direct) : -1;
}

// One part of C (m x n, leading dim ldc) = A (m x k) @ B (k x n), on one
// thread (Goto's algorithm): per depth block, A packed mc_size rows at a
// time (or only its last partial row panel, read_a_direct), and per column
// block the B block (kc x nc, in L2).
template <typename T, int W>
inline __attribute__((always_inline)) void gemm_part(
    const T* a, int64_t a_rs, int64_t a_cs, const T* b, int64_t b_rs,
    int64_t b_cs, T* c, int64_t ldc, int64_t m, int64_t n, int64_t k,
    int64_t kc_size, int64_t mc_size, int64_t nc_size, T* apack, T* bpack, int force_direct_b,
    bool few_cols) {
  constexpr int64_t kMr = tile_rows<W>();
  constexpr int64_t NR = nr<T, W>();
  const bool direct = a_cs == 1 && read_a_direct<T>(a_rs, few_cols);
  const bool b_direct = read_b_direct<T>(m, b_rs, b_cs, kc_size, force_direct_b);
  // B read in place: rows just past one tile (13-16 of 12 with 64-byte
  // vectors, 7-8 of 6 with 32) as two blocks of two thirds of a tile, so
  // each pass over B does as many multiply-adds (faster than 12 + 4).
  constexpr int64_t kTwoThirds = 2 * (kMr / 3);
  if (b_direct && m > kMr && m <= 2 * kTwoThirds) mc_size = kTwoThirds;
  for (int64_t pc = 0; pc < k; pc += kc_size) {
    const int64_t kc = std::min(kc_size, k - pc);
    for (int64_t ic = 0; ic < m; ic += mc_size) {
      const int64_t mc = std::min(mc_size, m - ic);
      const T* ablock = a + ic * a_rs + pc * a_cs;
      if (!direct) {
        pack_a<T, W>(ablock, a_rs, a_cs, mc, kc, apack);
      } else if (const int64_t whole = mc / kMr * kMr; whole < mc) {
        pack_a<T, W>(ablock + whole * a_rs, a_rs, a_cs, mc - whole, kc, apack + whole * kc);
      }
      for (int64_t jc = 0; jc < n; jc += nc_size) {
        const int64_t nc = std::min(nc_size, n - jc);
        const T* bblock = b + pc * b_rs + jc * b_cs;
        if (!b_direct) {
          pack_b<T, W>(bblock, b_rs, b_cs, kc, nc, bpack, kc);
        } else if (const int64_t whole = nc / NR * NR; whole < nc) {
          pack_b<T, W>(bblock + whole, b_rs, b_cs, kc, nc - whole, bpack + whole * kc, kc);
        }
        macro_kernel<T, W>(mc, nc, kc, apack, bpack, c + ic * ldc + jc, ldc,
                           pc == 0, direct ? ablock : nullptr, a_rs,
                           b_direct ? bblock : nullptr, b_rs);
      }
    }
  }
}

// Few rows of C (a vector or a small batch of them times a matrix; few_rows
// says how few): packing would copy all of B to use each element M times, and pad
// A to a kMr-row tile, so B is streamed instead, row by row (each row's
// slice contiguous, which the hardware prefetcher follows), into running
// sums that stay in L1: up to kStreamPass rows of C per pass over B (one
// pass of 8 rows is well ahead of two of 4).  The packed kernel would read
// B three times over (pack, store, read back), far behind a gemv.
// Same order of products as the packed kernel: each sum over k in turn.
// Up to 8 rows take one pass over B; 13-16 rows two (few_rows), since the
// prefetch below makes the second pass cheap.  Not 9-12 rows: one tile of
// 12 packed rows beats passes of 8 and 4.
constexpr int64_t kStreamPass = 8;
constexpr int64_t kStreamSums = 2048;  // running sums per pass (8 KB of floats, 16 of doubles)
// B's rows kStreamAhead on are prefetched into L2 while four rows are
// multiplied: a pass reads each row's slice (1-8 KB) and moves a row on,
// usually to another page, where the hardware prefetchers do not follow.
// Prefetching four rows ahead instead times the same.
constexpr int64_t kStreamAhead = 8;
// A column-major B (W^T) is multiplied as dot products with its columns up
// to this many rows (RowsDotMatrix), where packing would transpose it and
// lose clearly (9-16 x 1024 x 1024).
constexpr int64_t kDotRows = 16;

// Whether each matrix of t can be read row by row (unit stride along a
// row, rows not overlapping) or, transposed, column by column.
inline bool row_major_view(const at::Tensor& t) {
  const int64_t rows = t.size(-2), cols = t.size(-1);
  return (t.stride(-1) == 1 || cols == 1) && (t.stride(-2) >= cols || rows == 1);
}

inline bool col_major_view(const at::Tensor& t) {
  const int64_t rows = t.size(-2), cols = t.size(-1);
  return (t.stride(-2) == 1 || rows == 1) && (t.stride(-1) >= rows || cols == 1);
}

// Whether the few-row kernels (RowsTimesMatrix, RowsDotMatrix) take the call,
// given B as gemm_operand left it and the packed kernel's tile rows.
inline bool few_rows(const MatmulShape& s, const at::Tensor& b, int64_t tile) {
  if (!row_major_view(b)) {
    return s.m <= kDotRows;
  }
  if (s.m <= kStreamPass) {
    return true;
  }
  // Two passes over B where they leave fewer rows idle than the packed
  // kernel's register tiles of `tile` rows: 13-16 rows (tiles of 12 or 6:
  // 24 or 18 rows, against 16), not 9-12.
  return s.m <= 2 * kStreamPass && (s.m + tile - 1) / tile * tile >= 2 * kStreamPass;
}

// c[r, 0 .. n) = a[r, 0 .. k) @ B for r < MR (a, c leading dims lda, ldc;
// B k x n, leading dim ldb).
template <typename T, int W, int MR>
struct RowsTimesMatrix {
  static inline __attribute__((always_inline)) void run(
      const T* __restrict__ a, int64_t lda, const T* __restrict__ b, int64_t ldb,
      T* __restrict__ c, int64_t ldc, int64_t k, int64_t n) {
    using Vec = typename Gemm<T, W>::Vec;
    constexpr int64_t L = lanes<T, W>();
    constexpr int64_t kBlock = kStreamSums / MR / L * L;
    constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(T));
    alignas(64) T acc[MR][kBlock];
    for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
      const int64_t len = std::min(kBlock, n - j0), full = len / L * L;
      for (int r = 0; r < MR; ++r) {
        for (int64_t j = 0; j < len; ++j) {
          acc[r][j] = T(0);
        }
      }
      int64_t p = 0;
      // Four rows of B a pass: each sum is loaded and stored once per four
      // products (added in row order, as one row at a time would).
      for (; p + 4 <= k; p += 4) {
        T av[MR][4];
        for (int r = 0; r < MR; ++r) {
          for (int q = 0; q < 4; ++q) {
            av[r][q] = a[r * lda + p + q];
          }
        }
        const T* r0 = b + p * ldb + j0;
        const T* r1 = r0 + ldb;
        const T* r2 = r1 + ldb;
        const T* r3 = r2 + ldb;
        const bool pf = p + kStreamAhead + 4 <= k;
        const int64_t pfo = kStreamAhead * ldb;
        for (int64_t j = 0; j < full; j += L) {
          if (pf && j % kLine == 0) {
            __builtin_prefetch(r0 + pfo + j, 0, 2);
            __builtin_prefetch(r1 + pfo + j, 0, 2);
            __builtin_prefetch(r2 + pfo + j, 0, 2);
            __builtin_prefetch(r3 + pfo + j, 0, 2);
          }
          Vec b0, b1, b2, b3;
          __builtin_memcpy(&b0, r0 + j, sizeof(Vec));
          __builtin_memcpy(&b1, r1 + j, sizeof(Vec));
          __builtin_memcpy(&b2, r2 + j, sizeof(Vec));
          __builtin_memcpy(&b3, r3 + j, sizeof(Vec));
          for (int r = 0; r < MR; ++r) {
            Vec v;
            __builtin_memcpy(&v, &acc[r][j], sizeof(Vec));
            v += av[r][0] * b0;
            v += av[r][1] * b1;
            v += av[r][2] * b2;
            v += av[r][3] * b3;
            __builtin_memcpy(&acc[r][j], &v, sizeof(Vec));
          }
        }
        for (int64_t j = full; j < len; ++j) {
          for (int r = 0; r < MR; ++r) {
            T v = acc[r][j];
            v += av[r][0] * r0[j];
            v += av[r][1] * r1[j];
            v += av[r][2] * r2[j];
            v += av[r][3] * r3[j];
            acc[r][j] = v;
          }
        }
      }
      for (; p < k; ++p) {
        const T* row = b + p * ldb + j0;
        for (int r = 0; r < MR; ++r) {
          const T ap = a[r * lda + p];
          for (int64_t j = 0; j < full; j += L) {
            Vec bv, v;
            __builtin_memcpy(&bv, row + j, sizeof(Vec));
            __builtin_memcpy(&v, &acc[r][j], sizeof(Vec));
            v += ap * bv;
            __builtin_memcpy(&acc[r][j], &v, sizeof(Vec));
          }
          for (int64_t j = full; j < len; ++j) {
            acc[r][j] += ap * row[j];
          }
        }
      }
      for (int r = 0; r < MR; ++r) {
        for (int64_t j = 0; j < len; ++j) {
          c[r * ldc + j0 + j] = acc[r][j];
        }
      }
    }
  }
};

// Kernel<T, W, R>::run on `rows` rows, 1 <= rows <= R: R is the first
// template count from R down that is not above `rows` (each a kernel of its
// own, its sums in registers).
template <template <typename, int, int> class Kernel, typename T, int W, int R>
inline __attribute__((always_inline)) void run_rows(
    int64_t rows, const T* a, int64_t lda, const T* b, int64_t ldb, T* c, int64_t ldc,
    int64_t k, int64_t n) {
  if constexpr (R > 1) {
    if (rows < R) {
      run_rows<Kernel, T, W, R - 1>(rows, a, lda, b, ldb, c, ldc, k, n);
      return;
    }
  }
  Kernel<T, W, R>::run(a, lda, b, ldb, c, ldc, k, n);
}

// All m rows of A, P a pass.
template <template <typename, int, int> class Kernel, typename T, int W, int P>
inline __attribute__((always_inline)) void in_passes(
    const T* a, int64_t lda, const T* b, int64_t ldb, T* c, int64_t ldc, int64_t m,
    int64_t k, int64_t n) {
  for (int64_t r0 = 0; r0 < m; r0 += P) {
    run_rows<Kernel, T, W, P>(std::min<int64_t>(P, m - r0), a + r0 * lda, lda, b, ldb,
                              c + r0 * ldc, ldc, k, n);
  }
}

// c[r, q] = a[r, 0 .. k) . b[q] for r < MR, q < NC: dot products with B's
// columns, each contiguous over k (B column-major: W^T of a linear layer,
// column q at b + q * ldb).  Vector partial sums over k, added up at the end.
// ahead: columns of a later group to prefetch into L2 meanwhile (each
// column q at ahead + q * ldb), or nullptr.
template <typename T, int W, int MR, int NC>
inline __attribute__((always_inline)) void rows_dot_columns(
    const T* __restrict__ a, int64_t lda, const T* __restrict__ b, int64_t ldb,
    T* __restrict__ c, int64_t ldc, int64_t k, const T* ahead) {
  using Vec = typename Gemm<T, W>::Vec;
  constexpr int64_t L = lanes<T, W>();
  constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(T));
  Vec acc[MR][NC];
  for (int r = 0; r < MR; ++r) {
    for (int q = 0; q < NC; ++q) {
      acc[r][q] = Vec{};
    }
  }
  int64_t p = 0;
  // Unrolled by pragma: GCC left the AVX2 clone's loops over r rolled, with
  // the sums and A's vectors in memory, several times slower.
  for (; p + L <= k; p += L) {
    if (ahead != nullptr && p % kLine == 0) {
#pragma GCC unroll 4
      for (int q = 0; q < NC; ++q) {
        __builtin_prefetch(ahead + q * ldb + p, 0, 2);
      }
    }
    Vec av[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      __builtin_memcpy(&av[r], a + r * lda + p, sizeof(Vec));
    }
#pragma GCC unroll 4
    for (int q = 0; q < NC; ++q) {
      Vec bv;
      __builtin_memcpy(&bv, b + q * ldb + p, sizeof(Vec));
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        acc[r][q] += av[r] * bv;
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int q = 0; q < NC; ++q) {
      T part[L];
      __builtin_memcpy(part, &acc[r][q], sizeof(Vec));
      T sum = T(0);
      for (int64_t l = 0; l < L; ++l) {
        sum += part[l];
      }
      for (int64_t t = p; t < k; ++t) {
        sum += a[r * lda + t] * b[q * ldb + t];
      }
      c[r * ldc + q] = sum;
    }
  }
}

// MR rows of A against a column-major B (k x n), kDotCols columns at a
// time: B read once, the MR rows of A (from L1/L2) once per column group.
// The columns kDotAhead groups on are prefetched into L2 meanwhile: a column
// of a 1024-deep float W^T is a page's worth (4 KB), and the hardware
// prefetchers stop at page boundaries, so without it each column began with
// a run of misses.  Four groups ahead is no faster, and slower for a single
// row.
constexpr int64_t kDotAhead = 2;
template <typename T, int W, int MR>
struct RowsDotMatrix {
  static inline __attribute__((always_inline)) void run(
      const T* a, int64_t lda, const T* b, int64_t ldb, T* c, int64_t ldc,
      int64_t k, int64_t n) {
    constexpr int kDotCols = 2;  // MR x kDotCols sums, MR rows of A, a column: registers
    int64_t j = 0;
    for (; j + kDotCols <= n; j += kDotCols) {
      const int64_t next = j + kDotAhead * kDotCols;
      rows_dot_columns<T, W, MR, kDotCols>(a, lda, b + j * ldb, ldb, c + j, ldc, k,
                                           next + kDotCols <= n ? b + next * ldb : nullptr);
    }
    for (; j < n; ++j) {
      rows_dot_columns<T, W, MR, 1>(a, lda, b + j * ldb, ldb, c + j, ldc, k, nullptr);
    }
  }
};

// Rows a pass of the dot products (RowsDotMatrix): 8 x 2 sums + 8 rows + a
// column of 32 vector registers (4 x 2 + 4 + 1 of 16).  More rows a pass
// read B fewer times; more columns a group read A fewer times.  8 x 2 beats
// 6 x 4 clearly on 1024 x 1024 weights and trails it a little on 4096 x 4096
// ones.
template <int W>
constexpr int kDotPass = W == 64 ? 8 : 4;

// Columns of a column-major B (column_bytes each) that the passes over A's
// rows take in turn: as many as fill half of L2, so that where there is more
// than one pass, the later ones read B from L2 instead of memory.
inline int64_t dot_block_cols(int64_t column_bytes) {
  return std::max<int64_t>(2, cpu_cache_sizes().l2 / 2 / std::max<int64_t>(column_bytes, 1) / 2 * 2);
}

// The compiled entry points (target attributes do not apply to templates):
// per accumulation type, 32-byte vectors multi-versioned, 64-byte vectors
// for AVX-512.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TORCHOPS_AVX512 __attribute__((target("avx512f,avx512vl,avx2,fma")))
#define TORCHOPS_HAS_AVX512_PATH 1
#else
#define TORCHOPS_AVX512
#define TORCHOPS_HAS_AVX512_PATH 0
#endif

// Per (type, width): the whole-part GEMM of one thread, and the pieces the
// shared schedule (shared_gemm) hands out one at a time.
#define TORCHOPS_GEMM_ENTRIES(SUFFIX, T, W, ATTR)                              \
  ATTR void gemm_part_##SUFFIX(const T* a, int64_t a_rs, int64_t a_cs,        \
                               const T* b, int64_t b_rs, int64_t b_cs, T* c,   \
                               int64_t ldc, int64_t m, int64_t n, int64_t k,   \
                               int64_t kc, int64_t mc, int64_t nc, T* ap,      \
                               T* bp, int direct_b, bool few_cols) {           \
    gemm_part<T, W>(a, a_rs, a_cs, b, b_rs, b_cs, c, ldc, m, n, k, kc, mc, nc, \
                    ap, bp, direct_b, few_cols);                               \
  }                                                                            \
  ATTR void pack_a_##SUFFIX(const T* a, int64_t rs, int64_t cs, int64_t mc,    \
                            int64_t kc, T* out) {                              \
    pack_a<T, W>(a, rs, cs, mc, kc, out);                                      \
  }                                                                            \
  ATTR void pack_b_##SUFFIX(const T* b, int64_t rs, int64_t cs, int64_t kc,    \
                            int64_t nc, T* out, int64_t stride) {              \
    pack_b<T, W>(b, rs, cs, kc, nc, out, stride);                              \
  }                                                                            \
  ATTR void macro_##SUFFIX(int64_t mc, int64_t nc, int64_t kc, const T* ap,    \
                           const T* bp, T* c, int64_t ldc, bool first) {       \
    macro_kernel<T, W>(mc, nc, kc, ap, bp, c, ldc, first);                     \
  }                                                                            \
  inline void gemm_part_acc(std::integral_constant<int, W>, const T* a,        \
                            int64_t a_rs, int64_t a_cs, const T* b,            \
                            int64_t b_rs, int64_t b_cs, T* c, int64_t ldc,     \
                            int64_t m, int64_t n, int64_t k, int64_t kc,       \
                            int64_t mc, int64_t nc, T* ap, T* bp,              \
                            int direct_b, bool few_cols) {                     \
    gemm_part_##SUFFIX(a, a_rs, a_cs, b, b_rs, b_cs, c, ldc, m, n, k, kc, mc,  \
                       nc, ap, bp, direct_b, few_cols);                        \
  }                                                                            \
  inline void pack_a_acc(std::integral_constant<int, W>, const T* a,           \
                         int64_t rs, int64_t cs, int64_t mc, int64_t kc,       \
                         T* out) {                                             \
    pack_a_##SUFFIX(a, rs, cs, mc, kc, out);                                   \
  }                                                                            \
  inline void pack_b_acc(std::integral_constant<int, W>, const T* b,           \
                         int64_t rs, int64_t cs, int64_t kc, int64_t nc,       \
                         T* out, int64_t stride) {                             \
    pack_b_##SUFFIX(b, rs, cs, kc, nc, out, stride);                           \
  }                                                                            \
  inline void macro_acc(std::integral_constant<int, W>, int64_t mc,            \
                        int64_t nc, int64_t kc, const T* ap, const T* bp,      \
                        T* c, int64_t ldc, bool first) {                       \
    macro_##SUFFIX(mc, nc, kc, ap, bp, c, ldc, first);                         \
  }
// b_cm: B column-major (column j at b + j * ldb), else row-major.
#define TORCHOPS_ROW_TIMES(NAME, T, W, ATTR)                                 \
  ATTR void NAME(const T* a, int64_t lda, const T* b, int64_t ldb, bool b_cm, \
                 T* c, int64_t ldc, int64_t m, int64_t k, int64_t n) {       \
    if (b_cm) {                                                              \
      const int64_t cols = dot_block_cols(k * int64_t(sizeof(T)));           \
      for (int64_t j0 = 0; j0 < n; j0 += cols) {                             \
        in_passes<RowsDotMatrix, T, W, kDotPass<W>>(                         \
            a, lda, b + j0 * ldb, ldb, c + j0, ldc, m, k,                    \
            std::min(cols, n - j0));                                         \
      }                                                                      \
    } else {                                                                 \
      in_passes<RowsTimesMatrix, T, W, kStreamPass>(a, lda, b, ldb, c, ldc,  \
                                                    m, k, n);                \
    }                                                                        \
  }                                                                          \
  inline void stream_rows_acc(std::integral_constant<int, W>, const T* a,    \
                              int64_t lda, const T* b, int64_t ldb,          \
                              bool b_cm, T* c, int64_t ldc, int64_t m,       \
                              int64_t k, int64_t n) {                        \
    NAME(a, lda, b, ldb, b_cm, c, ldc, m, k, n);                             \
  }
TORCHOPS_ROW_TIMES(stream_rows_f32, float, 32, TORCHOPS_CPU_MULTIVERSION)
TORCHOPS_ROW_TIMES(stream_rows_f64, double, 32, TORCHOPS_CPU_MULTIVERSION)
TORCHOPS_ROW_TIMES(stream_rows_f32_avx512, float, 64, TORCHOPS_AVX512)
TORCHOPS_ROW_TIMES(stream_rows_f64_avx512, double, 64, TORCHOPS_AVX512)
#undef TORCHOPS_ROW_TIMES

TORCHOPS_GEMM_ENTRIES(f32, float, 32, TORCHOPS_CPU_MULTIVERSION)
TORCHOPS_GEMM_ENTRIES(f64, double, 32, TORCHOPS_CPU_MULTIVERSION)
TORCHOPS_GEMM_ENTRIES(f32_avx512, float, 64, TORCHOPS_AVX512)
TORCHOPS_GEMM_ENTRIES(f64_avx512, double, 64, TORCHOPS_AVX512)
#undef TORCHOPS_GEMM_ENTRIES

bool cpu_has_avx512() {
#if TORCHOPS_HAS_AVX512_PATH
  static const bool has = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512vl");
  return has;
#else
  return false;
#endif
}

// Packed panels start on a cache line: the micro-kernel loads B's rows as
// whole vectors, and one straddling two lines costs two L1 accesses (the
// 12x32 loop is measurably slower with malloc's 16-byte alignment).
constexpr int64_t kLineBytes = 64;

template <typename T>
constexpr int64_t line_multiple(int64_t elems) {
  constexpr int64_t q = kLineBytes / static_cast<int64_t>(sizeof(T));
  return (elems + q - 1) / q * q;
}

// `elems` elements of a buffer kept by the calling thread from call to call
// (fresh pages each call would cost their first-touch faults), from a cache
// line boundary.
template <typename T>
T* line_aligned(std::vector<T>& buf, int64_t elems) {
  buf.resize(static_cast<size_t>(elems + kLineBytes / static_cast<int64_t>(sizeof(T))));
  const uintptr_t p = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<T*>((p + kLineBytes - 1) & ~uintptr_t(kLineBytes - 1));
}

// One operand in the accumulation type: element (i, j) of matrix bi at
// p[bi * bs + i * rs + j * cs], row-major (cs == 1) or column-major (rs == 1).
template <typename T>
struct Mat {
  const T* p;
  int64_t bs, rs, cs;
  const T* at(int64_t bi, int64_t i, int64_t j) const { return p + bi * bs + i * rs + j * cs; }
};

// Sizes of `blocks` balanced blocks covering n, each a multiple of q.
inline int64_t balanced(int64_t n, int64_t limit, int64_t q) {
  const int64_t blocks = (n + limit - 1) / limit;
  const int64_t size = (n + blocks - 1) / blocks;
  return (size + q - 1) / q * q;
}

// Spins until ready() holds.  Every wait in shared_gemm is for work that
// running threads have already claimed and finish without waiting on the
// waiter, so each one ends, also when at::parallel_for runs the workers one
// after another on a single thread.
template <typename F>
inline void wait_until(F&& ready) {
  for (int spins = 0; !ready(); ++spins) {
    if (spins < 128) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    } else {
      std::this_thread::yield();
    }
  }
}

// Extent of the part of C the shared schedule walks at a time (a "super
// block"): its packed A and B blocks, two generations of them, are shared by
// all threads and stay in the last-level cache.
constexpr int64_t kSharedRows = 2048;
constexpr int64_t kSharedCols = 2048;
// Multiply-adds from which batched_gemm takes the shared schedule (below,
// its synchronisation costs about what the packing it saves does: 512^3 on
// 16 threads is slower than the grid).
constexpr double kSharedMinWork = double(1 << 28);

// C = A @ B for one row-major, contiguous A (M x K) and B (K x N), on all
// threads with every block of A and B packed once, by whichever thread gets
// to it.  The per-thread schedule (batched_gemm's grid) packs each thread's
// rows of A and columns of B on its own: on a 4 x 4 grid of 16 threads the
// whole of A and B four times over, on 2 threads all of B twice.
//
// The work comes in generations, one per depth block of each super block of
// C; in each, the packing of A and B (chunks: groups of A's row panels and
// of B's rows) and then the C tiles (units, mu x nu) are claimed from atomic
// counters.  A unit adds its depth block to C after the same unit of the
// previous depth block has (so each element's sum runs over k in order: the
// result is the same bits for every thread count and claim order).  Two
// generations' buffers alternate: a thread that runs out of units packs the
// next generation while the others finish theirs.
template <typename acc_t, int W>
void shared_gemm(const Mat<acc_t>& a, const Mat<acc_t>& b, acc_t* c, int64_t m,
                 int64_t n, int64_t k, int64_t threads) {
  using Tag = std::integral_constant<int, W>;
  constexpr int64_t NR = nr<acc_t, W>();
  constexpr int64_t kMr = tile_rows<W>();
  const Blocks& blk = blocks<acc_t, W>();
  const int64_t kc_size = balanced(k, blk.kc, 1);
  const int64_t kblocks = (k + kc_size - 1) / kc_size;
  const int64_t sm = balanced(m, kSharedRows, kMr);
  const int64_t sn = balanced(n, kSharedCols, NR);
  const int64_t super_cols = (n + sn - 1) / sn;
  const int64_t supers = (m + sm - 1) / sm * super_cols;
  const int64_t gens = supers * kblocks;

  // Units: the grid of a full super block with the least work for the
  // busiest thread, counting per unit its register tiles plus the streaming
  // of its A rows and B columns into the core's caches; nu keeps the unit's
  // B columns in L2 (Blocks::nc).
  const int64_t row_tiles = sm / kMr, col_tiles = sn / NR;
  int64_t mu = sm, nu = sn;
  double best = -1;
  for (int64_t ur = 1; ur <= std::min<int64_t>(row_tiles, 64); ++ur) {
    for (int64_t uc = 1; uc <= std::min<int64_t>(col_tiles, 64); ++uc) {
      const int64_t mt = (row_tiles + ur - 1) / ur, nt = (col_tiles + uc - 1) / uc;
      if (nt * NR > blk.nc && nt > 1) continue;
      const double per_unit = double(mt * kMr) * double(nt * NR) +
                              4.0 * double(mt * kMr + nt * NR);
      const double cost = per_unit * double((ur * uc + threads - 1) / threads);
      if (best < 0 || cost < best * 0.999) {
        best = cost;
        mu = mt * kMr;
        nu = nt * NR;
      }
    }
  }
  const int64_t max_units = ((sm + mu - 1) / mu) * ((sn + nu - 1) / nu);
  // Pack chunks: 8 row panels of A, or ~128 KB of B's rows.
  const int64_t a_chunk = 8 * kMr;
  const int64_t b_chunk = std::max<int64_t>(1, (128 << 10) / int64_t(sizeof(acc_t)) / sn);

  struct Generation {
    int64_t super, pc, kc, i0, j0, rows, cols, uc, units, a_chunks, chunks;
  };
  auto generation = [&](int64_t g) {
    Generation x;
    x.super = g / kblocks;
    x.pc = g % kblocks * kc_size;
    x.kc = std::min(kc_size, k - x.pc);
    x.i0 = x.super / super_cols * sm;
    x.j0 = x.super % super_cols * sn;
    x.rows = std::min(sm, m - x.i0);
    x.cols = std::min(sn, n - x.j0);
    x.uc = (x.cols + nu - 1) / nu;
    x.units = (x.rows + mu - 1) / mu * x.uc;
    x.a_chunks = (x.rows + a_chunk - 1) / a_chunk;
    x.chunks = x.a_chunks + (x.kc + b_chunk - 1) / b_chunk;
    return x;
  };

  struct Counters {
    std::atomic<int64_t> pack_next{0}, packed{0}, unit_next{0}, units_done{0};
  };
  std::unique_ptr<Counters[]> ctr(new Counters[static_cast<size_t>(gens)]);
  // The last generation each unit has added to C, for two super blocks: a
  // thread computing generation g has passed the packing waits of g and
  // g - 1, so every generation before g - 1 is done, and with it the super
  // block before the previous one (whose slots this one reuses).
  const int64_t slots = 2 * max_units;
  std::unique_ptr<std::atomic<int64_t>[]> unit_gen(
      new std::atomic<int64_t>[static_cast<size_t>(slots)]);
  for (int64_t i = 0; i < slots; ++i) {
    unit_gen[i].store(-1, std::memory_order_relaxed);
  }
  const int64_t a_slot = line_multiple<acc_t>(kc_size * sm);
  const int64_t b_slot = line_multiple<acc_t>(kc_size * sn);
  thread_local std::vector<acc_t> buffer;
  acc_t* const packed_base = line_aligned(buffer, 2 * (a_slot + b_slot));

  auto worker = [&](int64_t, int64_t) {
    for (int64_t g = 0; g < gens; ++g) {
      const Generation x = generation(g);
      Counters& here = ctr[g];
      acc_t* const apack = packed_base + (g % 2) * (a_slot + b_slot);
      acc_t* const bpack = apack + a_slot;
      if (g >= 2) {
        // This generation's buffers held generation g - 2.
        const int64_t units = generation(g - 2).units;
        Counters& old = ctr[g - 2];
        wait_until([&] { return old.units_done.load(std::memory_order_acquire) == units; });
      }
      for (int64_t ch; (ch = here.pack_next.fetch_add(1, std::memory_order_relaxed)) < x.chunks;) {
        if (ch < x.a_chunks) {
          const int64_t r0 = ch * a_chunk;
          pack_a_acc(Tag{}, a.at(0, x.i0 + r0, x.pc), a.rs, a.cs,
                     std::min(a_chunk, x.rows - r0), x.kc, apack + r0 * x.kc);
        } else {
          const int64_t p0 = (ch - x.a_chunks) * b_chunk;
          pack_b_acc(Tag{}, b.at(0, x.pc + p0, x.j0), b.rs, b.cs,
                     std::min(b_chunk, x.kc - p0), x.cols, bpack + p0 * NR, x.kc);
        }
        here.packed.fetch_add(1, std::memory_order_release);
      }
      wait_until([&] { return here.packed.load(std::memory_order_acquire) == x.chunks; });
      for (int64_t u; (u = here.unit_next.fetch_add(1, std::memory_order_relaxed)) < x.units;) {
        std::atomic<int64_t>& done = unit_gen[x.super % 2 * max_units + u];
        if (x.pc > 0) {
          wait_until([&] { return done.load(std::memory_order_acquire) == g - 1; });
        }
        const int64_t r0 = u / x.uc * mu, c0 = u % x.uc * nu;
        macro_acc(Tag{}, std::min(mu, x.rows - r0), std::min(nu, x.cols - c0), x.kc,
                  apack + r0 * x.kc, bpack + c0 * x.kc, c + (x.i0 + r0) * n + x.j0 + c0, n,
                  x.pc == 0);
        done.store(g, std::memory_order_release);
        here.units_done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  at::parallel_for(0, threads, 1, worker);
}

// The operand view of a gemm_operand tensor: row-major where it can be read
// so (one row, or unit column stride), else column-major.
template <typename T>
Mat<T> mat_of(const at::Tensor& t, bool batched) {
  const int64_t rows = t.size(-2), cols = t.size(-1);
  const int64_t bs = batched ? t.stride(0) : 0;
  if (row_major_view(t)) {
    return {t.const_data_ptr<T>(), bs, rows == 1 ? cols : t.stride(-2), 1};
  }
  return {t.const_data_ptr<T>(), bs, 1, cols == 1 ? rows : t.stride(-1)};
}

// C = A @ B for A (M x K) and B (K x N) in the accumulation type, each
// row-major or column-major (gemm_operand).  Up to a few rows of A take the
// few-row kernels (few_rows).  Otherwise each matrix of C is cut into a grid
// of gm x gn parts, and every thread computes whole parts on its own, with
// its own packing buffers: one parallel region per call, no waits, and each
// thread's B block in its own core's L2 (shared_gemm instead where that
// would pack A and B several times over).  Inside a part (Goto's
// algorithm): per depth block pc, A is packed mc rows at a time into
// kMr-row panels (or read in place, read_a_direct), and per column block jc
// the B block (kc x nc) into NR-column panels (Blocks).
template <typename acc_t, int W>
void batched_gemm(const at::Tensor& a, const at::Tensor& b, at::Tensor& c,
                  const MatmulShape& s) {
  constexpr int64_t NR = nr<acc_t, W>();
  constexpr int64_t kMr = tile_rows<W>();
  const Blocks& blk = blocks<acc_t, W>();
  const Mat<acc_t> am = mat_of<acc_t>(a, s.batched), bm = mat_of<acc_t>(b, s.batched);
  acc_t* cp = c.mutable_data_ptr<acc_t>();
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  if (few_rows(s, b, kMr)) {
    // Column slices of whole vectors, at most a pass's block wide, shared
    // out over the threads (and the batch).
    constexpr int64_t L = lanes<acc_t, W>();
    const int64_t per = std::clamp<int64_t>(
        ((s.n + threads - 1) / threads + L - 1) / L * L, L, kStreamSums);
    const int64_t slices = (s.n + per - 1) / per;
    at::parallel_for(0, s.batch * slices, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t bi = i / slices, j0 = i % slices * per;
        // A is row-major here (matmul), B either way.
        const bool b_cm = bm.cs != 1;
        stream_rows_acc(std::integral_constant<int, W>{}, am.at(bi, 0, 0), am.rs,
                        bm.at(bi, 0, j0), b_cm ? bm.cs : bm.rs, b_cm,
                        cp + bi * s.m * s.n + j0, s.n, s.m, s.k, std::min(per, s.n - j0));
      }
    });
    return;
  }
  const int64_t row_tiles = (s.m + kMr - 1) / kMr;
  const int64_t col_tiles = (s.n + NR - 1) / NR;
  // The grid: the least work for the busiest thread, counting register tiles
  // (padded edges included) plus packing (A's transposing copy dearer than
  // B's row copies).
  int64_t gm = 1, gn = 1;
  double best = -1;
  for (int64_t pm = 1; pm <= threads; ++pm) {
    for (int64_t pn = 1; pm * pn <= threads; ++pn) {
      if (pm > row_tiles || pn > col_tiles) continue;
      const int64_t parts = s.batch * pm * pn;
      const int64_t per_thread = (parts + threads - 1) / threads;
      const int64_t mt = (row_tiles + pm - 1) / pm;
      const int64_t nt = (col_tiles + pn - 1) / pn;
      const double work = double(mt * kMr) * double(nt * NR) * double(s.k) +
                          8.0 * double(s.k) * double(mt * kMr) +
                          2.0 * double(s.k) * double(nt * NR) *
                              double((mt * kMr + blk.mc - 1) / blk.mc);
      const double cost = work * double(per_thread);
      if (best < 0 || cost < best * 0.999) {
        best = cost;
        gm = pm;
        gn = pn;
      }
    }
  }
  // One large matrix whose grid would pack both A and B several times over
  // (2 x 2 parts and up): pack each block once, for all threads.  Where only
  // one of them is repeated (2 threads: 2 x 1) the grid stays ahead: its
  // blocks are packed by the thread that uses them, into its own L2, where the
  // shared schedule's come from other cores or L3 (1024^3 on 2 threads, 2-core
  // development machine: 6.4 against 6.9-7.0 ms).  TORCHOPS_TESTING_MATMUL_SHARED=1 / 0
  // (read per call) takes / avoids the shared schedule wherever the batch is
  // one matrix, for the tests.
  const std::optional<bool> force_shared = env::flag("matmul", env::kTestingMatmulShared);
  const bool shared =
      s.batch == 1 &&
      (force_shared
           ? *force_shared
           : gm > 1 && gn > 1 && double(s.m) * double(s.n) * double(s.k) >= kSharedMinWork);
  if (shared) {
    shared_gemm<acc_t, W>(am, bm, cp, s.m, s.n, s.k, threads);
    return;
  }
  const int64_t mpart = (row_tiles + gm - 1) / gm * kMr;
  const int64_t npart = (col_tiles + gn - 1) / gn * NR;
  const int64_t kc_size = balanced(s.k, blk.kc, 1);
  const int direct_b = direct_b_switch();
  const bool few_cols = s.n <= kDirectAMaxCols;
  at::parallel_for(0, s.batch * gm * gn, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<acc_t> apack, bpack;
    for (int64_t part = begin; part < end; ++part) {
      const int64_t bi = part / (gm * gn);
      const int64_t i0 = (part / gn) % gm * mpart;
      const int64_t j0 = part % gn * npart;
      const int64_t m = std::min(mpart, s.m - i0);
      const int64_t n = std::min(npart, s.n - j0);
      if (m <= 0 || n <= 0) continue;
      acc_t* cb = cp + bi * s.m * s.n + i0 * s.n + j0;
      const int64_t mc_size = balanced(m, blk.mc, kMr);
      const int64_t nc_size = balanced(n, blk.nc, NR);
      gemm_part_acc(std::integral_constant<int, W>{}, am.at(bi, i0, 0), am.rs, am.cs,
                    bm.at(bi, 0, j0), bm.rs, bm.cs, cb, s.n, m, n, s.k, kc_size,
                    mc_size, nc_size,
                    line_aligned(apack, mc_size * kc_size),
                    line_aligned(bpack, nc_size * kc_size), direct_b, few_cols);
    }
  });
}

// `t` itself where each of its matrices is row-major or column-major (a
// transposed view: x @ w.t() of a linear layer, or autograd's products),
// which the kernels read as they are, else a contiguous copy.  Tensor.to
// keeps a transposed layout, so a half-precision operand is converted
// without a second, transposing copy.
at::Tensor gemm_operand(const at::Tensor& t, bool row_major_only) {
  if (row_major_view(t) || (!row_major_only && col_major_view(t))) {
    return t;
  }
  return t.contiguous();
}

at::Tensor matmul(const at::Tensor& a_in, const at::Tensor& b_in) {
  const MatmulShape s = check_matmul(a_in, b_in, c10::DeviceType::CPU);
  const at::ScalarType dtype = a_in.scalar_type();
  const at::ScalarType acc =
      dtype == at::kDouble ? at::kDouble : at::kFloat;
  // Uninitialised: the first depth block stores; K == 0 is zeroed below.
  at::Tensor c = new_output("matmul", s.out_sizes(), a_in.options().dtype(acc));
  if (c.numel() == 0 || s.k == 0) {
    return c.zero_().to(dtype);
  }
  // TORCHOPS_TESTING_MATMUL_NARROW=1 takes the 32-byte path on an AVX-512
  // CPU too, so the tests cover both paths on one machine (read per call: a
  // getenv is noise beside a matmul).  TORCHOPS_TESTING_CPU_CACHES="L1,L2,L3"
  // (bytes, read once per process: cpu/common/cache_sizes.h) sets the caches
  // the block sizes are derived from, so tests can force many small blocks.
  const bool narrow = env::flag("matmul", env::kTestingMatmulNarrow).value_or(false);
  const bool wide = cpu_has_avx512() && !narrow;
  // The rows of A are read as vectors by the few-row kernels (RowsTimesMatrix,
  // RowsDotMatrix): a column-major A of their few rows is copied.  Whether
  // they take the call depends on the path's tile rows, hence after `wide`.
  const at::Tensor b = gemm_operand(b_in.to(acc), /*row_major_only=*/false);
  const at::Tensor a = gemm_operand(
      a_in.to(acc), /*row_major_only=*/few_rows(s, b, wide ? tile_rows<64>() : tile_rows<32>()));
  if (acc == at::kDouble) {
    wide ? batched_gemm<double, 64>(a, b, c, s) : batched_gemm<double, 32>(a, b, c, s);
  } else {
    wide ? batched_gemm<float, 64>(a, b, c, s) : batched_gemm<float, 32>(a, b, c, s);
  }
  return c.to(dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CPU, m) {
  m.impl("matmul", &matmul);
}

}  // namespace torchops::cpu
