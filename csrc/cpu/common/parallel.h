// Helpers for CPU kernels: element-wise parallel loops and function
// multi-versioning.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>

// Compile a hot loop twice, for AVX2+FMA (x86-64-v3) and for the baseline,
// and pick one at load time.  Wheels must run on any x86-64, so -march=native
// is not an option; this gets the wide vectors where the CPU has them.
#if defined(__x86_64__) && defined(__linux__) && \
    (defined(__GNUC__) || defined(__clang__))
#define TORCHOPS_CPU_MULTIVERSION \
  __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define TORCHOPS_CPU_MULTIVERSION
#endif

namespace torchops::cpu {

// Roughly the work one thread should get before splitting pays off.
constexpr int64_t kElementwiseGrain = 32768;

// Runs f(begin, end) over [0, n) on at::parallel_for's threads.
template <typename F>
void parallel_range(int64_t n, F&& f, int64_t grain = kElementwiseGrain) {
  if (n == 0) {
    return;
  }
  at::parallel_for(0, n, grain, std::forward<F>(f));
}

}  // namespace torchops::cpu
