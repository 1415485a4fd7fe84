// CUDA kernel of torchops.fused_sgd_: one launch steps many tensors
// (cuda/common/multi_tensor.cuh).  A tensor lr, grad_scale and found_inf are
// read on the device: no host synchronisation.  Elements move four at a time
// where every array of the tensor is aligned for it.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>
#include <type_traits>

#include "common/fused_sgd.h"
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
// gradient, momentum buffer (null without momentum), and the low-precision
// parameter the master is rounded into (null without masters).
enum Slot { kParam = 0, kGrad, kBuf, kLowParam, kSlots };
using Table = MultiTensorTable<kSlots>;

struct Scalars {
  SgdHyper h;
  const float* lr;  // the tensor lr, or null: h.lr
  const float* grad_scale;
  const float* found_inf;
};

static_assert(sizeof(Table) + sizeof(Scalars) <= 4000, "kernel arguments over 4 KiB");
static_assert(kChunk % kVec == 0, "chunks keep the vector alignment");

// param_t: the parameters; grad_t: the gradients; state_t: momentum buffers
// and masters (float32 with masters, param_t without).
template <typename param_t, typename grad_t, typename state_t>
__global__ void __launch_bounds__(kThreads) fused_sgd_kernel(Table t, Scalars s) {
  using acc_t = std::conditional_t<std::is_same_v<state_t, double>, double, float>;
  if (s.found_inf != nullptr && *s.found_inf == 1.0f) {
    return;
  }
  const BlockChunk bc = block_chunk(t, kChunk);
  const int ti = bc.tensor;
  const int64_t begin = bc.begin;
  const int64_t len = bc.len;
  const double lr = s.lr != nullptr ? static_cast<double>(*s.lr) : s.h.lr;
  const SgdCoeffs<acc_t> c = sgd_coeffs<acc_t>(s.h, lr, s.grad_scale);

  state_t* p = static_cast<state_t*>(t.ptr[kParam][ti]) + begin;
  grad_t* g = static_cast<grad_t*>(t.ptr[kGrad][ti]) + begin;
  state_t* b = static_cast<state_t*>(t.ptr[kBuf][ti]);
  param_t* low = static_cast<param_t*>(t.ptr[kLowParam][ti]);
  if (b != nullptr) {
    b += begin;
  }
  if (low != nullptr) {
    low += begin;
  }
  // The first step writes the buffer without reading it.
  const bool read_buf = b != nullptr && !c.first;

  const bool vec = pack_aligned<state_t, kVec>(p) && pack_aligned<grad_t, kVec>(g) &&
                   pack_aligned<state_t, kVec>(b) && pack_aligned<param_t, kVec>(low);
  int64_t done = 0;
  if (vec) {
    using SP = Pack<state_t, kVec>;
    using GP = Pack<grad_t, kVec>;
    using LP = Pack<param_t, kVec>;
    const int64_t packs = len / kVec;
    for (int64_t k = threadIdx.x; k < packs; k += blockDim.x) {
      const SP pp = reinterpret_cast<const SP*>(p)[k];
      GP gp = reinterpret_cast<const GP*>(g)[k];
      SP bp{};
      if (read_buf) {
        bp = reinterpret_cast<const SP*>(b)[k];
      }
      SP po;
      LP lo;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        acc_t pj = static_cast<acc_t>(pp.v[e]);
        acc_t gj = static_cast<acc_t>(gp.v[e]);
        acc_t bj = static_cast<acc_t>(bp.v[e]);
        sgd_update<acc_t>(pj, gj, b != nullptr ? &bj : nullptr, c);
        po.v[e] = static_cast<state_t>(pj);
        lo.v[e] = static_cast<param_t>(pj);
        gp.v[e] = static_cast<grad_t>(gj);
        bp.v[e] = static_cast<state_t>(bj);
      }
      reinterpret_cast<SP*>(p)[k] = po;
      if (low != nullptr) {
        reinterpret_cast<LP*>(low)[k] = lo;
      }
      if (c.has_scale) {
        reinterpret_cast<GP*>(g)[k] = gp;
      }
      if (b != nullptr) {
        reinterpret_cast<SP*>(b)[k] = bp;
      }
    }
    done = packs * kVec;
  }
  for (int64_t j = done + threadIdx.x; j < len; j += blockDim.x) {
    acc_t pj = static_cast<acc_t>(p[j]);
    acc_t gj = static_cast<acc_t>(g[j]);
    acc_t bj = read_buf ? static_cast<acc_t>(b[j]) : acc_t(0);
    sgd_update<acc_t>(pj, gj, b != nullptr ? &bj : nullptr, c);
    p[j] = static_cast<state_t>(pj);
    if (low != nullptr) {
      low[j] = static_cast<param_t>(pj);
    }
    if (c.has_scale) {
      g[j] = static_cast<grad_t>(gj);
    }
    if (b != nullptr) {
      b[j] = static_cast<state_t>(bj);
    }
  }
}

template <typename param_t, typename grad_t, typename state_t>
void launch_all(at::TensorList params, at::TensorList grads, at::TensorList bufs,
                const std::optional<at::TensorList>& master, const Scalars& s) {
  constexpr bool kMaster = !std::is_same_v<param_t, state_t>;
  const bool has_buf = !bufs.empty();
  const cudaStream_t stream = current_stream();
  multi_tensor_apply<kSlots>(
      kFusedSgdOp, params.size(), kChunk,
      [&](size_t i, void** ptr) {
        ptr[kParam] = kMaster ? (*master)[i].data_ptr() : params[i].data_ptr();
        ptr[kGrad] = grads[i].data_ptr();
        ptr[kBuf] = has_buf ? bufs[i].data_ptr() : nullptr;
        ptr[kLowParam] = kMaster ? params[i].data_ptr() : nullptr;
        return params[i].numel();
      },
      [&](const Table& t, int blocks) {
        fused_sgd_kernel<param_t, grad_t, state_t><<<blocks, kThreads, 0, stream>>>(t, s);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
}

void fused_sgd_impl(at::TensorList params, at::TensorList grads,
                    at::TensorList momentum_buffer_list, const SgdHyper& h,
                    const std::optional<at::TensorList>& master_params,
                    const std::optional<at::Tensor>& lr_tensor,
                    const std::optional<at::Tensor>& grad_scale,
                    const std::optional<at::Tensor>& found_inf) {
  check_fused_sgd(c10::DeviceType::CUDA, params, grads, momentum_buffer_list, h, master_params,
                  lr_tensor, grad_scale, found_inf);
  if (params.empty()) {
    return;
  }
  const c10::cuda::CUDAGuard guard(params[0].device());
  const Scalars s{h, lr_tensor.has_value() ? lr_tensor->data_ptr<float>() : nullptr,
                  grad_scale.has_value() ? grad_scale->data_ptr<float>() : nullptr,
                  found_inf.has_value() ? found_inf->data_ptr<float>() : nullptr};
  const multi_tensor::StepDtypes d{
      params[0].scalar_type(), grads[0].scalar_type(),
      master_params.has_value() ? at::kFloat : params[0].scalar_type()};
  multi_tensor::dispatch_step_types(d, master_params.has_value(), [&](auto p, auto g, auto st) {
    launch_all<decltype(p), decltype(g), decltype(st)>(params, grads, momentum_buffer_list,
                                                       master_params, s);
  });
}

}  // namespace

TORCHOPS_REGISTER_STEP(CUDA, fused_sgd_, (&fused_sgd_float_lr<fused_sgd_impl>),
                       (&fused_sgd_tensor_lr<fused_sgd_impl>))

}  // namespace torchops::cuda
