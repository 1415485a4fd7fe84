// multi_tensor_apply for the CUDA multi-tensor ops: one launch covers many
// tensors.
//
// As apex's: the tensors are cut into chunks, and each block of a launch
// takes one chunk.  A launch's table (each tensor's pointers and size, and
// which tensor and chunk each block takes) is passed by value as the
// kernel's argument, so nothing is copied to the device beforehand and the
// launch can be captured in a CUDA graph; a long list takes several
// launches, each with its own table.
#pragma once

#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <limits>

#include "cuda/common/launch.cuh"

namespace torchops::cuda {

// Kernel arguments stay under CUDA's classic 4 KiB; kArgBytes is what a
// table may take, leaving room for an op's scalars.
constexpr int kMultiTensorArgBytes = 3584;
constexpr int kMultiTensorMaxBlocks = 256;

// kSlots arrays per tensor (a parameter, its gradient, its states...; null
// where a tensor has no such array).
template <int kSlots>
struct MultiTensorTable {
  static constexpr int kBlockBytes = kMultiTensorMaxBlocks * (sizeof(int) + 1);
  static constexpr int kPerTensor = kSlots * sizeof(void*) + sizeof(int64_t) + sizeof(int);
  static constexpr int kFit = (kMultiTensorArgBytes - kBlockBytes) / kPerTensor;
  static constexpr int kMaxTensors = kFit < 255 ? kFit : 255;
  static_assert(kMaxTensors >= 8, "too many slots for one table");

  void* ptr[kSlots][kMaxTensors];
  int64_t numel[kMaxTensors];
  int index[kMaxTensors];  // the tensor's position in the op's lists
  int block_chunk[kMultiTensorMaxBlocks];
  unsigned char block_tensor[kMultiTensorMaxBlocks];
};

// The chunk a block takes: its tensor's table slot and elements
// [begin, begin + len) of that tensor.
struct BlockChunk {
  int tensor;
  int64_t begin;
  int64_t len;
};

template <int kSlots>
__device__ inline BlockChunk block_chunk(const MultiTensorTable<kSlots>& t, int64_t chunk) {
  const int ti = t.block_tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(t.block_chunk[blockIdx.x]) * chunk;
  const int64_t rest = t.numel[ti] - begin;
  return BlockChunk{ti, begin, rest < chunk ? rest : chunk};
}

// Whether a chunk's array (null: an absent one) can move kVec elements at
// a time: chunks are multiples of kVec elements, so a tensor aligned for its
// pack is aligned in every chunk.
template <typename T, int kVec>
__device__ inline bool pack_aligned(const void* p) {
  return p == nullptr || reinterpret_cast<uintptr_t>(p) % (sizeof(T) * kVec) == 0;
}

// Fills tables with the n tensors of an op's lists and calls
// launch(table, blocks) whenever one is full, and once at the end.
// pointers(i, ptr) writes tensor i's kSlots pointers into ptr and returns
// its number of elements; empty tensors are skipped.
template <int kSlots, typename Pointers, typename Launch>
void multi_tensor_apply(const char* op, size_t n, int64_t chunk, Pointers&& pointers,
                        Launch&& launch) {
  using Table = MultiTensorTable<kSlots>;
  Table t;
  int tensors = 0;
  int blocks = 0;
  for (size_t i = 0; i < n; ++i) {
    void* ptr[kSlots];
    const int64_t numel = pointers(i, ptr);
    if (numel == 0) {
      continue;
    }
    const int64_t chunks = ceil_div(numel, chunk);
    TORCH_CHECK(chunks <= std::numeric_limits<int>::max() &&
                    i <= static_cast<size_t>(std::numeric_limits<int>::max()),
                "torchops.", op, ": tensor ", i, " of the lists is too large");
    int slot = tensors++;
    for (int k = 0; k < kSlots; ++k) {
      t.ptr[k][slot] = ptr[k];
    }
    t.numel[slot] = numel;
    t.index[slot] = static_cast<int>(i);
    for (int64_t ch = 0; ch < chunks; ++ch) {
      t.block_tensor[blocks] = static_cast<unsigned char>(slot);
      t.block_chunk[blocks] = static_cast<int>(ch);
      ++blocks;
      const bool last_chunk = ch == chunks - 1;
      if (blocks == kMultiTensorMaxBlocks || (tensors == Table::kMaxTensors && last_chunk)) {
        launch(t, blocks);
        blocks = 0;
        if (last_chunk) {
          tensors = 0;
        } else {
          // The tensor continues in the next launch, as its table's slot 0.
          for (int k = 0; k < kSlots; ++k) {
            t.ptr[k][0] = t.ptr[k][slot];
          }
          t.numel[0] = t.numel[slot];
          t.index[0] = t.index[slot];
          tensors = 1;
          slot = 0;  // its remaining blocks name slot 0, which later tensors leave alone
        }
      }
    }
  }
  if (blocks > 0) {
    launch(t, blocks);
  }
}

}  // namespace torchops::cuda
