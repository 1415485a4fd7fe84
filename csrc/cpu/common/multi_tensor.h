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

// One array of a block in the compute type: the array itself when its type
// is acc_t, else a converted copy in `buf`, written back by finish().  A
// null `data` (an absent optional array) gives null.
template <typename T, typename acc_t>
struct View {
  T* data;
  acc_t* buf;
  acc_t* at(int64_t off, int64_t len) {
    if (data == nullptr) {
      return nullptr;
    }
    if constexpr (std::is_same_v<T, acc_t>) {
      return data + off;
    } else {
      for (int64_t i = 0; i < len; ++i) {
        buf[i] = static_cast<acc_t>(data[off + i]);
      }
      return buf;
    }
  }
  void finish(int64_t off, int64_t len) {
    if constexpr (!std::is_same_v<T, acc_t>) {
      if (data != nullptr) {
        for (int64_t i = 0; i < len; ++i) {
          data[off + i] = static_cast<T>(buf[i]);
        }
      }
    }
  }
};

}  // namespace torchops::cpu::multi_tensor
