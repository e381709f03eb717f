"""TAEF2's decoder: a nearest 2x upsampling and the 3x3 conv after it as one sub-pixel conv (half dtypes).

The fused layer must compute the same sums as the two layers (any size, tile, batch, layout, bias), keep
float32 bit for bit the released layers, round its kernels once from the loaded weights, tile exactly, and
let a non-finite value through.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from flowlift.models.taef2 import TAEF2, local_op
from flowlift.models.taef2_layers import UpConv, fuse_upsample_convs, subpixel_weights, upsample_conv
from flowlift.models.taef2_tiling import LocalOp, input_interval, output_size, produced_interval


def _two_layers(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.conv2d(F.interpolate(x, scale_factor=2.0, mode="nearest"), weight, bias, 1, 1)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_upsample_conv_is_upsample_then_conv(channels_last, with_bias):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 7, 4, dtype=torch.float64)
    weight = torch.randn(6, 5, 3, 3, dtype=torch.float64)
    bias = torch.randn(6, dtype=torch.float64) if with_bias else None
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    got = upsample_conv(x, weight, bias)
    assert got.shape == (2, 6, 14, 8)
    assert got.is_contiguous(memory_format=torch.channels_last) == channels_last
    torch.testing.assert_close(got, _two_layers(x, weight, bias), rtol=0, atol=1e-12)


def test_subpixel_kernels_sum_the_taps_each_phase_reads():
    weight = torch.arange(9, dtype=torch.float32).reshape(1, 1, 3, 3)  # rows 0 1 2 / 3 4 5 / 6 7 8
    kernels = subpixel_weights(weight)
    assert kernels.shape == (4, 1, 2, 2) and kernels.dtype == torch.float32
    # phase (0, 0): low-res rows i-1 | i take kernel rows 0 | 1+2, columns alike
    assert kernels[0, 0].tolist() == [[0.0, 1.0 + 2.0], [3.0 + 6.0, 4.0 + 5.0 + 7.0 + 8.0]]
    # phase (1, 1): rows 0+1 | 2, columns 0+1 | 2
    assert kernels[3, 0].tolist() == [[0.0 + 1.0 + 3.0 + 4.0, 2.0 + 5.0], [6.0 + 7.0, 8.0]]


@pytest.mark.parametrize(("a", "b", "n"), [(0, 3, 5), (1, 9, 5), (4, 7, 6), (3, 12, 6), (0, 12, 6), (5, 6, 9)])
def test_upconv_region_gives_the_frame_rows(a, b, n):
    """A tile of ``x`` (the rows ``input_interval`` names) yields output rows ``[a, b)`` of the whole frame."""
    op = LocalOp("upconv")
    assert output_size(op, n) == 2 * n
    torch.manual_seed(1)
    x = torch.randn(1, 3, n, n, dtype=torch.float64)
    weight = torch.randn(4, 3, 3, 3, dtype=torch.float64)
    whole = upsample_conv(x, weight, None)
    c, d = input_interval(op, a, b, n)
    have = produced_interval(op, c, d)
    assert have[0] <= a and b <= have[1] and 0 <= c < d <= n
    rows = upsample_conv(x[:, :, c:d], weight, None)[:, :, a - have[0] : b - have[0]]
    torch.testing.assert_close(rows, whole[:, :, a:b], rtol=0, atol=1e-12)


def test_decoder_fuses_each_upsampling_with_its_conv():
    dec = TAEF2(encoder=False).decoder
    layers = fuse_upsample_convs(list(dec))
    fused = [layer for layer in layers if isinstance(layer, UpConv)]
    assert [layer.conv for layer in fused] == [dec[7], dec[12], dec[17]]
    assert len(layers) == len(dec) - 3 and not any(isinstance(layer, torch.nn.Upsample) for layer in layers)
    assert local_op(fused[0]) == LocalOp("upconv")


def test_float32_decode_is_the_released_layers_bit_for_bit():
    torch.manual_seed(2)
    model = TAEF2(encoder=False).eval()
    latents = torch.randn(1, 32, 9, 11)
    with torch.no_grad():
        assert torch.equal(model.decode_full(latents), model.decoder(latents))


def test_half_decode_rounds_loaded_kernels_once_and_tiles_exactly():
    torch.manual_seed(3)
    source = TAEF2(encoder=False)
    model = TAEF2(encoder=False)
    model.load_state_dict(source.state_dict())  # the kernels follow the loaded weights
    assert not any("subpixel" in key for key in model.state_dict())  # the released state dict
    model = model.to(torch.bfloat16).eval().to(memory_format=torch.channels_last)
    for index in (7, 12, 17):
        expected = subpixel_weights(source.decoder[index].weight.detach()).to(torch.bfloat16)
        assert torch.equal(model.decoder[index].subpixel_weight, expected)
    latents = torch.randn(1, 32, 13, 19).bfloat16().contiguous(memory_format=torch.channels_last)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        full = model.decode_full(latents)
    fused_flops = counter.get_total_flops()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.decoder(latents)
    # the three fused convs: 4 phases x 2x2 taps on (h+1)(w+1) low-res positions instead of 9 taps on 4hw
    assert fused_flops < counter.get_total_flops()
    with torch.no_grad():
        tiled = model.decode_tiled(latents, band=9, tile=5)
        reference = source.eval().decode_full(latents.float())
    assert torch.equal(tiled, full)
    assert (full.float() - reference).abs().max().item() < 0.05  # bf16's rounding, no wrong phase or shift


def test_non_finite_values_stay_visible():
    torch.manual_seed(4)
    conv = torch.nn.Conv2d(4, 4, 3, padding=1, bias=False).to(torch.bfloat16)
    x = torch.randn(1, 4, 6, 6).bfloat16()
    x[0, 1, 2, 3] = float("nan")
    x[0, 2, 4, 0] = float("inf")
    out = UpConv(conv)(x)
    assert out.dtype == torch.bfloat16
    assert not torch.isfinite(out[0, :, 4:6, 6:8]).any()  # every output pixel that reads the NaN
    assert not torch.isfinite(out[0, :, 8:10, 0:2]).any()
