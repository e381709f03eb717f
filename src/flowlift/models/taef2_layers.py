"""TAEF2's decoder layers rewritten for the CPU's half dtypes: the same sums, shaped for oneDNN.

* :class:`UpConv`: a nearest 2x upsampling and the 3x3 conv after it as one sub-pixel conv on the
  low-resolution grid (4/9 of the multiply-adds, no upsampled copy).
* :class:`PairConv`: a 3x3 conv with few output channels (the decoder's last, 64 -> 3) as a stride-2 4x4
  conv that gives 2x2 output pixels per position (oneDNN pads 3 output channels to 16, 12 to 16 too).
* :func:`run_layers`: a conv and the ReLU after it in one oneDNN pass (:mod:`flowlift.models.fused_conv`).

Float32 runs the released layers as they are, bit for bit, in every one of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flowlift.models.fused_conv import conv_act, conv_add_act, fusable
from flowlift.models.taef2_tiling import call_layer

#: Rows of the 3x3 kernel that reach each 2x2 sub-pixel tap: ``SUBPIXEL_ROWS[a][k][d]`` is 1 where output
#: phase ``a`` (even/odd row) reads kernel row ``d`` (0..2) through low-resolution tap ``k`` (0..1).
SUBPIXEL_ROWS = ((1.0, 0.0, 0.0), (0.0, 1.0, 1.0)), ((1.0, 1.0, 0.0), (0.0, 0.0, 1.0))


def subpixel_weights(weight: torch.Tensor) -> torch.Tensor:
    """The 3x3 kernel of a conv after a nearest 2x upsampling as four 2x2 kernels on the low-resolution grid.

    Output pixel ``(2i + a, 2j + b)`` reads upsampled rows ``2i + a - 1 .. 2i + a + 1``, i.e. low-resolution
    rows ``i - 1, i`` (``a = 0``: kernel rows 0 | 1 + 2) or ``i, i + 1`` (``a = 1``: rows 0 + 1 | 2); columns
    alike. ``K[a, b] = R_a w R_b^T`` with ``R`` = :data:`SUBPIXEL_ROWS`, summed in float64 and rounded once:
    (O, I, 3, 3) -> (4 O, I, 2, 2), phase-major (``a``, then ``b``), in ``weight``'s dtype.
    """
    rows = torch.tensor(SUBPIXEL_ROWS, dtype=torch.float64, device=weight.device)
    kernels = torch.einsum("ayd,oide,bze->aboiyz", rows, weight.double(), rows)
    return kernels.reshape(4 * weight.shape[0], weight.shape[1], 2, 2).to(weight.dtype)


def upsample_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: torch.Tensor | None = None
) -> torch.Tensor:
    """``conv3x3(nearest2x(x), weight, bias, padding=1)`` computed on the low-resolution grid.

    One 2x2 convolution with padding 1 and the :func:`subpixel_weights` gives ``Y`` (B, 4 O, h + 1, w + 1);
    phase ``(a, b)``'s pixels are ``out[:, :, 2i + a, 2j + b] = Y[:, phase, i + a, j + b]``. The same sums
    with 4/9 of the multiply-adds and no upsampled copy of ``x``; zero padding at the border of ``x`` is the
    upsampled frame's padding, so a tile of ``x`` gives the tile of the output, as the two layers do.
    ``kernels``: the sub-pixel kernels when already made (else from ``weight``).
    """
    b, _, h, w = x.shape
    o = weight.shape[0]
    kernels = (subpixel_weights(weight) if kernels is None else kernels).to(x.dtype)
    y = F.conv2d(x, kernels, None if bias is None else bias.to(x.dtype).repeat(4), 1, 1)
    channels_last = x.shape[1] > 1 and x.stride(1) == 1
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.empty((b, o, 2 * h, 2 * w), dtype=y.dtype, device=y.device, memory_format=fmt)
    for phase, (a, c) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
        out[:, :, a::2, c::2] = y[:, phase * o : (phase + 1) * o, a : a + h, c : c + w]
    return out


class UpConv(nn.Module):
    """A decoder's ``Upsample(2)`` and the 3x3 conv after it as one layer, sharing the conv's parameters.

    In float32 the two layers as they are (the same bits as the released model's forward); in a half
    dtype :func:`upsample_conv` (4/9 of the multiply-adds) with the conv's ``subpixel_weight`` buffer
    (:meth:`TAEF2.refresh_subpixel_weights`: made from the weights as loaded, so a float32 file's kernels
    are rounded to the half dtype once, like every other weight) where it is there in ``x``'s dtype.
    """

    def __init__(self, conv: nn.Conv2d) -> None:
        super().__init__()
        if conv.kernel_size != (3, 3) or conv.padding != (1, 1) or conv.stride != (1, 1):
            raise ValueError(f"UpConv needs a 3x3 conv with padding 1, got {conv}")
        self.conv = conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv = self.conv
        if x.dtype == torch.float32:
            return conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))
        kernels = getattr(conv, "subpixel_weight", None)
        if kernels is not None and (kernels.dtype != x.dtype or kernels.device != x.device):
            kernels = None
        return upsample_conv(x, conv.weight, conv.bias, kernels)


def fuse_upsample_convs(layers: list[nn.Module]) -> list[nn.Module]:
    """``layers`` with every nearest ``Upsample(2)`` followed by a 3x3 conv replaced by one :class:`UpConv`."""
    fused: list[nn.Module] = []
    for layer in layers:
        previous = fused[-1] if fused else None
        if isinstance(layer, nn.Conv2d) and isinstance(previous, nn.Upsample) and _nearest2x(previous):
            fused[-1] = UpConv(layer)
        else:
            fused.append(layer)
    return fused


def run_layers(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """``layers`` applied in turn to ``x``, a conv followed by a ReLU as one step (:func:`conv_act`: the ReLU in
    place on the conv's output, never inside oneDNN's pass, which would turn NaN into 0).

    Every layer after the first reads a tensor the chain made and no one else holds, so a layer with a
    ``consume`` method (a TAEF2 ``Block``) is called through it and may write its result over its input.
    """
    i = 0
    while i < len(layers):
        layer = layers[i]
        if isinstance(layer, nn.Conv2d) and i + 1 < len(layers) and isinstance(layers[i + 1], nn.ReLU):
            x, i = conv_act(x, layer, "relu"), i + 2
        else:
            x, i = call_layer(layer, x, owned=i > 0), i + 1
    return x


def conv_add_relu_into(x: torch.Tensor, conv: nn.Conv2d, other: torch.Tensor) -> torch.Tensor:
    """``relu(conv(x) + other)`` written over ``other``: the add in the conv's oneDNN pass (the sum rounded once,
    as :func:`~flowlift.models.fused_conv.conv_add_act`'s, to the bit), the ReLU in place after it, where it is
    fusable, ``conv`` keeps the
    size (3x3, padding 1, stride 1) and ``other`` is dense in ``x``'s layout; elsewhere, float32 above all,
    :func:`~flowlift.models.fused_conv.conv_add_act` (a new tensor, ``other`` unchanged). The caller gives up
    ``other``: 4% less time than a new output on a 526x526 64-channel bf16 tile (no buffer to fill afresh).
    """
    op = getattr(torch.ops.mkldnn, "_convolution_pointwise_", None)
    layout = torch.channels_last if x.shape[1] > 1 and x.stride(1) == 1 else torch.contiguous_format
    if (
        op is None
        or not fusable(x, conv)
        or (conv.kernel_size, conv.padding, conv.stride, conv.dilation, conv.groups)
        != ((3, 3), (1, 1), (1, 1), (1, 1), 1)
        or other.dtype != x.dtype
        or other.shape != (x.shape[0], conv.out_channels, *x.shape[2:])
        or not (x.is_contiguous(memory_format=layout) and other.is_contiguous(memory_format=layout))
    ):
        return conv_add_act(x, conv, other, "relu")
    geometry = [1, 1], [1, 1], [1, 1], 1
    # The add in the conv's pass, the ReLU after it in place: after an add oneDNN takes only its plain ReLU,
    # which turns NaN into 0 (fused_conv).
    return torch.relu_(op.binary(other, x, conv.weight, conv.bias, *geometry, "add", None, None, [], None))


def _nearest2x(layer: nn.Upsample) -> bool:
    return layer.mode == "nearest" and layer.size is None and float(layer.scale_factor) == 2.0


def pixel_pair_weights(weight: torch.Tensor) -> torch.Tensor:
    """A 3x3 kernel as the 4x4 kernel of a stride-2 conv that gives 2x2 output pixels per position.

    With padding 1, position ``(p, q)`` reads input rows ``2p - 1 .. 2p + 2``; output pixel
    ``(2p + a, 2q + b)`` reads rows ``2p + a - 1 .. 2p + a + 1``, i.e. kernel rows ``a .. a + 2``:
    ``K[(o, a, b), :, a + d, b + e] = w[o, :, d, e]``, zero elsewhere (no sums: exact in any dtype).
    (O, I, 3, 3) -> (4 O, I, 4, 4), channel-major (``o``, then ``a``, ``b``) as ``pixel_shuffle`` reads them.
    """
    o, i = weight.shape[:2]
    kernels = weight.new_zeros(o, 2, 2, i, 4, 4)
    for a in range(2):
        for b in range(2):
            kernels[:, a, b, :, a : a + 3, b : b + 3] = weight
    return kernels.reshape(4 * o, i, 4, 4)


def conv3x3_by_pixel_pairs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``conv2d(x, weight, bias, padding=1)`` (3x3) as a stride-2 conv with :func:`pixel_pair_weights`.

    ``pixel_shuffle(conv2d(x, K, bias repeated 4x, stride 2, padding 1))``: each output pixel is the same
    nine taps (the other seven are zeros), summed once. An odd side is padded by 2 instead of 1, which
    starts the pairs one row (column) early; the extra first row is cut. The positions carry 4 O output
    channels, so a conv with O <= 4 fills oneDNN's 16-channel block instead of leaving 13 of 16 idle.
    """
    h, w = x.shape[-2:]
    pad_h, pad_w = 1 + h % 2, 1 + w % 2
    kernels = pixel_pair_weights(weight.to(x.dtype))
    bias4 = None if bias is None else bias.to(x.dtype).repeat_interleave(4)
    y = F.pixel_shuffle(F.conv2d(x, kernels, bias4, 2, (pad_h, pad_w)), 2)
    return y[:, :, pad_h - 1 : pad_h - 1 + h, pad_w - 1 : pad_w - 1 + w]


#: Output channels up to which :class:`PairConv` computes 2x2 pixels per position (4 x 4 = 16, one block).
PAIR_CONV_MAX_CHANNELS = 4


class PairConv(nn.Module):
    """A 3x3 conv (padding 1) with at most :data:`PAIR_CONV_MAX_CHANNELS` outputs, sharing the conv's parameters.

    In a half dtype on the CPU :func:`conv3x3_by_pixel_pairs` (the decoder's 64 -> 3 conv: 0.6x the CPU
    time on a 524x524 tile, bf16, AMD EPYC Zen 4); elsewhere, float32 above all, the conv as it is.
    """

    def __init__(self, conv: nn.Conv2d) -> None:
        super().__init__()
        if not is_pair_conv(conv):
            raise ValueError(f"PairConv needs a 3x3 conv with padding 1 and <= {PAIR_CONV_MAX_CHANNELS} outputs")
        self.conv = conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.bfloat16, torch.float16) or x.device.type != "cpu":
            return self.conv(x)
        return conv3x3_by_pixel_pairs(x, self.conv.weight, self.conv.bias)


def is_pair_conv(layer: nn.Module) -> bool:
    """True for a plain 3x3 conv (stride 1, padding 1, zeros, not grouped) with few outputs (:class:`PairConv`)."""
    return (
        isinstance(layer, nn.Conv2d)
        and layer.kernel_size == (3, 3)
        and layer.stride == (1, 1)
        and layer.padding == (1, 1)
        and layer.dilation == (1, 1)
        and layer.groups == 1
        and layer.padding_mode == "zeros"
        and layer.out_channels <= PAIR_CONV_MAX_CHANNELS
    )


def fuse_decoder_layers(layers: list[nn.Module]) -> list[nn.Module]:
    """:func:`fuse_upsample_convs`, then every conv with few outputs as a :class:`PairConv`."""
    return [PairConv(layer) if is_pair_conv(layer) else layer for layer in fuse_upsample_convs(layers)]
