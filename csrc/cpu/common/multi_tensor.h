// The CPU side of the multi-tensor ops: work items that cut a list of
// tensors into chunks for at::parallel_for, and block views that give a
// kernel its arrays in the compute type.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace torchops::cpu::multi_tensor {

// Elements per parallel work item.
constexpr int64_t kChunk = 1 << 16;

// Elements [begin, end) of tensor `tensor`.
struct Item {
  size_t tensor;
  int64_t begin;
  int64_t end;
};

// Every chunk of n tensors whose sizes numel(i) gives, in list order.
template <typename Numel>
std::vector<Item> chunk_items(size_t n, Numel&& numel) {
  std::vector<Item> items;
  for (size_t i = 0; i < n; ++i) {
    const int64_t size = numel(i);
    for (int64_t b = 0; b < size; b += kChunk) {
      items.push_back({i, b, std::min(size, b + kChunk)});
    }
  }
  return items;
}

// Calls f(item) for every item, spread over the threads.
template <typename F>
void parallel_items(const std::vector<Item>& items, F&& f) {
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t it = lo; it < hi; ++it) {
      f(items[it]);
    }
  });
}

// Element-wise conversions of a block, one loop each way.
template <typename T, typename acc_t>
void convert_in_scalar(const T* src, acc_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = static_cast<acc_t>(src[i]);
  }
}

template <typename T, typename acc_t>
void convert_out_scalar(const acc_t* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = static_cast<T>(src[i]);
  }
}

// One array of a block in the compute type: the array itself when its type
// is acc_t, else a copy converted into `buf` by `in`, written back by
// finish() through `out` (a kernel passes vectorised conversions where the
// CPU has them).  A null `data` (an absent optional array) gives null.
template <typename T, typename acc_t>
struct View {
  T* data;
  acc_t* buf;
  void (*in)(const T*, acc_t*, int64_t) = &convert_in_scalar<T, acc_t>;
  void (*out)(const acc_t*, T*, int64_t) = &convert_out_scalar<T, acc_t>;

  acc_t* at(int64_t off, int64_t len) {
    if (data == nullptr) {
      return nullptr;
    }
    if constexpr (std::is_same_v<T, acc_t>) {
      return data + off;
    } else {
      in(data + off, buf, len);
      return buf;
    }
  }
  void finish(int64_t off, int64_t len) {
    if constexpr (!std::is_same_v<T, acc_t>) {
      if (data != nullptr) {
        out(buf, data + off, len);
      }
    }
  }
};

}  // namespace torchops::cpu::multi_tensor
