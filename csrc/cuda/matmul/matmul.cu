// CUDA kernel of torchops.matmul: picks one of the paths in csrc/cuda/matmul/
// (each a torch-free header, checked and timed alone by scripts/matmul_dev):
//
//   decode  M <= 16: streams B once, memory-bound (bf16, fp16, fp32)
//   sm90    Hopper: wgmma + TMA, warp-specialised, persistent (bf16, fp16)
//   sm80    Ampere and later: mma.sync + ldmatrix + cp.async (bf16, fp16;
//           fp32 as TF32 when allowed)
//   simt    CUDA cores: exact fp32 and fp64, and any layout of any dtype
//
// float32 follows PyTorch's rule, read at each call (so torch.compile'd code
// sees the setting of the moment): TF32 tensor cores only when the user
// allows them (torch.set_float32_matmul_precision("high") or
// torch.backends.cuda.matmul.allow_tf32); otherwise exact fp32.
//
// Half-precision operands whose strides tensor-core loads cannot take (an
// odd leading dimension, no unit stride) are copied once into a padded
// row-major buffer: a copy is cheap beside the GEMM it unlocks.
//
// TORCHOPS_TESTING_MATMUL_PATH=decode|sm90|sm80|simt (read at each call)
// makes that path the first choice wherever it can run the call: the tests
// use it to run the Ampere path on a Hopper GPU.
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>

#include "common/env.h"
#include "common/matmul.h"
#include "cuda/common/launch.cuh"
#include "cuda/matmul/paths.cuh"
#include "cuda/matmul/api.h"

namespace torchops::cuda {
namespace {

using gemm::DType;
using gemm::GemmArgs;

using gemm::PathEntry;

// In order of preference where several could run a call.
const PathEntry* const kPaths[] = {&gemm::decode_path, &gemm::sm90_path, &gemm::sm80_path,
                                   &gemm::simt_path};
const PathEntry& kDecode = gemm::decode_path;
const PathEntry& kSm90 = gemm::sm90_path;
const PathEntry& kSm80 = gemm::sm80_path;
const PathEntry& kSimt = gemm::simt_path;

const PathEntry* forced_path() {
  const int i = env::choice("matmul", env::kTestingMatmulPath);
  if (i == 0) {
    return nullptr;
  }
  const char* v = env::kTestingMatmulPath.values[i];
  for (const PathEntry* p : kPaths) {
    if (std::strcmp(v, p->name) == 0) {
      return p;
    }
  }
  TORCH_INTERNAL_ASSERT(false, env::kTestingMatmulPath.name, "=", v, " is allowed but names no path");
}

DType dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kHalf:
      return DType::f16;
    case at::kBFloat16:
      return DType::bf16;
    case at::kFloat:
      return DType::f32;
    case at::kDouble:
      return DType::f64;
    default:
      TORCH_CHECK(false, "torchops.matmul: unsupported dtype ", t);
  }
}

gemm::Operand operand_of(const at::Tensor& t, bool batched) {
  return {t.const_data_ptr(), batched ? t.stride(0) : 0, t.stride(-2), t.stride(-1)};
}

GemmArgs args_of(const at::Tensor& a, const at::Tensor& b, at::Tensor& c, const MatmulShape& s,
                 bool tf32) {
  GemmArgs g{};
  g.a = operand_of(a, s.batched);
  g.b = operand_of(b, s.batched);
  g.c = c.mutable_data_ptr();
  g.batch = s.batch;
  g.m = s.m;
  g.n = s.n;
  g.k = s.k;
  g.dtype = dtype_of(a.scalar_type());
  g.allow_tf32 = g.dtype == DType::f32 && tf32;
  return g;
}

// A row-major copy of `t` (.., rows, cols) whose row stride is a multiple of
// 8 elements (16 bytes), as TMA and cp.async need.
at::Tensor padded_row_major(const at::Tensor& t) {
  const int64_t cols = t.size(-1);
  const int64_t ld = (cols + 7) / 8 * 8;
  std::vector<int64_t> sizes(t.sizes().begin(), t.sizes().end());
  sizes.back() = ld;
  at::Tensor buf = at::empty(sizes, t.options());
  at::Tensor view = buf.narrow(-1, 0, cols);
  view.copy_(t);
  return view;
}

bool is_half(DType d) {
  return d == DType::bf16 || d == DType::f16;
}

int device_major() {
  int dev = 0, major = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  return major;
}

bool is_hopper() {
  int dev = 0, major = 0, minor = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  return major == 9 && minor == 0;
}

// Whether a float32 operand is contiguous along its k dimension with a
// 16-byte multiple for the other stride (what TMA needs), k_dim -1 for A
// (m, k) and -2 for B (k, n).
bool k_contiguous(const at::Tensor& t, int k_dim) {
  const int other = k_dim == -1 ? -2 : -1;
  return (t.stride(k_dim) == 1 || t.size(k_dim) == 1) &&
         (t.size(other) == 1 || t.stride(other) % 4 == 0) &&
         reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

void run_path(const PathEntry& p, const GemmArgs& g, const at::Tensor& like) {
  const size_t ws_bytes = p.workspace_bytes(g);
  at::Tensor ws;
  if (ws_bytes > 0) {
    ws = at::empty({static_cast<int64_t>(ws_bytes)}, like.options().dtype(at::kByte));
  }
  const cudaError_t err = p.run(g, ws_bytes ? ws.mutable_data_ptr() : nullptr, current_stream());
  TORCH_CHECK(err == cudaSuccess, "torchops.matmul: the ", p.name, " kernel failed to launch: ",
              cudaGetErrorString(err));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// out: a contiguous tensor of the result's shape and dtype to write, or
// null for a new one.
at::Tensor matmul_as(const at::Tensor& a_in, const at::Tensor& b_in, bool tf32,
                     const at::Tensor* out = nullptr) {
  const MatmulShape s = check_matmul(a_in, b_in, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(a_in.device());
  at::Tensor c;
  if (out != nullptr) {
    TORCH_CHECK(out->sizes() == at::IntArrayRef(s.out_sizes()) && out->is_contiguous() &&
                    out->scalar_type() == a_in.scalar_type() && out->device() == a_in.device(),
                "torchops.matmul: out must be contiguous, of the result's shape, dtype and device");
    c = *out;
  } else {
    c = new_output("matmul", s.out_sizes(), a_in.options());
  }
  if (c.numel() == 0) {
    return c;
  }
  if (s.k == 0) {
    return c.zero_();
  }
  at::Tensor a = a_in, b = b_in;
  GemmArgs g = args_of(a, b, c, s, tf32);

  if (const PathEntry* f = forced_path(); f != nullptr && f->supports(g)) {
    run_path(*f, g, c);
    return c;
  }
  if (s.m <= 16 && kDecode.supports(g)) {
    run_path(kDecode, g, c);
    return c;
  }
  if (is_half(g.dtype) && device_major() >= 8) {
    const bool fits = kSm90.supports(g) || kSm80.supports(g);
    if (!fits) {
      // Copy into padded row-major buffers what the tensor-core loads
      // cannot read: A always here (cheap beside the GEMM), B only if the
      // paths still cannot take it.
      a = padded_row_major(a);
      if (!(kSm80.supports(args_of(a, b, c, s, tf32)))) {
        b = padded_row_major(b);
      }
      g = args_of(a, b, c, s, tf32);
    }
    // Batched matrices of at most 64 x 64 outputs: sm90's smallest tile
    // (64x128) would be half empty, and sm80 runs them a little faster.
    // Wider ones run faster on sm90's 64-row tiles.
    const bool small_batched = s.batch > 1 && s.m <= 64 && s.n <= 64;
    if (!small_batched && kSm90.supports(g)) {
      run_path(kSm90, g, c);
      return c;
    }
    if (kSm80.supports(g)) {
      run_path(kSm80, g, c);
      return c;
    }
  }
  if (g.dtype == DType::f32 && g.allow_tf32) {
    if (is_hopper() && !kSm90.supports(g)) {
      // sm90 takes a K-major B with any A, and a row-major B with a
      // K-major A (as C^T = B^T A^T): what neither fits is copied, A first.
      if (!k_contiguous(a, /*k_dim=*/-1)) {
        a = padded_row_major(a);
        g = args_of(a, b, c, s, tf32);
      }
      if (!kSm90.supports(g) && !k_contiguous(b, /*k_dim=*/-2)) {
        b = padded_row_major(b.transpose(-2, -1)).transpose(-2, -1);
        g = args_of(a, b, c, s, tf32);
      }
    }
    if (kSm90.supports(g)) {
      run_path(kSm90, g, c);
      return c;
    }
    if (kSm80.supports(g)) {
      run_path(kSm80, g, c);
      return c;
    }
  }
  run_path(kSimt, g, c);
  return c;
}

// at::NoTF32Guard (thread-local) holds float32 exact as it holds cuBLAS:
// ops that call torchops.matmul for an exact product rely on it.
at::Tensor matmul(const at::Tensor& a, const at::Tensor& b) {
  return matmul_as(a, b,
                   at::globalContext().allowTF32CuBLAS() && !at::NoTF32Guard::should_disable_tf32());
}

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CUDA, m) {
  m.impl("matmul", &matmul);
}

}  // namespace torchops::cuda

// The subsystem's interface for other ops (api.h).
namespace torchops::matmul {

at::Tensor gemm_tf32(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.scalar_type() == at::kFloat, "torchops.matmul_tf32: float32 only, got ",
              a.scalar_type());
  return cuda::matmul_as(a, b, /*tf32=*/true);
}

void gemm_tf32_out(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.scalar_type() == at::kFloat, "torchops.matmul_tf32: float32 only, got ",
              a.scalar_type());
  cuda::matmul_as(a, b, /*tf32=*/true, &out);
}

bool gemm_3xtf32_out(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.scalar_type() == at::kFloat, "torchops.matmul_3xtf32: float32 only, got ",
              a.scalar_type());
  const MatmulShape s = check_matmul(a, b, c10::DeviceType::CUDA);
  TORCH_CHECK(out.sizes() == at::IntArrayRef(s.out_sizes()) && out.is_contiguous() &&
                  out.scalar_type() == at::kFloat && out.device() == a.device(),
              "torchops.matmul_3xtf32: out must be contiguous, of the result's shape, float32");
  const c10::cuda::CUDAGuard guard(a.device());
  at::Tensor c = out;
  if (c.numel() == 0 || s.k == 0) {
    return false;
  }
  const cuda::gemm::GemmArgs g = cuda::args_of(a, b, c, s, /*tf32=*/true);
  if (!cuda::gemm::sm90_3xtf32_path.supports(g)) {
    return false;
  }
  cuda::run_path(cuda::gemm::sm90_3xtf32_path, g, c);
  return true;
}

bool gemm_3xtf32_available() { return cuda::is_hopper(); }

}  // namespace torchops::matmul
