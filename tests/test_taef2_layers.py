"""TAEF2's layers shaped for oneDNN in bf16: the fused Block, the decoder's fused conv + ReLU, PairConv.

Each must compute the released model's sums (float64 for the maths), keep float32 bit for bit the released
layers, stay within bf16's rounding of float32 in bf16, and tile exactly (a region of the input gives the
region of the output to the bit, whatever its parity).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cpu_features import needs_fused_bf16
from flowlift.models.fused_conv import conv_add_act, fusable
from flowlift.models.taef2 import TAEF2, Block, local_op
from flowlift.models.taef2_layers import (
    PairConv,
    UpConv,
    conv3x3_by_pixel_pairs,
    conv_add_relu_into,
    fuse_decoder_layers,
    pixel_pair_weights,
    run_layers,
)
from flowlift.models.taef2_tiling import LocalOp, run_two_level

BF16 = torch.bfloat16
CL = torch.channels_last


def _released_block(block: Block, x: torch.Tensor) -> torch.Tensor:
    """The released Block's forward, layer by layer: ``relu(conv(x') + x')``, ``x' = x + pool(x)``."""
    if block.pool is not None:
        x = x + block.pool(x)
    y = block.conv(x)  # conv, ReLU, conv, ReLU, conv as the Sequential runs them
    return torch.relu(y + x)


def _released_decoder(decoder: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    for layer in decoder:
        x = _released_block(layer, x) if isinstance(layer, Block) else layer(x)
    return x


def _block(use_gn: bool, dtype: torch.dtype) -> Block:
    torch.manual_seed(5)
    block = Block(16, use_gn).eval().requires_grad_(False)
    for conv in (block.conv[0], block.conv[2], block.conv[4]):
        conv.weight.mul_(2.0)  # a gain near 1 per conv, so the residual add and the ReLUs both matter
    return block.to(dtype).to(memory_format=CL)


@pytest.mark.parametrize("use_gn", [False, True])
def test_float32_block_is_the_released_block_bit_for_bit(use_gn):
    block = _block(use_gn, torch.float32)
    x = torch.randn(1, 16, 19, 14).contiguous(memory_format=CL)
    with torch.no_grad():
        assert torch.equal(block(x), _released_block(block, x))


@needs_fused_bf16
def test_bf16_block_fuses_the_residual_add_so_it_is_nearer_float32_than_the_released_block():
    block = _block(False, BF16)
    exact_block = _block(False, torch.float32)
    exact_block.load_state_dict({k: v.float() for k, v in block.state_dict().items()})
    x = torch.randn(1, 16, 23, 17, generator=torch.Generator().manual_seed(6)).to(BF16).contiguous(memory_format=CL)
    with torch.no_grad():
        fused, released, exact = block(x), _released_block(block, x), _released_block(exact_block, x.float())
    assert fused.dtype == BF16 and fused.shape == x.shape
    assert (fused >= 0).all()  # the last ReLU ran
    scale = exact.abs().max().item()
    # bf16 activations between the convs: a few roundings of ~2^-8; a missing ReLU, add or conv is O(1).
    assert (fused.float() - exact).abs().max().item() < 0.05 * scale
    # The add is rounded once (with the conv's sum) instead of twice: nearer float32 on average (~10% here).
    assert (fused.float() - exact).abs().mean() < (released.float() - exact).abs().mean() * 0.97


def test_float32_decoder_is_the_released_layers_bit_for_bit():
    torch.manual_seed(7)
    model = TAEF2(encoder=False).eval()
    latents = torch.randn(1, 32, 7, 9)
    with torch.no_grad():
        assert torch.equal(model.decode_full(latents), _released_decoder(model.decoder, latents))


def test_run_layers_fuses_conv_and_relu_bit_for_bit_in_bf16():
    torch.manual_seed(8)
    layers = [nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(16, 4, 3, padding=1)]
    layers = [layer.to(BF16).requires_grad_(False) for layer in layers]
    x = torch.randn(1, 8, 11, 13).to(BF16).contiguous(memory_format=CL)
    with torch.no_grad():
        plain = layers[2](torch.relu(layers[0](x)))
        assert torch.equal(run_layers(layers, x), plain)  # ReLU commutes with rounding


def test_pixel_pair_weights_place_each_phase_taps():
    weight = torch.arange(9, dtype=torch.float32).reshape(1, 1, 3, 3) + 1
    kernels = pixel_pair_weights(weight)
    assert kernels.shape == (4, 1, 4, 4)
    for phase, (a, b) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
        expected = torch.zeros(4, 4)
        expected[a : a + 3, b : b + 3] = weight[0, 0]
        assert torch.equal(kernels[phase, 0], expected)


@pytest.mark.parametrize(("h", "w"), [(8, 6), (7, 10), (9, 5), (1, 2), (2, 1)])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_pixel_pairs_are_the_3x3_conv(h, w, channels_last, with_bias):
    torch.manual_seed(h * 10 + w)
    x = torch.randn(2, 5, h, w, dtype=torch.float64)
    if channels_last:
        x = x.contiguous(memory_format=CL)
    weight = torch.randn(3, 5, 3, 3, dtype=torch.float64)
    bias = torch.randn(3, dtype=torch.float64) if with_bias else None
    got = conv3x3_by_pixel_pairs(x, weight, bias)
    assert got.shape == (2, 3, h, w)
    torch.testing.assert_close(got, F.conv2d(x, weight, bias, 1, 1), rtol=0, atol=1e-12)


def _out_conv(dtype: torch.dtype) -> nn.Conv2d:
    torch.manual_seed(9)
    conv = nn.Conv2d(64, 3, 3, padding=1).eval().requires_grad_(False)
    return conv.to(dtype).to(memory_format=CL)


def test_pair_conv_in_float32_is_the_conv_bit_for_bit():
    conv = _out_conv(torch.float32)
    x = torch.randn(1, 64, 13, 10).contiguous(memory_format=CL)
    with torch.no_grad():
        assert torch.equal(PairConv(conv)(x), conv(x))


def test_pair_conv_in_bf16_rounds_the_float32_sum_once_and_tiles_exactly():
    conv = _out_conv(BF16)
    x = torch.randn(1, 64, 40, 37, generator=torch.Generator().manual_seed(10)).relu().to(BF16)
    x = x.contiguous(memory_format=CL)
    layer = PairConv(conv)
    with torch.no_grad():
        whole = layer(x)
        exact = F.conv2d(x.float(), conv.weight.float(), conv.bias.float(), 1, 1)
        assert whole.dtype == BF16 and whole.shape == (1, 3, 40, 37)
        # one rounding of the float32 sum: within half a bf16 step of it
        assert ((whole.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()
        for r0, r1, c0, c1 in [(1, 40, 3, 37), (0, 39, 0, 36), (5, 30, 2, 31), (2, 17, 7, 20)]:
            tile = layer(x[:, :, r0:r1, c0:c1])  # odd and even sides, odd and even offsets
            assert torch.equal(tile[:, :, 1:-1, 1:-1], whole[:, :, r0 + 1 : r1 - 1, c0 + 1 : c1 - 1])


def test_decoder_runs_its_last_conv_as_a_pair_conv():
    dec = TAEF2(encoder=False).decoder
    layers = fuse_decoder_layers(list(dec))
    assert isinstance(layers[-1], PairConv) and layers[-1].conv is dec[19]
    assert [type(layer) for layer in layers].count(UpConv) == 3
    assert sum(isinstance(layer, PairConv) for layer in layers) == 1  # only the 64 -> 3 conv
    assert local_op(layers[-1]) == LocalOp("same", 1)
    with pytest.raises(ValueError, match="PairConv"):
        PairConv(dec[1])  # 32 -> 64: not a conv with few outputs


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("use_gn", [False, True])
def test_block_forward_leaves_its_input_and_consume_gives_the_same_bits(dtype, use_gn):
    block = _block(use_gn, dtype)
    x = torch.randn(1, 16, 21, 18, generator=torch.Generator().manual_seed(11)).to(dtype)
    x = x.contiguous(memory_format=CL)
    before = x.clone()
    with torch.no_grad():
        out = block(x)
        assert torch.equal(x, before)  # forward never writes over its input
        consumed = block.consume(x)
    assert torch.equal(consumed, out)
    if dtype == BF16 and not use_gn and fusable(x, block.conv[4]):
        assert consumed.data_ptr() == x.data_ptr()  # the residual add was done in place, over x
    elif dtype == torch.float32:
        assert torch.equal(x, before)  # float32 runs the released layers: nothing in place


def test_conv_add_relu_into_falls_back_for_a_view_and_leaves_it():
    conv = _block(False, BF16).conv[4]
    x = torch.randn(1, 16, 9, 11).to(BF16).contiguous(memory_format=CL)
    base = torch.randn(1, 16, 12, 14).to(BF16).contiguous(memory_format=CL)
    other = base[:, :, 1:10, 2:13]  # a crop: not dense, so not written over
    before = base.clone()
    with torch.no_grad():
        out = conv_add_relu_into(x, conv, other)
        assert torch.equal(base, before)
        assert torch.equal(out, conv_add_act(x, conv, other.contiguous(memory_format=CL), "relu"))


def _error(x: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    difference = x.float() - reference
    return difference.abs().max().item(), difference.pow(2).mean().sqrt().item()


def test_bf16_tiled_encode_and_decode_equal_the_whole_frame_and_leave_their_inputs():
    """Bands share their halos: a layer writing over a band's input would change the next band.

    The decode is the whole frame's bit for bit. The encode is within the whole frame's own bf16 error of float32:
    oneDNN's AMX kernels (Intel Xeon) sum its stem's stride-2 convolution in an order that depends on the tile's
    size (one bf16 step apart here and there; AVX512-BF16 on AMD Zen 4 gave equal bits), where a wrong halo
    would be an error of the activations' own size."""
    torch.manual_seed(12)
    model = TAEF2().to(BF16).eval().to(memory_format=CL)
    reference = TAEF2().eval()
    reference.load_state_dict({name: value.float() for name, value in model.state_dict().items()})
    # Full-width bands too: their crops are row ranges, dense views of the shared tensor.
    for width, latent_width in ((136, 19), (64, 8)):
        images = torch.rand(1, 3, 200, width).to(BF16).contiguous(memory_format=CL)
        latents = torch.randn(1, 32, 23, latent_width).to(BF16).contiguous(memory_format=CL)
        images_before, latents_before = images.clone(), latents.clone()
        with torch.no_grad():
            expected = reference.encode_full(images.float())
            whole_max, whole_rms = _error(model.encode_full(images), expected)
            tiled_max, tiled_rms = _error(model.encode_tiled(images, band=9, tile=4), expected)
            assert tiled_max <= 1.25 * whole_max and tiled_rms <= 1.1 * whole_rms
            assert torch.equal(model.decode_tiled(latents, band=9, tile=5), model.decode_full(latents))
        assert torch.equal(images, images_before) and torch.equal(latents, latents_before)


@pytest.mark.parametrize("tiled", [False, True])
def test_bf16_overflowing_weights_give_non_finite_output_not_a_plausible_image(tiled):
    """Issue 43's class at TAEF2: finite weights that overflow (x 1e30) must give NaN/Inf, which the pipeline
    refuses; oneDNN's fused ReLU (max with 0) turned the NaN into 0 and the bf16 decode came out finite."""
    torch.manual_seed(11)
    model = TAEF2().eval().requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1e30)
    model = model.to(dtype=torch.bfloat16, memory_format=CL)
    model.refresh_subpixel_weights()
    latents = torch.randn(1, 32, 8, 8).bfloat16().contiguous(memory_format=CL)
    images = torch.rand(1, 3, 64, 64).bfloat16().contiguous(memory_format=CL)
    with torch.no_grad():
        decoded = model.decode_tiled(latents, band=4, tile=2) if tiled else model.decode_full(latents)
        encoded = model.encode_tiled(images, band=4, tile=2) if tiled else model.encode_full(images)
    assert not torch.isfinite(decoded).all() and not torch.isfinite(encoded).all()


def test_a_nan_reaching_a_block_stays_nan_in_bf16():
    block = _block(False, torch.bfloat16)
    x = torch.randn(1, block.conv[0].in_channels, 9, 9).bfloat16().contiguous(memory_format=CL)
    x[0, :, 4, 4] = float("nan")
    with torch.no_grad():
        assert torch.isnan(block(x)).any() and torch.isnan(block.consume(x.clone())).any()


def test_an_amx_cpu_decodes_bf16_in_tiles_near_its_l2_and_equal_bits(monkeypatch):
    """AMX computes TAEF2's 64-channel convolutions faster than memory feeds them: bf16 on such a CPU decodes in
    16-latent-pixel tiles (64-pixel bands); float32 and other CPUs keep the defaults. Each CPU's own tiling gives
    the whole frame's bits; the AMX tiling forced on another CPU stays within one bf16 rounding (oneDNN's kernels
    for its narrow tiles may sum in another order there: on a Zen 4 with avx512_bf16, one step on 0.4% of values)."""
    from flowlift.models import taef2

    real_amx = taef2.cpu_has_feature("amx_bf16")
    bf16 = torch.zeros(1, 32, 4, 4, dtype=BF16)
    monkeypatch.setattr(taef2, "cpu_has_feature", lambda name: name == "amx_bf16")
    assert taef2.decode_tiling(bf16) == (taef2.AMX_DECODE_BAND, taef2.AMX_DECODE_TILE) == (64, 16)
    assert taef2.decode_tiling(bf16.float()) == (taef2.DEFAULT_DECODE_BAND, taef2.DEFAULT_DECODE_TILE)
    torch.manual_seed(13)
    model = TAEF2(encoder=False).to(BF16).eval().to(memory_format=CL)
    latents = torch.randn(1, 32, 40, 36).to(BF16).contiguous(memory_format=CL)
    seen = []

    def recording(*args, band, tile, **kwargs):
        seen.append((band, tile))
        return run_two_level(*args, band=band, tile=tile, **kwargs)

    monkeypatch.setattr(taef2, "run_two_level", recording)
    with torch.no_grad():
        on_amx = model.decode_tiled(latents)
        monkeypatch.setattr(taef2, "cpu_has_feature", lambda name: False)
        elsewhere = model.decode_tiled(latents)
        whole = model.decode_full(latents)
    assert seen == [(64, 16), (128, 64)]
    assert torch.equal(elsewhere, whole)
    if real_amx:
        assert torch.equal(on_amx, whole)
    else:
        torch.testing.assert_close(on_amx, whole, rtol=2**-8, atol=2**-12)
