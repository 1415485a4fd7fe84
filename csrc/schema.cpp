// The whole public API of torchops: every operator schema, in one place.
//
// Rules every schema here follows (see docs/design.md):
//  * sizes are SymInt, so torch.compile(dynamic=True) traces one graph;
//  * nothing returns an input or a view of one, and anything mutated is
//    annotated Tensor(a!);
//  * every op is pt2_compliant: it has a fake kernel in torchops.ops and
//    passes torch.library.opcheck.
// Backward passes that need a kernel of their own are operators too (leading
// underscore), so compiled training steps trace straight through them.
#include <torch/library.h>

TORCH_LIBRARY(torchops, m) {
  // Fake (meta) kernels live in this Python module; PyTorch's error messages
  // point users at it when it has not been imported.
  m.set_python_module("torchops.ops");
  const std::vector<at::Tag> pt2 = {at::Tag::pt2_compliant_tag};

  // --- linear algebra --------------------------------------------------------
  m.def("matmul(Tensor a, Tensor b) -> Tensor", pt2);

  // --- elementwise -------------------------------------------------------------
  m.def("d_sigmoid(Tensor z) -> Tensor", pt2);
  m.def("_d_sigmoid_backward(Tensor grad, Tensor z) -> Tensor", pt2);

  // --- detection: boxes -----------------------------------------------------------
  // nms / batched_nms return int64 indices into `boxes`, by decreasing score;
  // their length depends on the data (fake: an unbacked size in [0, N]).
  m.def("nms(Tensor boxes, Tensor scores, float iou_threshold) -> Tensor", pt2);
  m.def(
      "batched_nms(Tensor boxes, Tensor scores, Tensor idxs, "
      "float iou_threshold) -> Tensor",
      pt2);
  // nms_padded: nms (batched_nms with idxs) with static output shapes, for
  // CUDA graphs: (keep (N,) int64, -1 past the kept rows; number kept, 0-dim).
  m.def(
      "nms_padded(Tensor boxes, Tensor scores, float iou_threshold, "
      "Tensor? idxs=None) -> (Tensor, Tensor)",
      pt2);
  m.def("box_iou(Tensor boxes1, Tensor boxes2) -> Tensor", pt2);
  m.def(
      "_box_iou_backward(Tensor grad, Tensor boxes1, Tensor boxes2) -> "
      "(Tensor, Tensor)",
      pt2);

  // --- detection: RoI pooling ---------------------------------------------------------
  // Argument names and meanings follow torch.ops.torchvision so code can
  // switch by changing the namespace.  rois: (K, 5) rows (batch_index, x1,
  // y1, x2, y2) of the input's dtype.
  m.def("roi_align(Tensor input, Tensor rois, float spatial_scale, "
        "SymInt pooled_height, SymInt pooled_width, int sampling_ratio, "
        "bool aligned) -> Tensor", pt2);
  m.def("_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, "
        "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, "
        "SymInt channels, SymInt height, SymInt width, int sampling_ratio, "
        "bool aligned) -> Tensor", pt2);
  // Returns (output, argmax); argmax is int64 (torchvision's is int32).
  m.def("roi_pool(Tensor input, Tensor rois, float spatial_scale, "
        "SymInt pooled_height, SymInt pooled_width) -> (Tensor, Tensor)", pt2);
  m.def("_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, "
        "float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
        "SymInt batch_size, SymInt channels, SymInt height, SymInt width) "
        "-> Tensor", pt2);
  // Deformable RoI pooling (mmcv's deform_roi_pool): roi_align with
  // aligned=True whose bins move by gamma * roi size * offset[k, :, ph, pw]
  // (channel 0 along x, 1 along y); no offset: roi_align(aligned=True).
  m.def("deform_roi_pool(Tensor input, Tensor rois, Tensor? offset, "
        "float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
        "int sampling_ratio, float gamma) -> Tensor", pt2);
  // The forward when the offset needs a gradient: (output, slopes), slopes
  // (2, K, C, PH, PW) in the compute type (float32 for the half types):
  // d output / d (offset[:, 0] and offset[:, 1]) per output element, divided
  // by the offset's gain (gamma * roi width, height).
  m.def("_deform_roi_pool_forward(Tensor input, Tensor rois, Tensor offset, "
        "float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
        "int sampling_ratio, float gamma) -> (Tensor, Tensor)", pt2);
  // Returns (grad_input, grad_offset); grad_offset is (K, 2, PH, PW), summed
  // from `slopes`, zeros without them.
  m.def("_deform_roi_pool_backward(Tensor grad, Tensor input, Tensor rois, "
        "Tensor? offset, Tensor? slopes, float spatial_scale, "
        "SymInt pooled_height, SymInt pooled_width, int sampling_ratio, "
        "float gamma) -> (Tensor, Tensor)", pt2);

  // --- detection: deformable convolution ------------------------------------------------
  // Argument for argument torch.ops.torchvision.deform_conv2d.  With use_mask
  // false, `mask` is not read (DCNv1); its gradient is zeros of its shape.
  m.def("deform_conv2d(Tensor input, Tensor weight, Tensor offset, "
        "Tensor mask, Tensor bias, SymInt stride_h, SymInt stride_w, "
        "SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, "
        "SymInt groups, SymInt offset_groups, bool use_mask) -> Tensor", pt2);
  // Returns (grad_input, grad_weight, grad_offset, grad_mask, grad_bias).
  m.def("_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, "
        "Tensor offset, Tensor mask, Tensor bias, SymInt stride_h, "
        "SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, "
        "SymInt dilation_w, SymInt groups, SymInt offset_groups, "
        "bool use_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)", pt2);

  // --- losses -----------------------------------------------------------------------------
  m.def(
      "sigmoid_focal_loss(Tensor inputs, Tensor targets, float alpha=0.25, "
      "float gamma=2., str reduction=\"none\") -> Tensor", pt2);
  m.def(
      "_sigmoid_focal_loss_backward(Tensor grad, Tensor inputs, Tensor targets, "
      "float alpha, float gamma, str reduction) -> Tensor", pt2);

  // Cross-entropy of a linear layer's logits, input (..., H) @ weight (V,
  // H)^T + bias, against int64 targets, without materialising the logits
  // (F.cross_entropy(logits.float(), ...) semantics; softcap caps the logits
  // first, lse_square_scale adds the z-loss).  The loss is float32 (float64
  // for float64 inputs).  The _forward op also returns each token's
  // logsumexp (N) and, for a scalar loss, the gradients its output_mask asks
  // for (for an upstream gradient of 1; (0,) placeholders otherwise).  The
  // _backward op recomputes the logits chunk by chunk, given the lse; with
  // _stats ((N, 3) rows of lse, target logit and logit sum over the classes
  // [vocab_start, vocab_start + V) of vocab_size that weight holds) it is how
  // a vocabulary-parallel head computes the loss.
  m.def("fused_linear_cross_entropy(Tensor input, Tensor weight, Tensor target, "
        "Tensor? bias=None, int ignore_index=-100, float label_smoothing=0.0, "
        "str reduction=\"mean\", float lse_square_scale=0.0, float? softcap=None) -> Tensor",
        pt2);
  m.def("_fused_linear_cross_entropy_forward(Tensor input, Tensor weight, Tensor target, "
        "Tensor? bias, int ignore_index, float label_smoothing, str reduction, "
        "float lse_square_scale, float? softcap, bool[3] output_mask) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)", pt2);
  m.def("_fused_linear_cross_entropy_backward(Tensor grad, Tensor input, Tensor weight, "
        "Tensor target, Tensor? bias, Tensor lse, int ignore_index, float label_smoothing, "
        "str reduction, float lse_square_scale, float? softcap, int vocab_start, "
        "int vocab_size, bool[3] output_mask) -> (Tensor, Tensor, Tensor)", pt2);
  // grads *= scale (a 0-dim float32, float64 for float64 grads) in place,
  // nothing at all where scale is 1, decided on the device: the backward of
  // the loss scales the forward's gradients without a host sync.
  m.def("_fused_linear_cross_entropy_scale_(Tensor(a!)[] grads, Tensor scale) -> ()", pt2);
  m.def("_fused_linear_cross_entropy_stats(Tensor input, Tensor weight, Tensor target, "
        "Tensor? bias, int ignore_index, float? softcap, int vocab_start, int vocab_size) "
        "-> Tensor", pt2);

  // --- convolution: masked -------------------------------------------------------------
  // conv2d at the positions where mask > 0, zeros elsewhere; mask is
  // (N or 1, H_out, W_out), bool or floating.  The backward returns
  // (grad_input, grad_weight, grad_bias), each a (0,)-shaped placeholder
  // where output_mask says it is not wanted.
  m.def("masked_conv2d(Tensor input, Tensor mask, Tensor weight, Tensor? bias=None, "
        "int[2] padding=0, int[2] stride=1, int[2] dilation=1, int groups=1) -> Tensor", pt2);
  m.def("_masked_conv2d_backward(Tensor grad, Tensor input, Tensor mask, Tensor weight, "
        "int[2] padding, int[2] stride, int[2] dilation, int groups, bool[3] output_mask) "
        "-> (Tensor, Tensor, Tensor)", pt2);

  // --- upsampling --------------------------------------------------------------------------
  // CARAFE (mmcv's carafe): features (N, C, H, W), masks (N, group_size *
  // kernel_size^2, H * scale_factor, W * scale_factor) -> (N, C, H * s, W * s).
  m.def("carafe(Tensor features, Tensor masks, int kernel_size, int group_size, "
        "int scale_factor) -> Tensor", pt2);
  // Returns (grad_features, grad_masks).
  m.def("_carafe_backward(Tensor grad, Tensor features, Tensor masks, "
        "int kernel_size, int group_size, int scale_factor) -> (Tensor, Tensor)", pt2);

  // --- norms -------------------------------------------------------------------------------
  // Normalise over the trailing dims `normalized_shape` (drop-ins for
  // torch.nn.functional.rms_norm / layer_norm).  weight/bias: the input's
  // dtype, or float32 beside a half input.  The _forward ops also return the
  // row statistics the backward reads (float32, float64 for float64 inputs,
  // shaped as the input's leading dims); the backward ops return a
  // (0,)-shaped placeholder for a gradient output_mask does not ask for.
  m.def("rms_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, "
        "float? eps=None) -> Tensor", pt2);
  m.def("_rms_norm_forward(Tensor input, SymInt[] normalized_shape, Tensor? weight, "
        "float? eps) -> (Tensor, Tensor)", pt2);
  m.def("_rms_norm_backward(Tensor grad, Tensor input, Tensor rstd, "
        "SymInt[] normalized_shape, Tensor? weight, bool[2] output_mask) -> (Tensor, Tensor)",
        pt2);
  // Returns (rms_norm(input + residual), input + residual).
  m.def("fused_add_rms_norm(Tensor input, Tensor residual, SymInt[] normalized_shape, "
        "Tensor? weight=None, float? eps=None) -> (Tensor, Tensor)", pt2);
  m.def("_fused_add_rms_norm_forward(Tensor input, Tensor residual, "
        "SymInt[] normalized_shape, Tensor? weight, float? eps) -> (Tensor, Tensor, Tensor)",
        pt2);
  // vLLM's in-place inference variant over the last dim: the norm into
  // input, the sum into residual.
  m.def("fused_add_rms_norm_(Tensor(a!) input, Tensor(b!) residual, Tensor weight, "
        "float eps) -> ()", pt2);
  m.def("layer_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, "
        "Tensor? bias=None, float eps=1e-05) -> Tensor", pt2);
  m.def("_layer_norm_forward(Tensor input, SymInt[] normalized_shape, Tensor? weight, "
        "Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)", pt2);
  m.def("_layer_norm_backward(Tensor grad, Tensor input, Tensor mean, Tensor rstd, "
        "SymInt[] normalized_shape, Tensor? weight, Tensor? bias, bool[3] output_mask) "
        "-> (Tensor, Tensor, Tensor)", pt2);
  // --- softmax ------------------------------------------------------------------------------
  // Fused masked softmaxes of attention scores over the last dim, in float32
  // for half types: input (B, H, Sq, Sk) with a bool mask (B or 1, 1, Sq, Sk),
  // True = masked; the causal one takes (B, Sq, Sk) or (B, H, Sq, Sk), Sq == Sk.
  // The backward ops take the forward's output.
  m.def("scaled_masked_softmax(Tensor input, Tensor mask, float scale) -> Tensor", pt2);
  m.def("_scaled_masked_softmax_backward(Tensor grad, Tensor output, float scale) -> Tensor",
        pt2);
  m.def("scaled_upper_triang_masked_softmax(Tensor input, float scale) -> Tensor", pt2);
  m.def("_scaled_upper_triang_masked_softmax_backward(Tensor grad, Tensor output, "
        "float scale) -> Tensor", pt2);
  // --- activations ---------------------------------------------------------------------------
  // Gated activations (vLLM's layout): x = [a, b] along its even last
  // dimension, out = act(a) * b of shape (..., size / 2).  The backward
  // returns the gradient of x, both halves.
  m.def("silu_and_mul(Tensor x) -> Tensor", pt2);
  m.def("_silu_and_mul_backward(Tensor grad, Tensor x) -> Tensor", pt2);
  m.def("gelu_and_mul(Tensor x, str approximate=\"none\") -> Tensor", pt2);
  m.def("_gelu_and_mul_backward(Tensor grad, Tensor x, str approximate) -> Tensor", pt2);
  // --- rotary -------------------------------------------------------------------------------
  // Hugging Face's apply_rotary_pos_emb: q, k (B, H, S, D) with
  // unsqueeze_dim 1 or (B, S, H, D) with 2; cos, sin (B or 1, S, rotary_dim)
  // or (S, rotary_dim).  Returns new contiguous (q_out, k_out).
  m.def("rotary_embedding(Tensor q, Tensor k, Tensor cos, Tensor sin, "
        "int unsqueeze_dim=1, bool interleaved=False) -> (Tensor, Tensor)", pt2);
  // Returns (grad_q, grad_k, grad_cos, grad_sin); the last two are (0,)
  // placeholders without cos_sin_grad (q and k are then not read).
  m.def("_rotary_embedding_backward(Tensor grad_q, Tensor grad_k, Tensor q, "
        "Tensor k, Tensor cos, Tensor sin, int unsqueeze_dim, bool interleaved, "
        "bool cos_sin_grad) -> (Tensor, Tensor, Tensor, Tensor)", pt2);
  // vLLM's rotary_embedding, in place: positions (T) or (B, S) int64 rows of
  // cos_sin_cache (max_position, rotary_dim) = [cos | sin]; q, k of shape
  // (*positions.shape, heads, head_size).
  m.def("rotary_embedding_(Tensor positions, Tensor(a!) q, Tensor(b!) k, "
        "Tensor cos_sin_cache, bool interleaved=False) -> ()", pt2);
  // --- optim --------------------------------------------------------------------------------
  // One Adam/AdamW step over lists of parameters, in place (torch.optim's
  // _fused_adamw_ conventions: state_steps are float32 tensors the caller has
  // already incremented; grads are written only with grad_scale, which they
  // are divided by; found_inf == 1 skips the step).  master_params: float32
  // copies of float16/bfloat16 params, updated and rounded into them.
  m.def("fused_adam_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] exp_avgs, "
        "Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, Tensor[] state_steps, *, "
        "float lr, float beta1, float beta2, float eps, float weight_decay, bool amsgrad, "
        "bool maximize, bool adamw, Tensor(f!)[]? master_params=None, Tensor? grad_scale=None, "
        "Tensor? found_inf=None) -> ()", pt2);
  // lr as a float32 tensor of one element, read by the kernel (no recompiles
  // or CUDA-graph recaptures when it changes).
  m.def("fused_adam_.tensor_lr(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] exp_avgs, "
        "Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, Tensor[] state_steps, *, "
        "Tensor lr, float beta1, float beta2, float eps, float weight_decay, bool amsgrad, "
        "bool maximize, bool adamw, Tensor(f!)[]? master_params=None, Tensor? grad_scale=None, "
        "Tensor? found_inf=None) -> ()", pt2);
  // --- detection: multi-scale deformable attention -------------------------------------
  // Deformable DETR's sampling (mmcv's ms_deform_attn): value (B, S, heads,
  // C), spatial_shapes (L, 2) int64 rows (H_l, W_l), level_start_index (L,)
  // int64, sampling_locations (B, Q, heads, L, P, 2) as (x, y) in [0, 1],
  // attention_weights (B, Q, heads, L, P) -> (B, Q, heads * C).
  m.def("ms_deform_attn(Tensor value, Tensor spatial_shapes, Tensor level_start_index, "
        "Tensor sampling_locations, Tensor attention_weights) -> Tensor", pt2);
  // Returns the gradients of value, sampling_locations and attention_weights.
  m.def("_ms_deform_attn_backward(Tensor grad, Tensor value, Tensor spatial_shapes, "
        "Tensor level_start_index, Tensor sampling_locations, Tensor attention_weights) "
        "-> (Tensor, Tensor, Tensor)", pt2);
  // --- optim: fused_sgd_ --------------------------------------------------------------------
  // One SGD step over lists of parameters, in place, with torch._fused_sgd_'s
  // arguments (momentum_buffer_list empty without momentum; is_first_step:
  // the buffers are set to the gradient, not read) and fused_adam_'s
  // grad_scale, found_inf and master_params rules.
  m.def("fused_sgd_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] momentum_buffer_list, "
        "*, float weight_decay, float momentum, float lr, float dampening, bool nesterov, "
        "bool maximize, bool is_first_step, Tensor(d!)[]? master_params=None, "
        "Tensor? grad_scale=None, Tensor? found_inf=None) -> ()", pt2);
  m.def("fused_sgd_.tensor_lr(Tensor(a!)[] params, Tensor(b!)[] grads, "
        "Tensor(c!)[] momentum_buffer_list, *, float weight_decay, float momentum, Tensor lr, "
        "float dampening, bool nesterov, bool maximize, bool is_first_step, "
        "Tensor(d!)[]? master_params=None, Tensor? grad_scale=None, Tensor? found_inf=None) -> ()",
        pt2);
  // --- detection: rotated boxes and soft-NMS ------------------------------------------------
  // Rotated boxes are (x_ctr, y_ctr, width, height, angle in degrees,
  // counter-clockwise).  The NMS variants return int64 indices by decreasing
  // score (data-dependent length, as nms); soft_nms returns the kept indices
  // in selection order and their decayed scores.
  m.def("box_iou_rotated(Tensor boxes1, Tensor boxes2) -> Tensor", pt2);
  m.def("nms_rotated(Tensor boxes, Tensor scores, float iou_threshold) -> Tensor", pt2);
  m.def("batched_nms_rotated(Tensor boxes, Tensor scores, Tensor idxs, "
        "float iou_threshold) -> Tensor", pt2);
  m.def("soft_nms(Tensor boxes, Tensor scores, float iou_threshold=0.3, float sigma=0.5, "
        "float min_score=0.001, str method=\"gaussian\") -> (Tensor, Tensor)", pt2);
  // --- optim: multi_tensor_l2norm, multi_tensor_scale_ --------------------------------------
  // The 2-norm of a list of tensors of one dtype on one device, as if they
  // were one vector: (total, per-tensor norms, (n,) with per_tensor, else
  // (0,)), float32 (float64 for float64 tensors).  No autograd.
  m.def("multi_tensor_l2norm(Tensor[] tensors, bool per_tensor=False) -> (Tensor, Tensor)", pt2);
  // Every tensor of the list times scale, in place (a float, or a float32 or
  // float64 one-element tensor read by the kernel: no host synchronisation).
  m.def("multi_tensor_scale_(Tensor(a!)[] tensors, float scale) -> ()", pt2);
  m.def("multi_tensor_scale_.tensor(Tensor(a!)[] tensors, Tensor scale) -> ()", pt2);
}
