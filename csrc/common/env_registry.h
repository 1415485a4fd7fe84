// Generated from torchops/envs.py by `python torchops/envs.py --write`: do not edit.
// The environment variables that the library's C++ reads, each with the
// values it allows; common/env.h reads them.
#pragma once

#include <cstdint>

namespace torchops::env {

enum class EnvKind { kFlag, kChoice, kInt, kInts };

struct EnvVar {
  const char* name;
  EnvKind kind;
  const char* const* values;  // kFlag, kChoice: the allowed values, the default first
  int count;                  // how many values (kInts: integers)
  int64_t minimum;            // kInt, kInts: the smallest allowed
  bool testing;               // a testing switch
};

inline constexpr EnvVar kLceChunkMib = {
    "TORCHOPS_LCE_CHUNK_MIB", EnvKind::kInt, nullptr, 1, 1, false};
inline constexpr const char* kLceTargetCheckValues[] = {"sync", "nan"};
inline constexpr EnvVar kLceTargetCheck = {
    "TORCHOPS_LCE_TARGET_CHECK", EnvKind::kChoice, kLceTargetCheckValues, 2, INT64_MIN, false};
inline constexpr const char* kTestingMatmulPathValues[] = {"auto", "decode", "sm90", "sm80", "simt"};
inline constexpr EnvVar kTestingMatmulPath = {
    "TORCHOPS_TESTING_MATMUL_PATH", EnvKind::kChoice, kTestingMatmulPathValues, 5, INT64_MIN, true};
inline constexpr const char* kTestingMatmulNarrowValues[] = {"0", "1"};
inline constexpr EnvVar kTestingMatmulNarrow = {
    "TORCHOPS_TESTING_MATMUL_NARROW", EnvKind::kFlag, kTestingMatmulNarrowValues, 2, INT64_MIN, true};
inline constexpr const char* kTestingMatmulDirectBValues[] = {"0", "1"};
inline constexpr EnvVar kTestingMatmulDirectB = {
    "TORCHOPS_TESTING_MATMUL_DIRECT_B", EnvKind::kFlag, kTestingMatmulDirectBValues, 2, INT64_MIN, true};
inline constexpr const char* kTestingMatmulSharedValues[] = {"0", "1"};
inline constexpr EnvVar kTestingMatmulShared = {
    "TORCHOPS_TESTING_MATMUL_SHARED", EnvKind::kFlag, kTestingMatmulSharedValues, 2, INT64_MIN, true};
inline constexpr EnvVar kTestingCpuCaches = {
    "TORCHOPS_TESTING_CPU_CACHES", EnvKind::kInts, nullptr, 3, 1, true};
inline constexpr const char* kTestingRoiAlignWalkValues[] = {"auto", "sparse", "four", "dense"};
inline constexpr EnvVar kTestingRoiAlignWalk = {
    "TORCHOPS_TESTING_ROI_ALIGN_WALK", EnvKind::kChoice, kTestingRoiAlignWalkValues, 4, INT64_MIN, true};
inline constexpr const char* kTestingDeformInputGradValues[] = {"auto", "atomic", "gather"};
inline constexpr EnvVar kTestingDeformInputGrad = {
    "TORCHOPS_TESTING_DEFORM_INPUT_GRAD", EnvKind::kChoice, kTestingDeformInputGradValues, 3, INT64_MIN, true};
inline constexpr EnvVar kTestingDeformColumnBytes = {
    "TORCHOPS_TESTING_DEFORM_COLUMN_BYTES", EnvKind::kInt, nullptr, 1, 1, true};
inline constexpr const char* kTestingCarafePathValues[] = {"auto", "generic", "tiled"};
inline constexpr EnvVar kTestingCarafePath = {
    "TORCHOPS_TESTING_CARAFE_PATH", EnvKind::kChoice, kTestingCarafePathValues, 3, INT64_MIN, true};
inline constexpr const char* kTestingMaskedConvPathValues[] = {"auto", "sparse", "dense"};
inline constexpr EnvVar kTestingMaskedConvPath = {
    "TORCHOPS_TESTING_MASKED_CONV_PATH", EnvKind::kChoice, kTestingMaskedConvPathValues, 3, INT64_MIN, true};
inline constexpr const char* kTestingSoftmaxPathValues[] = {"auto", "warp", "chunked", "block"};
inline constexpr EnvVar kTestingSoftmaxPath = {
    "TORCHOPS_TESTING_SOFTMAX_PATH", EnvKind::kChoice, kTestingSoftmaxPathValues, 4, INT64_MIN, true};

}  // namespace torchops::env
