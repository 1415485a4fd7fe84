"""Tensor-parallel paths of torchops' ops: the ones whose math needs a
collective call, which a DTensor sharding rule (torchops/sharding.py: local
shards, no communication) cannot express.

``torchops.fused_linear_cross_entropy`` comes here when its weight is a DTensor
(it imports this module only then, so ``import torchops`` does not import
DTensor).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["vocab_parallel_cross_entropy"]

_OP = "torchops.fused_linear_cross_entropy"


def vocab_parallel_cross_entropy(input: Tensor, weight: Tensor, target: Tensor,
                                 bias: Tensor | None = None, ignore_index: int = -100,
                                 label_smoothing: float = 0.0, reduction: str = "mean",
                                 lse_square_scale: float = 0.0,
                                 softcap: float | None = None) -> Tensor:
    """``torchops.fused_linear_cross_entropy`` with a vocabulary-parallel head
    (Megatron's): ``weight`` (V, H) is a DTensor sharded over its rows,
    ``Shard(0)``, on a 1-D device mesh, so each rank holds a contiguous slice
    of the classes (uneven slices as DTensor makes them, ``torch.chunk``'s,
    an empty one included).  The loss, its options and its gradients are the
    single-process op's on the full weight.

    Arguments:
        input, target: plain tensors, or DTensors on the weight's mesh with
            every placement ``Replicate()``; identical on every rank either way.
        weight: the DTensor above.
        bias: None, or a (V,) DTensor sharded like the weight (``Shard(0)``).
        the rest: as ``torchops.fused_linear_cross_entropy``.

    Returns the loss on every rank: a plain tensor, or a ``Replicate()``
    DTensor when ``input`` is a DTensor (the placement it came in).

    Computation and communication.  Forward: each rank runs the op's stats
    pass over its slice (per token: the slice's logsumexp, the target's
    logit where the slice holds the target, the sum of its logits; the
    logits a chunk of tokens at a time, never all of them), then ONE
    all-reduce (sum) of an (N, R + 2) buffer over the R ranks of the mesh --
    column ``rank`` holds this rank's logsumexp (zeros in the others' columns,
    so the sum gathers them exactly), the last two the target logit and the
    logit sum -- after which every rank computes the global logsumexp over
    the R columns and the same loss.  Backward: each rank recomputes its
    slice's logits and turns them, with the global logsumexp, into its rows
    of the weight (and bias) gradient, which stay on the rank (the gradient
    is a ``Shard(0)`` DTensor like the weight), and its share of the input
    gradient; ONE all-reduce (sum) of that share, only when ``input``
    requires grad, completes it.  Nothing else is communicated.

    The collectives are ``torch.distributed._functional_collectives``'s
    (traceable by ``torch.compile``, out of place) on the mesh's process
    group.  Under ``torch.autocast`` input, weight and bias are cast as
    ``F.linear`` casts them (float64 left alone), as the op does.

    Raises ValueError for a weight or bias sharded otherwise, a mesh of more
    than one dimension, an input or target that is not replicated, and an
    unknown ``reduction``; RuntimeError for what the op rejects (shapes,
    dtypes, a target outside ``[0, V)`` that is not ``ignore_index``).
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from torchops import ops

    if not isinstance(weight, DTensor):
        raise ValueError(f"{_OP}: the vocabulary-parallel path takes 'weight' as a DTensor, "
                         f"but got {type(weight).__name__}")
    mesh = weight.device_mesh
    if mesh.ndim != 1:
        raise ValueError(f"{_OP}: a DTensor 'weight' must be on a 1-D device mesh, but got "
                         f"a {mesh.ndim}-D mesh {tuple(mesh.shape)}")
    if not _is_vocab_shard(weight.placements, Shard):
        raise ValueError(f"{_OP}: a DTensor 'weight' must be sharded over the vocabulary "
                         f"(placements (Shard(0),)), but got {tuple(weight.placements)}")
    if bias is not None and not (isinstance(bias, DTensor) and bias.device_mesh == mesh
                                 and _is_vocab_shard(bias.placements, Shard)):
        where = (f"placements {tuple(bias.placements)}" if isinstance(bias, DTensor)
                 and bias.device_mesh == mesh else type(bias).__name__
                 if not isinstance(bias, DTensor) else "another device mesh")
        raise ValueError(f"{_OP}: with a vocabulary-parallel 'weight', 'bias' must be None or "
                         f"a DTensor on the weight's mesh sharded like it (Shard(0)), but got "
                         f"{where}")
    for name, t in (("input", input), ("target", target)):
        if isinstance(t, DTensor) and (t.device_mesh != mesh or not all(
                isinstance(p, Replicate) for p in t.placements)):
            raise ValueError(f"{_OP}: with a vocabulary-parallel 'weight', '{name}' must be a "
                             f"plain tensor or a DTensor replicated on the weight's mesh, but "
                             f"got placements {tuple(t.placements)} on {t.device_mesh}")
    ops._check_reduction("fused_linear_cross_entropy", reduction, ValueError)
    if not torch.compiler.is_compiling():
        # The op's own checks, on the global shapes, before any rank
        # communicates: a rank that raised after its peers entered the
        # all-reduce would leave them waiting.  (Under torch.compile the ops'
        # fakes make the same checks on every rank while tracing, before any
        # collective runs; these would break the graph.)
        ops._check_lce_options("fused_linear_cross_entropy", label_smoothing, reduction,
                               lse_square_scale, softcap)
        ops._check_lce("fused_linear_cross_entropy", input, weight, target, bias)

    vocab, world, rank = weight.shape[0], mesh.size(), mesh.get_local_rank()
    vocab_start, rows = _vocab_slice(vocab, world, rank)
    w = weight.to_local()  # differentiable: its gradient comes back as Shard(0)
    if w.shape[0] != rows:
        raise ValueError(f"{_OP}: the weight's local shard has {w.shape[0]} rows, but "
                         f"Shard(0) of {vocab} classes over {world} ranks gives rank {rank} "
                         f"{rows} (a DTensor made by from_local with other split sizes)")
    b = bias.to_local() if bias is not None else None
    x = input.to_local() if isinstance(input, DTensor) else input
    t = target.to_local() if isinstance(target, DTensor) else target

    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        # F.linear's policy, as the op's autocast kernel applies it.
        low = torch.get_autocast_dtype(device_type)
        x, w = _autocast(x, low), _autocast(w, low)
        b = _autocast(b, low) if b is not None else None

    loss = _VocabParallelCrossEntropy.apply(
        x, w, b, t, mesh.get_group(), rank, world, vocab_start, vocab, ignore_index,
        label_smoothing, reduction, lse_square_scale, softcap)
    if isinstance(input, DTensor):
        return DTensor.from_local(loss, mesh, [Replicate()], run_check=False)
    return loss


def _vocab_slice(vocab: int, world: int, rank: int) -> tuple[int, int]:
    """(first class, number of classes) of `rank`'s Shard(0) slice: DTensor
    splits as torch.chunk does, ceil(V / R) rows per rank, the last ones
    shorter or empty.  Plain integer math (which torch.compile traces without
    a break); the caller checks it against the local shard's rows."""
    chunk = -(-vocab // world)
    start = min(rank * chunk, vocab)
    return start, min(chunk, vocab - start)


def _is_vocab_shard(placements, shard_cls) -> bool:
    # Shard(0) itself: a subclass (a strided shard) splits the rows otherwise.
    return len(placements) == 1 and type(placements[0]) is shard_cls and placements[0].dim == 0


def _autocast(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t


def _all_reduce_sum(t: Tensor, group) -> Tensor:
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_reduce(t, "sum", group))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """The loss on local tensors: x (input), w and b (this rank's slice of
    the weight and bias), t (target); see vocab_parallel_cross_entropy."""

    @staticmethod
    def forward(ctx, x, w, b, t, group, rank, world, vocab_start, vocab, ignore_index,
                smoothing, reduction, z_scale, softcap):
        with torch.autocast(x.device.type, enabled=False):
            stats = _local_stats(x, w, b, t, ignore_index, softcap, vocab_start, vocab)
            n = stats.shape[0]
            buf = stats.new_zeros((n, world + 2))
            buf[:, rank] = stats[:, 0]
            buf[:, world:] = stats[:, 1:]
            if n > 0:
                buf = _all_reduce_sum(buf, group)
            lse = torch.logsumexp(buf[:, :world], dim=1)
            flat_t = t.reshape(-1)
            loss = _loss(lse, buf[:, world], buf[:, world + 1], flat_t != ignore_index,
                         smoothing, z_scale, vocab, reduction, t.shape)
        ctx.save_for_backward(x, w, b, flat_t, lse)
        ctx.args = (group, vocab_start, vocab, ignore_index, smoothing, reduction, z_scale,
                    softcap)
        return loss

    @staticmethod
    def backward(ctx, grad):
        x, w, b, t, lse = ctx.saved_tensors
        group, vocab_start, vocab, ignore_index, smoothing, reduction, z_scale, softcap = \
            ctx.args
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                b is not None and ctx.needs_input_grad[2]]
        if not any(mask):
            return (None,) * 14
        if w.shape[0] > 0:
            gx, gw, gb = torch.ops.torchops._fused_linear_cross_entropy_backward(
                grad, x, w, t, b, lse, ignore_index, smoothing, reduction, z_scale, softcap,
                vocab_start, vocab, mask)
        else:  # a rank holding no classes: no logits, no contribution
            gx, gw = torch.zeros_like(x), torch.zeros_like(w)
            gb = torch.zeros_like(b) if b is not None else None
        # Every rank holds a share of dloss/dx (its classes' terms): summed,
        # identical on every rank, as a replicated input's gradient must be.
        # (Nothing to sum without tokens; every rank skips alike.)
        if mask[0] and gx.numel() > 0:
            gx = _all_reduce_sum(gx, group)
        return ((gx if mask[0] else None, gw if mask[1] else None, gb if mask[2] else None)
                + (None,) * 11)


def _local_stats(x, w, b, t, ignore_index, softcap, vocab_start, vocab) -> Tensor:
    """(N, 3): this rank's (lse, z_target, sum z) over its classes."""
    if w.shape[0] > 0:
        return torch.ops.torchops._fused_linear_cross_entropy_stats(
            x, w, t, b, ignore_index, softcap, vocab_start, vocab)
    # No classes here (more ranks than chunks of the vocabulary): logsumexp of
    # nothing.  The op's target check runs on the ranks that do hold classes;
    # this one raises the same error itself rather than wait for them in the
    # all-reduce.
    flat = t.reshape(-1)
    bad = (flat != ignore_index) & ((flat < 0) | (flat >= vocab))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise RuntimeError(f"{_OP}: expected every 'target' to be a class in [0, {vocab}) or "
                           f"ignore_index ({ignore_index}), but target[{i}] is "
                           f"{int(flat[i])}")
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    stats = torch.zeros((flat.numel(), 3), dtype=acc, device=x.device)
    stats[:, 0] = float("-inf")
    return stats


def _loss(lse, z_target, z_sum, valid, smoothing, z_scale, vocab, reduction, shape) -> Tensor:
    """Each token's loss from the global row statistics, then reduced: the
    kernels' lce_loss (csrc/common/fused_linear_cross_entropy_steps.h),
    term for term, so the two paths round alike."""
    per = lse - z_target * (1.0 - smoothing)
    # Terms with a zero coefficient are left out, not multiplied by 0: an
    # infinite logit would make them NaN.
    if smoothing != 0.0:
        per = per - z_sum * (smoothing / float(vocab))
    if z_scale != 0.0:
        per = per + lse * lse * z_scale
    per = torch.where(valid, per, torch.zeros((), dtype=per.dtype, device=per.device))
    if reduction == "none":
        return per.reshape(shape)
    if reduction == "sum":
        return per.sum()
    # No tokens counted: 0 / 0 = nan, as torch's cross_entropy.
    return per.sum() / valid.sum().to(per.dtype)
