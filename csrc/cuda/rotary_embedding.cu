// CUDA kernels of torchops.rotary_embedding, its backward and the in-place
// rotary_embedding_.
//
// One block per (b, s) row (grid-stride).  threadIdx.x picks a unit of the
// rotary dim -- V pairs (halves: entries j..j+V and j+h..j+h+V, h =
// rotary_dim / 2) or V adjacent entries (interleaved) -- and loads its cos
// and sin once; threadIdx.y walks the heads of q and then k with them.  The
// entries past the rotary dim are copied by all threads of the block.  With
// unit-stride heads, 16-byte-aligned pointers and strides that keep them
// aligned, a unit is one 16-byte load per operand (V = 16 / sizeof(T));
// otherwise one element (two for interleaved pairs) through the strides.
// The 16-byte forward has its own kernel (rotary_forward_vec_kernel).
//
// The backward's block owns one row of cos's gradient: (b, s), or every
// (b', s) when cos is shared by the batch.  Each thread sums its unit over
// its heads (and batches) in registers, then the block adds the threadIdx.y
// partials in a fixed order through shared memory: no atomics, the same bits
// on every run.
//
// rotary_embedding_ reads its cache row from `positions`; an index outside
// the cache fails CUDA_KERNEL_ASSERT (as ATen's index kernels do) and its
// row is left untouched, so nothing is read out of bounds.
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

#include "common/rotary_embedding_steps.h"
#include "cuda/common/launch.cuh"
#include "cuda/common/vectorized.cuh"

namespace torchops::cuda {
namespace {

constexpr int kThreads = 128;

// V values at p (stride ignored when kVec: one 16-byte access).
template <typename T, int V, bool kVec>
__device__ __forceinline__ void load(const T* p, int64_t stride, T (&v)[V]) {
  if constexpr (kVec) {
    const Pack<T, V> pk = *reinterpret_cast<const Pack<T, V>*>(p);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      v[e] = pk.v[e];
    }
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) {
      v[e] = p[e * stride];
    }
  }
}

template <typename T, int V, bool kVec, typename acc_t>
__device__ __forceinline__ void store(T* p, int64_t stride, const acc_t (&v)[V]) {
  if constexpr (kVec) {
    Pack<T, V> pk;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      pk.v[e] = static_cast<T>(v[e]);
    }
    *reinterpret_cast<Pack<T, V>*>(p) = pk;
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) {
      p[e * stride] = static_cast<T>(v[e]);
    }
  }
}

// The cos and sin of one unit starting at entry j.  Halves: ca, sa at
// j..j+V, cb, sb at j+h..j+h+V.  Interleaved: ca, sa at j..j+V (cb, sb
// unused).  From a cache row (kCache): cos_a = cos_b = cos[i] of pair i.
template <typename T, int V, bool kVec, bool kInterleaved, bool kCache>
__device__ __forceinline__ void load_coefficients(
    const T* crow, const T* srow, int64_t cd, int64_t sd, int64_t j, int64_t h,
    T (&ca)[V], T (&cb)[V], T (&sa)[V], T (&sb)[V]) {
  if constexpr (kCache) {
    // Scalar loads: a cache row holds one value per pair, and it is read
    // once per row for every head.
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const int64_t i = kInterleaved ? (j + e) / 2 : j + e;
      ca[e] = crow[i * cd];
      sa[e] = srow[i * cd];
      cb[e] = ca[e];
      sb[e] = sa[e];
    }
  } else {
    load<T, V, kVec>(crow + j * cd, cd, ca);
    load<T, V, kVec>(srow + j * sd, sd, sa);
    if constexpr (!kInterleaved) {
      load<T, V, kVec>(crow + (j + h) * cd, cd, cb);
      load<T, V, kVec>(srow + (j + h) * sd, sd, sb);
    }
  }
}

// Copies entries [rd, D) of every head of tensor t in one row, with all
// threads of the block (TV entries per step).
template <typename T, int TV, bool kVec>
__device__ __forceinline__ void copy_tail(const T* x, RotaryView xv, T* o,
                                          RotaryView ov, int64_t heads,
                                          int64_t D, int64_t rd) {
  const int64_t units = (D - rd) / TV;
  const int64_t total = heads * units;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  const int nthreads = blockDim.x * blockDim.y;
  for (int64_t i = tid; i < total; i += nthreads) {
    const int64_t hd = i / units;
    const int64_t e = rd + (i - hd * units) * TV;
    const T* src = x + hd * xv.sh + e * xv.sd;
    T* dst = o + hd * ov.sh + e * ov.sd;
    if constexpr (kVec) {
      *reinterpret_cast<Pack<T, TV>*>(dst) = *reinterpret_cast<const Pack<T, TV>*>(src);
    } else {
      *dst = *src;
    }
  }
}

// Rotates unit j of row (b, s) in every head of tensor t (q: 0, k: 1), the
// heads split over threadIdx.y.  Addresses are formed from the kernel's
// parameters in each iteration rather than kept in registers.
template <int t, typename T, int V, bool kVec, bool kInterleaved>
__device__ __forceinline__ void rotate_heads(const RotaryArgs<T>& a, int64_t b,
                                             int64_t s, int64_t j, const T (&ca)[V],
                                             const T (&cb)[V], const T (&sa)[V],
                                             const T (&sb)[V]) {
  using acc_t = at::opmath_type<T>;
  const int64_t h = a.g.rd / 2;
  for (int64_t hd = threadIdx.y; hd < a.g.H[t]; hd += blockDim.y) {
    const T* x = a.x[t] + b * a.xv[t].sb + s * a.xv[t].ss + hd * a.xv[t].sh;
    T* o = a.out[t] + b * a.ov[t].sb + s * a.ov[t].ss + hd * a.ov[t].sh;
    const int64_t xd = a.xv[t].sd, od = a.ov[t].sd;
    if constexpr (kInterleaved) {
      T v[V];
      load<T, V, kVec>(x + j * xd, xd, v);
      acc_t r[V];
#pragma unroll
      for (int i = 0; i < V / 2; ++i) {
        const acc_t x_a = v[2 * i], x_b = v[2 * i + 1];
        r[2 * i] = x_a * acc_t(ca[2 * i]) - x_b * acc_t(sa[2 * i]);
        r[2 * i + 1] = x_b * acc_t(ca[2 * i + 1]) + x_a * acc_t(sa[2 * i + 1]);
      }
      store<T, V, kVec>(o + j * od, od, r);
    } else {
      T va[V], vb[V];
      load<T, V, kVec>(x + j * xd, xd, va);
      load<T, V, kVec>(x + (j + h) * xd, xd, vb);
      acc_t ra[V], rb[V];
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const acc_t x_a = va[e], x_b = vb[e];
        ra[e] = x_a * acc_t(ca[e]) - x_b * acc_t(sa[e]);
        rb[e] = x_b * acc_t(cb[e]) + x_a * acc_t(sb[e]);
      }
      store<T, V, kVec>(o + j * od, od, ra);
      store<T, V, kVec>(o + (j + h) * od, od, rb);
    }
  }
}

// Eight blocks per SM (64 registers a thread): the forward is a stream
// with one or two 16-byte loads in flight per thread and head, so it needs
// the occupancy to keep enough bytes in flight; most of what the registers
// would otherwise hold are kernel parameters, which the compiler re-reads.
constexpr int kForwardBlocksPerSm = 8;

template <typename T, int V, bool kVec, bool kInterleaved, bool kCache>
__global__ void __launch_bounds__(kThreads, kForwardBlocksPerSm)
    rotary_forward_kernel(const RotaryArgs<T> a) {
  const int64_t S = a.g.S;
  const int64_t rd = a.g.rd, h = rd / 2;
  const int64_t units = (kInterleaved ? rd : h) / V;
  const int64_t nrows = a.g.B * S;
  for (int64_t row = blockIdx.x; row < nrows; row += gridDim.x) {
    const int64_t b = row / S, s = row - b * S;
    const T* crow;
    const T* srow;
    if constexpr (kCache) {
      const int64_t p = a.pos[b * a.pb + s * a.ps];
      CUDA_KERNEL_ASSERT(p >= 0 && p < a.max_pos);
      if (p < 0 || p >= a.max_pos) {
        continue;  // the same for the whole block: no barrier is skipped
      }
      crow = a.cos + p * a.cv.ss;
      srow = a.sin + p * a.cv.ss;
    } else {
      const int64_t bc = a.g.Bc == 1 ? 0 : b;
      crow = a.cos + bc * a.cv.sb + s * a.cv.ss;
      srow = a.sin + bc * a.sv.sb + s * a.sv.ss;
    }
    for (int64_t u = threadIdx.x; u < units; u += blockDim.x) {
      const int64_t j = u * V;
      T ca[V], cb[V], sa[V], sb[V];
      load_coefficients<T, V, kVec, kInterleaved, kCache>(
          crow, srow, a.cv.sd, a.sv.sd, j, h, ca, cb, sa, sb);
      rotate_heads<0, T, V, kVec, kInterleaved>(a, b, s, j, ca, cb, sa, sb);
      rotate_heads<1, T, V, kVec, kInterleaved>(a, b, s, j, ca, cb, sa, sb);
    }
    if constexpr (!kCache) {  // in place, the tail is already there
      constexpr int TV = kVec ? V : 1;
      copy_tail<T, TV, kVec>(a.x[0] + b * a.xv[0].sb + s * a.xv[0].ss, a.xv[0],
                             a.out[0] + b * a.ov[0].sb + s * a.ov[0].ss, a.ov[0],
                             a.g.H[0], a.g.D[0], rd);
      copy_tail<T, TV, kVec>(a.x[1] + b * a.xv[1].sb + s * a.xv[1].ss, a.xv[1],
                             a.out[1] + b * a.ov[1].sb + s * a.ov[1].ss, a.ov[1],
                             a.g.H[1], a.g.D[1], rd);
    }
  }
}

// The forward's 16-byte path.  Every unit is one aligned 16-byte access
// with unit stride, so a thread's loads are issued back to back: its cos
// and sin, then the units of its first head (two heads for 4- and 8-byte
// types), before any of them is used.  The heads of q and k form one index
// (k after q), so GQA's few k heads fill the slots q's leave.  Cos and sin
// stay packed across the head loop (16-bit values converted per use), so
// eight blocks per SM fit without spilling.  q, k, cos and sin go through the read-only path
// unless the op is in place; outputs are streaming stores (read by the
// next kernel, not by this one).
template <typename T, int V, bool kNc>
__device__ __forceinline__ Pack<T, V> load_pack(const T* p) {
  static_assert(sizeof(Pack<T, V>) == sizeof(uint4), "one 16-byte access");
  Pack<T, V> pk;
  if constexpr (kNc) {
    const uint4 r = __ldg(reinterpret_cast<const uint4*>(p));
    memcpy(&pk, &r, sizeof(r));
  } else {
    pk = *reinterpret_cast<const Pack<T, V>*>(p);
  }
  return pk;
}

// Makes the compiler treat p's bits as new, so values derived from them
// (the float conversions of 16-bit coefficients) are not hoisted out of
// the head loop: hoisted, eight bfloat16 pairs become 32 float registers
// and spill; kept packed they take 16.  No instruction is emitted.
template <typename T, int V>
__device__ __forceinline__ void refresh(Pack<T, V>& p) {
  uint4 r;
  memcpy(&r, &p, sizeof(r));
  asm volatile("" : "+r"(r.x), "+r"(r.y), "+r"(r.z), "+r"(r.w));
  memcpy(&p, &r, sizeof(r));
}

template <typename T, int V, typename acc_t>
__device__ __forceinline__ void store_pack_cs(T* p, const acc_t (&v)[V]) {
  Pack<T, V> pk;
#pragma unroll
  for (int e = 0; e < V; ++e) {
    pk.v[e] = static_cast<T>(v[e]);
  }
  uint4 r;
  memcpy(&r, &pk, sizeof(r));
  __stcs(reinterpret_cast<uint4*>(p), r);
}

// Head hh of the joint (q heads, then k heads) index, in row (b, s): the
// start of its input and of its output.
template <typename T>
__device__ __forceinline__ const T* joint_head_in(const RotaryArgs<T>& a, int64_t b,
                                                  int64_t s, int hh) {
  const bool is_k = hh >= a.g.H[0];
  const RotaryView& v = is_k ? a.xv[1] : a.xv[0];
  return (is_k ? a.x[1] : a.x[0]) + b * v.sb + s * v.ss +
         (is_k ? hh - a.g.H[0] : hh) * v.sh;
}

template <typename T>
__device__ __forceinline__ T* joint_head_out(const RotaryArgs<T>& a, int64_t b,
                                             int64_t s, int hh) {
  const bool is_k = hh >= a.g.H[0];
  const RotaryView& v = is_k ? a.ov[1] : a.ov[0];
  return (is_k ? a.out[1] : a.out[0]) + b * v.sb + s * v.ss +
         (is_k ? hh - a.g.H[0] : hh) * v.sh;
}

// Rotates one loaded unit (xa; xb the b half, unused interleaved) and
// stores it at o + j (and o + j + h): the scalar path's arithmetic, term
// for term.
template <typename T, int V, bool kInterleaved>
__device__ __forceinline__ void rotate_store(T* o, int j, int h,
                                             const Pack<T, V>& xa, const Pack<T, V>& xb,
                                             const Pack<T, V>& ca, const Pack<T, V>& cb,
                                             const Pack<T, V>& sa, const Pack<T, V>& sb) {
  using acc_t = at::opmath_type<T>;
  if constexpr (kInterleaved) {
    acc_t r[V];
#pragma unroll
    for (int i = 0; i < V / 2; ++i) {
      const acc_t x_a = xa.v[2 * i], x_b = xa.v[2 * i + 1];
      r[2 * i] = x_a * acc_t(ca.v[2 * i]) - x_b * acc_t(sa.v[2 * i]);
      r[2 * i + 1] = x_b * acc_t(ca.v[2 * i + 1]) + x_a * acc_t(sa.v[2 * i + 1]);
    }
    store_pack_cs<T, V>(o + j, r);
  } else {
    acc_t ra[V], rb[V];
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const acc_t x_a = xa.v[e], x_b = xb.v[e];
      ra[e] = x_a * acc_t(ca.v[e]) - x_b * acc_t(sa.v[e]);
      rb[e] = x_b * acc_t(cb.v[e]) + x_a * acc_t(sb.v[e]);
    }
    store_pack_cs<T, V>(o + j, ra);
    store_pack_cs<T, V>(o + j + h, rb);
  }
}

template <typename T, int V, bool kInterleaved, bool kCache>
__global__ void __launch_bounds__(kThreads, kForwardBlocksPerSm)
    rotary_forward_vec_kernel(const RotaryArgs<T> a) {
  constexpr bool kNc = !kCache;  // in place, the inputs are written
  const int64_t S = a.g.S;
  // Offsets within a row fit 32 bits (can_vectorize checks heads x head
  // size); fewer registers than int64.
  const int rd = static_cast<int>(a.g.rd), h = rd / 2;
  const int units = (kInterleaved ? rd : h) / V;
  const int64_t nrows = a.g.B * S;
  const int heads = static_cast<int>(a.g.H[0] + a.g.H[1]);
  const int ny = blockDim.y;
  for (int64_t row = blockIdx.x; row < nrows; row += gridDim.x) {
    const int64_t b = row / S, s = row - b * S;
    int64_t p = 0;
    if constexpr (kCache) {
      p = a.pos[b * a.pb + s * a.ps];
      CUDA_KERNEL_ASSERT(p >= 0 && p < a.max_pos);
      if (p < 0 || p >= a.max_pos) {
        continue;  // the same for the whole block: no barrier is skipped
      }
    }
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
      const int j = u * V;
      // The coefficient rows, formed here rather than kept live across
      // the head loop.
      const T* crow;
      const T* srow;
      if constexpr (kCache) {
        crow = a.cos + p * a.cv.ss;
        srow = a.sin + p * a.cv.ss;
      } else {
        const int64_t bc = a.g.Bc == 1 ? 0 : b;
        crow = a.cos + bc * a.cv.sb + s * a.cv.ss;
        srow = a.sin + bc * a.sv.sb + s * a.sv.ss;
      }
      Pack<T, V> ca, cb, sa, sb;
      if constexpr (kCache) {
        load_coefficients<T, V, true, kInterleaved, true>(
            crow, srow, a.cv.sd, a.sv.sd, j, h, ca.v, cb.v, sa.v, sb.v);
      } else {
        // Unit stride (the 16-byte path's condition on cos and sin).
        ca = load_pack<T, V, true>(crow + j);
        sa = load_pack<T, V, true>(srow + j);
        cb = ca;  // unused interleaved
        sb = sa;
        if constexpr (!kInterleaved) {
          cb = load_pack<T, V, true>(crow + j + h);
          sb = load_pack<T, V, true>(srow + j + h);
        }
      }
      // kPair: two heads per step, hh and hh + ny (the second may be past
      // the end).  16-bit types take one: their two heads' float
      // conversions do not fit the 64 registers of eight blocks per SM.
      constexpr bool kPair = sizeof(T) >= 4;
      for (int hh = threadIdx.y; hh < heads; hh += (kPair ? 2 : 1) * ny) {
        const bool two = kPair && hh + ny < heads;
        refresh(ca);
        refresh(sa);
        if constexpr (!kInterleaved) {
          refresh(cb);
          refresh(sb);
        }
        const T* x0 = joint_head_in(a, b, s, hh);
        Pack<T, V> xa0 = load_pack<T, V, kNc>(x0 + j);
        Pack<T, V> xb0 = xa0;
        if constexpr (!kInterleaved) {
          xb0 = load_pack<T, V, kNc>(x0 + j + h);
        }
        Pack<T, V> xa1 = xa0, xb1 = xb0;
        if (two) {
          const T* x1 = joint_head_in(a, b, s, hh + ny);
          xa1 = load_pack<T, V, kNc>(x1 + j);
          if constexpr (!kInterleaved) {
            xb1 = load_pack<T, V, kNc>(x1 + j + h);
          }
        }
        rotate_store<T, V, kInterleaved>(joint_head_out(a, b, s, hh), j, h, xa0, xb0,
                                         ca, cb, sa, sb);
        if (two) {
          // Again: the first head's conversions are not kept for the second.
          refresh(ca);
          refresh(sa);
          if constexpr (!kInterleaved) {
            refresh(cb);
            refresh(sb);
          }
          rotate_store<T, V, kInterleaved>(joint_head_out(a, b, s, hh + ny), j, h,
                                           xa1, xb1, ca, cb, sa, sb);
        }
      }
    }
    if constexpr (!kCache) {  // in place, the tail is already there
      // Entries [rd, D) of every head, by all threads of the block; a
      // row's offsets in 32 bits (no 64-bit division).
      const int tid = threadIdx.y * blockDim.x + threadIdx.x;
      for (int t = 0; t < 2; ++t) {
        const int tu = static_cast<int>(a.g.D[t] - rd) / V;
        const int total = static_cast<int>(a.g.H[t]) * tu;
        const T* x = a.x[t] + b * a.xv[t].sb + s * a.xv[t].ss;
        T* o = a.out[t] + b * a.ov[t].sb + s * a.ov[t].ss;
        for (int i = tid; i < total; i += kThreads) {
          const int hd = i / tu;
          const int e = rd + (i - hd * tu) * V;
          *reinterpret_cast<Pack<T, V>*>(o + hd * a.ov[t].sh + e) =
              load_pack<T, V, true>(x + hd * a.xv[t].sh + e);
        }
      }
    }
  }
}

// Partial sums per thread: (dcos_a, dcos_b, dsin_a, dsin_b) x V for halves,
// (dcos, dsin) x V interleaved.
template <bool kInterleaved, int V>
constexpr int kAccs = kInterleaved ? 2 * V : 4 * V;

template <typename T, int V, bool kVec, bool kInterleaved>
__global__ void __launch_bounds__(kThreads)
    rotary_backward_kernel(const RotaryArgs<T> a) {
  using acc_t = at::opmath_type<T>;
  constexpr int NA = kAccs<kInterleaved, V>;
  extern __shared__ unsigned char smem_bytes[];
  acc_t* smem = reinterpret_cast<acc_t*>(smem_bytes);
  const int64_t S = a.g.S, H0 = a.g.H[0], H1 = a.g.H[1];
  const int64_t rd = a.g.rd, h = rd / 2;
  const int64_t units = (kInterleaved ? rd : h) / V;
  const bool cos_grad = a.dcos != nullptr;  // the same for every thread
  const bool shared = a.g.Bc == 1;
  const int64_t batches = shared ? a.g.B : 1;
  const int64_t ngroups = a.g.Bc * S;
  const int tx = threadIdx.x, ty = threadIdx.y;
  for (int64_t grp = blockIdx.x; grp < ngroups; grp += gridDim.x) {
    const int64_t bc = grp / S, s = grp - bc * S;
    const T* crow = a.cos + bc * a.cv.sb + s * a.cv.ss;
    const T* srow = a.sin + bc * a.sv.sb + s * a.sv.ss;
    // Uniform trip count, so every thread reaches the barriers below.
    for (int64_t u0 = 0; u0 < units; u0 += blockDim.x) {
      const int64_t u = u0 + tx;
      const bool active = u < units;
      const int64_t j = u * V;
      acc_t acc[NA];
#pragma unroll
      for (int k = 0; k < NA; ++k) {
        acc[k] = acc_t(0);
      }
      if (active) {
        T ca[V], cb[V], sa[V], sb[V];
        load_coefficients<T, V, kVec, kInterleaved, false>(
            crow, srow, a.cv.sd, a.sv.sd, j, h, ca, cb, sa, sb);
        for (int64_t i = 0; i < batches; ++i) {
          const int64_t b = shared ? i : bc;
          for (int64_t hh = ty; hh < H0 + H1; hh += blockDim.y) {
            const bool is_k = hh >= H0;
            const int64_t hd = is_k ? hh - H0 : hh;
            const RotaryView gv = is_k ? a.dyv[1] : a.dyv[0];
            const RotaryView ov = is_k ? a.ov[1] : a.ov[0];
            const T* g = (is_k ? a.dy[1] : a.dy[0]) + b * gv.sb + s * gv.ss + hd * gv.sh;
            T* o = (is_k ? a.out[1] : a.out[0]) + b * ov.sb + s * ov.ss + hd * ov.sh;
            if constexpr (kInterleaved) {
              T gvv[V];
              load<T, V, kVec>(g + j * gv.sd, gv.sd, gvv);
              acc_t r[V];
#pragma unroll
              for (int p = 0; p < V / 2; ++p) {
                const acc_t g_a = gvv[2 * p], g_b = gvv[2 * p + 1];
                r[2 * p] = g_a * acc_t(ca[2 * p]) + g_b * acc_t(sa[2 * p + 1]);
                r[2 * p + 1] = g_b * acc_t(ca[2 * p + 1]) - g_a * acc_t(sa[2 * p]);
              }
              store<T, V, kVec>(o + j * ov.sd, ov.sd, r);
              if (cos_grad) {
                const RotaryView xv = is_k ? a.xv[1] : a.xv[0];
                const T* x = (is_k ? a.x[1] : a.x[0]) + b * xv.sb + s * xv.ss + hd * xv.sh;
                T xvv[V];
                load<T, V, kVec>(x + j * xv.sd, xv.sd, xvv);
#pragma unroll
                for (int p = 0; p < V / 2; ++p) {
                  const acc_t g_a = gvv[2 * p], g_b = gvv[2 * p + 1];
                  const acc_t x_a = xvv[2 * p], x_b = xvv[2 * p + 1];
                  acc[2 * p] += g_a * x_a;
                  acc[2 * p + 1] += g_b * x_b;
                  acc[V + 2 * p] -= g_a * x_b;
                  acc[V + 2 * p + 1] += g_b * x_a;
                }
              }
            } else {
              T ga[V], gb[V];
              load<T, V, kVec>(g + j * gv.sd, gv.sd, ga);
              load<T, V, kVec>(g + (j + h) * gv.sd, gv.sd, gb);
              acc_t ra[V], rb[V];
#pragma unroll
              for (int e = 0; e < V; ++e) {
                const acc_t g_a = ga[e], g_b = gb[e];
                ra[e] = g_a * acc_t(ca[e]) + g_b * acc_t(sb[e]);
                rb[e] = g_b * acc_t(cb[e]) - g_a * acc_t(sa[e]);
              }
              store<T, V, kVec>(o + j * ov.sd, ov.sd, ra);
              store<T, V, kVec>(o + (j + h) * ov.sd, ov.sd, rb);
              if (cos_grad) {
                const RotaryView xv = is_k ? a.xv[1] : a.xv[0];
                const T* x = (is_k ? a.x[1] : a.x[0]) + b * xv.sb + s * xv.ss + hd * xv.sh;
                T xa[V], xb[V];
                load<T, V, kVec>(x + j * xv.sd, xv.sd, xa);
                load<T, V, kVec>(x + (j + h) * xv.sd, xv.sd, xb);
#pragma unroll
                for (int e = 0; e < V; ++e) {
                  const acc_t g_a = ga[e], g_b = gb[e];
                  const acc_t x_a = xa[e], x_b = xb[e];
                  acc[e] += g_a * x_a;
                  acc[V + e] += g_b * x_b;
                  acc[2 * V + e] -= g_a * x_b;
                  acc[3 * V + e] += g_b * x_a;
                }
              }
            }
          }
        }
      }
      if (cos_grad) {
        // Partial k of thread `tid` at smem[k * kThreads + tid]: consecutive
        // threads hit consecutive banks, writing and reading.  Then every
        // thread adds up some of the (k, unit) sums over threadIdx.y, in
        // order: the same bits on every run.
        const int tid = ty * blockDim.x + tx;
#pragma unroll
        for (int k = 0; k < NA; ++k) {
          smem[k * kThreads + tid] = acc[k];
        }
        __syncthreads();
        const int nx = blockDim.x, ny = blockDim.y;
        for (int o = tid; o < NA * nx; o += kThreads) {
          const int k = o / nx, x = o - k * nx;
          const int64_t uu = u0 + x;
          if (uu < units) {
            acc_t sum = acc_t(0);
            for (int y = 0; y < ny; ++y) {
              sum += smem[k * kThreads + y * nx + x];
            }
            const int part = k / V;
            const int64_t entry = uu * V + (k - part * V);
            // Halves: parts dcos_a, dcos_b, dsin_a, dsin_b; interleaved:
            // dcos, dsin.
            const bool is_sin = kInterleaved ? part == 1 : part >= 2;
            const bool is_b = !kInterleaved && (part & 1) == 1;
            T* dst = (is_sin ? a.dsin : a.dcos) + grp * rd;
            dst[entry + (is_b ? h : 0)] = static_cast<T>(sum);
          }
        }
        __syncthreads();  // smem is rewritten by the next unit
      }
    }
    // Past the rotary dim the gradient passes through.
    constexpr int TV = kVec ? V : 1;
    for (int64_t i = 0; i < batches; ++i) {
      const int64_t b = shared ? i : bc;
      for (int t = 0; t < 2; ++t) {
        const RotaryView gv = t ? a.dyv[1] : a.dyv[0];
        const RotaryView ov = t ? a.ov[1] : a.ov[0];
        copy_tail<T, TV, kVec>((t ? a.dy[1] : a.dy[0]) + b * gv.sb + s * gv.ss, gv,
                               (t ? a.out[1] : a.out[0]) + b * ov.sb + s * ov.ss, ov,
                               t ? H1 : H0, t ? a.g.D[1] : a.g.D[0], rd);
      }
    }
  }
}

// Whether a (B, S, H, D) view keeps every V-entry unit 16-byte aligned.
template <typename T, int V>
bool view_aligned(const T* p, const RotaryView v) {
  return p == nullptr ||
         (aligned_for_packs({p}) && v.sd == 1 && v.sb % V == 0 && v.ss % V == 0 &&
          v.sh % V == 0);
}

template <typename T>
bool can_vectorize(const RotaryArgs<T>& a, bool cache) {
  constexpr int V = pack_size<T>();
  const int64_t h = a.g.rd / 2;
  if ((a.interleaved ? a.g.rd : h) % V != 0 || a.g.D[0] % V != 0 ||
      a.g.D[1] % V != 0) {
    return false;
  }
  for (int t = 0; t < 2; ++t) {
    if (!view_aligned<T, V>(a.x[t], a.xv[t]) || !view_aligned<T, V>(a.out[t], a.ov[t]) ||
        !view_aligned<T, V>(a.dy[t], a.dyv[t])) {
      return false;
    }
  }
  return cache || (view_aligned<T, V>(a.cos, a.cv) && view_aligned<T, V>(a.sin, a.sv));
}

// Threads along the rotary dim (a power of two covering the units, at
// most the block) and along the heads.
dim3 block_for(int64_t units) {
  int tx = 1;
  while (tx < units && tx < kThreads) {
    tx *= 2;
  }
  return dim3(tx, kThreads / tx);
}

unsigned int blocks_for(int64_t rows) {
  return static_cast<unsigned int>(
      std::min<int64_t>(rows, std::numeric_limits<int32_t>::max()));
}

template <typename T, int V, bool kVec, bool kInterleaved, bool kCache>
void launch_forward(const RotaryArgs<T>& a) {
  const int64_t units = (kInterleaved ? a.g.rd : a.g.rd / 2) / V;
  if constexpr (kVec) {
    rotary_forward_vec_kernel<T, V, kInterleaved, kCache>
        <<<blocks_for(a.g.B * a.g.S), block_for(units), 0, current_stream()>>>(a);
  } else {
    rotary_forward_kernel<T, V, kVec, kInterleaved, kCache>
        <<<blocks_for(a.g.B * a.g.S), block_for(units), 0, current_stream()>>>(a);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int V, bool kVec, bool kInterleaved>
void launch_backward(const RotaryArgs<T>& a) {
  using acc_t = at::opmath_type<T>;
  const int64_t units = (kInterleaved ? a.g.rd : a.g.rd / 2) / V;
  const dim3 block = block_for(units);
  const size_t smem = a.dcos != nullptr
                          ? sizeof(acc_t) * kThreads * kAccs<kInterleaved, V>
                          : 0;
  rotary_backward_kernel<T, V, kVec, kInterleaved>
      <<<blocks_for(a.g.Bc * a.g.S), block, smem, current_stream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, bool kInterleaved, bool kCache>
void forward_for(const RotaryArgs<T>& a) {
  // The 16-byte forward keeps a row's offsets (heads x head size) in int.
  const bool row_fits_int = (a.g.H[0] + a.g.H[1]) * std::max(a.g.D[0], a.g.D[1]) <=
                            std::numeric_limits<int32_t>::max();
  if (row_fits_int && can_vectorize(a, kCache)) {
    launch_forward<T, pack_size<T>(), true, kInterleaved, kCache>(a);
  } else {
    launch_forward<T, kInterleaved ? 2 : 1, false, kInterleaved, kCache>(a);
  }
}

template <typename T, bool kInterleaved>
void backward_for(const RotaryArgs<T>& a) {
  if (can_vectorize(a, false)) {
    launch_backward<T, pack_size<T>(), true, kInterleaved>(a);
  } else {
    launch_backward<T, kInterleaved ? 2 : 1, false, kInterleaved>(a);
  }
}

struct CudaKernels {
  static constexpr c10::DeviceType device = c10::DeviceType::CUDA;

  static c10::cuda::CUDAGuard guard(const at::Tensor& q) {
    return c10::cuda::CUDAGuard(q.device());
  }

  template <typename scalar_t>
  static void forward(const RotaryArgs<scalar_t>& a) {
    if (a.g.B * a.g.S == 0) {
      return;
    }
    const bool cache = a.pos != nullptr;
    if (a.interleaved) {
      cache ? forward_for<scalar_t, true, true>(a) : forward_for<scalar_t, true, false>(a);
    } else {
      cache ? forward_for<scalar_t, false, true>(a) : forward_for<scalar_t, false, false>(a);
    }
  }

  template <typename scalar_t>
  static void backward(const RotaryArgs<scalar_t>& a) {
    if (a.g.Bc * a.g.S == 0) {
      return;
    }
    if (a.interleaved) {
      backward_for<scalar_t, true>(a);
    } else {
      backward_for<scalar_t, false>(a);
    }
  }
};

}  // namespace

TORCHOPS_REGISTER_ROTARY(CUDA, CudaKernels)

}  // namespace torchops::cuda
