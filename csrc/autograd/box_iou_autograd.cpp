// Autograd of torchops.box_iou.  The backward is the registered operator
// torchops::_box_iou_backward (CPU and CUDA kernels, a fake), so compiled
// training steps trace straight through it.
#include <torch/autograd.h>
#include <torch/library.h>

#include "ops.h"

namespace torchops::autograd {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

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

TORCH_LIBRARY_IMPL(torchops, Autograd, m) {
  m.impl("box_iou", &box_iou_autograd);
}

}  // namespace torchops::autograd
