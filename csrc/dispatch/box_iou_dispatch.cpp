// Dispatcher glue of torchops.box_iou: registers its Autograd kernel.  The
// backward is the registered operator torchops::_box_iou_backward (CPU and
// CUDA kernels, a fake), called through the dispatcher, so compiled training
// steps trace straight through it.
#include <torch/autograd.h>
#include <torch/library.h>

#include <tuple>

#include "dispatch/handle.h"

namespace torchops::dispatch {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace ops {

at::Tensor box_iou(const at::Tensor& boxes1, const at::Tensor& boxes2) {
  static const auto op =
      typed_handle<at::Tensor(const at::Tensor&, const at::Tensor&)>(
          "torchops::box_iou");
  return op.call(boxes1, boxes2);
}

std::tuple<at::Tensor, at::Tensor> box_iou_backward(
    const at::Tensor& grad, const at::Tensor& boxes1, const at::Tensor& boxes2) {
  static const auto op = typed_handle<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
      "torchops::_box_iou_backward");
  return op.call(grad, boxes1, boxes2);
}

}  // namespace ops

class BoxIou : public torch::autograd::Function<BoxIou> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& boxes1,
                            const at::Tensor& boxes2) {
    ctx->save_for_backward({boxes1, boxes2});
    at::AutoDispatchBelowADInplaceOrView guard;
    return ops::box_iou(boxes1, boxes2);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [grad1, grad2] = ops::box_iou_backward(grads[0], saved[0], saved[1]);
    return {ctx->needs_input_grad(0) ? grad1 : at::Tensor(),
            ctx->needs_input_grad(1) ? grad2 : at::Tensor()};
  }
};

at::Tensor box_iou_autograd(const at::Tensor& boxes1, const at::Tensor& boxes2) {
  return BoxIou::apply(boxes1, boxes2);
}

}  // namespace
}  // namespace torchops::dispatch

TORCH_LIBRARY_IMPL(torchops, Autograd, m) {
  m.impl("box_iou", &torchops::dispatch::box_iou_autograd);
}
