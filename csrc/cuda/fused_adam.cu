// CUDA kernel of torchops.fused_adam_: one launch steps many tensors.
//
// As apex's multi_tensor_apply: the tensors are cut into chunks of kChunk
// elements, and each block of a launch updates one chunk.  A launch's table
// (the tensors' pointers, sizes and step pointers, and which tensor and
// chunk each block takes) is passed by value as the kernel's argument, so
// nothing is copied to the device beforehand and the launch can be captured
// in a CUDA graph; a long list takes several launches, each with its own
// table.  Steps, a tensor lr, grad_scale and found_inf are read on the
// device: no host synchronisation.  Elements move four at a time (16 bytes
// for float) where every array of the tensor is aligned for it.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <type_traits>

#include "common/fused_adam.h"
#include "cuda/common/launch.cuh"
#include "cuda/common/vectorized.cuh"

namespace torchops::cuda {
namespace {

constexpr int64_t kChunk = 1 << 16;
constexpr int kThreads = 512;
constexpr int kVec = 4;
// Table sizes that keep the kernel's arguments under CUDA's 4 KiB.
constexpr int kMaxTensors = 36;
constexpr int kMaxBlocks = 256;

// The arrays of a tensor: parameter (the float32 master with masters),
// gradient, moments, max moment (null without amsgrad), and the
// low-precision parameter the master is rounded into (null without masters).
enum Slot { kParam = 0, kGrad, kExpAvg, kExpAvgSq, kMaxExpAvgSq, kLowParam, kSlots };

struct Table {
  void* ptr[kSlots][kMaxTensors];
  const float* step[kMaxTensors];
  int64_t numel[kMaxTensors];
  int block_chunk[kMaxBlocks];
  unsigned char block_tensor[kMaxBlocks];
};

struct Scalars {
  AdamHyper h;
  const float* lr;  // the tensor lr, or null: h.lr
  const float* grad_scale;
  const float* found_inf;
};

static_assert(sizeof(Table) + sizeof(Scalars) <= 4000, "kernel arguments over 4 KiB");
static_assert(kMaxTensors <= 255, "block_tensor is a byte");
static_assert(kChunk % kVec == 0, "chunks keep the vector alignment");

template <typename T>
__device__ inline bool aligned(const void* p) {
  return p == nullptr || reinterpret_cast<uintptr_t>(p) % (sizeof(T) * kVec) == 0;
}

// param_t: the parameters; grad_t: the gradients; state_t: moments and
// masters (float32 with masters, param_t without).
template <typename param_t, typename grad_t, typename state_t>
__global__ void __launch_bounds__(kThreads) fused_adam_kernel(Table t, Scalars s) {
  using acc_t = std::conditional_t<std::is_same_v<state_t, double>, double, float>;
  if (s.found_inf != nullptr && *s.found_inf == 1.0f) {
    return;
  }
  const int ti = t.block_tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(t.block_chunk[blockIdx.x]) * kChunk;
  const int64_t rest = t.numel[ti] - begin;
  const int64_t len = rest < kChunk ? rest : kChunk;
  const double lr = s.lr != nullptr ? static_cast<double>(*s.lr) : s.h.lr;
  const AdamCoeffs<acc_t> c =
      adam_coeffs<acc_t>(s.h, lr, static_cast<double>(*t.step[ti]), s.grad_scale);

  state_t* p = static_cast<state_t*>(t.ptr[kParam][ti]) + begin;
  grad_t* g = static_cast<grad_t*>(t.ptr[kGrad][ti]) + begin;
  state_t* m = static_cast<state_t*>(t.ptr[kExpAvg][ti]) + begin;
  state_t* v = static_cast<state_t*>(t.ptr[kExpAvgSq][ti]) + begin;
  state_t* x = static_cast<state_t*>(t.ptr[kMaxExpAvgSq][ti]);
  param_t* low = static_cast<param_t*>(t.ptr[kLowParam][ti]);
  if (x != nullptr) {
    x += begin;
  }
  if (low != nullptr) {
    low += begin;
  }

  // Updates element j of the chunk from and into registers.
  auto update = [&](acc_t& pj, acc_t& gj, acc_t& mj, acc_t& vj, acc_t& xj) {
    adam_update<acc_t>(pj, gj, mj, vj, x != nullptr ? &xj : nullptr, c);
  };

  const bool vec = aligned<state_t>(p) && aligned<grad_t>(g) && aligned<state_t>(m) &&
                   aligned<state_t>(v) && aligned<state_t>(x) && aligned<param_t>(low);
  int64_t done = 0;
  if (vec) {
    using SP = Pack<state_t, kVec>;
    using GP = Pack<grad_t, kVec>;
    using LP = Pack<param_t, kVec>;
    const int64_t packs = len / kVec;
    for (int64_t k = threadIdx.x; k < packs; k += blockDim.x) {
      const SP pp = reinterpret_cast<const SP*>(p)[k];
      GP gp = reinterpret_cast<const GP*>(g)[k];
      SP mp = reinterpret_cast<const SP*>(m)[k];
      SP vp = reinterpret_cast<const SP*>(v)[k];
      SP xp{};
      if (x != nullptr) {
        xp = reinterpret_cast<const SP*>(x)[k];
      }
      SP po;
      LP lo;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        acc_t pj = static_cast<acc_t>(pp.v[e]);
        acc_t gj = static_cast<acc_t>(gp.v[e]);
        acc_t mj = static_cast<acc_t>(mp.v[e]);
        acc_t vj = static_cast<acc_t>(vp.v[e]);
        acc_t xj = static_cast<acc_t>(xp.v[e]);
        update(pj, gj, mj, vj, xj);
        po.v[e] = static_cast<state_t>(pj);
        lo.v[e] = static_cast<param_t>(pj);
        gp.v[e] = static_cast<grad_t>(gj);
        mp.v[e] = static_cast<state_t>(mj);
        vp.v[e] = static_cast<state_t>(vj);
        xp.v[e] = static_cast<state_t>(xj);
      }
      reinterpret_cast<SP*>(p)[k] = po;
      if (low != nullptr) {
        reinterpret_cast<LP*>(low)[k] = lo;
      }
      if (c.has_scale) {
        reinterpret_cast<GP*>(g)[k] = gp;
      }
      reinterpret_cast<SP*>(m)[k] = mp;
      reinterpret_cast<SP*>(v)[k] = vp;
      if (x != nullptr) {
        reinterpret_cast<SP*>(x)[k] = xp;
      }
    }
    done = packs * kVec;
  }
  for (int64_t j = done + threadIdx.x; j < len; j += blockDim.x) {
    acc_t pj = static_cast<acc_t>(p[j]);
    acc_t gj = static_cast<acc_t>(g[j]);
    acc_t mj = static_cast<acc_t>(m[j]);
    acc_t vj = static_cast<acc_t>(v[j]);
    acc_t xj = x != nullptr ? static_cast<acc_t>(x[j]) : acc_t(0);
    update(pj, gj, mj, vj, xj);
    p[j] = static_cast<state_t>(pj);
    if (low != nullptr) {
      low[j] = static_cast<param_t>(pj);
    }
    if (c.has_scale) {
      g[j] = static_cast<grad_t>(gj);
    }
    m[j] = static_cast<state_t>(mj);
    v[j] = static_cast<state_t>(vj);
    if (x != nullptr) {
      x[j] = static_cast<state_t>(xj);
    }
  }
}

template <typename param_t, typename grad_t, typename state_t>
void launch_all(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                at::TensorList steps, const std::optional<at::TensorList>& master,
                const Scalars& s) {
  constexpr bool kMaster = !std::is_same_v<param_t, state_t>;
  const cudaStream_t stream = current_stream();
  Table t;
  int tensors = 0;
  int blocks = 0;
  auto launch = [&] {
    fused_adam_kernel<param_t, grad_t, state_t><<<blocks, kThreads, 0, stream>>>(t, s);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t numel = params[i].numel();
    if (numel == 0) {
      continue;
    }
    const int slot = tensors++;
    t.ptr[kParam][slot] = kMaster ? (*master)[i].data_ptr() : params[i].data_ptr();
    t.ptr[kGrad][slot] = grads[i].data_ptr();
    t.ptr[kExpAvg][slot] = exp_avgs[i].data_ptr();
    t.ptr[kExpAvgSq][slot] = exp_avg_sqs[i].data_ptr();
    t.ptr[kMaxExpAvgSq][slot] = s.h.amsgrad ? max_exp_avg_sqs[i].data_ptr() : nullptr;
    t.ptr[kLowParam][slot] = kMaster ? params[i].data_ptr() : nullptr;
    t.step[slot] = steps[i].data_ptr<float>();
    t.numel[slot] = numel;
    const int64_t chunks = ceil_div(numel, kChunk);
    for (int64_t ch = 0; ch < chunks; ++ch) {
      t.block_tensor[blocks] = static_cast<unsigned char>(slot);
      t.block_chunk[blocks] = static_cast<int>(ch);
      ++blocks;
      const bool last_chunk = ch == chunks - 1;
      if (blocks == kMaxBlocks || (tensors == kMaxTensors && last_chunk)) {
        launch();
        blocks = 0;
        if (last_chunk) {
          tensors = 0;
        } else {
          // The tensor continues in the next launch, as its table's slot 0.
          for (int k = 0; k < kSlots; ++k) {
            t.ptr[k][0] = t.ptr[k][slot];
          }
          t.step[0] = t.step[slot];
          t.numel[0] = t.numel[slot];
          tensors = 1;
        }
      }
    }
  }
  if (blocks > 0) {
    launch();
  }
}

void fused_adam_impl(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                     at::TensorList state_steps, const AdamHyper& h,
                     const std::optional<at::TensorList>& master_params,
                     const std::optional<at::Tensor>& lr_tensor,
                     const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf) {
  check_fused_adam(c10::DeviceType::CUDA, params, grads, exp_avgs, exp_avg_sqs,
                   max_exp_avg_sqs, state_steps, h, master_params, lr_tensor, grad_scale,
                   found_inf);
  if (params.empty()) {
    return;
  }
  // Chunk indices are ints (a tensor of up to 2^31 chunks of kChunk).
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(ceil_div(params[i].numel(), kChunk) <= std::numeric_limits<int>::max(),
                "torchops.fused_adam_: 'params[", i, "]' is too large");
  }
  const c10::cuda::CUDAGuard guard(params[0].device());
  Scalars s{h, lr_tensor.has_value() ? lr_tensor->data_ptr<float>() : nullptr,
            grad_scale.has_value() ? grad_scale->data_ptr<float>() : nullptr,
            found_inf.has_value() ? found_inf->data_ptr<float>() : nullptr};
  const at::ScalarType pt = params[0].scalar_type();
  const at::ScalarType gt = grads[0].scalar_type();
  auto call = [&](auto param_tag, auto grad_tag, auto state_tag) {
    launch_all<decltype(param_tag), decltype(grad_tag), decltype(state_tag)>(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, master_params, s);
  };
  if (master_params.has_value()) {
    AT_DISPATCH_REDUCED_FLOATING_TYPES(pt, "fused_adam_", [&] {
      if (gt == at::kFloat) {
        call(scalar_t{}, float{}, float{});
      } else {
        call(scalar_t{}, scalar_t{}, float{});
      }
    });
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, pt, "fused_adam_", [&] {
      call(scalar_t{}, scalar_t{}, scalar_t{});
    });
  }
}

void fused_adam(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                at::TensorList state_steps, double lr, double beta1, double beta2, double eps,
                double weight_decay, bool amsgrad, bool maximize, bool adamw,
                std::optional<at::TensorList> master_params,
                const std::optional<at::Tensor>& grad_scale,
                const std::optional<at::Tensor>& found_inf) {
  fused_adam_impl(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                  AdamHyper{lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, adamw},
                  master_params, std::nullopt, grad_scale, found_inf);
}

void fused_adam_tensor_lr(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                          at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                          at::TensorList state_steps, const at::Tensor& lr, double beta1,
                          double beta2, double eps, double weight_decay, bool amsgrad,
                          bool maximize, bool adamw, std::optional<at::TensorList> master_params,
                          const std::optional<at::Tensor>& grad_scale,
                          const std::optional<at::Tensor>& found_inf) {
  fused_adam_impl(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                  AdamHyper{0.0, beta1, beta2, eps, weight_decay, amsgrad, maximize, adamw},
                  master_params, lr, grad_scale, found_inf);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CUDA, m) {
  m.impl("fused_adam_", &fused_adam);
  m.impl("fused_adam_.tensor_lr", &fused_adam_tensor_lr);
}

// A sparse gradient sends the call to the sparse key: the same kernel then
// rejects it by name and index.
TORCH_LIBRARY_IMPL(torchops, SparseCUDA, m) {
  m.impl("fused_adam_", &fused_adam);
  m.impl("fused_adam_.tensor_lr", &fused_adam_tensor_lr);
}

}  // namespace torchops::cuda
