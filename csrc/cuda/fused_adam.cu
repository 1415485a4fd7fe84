// CUDA kernel of torchops.fused_adam_: one launch steps many tensors
// (cuda/common/multi_tensor.cuh).  Steps, a tensor lr, grad_scale and
// found_inf are read on the device: no host synchronisation.  Elements move
// four at a time (16 bytes for float) where every array of the tensor is
// aligned for it.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <type_traits>

#include "common/fused_adam.h"
#include "common/register_kernels.h"
#include "cuda/common/launch.cuh"
#include "cuda/common/multi_tensor.cuh"
#include "cuda/common/vectorized.cuh"

namespace torchops::cuda {
namespace {

constexpr int64_t kChunk = 1 << 16;
constexpr int kThreads = 512;
constexpr int kVec = 4;

// The arrays of a tensor: parameter (the float32 master with masters),
// gradient, moments, max moment (null without amsgrad), the low-precision
// parameter the master is rounded into (null without masters), and the
// float32 step count.
enum Slot { kParam = 0, kGrad, kExpAvg, kExpAvgSq, kMaxExpAvgSq, kLowParam, kStep, kSlots };
using Table = MultiTensorTable<kSlots>;

struct Scalars {
  AdamHyper h;
  const float* lr;  // the tensor lr, or null: h.lr
  const float* grad_scale;
  const float* found_inf;
};

static_assert(sizeof(Table) + sizeof(Scalars) <= 4000, "kernel arguments over 4 KiB");
static_assert(kChunk % kVec == 0, "chunks keep the vector alignment");

// param_t: the parameters; grad_t: the gradients; state_t: moments and
// masters (float32 with masters, param_t without).
template <typename param_t, typename grad_t, typename state_t>
__global__ void __launch_bounds__(kThreads) fused_adam_kernel(Table t, Scalars s) {
  using acc_t = std::conditional_t<std::is_same_v<state_t, double>, double, float>;
  if (s.found_inf != nullptr && *s.found_inf == 1.0f) {
    return;
  }
  const BlockChunk bc = block_chunk(t, kChunk);
  const int ti = bc.tensor;
  const int64_t begin = bc.begin;
  const int64_t len = bc.len;
  const double lr = s.lr != nullptr ? static_cast<double>(*s.lr) : s.h.lr;
  const AdamCoeffs<acc_t> c =
      adam_coeffs<acc_t>(s.h, lr, static_cast<double>(*static_cast<const float*>(t.ptr[kStep][ti])), s.grad_scale);

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

  const bool vec = pack_aligned<state_t, kVec>(p) && pack_aligned<grad_t, kVec>(g) &&
                   pack_aligned<state_t, kVec>(m) && pack_aligned<state_t, kVec>(v) &&
                   pack_aligned<state_t, kVec>(x) && pack_aligned<param_t, kVec>(low);
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
  multi_tensor_apply<kSlots>(
      kFusedAdamOp, params.size(), kChunk,
      [&](size_t i, void** ptr) {
        ptr[kParam] = kMaster ? (*master)[i].data_ptr() : params[i].data_ptr();
        ptr[kGrad] = grads[i].data_ptr();
        ptr[kExpAvg] = exp_avgs[i].data_ptr();
        ptr[kExpAvgSq] = exp_avg_sqs[i].data_ptr();
        ptr[kMaxExpAvgSq] = s.h.amsgrad ? max_exp_avg_sqs[i].data_ptr() : nullptr;
        ptr[kLowParam] = kMaster ? params[i].data_ptr() : nullptr;
        ptr[kStep] = steps[i].data_ptr();
        return params[i].numel();
      },
      [&](const Table& t, int blocks) {
        fused_adam_kernel<param_t, grad_t, state_t><<<blocks, kThreads, 0, stream>>>(t, s);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
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
  const c10::cuda::CUDAGuard guard(params[0].device());
  Scalars s{h, lr_tensor.has_value() ? lr_tensor->data_ptr<float>() : nullptr,
            grad_scale.has_value() ? grad_scale->data_ptr<float>() : nullptr,
            found_inf.has_value() ? found_inf->data_ptr<float>() : nullptr};
  const torchops::multi_tensor::StepDtypes d{
      params[0].scalar_type(), grads[0].scalar_type(),
      master_params.has_value() ? at::kFloat : params[0].scalar_type()};
  torchops::multi_tensor::dispatch_step_types(
      d, master_params.has_value(), [&](auto p, auto g, auto st) {
        launch_all<decltype(p), decltype(g), decltype(st)>(params, grads, exp_avgs, exp_avg_sqs,
                                                           max_exp_avg_sqs, state_steps,
                                                           master_params, s);
      });
}

}  // namespace

TORCHOPS_REGISTER_STEP(CUDA, fused_adam_, (&fused_adam_float_lr<fused_adam_impl>),
                       (&fused_adam_tensor_lr<fused_adam_impl>))

}  // namespace torchops::cuda
