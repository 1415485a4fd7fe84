// CPU kernels of torchops.carafe and its backward.
//
// Output column ow = s q + phase reads source columns q + kx - r: for one
// phase, the output columns of a row are a contiguous run of source
// columns.  So the forward runs per phase: with the features zero-padded by
// r once (a padded copy, in the compute type), the tap (ky, kx) of a run of
// output columns reads a contiguous run of a padded row, and its weights --
// the masks of those columns, split by phase once per task -- are
// contiguous too: every tap is a vectorisable multiply-add.  A task is one
// source row y of one (image, group) and a span of kSpan source columns; its
// phase-split masks (s^2 k^2 rows of the span) stay in cache while every
// channel of the group streams past them; results are interleaved back into
// the s output rows on the store.
//
// The backward is a gather too, so it needs no atomics and its result does
// not depend on the number of threads:
//  * grad_masks: the forward's tasks, accumulating grad (split by phase) *
//    padded feature rows over the group's channels, in channel order;
//  * grad_features: per (image, group, source row y) and channel, the output
//    rows whose neighbourhoods contain row y are multiplied by their masks
//    and added, shifted by tap, into a row in output coordinates, then each
//    feature pixel sums its s columns.
// Half types compute in float: features, masks and grads are converted once
// into float rows.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common/carafe.h"
#include "common/carafe_steps.h"
#include "cpu/common/parallel.h"

namespace torchops::cpu {
namespace {

// Source columns per forward / grad_masks task.
constexpr int64_t kSpan = 64;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// 32 bytes of T, loaded and stored unaligned (GCC/Clang vector extension:
// explicit vectors keep the accumulators of taps_dot in registers, which
// the auto-vectoriser did not; the baseline build splits them in halves).
template <typename T>
struct Vec {
  typedef T type __attribute__((vector_size(32), aligned(sizeof(T))));
  static constexpr int64_t kLanes = 32 / sizeof(T);
};

// acc[j] = sum_t p[t][j] * m[t][j] for j < n, taps in order.  Four
// accumulators in flight hide the FMA latency.
template <typename T>
inline __attribute__((always_inline)) void taps_dot_impl(
    const T* const* p, const T* const* m, int64_t taps, int64_t n,
    T* __restrict__ acc) {
  using V = typename Vec<T>::type;
  constexpr int64_t kLanes = Vec<T>::kLanes;
  int64_t j = 0;
  for (; j + 4 * kLanes <= n; j += 4 * kLanes) {
    V a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int64_t t = 0; t < taps; ++t) {
      const V* pv = reinterpret_cast<const V*>(p[t] + j);
      const V* mv = reinterpret_cast<const V*>(m[t] + j);
      a0 += pv[0] * mv[0];
      a1 += pv[1] * mv[1];
      a2 += pv[2] * mv[2];
      a3 += pv[3] * mv[3];
    }
    V* out = reinterpret_cast<V*>(acc + j);
    out[0] = a0;
    out[1] = a1;
    out[2] = a2;
    out[3] = a3;
  }
  for (; j + kLanes <= n; j += kLanes) {
    V a = {};
    for (int64_t t = 0; t < taps; ++t) {
      a += *reinterpret_cast<const V*>(p[t] + j) *
           *reinterpret_cast<const V*>(m[t] + j);
    }
    *reinterpret_cast<V*>(acc + j) = a;
  }
  for (; j < n; ++j) {
    T a = T(0);
    for (int64_t t = 0; t < taps; ++t) {
      a += p[t][j] * m[t][j];
    }
    acc[j] = a;
  }
}

// out[t][j] += g[j] * p[t][j] for every tap t and j < n.
template <typename T>
inline __attribute__((always_inline)) void taps_axpy_impl(
    const T* __restrict__ g, const T* const* p, T* const* out, int64_t taps,
    int64_t n) {
  for (int64_t t = 0; t < taps; ++t) {
    const T* __restrict__ pt = p[t];
    T* __restrict__ ot = out[t];
    for (int64_t j = 0; j < n; ++j) {
      ot[j] += g[j] * pt[j];
    }
  }
}

#define TORCHOPS_CARAFE_LOOPS(T)                                               \
  TORCHOPS_CPU_MULTIVERSION void taps_dot(const T* const* p,                   \
                                          const T* const* m, int64_t taps,     \
                                          int64_t n, T* acc) {                 \
    taps_dot_impl(p, m, taps, n, acc);                                         \
  }                                                                            \
  TORCHOPS_CPU_MULTIVERSION void taps_axpy(const T* g, const T* const* p,      \
                                           T* const* out, int64_t taps,        \
                                           int64_t n) {                        \
    taps_axpy_impl(g, p, out, taps, n);                                        \
  }
TORCHOPS_CARAFE_LOOPS(float)
TORCHOPS_CARAFE_LOOPS(double)
#undef TORCHOPS_CARAFE_LOOPS

// `n` values of `src` as T: the row itself when it already is T, else a
// conversion into buf[offset, offset + n) (`buf` is only sized for half types).
template <typename T, typename scalar_t>
const T* as_opmath(const scalar_t* src, int64_t n, std::vector<T>& buf,
                   int64_t offset = 0) {
  if constexpr (std::is_same_v<T, scalar_t>) {
    return src;
  } else {
    T* dst = buf.data() + offset;
    for (int64_t j = 0; j < n; ++j) {
      dst[j] = static_cast<T>(src[j]);
    }
    return dst;
  }
}

// Task index -> (image, group, source row, span of source columns).
struct Task {
  int64_t n, grp, y, q0, len;
};

Task task_of(const CarafeShape& p, int64_t task, int64_t spans) {
  Task t;
  const int64_t span = task % spans;
  int64_t rest = task / spans;
  t.y = rest % p.h;
  rest /= p.h;
  t.grp = rest % p.g;
  t.n = rest / p.g;
  t.q0 = span * kSpan;
  t.len = std::min(kSpan, p.w - t.q0);
  return t;
}

// Phase-split rows of a task: row (i, phase, tap) holds, for the task's
// source columns q0 + q, the value at output row y s + i, column
// s (q0 + q) + phase of map `tap` (maps `oplane` apart).
struct PhaseRows {
  int64_t len, taps, s;
  int64_t index(int64_t i, int64_t phase, int64_t tap) const {
    return ((i * s + phase) * taps + tap) * kSpan;
  }
};

template <typename scalar_t, typename T>
void split_phases(const CarafeShape& p, const Task& t, const scalar_t* maps,
                  int64_t taps, T* dst) {
  const PhaseRows rows{t.len, taps, p.s};
  const int64_t oplane = p.ho * p.wo;
  for (int64_t tap = 0; tap < taps; ++tap) {
    for (int64_t i = 0; i < p.s; ++i) {
      const scalar_t* src =
          maps + tap * oplane + (t.y * p.s + i) * p.wo + t.q0 * p.s;
      for (int64_t phase = 0; phase < p.s; ++phase) {
        T* d = dst + rows.index(i, phase, tap);
        for (int64_t q = 0; q < t.len; ++q) {
          d[q] = static_cast<T>(src[q * p.s + phase]);
        }
      }
    }
  }
}

// Zeroes the phase-split mask rows of the taps that read outside the
// feature map (carafe_tap_inside): the padded features there are zero, and
// an inf or NaN mask weight must not turn 0 into NaN.
template <typename T>
void drop_outside_taps(const CarafeShape& p, const Task& t, T* rows_data) {
  const PhaseRows rows{t.len, p.taps(), p.s};
  const int64_t r = p.radius();
  for (int64_t tap = 0; tap < p.taps(); ++tap) {
    const int64_t ky = tap / p.k, kx = tap % p.k;
    for (int64_t q = 0; q < t.len; ++q) {
      if (carafe_tap_inside(t.y, t.q0 + q, ky, kx, r, p.h, p.w)) {
        continue;
      }
      for (int64_t i = 0; i < p.s; ++i) {
        for (int64_t phase = 0; phase < p.s; ++phase) {
          rows_data[rows.index(i, phase, tap) + q] = T(0);
        }
      }
    }
  }
}

// The features of every (image, channel) in T, zero-padded by r on each
// side: rows of w + 2 r.
at::Tensor padded_features(const at::Tensor& features, int64_t r) {
  const at::ScalarType t = at::toOpMathType(features.scalar_type());
  return at::constant_pad_nd(features.to(t), {r, r, r, r}, 0).contiguous();
}

// Tap pointers into the task's image's padded plane of channel c (of
// `padded`, the planes of padded_features): tap (ky, kx) reads padded row
// y + ky from column q0 + kx.
template <typename T>
void tap_rows(const CarafeShape& p, const Task& t, const T* padded, int64_t c,
              const T** taps) {
  const int64_t pw = p.w + 2 * p.radius();
  const T* plane = padded + (t.n * p.c + c) * (p.h + 2 * p.radius()) * pw;
  for (int64_t ky = 0; ky < p.k; ++ky) {
    for (int64_t kx = 0; kx < p.k; ++kx) {
      taps[ky * p.k + kx] = plane + (t.y + ky) * pw + t.q0 + kx;
    }
  }
}

// Runs every task, in parallel.  `chunk()` is called once per parallel chunk
// and returns the function that runs one task, so that a thread allocates
// its buffers once for all the tasks of its chunk.
template <typename Chunk>
void parallel_over_tasks(const CarafeShape& p, const Chunk& chunk) {
  const int64_t spans = ceil_div(p.w, kSpan);
  at::parallel_for(0, p.n * p.g * p.h * spans, 1, [&](int64_t b, int64_t e) {
    auto run = chunk();
    for (int64_t task = b; task < e; ++task) {
      run(task_of(p, task, spans));
    }
  });
}

template <typename scalar_t>
void forward_kernel(const CarafeShape& p, const at::Tensor& padded,
                    const scalar_t* masks, scalar_t* out) {
  using T = at::opmath_type<scalar_t>;
  const int64_t k2 = p.taps(), s = p.s, cg = p.group_channels();
  const int64_t oplane = p.ho * p.wo;
  const T* fp = padded.const_data_ptr<T>();
  parallel_over_tasks(p, [&] {
    return [&, mrows = std::vector<T>(s * s * k2 * kSpan),
            acc = std::vector<T>(s * kSpan), taps = std::vector<const T*>(k2),
            m = std::vector<const T*>(k2)](const Task& t) mutable {
      const PhaseRows rows{t.len, k2, s};
      split_phases(p, t, masks + (t.n * p.g + t.grp) * k2 * oplane, k2,
                   mrows.data());
      drop_outside_taps(p, t, mrows.data());
      for (int64_t c = t.grp * cg; c < (t.grp + 1) * cg; ++c) {
        tap_rows(p, t, fp, c, taps.data());
        for (int64_t i = 0; i < s; ++i) {
          for (int64_t phase = 0; phase < s; ++phase) {
            for (int64_t tap = 0; tap < k2; ++tap) {
              m[tap] = mrows.data() + rows.index(i, phase, tap);
            }
            taps_dot(taps.data(), m.data(), k2, t.len,
                     acc.data() + phase * kSpan);
          }
          scalar_t* o = out + (t.n * p.c + c) * oplane + (t.y * s + i) * p.wo +
                        t.q0 * s;
          for (int64_t q = 0; q < t.len; ++q) {
            for (int64_t phase = 0; phase < s; ++phase) {
              o[q * s + phase] = static_cast<scalar_t>(acc[phase * kSpan + q]);
            }
          }
        }
      }
    };
  });
}

template <typename scalar_t>
void grad_masks_kernel(const CarafeShape& p, const scalar_t* grad,
                       const at::Tensor& padded, scalar_t* grad_masks) {
  using T = at::opmath_type<scalar_t>;
  const int64_t k2 = p.taps(), s = p.s, cg = p.group_channels();
  const int64_t oplane = p.ho * p.wo;
  const T* fp = padded.const_data_ptr<T>();
  parallel_over_tasks(p, [&] {
    return [&, acc = std::vector<T>(s * s * k2 * kSpan),
            grows = std::vector<T>(s * s * kSpan),
            taps = std::vector<const T*>(k2),
            outs = std::vector<T*>(k2)](const Task& t) mutable {
      const PhaseRows rows{t.len, k2, s};
      const PhaseRows grad_rows{t.len, 1, s};
      std::fill(acc.begin(), acc.end(), T(0));
      for (int64_t c = t.grp * cg; c < (t.grp + 1) * cg; ++c) {
        tap_rows(p, t, fp, c, taps.data());
        split_phases(p, t, grad + (t.n * p.c + c) * oplane, 1, grows.data());
        for (int64_t i = 0; i < s; ++i) {
          for (int64_t phase = 0; phase < s; ++phase) {
            for (int64_t tap = 0; tap < k2; ++tap) {
              outs[tap] = acc.data() + rows.index(i, phase, tap);
            }
            taps_axpy(grows.data() + grad_rows.index(i, phase, 0), taps.data(),
                      outs.data(), k2, t.len);
          }
        }
      }
      for (int64_t tap = 0; tap < k2; ++tap) {
        for (int64_t i = 0; i < s; ++i) {
          scalar_t* o = grad_masks + ((t.n * p.g + t.grp) * k2 + tap) * oplane +
                        (t.y * s + i) * p.wo + t.q0 * s;
          for (int64_t q = 0; q < t.len; ++q) {
            for (int64_t phase = 0; phase < s; ++phase) {
              o[q * s + phase] =
                  static_cast<scalar_t>(acc[rows.index(i, phase, tap) + q]);
            }
          }
        }
      }
    };
  });
}

template <typename scalar_t>
void grad_features_kernel(const CarafeShape& p, const scalar_t* grad,
                          const scalar_t* masks, scalar_t* grad_features) {
  using T = at::opmath_type<scalar_t>;
  const int64_t k = p.k, k2 = p.taps(), s = p.s, r = p.radius();
  const int64_t cg = p.group_channels();
  const int64_t plane = p.h * p.w, oplane = p.ho * p.wo;
  const int64_t width = p.wo + 2 * r * s;  // a window row over the whole width
  at::parallel_for(0, p.n * p.g * p.h, 1, [&](int64_t b, int64_t e) {
    struct {
      std::vector<T> window, masks, row;
      std::vector<const T*> m;
      std::vector<T*> out;
    } sc;
    sc.window.resize(width);
    sc.masks.resize(std::is_same_v<T, scalar_t> ? 0 : k2 * s * p.wo);
    sc.row.resize(p.wo);
    sc.m.resize(k2 * s);
    sc.out.resize(k);
    for (int64_t task = b; task < e; ++task) {
      const int64_t y = task % p.h, grp = (task / p.h) % p.g;
      const int64_t n = task / (p.h * p.g);
      // Output rows (y + r - ky) s + i hold the pixels whose tap ky reads
      // row y; their mask rows, tap (ky, kx): sc.m[(ky * s + i) * k + kx].
      for (int64_t ky = 0; ky < k; ++ky) {
        const int64_t qy = y + r - ky;
        for (int64_t i = 0; i < s; ++i) {
          for (int64_t kx = 0; kx < k; ++kx) {
            const int64_t slot = (ky * s + i) * k + kx;
            sc.m[slot] = nullptr;
            if (qy >= 0 && qy < p.h) {
              sc.m[slot] = as_opmath<T>(
                  masks + ((n * p.g + grp) * k2 + ky * k + kx) * oplane +
                      (qy * s + i) * p.wo,
                  p.wo, sc.masks, slot * p.wo);
            }
          }
        }
      }
      for (int64_t kx = 0; kx < k; ++kx) {
        sc.out[kx] = sc.window.data() + kx * s;
      }
      for (int64_t c = grp * cg; c < (grp + 1) * cg; ++c) {
        std::fill(sc.window.begin(), sc.window.end(), T(0));
        for (int64_t ky = 0; ky < k; ++ky) {
          const int64_t qy = y + r - ky;
          if (qy < 0 || qy >= p.h) {
            continue;
          }
          for (int64_t i = 0; i < s; ++i) {
            const T* g = as_opmath<T>(
                grad + (n * p.c + c) * oplane + (qy * s + i) * p.wo, p.wo,
                sc.row);
            // window[kx s + ow] += g[ow] m[kx][ow]: one tap per call, as
            // the shifted rows of the taps overlap.
            for (int64_t kx = 0; kx < k; ++kx) {
              taps_axpy(g, &sc.m[(ky * s + i) * k + kx], &sc.out[kx], 1, p.wo);
            }
          }
        }
        // Feature column x gathers window columns (x + r) s .. + s - 1.
        scalar_t* dst = grad_features + (n * p.c + c) * plane + y * p.w;
        for (int64_t x = 0; x < p.w; ++x) {
          const T* v = sc.window.data() + (x + r) * s;
          T a = T(0);
          for (int64_t j = 0; j < s; ++j) {
            a += v[j];
          }
          dst[x] = static_cast<scalar_t>(a);
        }
      }
    }
  });
}

// The steps of common/carafe_steps.h, on the CPU.
struct CpuKernels {
  static constexpr c10::DeviceType device = c10::DeviceType::CPU;

  struct NoGuard {};
  static NoGuard guard(const at::Tensor& /*features*/) { return {}; }

  static at::Tensor features(const at::Tensor& features, const CarafeShape& p) {
    return padded_features(features, p.radius());
  }

  template <typename scalar_t>
  static void forward(const CarafeShape& p, const at::Tensor& padded,
                      const scalar_t* masks, scalar_t* out) {
    forward_kernel<scalar_t>(p, padded, masks, out);
  }

  template <typename scalar_t>
  static void grad_masks(const CarafeShape& p, const scalar_t* grad,
                         const at::Tensor& padded, scalar_t* out) {
    grad_masks_kernel<scalar_t>(p, grad, padded, out);
  }

  template <typename scalar_t>
  static void grad_features(const CarafeShape& p, const scalar_t* grad,
                            const scalar_t* masks, const at::Tensor& /*padded*/,
                            scalar_t* out) {
    grad_features_kernel<scalar_t>(p, grad, masks, out);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CPU, m) {
  m.impl("carafe", &carafe_forward<CpuKernels>);
  m.impl("_carafe_backward", &carafe_backward<CpuKernels>);
}

}  // namespace torchops::cpu
