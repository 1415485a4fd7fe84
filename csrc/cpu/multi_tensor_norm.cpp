// CPU kernels of torchops.multi_tensor_l2norm and torchops.multi_tensor_scale_.
//
// Both cut the list into the chunks of cpu/common/multi_tensor.h and spread
// them over the threads.  A chunk is read in blocks that stay in L1, through
// float (double for float64) views: float32 and float64 arrays in place,
// float16/bfloat16 ones converted into a block buffer (and back, for the
// scale).
//
// The norm is deterministic whatever the thread count: each chunk's sum of
// squares goes to its own slot, and the slots are added in chunk order (per
// tensor, then the tensors in list order).  Within a chunk, each block is
// summed into fresh accumulators (four vectors wide on AVX2) and the block
// sums are added in order, which keeps float32 rounding near that of a
// pairwise sum.
#include "cpu/common/vectorized.h"  // first: see the header

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "common/multi_tensor_norm.h"
#include "cpu/common/multi_tensor.h"

namespace torchops::cpu {
namespace {

namespace mt = multi_tensor;

// Elements per block of a chunk.
constexpr int64_t kBlock = 1024;

template <typename acc_t>
acc_t sum_squares_scalar(const acc_t* x, int64_t n) {
  acc_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += x[i] * x[i];
    s1 += x[i + 1] * x[i + 1];
    s2 += x[i + 2] * x[i + 2];
    s3 += x[i + 3] * x[i + 3];
  }
  for (; i < n; ++i) {
    s0 += x[i] * x[i];
  }
  return (s0 + s1) + (s2 + s3);
}

template <typename acc_t>
void scale_scalar(acc_t* x, int64_t n, acc_t s) {
  for (int64_t i = 0; i < n; ++i) {
    x[i] = x[i] * s;
  }
}

TORCHOPS_VEC_BEGIN

// The sum of x[i]^2 over four vector accumulators; a last partial vector is
// loaded with a count (the other lanes zero).
template <typename acc_t>
acc_t sum_squares_vec(const acc_t* x, int64_t n) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  Vec a0(acc_t(0)), a1(acc_t(0)), a2(acc_t(0)), a3(acc_t(0));
  int64_t i = 0;
  for (; i + 4 * W <= n; i += 4 * W) {
    const Vec v0 = Vec::loadu(x + i);
    const Vec v1 = Vec::loadu(x + i + W);
    const Vec v2 = Vec::loadu(x + i + 2 * W);
    const Vec v3 = Vec::loadu(x + i + 3 * W);
    a0 = at::vec::fmadd(v0, v0, a0);
    a1 = at::vec::fmadd(v1, v1, a1);
    a2 = at::vec::fmadd(v2, v2, a2);
    a3 = at::vec::fmadd(v3, v3, a3);
  }
  for (; i + W <= n; i += W) {
    const Vec v = Vec::loadu(x + i);
    a0 = at::vec::fmadd(v, v, a0);
  }
  if (i < n) {
    const Vec v = Vec::loadu(x + i, n - i);
    a1 = at::vec::fmadd(v, v, a1);
  }
  acc_t lanes[W];
  ((a0 + a1) + (a2 + a3)).store(lanes);
  acc_t s = 0;
  for (int64_t k = 0; k < W; ++k) {
    s += lanes[k];
  }
  return s;
}

template <typename acc_t>
void scale_vec(acc_t* x, int64_t n, acc_t s) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  const Vec sv(s);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    (Vec::loadu(x + i) * sv).store(x + i);
  }
  if (i < n) {
    (Vec::loadu(x + i, n - i) * sv).store(x + i, n - i);
  }
}

template float sum_squares_vec<float>(const float*, int64_t);
template double sum_squares_vec<double>(const double*, int64_t);
template void scale_vec<float>(float*, int64_t, float);
template void scale_vec<double>(double*, int64_t, double);

TORCHOPS_VEC_END

template <typename scalar_t>
std::tuple<at::Tensor, at::Tensor> l2norm_run(at::TensorList tensors, bool per_tensor,
                                              const at::TensorOptions& out) {
  using acc_t = norm_acc_t<scalar_t>;
  const size_t n = tensors.size();
  const std::vector<mt::Item> items =
      mt::chunk_items(n, [&](size_t i) { return tensors[i].numel(); });
  std::vector<acc_t> partial(items.size());
  const bool vec = vec_available();
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t lo, int64_t hi) {
    acc_t buf[kBlock];
    for (int64_t k = lo; k < hi; ++k) {
      const mt::Item& item = items[k];
      // Read only: the view's buffer is filled, never written back.
      const scalar_t* data = tensors[item.tensor].const_data_ptr<scalar_t>();
      mt::View<scalar_t, acc_t> x{const_cast<scalar_t*>(data), buf};
      acc_t s = 0;
      for (int64_t off = item.begin; off < item.end; off += kBlock) {
        const int64_t len = std::min(kBlock, item.end - off);
        const acc_t* p = x.at(off, len);
        s += vec ? sum_squares_vec<acc_t>(p, len) : sum_squares_scalar<acc_t>(p, len);
      }
      partial[k] = s;
    }
  });
  // Items are in list order, a tensor's chunks consecutive.
  std::vector<acc_t> sums(n, acc_t(0));
  for (size_t k = 0; k < items.size(); ++k) {
    sums[items[k].tensor] += partial[k];
  }
  acc_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    total += sums[i];
  }
  at::Tensor total_out = at::empty({}, out);
  at::Tensor per_out = at::empty({per_tensor ? static_cast<int64_t>(n) : 0}, out);
  *total_out.mutable_data_ptr<acc_t>() = std::sqrt(total);
  if (per_tensor) {
    acc_t* p = per_out.mutable_data_ptr<acc_t>();
    for (size_t i = 0; i < n; ++i) {
      p[i] = std::sqrt(sums[i]);
    }
  }
  return {total_out, per_out};
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(at::TensorList tensors, bool per_tensor) {
  TORCH_CHECK(!tensors.empty(), "torchops.multi_tensor_l2norm: 'tensors' is empty (the "
              "wrapper torchops.multi_tensor_l2norm returns 0 for an empty list)");
  const at::ScalarType dtype =
      check_tensor_list(kL2NormOp, c10::DeviceType::CPU, tensors, /*distinct=*/false);
  const at::TensorOptions out = tensors[0].options().dtype(norm_acc_type(dtype));
  std::tuple<at::Tensor, at::Tensor> result;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, kL2NormOp, [&] {
    result = l2norm_run<scalar_t>(tensors, per_tensor, out);
  });
  return result;
}

template <typename scalar_t>
void scale_run(at::TensorList tensors, norm_acc_t<scalar_t> s) {
  using acc_t = norm_acc_t<scalar_t>;
  const std::vector<mt::Item> items =
      mt::chunk_items(tensors.size(), [&](size_t i) { return tensors[i].numel(); });
  const bool vec = vec_available();
  mt::parallel_items(items, [&](const mt::Item& item) {
    acc_t buf[kBlock];
    mt::View<scalar_t, acc_t> x{tensors[item.tensor].mutable_data_ptr<scalar_t>(), buf};
    for (int64_t off = item.begin; off < item.end; off += kBlock) {
      const int64_t len = std::min(kBlock, item.end - off);
      acc_t* p = x.at(off, len);
      if (vec) {
        scale_vec<acc_t>(p, len, s);
      } else {
        scale_scalar<acc_t>(p, len, s);
      }
      x.finish(off, len);
    }
  });
}

void multi_tensor_scale_impl(at::TensorList tensors, const at::Tensor* scale_tensor,
                             double scale) {
  if (tensors.empty()) {
    return;
  }
  const at::ScalarType dtype =
      check_tensor_list(kScaleOp, c10::DeviceType::CPU, tensors, /*distinct=*/true);
  ScaleArg arg{scale, nullptr, false};
  if (scale_tensor != nullptr) {
    check_scale_tensor(c10::DeviceType::CPU, tensors[0], *scale_tensor);
    arg.tensor = scale_tensor->const_data_ptr();
    arg.is_double = scale_tensor->scalar_type() == at::kDouble;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, kScaleOp, [&] {
    scale_run<scalar_t>(tensors, arg.get<norm_acc_t<scalar_t>>());
  });
}

}  // namespace

TORCHOPS_REGISTER_MULTI_TENSOR_NORM(CPU, multi_tensor_l2norm, multi_tensor_scale_impl)

}  // namespace torchops::cpu
