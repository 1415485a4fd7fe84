// CPU kernels of torchops.carafe and its backward.
//
// A task is one source row y of one (image, group), for a span of at most
// kColumns output columns: the s output rows y s .. y s + s - 1.  Its masks
// (s k^2 rows of the span) stay in cache while every channel of the group
// streams past them.  Per channel, the k source rows around y are expanded
// once into "window" rows in output coordinates: window[ky][t] is the
// feature pixel (y + ky - r, (x0 + t) / s - r), zero in the padding, so the
// tap (ky, kx) of output column x0 + j reads window[ky][j + kx s] -- every
// tap is a contiguous, vectorisable multiply-add over the span.
//
// The backward is a gather too, so it needs no atomics and its result does
// not depend on the number of threads:
//  * grad_masks: the forward's tasks, accumulating grad * window over the
//    group's channels, in channel order;
//  * grad_features: per (image, group, source row y) and channel, the output
//    rows whose neighbourhoods contain row y are multiplied by their masks
//    and added into a row in window coordinates (the transpose of the
//    forward's expansion), then each feature pixel sums its s columns.
// Half types compute in float: features, masks and grads are converted once
// into float rows.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common/carafe.h"
#include "cpu/common/parallel.h"

namespace torchops::cpu {
namespace {

// Output columns per forward / grad_masks task.
constexpr int64_t kColumns = 128;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// acc[j] = sum_t p[t][j] * m[t][j] for j < n, taps in order (so the result
// does not depend on how j is blocked).
template <typename T>
inline __attribute__((always_inline)) void taps_dot_impl(
    const T* const* p, const T* const* m, int64_t taps, int64_t n,
    T* __restrict__ acc) {
  constexpr int64_t kBlock = 16;
  int64_t j = 0;
  for (; j + kBlock <= n; j += kBlock) {
    T a[kBlock] = {};
    for (int64_t t = 0; t < taps; ++t) {
      const T* __restrict__ pt = p[t] + j;
      const T* __restrict__ mt = m[t] + j;
      for (int64_t q = 0; q < kBlock; ++q) {
        a[q] += pt[q] * mt[q];
      }
    }
    for (int64_t q = 0; q < kBlock; ++q) {
      acc[j + q] = a[q];
    }
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

template <typename T, typename scalar_t>
void store_row(const T* src, int64_t n, scalar_t* dst) {
  for (int64_t j = 0; j < n; ++j) {
    dst[j] = static_cast<scalar_t>(src[j]);
  }
}

// Task index -> (image, group, source row, column span).
struct Task {
  int64_t n, grp, y, x0, len;
};

Task task_of(const CarafeShape& p, int64_t task, int64_t spans,
             int64_t span_width) {
  Task t;
  const int64_t span = task % spans;
  int64_t rest = task / spans;
  t.y = rest % p.h;
  rest /= p.h;
  t.grp = rest % p.g;
  t.n = rest / p.g;
  t.x0 = span * span_width;
  t.len = std::min(span_width, p.wo - t.x0);
  return t;
}

// The k window rows of channel plane `f` around source row y for output
// columns [x0, x0 + len): row ky holds len + 2 r s values, from output
// column x0 - r s on.
template <typename scalar_t, typename T>
void build_window(const CarafeShape& p, const scalar_t* f, int64_t y,
                  int64_t x0, int64_t len, T* window) {
  const int64_t r = p.radius(), s = p.s;
  const int64_t width = len + 2 * r * s;
  for (int64_t ky = 0; ky < p.k; ++ky) {
    T* row = window + ky * width;
    const int64_t yy = y + ky - r;
    if (yy < 0 || yy >= p.h) {
      std::fill(row, row + width, T(0));
      continue;
    }
    const scalar_t* src = f + yy * p.w;
    // Window column t is output column x0 + t - r s, whose source column
    // floor((x0 + t - r s) / s) is written (x0 + t) / s - r: C's division
    // truncates, and x0 + t is never negative.
    for (int64_t t = 0; t < width; ++t) {
      const int64_t x = (x0 + t) / s - r;
      row[t] = (x >= 0 && x < p.w) ? static_cast<T>(src[x]) : T(0);
    }
  }
}

// Per-thread scratch rows of the three kernels.
template <typename T>
struct Scratch {
  std::vector<T> window, masks, acc, row;
  std::vector<const T*> p, m;
  std::vector<T*> out;
};

template <typename scalar_t>
void forward_kernel(const CarafeShape& p, const scalar_t* features,
                    const scalar_t* masks, scalar_t* out) {
  using T = at::opmath_type<scalar_t>;
  const int64_t k2 = p.taps(), s = p.s, cg = p.group_channels();
  const int64_t spans = ceil_div(p.wo, kColumns);
  const int64_t span_width = std::min(kColumns, p.wo);
  const int64_t win = span_width + 2 * p.radius() * s;
  const int64_t plane = p.h * p.w, oplane = p.ho * p.wo;
  at::parallel_for(0, p.n * p.g * p.h * spans, 1, [&](int64_t b, int64_t e) {
    Scratch<T> sc;
    sc.window.resize(p.k * win);
    sc.masks.resize(std::is_same_v<T, scalar_t> ? 0 : s * k2 * span_width);
    sc.acc.resize(span_width);
    sc.p.resize(k2);
    sc.m.resize(s * k2);
    for (int64_t task = b; task < e; ++task) {
      const Task t = task_of(p, task, spans, span_width);
      const int64_t w = t.len + 2 * p.radius() * s;
      for (int64_t i = 0; i < s; ++i) {
        for (int64_t kk = 0; kk < k2; ++kk) {
          const scalar_t* src =
              masks + ((t.n * p.g + t.grp) * k2 + kk) * oplane +
              (t.y * s + i) * p.wo + t.x0;
          sc.m[i * k2 + kk] =
              as_opmath<T>(src, t.len, sc.masks, (i * k2 + kk) * span_width);
        }
      }
      for (int64_t kk = 0; kk < k2; ++kk) {
        sc.p[kk] = sc.window.data() + (kk / p.k) * w + (kk % p.k) * s;
      }
      for (int64_t c = t.grp * cg; c < (t.grp + 1) * cg; ++c) {
        build_window(p, features + (t.n * p.c + c) * plane, t.y, t.x0, t.len,
                     sc.window.data());
        for (int64_t i = 0; i < s; ++i) {
          taps_dot(sc.p.data(), sc.m.data() + i * k2, k2, t.len, sc.acc.data());
          store_row(sc.acc.data(), t.len,
                    out + (t.n * p.c + c) * oplane + (t.y * s + i) * p.wo + t.x0);
        }
      }
    }
  });
}

template <typename scalar_t>
void grad_masks_kernel(const CarafeShape& p, const scalar_t* grad,
                       const scalar_t* features, scalar_t* grad_masks) {
  using T = at::opmath_type<scalar_t>;
  const int64_t k2 = p.taps(), s = p.s, cg = p.group_channels();
  const int64_t spans = ceil_div(p.wo, kColumns);
  const int64_t span_width = std::min(kColumns, p.wo);
  const int64_t win = span_width + 2 * p.radius() * s;
  const int64_t plane = p.h * p.w, oplane = p.ho * p.wo;
  at::parallel_for(0, p.n * p.g * p.h * spans, 1, [&](int64_t b, int64_t e) {
    Scratch<T> sc;
    sc.window.resize(p.k * win);
    sc.acc.resize(s * k2 * span_width);
    sc.row.resize(span_width);
    sc.p.resize(k2);
    sc.out.resize(k2);
    for (int64_t task = b; task < e; ++task) {
      const Task t = task_of(p, task, spans, span_width);
      const int64_t w = t.len + 2 * p.radius() * s;
      std::fill(sc.acc.begin(), sc.acc.end(), T(0));
      for (int64_t kk = 0; kk < k2; ++kk) {
        sc.p[kk] = sc.window.data() + (kk / p.k) * w + (kk % p.k) * s;
      }
      for (int64_t c = t.grp * cg; c < (t.grp + 1) * cg; ++c) {
        build_window(p, features + (t.n * p.c + c) * plane, t.y, t.x0, t.len,
                     sc.window.data());
        for (int64_t i = 0; i < s; ++i) {
          const T* g = as_opmath<T>(
              grad + (t.n * p.c + c) * oplane + (t.y * s + i) * p.wo + t.x0,
              t.len, sc.row);
          for (int64_t kk = 0; kk < k2; ++kk) {
            sc.out[kk] = sc.acc.data() + (i * k2 + kk) * span_width;
          }
          taps_axpy(g, sc.p.data(), sc.out.data(), k2, t.len);
        }
      }
      for (int64_t i = 0; i < s; ++i) {
        for (int64_t kk = 0; kk < k2; ++kk) {
          store_row(sc.acc.data() + (i * k2 + kk) * span_width, t.len,
                    grad_masks + ((t.n * p.g + t.grp) * k2 + kk) * oplane +
                        (t.y * s + i) * p.wo + t.x0);
        }
      }
    }
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
    Scratch<T> sc;
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

at::Tensor carafe(const at::Tensor& features_in, const at::Tensor& masks_in,
                  int64_t kernel_size, int64_t group_size,
                  int64_t scale_factor) {
  const char* op = "carafe";
  const CarafeShape p =
      check_carafe(op, features_in, masks_in, kernel_size, group_size,
                   scale_factor, c10::DeviceType::CPU);
  at::Tensor out = new_output(op, {p.n, p.c, p.ho, p.wo}, features_in.options());
  if (out.numel() == 0) {
    return out;
  }
  const at::Tensor features = features_in.contiguous();
  const at::Tensor masks = masks_in.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, features.scalar_type(), "torchops.carafe", [&] {
        forward_kernel<scalar_t>(p, features.const_data_ptr<scalar_t>(),
                                 masks.const_data_ptr<scalar_t>(),
                                 out.mutable_data_ptr<scalar_t>());
      });
  return out;
}

std::tuple<at::Tensor, at::Tensor> carafe_backward(
    const at::Tensor& grad_in, const at::Tensor& features_in,
    const at::Tensor& masks_in, int64_t kernel_size, int64_t group_size,
    int64_t scale_factor) {
  const char* op = "_carafe_backward";
  const CarafeShape p =
      check_carafe_backward(op, grad_in, features_in, masks_in, kernel_size,
                            group_size, scale_factor, c10::DeviceType::CPU);
  at::Tensor grad_features =
      new_output(op, {p.n, p.c, p.h, p.w}, features_in.options());
  at::Tensor grad_masks =
      new_output(op, {p.n, p.g * p.taps(), p.ho, p.wo}, masks_in.options());
  if (grad_features.numel() == 0 && grad_masks.numel() == 0) {
    return {grad_features, grad_masks};
  }
  if (p.c == 0 || p.h == 0 || p.w == 0) {
    // No channels: no output, so every mask gets a zero gradient.
    grad_masks.zero_();
    return {grad_features, grad_masks};
  }
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor features = features_in.contiguous();
  const at::Tensor masks = masks_in.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, features.scalar_type(),
      "torchops._carafe_backward", [&] {
        grad_masks_kernel<scalar_t>(p, grad.const_data_ptr<scalar_t>(),
                                    features.const_data_ptr<scalar_t>(),
                                    grad_masks.mutable_data_ptr<scalar_t>());
        grad_features_kernel<scalar_t>(p, grad.const_data_ptr<scalar_t>(),
                                       masks.const_data_ptr<scalar_t>(),
                                       grad_features.mutable_data_ptr<scalar_t>());
      });
  return {grad_features, grad_masks};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CPU, m) {
  m.impl("carafe", &carafe);
  m.impl("_carafe_backward", &carafe_backward);
}

}  // namespace torchops::cpu
