"""Entries of the norms: rms_norm, fused_add_rms_norm, fused_add_rms_norm_
(in place) and layer_norm."""

from __future__ import annotations

import torch

from .core import ErrorInput, OpInfo, Sample, ShardingSample, Tol, make, make_transposed

_HALF = (torch.float16, torch.bfloat16)


def _param(shape, device, dtype, requires_grad, mixed=False):
    """A weight or bias; float32 beside a half input when `mixed`."""
    pdtype = torch.float32 if mixed and dtype in _HALF else dtype
    return make(shape, device, pdtype, requires_grad, low=0.5, high=1.5)


def _misaligned(shape, device, dtype, requires_grad):
    """Contiguous, but one element into its storage: the kernels' unaligned path."""
    n = 1
    for d in shape:
        n *= d
    t = make((n + 1,), device, dtype)[1:].view(shape)
    return t.detach().requires_grad_(requires_grad)


def _inputs(device, dtype, rg):
    """(input, normalized_shape, name) of every layout the norm samples cover."""
    yield make((4, 16), device, dtype, rg), [16], "rows"
    yield make((2, 3, 5), device, dtype, rg), [3, 5], "two_dims"
    yield make((3, 7), device, dtype, rg), [7], "odd"
    yield make((6, 33), device, dtype, rg), [33], "odd33"
    yield make_transposed((5, 9), device, dtype, rg), [9], "transposed"
    yield make((4, 20), device, dtype)[:, ::2].detach().requires_grad_(rg), [10], "sliced"
    yield make((1, 8), device, dtype).expand(3, 8).detach().requires_grad_(rg), [8], "expanded"
    yield _misaligned((3, 16), device, dtype, rg), [16], "misaligned"
    yield make((0, 8), device, dtype, rg), [8], "no_rows"
    yield make((3, 1), device, dtype, rg), [1], "one_col"
    yield make((2, 0), device, dtype, rg), [0], "no_cols"
    # Rows longer than a CUDA block keeps in registers (its looping path;
    # the CPU has one path for every length).
    if device != "cpu":
        yield make((2, 40000), device, dtype, rg), [40000], "long"


def _rms_samples(device, dtype, requires_grad=False):
    rg = requires_grad
    for x, shape, name in _inputs(device, dtype, rg):
        yield Sample((x, shape, _param(shape, device, dtype, rg), 1e-5), name=f"rms_{name}")
    x = make((5, 12), device, dtype, rg)
    yield Sample((x, [12]), name="rms_no_weight_default_eps")
    # Mixed precision (a float32 weight beside a half input): its gradients
    # keep their own dtypes, which the generic gradient tests do not expect;
    # test_norms.py checks them.
    if not rg:
        yield Sample((make((5, 12), device, dtype), [12], _param([12], device, dtype, False, True)),
                     {"eps": 1e-6}, name="rms_mixed")
    yield from _rms_compile(device, dtype, requires_grad)


def _rms_compile(device, dtype, requires_grad=False):
    for rows in (4, 6, 9):
        yield Sample((make((rows, 16), device, dtype, requires_grad), [16],
                      _param([16], device, dtype, requires_grad), 1e-6), name=f"rms_c{rows}")


def _fused_samples(device, dtype, requires_grad=False):
    rg = requires_grad
    for x, shape, name in _inputs(device, dtype, rg):
        r = make(x.shape, device, dtype, rg)
        yield Sample((x, r, shape, _param(shape, device, dtype, rg), 1e-5), name=f"fused_{name}")
    x, r = make((5, 12), device, dtype, rg), make_transposed((5, 12), device, dtype, rg)
    yield Sample((x, r, [12]), name="fused_no_weight_transposed_residual")
    if not rg:  # mixed precision: see _rms_samples
        x, r = make((5, 12), device, dtype), make((5, 12), device, dtype)
        yield Sample((x, r, [12], _param([12], device, dtype, False, True)), {"eps": 1e-6},
                     name="fused_mixed")
    yield from _fused_compile(device, dtype, requires_grad)


def _fused_compile(device, dtype, requires_grad=False):
    for rows in (4, 6, 9):
        x, r = (make((rows, 16), device, dtype, requires_grad) for _ in range(2))
        yield Sample((x, r, [16], _param([16], device, dtype, requires_grad), 1e-6),
                     name=f"fused_c{rows}")


def _inplace_samples(device, dtype, requires_grad=False):
    def sample(x, r, mixed=False, name=""):
        w = _param([x.shape[-1]], device, dtype, False, mixed)
        return Sample((x, r, w, 1e-6), name=f"inplace_{name}")

    def m(*shape):
        return make(shape, device, dtype)

    yield sample(m(4, 16), m(4, 16), name="rows")
    yield sample(m(2, 3, 7), m(2, 3, 7), name="3d_odd")
    yield sample(make_transposed((5, 9), device, dtype), m(5, 9), name="transposed")
    yield sample(m(4, 20)[:, ::2], make_transposed((4, 10), device, dtype), name="sliced")
    yield sample(_misaligned((3, 16), device, dtype, False), m(3, 16), name="misaligned")
    yield sample(m(0, 8), m(0, 8), name="no_rows")
    yield sample(m(3, 1), m(3, 1), name="one_col")
    yield sample(m(5, 12), m(5, 12), mixed=True, name="mixed")
    if device != "cpu":  # the CUDA looping path, as _inputs
        yield sample(m(2, 40000), m(2, 40000), name="long")
    yield from _inplace_compile(device, dtype)


def _inplace_compile(device, dtype, requires_grad=False):
    for rows in (4, 6, 9):
        x, r = make((rows, 16), device, dtype), make((rows, 16), device, dtype)
        yield Sample((x, r, _param([16], device, dtype, False), 1e-6), name=f"inplace_c{rows}")


def _ln_samples(device, dtype, requires_grad=False):
    rg = requires_grad
    for x, shape, name in _inputs(device, dtype, rg):
        yield Sample((x, shape, _param(shape, device, dtype, rg), _param(shape, device, dtype, rg),
                      1e-5), name=f"ln_{name}")
    yield Sample((make((5, 12), device, dtype, rg), [12]), name="ln_no_params")
    yield Sample((make((5, 12), device, dtype, rg), [12], _param([12], device, dtype, rg)),
                 name="ln_weight_only")
    yield Sample((make((5, 12), device, dtype, rg), [12], None, _param([12], device, dtype, rg)),
                 name="ln_bias_only")
    if not rg:  # mixed precision: see _rms_samples
        yield Sample((make((5, 12), device, dtype), [12], _param([12], device, dtype, False, True),
                      _param([12], device, dtype, False, True)), {"eps": 1e-6}, name="ln_mixed")
    # A mean well above the spread: the variance is taken about the mean.
    x = (make((4, 64), device, torch.float64, low=-1, high=1) + 10).to(dtype)
    yield Sample((x.requires_grad_(rg), [64], None, None, 1e-5), name="ln_offset")
    yield from _ln_compile(device, dtype, requires_grad)


def _ln_compile(device, dtype, requires_grad=False):
    for rows in (4, 6, 9):
        yield Sample((make((rows, 16), device, dtype, requires_grad), [16],
                      _param([16], device, dtype, requires_grad),
                      _param([16], device, dtype, requires_grad), 1e-5), name=f"ln_c{rows}")


def _param_errors(device, op: str, call):
    """The errors every forward op shares; `call(x, shape, weight)` builds
    the sample."""
    f = lambda *s, dt=torch.float32, dev=device: make(s, dev, dt)  # noqa: E731
    yield ErrorInput(call(f(3, 4), [5], f(5)), op + r".*'normalized_shape'")
    yield ErrorInput(call(f(4), [3, 4], f(3, 4)), op + r".*'normalized_shape'")
    yield ErrorInput(call(f(3, 4), [], None), op + r".*'normalized_shape'")
    yield ErrorInput(call(f(3, 4), [4], f(5)), op + r".*'weight'.*shape")
    yield ErrorInput(call(f(3, 4), [4], f(4, dt=torch.float64)), op + r".*'weight'.*dtype")
    yield ErrorInput(call(f(3, 4, dt=torch.bfloat16), [4], f(4, dt=torch.float16)),
                     op + r".*'weight'.*dtype")
    yield ErrorInput(call(torch.ones(3, 4, dtype=torch.int64, device=device), [4], None),
                     op + r".*'input'.*floating")
    if device != "cpu":
        yield ErrorInput(call(f(3, 4), [4], f(4, dev="cpu")), op + r".*'weight'")


def _stat(shape, device, dtype=torch.float32):
    return torch.rand(shape, device=device, dtype=dtype) + 0.5


def _rms_errors(device):
    op = r"torchops\.rms_norm"
    yield from _param_errors(device, op, lambda x, s, w: Sample((x, s, w, 1e-5)))
    f = lambda *s, dt=torch.float32: make(s, device, dt)  # noqa: E731
    bwd = torch.ops.torchops._rms_norm_backward.default
    bop = r"torchops\._rms_norm_backward"
    yield ErrorInput(Sample((f(3, 5), f(3, 4), _stat((3,), device), [4], f(4), [True, True])),
                     bop + r".*'grad'", op=bwd)
    yield ErrorInput(Sample((f(3, 4), f(3, 4), _stat((4,), device), [4], f(4), [True, True])),
                     bop + r".*'rstd'", op=bwd)
    yield ErrorInput(Sample((f(3, 4), f(3, 4), _stat((3,), device, torch.float64), [4], f(4),
                             [True, True])), bop + r".*'rstd'", op=bwd)
    fwd = torch.ops.torchops._rms_norm_forward.default
    yield ErrorInput(Sample((f(3, 4), [4], f(5), None)), r"torchops\._rms_norm_forward.*'weight'",
                     op=fwd)


def _fused_errors(device):
    op = r"torchops\.fused_add_rms_norm"
    yield from _param_errors(device, op, lambda x, s, w: Sample((x, x.clone(), s, w, 1e-5)))
    f = lambda *s, dt=torch.float32: make(s, device, dt)  # noqa: E731
    yield ErrorInput(Sample((f(3, 4), f(4, 3), [4], f(4))), op + r".*'residual'.*shape")
    yield ErrorInput(Sample((f(3, 4), f(3, 4, dt=torch.float64), [4], f(4))),
                     op + r".*'residual'.*dtype")
    fwd = torch.ops.torchops._fused_add_rms_norm_forward.default
    yield ErrorInput(Sample((f(3, 4), f(3, 5), [4], f(4), None)),
                     r"torchops\._fused_add_rms_norm_forward.*'residual'", op=fwd)


def _inplace_errors(device):
    op = r"torchops\.fused_add_rms_norm_"
    f = lambda *s, dt=torch.float32, dev=device: make(s, dev, dt)  # noqa: E731
    yield ErrorInput(Sample((f(3, 4), f(3, 4), f(5), 1e-6)), op + r".*'weight'.*shape")
    yield ErrorInput(Sample((f(3, 4), f(3, 5), f(4), 1e-6)), op + r".*'residual'.*shape")
    yield ErrorInput(Sample((f(3, 4), f(3, 4, dt=torch.float16), f(4), 1e-6)),
                     op + r".*'residual'.*dtype")
    yield ErrorInput(Sample((f(3, 4), f(3, 4), f(4, dt=torch.float64), 1e-6)),
                     op + r".*'weight'.*dtype")
    yield ErrorInput(Sample((torch.ones(3, 4, dtype=torch.int64, device=device),
                             torch.ones(3, 4, dtype=torch.int64, device=device), f(4), 1e-6)),
                     op + r".*'input'.*floating")
    yield ErrorInput(Sample((f(1, 4).expand(3, 4), f(3, 4), f(4), 1e-6)),
                     op + r".*'input'.*overlapping", kernel_only="memory overlap is a property "
                     "of real storage that a fake tensor does not check")
    x = f(3, 4)
    yield ErrorInput(Sample((x, x, f(4), 1e-6)), op + r".*share memory",
                     kernel_only="aliasing between two arguments is checked on real storage")
    if device != "cpu":
        yield ErrorInput(Sample((f(3, 4), f(3, 4, dev="cpu"), f(4), 1e-6)), op + r".*'residual'")


def _ln_errors(device):
    op = r"torchops\.layer_norm"
    yield from _param_errors(device, op, lambda x, s, w: Sample((x, s, w, None, 1e-5)))
    f = lambda *s, dt=torch.float32: make(s, device, dt)  # noqa: E731
    yield ErrorInput(Sample((f(3, 4), [4], f(4), f(5), 1e-5)), op + r".*'bias'.*shape")
    yield ErrorInput(Sample((f(3, 4, dt=torch.bfloat16), [4], f(4), f(4, dt=torch.bfloat16),
                             1e-5)), op + r".*'bias'.*dtype")
    bwd = torch.ops.torchops._layer_norm_backward.default
    bop = r"torchops\._layer_norm_backward"
    s3 = _stat((3,), device)
    yield ErrorInput(Sample((f(3, 4), f(3, 4), _stat((2,), device), s3, [4], f(4), f(4),
                             [True, True, True])), bop + r".*'mean'", op=bwd)
    yield ErrorInput(Sample((f(3, 4, dt=torch.float64), f(3, 4), s3, s3, [4], f(4), f(4),
                             [True, True, True])), bop + r".*'grad'.*dtype", op=bwd)
    fwd = torch.ops.torchops._layer_norm_forward.default
    yield ErrorInput(Sample((f(3, 4), [4], f(4), f(3), 1e-5)),
                     r"torchops\._layer_norm_forward.*'bias'", op=fwd)


def _sharded(device, make_sample, n_out):
    """Row shardings (any dim but the normalised ones, weights replicated),
    an odd row count (DTensor pads the last shard), and all replicated.
    `make_sample(x_shape, shape, rows)` returns (sample, input placements
    with "X" where the activations' placement goes)."""
    for x_shape, shape, dims in (((4, 6, 8), [8], (0, 1)), ((5, 3, 8), [3, 8], (0,))):
        for p in [f"S{d}" for d in dims] + ["R"]:
            sample, ins = make_sample(x_shape, shape)
            yield ShardingSample(sample, inputs=tuple(p if i == "X" else i for i in ins),
                                 outputs=(p,) * n_out)


def _rms_sharding(device):
    def sample(x_shape, shape):
        x = make(x_shape, device, torch.float32, True)
        w = _param(shape, device, torch.float32, True)
        return Sample((x, shape, w, 1e-5)), ("X", None, "R", None)
    yield from _sharded(device, sample, 1)


def _fused_sharding(device):
    def sample(x_shape, shape):
        x, r = make(x_shape, device, torch.float32, True), make(x_shape, device, torch.float32, True)
        w = _param(shape, device, torch.float32, True)
        return Sample((x, r, shape, w, 1e-5)), ("X", "X", None, "R", None)
    yield from _sharded(device, sample, 2)


def _ln_sharding(device):
    def sample(x_shape, shape):
        x = make(x_shape, device, torch.float32, True)
        w, b = (_param(shape, device, torch.float32, True) for _ in range(2))
        return Sample((x, shape, w, b, 1e-5)), ("X", None, "R", "R", None)
    yield from _sharded(device, sample, 1)


# Half outputs of values up to |x| / rms * w (about 3): one rounding of those.
_NORM_TOLS = {torch.bfloat16: Tol(2e-2, 1.6e-2), torch.float16: Tol(3e-3, 2e-3)}

RMS_NORM = OpInfo(
    name="rms_norm",
    sample_inputs=_rms_samples,
    sample_inputs_compile=_rms_compile,
    error_inputs=_rms_errors,
    internal_ops=("_rms_norm_forward", "_rms_norm_backward"),
    autocast=True,
    tols=_NORM_TOLS,
    sharding_samples=_rms_sharding,
)

FUSED_ADD_RMS_NORM = OpInfo(
    name="fused_add_rms_norm",
    sample_inputs=_fused_samples,
    sample_inputs_compile=_fused_compile,
    error_inputs=_fused_errors,
    internal_ops=("_fused_add_rms_norm_forward", "_rms_norm_backward"),
    autocast=True,
    tols=_NORM_TOLS,
    sharding_samples=_fused_sharding,
)

FUSED_ADD_RMS_NORM_ = OpInfo(
    name="fused_add_rms_norm_",
    sample_inputs=_inplace_samples,
    sample_inputs_compile=_inplace_compile,
    error_inputs=_inplace_errors,
    mutated_args=(0, 1),
    tols=_NORM_TOLS,
    no_benchmark={"fused_add_rms_norm_": "the in-place variant runs fused_add_rms_norm's "
                  "kernel, then copies into place; that case times the kernel"},
)

LAYER_NORM = OpInfo(
    name="layer_norm",
    sample_inputs=_ln_samples,
    sample_inputs_compile=_ln_compile,
    error_inputs=_ln_errors,
    internal_ops=("_layer_norm_forward", "_layer_norm_backward"),
    autocast=True,
    tols=_NORM_TOLS,
    sharding_samples=_ln_sharding,
)

NORM_OPS = [RMS_NORM, FUSED_ADD_RMS_NORM, FUSED_ADD_RMS_NORM_, LAYER_NORM]
