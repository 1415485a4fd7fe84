// CPU kernel of torchops.fused_sgd_.
//
// Memory-bound: each element's parameter, gradient and momentum buffer (and
// master copy) are read and written once.  The work is cut as
// fused_adam_'s is (cpu/common/multi_tensor.h): chunks of all tensors spread
// over the threads, each updated in L1-sized blocks through float (or
// double) views of its arrays.  The update runs on at::vec vectors (AVX2 +
// FMA, chosen at load time; common/fused_sgd.h's scalar form elsewhere), in
// the order of torch.optim's for-loop SGD.
#include "cpu/common/vectorized.h"  // first: see the header

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <type_traits>
#include <vector>

#include "common/fused_sgd.h"
#include "common/register_kernels.h"
#include "cpu/common/multi_tensor.h"

namespace torchops::cpu {
namespace {

namespace mt = multi_tensor;

// Elements per block of a work item (3 arrays of kBlock floats stay in L1).
constexpr int64_t kBlock = 1024;

template <typename acc_t>
void sgd_block_scalar(acc_t* p, acc_t* g, acc_t* buf, int64_t n, const SgdCoeffs<acc_t>& c) {
  for (int64_t i = 0; i < n; ++i) {
    sgd_update(p[i], g[i], buf == nullptr ? nullptr : buf + i, c);
  }
}

TORCHOPS_VEC_BEGIN

// sgd_update (common/fused_sgd.h), a vector at a time: whole vectors, then
// the last partial one, loaded and stored with counts.
template <typename acc_t>
void sgd_block_vec(acc_t* p, acc_t* g, acc_t* buf, int64_t n, const SgdCoeffs<acc_t>& c) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  const Vec scale(c.grad_scale), decay(c.weight_decay), momentum(c.momentum),
      omd(c.one_minus_dampening), neg_lr(c.neg_lr);
  // `whole` (std::true_type) compiles the loop's loads and stores without counts.
  auto step = [&](int64_t i, int64_t k, auto whole) {
    auto load = [&](const acc_t* x) {
      if constexpr (decltype(whole)::value) {
        return Vec::loadu(x + i);
      } else {
        return Vec::loadu(x + i, k);
      }
    };
    auto store = [&](const Vec& x, acc_t* to) {
      if constexpr (decltype(whole)::value) {
        x.store(to + i);
      } else {
        x.store(to + i, k);
      }
    };
    Vec gv = load(g);
    if (c.has_scale) {
      gv = gv / scale;
      store(gv, g);
    }
    Vec d = c.maximize ? gv.neg() : gv;
    Vec pv = load(p);
    if (c.decayed) {
      d = at::vec::fmadd(pv, decay, d);
    }
    if (buf != nullptr) {
      const Vec b = c.first ? d : at::vec::fmadd(d, omd, load(buf) * momentum);
      store(b, buf);
      d = c.nesterov ? at::vec::fmadd(b, momentum, d) : b;
    }
    pv = at::vec::fmadd(d, neg_lr, pv);
    store(pv, p);
  };
  const int64_t whole = n - n % W;
  for (int64_t i = 0; i < whole; i += W) {
    step(i, W, std::true_type{});
  }
  if (whole < n) {
    step(whole, n - whole, std::false_type{});
  }
}

template void sgd_block_vec<float>(float*, float*, float*, int64_t, const SgdCoeffs<float>&);
template void sgd_block_vec<double>(double*, double*, double*, int64_t,
                                    const SgdCoeffs<double>&);

TORCHOPS_VEC_END

// param_t: the parameters; grad_t: the gradients; state_t: momentum buffers
// (and masters, which are float32 as the buffers then are).
template <typename param_t, typename grad_t, typename state_t>
void run(at::TensorList params, at::TensorList grads, at::TensorList bufs,
         const std::optional<at::TensorList>& master, const SgdHyper& h, double lr,
         const float* grad_scale) {
  using acc_t = std::conditional_t<std::is_same_v<state_t, double>, double, float>;
  const SgdCoeffs<acc_t> c = sgd_coeffs<acc_t>(h, lr, grad_scale);
  constexpr bool kMaster = !std::is_same_v<param_t, state_t>;
  const bool has_buf = !bufs.empty();
  const std::vector<mt::Item> items =
      mt::chunk_items(params.size(), [&](size_t i) { return params[i].numel(); });
  const bool vec = vec_available();
  mt::parallel_items(items, [&](const mt::Item& item) {
    acc_t block[3][kBlock];
    const size_t i = item.tensor;
    // With masters the update reads and writes the float32 master, then
    // rounds it into the parameter.
    mt::View<state_t, acc_t> pv{kMaster ? (*master)[i].data_ptr<state_t>()
                                        : reinterpret_cast<state_t*>(params[i].data_ptr()),
                                block[0]};
    mt::View<grad_t, acc_t> gv{grads[i].data_ptr<grad_t>(), block[1]};
    mt::View<state_t, acc_t> bv{has_buf ? bufs[i].data_ptr<state_t>() : nullptr, block[2]};
    param_t* low = kMaster ? params[i].data_ptr<param_t>() : nullptr;
    for (int64_t off = item.begin; off < item.end; off += kBlock) {
      const int64_t len = std::min(kBlock, item.end - off);
      acc_t* p = pv.at(off, len);
      acc_t* g = gv.at(off, len);
      acc_t* b = bv.at(off, len);
      if (vec) {
        sgd_block_vec<acc_t>(p, g, b, len, c);
      } else {
        sgd_block_scalar<acc_t>(p, g, b, len, c);
      }
      pv.finish(off, len);
      if (c.has_scale) {
        gv.finish(off, len);
      }
      bv.finish(off, len);
      if constexpr (kMaster) {
        for (int64_t j = 0; j < len; ++j) {
          low[off + j] = static_cast<param_t>(p[j]);
        }
      }
    }
  });
}

void fused_sgd_impl(at::TensorList params, at::TensorList grads,
                    at::TensorList momentum_buffer_list, const SgdHyper& h,
                    const std::optional<at::TensorList>& master_params,
                    const std::optional<at::Tensor>& lr_tensor,
                    const std::optional<at::Tensor>& grad_scale,
                    const std::optional<at::Tensor>& found_inf) {
  check_fused_sgd(c10::DeviceType::CPU, params, grads, momentum_buffer_list, h, master_params,
                  lr_tensor, grad_scale, found_inf);
  if (params.empty()) {
    return;
  }
  // GradScaler found an inf or NaN: the step is skipped, nothing is written.
  if (found_inf.has_value() && *found_inf->data_ptr<float>() == 1.0f) {
    return;
  }
  const double lr = lr_tensor.has_value() ? static_cast<double>(*lr_tensor->data_ptr<float>())
                                          : h.lr;
  const float* scale = grad_scale.has_value() ? grad_scale->data_ptr<float>() : nullptr;
  const torchops::multi_tensor::StepDtypes d{
      params[0].scalar_type(), grads[0].scalar_type(),
      master_params.has_value() ? at::kFloat : params[0].scalar_type()};
  torchops::multi_tensor::dispatch_step_types(
      d, master_params.has_value(), [&](auto p, auto g, auto st) {
        run<decltype(p), decltype(g), decltype(st)>(params, grads, momentum_buffer_list,
                                                    master_params, h, lr, scale);
      });
}

}  // namespace

TORCHOPS_REGISTER_STEP(CPU, fused_sgd_, (&fused_sgd_float_lr<fused_sgd_impl>),
                       (&fused_sgd_tensor_lr<fused_sgd_impl>))

}  // namespace torchops::cpu
