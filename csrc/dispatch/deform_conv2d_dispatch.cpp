// Dispatcher glue of torchops.deform_conv2d: its Autograd kernel and its
// AutocastCPU/AutocastCUDA kernels.
//
// Gradients flow to input, weight, offset, mask and bias through the
// registered operator torchops::_deform_conv2d_backward, called through the
// dispatcher so compiled training steps trace through it (no double
// backward).  Autocast as torchvision does it: computed in float32, returned
// in the input's dtype.
#include <torch/autograd.h>
#include <torch/library.h>

#include <tuple>
#include <utility>

#include "common/autocast.h"
#include "dispatch/handle.h"

namespace torchops::dispatch {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using c10::SymInt;

namespace ops {

at::Tensor deform_conv2d(const at::Tensor& input, const at::Tensor& weight,
                         const at::Tensor& offset, const at::Tensor& mask,
                         const at::Tensor& bias, SymInt stride_h,
                         SymInt stride_w, SymInt pad_h, SymInt pad_w,
                         SymInt dilation_h, SymInt dilation_w, SymInt groups,
                         SymInt offset_groups, bool use_mask) {
  static const auto op = typed_handle<at::Tensor(
      const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const at::Tensor&, SymInt, SymInt, SymInt, SymInt,
      SymInt, SymInt, SymInt, SymInt, bool)>("torchops::deform_conv2d");
  return op.call(input, weight, offset, mask, bias, std::move(stride_h),
                 std::move(stride_w), std::move(pad_h), std::move(pad_w),
                 std::move(dilation_h), std::move(dilation_w),
                 std::move(groups), std::move(offset_groups), use_mask);
}

using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                         at::Tensor>;

Grads deform_conv2d_backward(
    const at::Tensor& grad, const at::Tensor& input, const at::Tensor& weight,
    const at::Tensor& offset, const at::Tensor& mask, const at::Tensor& bias,
    SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w,
    SymInt dilation_h, SymInt dilation_w, SymInt groups, SymInt offset_groups,
    bool use_mask) {
  static const auto op = typed_handle<Grads(
      const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const at::Tensor&, const at::Tensor&, SymInt, SymInt,
      SymInt, SymInt, SymInt, SymInt, SymInt, SymInt, bool)>(
      "torchops::_deform_conv2d_backward");
  return op.call(grad, input, weight, offset, mask, bias, std::move(stride_h),
                 std::move(stride_w), std::move(pad_h), std::move(pad_w),
                 std::move(dilation_h), std::move(dilation_w),
                 std::move(groups), std::move(offset_groups), use_mask);
}

}  // namespace ops

const char* const kInts[] = {"stride_h",   "stride_w",   "pad_h",
                             "pad_w",      "dilation_h", "dilation_w",
                             "groups",     "offset_groups"};

class DeformConv2d : public torch::autograd::Function<DeformConv2d> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, const at::Tensor& offset,
                            const at::Tensor& mask, const at::Tensor& bias,
                            SymInt stride_h, SymInt stride_w, SymInt pad_h,
                            SymInt pad_w, SymInt dilation_h, SymInt dilation_w,
                            SymInt groups, SymInt offset_groups,
                            bool use_mask) {
    ctx->save_for_backward({input, weight, offset, mask, bias});
    const SymInt* ints[] = {&stride_h,   &stride_w,   &pad_h,  &pad_w,
                            &dilation_h, &dilation_w, &groups, &offset_groups};
    for (int i = 0; i < 8; ++i) {
      ctx->saved_data[kInts[i]] = *ints[i];
    }
    ctx->saved_data["use_mask"] = use_mask;
    at::AutoDispatchBelowADInplaceOrView guard;
    return ops::deform_conv2d(input, weight, offset, mask, bias,
                              std::move(stride_h), std::move(stride_w),
                              std::move(pad_h), std::move(pad_w),
                              std::move(dilation_h), std::move(dilation_w),
                              std::move(groups), std::move(offset_groups),
                              use_mask);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& d = ctx->saved_data;
    auto i = [&](int k) { return d.at(kInts[k]).toSymInt(); };
    auto [gi, gw, go, gm, gb] = ops::deform_conv2d_backward(
        grads[0], saved[0], saved[1], saved[2], saved[3], saved[4], i(0), i(1),
        i(2), i(3), i(4), i(5), i(6), i(7), d.at("use_mask").toBool());
    variable_list out = {gi, gw, go, gm, gb};
    out.resize(14);
    return out;
  }
};

at::Tensor deform_conv2d_autograd(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& offset,
    const at::Tensor& mask, const at::Tensor& bias, SymInt stride_h,
    SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h,
    SymInt dilation_w, SymInt groups, SymInt offset_groups, bool use_mask) {
  return DeformConv2d::apply(input, weight, offset, mask, bias,
                             std::move(stride_h), std::move(stride_w),
                             std::move(pad_h), std::move(pad_w),
                             std::move(dilation_h), std::move(dilation_w),
                             std::move(groups), std::move(offset_groups),
                             use_mask);
}

template <c10::DeviceType D>
at::Tensor deform_conv2d_autocast(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& offset,
    const at::Tensor& mask, const at::Tensor& bias, SymInt stride_h,
    SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h,
    SymInt dilation_w, SymInt groups, SymInt offset_groups, bool use_mask) {
  const AutocastFloat32<D> guard;
  return guard.back(
      ops::deform_conv2d(guard.up(input), guard.up(weight), guard.up(offset),
                         guard.up(mask), guard.up(bias), std::move(stride_h),
                         std::move(stride_w), std::move(pad_h),
                         std::move(pad_w), std::move(dilation_h),
                         std::move(dilation_w), std::move(groups),
                         std::move(offset_groups), use_mask),
      input);
}

}  // namespace
}  // namespace torchops::dispatch

TORCH_LIBRARY_IMPL(torchops, Autograd, m) {
  m.impl("deform_conv2d", &torchops::dispatch::deform_conv2d_autograd);
}

TORCHOPS_REGISTER_AUTOCAST("deform_conv2d",
                           torchops::dispatch::deform_conv2d_autocast)
