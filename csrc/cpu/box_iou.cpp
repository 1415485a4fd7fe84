// CPU kernels of torchops.box_iou and its backward.
//
// Boxes are first copied into structure-of-arrays buffers in the op math type
// (O(N + M), negligible next to the N x M pairs), so every inner loop runs
// over unit-stride arrays and vectorises; rows (forward, grad of boxes1) or
// column chunks (grad of boxes2) are split over threads.  Every output
// element is reduced by one thread in a fixed order: results are
// deterministic and independent of the thread count.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu/common/box_arrays.h"
#include "cpu/common/parallel.h"

// GCC vectorises the gradient loops only without -ftrapping-math: with it,
// the clamp and tie selects of box_iou_pair_grad stay branches.  Nothing in
// this file reads floating-point exception flags.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")
#endif

#include "common/box_iou.h"
#include "common/register_kernels.h"

namespace torchops::cpu {
namespace {

constexpr int64_t kChunk = 256;  // columns per buffer / per grad-of-boxes2 task

// Boxes as structure of arrays, op math type.
template <typename T>
struct BoxArrays {
  std::vector<T> x1, y1, x2, y2, area;

  Box<T> box(int64_t i) const {
    return {x1[i], y1[i], x2[i], y2[i]};
  }
};

template <typename T, typename scalar_t>
BoxArrays<T> box_arrays(const at::Tensor& boxes) {
  const int64_t n = boxes.size(0);
  BoxArrays<T> out;
  for (auto* v : {&out.x1, &out.y1, &out.x2, &out.y2, &out.area}) {
    v->resize(n);
  }
  const at::Tensor b = boxes.contiguous();
  const scalar_t* p = b.const_data_ptr<scalar_t>();
  for (int64_t i = 0; i < n; ++i) {
    load_box<T>(p, i, out, i);
  }
  return out;
}

template <typename T>
struct Cols {  // pointers into a BoxArrays, offset to a chunk
  const T *x1, *y1, *x2, *y2, *area;
};

template <typename T>
Cols<T> cols_of(const BoxArrays<T>& b, int64_t offset) {
  return {b.x1.data() + offset, b.y1.data() + offset, b.x2.data() + offset,
          b.y2.data() + offset, b.area.data() + offset};
}

// out[j] = iou(a, cols[j]) for j < m.
template <typename T>
inline __attribute__((always_inline)) void iou_row_impl(
    const Box<T>& a, T area_a, Cols<T> c, int64_t m, T* __restrict__ out) {
#pragma omp simd
  for (int64_t j = 0; j < m; ++j) {
    const T inter = box_intersection(a.x1, a.y1, a.x2, a.y2, c.x1[j], c.y1[j],
                                     c.x2[j], c.y2[j]);
    out[j] = iou_of(inter, area_a, c.area[j]);
  }
}

// sum_j d iou(a, cols[j]) / d a * g[j]: the gradient of one row's box.
template <typename T>
inline __attribute__((always_inline)) void grad_row_impl(
    const Box<T>& a, T area_a, Cols<T> c, const T* __restrict__ g, int64_t m,
    T* __restrict__ out4) {
  T s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t j = 0; j < m; ++j) {
    const Box<T> b{c.x1[j], c.y1[j], c.x2[j], c.y2[j]};
    const BoxPairGrad<T> d = box_iou_pair_grad(g[j], a, b, area_a, c.area[j]);
    s0 += d.a.x1;
    s1 += d.a.y1;
    s2 += d.a.x2;
    s3 += d.a.y2;
  }
  out4[0] = s0;
  out4[1] = s1;
  out4[2] = s2;
  out4[3] = s3;
}

// acc_k[j] += d iou(a, cols[j]) / d cols[j]_k * g[j]: one row's contribution
// to the gradients of a chunk of columns.
template <typename T>
inline __attribute__((always_inline)) void grad_cols_impl(
    const Box<T>& a, T area_a, Cols<T> c, const T* __restrict__ g, int64_t m,
    T* __restrict__ acc0, T* __restrict__ acc1, T* __restrict__ acc2,
    T* __restrict__ acc3) {
#pragma omp simd
  for (int64_t j = 0; j < m; ++j) {
    const Box<T> b{c.x1[j], c.y1[j], c.x2[j], c.y2[j]};
    const BoxPairGrad<T> d = box_iou_pair_grad(g[j], a, b, area_a, c.area[j]);
    acc0[j] += d.b.x1;
    acc1[j] += d.b.y1;
    acc2[j] += d.b.x2;
    acc3[j] += d.b.y2;
  }
}

// Multi-versioned instances (target_clones needs plain functions).
#define TORCHOPS_BOX_IOU_INSTANCES(T, suffix)                                  \
  TORCHOPS_CPU_MULTIVERSION void iou_row_##suffix(                            \
      const Box<T>& a, T area_a, Cols<T> c, int64_t m, T* out) {                     \
    iou_row_impl(a, area_a, c, m, out);                                       \
  }                                                                           \
  TORCHOPS_CPU_MULTIVERSION void grad_row_##suffix(                           \
      const Box<T>& a, T area_a, Cols<T> c, const T* g, int64_t m, T* out4) {        \
    grad_row_impl(a, area_a, c, g, m, out4);                                  \
  }                                                                           \
  TORCHOPS_CPU_MULTIVERSION void grad_cols_##suffix(                          \
      const Box<T>& a, T area_a, Cols<T> c, const T* g, int64_t m, T* acc0, T* acc1, \
      T* acc2, T* acc3) {                                                     \
    grad_cols_impl(a, area_a, c, g, m, acc0, acc1, acc2, acc3);               \
  }                                                                           \
  inline void iou_row(const Box<T>& a, T area_a, Cols<T> c, int64_t m, T* out) {     \
    iou_row_##suffix(a, area_a, c, m, out);                                   \
  }                                                                           \
  inline void grad_row(const Box<T>& a, T area_a, Cols<T> c, const T* g, int64_t m,  \
                       T* out4) {                                             \
    grad_row_##suffix(a, area_a, c, g, m, out4);                              \
  }                                                                           \
  inline void grad_cols(const Box<T>& a, T area_a, Cols<T> c, const T* g, int64_t m, \
                        T* acc0, T* acc1, T* acc2, T* acc3) {                 \
    grad_cols_##suffix(a, area_a, c, g, m, acc0, acc1, acc2, acc3);           \
  }

TORCHOPS_BOX_IOU_INSTANCES(float, f32)
TORCHOPS_BOX_IOU_INSTANCES(double, f64)
#undef TORCHOPS_BOX_IOU_INSTANCES

// Rows per task so that a task holds about kElementwiseGrain pairs.
int64_t row_grain(int64_t m) {
  return std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(m, 1));
}

template <typename scalar_t>
void box_iou_kernel(const at::Tensor& boxes1, const at::Tensor& boxes2,
                    at::Tensor& out) {
  using T = at::opmath_type<scalar_t>;
  const int64_t n = boxes1.size(0);
  const int64_t m = boxes2.size(0);
  const auto a = box_arrays<T, scalar_t>(boxes1);
  const auto b = box_arrays<T, scalar_t>(boxes2);
  scalar_t* op = out.mutable_data_ptr<scalar_t>();
  at::parallel_for(0, n, row_grain(m), [&](int64_t r0, int64_t r1) {
    std::vector<T> buf;  // half types: a row chunk in float first
    if constexpr (!std::is_same_v<T, scalar_t>) {
      buf.resize(std::min(m, kChunk));
    }
    for (int64_t i = r0; i < r1; ++i) {
      scalar_t* row = op + i * m;
      if constexpr (std::is_same_v<T, scalar_t>) {
        iou_row(a.box(i), a.area[i], cols_of(b, 0), m, row);
      } else {
        for (int64_t j0 = 0; j0 < m; j0 += kChunk) {
          const int64_t len = std::min(kChunk, m - j0);
          iou_row(a.box(i), a.area[i], cols_of(b, j0), len, buf.data());
          for (int64_t j = 0; j < len; ++j) {
            row[j0 + j] = static_cast<scalar_t>(buf[j]);
          }
        }
      }
    }
  });
}

at::Tensor box_iou(const at::Tensor& boxes1, const at::Tensor& boxes2) {
  check_box_iou(boxes1, boxes2, c10::DeviceType::CPU);
  at::Tensor out =
      new_output("box_iou", {boxes1.size(0), boxes2.size(0)}, boxes1.options());
  if (out.numel() == 0) {
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, boxes1.scalar_type(), "torchops.box_iou",
      [&] { box_iou_kernel<scalar_t>(boxes1, boxes2, out); });
  return out;
}

template <typename scalar_t>
void box_iou_backward_kernel(const at::Tensor& grad, const at::Tensor& boxes1,
                             const at::Tensor& boxes2, at::Tensor& grad1,
                             at::Tensor& grad2) {
  using T = at::opmath_type<scalar_t>;
  const int64_t n = boxes1.size(0);
  const int64_t m = boxes2.size(0);
  const auto a = box_arrays<T, scalar_t>(boxes1);
  const auto b = box_arrays<T, scalar_t>(boxes2);
  // The incoming gradient in the op math type (a copy only for half types or
  // unusual strides).
  const at::Tensor g =
      grad.to(c10::CppTypeToScalarType<T>::value).contiguous();
  const T* gp = g.const_data_ptr<T>();
  scalar_t* g1 = grad1.mutable_data_ptr<scalar_t>();
  scalar_t* g2 = grad2.mutable_data_ptr<scalar_t>();
  // Gradient of boxes1: one row reduction per box.
  at::parallel_for(0, n, row_grain(m), [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      T s[4];
      grad_row(a.box(i), a.area[i], cols_of(b, 0), gp + i * m, m, s);
      for (int k = 0; k < 4; ++k) {
        g1[4 * i + k] = static_cast<scalar_t>(s[k]);
      }
    }
  });
  // Gradient of boxes2: per chunk of columns, accumulate over all rows.
  const int64_t chunks = (m + kChunk - 1) / kChunk;
  const int64_t grain = std::max<int64_t>(
      1, kElementwiseGrain / (kChunk * std::max<int64_t>(n, 1)));
  at::parallel_for(0, chunks, grain, [&](int64_t c0, int64_t c1) {
    std::vector<T> acc(4 * kChunk);
    T* acc0 = acc.data();
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t j0 = c * kChunk;
      const int64_t len = std::min(kChunk, m - j0);
      std::fill(acc.begin(), acc.end(), T(0));
      for (int64_t i = 0; i < n; ++i) {
        grad_cols(a.box(i), a.area[i], cols_of(b, j0), gp + i * m + j0, len,
                  acc0, acc0 + kChunk, acc0 + 2 * kChunk, acc0 + 3 * kChunk);
      }
      for (int64_t j = 0; j < len; ++j) {
        for (int k = 0; k < 4; ++k) {
          g2[4 * (j0 + j) + k] = static_cast<scalar_t>(acc0[k * kChunk + j]);
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> box_iou_backward(
    const at::Tensor& grad, const at::Tensor& boxes1,
    const at::Tensor& boxes2) {
  check_box_iou_backward(grad, boxes1, boxes2, c10::DeviceType::CPU);
  at::Tensor grad1 = at::zeros({boxes1.size(0), 4}, boxes1.options());
  at::Tensor grad2 = at::zeros({boxes2.size(0), 4}, boxes2.options());
  if (grad.numel() == 0) {
    return {grad1, grad2};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, boxes1.scalar_type(),
      "torchops._box_iou_backward", [&] {
        box_iou_backward_kernel<scalar_t>(grad, boxes1, boxes2, grad1, grad2);
      });
  return {grad1, grad2};
}

}  // namespace

TORCHOPS_REGISTER_KERNELS(CPU, box_iou)

}  // namespace torchops::cpu

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
