"""``torch.nn.Module`` wrappers of the torchops ops, for users switching from
torchvision (``torchvision.ops.RoIAlign``, ``DeformConv2d``, ...) or mmcv
(``ModulatedDeformConv2dPack``, ``CARAFEPack``, ...).  Each module holds its
hyper-parameters (and, where the op has weights, its parameters) and calls the
public op of the same name in :mod:`torchops.ops`; everything an op supports
(dtypes, devices, autograd, autocast, ``torch.compile``) holds for its module.

One section per family; each adds its names to ``__all__``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from torchops import ops

__all__ = ["RoIAlign", "RoIPool"]


# --- RoI pooling --------------------------------------------------------------

class RoIAlign(nn.Module):
    """:func:`torchops.roi_align` as a module, like ``torchvision.ops.RoIAlign``:
    ``RoIAlign(output_size, spatial_scale, sampling_ratio, aligned=False)``,
    called as ``module(input, rois)`` with ``rois`` a ``(K, 5)`` tensor or a
    list of ``(L, 4)`` tensors, one per image."""

    def __init__(self, output_size: int | tuple[int, int], spatial_scale: float,
                 sampling_ratio: int, aligned: bool = False) -> None:
        super().__init__()
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
        self.output_size = output_size
        self.spatial_scale = spatial_scale

    def forward(self, input: Tensor, rois: Tensor | list[Tensor]) -> Tensor:
        return ops.roi_pool(input, rois, self.output_size, self.spatial_scale)

    def extra_repr(self) -> str:
        return f"output_size={self.output_size}, spatial_scale={self.spatial_scale}"


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
