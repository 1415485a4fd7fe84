// CPU kernel of torchops.fused_adam_.
//
// Memory-bound: each element is read and written once (parameter, gradient,
// both moments, and the master copy or the max moment when there is one).
// The tensors are cut into chunks that at::parallel_for spreads over the
// threads; a chunk is updated in blocks that stay in L1, through float (or
// double) views of its arrays: arrays already in the compute type are used in
// place, the others (bfloat16/float16 parameters, gradients, states) are
// converted into a block buffer and back.  The update runs on at::vec
// vectors (AVX2 + FMA, chosen at load time; common/fused_adam.h's scalar
// form elsewhere), in the order of torch.optim's for-loop Adam.
#include "cpu/common/vectorized.h"  // first: see the header

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <type_traits>
#include <vector>

#include "common/fused_adam.h"
#include "common/register_kernels.h"
#include "cpu/common/multi_tensor.h"

namespace torchops::cpu {
namespace {

namespace mt = multi_tensor;

// Elements per block of a work item (6 arrays of kBlock floats fit in L1
// with room to spare).
constexpr int64_t kBlock = 1024;

template <typename acc_t>
void adam_block_scalar(acc_t* p, acc_t* g, acc_t* m, acc_t* v, acc_t* vmax, int64_t n,
                       const AdamCoeffs<acc_t>& c) {
  for (int64_t i = 0; i < n; ++i) {
    adam_update(p[i], g[i], m[i], v[i], vmax == nullptr ? nullptr : vmax + i, c);
  }
}

TORCHOPS_VEC_BEGIN

// adam_update (common/fused_adam.h), a vector at a time; the last partial
// vector is loaded and stored with counts.
template <typename acc_t>
void adam_block_vec(acc_t* p, acc_t* g, acc_t* m, acc_t* v, acc_t* vmax, int64_t n,
                    const AdamCoeffs<acc_t>& c) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  const Vec scale(c.grad_scale), l2(c.l2), decay(c.decay), lerp_w(c.lerp_w), beta2(c.beta2),
      omb2(c.one_minus_beta2), bc2_sqrt(c.bc2_sqrt), eps(c.eps), neg_step(c.neg_step_size);
  for (int64_t i = 0; i < n; i += W) {
    const int64_t k = std::min<int64_t>(W, n - i);
    auto load = [&](const acc_t* x) { return k == W ? Vec::loadu(x + i) : Vec::loadu(x + i, k); };
    auto store = [&](const Vec& x, acc_t* to) {
      if (k == W) {
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
    d = d + pv * l2;
    pv = pv * decay;
    Vec mv = load(m);
    const Vec diff = d - mv;
    mv = at::vec::fmadd(lerp_w, diff, c.from_end ? d : mv);
    const Vec vv = load(v) * beta2 + omb2 * d * d;
    store(mv, m);
    store(vv, v);
    Vec s = vv;
    if (vmax != nullptr) {
      s = at::vec::maximum(load(vmax), vv);
      store(s, vmax);
    }
    const Vec denom = s.sqrt() / bc2_sqrt + eps;
    pv = pv + neg_step * mv / denom;
    store(pv, p);
  }
}

template void adam_block_vec<float>(float*, float*, float*, float*, float*, int64_t,
                                    const AdamCoeffs<float>&);
template void adam_block_vec<double>(double*, double*, double*, double*, double*, int64_t,
                                     const AdamCoeffs<double>&);

// Block conversions between float and the 16-bit types (at::vec's, with
// F16C for the float-to-16-bit direction).
template <typename T>
void convert_in_vec(const T* src, float* dst, int64_t n) {
  at::vec::convert(src, dst, n);
}

template <typename T>
void convert_out_vec(const float* src, T* dst, int64_t n) {
  at::vec::convert(src, dst, n);
}

template void convert_in_vec<at::BFloat16>(const at::BFloat16*, float*, int64_t);
template void convert_in_vec<at::Half>(const at::Half*, float*, int64_t);
template void convert_out_vec<at::BFloat16>(const float*, at::BFloat16*, int64_t);
template void convert_out_vec<at::Half>(const float*, at::Half*, int64_t);

TORCHOPS_VEC_END

// A view of a T array in acc_t, with the vector conversions where they apply.
template <typename T, typename acc_t>
mt::View<T, acc_t> view(T* data, acc_t* buf, bool vec) {
  mt::View<T, acc_t> v{data, buf};
  if constexpr (std::is_same_v<acc_t, float> &&
                (std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>)) {
    if (vec) {
      v.in = &convert_in_vec<T>;
      v.out = &convert_out_vec<T>;
    }
  }
  return v;
}

// param_t: the parameters; grad_t: the gradients; state_t: moments (and
// masters, which are float32 as the states then are).
template <typename param_t, typename grad_t, typename state_t>
void run(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
         at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList steps,
         const std::optional<at::TensorList>& master, const AdamHyper& h, double lr,
         const float* grad_scale) {
  using acc_t = std::conditional_t<std::is_same_v<state_t, double>, double, float>;
  constexpr bool kMaster = !std::is_same_v<param_t, state_t>;
  const size_t n = params.size();
  std::vector<AdamCoeffs<acc_t>> coeffs(n);
  for (size_t i = 0; i < n; ++i) {
    const double step = static_cast<double>(*steps[i].data_ptr<float>());
    coeffs[i] = adam_coeffs<acc_t>(h, lr, step, grad_scale);
  }
  const std::vector<mt::Item> items =
      mt::chunk_items(n, [&](size_t i) { return params[i].numel(); });
  const bool vec = vec_available();
  mt::parallel_items(items, [&](const mt::Item& item) {
    acc_t buf[5][kBlock];
    const size_t i = item.tensor;
    const AdamCoeffs<acc_t>& c = coeffs[i];
    // With masters the update reads and writes the float32 master, then
    // rounds it into the parameter.
    auto pv = view<state_t, acc_t>(kMaster ? (*master)[i].data_ptr<state_t>()
                                           : reinterpret_cast<state_t*>(params[i].data_ptr()),
                                   buf[0], vec);
    auto gv = view<grad_t, acc_t>(grads[i].data_ptr<grad_t>(), buf[1], vec);
    auto mv = view<state_t, acc_t>(exp_avgs[i].data_ptr<state_t>(), buf[2], vec);
    auto vv = view<state_t, acc_t>(exp_avg_sqs[i].data_ptr<state_t>(), buf[3], vec);
    auto xv = view<state_t, acc_t>(
        h.amsgrad ? max_exp_avg_sqs[i].data_ptr<state_t>() : nullptr, buf[4], vec);
    // The rounded copy of the master goes out as a fifth view's write-back.
    auto lv = view<param_t, acc_t>(kMaster ? params[i].data_ptr<param_t>() : nullptr, nullptr,
                                   vec);
    for (int64_t off = item.begin; off < item.end; off += kBlock) {
      const int64_t len = std::min(kBlock, item.end - off);
      acc_t* p = pv.at(off, len);
      acc_t* g = gv.at(off, len);
      acc_t* m = mv.at(off, len);
      acc_t* v = vv.at(off, len);
      acc_t* x = xv.at(off, len);
      if (vec) {
        adam_block_vec<acc_t>(p, g, m, v, x, len, c);
      } else {
        adam_block_scalar<acc_t>(p, g, m, v, x, len, c);
      }
      pv.finish(off, len);
      if (c.has_scale) {
        gv.finish(off, len);
      }
      mv.finish(off, len);
      vv.finish(off, len);
      xv.finish(off, len);
      if constexpr (kMaster) {
        lv.out(p, lv.data + off, len);
      }
    }
  });
}

void fused_adam_impl(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                     at::TensorList state_steps, const AdamHyper& h,
                     const std::optional<at::TensorList>& master_params,
                     const std::optional<at::Tensor>& lr_tensor,
                     const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf) {
  check_fused_adam(c10::DeviceType::CPU, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                   state_steps, h, master_params, lr_tensor, grad_scale, found_inf);
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
  const torchops::multi_tensor::StepDtypes d{params[0].scalar_type(), grads[0].scalar_type(),
                        master_params.has_value() ? at::kFloat : params[0].scalar_type()};
  torchops::multi_tensor::dispatch_step_types(d, master_params.has_value(), [&](auto p, auto g, auto st) {
    run<decltype(p), decltype(g), decltype(st)>(params, grads, exp_avgs, exp_avg_sqs,
                                                max_exp_avg_sqs, state_steps, master_params, h,
                                                lr, scale);
  });
}

}  // namespace

TORCHOPS_REGISTER_STEP(CPU, fused_adam_, (&fused_adam_float_lr<fused_adam_impl>),
                       (&fused_adam_tensor_lr<fused_adam_impl>))

}  // namespace torchops::cpu
