// Shape and argument checks of torchops.matmul, shared by its CPU and CUDA
// kernels so both reject exactly the same inputs with the same messages.
#pragma once

#include "common/checks.h"

namespace torchops {

struct MatmulShape {
  int64_t batch;  // 1 for 2-D inputs
  int64_t m, k, n;
  bool batched;   // inputs were 3-D: the output keeps a batch dimension

  std::vector<int64_t> out_sizes() const {
    if (batched) {
      return {batch, m, n};
    }
    return {m, n};
  }
};

inline MatmulShape check_matmul(
    const at::Tensor& a, const at::Tensor& b, c10::DeviceType device) {
  const char* op = "matmul";
  check_devices(op, device, {{a, "a"}, {b, "b"}});
  check_floating(op, {a, "a"});
  check_same_dtype(op, {a, "a"}, {b, "b"});
  TORCH_CHECK(
      a.dim() == 2 || a.dim() == 3,
      "torchops.matmul: expected 'a' to be 2-D (M, K) or 3-D (B, M, K), but "
      "got shape ", a.sizes());
  TORCH_CHECK(
      b.dim() == a.dim(), "torchops.matmul: expected 'b' to have ", a.dim(),
      " dimensions like 'a', but got shape ", b.sizes());
  MatmulShape s{};
  s.batched = a.dim() == 3;
  s.batch = s.batched ? a.size(0) : 1;
  s.m = a.size(-2);
  s.k = a.size(-1);
  s.n = b.size(-1);
  TORCH_CHECK(
      b.size(-2) == s.k, "torchops.matmul: inner dimensions differ: 'a' has "
      "shape ", a.sizes(), " and 'b' has shape ", b.sizes());
  TORCH_CHECK(
      !s.batched || b.size(0) == s.batch,
      "torchops.matmul: batch dimensions differ: 'a' has shape ", a.sizes(),
      " and 'b' has shape ", b.sizes());
  return s;
}

}  // namespace torchops
