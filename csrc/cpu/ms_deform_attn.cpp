// CPU kernels of torchops.ms_deform_attn and its backward.
//
// Forward: at::parallel_for over the (batch, query) rows; each head's output
// row sums its samples' corner rows of value (C contiguous values each) with
// an axpy over C.  Backward: at::parallel_for over (batch, head, level), each
// of which owns value's gradient at that head and level's positions (the
// levels' positions are disjoint once spatial_shapes is checked), so the
// scatter needs no atomics and adds in query order: the result does not
// depend on the thread count.  The same pass computes the locations' and
// weights' gradients (dot products over C).
//
// float and double run the loops in their own type; float16 and bfloat16 are
// converted to float32 first and the results rounded once.  The values of
// spatial_shapes and level_start_index are checked here (host memory), so
// the loops read only inside value.
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
