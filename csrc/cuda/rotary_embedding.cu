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
  rotary_forward_kernel<T, V, kVec, kInterleaved, kCache>
      <<<blocks_for(a.g.B * a.g.S), block_for(units), 0, current_stream()>>>(a);
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
  if (can_vectorize(a, kCache)) {
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
