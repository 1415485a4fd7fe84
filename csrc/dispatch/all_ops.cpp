// Every op's dispatcher glue (csrc/dispatch/<op>_dispatch.cpp), compiled as
// one translation unit.
//
// Why: each glue file needs torch/autograd.h, torch/library.h and
// ATen/autocast_mode.h, about 300k lines after preprocessing.  Compiled one
// by one, each glue file spends most of its time in those same headers, and
// the glue files alone would take most of a 2-core build; together they parse
// the headers once.  The glue files stay one per op and
// are written as if compiled alone (nothing checks that any more: a file
// leaning on an include of an earlier one still builds here).
// torchops/_build.py compiles this file instead of them and refuses to build
// when a glue file is missing below (its registrations would silently
// vanish), listed twice, or a line names a file that does not exist.
#include "dispatch/batched_nms_dispatch.cpp"
#include "dispatch/box_iou_dispatch.cpp"
#include "dispatch/carafe_dispatch.cpp"
#include "dispatch/d_sigmoid_dispatch.cpp"
#include "dispatch/deform_conv2d_dispatch.cpp"
#include "dispatch/deform_roi_pool_dispatch.cpp"
#include "dispatch/masked_conv2d_dispatch.cpp"
#include "dispatch/matmul_dispatch.cpp"
#include "dispatch/nms_dispatch.cpp"
#include "dispatch/nms_padded_dispatch.cpp"
#include "dispatch/roi_align_dispatch.cpp"
#include "dispatch/roi_pool_dispatch.cpp"
#include "dispatch/sigmoid_focal_loss_dispatch.cpp"
#include "dispatch/norms_dispatch.cpp"
// softmax
#include "dispatch/masked_softmax_dispatch.cpp"
// activations
#include "dispatch/act_and_mul_dispatch.cpp"
#include "dispatch/rotary_embedding_dispatch.cpp"
// losses: fused linear cross-entropy
#include "dispatch/fused_linear_cross_entropy_dispatch.cpp"
// detection: multi-scale deformable attention
#include "dispatch/ms_deform_attn_dispatch.cpp"
// detection: rotated boxes and soft-NMS
#include "dispatch/rotated_nms_dispatch.cpp"
