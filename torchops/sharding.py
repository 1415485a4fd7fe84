"""DTensor sharding rules: which placements each op runs on without moving data.

A torchops op called on DTensors (tensor or sequence parallelism) needs a rule
saying which input placements it accepts and what placements its outputs then
have; DTensor calls the op on the local shards under the rule it picks, and
redistributes the inputs first only when no rule fits.  Each rule here is a
function of the op's arguments, as ``torch.distributed.tensor.experimental.
register_sharding`` takes them (tensors arrive as DTensor specs: ``.ndim``,
``.shape``), returning ``[(output placements, input placements), ...]`` for one
mesh dimension; DTensor expands that over every dimension of the mesh.

Writing a rule
--------------
* One entry per positional argument in the input list: a placement for each
  tensor argument that is present, ``None`` for a scalar, a list of ints or an
  absent optional tensor.  One placement per output.
* List the all-``Replicate`` strategy first, then every sharding the math
  allows without communication (a reduction over a sharded dim is not one: a
  norm sharded on its normalised dim must be gathered).
* A gradient summed over a sharded dim (a weight's gradient when the rows are
  sharded) is ``Partial()``: each rank holds its rows' share.
* Register the backward ops too: under DTensor, the C++ autograd calls them on
  DTensors.
* Give the op's database entry ``sharding_samples`` (test/opdb/__init__.py);
  test/test_sharding.py runs them on two processes.

Rules are registered when ``torch.distributed.tensor`` is imported -- at
``import torchops`` when it already was, else by an import hook the moment it
is -- so ``import torchops`` does not pay for DTensor's import.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Callable

import torch

__all__ = ["rule", "placements", "registered"]

_RULES: list[tuple[tuple[str, ...], Callable]] = []
_INSTALLED: set[str] = set()
_DTENSOR = "torch.distributed.tensor"


def rule(*op_names: str) -> Callable[[Callable], Callable]:
    """Decorator: ``fn`` is the sharding rule of ``torch.ops.torchops.<name>``
    for each name (ops whose arguments take the same rule share one)."""

    def decorate(fn: Callable) -> Callable:
        _RULES.append((op_names, fn))
        if _DTENSOR in sys.modules:
            _install()
        return fn

    return decorate


def placements():
    """(Replicate, Shard, Partial): the placement classes, imported on first use."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    return Replicate, Shard, Partial


def registered() -> list[str]:
    """The ops with a rule registered with DTensor (after DTensor's import)."""
    return sorted(_INSTALLED)


def _rule_names() -> list[str]:
    return sorted({n for names, _ in _RULES for n in names})


def _first_static_arg(overload) -> int:
    # DTensor caches the rule's result by the tensor specs and the arguments
    # from this index on.  Every non-tensor argument can change the answer
    # (normalized_shape, unsqueeze_dim), so all of them take part.
    for i, arg in enumerate(overload._schema.arguments):
        t = arg.type
        if isinstance(t, torch.OptionalType):
            t = t.getElementType()
        if not isinstance(t, torch.TensorType):
            return i
    return len(overload._schema.arguments)


def _install() -> None:
    if not torch.distributed.is_available():
        return
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor.experimental import register_sharding

    propagator = DTensor._op_dispatcher.sharding_propagator
    for names, fn in _RULES:
        todo = [n for n in names if n not in _INSTALLED]
        if not todo:
            continue
        overloads = [getattr(torch.ops.torchops, n).default for n in todo]
        register_sharding(overloads)(fn)
        for name, overload in zip(todo, overloads):
            # register_sharding hashes only the int arguments into the cache
            # key; re-register its strategy with every non-tensor argument.
            propagator.register_op_strategy(
                overload, propagator.op_strategy_funcs[overload],
                RuntimeSchemaInfo(static_argnum=_first_static_arg(overload),
                                  needs_pytree=True))
            _INSTALLED.add(name)


class _InstallAfterImport(importlib.abc.MetaPathFinder):
    """Runs _install right after torch.distributed.tensor finishes importing."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _DTENSOR:
            return None
        import importlib.util

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_install(module):
            exec_module(module)
            try:
                _install()
            except Exception as e:  # never break the user's import of DTensor
                import warnings

                warnings.warn(f"torchops: DTensor sharding rules not registered: {e!r}")

        loader.exec_module = exec_then_install
        return spec


def _arm() -> None:
    if _DTENSOR in sys.modules:
        _install()
    elif torch.distributed.is_available():
        sys.meta_path.insert(0, _InstallAfterImport())


_arm()


# --- basic ---------------------------------------------------------------------------

@rule("d_sigmoid")
def _elementwise(z):
    Replicate, Shard, Partial = placements()
    return [([Replicate()], [Replicate()])] + [([Shard(d)], [Shard(d)]) for d in range(z.ndim)]


@rule("_d_sigmoid_backward")
def _elementwise_backward(grad, z):
    Replicate, Shard, Partial = placements()
    return ([([Replicate()], [Replicate(), Replicate()])]
            + [([Shard(d)], [Shard(d), Shard(d)]) for d in range(z.ndim)])


# --- norms ---------------------------------------------------------------------------
# A norm reduces over its trailing normalized_shape dims: it runs shard-locally
# on any other (row) dim, with the weights replicated.  The statistics the
# _forward ops return have the row dims, so they shard alike; the backward's
# weight and bias gradients sum over the rows, Partial when the rows are
# sharded.  fused_add_rms_norm_ has no rule: DTensor does not take in-place
# ops without a return value.


def _norm_strategies(input, nd: int, tensors_in, n_out: int, params: dict[int, bool],
                     partial_outs: dict[int, bool]):
    """Strategies of a norm op: `tensors_in` lists per positional argument
    "x" (an activation-shaped tensor or a row statistic: sharded with the
    rows), "w" (a weight: replicated) or None.  `params` marks the outputs
    that do not shard with the rows: parameter gradients, Partial under row
    sharding where `partial_outs` says so, and (0,)-shaped placeholders,
    Replicate."""
    Replicate, Shard, Partial = placements()

    def ins(p):
        return [None if k is None else (Replicate() if k == "w" else p) for k in tensors_in]

    out = [([Replicate()] * n_out, ins(Replicate()))]
    for d in range(input.ndim - nd):
        outs = [(Partial() if partial_outs.get(i) else Replicate()) if params.get(i) else Shard(d)
                for i in range(n_out)]
        out.append((outs, ins(Shard(d))))
    return out


def _kind(t, kind):
    return None if t is None else kind


@rule("rms_norm")
def _rms_norm_rule(input, normalized_shape, weight=None, *rest):
    return _norm_strategies(input, len(normalized_shape),
                            ["x", None, _kind(weight, "w"), *([None] * len(rest))], 1, {}, {})


@rule("_rms_norm_forward")
def _rms_norm_forward_rule(input, normalized_shape, weight=None, *rest):
    return _norm_strategies(input, len(normalized_shape),
                            ["x", None, _kind(weight, "w"), *([None] * len(rest))], 2, {}, {})


@rule("fused_add_rms_norm")
def _fused_add_rms_norm_rule(input, residual, normalized_shape, weight=None, *rest):
    return _norm_strategies(input, len(normalized_shape),
                            ["x", "x", None, _kind(weight, "w"), *([None] * len(rest))], 2, {},
                            {})


@rule("_fused_add_rms_norm_forward")
def _fused_add_rms_norm_forward_rule(input, residual, normalized_shape, weight=None, *rest):
    return _norm_strategies(input, len(normalized_shape),
                            ["x", "x", None, _kind(weight, "w"), *([None] * len(rest))], 3, {},
                            {})


@rule("_rms_norm_backward")
def _rms_norm_backward_rule(grad, input, rstd, normalized_shape, weight, output_mask):
    return _norm_strategies(input, len(normalized_shape),
                            ["x", "x", "x", None, _kind(weight, "w"), None], 2,
                            {0: not output_mask[0], 1: True},
                            {1: weight is not None and output_mask[1]})


@rule("layer_norm")
def _layer_norm_rule(input, normalized_shape, weight=None, bias=None, *rest):
    return _norm_strategies(input, len(normalized_shape),
                            ["x", None, _kind(weight, "w"), _kind(bias, "w"),
                             *([None] * len(rest))], 1, {}, {})


@rule("_layer_norm_forward")
def _layer_norm_forward_rule(input, normalized_shape, weight=None, bias=None, *rest):
    return _norm_strategies(input, len(normalized_shape),
                            ["x", None, _kind(weight, "w"), _kind(bias, "w"),
                             *([None] * len(rest))], 3, {}, {})


@rule("_layer_norm_backward")
def _layer_norm_backward_rule(grad, input, mean, rstd, normalized_shape, weight, bias,
                              output_mask):
    return _norm_strategies(input, len(normalized_shape),
                            ["x", "x", "x", "x", None, _kind(weight, "w"), _kind(bias, "w"),
                             None], 3, {0: not output_mask[0], 1: True, 2: True},
                            {1: weight is not None and output_mask[1],
                             2: bias is not None and output_mask[2]})


# --- softmax -------------------------------------------------------------------------
# Rows of attention scores are independent and a causal row's mask depends only
# on its position within (Sq, Sk): batch and heads shard freely.  The mask of
# scaled_masked_softmax is sharded with the batch when it has one entry per
# batch entry, else replicated (also when the heads are sharded).

@rule("scaled_masked_softmax")
def _scaled_masked_softmax(input, mask, scale):
    Replicate, Shard, Partial = placements()
    mask_batch = Shard(0) if mask.shape[0] > 1 else Replicate()
    return [([Replicate()], [Replicate(), Replicate(), None]),
            ([Shard(0)], [Shard(0), mask_batch, None]),
            ([Shard(1)], [Shard(1), Replicate(), None])]


@rule("scaled_upper_triang_masked_softmax")
def _scaled_upper_triang_masked_softmax(input, scale):
    Replicate, Shard, Partial = placements()
    # (B, Sq, Sk): the batch; (B, H, Sq, Sk): the batch or the heads.
    return ([([Replicate()], [Replicate(), None])]
            + [([Shard(d)], [Shard(d), None]) for d in range(input.ndim - 2)])


@rule("_scaled_masked_softmax_backward", "_scaled_upper_triang_masked_softmax_backward")
def _masked_softmax_backward(grad, output, scale):
    Replicate, Shard, Partial = placements()
    return ([([Replicate()], [Replicate(), Replicate(), None])]
            + [([Shard(d)], [Shard(d), Shard(d), None]) for d in range(output.ndim - 2)])


# --- activations ---------------------------------------------------------------------

# Gated activations: each row's halves meet in one element-wise pass, so x
# (and the backward's grad) shards on any dim but the last; the last dim
# holds both halves and must stay whole.  gelu_and_mul's `approximate` is a
# scalar (None).


@rule("silu_and_mul", "gelu_and_mul")
def _gated(x, *scalars):
    Replicate, Shard, Partial = placements()
    rest = [None] * len(scalars)
    return ([([Replicate()], [Replicate(), *rest])]
            + [([Shard(d)], [Shard(d), *rest]) for d in range(x.ndim - 1)])


@rule("_silu_and_mul_backward", "_gelu_and_mul_backward")
def _gated_backward(grad, x, *scalars):
    Replicate, Shard, Partial = placements()
    rest = [None] * len(scalars)
    return ([([Replicate()], [Replicate(), Replicate(), *rest])]
            + [([Shard(d)], [Shard(d), Shard(d), *rest]) for d in range(x.ndim - 1)])


# --- rotary ----------------------------------------------------------------------------

def _rotary_dims(q, cos, unsqueeze_dim):
    """(batch, sequence, heads) dims of q and k; cos's sequence dim; whether
    cos has a batch of its own (else it is shared and stays replicated on a
    batch sharding)."""
    s_dim, h_dim = (2, 1) if unsqueeze_dim in (1, -3) else (1, 2)
    per_batch = cos.ndim == 3 and cos.shape[0] != 1
    return s_dim, h_dim, cos.ndim - 2, per_batch


@rule("rotary_embedding")
def _rotary(q, k, cos, sin, unsqueeze_dim=1, interleaved=False):
    # Rows are independent and heads are independent: batch, sequence and
    # heads shard; cos and sin follow on their matching dim, or stay whole.
    Replicate, Shard, Partial = placements()
    s_dim, h_dim, cs_dim, per_batch = _rotary_dims(q, cos, unsqueeze_dim)
    R = Replicate()
    cb = Shard(0) if per_batch else R
    return [
        ([R, R], [R, R, R, R, None, None]),
        ([Shard(0), Shard(0)], [Shard(0), Shard(0), cb, cb, None, None]),
        ([Shard(s_dim), Shard(s_dim)], [Shard(s_dim), Shard(s_dim), Shard(cs_dim),
                                        Shard(cs_dim), None, None]),
        ([Shard(h_dim), Shard(h_dim)], [Shard(h_dim), Shard(h_dim), R, R, None, None]),
    ]


@rule("_rotary_embedding_backward")
def _rotary_backward(grad_q, grad_k, q, k, cos, sin, unsqueeze_dim, interleaved, cos_sin_grad):
    # cos's and sin's gradients sum over heads (and batch, when cos is
    # shared): Partial where that dim is sharded.  Without cos_sin_grad they
    # are (0,) placeholders, the same on every rank.
    Replicate, Shard, Partial = placements()
    s_dim, h_dim, cs_dim, per_batch = _rotary_dims(q, cos, unsqueeze_dim)
    R = Replicate()

    def case(x, c, dc):
        dc = dc if cos_sin_grad else R
        return ([x, x, dc, dc], [x, x, x, x, c, c, None, None, None])
    cb = Shard(0) if per_batch else R
    return [
        case(R, R, R),
        case(Shard(0), cb, Shard(0) if per_batch else Partial()),
        case(Shard(s_dim), Shard(cs_dim), Shard(cs_dim)),
        case(Shard(h_dim), R, Partial()),
    ]
