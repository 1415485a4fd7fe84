"""``torch.nn.Module`` wrappers of the torchops ops, for users switching from
torchvision (``torchvision.ops.RoIAlign``, ``DeformConv2d``, ...) or mmcv
(``ModulatedDeformConv2dPack``, ``CARAFEPack``, ...).  Each module holds its
hyper-parameters (and, where the op has weights, its parameters) and calls the
public op of the same name in :mod:`torchops.ops`; everything an op supports
(dtypes, devices, autograd, autocast, ``torch.compile``) holds for its module.

One section per family; each adds its names to ``__all__``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.utils import _pair

from torchops import ops

__all__ = ["RoIAlign", "RoIPool"]


# --- constructor checks -------------------------------------------------------
# Each module checks its hyper-parameters when it is built, so that a bad one
# fails there, naming the module and the argument, rather than at the first
# forward (or inside a submodule such as nn.Conv2d).  A size argument may be
# an int or a pair, like the ops'.


def _as_pair(module: str, name: str, value) -> tuple:
    pair = tuple(value) if isinstance(value, (list, tuple)) else (value, value)
    if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool)
                                 for v in pair):
        raise ValueError(f"torchops.{module}: expected '{name}' to be an int or a pair of "
                         f"ints, but got {value!r}")
    return pair


def _check_ints(module: str, low: int, high: int | None = None, **values) -> None:
    """Each value (an int, or a pair of them) within [low, high]."""
    for name, value in values.items():
        for v in _as_pair(module, name, value):
            if v < low or (high is not None and v > high):
                what = {0: "non-negative", 1: "positive"}.get(low, f"at least {low}")
                bound = f" and at most {high}" if high is not None else ""
                raise ValueError(f"torchops.{module}: expected '{name}' to be {what}{bound}, "
                                 f"but got {value!r}")


def _check_divides(module: str, divisor: str, d: int, **dividends) -> None:
    for name, v in dividends.items():
        if v % d != 0:
            raise ValueError(f"torchops.{module}: expected '{divisor}' ({d}) to divide "
                             f"'{name}' ({v})")


def _check_finite(module: str, **values) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"torchops.{module}: expected '{name}' to be a finite number, "
                             f"but got {v!r}")


def _check_conv_module(module: str, in_channels, out_channels, kernel_size, stride, padding,
                       dilation, groups) -> None:
    """The hyper-parameters of a convolution module, as the conv ops bound them."""
    _check_ints(module, 0, in_channels=in_channels, out_channels=out_channels)
    _check_ints(module, 1, kernel_size=kernel_size, groups=groups)
    _check_ints(module, 1, ops.MAX_CONV_ARGUMENT, stride=stride, dilation=dilation)
    _check_ints(module, 0, ops.MAX_CONV_ARGUMENT, padding=padding)
    _check_divides(module, "groups", groups, in_channels=in_channels,
                   out_channels=out_channels)


def _check_roi_module(module: str, output_size, spatial_scale, sampling_ratio) -> None:
    _check_ints(module, 1, output_size=output_size)
    _check_finite(module, spatial_scale=spatial_scale)
    if isinstance(sampling_ratio, bool) or not isinstance(sampling_ratio, int) or \
            sampling_ratio > ops.MAX_SAMPLING_RATIO:
        raise ValueError(f"torchops.{module}: expected 'sampling_ratio' to be an int of at "
                         f"most {ops.MAX_SAMPLING_RATIO} (<= 0: adaptive), but got "
                         f"{sampling_ratio!r}")


# --- RoI pooling --------------------------------------------------------------

class RoIAlign(nn.Module):
    """:func:`torchops.roi_align` as a module, like ``torchvision.ops.RoIAlign``:
    ``RoIAlign(output_size, spatial_scale, sampling_ratio, aligned=False)``,
    called as ``module(input, rois)`` with ``rois`` a ``(K, 5)`` tensor or a
    list of ``(L, 4)`` tensors, one per image."""

    def __init__(self, output_size: int | tuple[int, int], spatial_scale: float,
                 sampling_ratio: int, aligned: bool = False) -> None:
        super().__init__()
        _check_roi_module("RoIAlign", output_size, spatial_scale, sampling_ratio)
        self.output_size = output_size
        self.spatial_scale = spatial_scale
        self.sampling_ratio = sampling_ratio
        self.aligned = aligned

    def forward(self, input: Tensor, rois: Tensor | list[Tensor]) -> Tensor:
        return ops.roi_align(input, rois, self.output_size, self.spatial_scale,
                             self.sampling_ratio, self.aligned)

    def extra_repr(self) -> str:
        return (f"output_size={self.output_size}, spatial_scale={self.spatial_scale}, "
                f"sampling_ratio={self.sampling_ratio}, aligned={self.aligned}")


class RoIPool(nn.Module):
    """:func:`torchops.roi_pool` as a module, like ``torchvision.ops.RoIPool``:
    ``RoIPool(output_size, spatial_scale)``, called as ``module(input, rois)``."""

    def __init__(self, output_size: int | tuple[int, int], spatial_scale: float) -> None:
        super().__init__()
        _check_ints("RoIPool", 1, output_size=output_size)
        _check_finite("RoIPool", spatial_scale=spatial_scale)
        self.output_size = output_size
        self.spatial_scale = spatial_scale

    def forward(self, input: Tensor, rois: Tensor | list[Tensor]) -> Tensor:
        return ops.roi_pool(input, rois, self.output_size, self.spatial_scale)

    def extra_repr(self) -> str:
        return f"output_size={self.output_size}, spatial_scale={self.spatial_scale}"


# --- deformable convolution and RoI pooling ------------------------------------------

__all__ += ["DeformConv2d", "ModulatedDeformConv2dPack", "DeformRoIPool", "DeformRoIPoolPack",
            "ModulatedDeformRoIPoolPack"]


def _init_conv(module: nn.Module, in_channels: int, out_channels: int, kernel_size,
               stride, padding, dilation, groups: int, bias: bool) -> None:
    """The attributes (named as ``nn.Conv2d``'s) and the ``weight`` and ``bias``
    parameters, uninitialised, of the deformable convolution modules."""
    module.in_channels = in_channels
    module.out_channels = out_channels
    module.kernel_size = _pair(kernel_size)
    module.stride = _pair(stride)
    module.padding = _pair(padding)
    module.dilation = _pair(dilation)
    module.groups = groups
    module.weight = nn.Parameter(torch.empty(out_channels, in_channels // groups,
                                             *module.kernel_size))
    if bias:
        module.bias = nn.Parameter(torch.empty(out_channels))
    else:
        module.register_parameter("bias", None)


def _conv_repr(module: nn.Module) -> str:
    return (f"{module.in_channels}, {module.out_channels}, kernel_size={module.kernel_size}, "
            f"stride={module.stride}, padding={module.padding}, dilation={module.dilation}, "
            f"groups={module.groups}")


class DeformConv2d(nn.Module):
    """:func:`torchops.deform_conv2d` as a module, like
    ``torchvision.ops.DeformConv2d``: ``DeformConv2d(in_channels,
    out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
    bias=True)``, called as ``module(input, offset, mask=None)`` with the
    offsets (and DCNv2 modulation mask) computed by the caller.  Parameters
    ``weight`` ``(out, in / groups, kh, kw)`` and ``bias`` are initialised as
    torchvision (and ``nn.Conv2d``) do: Kaiming-uniform with ``a = sqrt(5)``,
    bias uniform in ``+-1 / sqrt(fan_in)``."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int],
                 stride: int | tuple[int, int] = 1, padding: int | tuple[int, int] = 0,
                 dilation: int | tuple[int, int] = 1, groups: int = 1, bias: bool = True) -> None:
        super().__init__()
        _check_conv_module("DeformConv2d", in_channels, out_channels, kernel_size, stride,
                           padding, dilation, groups)
        _init_conv(self, in_channels, out_channels, kernel_size, stride, padding, dilation,
                   groups, bias)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in, _ = nn.init._calculate_fan_in_and_fan_out(self.weight)
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, input: Tensor, offset: Tensor, mask: Tensor | None = None) -> Tensor:
        return ops.deform_conv2d(input, offset, self.weight, self.bias, stride=self.stride,
                                 padding=self.padding, dilation=self.dilation, mask=mask)

    def extra_repr(self) -> str:
        return f"{_conv_repr(self)}, bias={self.bias is not None}"


class ModulatedDeformConv2dPack(nn.Module):
    """DCNv2 that acts as a plain convolution, like mmcv's
    ``ModulatedDeformConv2dPack``: ``(in_channels, out_channels, kernel_size,
    stride=1, padding=0, dilation=1, groups=1, deform_groups=1, bias=True)``,
    called as ``module(x)``.  A convolution ``conv_offset`` (same kernel,
    stride, padding and dilation) predicts ``3 * deform_groups * kh * kw``
    channels from ``x``: split in three, the first two thirds are the
    offsets and the last, through a sigmoid, the mask of
    :func:`torchops.deform_conv2d`.  As in mmcv, ``conv_offset`` starts at
    zero (so at initialisation the module is ``0.5 * conv(x) + bias``),
    ``weight`` is uniform in ``+-1 / sqrt(in_channels * kh * kw)`` and
    ``bias`` zero."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int],
                 stride: int | tuple[int, int] = 1, padding: int | tuple[int, int] = 0,
                 dilation: int | tuple[int, int] = 1, groups: int = 1, deform_groups: int = 1,
                 bias: bool = True) -> None:
        super().__init__()
        name = "ModulatedDeformConv2dPack"
        _check_conv_module(name, in_channels, out_channels, kernel_size, stride, padding,
                           dilation, groups)
        _check_ints(name, 1, deform_groups=deform_groups)
        _check_divides(name, "deform_groups", deform_groups, in_channels=in_channels)
        _init_conv(self, in_channels, out_channels, kernel_size, stride, padding, dilation,
                   groups, bias)
        self.deform_groups = deform_groups
        self.conv_offset = nn.Conv2d(
            in_channels, deform_groups * 3 * self.kernel_size[0] * self.kernel_size[1],
            kernel_size=self.kernel_size, stride=self.stride, padding=self.padding,
            dilation=self.dilation, bias=True)
        self.init_weights()

    def init_weights(self) -> None:
        n = self.in_channels * self.kernel_size[0] * self.kernel_size[1]
        stdv = 1.0 / math.sqrt(n) if n > 0 else 0.0
        with torch.no_grad():
            self.weight.uniform_(-stdv, stdv)
            if self.bias is not None:
                self.bias.zero_()
            self.conv_offset.weight.zero_()
            self.conv_offset.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        o1, o2, mask = torch.chunk(self.conv_offset(x), 3, dim=1)
        offset = torch.cat((o1, o2), dim=1)
        return ops.deform_conv2d(x, offset, self.weight, self.bias, stride=self.stride,
                                 padding=self.padding, dilation=self.dilation,
                                 mask=torch.sigmoid(mask))

    def extra_repr(self) -> str:
        return (f"{_conv_repr(self)}, deform_groups={self.deform_groups}, "
                f"bias={self.bias is not None}")


class DeformRoIPool(nn.Module):
    """:func:`torchops.deform_roi_pool` as a module, like mmcv's
    ``DeformRoIPool``: ``DeformRoIPool(output_size, spatial_scale=1.0,
    sampling_ratio=0, gamma=0.1)``, called as ``module(input, rois,
    offset=None)``."""

    def __init__(self, output_size: int | tuple[int, int], spatial_scale: float = 1.0,
                 sampling_ratio: int = 0, gamma: float = 0.1) -> None:
        super().__init__()
        _check_roi_module(type(self).__name__, output_size, spatial_scale, sampling_ratio)
        _check_finite(type(self).__name__, gamma=gamma)
        self.output_size = _pair(output_size)
        self.spatial_scale = float(spatial_scale)
        self.sampling_ratio = int(sampling_ratio)
        self.gamma = float(gamma)

    def _pool(self, input: Tensor, rois: Tensor | list[Tensor],
              offset: Tensor | None) -> Tensor:
        return ops.deform_roi_pool(input, rois, offset, self.output_size, self.spatial_scale,
                                   self.sampling_ratio, self.gamma)

    def forward(self, input: Tensor, rois: Tensor | list[Tensor],
                offset: Tensor | None = None) -> Tensor:
        return self._pool(input, rois, offset)

    def extra_repr(self) -> str:
        return (f"output_size={self.output_size}, spatial_scale={self.spatial_scale}, "
                f"sampling_ratio={self.sampling_ratio}, gamma={self.gamma}")


def _fc_head(in_features: int, hidden: int, out_features: int, layers: int) -> nn.Sequential:
    """mmcv's heads: `layers` Linear layers with ReLUs between them."""
    mods: list[nn.Module] = []
    for i in range(layers):
        mods.append(nn.Linear(in_features if i == 0 else hidden,
                              out_features if i == layers - 1 else hidden))
        if i < layers - 1:
            mods.append(nn.ReLU(inplace=True))
    return nn.Sequential(*mods)


class DeformRoIPoolPack(DeformRoIPool):
    """Deformable RoI pooling that predicts its own offsets, like mmcv's
    ``DeformRoIPoolPack``: ``(output_size, output_channels,
    deform_fc_channels=1024, spatial_scale=1.0, sampling_ratio=0,
    gamma=0.1)``, called as ``module(input, rois)`` with ``input``'s channels
    ``output_channels``.  The RoIs are first pooled without offsets; a head
    ``offset_fc`` (three Linear layers, ``ph * pw * C -> fc -> fc -> ph * pw
    * 2``, ReLUs between) maps each RoI's pooled features to its offsets,
    with which the RoIs are pooled again.  The last layer starts at zero (as
    in mmcv), so at initialisation the module is ``roi_align`` with
    ``aligned=True``."""

    def __init__(self, output_size: int | tuple[int, int], output_channels: int,
                 deform_fc_channels: int = 1024, spatial_scale: float = 1.0,
                 sampling_ratio: int = 0, gamma: float = 0.1) -> None:
        super().__init__(output_size, spatial_scale, sampling_ratio, gamma)
        _check_ints(type(self).__name__, 1, output_channels=output_channels,
                    deform_fc_channels=deform_fc_channels)
        self.output_channels = output_channels
        self.deform_fc_channels = deform_fc_channels
        bins = self.output_size[0] * self.output_size[1]
        self.offset_fc = _fc_head(bins * output_channels, deform_fc_channels, bins * 2, 3)
        with torch.no_grad():
            self.offset_fc[-1].weight.zero_()
            self.offset_fc[-1].bias.zero_()

    def _check_channels(self, input: Tensor) -> None:
        if input.shape[1] != self.output_channels:
            raise ValueError(f"torchops.{type(self).__name__}: expected 'input' to have "
                             f"output_channels = {self.output_channels} channels")

    def forward(self, input: Tensor, rois: Tensor | list[Tensor]) -> Tensor:  # type: ignore[override]
        self._check_channels(input)
        rows = ops._roi_rows("deform_roi_pool", rois, "rois")
        x = self._pool(input, rows, None).flatten(1)
        offset = self.offset_fc(x).view(-1, 2, *self.output_size)
        return self._pool(input, rows, offset)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, output_channels={self.output_channels}, "
                f"deform_fc_channels={self.deform_fc_channels}")


class ModulatedDeformRoIPoolPack(DeformRoIPoolPack):
    """:class:`DeformRoIPoolPack` with a modulation mask, like mmcv's
    ``ModulatedDeformRoIPoolPack`` (same arguments): a second head
    ``mask_fc`` (``ph * pw * C -> fc -> ph * pw``, then a sigmoid) scales
    each bin of the deformed pooling.  Its last Linear layer starts at zero
    (as in mmcv), so at initialisation the module is ``0.5 * roi_align``
    with ``aligned=True``."""

    def __init__(self, output_size: int | tuple[int, int], output_channels: int,
                 deform_fc_channels: int = 1024, spatial_scale: float = 1.0,
                 sampling_ratio: int = 0, gamma: float = 0.1) -> None:
        super().__init__(output_size, output_channels, deform_fc_channels, spatial_scale,
                         sampling_ratio, gamma)
        bins = self.output_size[0] * self.output_size[1]
        self.mask_fc = nn.Sequential(*_fc_head(bins * output_channels, deform_fc_channels,
                                               bins, 2), nn.Sigmoid())
        with torch.no_grad():
            self.mask_fc[2].weight.zero_()
            self.mask_fc[2].bias.zero_()

    def forward(self, input: Tensor, rois: Tensor | list[Tensor]) -> Tensor:  # type: ignore[override]
        self._check_channels(input)
        rows = ops._roi_rows("deform_roi_pool", rois, "rois")
        x = self._pool(input, rows, None).flatten(1)
        offset = self.offset_fc(x).view(-1, 2, *self.output_size)
        mask = self.mask_fc(x).view(-1, 1, *self.output_size)
        return self._pool(input, rows, offset) * mask
# --- convolution: masked ------------------------------------------------------

__all__ += ["MaskedConv2d"]


class MaskedConv2d(nn.Conv2d):
    """:func:`torchops.masked_conv2d` as a module, like mmcv's ``MaskedConv2d``:
    an ``nn.Conv2d`` (same constructor, parameters and ``state_dict``) whose
    ``forward(input, mask=None)`` computes the convolution only where
    ``mask > 0`` (``(N or 1, H_out, W_out)``, bool or floating) and returns 0
    elsewhere; with ``mask=None`` it is the plain ``nn.Conv2d``.  The masked
    path needs ``padding_mode="zeros"``; ``padding="same"`` works where the
    padding comes out symmetric (odd dilated kernels)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1,
                 padding=0, dilation=1, groups: int = 1, bias: bool = True,
                 padding_mode: str = "zeros", device=None, dtype=None) -> None:
        # nn.Conv2d checks groups and padding_mode; the masked op also needs
        # a non-negative padding and a positive stride and dilation.
        _check_conv_module("MaskedConv2d", in_channels, out_channels, kernel_size, stride,
                           0 if isinstance(padding, str) else padding, dilation, groups)
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, bias, padding_mode, device, dtype)

    def _masked_padding(self) -> tuple[int, int]:
        if self.padding_mode != "zeros":
            raise ValueError(f"torchops.MaskedConv2d: the masked path pads with zeros only, "
                             f"got padding_mode={self.padding_mode!r}")
        if self.padding == "valid":
            return (0, 0)
        if self.padding == "same":
            total = [d * (k - 1) for d, k in zip(self.dilation, self.kernel_size)]
            if any(t % 2 for t in total):
                raise ValueError("torchops.MaskedConv2d: padding='same' with an even dilated "
                                 f"kernel {tuple(self.kernel_size)} pads asymmetrically, which "
                                 "the masked path does not support")
            return (total[0] // 2, total[1] // 2)
        return tuple(self.padding)

    def forward(self, input: Tensor, mask: Tensor | None = None) -> Tensor:
        if mask is None:
            return super().forward(input)
        return ops.masked_conv2d(input, mask, self.weight, self.bias, self._masked_padding(),
                                 self.stride, self.dilation, self.groups)
# --- upsampling ---------------------------------------------------------------

__all__ += ["CARAFEPack"]


class CARAFEPack(nn.Module):
    """The CARAFE upsampler of mmcv (``mmcv.ops.CARAFEPack``), on
    :func:`torchops.carafe`: same arguments, parameters and initialisation.

    ``CARAFEPack(channels, scale_factor, up_kernel=5, up_group=1,
    encoder_kernel=3, encoder_dilation=1, compressed_channels=64)`` maps
    ``(N, channels, H, W)`` to ``(N, channels, H * scale_factor, W *
    scale_factor)``:

    1. a channel compressor, a 1x1 convolution to ``compressed_channels``;
    2. a content encoder, an ``encoder_kernel`` convolution (dilation
       ``encoder_dilation``, same padding) predicting ``up_kernel**2 *
       up_group`` kernel weights for each of the ``scale_factor**2`` output
       pixels of every input pixel;
    3. a kernel normaliser: pixel shuffle to the output resolution, then a
       softmax over each group's ``up_kernel**2`` weights;
    4. :func:`torchops.carafe` reassembles the input with those kernels.

    Weights are initialised as mmcv does: Xavier-uniform convolutions with
    zero bias, the content encoder's weights then drawn from N(0, 0.001^2)
    (so an untrained module starts close to nearest-neighbour averaging).
    """

    def __init__(self, channels: int, scale_factor: int, up_kernel: int = 5,
                 up_group: int = 1, encoder_kernel: int = 3, encoder_dilation: int = 1,
                 compressed_channels: int = 64) -> None:
        super().__init__()
        name = "CARAFEPack"
        _check_ints(name, 1, channels=channels, scale_factor=scale_factor, up_group=up_group,
                    encoder_dilation=encoder_dilation,
                    compressed_channels=compressed_channels)
        for arg, k in (("up_kernel", up_kernel), ("encoder_kernel", encoder_kernel)):
            _check_ints(name, 1, **{arg: k})
            if k % 2 == 0:
                # carafe needs an odd kernel; the encoder's "same" padding too.
                raise ValueError(f"torchops.{name}: expected '{arg}' to be odd, but got {k}")
        _check_divides(name, "up_group", up_group, channels=channels)
        self.channels = channels
        self.scale_factor = scale_factor
        self.up_kernel = up_kernel
        self.up_group = up_group
        self.encoder_kernel = encoder_kernel
        self.encoder_dilation = encoder_dilation
        self.compressed_channels = compressed_channels
        self.channel_compressor = nn.Conv2d(channels, compressed_channels, 1)
        self.content_encoder = nn.Conv2d(
            compressed_channels, up_kernel * up_kernel * up_group * scale_factor * scale_factor,
            encoder_kernel, padding=int((encoder_kernel - 1) * encoder_dilation / 2),
            dilation=encoder_dilation)
        self.init_weights()

    def init_weights(self) -> None:
        for m in (self.channel_compressor, self.content_encoder):
            nn.init.xavier_uniform_(m.weight)
            nn.init.zeros_(m.bias)
        nn.init.normal_(self.content_encoder.weight, 0.0, 0.001)
        nn.init.zeros_(self.content_encoder.bias)

    def kernel_normalizer(self, mask: Tensor) -> Tensor:
        """Content-encoder output ``(N, k^2 g s^2, H, W)`` -> softmax-normalised
        kernels ``(N, g k^2, H s, W s)``, the mask layout carafe expects."""
        mask = F.pixel_shuffle(mask, self.scale_factor)
        n, mask_c, h, w = mask.shape
        mask = mask.view(n, mask_c // (self.up_kernel * self.up_kernel), -1, h, w)
        mask = F.softmax(mask, dim=2, dtype=mask.dtype)
        return mask.view(n, mask_c, h, w).contiguous()

    def feature_reassemble(self, x: Tensor, mask: Tensor) -> Tensor:
        return ops.carafe(x, mask, self.up_kernel, self.up_group, self.scale_factor)

    def forward(self, x: Tensor) -> Tensor:
        mask = self.kernel_normalizer(self.content_encoder(self.channel_compressor(x)))
        return self.feature_reassemble(x, mask)

    def extra_repr(self) -> str:
        return (f"channels={self.channels}, scale_factor={self.scale_factor}, "
                f"up_kernel={self.up_kernel}, up_group={self.up_group}, "
                f"encoder_kernel={self.encoder_kernel}, "
                f"encoder_dilation={self.encoder_dilation}, "
                f"compressed_channels={self.compressed_channels}")


# --- norms ----------------------------------------------------------------------

__all__ += ["RMSNorm", "LayerNorm"]


class RMSNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm`` computed by :func:`torchops.rms_norm`: the same
    constructor arguments (``normalized_shape, eps=None,
    elementwise_affine=True, device, dtype``), attributes and state-dict keys
    (``weight``), so a checkpoint of either loads into the other.  A float32
    module may take half inputs (mixed precision): the result has the input's
    dtype."""

    def forward(self, x: Tensor) -> Tensor:
        return ops.rms_norm(x, self.normalized_shape, self.weight, self.eps)


class LayerNorm(nn.LayerNorm):
    """``torch.nn.LayerNorm`` computed by :func:`torchops.layer_norm`: the same
    constructor arguments (``normalized_shape, eps=1e-5,
    elementwise_affine=True, bias=True, device, dtype``), attributes and
    state-dict keys (``weight``, ``bias``), so a checkpoint of either loads
    into the other.  A float32 module may take half inputs (mixed
    precision): the result has the input's dtype."""

    def forward(self, x: Tensor) -> Tensor:
        return ops.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


# --- losses: fused linear cross-entropy ---------------------------------------------

__all__ += ["FusedLinearCrossEntropyLoss"]


class FusedLinearCrossEntropyLoss(nn.Module):
    """Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` computed by
    :func:`torchops.fused_linear_cross_entropy`: the same constructor
    arguments (``ignore_index=-100, lse_square_scale=0.0,
    label_smoothing=0.0, reduction="mean", softcap=None``) and the same call,
    ``loss_fn(lin_weight, input, target, bias=None)`` (the head's weight
    first), so a model written for Liger's loss switches by its import.  The
    loss is float32 (float64 for float64 inputs).  No parameters: the head's
    weight stays in the model."""

    def __init__(self, ignore_index: int = -100, lse_square_scale: float = 0.0,
                 label_smoothing: float = 0.0, reduction: str = "mean",
                 softcap: float | None = None):
        super().__init__()
        if reduction not in ("none", "mean", "sum"):
            raise ValueError(f"torchops.FusedLinearCrossEntropyLoss: expected 'reduction' to "
                             f"be 'none', 'mean' or 'sum', but got '{reduction}'")
        self.ignore_index = ignore_index
        self.lse_square_scale = lse_square_scale
        self.label_smoothing = label_smoothing
        self.reduction = reduction
        self.softcap = softcap

    def forward(self, lin_weight: Tensor, input: Tensor, target: Tensor,
                bias: Tensor | None = None) -> Tensor:
        return ops.fused_linear_cross_entropy(
            input, lin_weight, target, bias, self.ignore_index, self.label_smoothing,
            self.reduction, self.lse_square_scale, self.softcap)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, lse_square_scale={self.lse_square_scale}, "
                f"label_smoothing={self.label_smoothing}, reduction={self.reduction!r}, "
                f"softcap={self.softcap}")


# --- detection: multi-scale deformable attention ---------------------------------------------

__all__ += ["MultiScaleDeformableAttention"]


class MultiScaleDeformableAttention(nn.Module):
    """mmcv's ``MultiScaleDeformableAttention`` (Deformable DETR's attention):
    the same constructor, parameters (names and shapes, so mmcv checkpoints
    load), initialisation and call, with :func:`torchops.ms_deform_attn` for
    the sampling.

    Args:
        embed_dims: the query and value width; divisible by ``num_heads``.
        num_heads, num_levels, num_points: heads, feature levels and sampling
            points per head and level.
        im2col_step: accepted for mmcv compatibility; unused (the kernels
            need no batch chunking).
        dropout: on the output, before the residual.
        batch_first: inputs ``(B, N, C)`` when true, ``(N, B, C)`` when false
            (mmcv's default).
        norm_cfg, init_cfg: accepted and ignored (mmcv's config hooks).
        value_proj_ratio: the value projection's width, ``embed_dims *
            value_proj_ratio``.

    ``forward(query, key=None, value=None, identity=None, query_pos=None,
    key_padding_mask=None, reference_points=None, spatial_shapes=None,
    level_start_index=None)``: ``reference_points`` ``(B, Q, num_levels, 2)``
    (points, normalised ``(x, y)``) or ``(..., 4)`` (boxes ``(cx, cy, w,
    h)``); returns ``dropout(output_proj(attention)) + identity`` in the
    query's layout.
    """

    def __init__(self, embed_dims: int = 256, num_heads: int = 8, num_levels: int = 4,
                 num_points: int = 4, im2col_step: int = 64, dropout: float = 0.1,
                 batch_first: bool = False, norm_cfg=None, init_cfg=None,
                 value_proj_ratio: float = 1.0):
        super().__init__()
        name = "MultiScaleDeformableAttention"
        for arg, v in (("embed_dims", embed_dims), ("num_heads", num_heads),
                       ("num_levels", num_levels), ("num_points", num_points)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"torchops.{name}: expected '{arg}' to be a positive int, "
                                 f"but got {v!r}")
        if embed_dims % num_heads != 0:
            raise ValueError(f"torchops.{name}: expected 'embed_dims' ({embed_dims}) to be "
                             f"divisible by 'num_heads' ({num_heads})")
        value_dims = int(embed_dims * value_proj_ratio)
        if value_dims <= 0 or value_dims % num_heads != 0:
            raise ValueError(f"torchops.{name}: expected embed_dims * 'value_proj_ratio' "
                             f"({value_dims}) to be a positive multiple of num_heads "
                             f"({num_heads})")
        self.embed_dims, self.num_heads = embed_dims, num_heads
        self.num_levels, self.num_points = num_levels, num_points
        self.im2col_step, self.batch_first = im2col_step, batch_first
        self.norm_cfg, self.init_cfg = norm_cfg, init_cfg
        self.dropout = nn.Dropout(dropout)
        points = num_heads * num_levels * num_points
        self.sampling_offsets = nn.Linear(embed_dims, points * 2)
        self.attention_weights = nn.Linear(embed_dims, points)
        self.value_proj = nn.Linear(embed_dims, value_dims)
        self.output_proj = nn.Linear(value_dims, embed_dims)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """mmcv's initialisation: each head's offsets start on a ring of
        directions (head i at angle 2 pi i / heads, scaled so its larger
        coordinate is 1), point p at p + 1 times that; attention weights
        zero (uniform after the softmax); the projections Xavier-uniform
        with zero biases."""
        nn.init.zeros_(self.sampling_offsets.weight)
        device = self.sampling_offsets.bias.device
        angle = torch.arange(self.num_heads, dtype=torch.float32, device=device) * (
            2.0 * math.pi / self.num_heads)
        ring = torch.stack([angle.cos(), angle.sin()], -1)
        ring = ring / ring.abs().max(-1, keepdim=True)[0]
        scale = torch.arange(1, self.num_points + 1, dtype=torch.float32, device=device)
        grid = ring[:, None, None, :] * scale[None, None, :, None]  # (heads, 1, points, 2)
        grid = grid.expand(self.num_heads, self.num_levels, self.num_points, 2)
        self.sampling_offsets.bias.copy_(grid.reshape(-1))
        nn.init.zeros_(self.attention_weights.weight)
        nn.init.zeros_(self.attention_weights.bias)
        for proj in (self.value_proj, self.output_proj):
            nn.init.xavier_uniform_(proj.weight)
            nn.init.zeros_(proj.bias)

    def forward(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None,
                identity: Tensor | None = None, query_pos: Tensor | None = None,
                key_padding_mask: Tensor | None = None,
                reference_points: Tensor | None = None, spatial_shapes: Tensor | None = None,
                level_start_index: Tensor | None = None, **kwargs) -> Tensor:
        name = "MultiScaleDeformableAttention"
        if reference_points is None or spatial_shapes is None or level_start_index is None:
            raise ValueError(f"torchops.{name}: 'reference_points', 'spatial_shapes' and "
                             "'level_start_index' are required")
        if value is None:
            value = query
        if identity is None:
            identity = query
        if query_pos is not None:
            query = query + query_pos
        if not self.batch_first:
            query, value = query.transpose(0, 1), value.transpose(0, 1)
        b, q, _ = query.shape
        s = value.shape[1]
        value = self.value_proj(value)
        if key_padding_mask is not None:
            value = value.masked_fill(key_padding_mask[..., None], 0.0)
        value = value.reshape(b, s, self.num_heads, -1)
        heads, levels, points = self.num_heads, self.num_levels, self.num_points
        offsets = self.sampling_offsets(query).view(b, q, heads, levels, points, 2)
        weights = self.attention_weights(query).view(b, q, heads, levels * points)
        weights = weights.softmax(-1).view(b, q, heads, levels, points)
        if reference_points.shape[-1] == 2:
            # Offsets are in pixels of each level: (W, H) normalise (x, y).
            size = torch.stack([spatial_shapes[..., 1], spatial_shapes[..., 0]], -1)
            locations = (reference_points[:, :, None, :, None, :]
                         + offsets / size[None, None, None, :, None, :])
        elif reference_points.shape[-1] == 4:
            locations = (reference_points[:, :, None, :, None, :2]
                         + offsets / points * reference_points[:, :, None, :, None, 2:] * 0.5)
        else:
            raise ValueError(f"torchops.{name}: expected 'reference_points' to end in 2 or 4 "
                             f"coordinates, but got shape {tuple(reference_points.shape)}")
        # Under autocast the projections give half values beside float32
        # locations and weights, which the op's autocast kernel takes as they
        # are (rounding locations to bfloat16 would move samples by up to a
        # pixel).  Outside autocast the op takes one dtype, value's.
        if not torch.is_autocast_enabled(value.device.type):
            locations, weights = locations.to(value.dtype), weights.to(value.dtype)
        out = ops.ms_deform_attn(value, spatial_shapes, level_start_index, locations, weights)
        out = self.output_proj(out)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return self.dropout(out) + identity

    def extra_repr(self) -> str:
        return (f"embed_dims={self.embed_dims}, num_heads={self.num_heads}, "
                f"num_levels={self.num_levels}, num_points={self.num_points}, "
                f"batch_first={self.batch_first}")
