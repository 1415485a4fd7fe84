// CPU kernel of torchops.matmul: a packed, cache-blocked (BLIS-style) GEMM,
// parallel over blocks of output rows.
//
// Inputs are first made contiguous in the accumulation type (float for
// float/half/bfloat16, double for double), so one micro-kernel per
// accumulation type serves every input dtype and stride pattern; the output
// is rounded to the input dtype once, at the end.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include "common/matmul.h"
#include "cpu/common/parallel.h"

namespace torchops::cpu {
namespace {

// BLIS-style GEMM (Goto's algorithm): C += A @ B for row-major, contiguous
// A (M x K) and B (K x N) in the accumulation type.
//
// B is packed a (kKc x kNc) block at a time into panels of kNr columns, A a
// (kMc x kKc) block at a time (per thread) into panels of kMr rows, so the
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
constexpr int64_t kKc = 256;    // depth of a packed block (A panel in L1)
constexpr int64_t kMc = 96;     // rows of a packed A block (in L2)
constexpr int64_t kNc = 3072;   // columns of a packed B block (in L3)

template <typename T, int W>
constexpr int64_t lanes() {
  return W / static_cast<int64_t>(sizeof(T));
}

template <typename T, int W>
constexpr int64_t nr() {
  return 2 * lanes<T, W>();  // columns of the register tile: two vectors
}

// c[r * ldc + j] += tile for r < mr, j < nr (a partial tile at the edges).
template <typename T, int W>
inline __attribute__((always_inline)) void micro_kernel(
    int64_t kc, const T* __restrict__ ap, const T* __restrict__ bp,
    T* __restrict__ c, int64_t ldc, int64_t mr, int64_t ncols) {
  using Vec = typename Gemm<T, W>::Vec;
  constexpr int64_t L = lanes<T, W>();
  constexpr int64_t kMr = tile_rows<W>();
  Vec acc[kMr][2];
  for (int64_t r = 0; r < kMr; ++r) {
    acc[r][0] = Vec{};
    acc[r][1] = Vec{};
  }
  for (int64_t p = 0; p < kc; ++p) {
    Vec b0, b1;
    __builtin_memcpy(&b0, bp + p * 2 * L, sizeof(Vec));
    __builtin_memcpy(&b1, bp + p * 2 * L + L, sizeof(Vec));
    const T* a = ap + p * kMr;
    for (int64_t r = 0; r < kMr; ++r) {
      acc[r][0] += a[r] * b0;
      acc[r][1] += a[r] * b1;
    }
  }
  if (mr == kMr && ncols == 2 * L) {
    for (int64_t r = 0; r < kMr; ++r) {
      Vec c0, c1;
      __builtin_memcpy(&c0, c + r * ldc, sizeof(Vec));
      __builtin_memcpy(&c1, c + r * ldc + L, sizeof(Vec));
      c0 += acc[r][0];
      c1 += acc[r][1];
      __builtin_memcpy(c + r * ldc, &c0, sizeof(Vec));
      __builtin_memcpy(c + r * ldc + L, &c1, sizeof(Vec));
    }
    return;
  }
  T tile[kMr][2 * L];
  for (int64_t r = 0; r < kMr; ++r) {
    __builtin_memcpy(&tile[r][0], &acc[r][0], sizeof(Vec));
    __builtin_memcpy(&tile[r][L], &acc[r][1], sizeof(Vec));
  }
  for (int64_t r = 0; r < mr; ++r) {
    for (int64_t j = 0; j < ncols; ++j) {
      c[r * ldc + j] += tile[r][j];
    }
  }
}

// One packed A block against one packed B block: every (kMr x nr) tile.
template <typename T, int W>
inline __attribute__((always_inline)) void macro_kernel(
    int64_t mc, int64_t nc, int64_t kc, const T* __restrict__ apack,
    const T* __restrict__ bpack, T* __restrict__ c, int64_t ldc) {
  constexpr int64_t NR = nr<T, W>();
  constexpr int64_t kMr = tile_rows<W>();
  for (int64_t j = 0; j < nc; j += NR) {
    const T* bp = bpack + j * kc;
    for (int64_t i = 0; i < mc; i += kMr) {
      micro_kernel<T, W>(kc, apack + i * kc, bp, c + i * ldc + j, ldc,
                      std::min(kMr, mc - i), std::min(NR, nc - j));
    }
  }
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

#define TORCHOPS_MACRO_KERNEL(NAME, T, W, ATTR)                            \
  ATTR void NAME(int64_t mc, int64_t nc, int64_t kc, const T* ap,          \
                 const T* bp, T* c, int64_t ldc) {                         \
    macro_kernel<T, W>(mc, nc, kc, ap, bp, c, ldc);                        \
  }                                                                        \
  inline void macro_kernel_acc(std::integral_constant<int, W>, int64_t mc, \
                               int64_t nc, int64_t kc, const T* ap,        \
                               const T* bp, T* c, int64_t ldc) {           \
    NAME(mc, nc, kc, ap, bp, c, ldc);                                      \
  }
TORCHOPS_MACRO_KERNEL(macro_kernel_f32, float, 32, TORCHOPS_CPU_MULTIVERSION)
TORCHOPS_MACRO_KERNEL(macro_kernel_f64, double, 32, TORCHOPS_CPU_MULTIVERSION)
TORCHOPS_MACRO_KERNEL(macro_kernel_f32_avx512, float, 64, TORCHOPS_AVX512)
TORCHOPS_MACRO_KERNEL(macro_kernel_f64_avx512, double, 64, TORCHOPS_AVX512)
#undef TORCHOPS_MACRO_KERNEL

bool cpu_has_avx512() {
#if TORCHOPS_HAS_AVX512_PATH
  static const bool has = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512vl");
  return has;
#else
  return false;
#endif
}

// a[i0 .. i0 + mc, p0 .. p0 + kc] (leading dim lda) into panels of kMr rows,
// k-major inside a panel; rows past mc are zero.
template <typename T, int W>
void pack_a(const T* a, int64_t lda, int64_t mc, int64_t kc, T* out) {
  constexpr int64_t kMr = tile_rows<W>();
  for (int64_t i = 0; i < mc; i += kMr) {
    T* panel = out + i * kc;
    const int64_t rows = std::min(kMr, mc - i);
    for (int64_t p = 0; p < kc; ++p) {
      for (int64_t r = 0; r < kMr; ++r) {
        panel[p * kMr + r] = r < rows ? a[(i + r) * lda + p] : T(0);
      }
    }
  }
}

// b[p0 .. p0 + kc, j .. j + NR] (leading dim ldb) as one panel, row-major
// inside; columns past ncols are zero.
template <typename T, int W>
void pack_b_panel(const T* b, int64_t ldb, int64_t kc, int64_t ncols, T* out) {
  constexpr int64_t NR = nr<T, W>();
  for (int64_t p = 0; p < kc; ++p) {
    const T* row = b + p * ldb;
    T* dst = out + p * NR;
    if (ncols == NR) {
      std::copy(row, row + NR, dst);
    } else {
      std::copy(row, row + ncols, dst);
      std::fill(dst + ncols, dst + NR, T(0));
    }
  }
}

template <typename acc_t, int W>
void batched_gemm(const at::Tensor& a, const at::Tensor& b, at::Tensor& c,
                  const MatmulShape& s) {
  constexpr int64_t NR = nr<acc_t, W>();
  constexpr int64_t kMr = tile_rows<W>();
  const acc_t* ap = a.const_data_ptr<acc_t>();
  const acc_t* bp = b.const_data_ptr<acc_t>();
  acc_t* cp = c.mutable_data_ptr<acc_t>();
  // Row blocks of at most kMc rows, as many as a multiple of the thread
  // count so that every thread gets the same share, of whole register tiles.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t blocks = (s.m + kMc - 1) / kMc;
  blocks = (blocks + threads - 1) / threads * threads;
  int64_t mc = (s.m + blocks - 1) / blocks;
  mc = std::max<int64_t>(kMr, (mc + kMr - 1) / kMr * kMr);
  const int64_t row_blocks = (s.m + mc - 1) / mc;
  std::vector<acc_t> bpack(static_cast<size_t>(
      kKc * ((std::min(kNc, s.n) + NR - 1) / NR * NR)));
  for (int64_t bi = 0; bi < s.batch; ++bi) {
    const acc_t* ab = ap + bi * s.m * s.k;
    const acc_t* bb = bp + bi * s.k * s.n;
    acc_t* cb = cp + bi * s.m * s.n;
    for (int64_t jc = 0; jc < s.n; jc += kNc) {
      const int64_t nc = std::min(kNc, s.n - jc);
      const int64_t panels = (nc + NR - 1) / NR;
      for (int64_t pc = 0; pc < s.k; pc += kKc) {
        const int64_t kc = std::min(kKc, s.k - pc);
        at::parallel_for(0, panels, 8, [&](int64_t begin, int64_t end) {
          for (int64_t j = begin; j < end; ++j) {
            pack_b_panel<acc_t, W>(bb + pc * s.n + jc + j * NR, s.n, kc,
                         std::min(NR, nc - j * NR), bpack.data() + j * NR * kc);
          }
        });
        at::parallel_for(0, row_blocks, 1, [&](int64_t begin, int64_t end) {
          thread_local std::vector<acc_t> apack;
          apack.resize(static_cast<size_t>((mc + kMr) * kKc));
          for (int64_t blk = begin; blk < end; ++blk) {
            const int64_t ic = blk * mc;
            const int64_t rows = std::min(mc, s.m - ic);
            pack_a<acc_t, W>(ab + ic * s.k + pc, s.k, rows, kc, apack.data());
            macro_kernel_acc(std::integral_constant<int, W>{}, rows, nc, kc,
                             apack.data(), bpack.data(),
                             cb + ic * s.n + jc, s.n);
          }
        });
      }
    }
  }
}

at::Tensor matmul(const at::Tensor& a_in, const at::Tensor& b_in) {
  const MatmulShape s = check_matmul(a_in, b_in, c10::DeviceType::CPU);
  const at::ScalarType dtype = a_in.scalar_type();
  const at::ScalarType acc =
      dtype == at::kDouble ? at::kDouble : at::kFloat;
  // Zero-initialised: the micro-kernel accumulates, and K == 0 must give 0.
  at::Tensor c = new_output("matmul", s.out_sizes(), a_in.options().dtype(acc),
                            /*zero=*/true);
  if (c.numel() == 0 || s.k == 0) {
    return c.to(dtype);
  }
  const at::Tensor a = a_in.to(acc).contiguous();
  const at::Tensor b = b_in.to(acc).contiguous();
  // TORCHOPS_TESTING_MATMUL_NARROW=1 takes the 32-byte path on an AVX-512
  // CPU too, so the tests cover both paths on one machine (read per call: a
  // getenv is noise beside a matmul).
  const char* narrow = std::getenv("TORCHOPS_TESTING_MATMUL_NARROW");
  const bool wide = cpu_has_avx512() && !(narrow && narrow[0] == '1');
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
