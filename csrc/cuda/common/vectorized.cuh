// 16-byte vector loads and stores for element-wise kernels.
#pragma once

#include <cstdint>
#include <initializer_list>

namespace torchops::cuda {

// N values of T moved by one 16-byte (or narrower) memory instruction.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// Elements per 16-byte pack.
template <typename T>
constexpr int pack_size() {
  return 16 / sizeof(T) > 0 ? static_cast<int>(16 / sizeof(T)) : 1;
}

// Whether every pointer (nullptr is ignored) is aligned for 16-byte packs.
inline bool aligned_for_packs(std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs) {
    if (p != nullptr && reinterpret_cast<std::uintptr_t>(p) % 16 != 0) {
      return false;
    }
  }
  return true;
}

}  // namespace torchops::cuda
