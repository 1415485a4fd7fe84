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
import torch.nn.functional as F
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
