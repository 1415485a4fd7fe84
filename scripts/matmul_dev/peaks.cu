// Instruction-throughput ceilings of this GPU for the matmul paths, from
// register-only loops (no memory traffic): FFMA (the exact-float32 simt path)
// and mma.sync m16n8k16 bf16 with float32 accumulation (the Ampere path,
// which Hopper runs without wgmma).  The paths' TFLOP/s read against these,
// not only against the datasheet.
//
//   nvcc -O3 -arch=sm_90a -o /tmp/peaks scripts/matmul_dev/peaks.cu && /tmp/peaks
//
// It prints FFMA and mma.sync bf16 TFLOP/s (4 to 16 warps a block, 2 blocks
// per SM).
#include <cstdio>
#include <cuda_runtime.h>

// 16 independent FMA chains a thread: enough to cover the FMA latency.
__global__ void ffma_loop(float* sink, int iters) {
  float a[16];
  for (int i = 0; i < 16; ++i) a[i] = threadIdx.x * 1e-3f + i;
  const float x = 1.0001f, y = 1e-7f;
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int r = 0; r < 8; ++r)
#pragma unroll
      for (int i = 0; i < 16; ++i) a[i] = fmaf(a[i], x, y);
  }
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += a[i];
  if (s == 1234.5f) *sink = s;  // keeps the loop alive, never true
}

// 8 independent accumulator tiles a warp, so the tensor pipe, not the
// dependency between mma.sync instructions, is the limit.
__global__ void mma_loop(float* sink, int iters) {
  const unsigned a[4] = {0x3f803f80u ^ threadIdx.x, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u};
  const unsigned b[2] = {0x3f803f80u, 0x3f803f80u ^ threadIdx.x};
  float c[8][4] = {};
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
          "{%8,%9}, {%0,%1,%2,%3};"
          : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  float s = 0.f;
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 4; ++i) s += c[j][i];
  if (s == 1234.5f) *sink = s;
}

template <class F>
static float time_ms(F launch) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  launch(100);  // warm-up (clocks up, module loaded)
  cudaEventRecord(e0);
  launch(0);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, e0, e1);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return ms;
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* sink = nullptr;
  cudaMalloc(&sink, sizeof(float));
  const int iters = 20000;
  {
    const int blocks = 2 * sms, threads = 1024;
    const float ms = time_ms([&](int warm) {
      ffma_loop<<<blocks, threads>>>(sink, warm ? warm : iters);
    });
    const double flop = 2.0 * 16 * 8 * double(iters) * blocks * threads;
    printf("FFMA: %.1f TFLOP/s\n", flop / ms / 1e9);
  }
  for (int warps = 4; warps <= 16; warps *= 2) {
    const int blocks = 2 * sms;
    const float ms = time_ms([&](int warm) {
      mma_loop<<<blocks, 32 * warps>>>(sink, warm ? warm : iters);
    });
    const double flop = 2.0 * 16 * 8 * 16 * 8.0 * iters * blocks * warps;
    printf("mma.sync m16n8k16 bf16 (%d warps a block, 2 blocks/SM): %.1f TFLOP/s\n", warps,
           flop / ms / 1e9);
  }
  const cudaError_t e = cudaGetLastError();
  printf("%s\n", cudaGetErrorString(e));
  return e == cudaSuccess ? 0 : 1;
}
