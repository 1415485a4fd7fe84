"""torchops.modules: each module calls its op with the hyper-parameters it
holds, is documented, and compiles.  Values of the ops themselves are the op
database's business; here the module must equal the functional call."""

from __future__ import annotations

import pytest
import torch

import torchops
from torchops import modules

from opdb import random_mask, random_rois
from opdb import random_rois
from torchops import references


def test_every_module_is_public_and_documented():
    for name in modules.__all__:
        cls = getattr(torchops, name)
        assert issubclass(cls, torch.nn.Module), name
        assert cls.__doc__ and len(cls.__doc__) > 40, f"{name} needs a docstring"


@pytest.mark.parametrize("aligned", [False, True])
def test_roi_align_module_equals_op(aligned):
    x = torch.randn(2, 3, 12, 10)
    rois = random_rois(2, 7, 12, 10, 0.5, torch.float32, "cpu", seed=1)
    m = torchops.RoIAlign((3, 4), 0.5, 2, aligned=aligned)
    expect = torchops.roi_align(x, rois, (3, 4), 0.5, 2, aligned)
    torch.testing.assert_close(m(x, rois), expect, rtol=0, atol=0)
    assert "aligned" in repr(m)


def test_roi_pool_module_equals_op_and_compiles():
    x = torch.randn(2, 3, 12, 10)
    rois = random_rois(2, 5, 12, 10, 1.0, torch.float32, "cpu", seed=2)
    m = torchops.RoIPool(2, 1.0)
    expect = torchops.roi_pool(x, rois, 2, 1.0)
    torch.testing.assert_close(m(x, rois), expect, rtol=0, atol=0)
    torch.testing.assert_close(torch.compile(m, fullgraph=True)(x, rois), expect, rtol=0, atol=0)


# --- deformable convolution and RoI pooling ------------------------------------------

def _offset(shape, scale=1.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g) * 2 - 1) * scale


def test_deform_conv2d_module_equals_op_and_inits_as_torchvision():
    torch.manual_seed(3)
    m = torchops.DeformConv2d(4, 6, (3, 2), stride=(2, 1), padding=1, dilation=(1, 2), groups=2)
    torch.manual_seed(3)
    conv = torch.nn.Conv2d(4, 6, (3, 2), stride=(2, 1), padding=1, dilation=(1, 2), groups=2)
    # torchvision's DeformConv2d initialises exactly as nn.Conv2d does.
    assert torch.equal(m.weight, conv.weight) and torch.equal(m.bias, conv.bias)
    x = torch.randn(2, 4, 7, 8)
    oh, ow = 4, 8
    offset = _offset((2, 2 * 3 * 2, oh, ow))
    mask = torch.rand(2, 3 * 2, oh, ow)
    for msk in (None, mask):
        expect = torchops.deform_conv2d(x, offset, m.weight, m.bias, (2, 1), 1, (1, 2), msk)
        torch.testing.assert_close(m(x, offset, msk), expect, rtol=0, atol=0)
    # Zero offsets: a plain convolution.
    torch.testing.assert_close(m(x, torch.zeros_like(offset)), conv(x), rtol=1e-5, atol=1e-5)
    assert torchops.DeformConv2d(2, 2, 1, bias=False).bias is None
    with pytest.raises(ValueError, match="'in_channels'"):
        torchops.DeformConv2d(3, 4, 3, groups=2)
    assert "groups=2" in repr(m)


def test_modulated_deform_conv2d_pack():
    torch.manual_seed(0)
    m = torchops.ModulatedDeformConv2dPack(4, 6, 3, padding=1, groups=2, deform_groups=2)
    assert m.conv_offset.out_channels == 3 * 2 * 9
    assert not m.conv_offset.weight.any() and not m.bias.any()
    bound = 1 / (4 * 9) ** 0.5
    assert m.weight.abs().max() <= bound
    x = torch.randn(2, 4, 6, 5)
    # At initialisation: zero offsets, mask sigmoid(0) = 1/2.
    with torch.no_grad():
        m.bias.uniform_(-1, 1)
    plain = torch.nn.functional.conv2d(x, m.weight, None, 1, 1, 1, 2)
    torch.testing.assert_close(m(x), 0.5 * plain + m.bias[:, None, None], rtol=1e-5, atol=1e-5)
    # Trained offsets: the module is mmcv's composition of the functional op.
    with torch.no_grad():
        m.conv_offset.weight.normal_(0, 0.3)
        m.conv_offset.bias.normal_(0, 0.3)
    out = m.conv_offset(x)
    n = out.shape[1] // 3
    expect = torchops.deform_conv2d(x, out[:, :2 * n], m.weight, m.bias, 1, 1, 1,
                                    torch.sigmoid(out[:, 2 * n:]))
    torch.testing.assert_close(m(x), expect, rtol=0, atol=0)
    m(x).sum().backward()
    assert m.conv_offset.weight.grad.abs().sum() > 0


def _roi_problem(seed=4):
    x = torch.randn(2, 4, 12, 10)
    rois = random_rois(2, 6, 12, 10, 0.5, torch.float32, "cpu", seed=seed)
    return x, rois


def test_deform_roi_pool_module_equals_op():
    x, rois = _roi_problem()
    m = torchops.DeformRoIPool((3, 2), 0.5, 2, gamma=0.2)
    offset = _offset((6, 2, 3, 2), 0.5)
    for off in (None, offset):
        expect = torchops.deform_roi_pool(x, rois, off, (3, 2), 0.5, 2, 0.2)
        torch.testing.assert_close(m(x, rois, off), expect, rtol=0, atol=0)
    assert "gamma=0.2" in repr(m)


@pytest.mark.parametrize("modulated", [False, True])
def test_deform_roi_pool_packs(modulated):
    torch.manual_seed(1)
    cls = torchops.ModulatedDeformRoIPoolPack if modulated else torchops.DeformRoIPoolPack
    m = cls(3, 4, deform_fc_channels=8, spatial_scale=0.5, sampling_ratio=2)
    x, rois = _roi_problem()
    # At initialisation: roi_align with aligned=True (times sigmoid(0) = 1/2).
    aligned = torchops.roi_align(x, rois, 3, 0.5, 2, aligned=True)
    torch.testing.assert_close(m(x, rois), aligned * (0.5 if modulated else 1.0),
                               rtol=1e-6, atol=1e-6)
    # Trained heads: mmcv's composition of the functional op.
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    plain = torchops.deform_roi_pool(x, rois, None, 3, 0.5, 2).flatten(1)
    offset = m.offset_fc(plain).view(-1, 2, 3, 3)
    expect = torchops.deform_roi_pool(x, rois, offset, 3, 0.5, 2)
    if modulated:
        expect = expect * m.mask_fc(plain).view(-1, 1, 3, 3)
    torch.testing.assert_close(m(x, rois), expect, rtol=0, atol=0)
    # Per-image box lists work as for roi_align.
    per_image = [rois[rois[:, 0] == i, 1:] for i in range(2)]
    order = torch.cat([torch.nonzero(rois[:, 0] == i).flatten() for i in range(2)])
    torch.testing.assert_close(m(x, per_image), expect[order], rtol=1e-6, atol=1e-6)
    m(x, rois).sum().backward()
    assert m.offset_fc[0].weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="output_channels"):
        m(x[:, :3], rois)


def test_deform_modules_compile_fullgraph():
    torch._dynamo.reset()
    torch.manual_seed(2)
    x, rois = _roi_problem()
    offset = _offset((2, 18, 6, 5), 0.8)
    calls = [
        (torchops.DeformConv2d(4, 3, 3, stride=2, padding=1), (x, offset)),
        (torchops.ModulatedDeformConv2dPack(4, 3, 3, padding=1), (x,)),
        (torchops.DeformRoIPool(3, 0.5, 0), (x, rois, _offset((6, 2, 3, 3)))),
        (torchops.DeformRoIPoolPack(3, 4, 8, 0.5), (x, rois)),
        (torchops.ModulatedDeformRoIPoolPack(3, 4, 8, 0.5), (x, rois)),
    ]
    for m, args in calls:
        with torch.no_grad():
            for p in m.parameters():  # nonzero heads: every op does work
                p.add_(torch.randn_like(p) * 0.1)
        expect = m(*args)
        got = torch.compile(m, fullgraph=True)(*args)
        torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
# --- MaskedConv2d ------------------------------------------------------------------------------

def test_masked_conv2d_module_equals_op_and_conv2d_without_mask():
    torch.manual_seed(0)
    m = torchops.MaskedConv2d(4, 6, 3, stride=(2, 1), padding=1, dilation=(1, 2), groups=2)
    assert isinstance(m, torch.nn.Conv2d)
    x = torch.randn(2, 4, 9, 10)
    plain = m(x)
    torch.testing.assert_close(plain, torch.nn.functional.conv2d(
        x, m.weight, m.bias, m.stride, m.padding, m.dilation, m.groups), rtol=0, atol=0)
    mask = random_mask((2, *plain.shape[2:]), "cpu", seed=3)
    expect = torchops.masked_conv2d(x, mask, m.weight, m.bias, 1, (2, 1), (1, 2), 2)
    torch.testing.assert_close(m(x, mask), expect, rtol=0, atol=0)
    torch.testing.assert_close(m(x, mask), torch.where(mask[:, None], plain, 0.0))
    torch.testing.assert_close(torch.compile(m, fullgraph=True)(x, mask), expect)


def test_masked_conv2d_module_string_padding():
    torch.manual_seed(1)
    x = torch.randn(1, 3, 7, 8)
    mask = torch.ones(1, 7, 8, dtype=torch.bool)
    same = torchops.MaskedConv2d(3, 2, (3, 5), padding="same", bias=False)
    torch.testing.assert_close(same(x, mask), same(x))
    valid = torchops.MaskedConv2d(3, 2, 3, padding="valid")
    torch.testing.assert_close(valid(x, torch.ones(1, 5, 6, dtype=torch.bool)), valid(x))
    with pytest.raises(ValueError, match=r"MaskedConv2d.*'same'"):
        torchops.MaskedConv2d(3, 2, 2, padding="same")(x, mask)
    with pytest.raises(ValueError, match=r"MaskedConv2d.*padding_mode"):
        torchops.MaskedConv2d(3, 2, 3, padding=1, padding_mode="reflect")(x, mask)
# --- CARAFEPack ---------------------------------------------------------------


def _carafe_pack_by_hand(m: torchops.CARAFEPack, x: torch.Tensor) -> torch.Tensor:
    """mmcv's CARAFEPack.forward written out, with the reference carafe."""
    mask = m.content_encoder(m.channel_compressor(x))
    mask = torch.nn.functional.pixel_shuffle(mask, m.scale_factor)
    n, mc, h, w = mask.shape
    k2 = m.up_kernel**2
    mask = torch.softmax(mask.view(n, mc // k2, k2, h, w), dim=2).view(n, mc, h, w)
    return references.carafe(x, mask, m.up_kernel, m.up_group, m.scale_factor)


@pytest.mark.parametrize("up_kernel,up_group,scale,dilation", [(5, 1, 2, 1), (3, 2, 3, 2)])
def test_carafe_pack_equals_its_formula(up_kernel, up_group, scale, dilation):
    torch.manual_seed(0)
    m = torchops.CARAFEPack(4, scale, up_kernel=up_kernel, up_group=up_group,
                            encoder_dilation=dilation, compressed_channels=8).double()
    # Weights larger than the near-uniform initial ones, so the kernels differ per pixel.
    torch.nn.init.normal_(m.content_encoder.weight, 0.0, 0.3)
    x = torch.randn(2, 4, 5, 6, dtype=torch.float64, requires_grad=True)
    out = m(x)
    assert out.shape == (2, 4, 5 * scale, 6 * scale)
    expect = _carafe_pack_by_hand(m, x)
    torch.testing.assert_close(out, expect)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *m.parameters()], g)
    want = torch.autograd.grad(expect, [x, *m.parameters()], g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert "up_kernel" in repr(m)


def test_carafe_pack_parameters_init_and_compile():
    torch.manual_seed(0)
    m = torchops.CARAFEPack(16, 2)  # mmcv's defaults: k 5, one group, 64 compressed channels
    assert m.channel_compressor.weight.shape == (64, 16, 1, 1)
    assert m.content_encoder.weight.shape == (5 * 5 * 1 * 2 * 2, 64, 3, 3)
    assert m.content_encoder.weight.std() < 0.002
    assert not m.content_encoder.bias.any() and not m.channel_compressor.bias.any()
    x = torch.randn(1, 16, 6, 7)
    mask = m.kernel_normalizer(m.content_encoder(m.channel_compressor(x)))
    torch.testing.assert_close(mask.view(1, 1, 25, 12, 14).sum(2), torch.ones(1, 1, 12, 14))
    expect = m(x)
    torch.testing.assert_close(torch.compile(m, fullgraph=True)(x), expect)


# --- norms ----------------------------------------------------------------------


@pytest.mark.parametrize("affine", [True, False])
def test_rms_norm_module_equals_op_and_loads_torch_state(affine):
    ref = torch.nn.RMSNorm((3, 8), eps=1e-6, elementwise_affine=affine)
    if affine:
        torch.nn.init.uniform_(ref.weight, 0.5, 1.5)
    m = torchops.RMSNorm((3, 8), eps=1e-6, elementwise_affine=affine)
    m.load_state_dict(ref.state_dict())
    assert m.state_dict().keys() == ref.state_dict().keys()
    x = torch.randn(4, 3, 8)
    torch.testing.assert_close(m(x), torchops.rms_norm(x, (3, 8), m.weight, 1e-6), rtol=0, atol=0)
    torch.testing.assert_close(m(x), ref(x))
    back = torch.nn.RMSNorm((3, 8), eps=1e-6, elementwise_affine=affine)
    back.load_state_dict(m.state_dict())
    torch.testing.assert_close(back(x), m(x))


@pytest.mark.parametrize("affine,bias", [(True, True), (True, False), (False, False)])
def test_layer_norm_module_equals_op_and_loads_torch_state(affine, bias):
    ref = torch.nn.LayerNorm(8, elementwise_affine=affine, bias=bias)
    for p in ref.parameters():
        torch.nn.init.uniform_(p, 0.5, 1.5)
    m = torchops.LayerNorm(8, elementwise_affine=affine, bias=bias)
    m.load_state_dict(ref.state_dict())
    assert m.state_dict().keys() == ref.state_dict().keys()
    x = torch.randn(5, 8, requires_grad=True)
    torch.testing.assert_close(m(x), torchops.layer_norm(x, (8,), m.weight, m.bias, 1e-5),
                               rtol=0, atol=0)
    torch.testing.assert_close(m(x), ref(x))
    m(x).sum().backward()
    back = torch.nn.LayerNorm(8, elementwise_affine=affine, bias=bias)
    back.load_state_dict(m.state_dict())
    torch.testing.assert_close(back(x), m(x))


def test_norm_modules_take_half_inputs_with_float32_weights_and_compile():
    m = torchops.RMSNorm(16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    assert m(x).dtype == torch.bfloat16
    ln = torchops.LayerNorm(16)
    compiled = torch.compile(ln, fullgraph=True)
    torch.testing.assert_close(compiled(x), ln(x))


# --- losses: fused linear cross-entropy ---------------------------------------------


def test_fused_linear_cross_entropy_loss_module_takes_ligers_call_and_compiles():
    """Liger's constructor and call order (weight first); equal to the op,
    gradients included, eagerly and compiled."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8, requires_grad=True)
    w = torch.randn(11, 8, requires_grad=True)
    b = torch.randn(11, requires_grad=True)
    t = torch.randint(0, 11, (2, 5))
    t[0, 2] = 3
    loss_fn = torchops.FusedLinearCrossEntropyLoss(ignore_index=3, lse_square_scale=1e-2,
                                                   label_smoothing=0.1, reduction="sum",
                                                   softcap=5.0)
    assert "softcap=5.0" in repr(loss_fn) and not list(loss_fn.parameters())
    want = torchops.fused_linear_cross_entropy(x, w, t, b, ignore_index=3, label_smoothing=0.1,
                                               reduction="sum", lse_square_scale=1e-2,
                                               softcap=5.0)
    want_grads = torch.autograd.grad(want, (x, w, b))
    for fn in (loss_fn, torch.compile(loss_fn, backend="aot_eager", fullgraph=True)):
        got = fn(w, x, t, b)
        torch.testing.assert_close(got, want)
        for g, wg in zip(torch.autograd.grad(got, (x, w, b)), want_grads):
            torch.testing.assert_close(g, wg)
    assert torchops.FusedLinearCrossEntropyLoss()(w, x, t).shape == ()
    with pytest.raises(ValueError, match=r"FusedLinearCrossEntropyLoss.*'reduction'"):
        torchops.FusedLinearCrossEntropyLoss(reduction="avg")


# --- detection: multi-scale deformable attention ---------------------------------------------


def _msda_module_inputs(b=2, q=5, levels=((6, 8), (3, 4)), dims=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = torch.tensor(levels)
    starts = torch.cat([shapes.new_zeros(1), (shapes[:, 0] * shapes[:, 1]).cumsum(0)[:-1]])
    s = int((shapes[:, 0] * shapes[:, 1]).sum())
    query = torch.randn(b, q, dims, generator=g)
    value = torch.randn(b, s, dims, generator=g)
    ref = torch.rand(b, q, len(levels), 2, generator=g)
    return query, value, ref, shapes, starts


def _msda_by_hand(mod, query, value, ref, shapes, starts):
    """mmcv's forward, batch first, with grid_sample's formulation."""
    b, q, _ = query.shape
    v = mod.value_proj(value).view(b, value.shape[1], mod.num_heads, -1)
    off = mod.sampling_offsets(query).view(b, q, mod.num_heads, mod.num_levels, mod.num_points, 2)
    w = mod.attention_weights(query).view(b, q, mod.num_heads, -1).softmax(-1)
    w = w.view(b, q, mod.num_heads, mod.num_levels, mod.num_points)
    if ref.shape[-1] == 2:
        norm = torch.stack([shapes[:, 1], shapes[:, 0]], -1)
        loc = ref[:, :, None, :, None, :] + off / norm[None, None, None, :, None, :]
    else:
        loc = (ref[:, :, None, :, None, :2]
               + off / mod.num_points * ref[:, :, None, :, None, 2:] * 0.5)
    out = references.ms_deform_attn_grid_sample(v, shapes, starts, loc, w)
    return mod.output_proj(out) + query


def test_multi_scale_deformable_attention_initialisation_is_mmcvs():
    mod = torchops.MultiScaleDeformableAttention(embed_dims=64, num_heads=4, num_levels=3,
                                                 num_points=2)
    assert mod.sampling_offsets.weight.abs().max() == 0
    bias = mod.sampling_offsets.bias.view(4, 3, 2, 2)
    # Head i points along angle 2 pi i / 4, its larger coordinate 1; point p at p + 1.
    want = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]])
    for p in range(2):
        for lvl in range(3):
            torch.testing.assert_close(bias[:, lvl, p], want * (p + 1), atol=1e-6, rtol=0)
    for lin in (mod.attention_weights,):
        assert lin.weight.abs().max() == 0 and lin.bias.abs().max() == 0
    for lin in (mod.value_proj, mod.output_proj):
        bound = (6.0 / (lin.in_features + lin.out_features)) ** 0.5
        assert lin.bias.abs().max() == 0 and 0 < lin.weight.abs().max() <= bound
    assert [n for n, _ in mod.named_parameters()] == [
        "sampling_offsets.weight", "sampling_offsets.bias", "attention_weights.weight",
        "attention_weights.bias", "value_proj.weight", "value_proj.bias", "output_proj.weight",
        "output_proj.bias"]
    with pytest.raises(ValueError, match=r"MultiScaleDeformableAttention.*'embed_dims'"):
        torchops.MultiScaleDeformableAttention(embed_dims=30, num_heads=4)


@pytest.mark.parametrize("box_refs", [False, True])
def test_multi_scale_deformable_attention_equals_mmcvs_formula(box_refs):
    torch.manual_seed(0)
    mod = torchops.MultiScaleDeformableAttention(32, num_heads=4, num_levels=2, num_points=3,
                                                 dropout=0.0, batch_first=True)
    for p in mod.parameters():  # away from the initialisation's zeros
        torch.nn.init.normal_(p, std=0.3)
    query, value, ref, shapes, starts = _msda_module_inputs()
    if box_refs:
        ref = torch.cat([ref, torch.rand(ref.shape) * 0.5], -1)
    query.requires_grad_()
    got = mod(query, value=value, reference_points=ref, spatial_shapes=shapes,
              level_start_index=starts)
    want = _msda_by_hand(mod, query, value, ref, shapes, starts)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    g1 = torch.autograd.grad(got.sum(), [query, *mod.parameters()])
    g2 = torch.autograd.grad(want.sum(), [query, *mod.parameters()])
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # Sequence-first (mmcv's default) is the same attention on transposed inputs.
    mod.batch_first = False
    seq = mod(query.transpose(0, 1), value=value.transpose(0, 1), reference_points=ref,
              spatial_shapes=shapes, level_start_index=starts)
    torch.testing.assert_close(seq.transpose(0, 1), got)


def test_multi_scale_deformable_attention_compiles_in_one_graph():
    mod = torchops.MultiScaleDeformableAttention(32, num_heads=4, num_levels=2, num_points=2,
                                                 dropout=0.0, batch_first=True)
    query, value, ref, shapes, starts = _msda_module_inputs(q=4)
    want = mod(query, value=value, reference_points=ref, spatial_shapes=shapes,
               level_start_index=starts)
    compiled = torch.compile(mod, backend="aot_eager", fullgraph=True, dynamic=True)
    got = compiled(query, value=value, reference_points=ref, spatial_shapes=shapes,
                   level_start_index=starts)
    torch.testing.assert_close(got, want)
