// What box_iou's CPU and CUDA kernels share: argument checks and the
// per-pair gradient.
//
// iou(a, b) = inter / union, inter = w * h,
//   w = max(min(a.x2, b.x2) - max(a.x1, b.x1), 0)   (h alike in y),
//   union = area(a) + area(b) - inter.
// The gradient is the one autograd computes for the plain-PyTorch formula
// (torchvision's box_iou), including at its kinks: the clamp passes the
// gradient where w >= 0 (clamp_min's rule), and max/min split it in half
// between equal coordinates (maximum/minimum's rule).
#pragma once

#include "common/boxes.h"

namespace torchops {

// d iou / d (x1, y1, x2, y2) of both boxes, times the incoming gradient g.
// Scalar members, no arrays: the CPU loops keep them in SIMD registers.
template <typename T>
struct BoxPairGrad {
  Box<T> a;
  Box<T> b;
};

// Share of the first argument in the gradient of max(x, y) / min(x, y): 1, or
// 1/2 on a tie.  Arithmetic rather than branches, so loops over it vectorise.
template <typename T>
C10_HOST_DEVICE inline T max_share(T x, T y) {
  return T(0.5) * (static_cast<T>(x > y) + static_cast<T>(x >= y));
}
template <typename T>
C10_HOST_DEVICE inline T min_share(T x, T y) {
  return T(0.5) * (static_cast<T>(x < y) + static_cast<T>(x <= y));
}

// Always inlined: the CPU loops vectorise only with its body inside them.
template <typename T>
C10_HOST_DEVICE C10_ALWAYS_INLINE BoxPairGrad<T> box_iou_pair_grad(
    T g, const Box<T>& a, const Box<T>& b, T area_a, T area_b) {
  const T dx = min_of(a.x2, b.x2) - max_of(a.x1, b.x1);
  const T dy = min_of(a.y2, b.y2) - max_of(a.y1, b.y1);
  const T w = max_of(dx, T(0));
  const T h = max_of(dy, T(0));
  const T inter = w * h;
  const T uni = area_a + area_b - inter;
  // iou = inter / union: autograd's rules for division.
  const T g_union = -g * ((inter / uni) / uni);
  const T g_inter = g / uni - g_union;  // inter also enters union with -1
  // Products computed unconditionally, then selected: a conditional FP
  // operation may trap, which keeps compilers from vectorising the loop.
  const T g_w = g_inter * h;
  const T g_h = g_inter * w;
  const T g_dx = dx >= T(0) ? g_w : T(0);
  const T g_dy = dy >= T(0) ? g_h : T(0);
  const T s_x1 = max_share(a.x1, b.x1);
  const T s_y1 = max_share(a.y1, b.y1);
  const T s_x2 = min_share(a.x2, b.x2);
  const T s_y2 = min_share(a.y2, b.y2);
  // area = (x2 - x1) * (y2 - y1) for each box, both scaled by g_union.
  const T aw = a.x2 - a.x1, ah = a.y2 - a.y1;
  const T bw = b.x2 - b.x1, bh = b.y2 - b.y1;
  BoxPairGrad<T> out;
  out.a.x1 = -g_dx * s_x1 - g_union * ah;
  out.a.y1 = -g_dy * s_y1 - g_union * aw;
  out.a.x2 = g_dx * s_x2 + g_union * ah;
  out.a.y2 = g_dy * s_y2 + g_union * aw;
  out.b.x1 = -g_dx * (T(1) - s_x1) - g_union * bh;
  out.b.y1 = -g_dy * (T(1) - s_y1) - g_union * bw;
  out.b.x2 = g_dx * (T(1) - s_x2) + g_union * bh;
  out.b.y2 = g_dy * (T(1) - s_y2) + g_union * bw;
  return out;
}

inline void check_box_iou(const at::Tensor& boxes1, const at::Tensor& boxes2,
                          c10::DeviceType device) {
  const char* op = "box_iou";
  check_devices(op, device, {{boxes1, "boxes1"}, {boxes2, "boxes2"}});
  check_boxes(op, {boxes1, "boxes1"});
  check_boxes(op, {boxes2, "boxes2"});
  check_same_dtype(op, {boxes1, "boxes1"}, {boxes2, "boxes2"});
}

inline void check_box_iou_backward(
    const at::Tensor& grad, const at::Tensor& boxes1, const at::Tensor& boxes2,
    c10::DeviceType device) {
  const char* op = "_box_iou_backward";
  check_devices(
      op, device, {{grad, "grad"}, {boxes1, "boxes1"}, {boxes2, "boxes2"}});
  check_boxes(op, {boxes1, "boxes1"});
  check_boxes(op, {boxes2, "boxes2"});
  check_same_dtype(op, {boxes1, "boxes1"}, {boxes2, "boxes2"});
  check_same_dtype(op, {boxes1, "boxes1"}, {grad, "grad"});
  TORCH_CHECK(
      grad.dim() == 2 && grad.size(0) == boxes1.size(0) &&
          grad.size(1) == boxes2.size(0),
      "torchops._box_iou_backward: expected 'grad' to have shape (",
      boxes1.size(0), ", ", boxes2.size(0), "), but got ", grad.sizes());
}

}  // namespace torchops
