"""The op database: one entry per public torchops operator.

Every generic test (test_ops.py, test_export.py, test_properties.py,
test_gates.py) is generated from these entries, in the spirit of PyTorch's
OpInfo: adding an op means adding an entry, not writing a new test file.  An
entry says how to call the op, how to make sample inputs for a device and
dtype, what its pure-PyTorch reference is (torchops.references), which
tolerances apply, and which invalid inputs must raise what.

Layout: ``core.py`` holds the records (OpInfo, Sample, ErrorInput, Tol, Skip)
and the tensor helpers (make, make_transposed, convert, hyp_tensor,
hyp_size); one module per family holds its entries: ``basic.py`` (matmul,
d_sigmoid), ``boxes.py`` (nms, batched_nms, box_iou), ``roi.py`` (roi_align,
roi_pool, deform_roi_pool), ``losses.py`` (sigmoid_focal_loss,
fused_linear_cross_entropy),
``deform.py`` (deform_conv2d), ``masked_conv.py`` (masked_conv2d),
``upsample.py`` (carafe), ``norms.py`` (rms_norm, fused_add_rms_norm(_),
layer_norm), ``rotary.py`` (rotary_embedding(_)), ``activations.py``
(silu_and_mul, gelu_and_mul), ``softmax.py`` (the two masked softmaxes).  Sample makers that the op-specific tests share
are public names of their family module, re-exported here (make_boxes,
make_scores, random_rois, random_mask, carafe_inputs).

Adding an op
------------
Write an ``OpInfo`` in its family's module (a new family: a new module,
imported below) and add it to that module's list (BASIC_OPS, BOX_OPS,
ROI_OPS, LOSS_OPS, DEFORM_OPS, MASKED_CONV_OPS, UPSAMPLE_OPS, NORM_OPS,
ROTARY_OPS, ACTIVATION_OPS, SOFTMAX_OPS).  Required
fields:

``name``            public name (``torchops.<name>``).  The entry takes
                    from it, never as arguments: ``op``, the overload
                    ``torch.ops.torchops.<name>.default``; ``wrapper``, the
                    typed Python wrapper ``torchops.<name>``; and
                    ``reference``, ``torchops.references.<name>`` (pure
                    PyTorch, the op's arguments), called with every floating
                    tensor of a sample converted to float64 (integer tensors
                    and scalars as they are), which returns what the op
                    returns (a tensor or a tuple).  Integer outputs are
                    compared exactly, dtype included.
``sample_inputs``   ``(device, dtype, requires_grad=False) -> iterable of
                    Sample``.  Tensors go in ``Sample.args`` (positionally);
                    scalars (float/int/bool/str) may go in args or kwargs.
                    Cover: an empty dim, a size-1 dim, odd sizes, transposed or
                    sliced (non-contiguous) and expanded (stride 0) inputs, and,
                    when ``requires_grad`` is true, set it on the floating
                    inputs that are differentiable (never on integer ones).
                    ``dtype`` is the floating dtype under test; integer inputs
                    (indices, ...) keep their own dtype.  Also list >= 3
                    samples that differ only in their sizes (those >= 2): the
                    compile and export tests take them (or give
                    ``sample_inputs_compile``); dims of size 1 are fine when
                    they are 1 in all three.  test_gates checks the variety.
``error_inputs``    ``(device) -> iterable of ErrorInput``: invalid calls, the
                    exception type and a regex that names the op and the
                    argument ("torchops\\.<name>.*'boxes'").  Each must also
                    raise under FakeTensorMode (the fake's checks), unless it
                    sets ``kernel_only`` to the reason only the kernel can see
                    it (a value inside a tensor, a real allocation).  Include
                    the internal backward ops' invalid calls, with
                    ``op=torch.ops.torchops._<name>_backward.default``, and
                    the wrapper's own errors with ``via_wrapper=True``.

Optional fields (defaults in brackets): ``dtypes`` [all four float dtypes on
cpu and cuda], ``tols`` [DEFAULT_TOLS] per dtype, ``differentiable`` [True:
the op has an Autograd kernel; False for in-place ops], ``mutated_args`` [():
indices of the positional args an in-place op writes, marked ``Tensor(a!)``
in its schema; the generic tests call it on same-strided copies of them and
compare their new values with the reference's, which returns them as a
tuple (their strides are the caller's: contiguous_outputs does not apply);
opcheck still runs (it checks the alias annotations), the gradient tests
do not], ``supports_gradgrad`` [False: its internal
tuple; opcheck still runs (it checks the alias annotations), the gradient
tests do not], ``supports_gradgrad`` [False: its internal
backward ops have Autograd kernels too], ``data_dependent_output`` [False: the
output size depends on the values, like nms], ``internal_ops`` [()]
(``_<op>_backward`` ops this entry exercises), ``autocast`` [False: the op
has AutocastCPU/AutocastCUDA kernels], ``no_benchmark`` [{}: op name -> why
torchops/bench/cases.py has no case timing it], ``contiguous_outputs``
[True], ``sample_inputs_large`` [None: extra, bigger samples for the
``--full`` profile], ``sample_inputs_compile`` [None: derived],
``hypothesis_sample`` [None: derived from ``sample_inputs``; ``(draw, device,
dtype) -> Sample`` for a real property test, see hyp_tensor],
``gradcheck_kwargs`` [{}: e.g. nondet_tol for atomics], ``sharding_samples``
[None: ``(device) -> iterable of ShardingSample``, DTensor calls over two
ranks that the op's rules in torchops/sharding.py must run on local shards;
test_sharding.py runs them, forward and backward], ``wrapper_sample`` and
``wrapper_outputs`` [None: the wrapper takes the op's arguments and returns
its outputs], ``output_dtype`` [None: floating outputs in the floating inputs'
dtype; else ``dtype -> dtype``, as fused_linear_cross_entropy's float32 loss
of half inputs], ``skips`` [[]: ``Skip(test, reason, device=None, dtype=None,
xfail=False)`` records, a test of GENERIC_TESTS on one device and dtype (None:
all) skipped or, with xfail, expected to fail] and ``opcheck_skips`` [{}:
opcheck test_util name -> written reason].  test_gates rejects empty reasons
and unknown names, and checks the op's kernels against these fields.
"""

from __future__ import annotations

from .basic import BASIC_OPS, D_SIGMOID, MATMUL
from .boxes import BATCHED_NMS, BOX_IOU, BOX_OPS, NMS, make_boxes, make_scores
from .core import (DEFAULT_TOLS, DEVICE_TYPES, ENTRY_DTYPES, FLOAT_DTYPES, GENERIC_TESTS,
                   HALF_DTYPES, OPCHECK_UTILS, ErrorInput, OpInfo, Sample, ShardingSample,
                   Skip, Tol, convert,
                   devices, full_profile, hyp_size, hyp_tensor, make, make_transposed)
from .deform import DEFORM_CONV2D, DEFORM_OPS
from .losses import LOSS_OPS, SIGMOID_FOCAL_LOSS
from .roi import DEFORM_ROI_POOL, ROI_ALIGN, ROI_OPS, ROI_POOL, random_rois
from .masked_conv import MASKED_CONV2D, MASKED_CONV_OPS, random_mask
from .upsample import CARAFE, UPSAMPLE_OPS, carafe_inputs

OP_DB: list[OpInfo] = [*BASIC_OPS, *BOX_OPS, *ROI_OPS, *LOSS_OPS, *DEFORM_OPS, *MASKED_CONV_OPS,
                       *UPSAMPLE_OPS]

# --- norms ---
from .norms import FUSED_ADD_RMS_NORM, FUSED_ADD_RMS_NORM_, LAYER_NORM, NORM_OPS, RMS_NORM  # noqa: E402

OP_DB += NORM_OPS

__all__ = [
    "OP_DB", "BASIC_OPS", "BOX_OPS", "ROI_OPS", "LOSS_OPS", "DEFORM_OPS",
    "MATMUL", "D_SIGMOID", "NMS", "BATCHED_NMS", "BOX_IOU", "ROI_ALIGN", "ROI_POOL",
    "SIGMOID_FOCAL_LOSS", "DEFORM_CONV2D",
    "DEFORM_ROI_POOL",
    "OpInfo", "Sample", "ShardingSample", "ErrorInput", "Tol", "Skip", "DEFAULT_TOLS", "FLOAT_DTYPES",
    "HALF_DTYPES", "DEVICE_TYPES", "GENERIC_TESTS", "ENTRY_DTYPES", "OPCHECK_UTILS",
    "make", "make_transposed", "convert", "hyp_tensor", "hyp_size", "full_profile", "devices",
    "make_boxes", "make_scores", "random_rois",
]
__all__ += ["MASKED_CONV_OPS", "MASKED_CONV2D", "random_mask"]
__all__ += ["UPSAMPLE_OPS", "CARAFE", "carafe_inputs"]
__all__ += ["NORM_OPS", "RMS_NORM", "FUSED_ADD_RMS_NORM", "FUSED_ADD_RMS_NORM_", "LAYER_NORM"]

# softmax
from .softmax import (SCALED_MASKED_SOFTMAX, SCALED_UPPER_TRIANG_MASKED_SOFTMAX,  # noqa: E402
                      SOFTMAX_OPS, attention_mask)

OP_DB += SOFTMAX_OPS
__all__ += ["SOFTMAX_OPS", "SCALED_MASKED_SOFTMAX", "SCALED_UPPER_TRIANG_MASKED_SOFTMAX",
            "attention_mask"]

# activations
from .activations import ACTIVATION_OPS, GELU_AND_MUL, SILU_AND_MUL  # noqa: E402

OP_DB += ACTIVATION_OPS
__all__ += ["ACTIVATION_OPS", "SILU_AND_MUL", "GELU_AND_MUL"]

# --- rotary ---
from .rotary import ROTARY_EMBEDDING, ROTARY_EMBEDDING_, ROTARY_OPS, rotary_cache_inputs, rotary_inputs  # noqa: E402

OP_DB += ROTARY_OPS
__all__ += ["ROTARY_OPS", "ROTARY_EMBEDDING", "ROTARY_EMBEDDING_", "rotary_inputs",
            "rotary_cache_inputs"]

# --- losses: fused linear cross-entropy ---
from .losses import FUSED_LINEAR_CROSS_ENTROPY, lce_inputs, lce_targets  # noqa: E402

__all__ += ["FUSED_LINEAR_CROSS_ENTROPY", "lce_inputs", "lce_targets"]

# --- optim ---
from .optim import FUSED_ADAM_, OPTIM_OPS  # noqa: E402

OP_DB += OPTIM_OPS
__all__ += ["OPTIM_OPS", "FUSED_ADAM_"]

# --- detection: multi-scale deformable attention ---
from .deform_attn import DEFORM_ATTN_OPS, MS_DEFORM_ATTN, msda_inputs  # noqa: E402

OP_DB += DEFORM_ATTN_OPS
__all__ += ["DEFORM_ATTN_OPS", "MS_DEFORM_ATTN", "msda_inputs"]


# --- optim: fused_sgd_ ---
from .optim import FUSED_SGD_  # noqa: E402

__all__ += ["FUSED_SGD_"]


# --- rotated boxes and soft-NMS ---
from .rotated import (BATCHED_NMS_ROTATED, BOX_IOU_ROTATED, NMS_ROTATED, ROTATED_OPS,  # noqa: E402
                      SOFT_NMS, make_rotated_boxes)

OP_DB += ROTATED_OPS
__all__ += ["ROTATED_OPS", "BOX_IOU_ROTATED", "NMS_ROTATED", "BATCHED_NMS_ROTATED", "SOFT_NMS",
            "make_rotated_boxes"]


# --- optim: multi_tensor_l2norm, multi_tensor_scale_ ---
from .optim import MULTI_TENSOR_L2NORM, MULTI_TENSOR_SCALE_  # noqa: E402

__all__ += ["MULTI_TENSOR_L2NORM", "MULTI_TENSOR_SCALE_"]
