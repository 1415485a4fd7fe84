"""Op-specific tests of the rotary ops (torchops.rotary_embedding and the
in-place rotary_embedding_): what the generic opdb tests do not cover --
equality with Hugging Face's and vLLM's formulas as written, agreement of
the two ops, gradients with only some inputs requiring them, determinism of
cos's gradient, out-of-range positions, the in-place op under compile, and
(on a GPU) the 16-byte paths at model sizes against the CPU."""

from __future__ import annotations

import pytest
import torch

import torchops
from opdb import rotary_cache_inputs, rotary_inputs

OP = torch.ops.torchops.rotary_embedding.default
BACKWARD = torch.ops.torchops._rotary_embedding_backward.default
INPLACE = torch.ops.torchops.rotary_embedding_.default


def _devices():
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# --- the peers' formulas, as their code writes them ---------------------------------------


def _hf_rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (_hf_rotate_half(q) * sin), (k * cos) + (_hf_rotate_half(k) * sin)


def _vllm_rotary(positions, x, cache, is_neox):
    """vLLM's RotaryEmbedding.forward_native on one of q, k of shape
    (T, H, D)."""
    rot = cache.shape[1]
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    xr, xp = x[..., :rot], x[..., rot:]
    if is_neox:
        x1, x2 = torch.chunk(xr, 2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = xr[..., ::2], xr[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((out, xp), dim=-1)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_matches_hugging_face(device, unsqueeze_dim):
    layout = "bhsd" if unsqueeze_dim == 1 else "bshd"
    q, k, cos, sin, u, _ = rotary_inputs(2, 4, 2, 7, 16, 16, device, torch.float64,
                                         layout=layout)
    # Unequal halves of cos and sin: each entry must use its own value.
    assert not torch.equal(cos[..., :8], cos[..., 8:])
    want = _hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
    got = torchops.rotary_embedding(q, k, cos, sin, unsqueeze_dim)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-12)
    # The negative spelling of the same dim.
    got = torchops.rotary_embedding(q, k, cos, sin, unsqueeze_dim - 4)
    torch.testing.assert_close(got[0], want[0], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("interleaved", [False, True])
def test_inplace_matches_vllm(device, interleaved):
    pos, q, k, cache, _ = rotary_cache_inputs((11,), 4, 2, 12, 8, 20, device, torch.float64,
                                              interleaved=interleaved, qk_order="fused")
    want_q = _vllm_rotary(pos, q, cache, not interleaved)
    want_k = _vllm_rotary(pos, k, cache, not interleaved)
    before = q.clone()
    assert torchops.rotary_embedding_(pos, q, k, cache, interleaved) is None
    torch.testing.assert_close(q, want_q, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(k, want_k, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(q[..., 8:], before[..., 8:], atol=0, rtol=0)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("interleaved", [False, True])
def test_inplace_agrees_with_functional(device, interleaved):
    """The cache's per-pair cos/sin, spread to every entry of the pair, give
    the functional op the same rotation."""
    pos, q, k, cache, _ = rotary_cache_inputs((2, 6), 3, 1, 8, 8, 16, device, torch.float32,
                                              interleaved=interleaved)
    cos, sin = cache[pos].chunk(2, dim=-1)
    if interleaved:
        cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    else:
        cos, sin = cos.repeat(1, 1, 2), sin.repeat(1, 1, 2)
    want_q, want_k = torchops.rotary_embedding(q, k, cos, sin, 2, interleaved)
    torchops.rotary_embedding_(pos, q, k, cache, interleaved)
    torch.testing.assert_close(q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, want_k, atol=1e-6, rtol=1e-6)


# --- gradients ----------------------------------------------------------------------------


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("which", ["q", "k", "qk", "cos", "all"])
def test_gradients_of_some_inputs(device, which):
    """Only some inputs require grad (a frozen cos, the usual case, skips
    reading q and k in the backward); upstream gradients are strided."""
    args = rotary_inputs(2, 3, 1, 5, 8, 6, device, torch.float64, interleaved=True)
    names = ["q", "k", "cos", "sin"]
    wanted = {"q": "q", "k": "k", "qk": "qk", "cos": ["cos"], "all": names}[which]
    leaves = [a.detach().requires_grad_(n in wanted) for n, a in zip(names, args[:4])]
    outs = OP(*leaves, *args[4:])
    refs = torchops.references.rotary_embedding(*leaves, *args[4:])
    ups = [torch.randn(o.shape[:-1] + (2 * o.shape[-1],), device=device,
                       dtype=torch.float64)[..., ::2] for o in outs]
    inputs = [t for t in leaves if t.requires_grad]
    got = torch.autograd.grad(outs, inputs, ups, allow_unused=True)
    pairs = [(r, u) for r, u in zip(refs, ups) if r.requires_grad]
    want = torch.autograd.grad([r for r, _ in pairs], inputs, [u for _, u in pairs],
                               allow_unused=True)
    for g, w in zip(got, want):
        w = torch.zeros_like(g) if w is None else w
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-12)


def test_cos_gradient_is_deterministic_across_threads():
    q, k, cos, sin, u, i = rotary_inputs(4, 6, 2, 33, 16, 16, "cpu", torch.float32,
                                         cos_batch=0)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            results.append(BACKWARD(gq, gk, q, k, cos, sin, u, i, True))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_backward_without_cos_grad_returns_placeholders():
    q, k, cos, sin, u, i = rotary_inputs(2, 2, 2, 3, 4, 4, "cpu", torch.float32)
    dq, dk, dcos, dsin = BACKWARD(q, k, q, k, cos, sin, u, i, False)
    assert dcos.shape == (0,) and dsin.shape == (0,)
    assert dq.shape == q.shape and dk.shape == k.shape


@pytest.mark.parametrize("device", _devices())
def test_compiled_training_step(device):
    """A compiled loss (one graph, dynamic sizes) and its compiled backward."""
    def loss(q, k, cos, sin):
        qo, ko = torchops.rotary_embedding(q, k, cos, sin)
        return qo.square().sum() + ko.sum()

    compiled = torch.compile(loss, fullgraph=True, dynamic=True)
    for s in (5, 9):
        args = rotary_inputs(2, 4, 2, s, 8, 8, device, torch.float32, requires_grad=True)
        twin = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) else a
                for a in args]
        compiled(*args[:4]).backward()
        loss(*twin[:4]).backward()
        for a, b in zip(args[:4], twin[:4]):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)


# --- the in-place op -----------------------------------------------------------------------


def test_out_of_range_position_raises_and_writes_nothing():
    pos, q, k, cache, _ = rotary_cache_inputs((6,), 2, 1, 8, 8, 10, "cpu", torch.float32)
    pos[4] = 10
    q0, k0 = q.clone(), k.clone()
    with pytest.raises(RuntimeError, match=r"torchops\.rotary_embedding_: .*'positions'.*10"):
        INPLACE(pos, q, k, cache, False)
    assert torch.equal(q, q0) and torch.equal(k, k0)


@pytest.mark.parametrize("device", _devices())
def test_inplace_under_compile(device):
    def fn(pos, qkv, cache):
        q = qkv[..., :32].unflatten(-1, (4, 8))
        k = qkv[..., 32:48].unflatten(-1, (2, 8))
        torchops.rotary_embedding_(pos, q, k, cache)
        return qkv * 2

    compiled = torch.compile(fn, fullgraph=True)
    pos = torch.randint(0, 16, (7,), device=device)
    qkv = torch.randn(7, 64, device=device)
    cache = torch.randn(16, 8, device=device)
    a, b = qkv.clone(), qkv.clone()
    torch.testing.assert_close(compiled(pos, a, cache), fn(pos, b, cache))
    torch.testing.assert_close(a, b)


def test_inplace_rejects_grad_free_misuse_shapes():
    pos, q, k, cache, _ = rotary_cache_inputs((5,), 2, 1, 8, 8, 10, "cpu", torch.float32)
    with pytest.raises(RuntimeError, match=r"torchops\.rotary_embedding_: .*'q' and 'k'"):
        INPLACE(pos, q.flatten(-2), k, cache, False)


# --- CUDA: the vectorised paths at model sizes ----------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_cuda_matches_cpu_at_model_sizes(dtype, interleaved, layout):
    args = rotary_inputs(2, 8, 2, 67, 128, 128, "cuda", dtype, layout=layout,
                         interleaved=interleaved, requires_grad=True)
    cpu = [a.detach().cpu().requires_grad_() if isinstance(a, torch.Tensor) else a
           for a in args]
    outs = OP(*args)
    outs_cpu = OP(*cpu)
    for o, c in zip(outs, outs_cpu):
        torch.testing.assert_close(o.cpu(), c)
    ups = [torch.randn_like(o) for o in outs]
    g = torch.autograd.grad(outs, args[:4], ups)
    gc = torch.autograd.grad(outs_cpu, cpu[:4], [u.cpu() for u in ups])
    for a, b in zip(g, gc):
        torch.testing.assert_close(a.cpu(), b, atol=1e-2, rtol=1e-2)


@pytest.mark.cuda
def test_cuda_backward_is_deterministic():
    args = rotary_inputs(4, 16, 4, 129, 128, 128, "cuda", torch.bfloat16, cos_batch=0)
    gq, gk = torch.randn_like(args[0]), torch.randn_like(args[1])
    first = BACKWARD(gq, gk, *args[:4], 1, False, True)
    for _ in range(3):
        again = BACKWARD(gq, gk, *args[:4], 1, False, True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("interleaved", [False, True])
def test_cuda_inplace_matches_cpu_fused_qkv(interleaved):
    pos, q, k, cache, _ = rotary_cache_inputs((3, 97), 8, 2, 128, 64, 4096, "cuda",
                                              torch.bfloat16, interleaved=interleaved,
                                              qk_order="fused")
    qc, kc = q.cpu(), k.cpu()
    INPLACE(pos, q, k, cache, interleaved)
    INPLACE(pos.cpu(), qc, kc, cache.cpu(), interleaved)
    torch.testing.assert_close(q.cpu(), qc)
    torch.testing.assert_close(k.cpu(), kc)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("hq,hk,rd", [(3, 1, 128), (1, 3, 64), (33, 3, 64), (5, 0, 128)])
def test_cuda_16_byte_forward_odd_heads_and_partial_rotary(dtype, interleaved, layout,
                                                           hq, hk, rd):
    # Head counts not divisible by the heads a thread takes per step, GQA
    # either way round, no k heads, and a pass-through tail (rd < D): the
    # 16-byte forward against the CPU, and bit for bit against the
    # element-wise path (a misaligned slice of the same values): bit for bit in
    # the half types; float32 to its rounding (the two kernels' multiply-adds
    # contract into FMAs differently).
    args = rotary_inputs(2, hq, hk, 37, 128, rd, "cuda", dtype, layout=layout,
                         interleaved=interleaved)
    outs = OP(*args)
    outs_cpu = OP(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
    for o, c in zip(outs, outs_cpu):
        torch.testing.assert_close(o.cpu(), c)

    def misaligned(x):
        wide = torch.empty((*x.shape[:3], x.shape[3] + 1), device=x.device, dtype=x.dtype)
        wide[..., 1:] = x
        return wide[..., 1:]

    slow = OP(misaligned(args[0]), misaligned(args[1]), *args[2:])
    for o, s in zip(outs, slow):
        if dtype == torch.float32:
            torch.testing.assert_close(o, s, atol=1e-6, rtol=1e-6)
        else:
            assert torch.equal(o, s)
