// CPU kernels of torchops.ms_deform_attn and its backward.
//
// Forward: at::parallel_for over the (batch, query) rows.  For each head the
// row's samples are first reduced to a list of taps (a corner inside the
// level: its row of value, C contiguous values, and its weight, attention
// times bilinear), then every channel sums its taps in list order, a block
// of channels held in vector registers while the taps stream past.
// Backward: at::parallel_for over (batch, head, level), each of which owns
// value's gradient at that head and level's positions (the levels'
// positions are disjoint once spatial_shapes is checked), so the scatter
// needs no atomics and adds in query order: the result does not depend on
// the thread count.  The same pass computes the locations' and weights'
// gradients: per corner one vector of g * value products over C, combined
// into the three sums (bilinear weight, d/dx, d/dy) before one horizontal
// reduction each.
//
// Everything is computed in float32 (float64 for float64): float16 and
// bfloat16 are widened as each vector is loaded, value's gradient is summed
// in a float32 copy of the task's positions and rounded once.  The vector
// code is AVX2 (cpu/common/vectorized.h); CPUs without it run scalar loops
// (float16 and bfloat16 widened whole first).  The values of spatial_shapes
// and level_start_index are checked here (host memory), so the loops read
// only inside value.
#include "cpu/common/vectorized.h"  // first: before any other vector include

#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "common/ms_deform_attn_steps.h"
#include "common/register_kernels.h"
#include "cpu/common/parallel.h"

namespace torchops::cpu {
namespace {

// y += a * x over n values; multi-versioned so the loop runs on AVX2 where
// the CPU has it.
TORCHOPS_CPU_MULTIVERSION void axpy(float a, const float* __restrict__ x,
                                    float* __restrict__ y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    y[i] += a * x[i];
  }
}

TORCHOPS_CPU_MULTIVERSION void axpy(double a, const double* __restrict__ x,
                                    double* __restrict__ y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    y[i] += a * x[i];
  }
}

// sum x[i] * y[i] in eight interleaved partial sums (a fixed order the
// compiler can keep in one vector register), added pairwise at the end.
template <typename T>
inline T dot8(const T* __restrict__ x, const T* __restrict__ y, int64_t n) {
  T part[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) {
      part[j] += x[i + j] * y[i + j];
    }
  }
  for (int j = 0; i < n; ++i, ++j) {
    part[j] += x[i] * y[i];
  }
  return ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
}

TORCHOPS_CPU_MULTIVERSION float dot(const float* x, const float* y, int64_t n) {
  return dot8(x, y, n);
}

TORCHOPS_CPU_MULTIVERSION double dot(const double* x, const double* y, int64_t n) {
  return dot8(x, y, n);
}

std::vector<MsdaLevel> host_levels(const at::Tensor& shapes, const at::Tensor& starts,
                                   int64_t spatial) {
  const int64_t* sh = shapes.const_data_ptr<int64_t>();
  const int64_t* st = starts.const_data_ptr<int64_t>();
  std::vector<MsdaLevel> levels;
  for (int64_t l = 0; l < shapes.size(0); ++l) {
    levels.push_back(msda_level(sh[2 * l], sh[2 * l + 1], st[l], spatial));
  }
  return levels;
}

// Work of one output row of one head is about L * P * 4 * C multiply-adds.
int64_t row_grain(const MsdaDims& d, int64_t per_row) {
  const int64_t work = std::max<int64_t>(1, per_row * d.levels * d.points * 4 * d.channels);
  return std::max<int64_t>(1, kElementwiseGrain / work);
}

template <typename T>
void forward_loop(const T* value, const std::vector<MsdaLevel>& levels, const T* loc,
                  const T* attn, const MsdaDims& d, T* out) {
  const int64_t C = d.channels, H = d.heads, LP = d.levels * d.points;
  const int64_t pixel = H * C;  // value's stride between positions
  parallel_range(d.batch * d.queries, [&](int64_t begin, int64_t end) {
    std::vector<T> acc(C);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / d.queries;
      for (int64_t h = 0; h < H; ++h) {
        std::fill(acc.begin(), acc.end(), T(0));
        const int64_t row = r * H + h;  // (b, q, h)
        const T* lrow = loc + row * LP * 2;
        const T* arow = attn + row * LP;
        for (int64_t l = 0; l < d.levels; ++l) {
          const MsdaLevel& lv = levels[l];
          const T* base = value + (b * d.spatial + lv.start) * pixel + h * C;
          for (int64_t p = 0; p < d.points; ++p) {
            const int64_t s = l * d.points + p;
            const MsdaTaps<T> t = msda_taps<T>(lv, lrow[2 * s], lrow[2 * s + 1]);
            if (!t.any) {
              continue;
            }
            for (int k = 0; k < 4; ++k) {
              if (t.pos[k] >= 0) {
                axpy(arow[s] * t.weight[k], base + t.pos[k] * pixel, acc.data(), C);
              }
            }
          }
        }
        std::copy(acc.begin(), acc.end(), out + row * C);
      }
    }
  }, row_grain(d, H));
}

template <typename T>
void backward_loop(const T* grad, const T* value, const std::vector<MsdaLevel>& levels,
                   const T* loc, const T* attn, const MsdaDims& d, T* grad_value,
                   T* grad_loc, T* grad_attn) {
  const int64_t C = d.channels, H = d.heads, LP = d.levels * d.points;
  const int64_t pixel = H * C;
  parallel_range(d.batch * H * d.levels, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t l = task % d.levels, bh = task / d.levels;
      const int64_t b = bh / H, h = bh % H;
      const MsdaLevel& lv = levels[l];
      for (int64_t q = 0; q < d.queries; ++q) {
        const int64_t row = (b * d.queries + q) * H + h;
        const T* g = grad + row * C;
        const T* lrow = loc + row * LP * 2;
        const T* arow = attn + row * LP;
        const int64_t first = (b * d.spatial + lv.start) * pixel + h * C;
        for (int64_t p = 0; p < d.points; ++p) {
          const int64_t s = l * d.points + p;
          const MsdaTaps<T> t = msda_taps<T>(lv, lrow[2 * s], lrow[2 * s + 1]);
          if (!t.any) {
            continue;
          }
          const T a = arow[s];
          T dh[4], dw[4];
          msda_tap_slopes(t, dh, dw);
          T ga = T(0), gx = T(0), gy = T(0);
          for (int k = 0; k < 4; ++k) {
            if (t.pos[k] < 0) {
              continue;
            }
            const int64_t off = first + t.pos[k] * pixel;
            const T dk = dot(g, value + off, C);
            ga += t.weight[k] * dk;
            gx += dw[k] * dk;
            gy += dh[k] * dk;
            axpy(a * t.weight[k], g, grad_value + off, C);
          }
          grad_attn[row * LP + s] = ga;
          grad_loc[(row * LP + s) * 2] = a * static_cast<T>(lv.width) * gx;
          grad_loc[(row * LP + s) * 2 + 1] = a * static_cast<T>(lv.height) * gy;
        }
      }
    }
  }, 1);
}

TORCHOPS_VEC_BEGIN

using at::vec::Vectorized;

// W values at p as a vector of T's math type (float16 and bfloat16 widened).
template <typename T>
inline Vectorized<at::opmath_type<T>> load_acc(const T* p) {
  if constexpr (std::is_same_v<T, at::opmath_type<T>>) {
    return Vectorized<T>::loadu(p);
  } else {
    Vectorized<float> v;
    at::vec::load_to_float(p, v);
    return v;
  }
}

template <typename T>
inline void store_acc(T* p, const Vectorized<at::opmath_type<T>>& v) {
  if constexpr (std::is_same_v<T, at::opmath_type<T>>) {
    v.store(p);
  } else {
    at::vec::convert_from_float<T>(v, v).store(p, Vectorized<float>::size());
  }
}

template <typename A>
inline A reduce_add(const Vectorized<A>& v) {
  return at::vec::vec_reduce_all<A>(
      [](const Vectorized<A>& x, const Vectorized<A>& y) { return x + y; }, v);
}

// msda_taps's corners of one sample, appended without branching on the
// data (a sample's corners fall inside or outside the level at random, which
// a branch predicts badly): value's offset (first + position * pixel) and
// weight (scale times the bilinear weight) of each corner inside, written at
// offs[n], wts[n] and on; returns the new count.  The slots up to n + 4 must
// exist.
template <typename A>
inline int64_t append_corners(const MsdaLevel& lv, A loc_x, A loc_y, A scale, int64_t first,
                              int64_t pixel, int64_t* offs, A* wts, int64_t n) {
  const A h_im = loc_y * static_cast<A>(lv.height) - A(0.5);
  const A w_im = loc_x * static_cast<A>(lv.width) - A(0.5);
  // NaN fails every comparison; rows <= S keeps the integer casts in range.
  const bool inside = (h_im > A(-1)) & (w_im > A(-1)) & (h_im < static_cast<A>(lv.rows)) &
                      (w_im < static_cast<A>(lv.width));
  const A fh = std::floor(inside ? h_im : A(0)), fw = std::floor(inside ? w_im : A(0));
  const int64_t y0 = static_cast<int64_t>(fh), x0 = static_cast<int64_t>(fw);
  const A lh = h_im - fh, lw = w_im - fw, hh = A(1) - lh, hw = A(1) - lw;
  const bool top = inside & (y0 >= 0), bottom = inside & (y0 + 1 < lv.rows);
  const bool left = x0 >= 0, right = x0 + 1 < lv.width;
  const int64_t at = first + (y0 * lv.width + x0) * pixel;
  offs[n] = at;
  wts[n] = scale * (hh * hw);
  n += top & left;
  offs[n] = at + pixel;
  wts[n] = scale * (hh * lw);
  n += top & right;
  offs[n] = at + lv.width * pixel;
  wts[n] = scale * (lh * hw);
  n += bottom & left;
  offs[n] = at + (lv.width + 1) * pixel;
  wts[n] = scale * (lh * lw);
  n += bottom & right;
  return n;
}

// Output rows [begin, end) of (batch, query); offs and wts hold the taps of
// one head (at least 4 * L * P each).
template <typename T>
void forward_rows_vec(const T* value, const MsdaLevel* levels, const T* loc, const T* attn,
                      const MsdaDims& d, T* out, int64_t begin, int64_t end, int64_t* offs,
                      at::opmath_type<T>* wts) {
  using A = at::opmath_type<T>;
  using V = Vectorized<A>;
  constexpr int64_t W = V::size();
  const int64_t C = d.channels, H = d.heads, LP = d.levels * d.points;
  const int64_t pixel = H * C;  // value's stride between positions
  for (int64_t r = begin; r < end; ++r) {
    const int64_t b = r / d.queries;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t row = r * H + h;  // (b, q, h)
      const T* lrow = loc + row * LP * 2;
      const T* arow = attn + row * LP;
      int64_t n = 0;
      for (int64_t l = 0; l < d.levels; ++l) {
        const MsdaLevel& lv = levels[l];
        const int64_t first = (b * d.spatial + lv.start) * pixel + h * C;
        for (int64_t p = 0; p < d.points; ++p) {
          const int64_t s = l * d.points + p;
          n = append_corners<A>(lv, static_cast<A>(lrow[2 * s]), static_cast<A>(lrow[2 * s + 1]),
                                static_cast<A>(arow[s]), first, pixel, offs, wts, n);
        }
      }
      T* o = out + row * C;
      int64_t c = 0;
      // Four vectors of channels stay in registers while the taps stream by.
      for (; c + 4 * W <= C; c += 4 * W) {
        V s0(A(0)), s1(A(0)), s2(A(0)), s3(A(0));
        for (int64_t i = 0; i < n; ++i) {
          const T* v = value + offs[i] + c;
          const V w(wts[i]);
          s0 = at::vec::fmadd(w, load_acc(v), s0);
          s1 = at::vec::fmadd(w, load_acc(v + W), s1);
          s2 = at::vec::fmadd(w, load_acc(v + 2 * W), s2);
          s3 = at::vec::fmadd(w, load_acc(v + 3 * W), s3);
        }
        store_acc(o + c, s0);
        store_acc(o + c + W, s1);
        store_acc(o + c + 2 * W, s2);
        store_acc(o + c + 3 * W, s3);
      }
      for (; c + W <= C; c += W) {
        V s0(A(0));
        for (int64_t i = 0; i < n; ++i) {
          s0 = at::vec::fmadd(V(wts[i]), load_acc(value + offs[i] + c), s0);
        }
        store_acc(o + c, s0);
      }
      for (; c < C; ++c) {
        A s0 = A(0);
        for (int64_t i = 0; i < n; ++i) {
          s0 += wts[i] * static_cast<A>(value[offs[i] + c]);
        }
        o[c] = static_cast<T>(s0);
      }
    }
  }
}

// How many queries ahead the backward prefetches its strided rows.
constexpr int64_t kAhead = 4;

inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
#if defined(__GNUC__) || defined(__clang__)
  if (bytes <= 0) {
    return;
  }
  for (int64_t i = 0; i < bytes; i += 64) {
    __builtin_prefetch(c + i);
  }
  __builtin_prefetch(c + bytes - 1);
#else
  (void)c;
  (void)bytes;
#endif
}

// Backward tasks [begin, end) of (batch, head, level).  Value's gradient is
// summed in place for float and double; for float16 and bfloat16 in a
// float32 buffer of the task's positions (`most`: the largest level's),
// rounded at the task's end.
template <typename T>
void backward_tasks_vec(const T* grad, const T* value, const MsdaLevel* levels, const T* loc,
                        const T* attn, const MsdaDims& d, T* grad_value, T* grad_loc,
                        T* grad_attn, int64_t begin, int64_t end, int64_t most) {
  using A = at::opmath_type<T>;
  using V = Vectorized<A>;
  constexpr bool widened = !std::is_same_v<T, A>;
  constexpr int64_t W = V::size();
  std::vector<A> acc_buf(widened ? most * d.channels : 0), g_buf(widened ? d.channels : 0);
  std::vector<A> scratch(d.points * (4 * W + 4 + 1));
  std::vector<MsdaTaps<A>> taps(d.points);
  std::vector<int64_t> corners(d.points * 8);
  int64_t* corner_pos = corners.data();                // (P * 4): level-relative positions
  int64_t* corner_slot = corner_pos + d.points * 4;    // (P * 4): p * 4 + k
  std::vector<A> corner_coefs(d.points * 4);
  A* corner_coef = corner_coefs.data();                // attention times bilinear weight
  A* acc = acc_buf.data();
  A* gbuf = g_buf.data();
  A* dots = scratch.data();               // (P, 4, W)
  A* tails = dots + d.points * 4 * W;     // (P, 4)
  A* scale = tails + d.points * 4;        // (P): the attention weights
  const int64_t C = d.channels, H = d.heads, LP = d.levels * d.points;
  const int64_t pixel = H * C;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t l = task % d.levels, bh = task / d.levels;
    const int64_t b = bh / H, h = bh % H;
    const MsdaLevel& lv = levels[l];
    const int64_t first = (b * d.spatial + lv.start) * pixel + h * C;
    const int64_t positions = lv.rows * lv.width;
    // Where value's gradient at the level's position pos starts, and the
    // stride between positions.
    A* gv = nullptr;
    int64_t gv_stride = 0;
    if constexpr (widened) {
      std::fill(acc, acc + positions * C, A(0));
      gv = acc;
      gv_stride = C;
    } else {
      gv = grad_value + first;
      gv_stride = pixel;
    }
    for (int64_t q = 0; q < d.queries; ++q) {
      const int64_t row = (b * d.queries + q) * H + h;
      const T* lrow = loc + row * LP * 2;
      const T* arow = attn + row * LP;
      if (q + kAhead < d.queries) {
        // A task reads a few bytes of each query's rows, a head's stride
        // apart: fetch the rows of a later query while this one computes.
        const int64_t ahead = row + kAhead * H;
        prefetch(loc + (ahead * LP + l * d.points) * 2, d.points * 2 * sizeof(T));
        prefetch(attn + ahead * LP + l * d.points, d.points * sizeof(T));
        prefetch(grad + ahead * C, C * sizeof(T));
      }
      const A* g = nullptr;
      if constexpr (widened) {
        for (int64_t c = 0; c < C; ++c) {
          gbuf[c] = static_cast<A>(grad[row * C + c]);
        }
        g = gbuf;
      } else {
        g = grad + row * C;
      }
      // The level's taps of this query, then the channels in blocks of up
      // to four vectors (grad's block held in registers), every sample's
      // corners in turn: value's gradient at the corner, and the vector of
      // g * value products summed over blocks per corner (dots).
      for (int64_t p = 0; p < d.points; ++p) {
        const int64_t s = l * d.points + p;
        taps[p] = msda_taps<A>(lv, static_cast<A>(lrow[2 * s]),
                               static_cast<A>(lrow[2 * s + 1]));
        scale[p] = static_cast<A>(arow[s]);
      }
      std::fill(dots, dots + 4 * d.points * W, A(0));
      std::fill(tails, tails + 4 * d.points, A(0));
      // The corners inside, listed without branching on the data.
      int64_t n = 0;
      for (int64_t p = 0; p < d.points; ++p) {
        const MsdaTaps<A>& t = taps[p];
        for (int k = 0; k < 4; ++k) {
          corner_pos[n] = t.pos[k];
          corner_slot[n] = p * 4 + k;
          corner_coef[n] = scale[p] * t.weight[k];
          n += t.pos[k] >= 0;
        }
      }
      int64_t c = 0;
      for (; c + 4 * W <= C; c += 4 * W) {
        const V g0 = V::loadu(g + c), g1 = V::loadu(g + c + W), g2 = V::loadu(g + c + 2 * W),
                g3 = V::loadu(g + c + 3 * W);
        for (int64_t i = 0; i < n; ++i) {
          const T* v = value + first + corner_pos[i] * pixel + c;
          A* gvk = gv + corner_pos[i] * gv_stride + c;
          A* dk = dots + corner_slot[i] * W;
          const V d01 = at::vec::fmadd(g1, load_acc(v + W), g0 * load_acc(v));
          const V d23 = at::vec::fmadd(g3, load_acc(v + 3 * W), g2 * load_acc(v + 2 * W));
          (V::loadu(dk) + (d01 + d23)).store(dk);
          const V coef(corner_coef[i]);
          at::vec::fmadd(coef, g0, V::loadu(gvk)).store(gvk);
          at::vec::fmadd(coef, g1, V::loadu(gvk + W)).store(gvk + W);
          at::vec::fmadd(coef, g2, V::loadu(gvk + 2 * W)).store(gvk + 2 * W);
          at::vec::fmadd(coef, g3, V::loadu(gvk + 3 * W)).store(gvk + 3 * W);
        }
      }
      for (; c + W <= C; c += W) {
        const V g0 = V::loadu(g + c);
        for (int64_t i = 0; i < n; ++i) {
          A* gvk = gv + corner_pos[i] * gv_stride + c;
          A* dk = dots + corner_slot[i] * W;
          at::vec::fmadd(g0, load_acc(value + first + corner_pos[i] * pixel + c), V::loadu(dk))
              .store(dk);
          at::vec::fmadd(V(corner_coef[i]), g0, V::loadu(gvk)).store(gvk);
        }
      }
      for (; c < C; ++c) {
        for (int64_t i = 0; i < n; ++i) {
          tails[corner_slot[i]] += g[c] * static_cast<A>(value[first + corner_pos[i] * pixel + c]);
          gv[corner_pos[i] * gv_stride + c] += corner_coef[i] * g[c];
        }
      }
      // Per sample: the sums over corners of (weight, d/dw, d/dh) times
      // g . value[corner], one horizontal reduction each.
      for (int64_t p = 0; p < d.points; ++p) {
        const MsdaTaps<A>& t = taps[p];
        if (!t.any) {
          continue;
        }
        const int64_t s = l * d.points + p;
        const A a = scale[p];
        A dh[4], dw[4];
        msda_tap_slopes(t, dh, dw);
        V va(A(0)), vx(A(0)), vy(A(0));
        A ta = A(0), tx = A(0), ty = A(0);
        // Corners outside add exact zeros: weight, slopes, dot and tail 0.
        for (int k = 0; k < 4; ++k) {
          const V dot = V::loadu(dots + (p * 4 + k) * W);
          const A tail = tails[p * 4 + k];
          va = at::vec::fmadd(V(t.weight[k]), dot, va);
          vx = at::vec::fmadd(V(dw[k]), dot, vx);
          vy = at::vec::fmadd(V(dh[k]), dot, vy);
          ta += t.weight[k] * tail;
          tx += dw[k] * tail;
          ty += dh[k] * tail;
        }
        const A ga = reduce_add(va) + ta, gx = reduce_add(vx) + tx, gy = reduce_add(vy) + ty;
        grad_attn[row * LP + s] = static_cast<T>(ga);
        grad_loc[(row * LP + s) * 2] = static_cast<T>(a * static_cast<A>(lv.width) * gx);
        grad_loc[(row * LP + s) * 2 + 1] = static_cast<T>(a * static_cast<A>(lv.height) * gy);
      }
    }
    if constexpr (widened) {
      for (int64_t pos = 0; pos < positions; ++pos) {
        T* dst = grad_value + first + pos * pixel;
        const A* src = acc + pos * C;
        int64_t c = 0;
        for (; c + W <= C; c += W) {
          store_acc(dst + c, V::loadu(src + c));
        }
        for (; c < C; ++c) {
          dst[c] = static_cast<T>(src[c]);
        }
      }
    }
  }
}

TORCHOPS_VEC_END

struct CpuKernels {
  static constexpr c10::DeviceType device = c10::DeviceType::CPU;

  struct NoGuard {};
  static NoGuard guard(const at::Tensor& /*value*/) { return {}; }

  static void check_levels(const char* op, const at::Tensor& shapes, const at::Tensor& starts,
                           int64_t spatial) {
    check_ms_deform_attn_levels(op, shapes.const_data_ptr<int64_t>(),
                                starts.const_data_ptr<int64_t>(), shapes.size(0), spatial);
  }

  template <typename scalar_t>
  static void forward(const at::Tensor& value, const at::Tensor& shapes, const at::Tensor& starts,
                      const at::Tensor& loc, const at::Tensor& attn, const MsdaDims& d,
                      at::Tensor& out) {
    const std::vector<MsdaLevel> levels = host_levels(shapes, starts, d.spatial);
    if (vec_available()) {
      using A = at::opmath_type<scalar_t>;
      const int64_t taps = 4 * d.levels * d.points;
      parallel_range(d.batch * d.queries, [&](int64_t begin, int64_t end) {
        std::vector<int64_t> offs(taps);
        std::vector<A> wts(taps);
        forward_rows_vec<scalar_t>(value.const_data_ptr<scalar_t>(), levels.data(),
                                   loc.const_data_ptr<scalar_t>(),
                                   attn.const_data_ptr<scalar_t>(), d,
                                   out.mutable_data_ptr<scalar_t>(), begin, end, offs.data(),
                                   wts.data());
      }, row_grain(d, d.heads));
      return;
    }
    if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>) {
      forward_loop<scalar_t>(value.const_data_ptr<scalar_t>(), levels,
                             loc.const_data_ptr<scalar_t>(), attn.const_data_ptr<scalar_t>(), d,
                             out.mutable_data_ptr<scalar_t>());
    } else {
      const at::Tensor v = value.to(at::kFloat), lo = loc.to(at::kFloat),
                       a = attn.to(at::kFloat);
      at::Tensor o = at::empty(out.sizes(), out.options().dtype(at::kFloat));
      forward_loop<float>(v.const_data_ptr<float>(), levels, lo.const_data_ptr<float>(),
                          a.const_data_ptr<float>(), d, o.mutable_data_ptr<float>());
      out.copy_(o);
    }
  }

  template <typename scalar_t>
  static void backward(const at::Tensor& grad, const at::Tensor& value, const at::Tensor& shapes,
                       const at::Tensor& starts, const at::Tensor& loc, const at::Tensor& attn,
                       const MsdaDims& d, at::Tensor& grad_value, at::Tensor& grad_loc,
                       at::Tensor& grad_attn) {
    const std::vector<MsdaLevel> levels = host_levels(shapes, starts, d.spatial);
    if (vec_available()) {
      int64_t most = 0;  // the largest level's positions
      for (const MsdaLevel& lv : levels) {
        most = std::max(most, lv.rows * lv.width);
      }
      parallel_range(d.batch * d.heads * d.levels, [&](int64_t begin, int64_t end) {
        backward_tasks_vec<scalar_t>(
            grad.const_data_ptr<scalar_t>(), value.const_data_ptr<scalar_t>(), levels.data(),
            loc.const_data_ptr<scalar_t>(), attn.const_data_ptr<scalar_t>(), d,
            grad_value.mutable_data_ptr<scalar_t>(), grad_loc.mutable_data_ptr<scalar_t>(),
            grad_attn.mutable_data_ptr<scalar_t>(), begin, end, most);
      }, 1);
      return;
    }
    if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>) {
      backward_loop<scalar_t>(grad.const_data_ptr<scalar_t>(), value.const_data_ptr<scalar_t>(),
                              levels, loc.const_data_ptr<scalar_t>(),
                              attn.const_data_ptr<scalar_t>(), d,
                              grad_value.mutable_data_ptr<scalar_t>(),
                              grad_loc.mutable_data_ptr<scalar_t>(),
                              grad_attn.mutable_data_ptr<scalar_t>());
    } else {
      const auto f32 = [](const at::Tensor& t) { return t.to(at::kFloat); };
      const at::Tensor g = f32(grad), v = f32(value), lo = f32(loc), a = f32(attn);
      at::Tensor gv = f32(grad_value), gl = f32(grad_loc), ga = f32(grad_attn);  // zeros
      backward_loop<float>(g.const_data_ptr<float>(), v.const_data_ptr<float>(), levels,
                           lo.const_data_ptr<float>(), a.const_data_ptr<float>(), d,
                           gv.mutable_data_ptr<float>(), gl.mutable_data_ptr<float>(),
                           ga.mutable_data_ptr<float>());
      grad_value.copy_(gv);
      grad_loc.copy_(gl);
      grad_attn.copy_(ga);
    }
  }
};

}  // namespace

TORCHOPS_REGISTER_STEPS(CPU, ms_deform_attn, CpuKernels)

}  // namespace torchops::cpu
