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
