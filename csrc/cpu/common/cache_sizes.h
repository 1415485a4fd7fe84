// The data cache sizes one core of the running machine can count on, for sizing
// cache blocks (csrc/cpu/matmul.cpp).  Read once per process.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>

#ifdef __linux__
#include <unistd.h>
#endif

#include "common/env.h"

namespace torchops::cpu {

// Bytes: L1 data, L2 and L3; a cache shared by several cores counts as this
// core's share, since every thread of a parallel GEMM fills its own.
struct CacheSizes {
  int64_t l1d, l2, l3;
};

namespace cache_detail {

inline std::string read_line(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

// "48K", "2048K", "32M" -> bytes; 0 if unreadable.
inline int64_t parse_size(const std::string& s) {
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (end == s.c_str() || v <= 0) return 0;
  const int64_t unit = *end == 'K' ? 1 << 10 : *end == 'M' ? 1 << 20
                     : *end == 'G' ? 1 << 30 : 1;
  return v > (int64_t(1) << 40) / unit ? 0 : v * unit;
}

// A cpulist ("0-27,56-83") -> how many CPUs it names; 0 if unreadable.
inline int64_t count_cpus(const std::string& s) {
  int64_t n = 0;
  const char* p = s.c_str();
  while (*p >= '0' && *p <= '9') {
    char* end;
    const long lo = std::strtol(p, &end, 10);
    long hi = lo;
    if (*end == '-') hi = std::strtol(end + 1, &end, 10);
    n += std::max(0L, hi - lo + 1);
    p = *end == ',' ? end + 1 : end;
  }
  return n;
}

inline CacheSizes detect() {
  int64_t size[4] = {0, 0, 0, 0};
  int64_t sharing[4] = {1, 1, 1, 0};  // cores per cache; L3: 0 = unknown
#ifdef __linux__
#ifdef _SC_LEVEL1_DCACHE_SIZE  // glibc only; 0 or -1 where it cannot tell
  size[1] = sysconf(_SC_LEVEL1_DCACHE_SIZE);
  size[2] = sysconf(_SC_LEVEL2_CACHE_SIZE);
  size[3] = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
  // sysfs: sizes where sysconf has none (other libcs, most ARM), and how
  // many cores share each cache (SMT siblings are one core).
  const std::string cpu = "/sys/devices/system/cpu/cpu0/";
  const int64_t smt = std::max<int64_t>(
      1, count_cpus(read_line(cpu + "topology/thread_siblings_list")));
  for (int i = 0; i < 8; ++i) {
    const std::string dir = cpu + "cache/index" + std::to_string(i) + "/";
    const int level = std::atoi(read_line(dir + "level").c_str());
    if (level < 1 || level > 3 || read_line(dir + "type") == "Instruction") {
      continue;
    }
    if (size[level] <= 0) size[level] = parse_size(read_line(dir + "size"));
    const int64_t cpus = count_cpus(read_line(dir + "shared_cpu_list"));
    if (cpus > 0) sharing[level] = std::max<int64_t>(1, cpus / smt);
  }
#endif
  const int64_t fallback[4] = {0, 32 << 10, 1 << 20, 8 << 20};
  for (int l = 1; l <= 3; ++l) {
    if (size[l] <= 0) size[l] = fallback[l];
  }
  if (sharing[3] == 0) {  // unknown: assume one L3 for all CPUs
    sharing[3] = std::max<int64_t>(1, std::thread::hardware_concurrency());
  }
  return {size[1] / sharing[1], size[2] / sharing[2], size[3] / sharing[3]};
}

}  // namespace cache_detail

// TORCHOPS_TESTING_CPU_CACHES="L1,L2,L3" (bytes per core, read once at first
// use) replaces the detected sizes, so tests can force tiny blocks.  Every
// value is clamped, so a garbage report cannot give zero or giant blocks.
inline const CacheSizes& cpu_cache_sizes() {
  static const CacheSizes sizes = [] {
    CacheSizes c;
    if (const auto v = env::integers(nullptr, env::kTestingCpuCaches)) {
      c = {(*v)[0], (*v)[1], (*v)[2]};
    } else {
      c = cache_detail::detect();
    }
    constexpr int64_t K = 1 << 10, M = 1 << 20;
    c.l1d = std::clamp<int64_t>(c.l1d, 4 * K, 1 * M);
    c.l2 = std::clamp<int64_t>(c.l2, 16 * K, 64 * M);
    c.l3 = std::clamp<int64_t>(c.l3, 16 * K, 1024 * M);
    return c;
  }();
  return sizes;
}

}  // namespace torchops::cpu
