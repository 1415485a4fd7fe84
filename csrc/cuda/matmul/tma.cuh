// TMA and mbarrier helpers shared by the Hopper kernels of the matmul paths
// (sm90.cuh: wgmma; simt90.cuh: exact float32 on CUDA cores).  Device code
// exists only in sm_90a builds; the host functions run anywhere and fail
// (return false) where the driver has no tensor maps.
#pragma once

#include <cstdint>

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

namespace torchops::cuda::gemm::tma {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// Warp specialisation's register hand-over: the producer warpgroup gives
// registers back to the pool (dec), the consumers take them (inc, which
// waits until they are free).  Builds for compute-sanitizer's racecheck
// define TORCHOPS_NO_SETMAXNREG (scripts/gpu_check.sh): racecheck's
// instrumented kernels deadlock there, intermittently (a hang at the first
// launch), as other instrumenting tools do on setmaxnreg.  The kernels then keep
// their compiled register count; synchronisation is unchanged.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
#ifndef TORCHOPS_NO_SETMAXNREG
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
#endif
}

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
#ifndef TORCHOPS_NO_SETMAXNREG
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
#endif
}

// Waits until the phase of parity `parity` has completed.  A fresh barrier
// counts its (nonexistent) previous phase, parity 1, as complete: that is
// how the producer's first pass over the empty ring goes straight through.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}

__device__ __forceinline__ void tma_load_3d(
    void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];"
      ::"r"(smem_addr(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2),
        "r"(smem_addr(bar)) : "memory");
}

#endif  // sm_90a

inline PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      f = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// An sm_90 GPU (the sm_90a kernels' target), and a driver that encodes
// tensor maps.
inline bool sm90_device() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    return false;
  }
  return major == 9 && minor == 0 && encode_fn() != nullptr;
}

// A 3-D tensor map: dims innermost first, byte strides of dims 1 and 2, a
// box of box[0] x box[1] x box[2] elements of 2 or 4 bytes, zero fill past
// every edge.  Strides need not grow with the dimension (simt90.cuh's A
// view steps 16 bytes along its outermost one).
inline bool encode_3d(CUtensorMap* map, const void* ptr, int bytes, const uint64_t (&dims)[3],
                      const uint64_t (&strides)[2], const uint32_t (&box)[3],
                      CUtensorMapSwizzle swizzle) {
  auto fn = encode_fn();
  if (fn == nullptr) return false;
  const cuuint64_t d[3] = {dims[0], dims[1], dims[2]};
  const cuuint64_t st[2] = {strides[0], strides[1]};
  const cuuint32_t bx[3] = {box[0], box[1], box[2]};
  const cuuint32_t estr[3] = {1, 1, 1};
  const CUtensorMapDataType type =
      bytes == 4 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_UINT16;
  return fn(map, type, 3, const_cast<void*>(ptr), d, st, bx, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace torchops::cuda::gemm::tma
