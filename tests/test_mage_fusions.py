"""Mage-VAE's CPU reformulations (issue 47): the DiCo blocks' GELUs fused into their convolutions, the per-pixel
LayerNorm as a centering convolution and a row norm (its affine folded into the modulation), the SiLUs fused
into the per-pixel layers, and the tiled executor's chunked statistics. Each: float32 the same maths (bit for bit
where nothing was reordered), bf16 within a stated distance of float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flowlift.models.mage_vae as mage_vae
from cpu_features import needs_fused_bf16
from flowlift.models.fused_conv import conv_act, fusable
from flowlift.models.mage_passes import GroupSums, channel_mean_var, channel_moments, channel_sums
from flowlift.models.mage_vae import NORM_EPS, DiCoBlock, centering_weight, layer_norm_2d, layer_norm_rows
from flowlift.models.mage_vae_files import mage_from_state_dict
from mage_files import NARROW, released_state

pytestmark = pytest.mark.usefixtures("single_thread_torch")

BF16 = torch.bfloat16
CL = torch.channels_last


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _block(dtype: torch.dtype) -> DiCoBlock:
    torch.manual_seed(0)
    block = DiCoBlock(64, 4.0, modulated=False).eval().requires_grad_(False)
    with torch.no_grad():
        for p in block.parameters():
            p.mul_(2.0)  # GELUs away from their linear middle
    return block.to(dtype=dtype, memory_format=CL)


def _unfused(block: DiCoBlock, x: torch.Tensor) -> torch.Tensor:
    """The block as released: every layer, then its GELU, one op after another."""
    a = F.gelu(block.conv2(block.conv1(layer_norm_2d(x, block.norm1.weight, block.norm1.bias))))
    gate = torch.sigmoid(block.ca[1](a.mean(dim=(2, 3), keepdim=True)))
    y = F.conv2d(a, block.conv3.weight * gate.reshape(1, -1, 1, 1), block.conv3.bias).add_(x)
    return block.conv5(F.gelu(block.conv4(layer_norm_2d(y, block.norm2.weight, block.norm2.bias)))).add_(y)


def _frame(c: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(1, c, 13, 19, generator=torch.Generator().manual_seed(1))
    return x.to(dtype).contiguous(memory_format=CL)


def test_a_float32_dico_block_is_the_unfused_layers_bit_for_bit():
    block, x = _block(torch.float32), _frame(64, torch.float32)
    with torch.no_grad():
        assert torch.equal(block(x), _unfused(block, x))


@needs_fused_bf16
def test_a_bf16_dico_block_runs_both_gelus_fused_and_stays_near_float32(monkeypatch):
    block, x = _block(BF16), _frame(64, BF16)
    assert fusable(x, block.conv2) and fusable(x, block.conv4)
    fused = []

    def counting(t, conv, activation):
        fused.append((conv, activation))
        return conv_act(t, conv, activation)

    monkeypatch.setattr(mage_vae, "conv_act", counting)
    with torch.no_grad():
        out = block(x)
        exact = _unfused(_block(torch.float32), x.float())
        unfused = _unfused(block, x)
    assert fused == [(block.conv2, "gelu"), (block.conv4, "gelu")]
    # bf16 against float32 (measured 5.3e-3 relative; the unfused bf16 layers 5.4e-3; a ReLU in place of a
    # GELU 6.6e-2): one rounding fewer per GELU, never farther from float32 than the unfused layers.
    assert relative(out, exact) <= 1e-2
    assert relative(out, exact) <= 1.05 * relative(unfused, exact)


def test_the_row_layer_norm_is_layer_norm():
    """float32: F.layer_norm to float32 rounding; bf16 (one rounding of y, of the row norm and of the product):
    within 2^-6 of the float32 result, relative to each row's unit scale."""
    torch.manual_seed(2)
    x = torch.randn(4096, 32) * 3 + 1.5  # a mean far from 0: the centering must take it out before the norm
    center = centering_weight(32, device=x.device, dtype=torch.float32)
    expected = F.layer_norm(x, (32,), None, None, NORM_EPS)
    torch.testing.assert_close(layer_norm_rows(x, center), expected, rtol=0, atol=2e-6)
    bf = layer_norm_rows(x.to(BF16), centering_weight(32, device=x.device, dtype=BF16))
    assert bf.dtype == BF16 and float((bf.float() - expected).abs().max()) <= 2**-6 * 4
    assert relative(bf, expected) <= 5e-3


def test_the_centering_weight_is_exact_in_bf16_for_the_released_width():
    w = centering_weight(32, device=torch.device("cpu"), dtype=BF16)[:, :, 0, 0].double()
    assert torch.equal(w, torch.eye(32, dtype=torch.float64) - 1 / 32)


@needs_fused_bf16
def test_the_fused_swish_is_silu_rounded_once():
    torch.manual_seed(3)
    conv = torch.nn.Conv2d(32, 32, 1).to(BF16).to(memory_format=CL).requires_grad_(False)
    x = torch.randn(1, 32, 4096, 1).to(BF16).contiguous(memory_format=CL) * 2
    exact = F.silu(F.conv2d(x.float(), conv.weight.float(), conv.bias.float()))
    fused = conv_act(x, conv, "swish")
    assert fused.dtype == BF16
    assert ((fused.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()
    conv32 = conv.float()
    x32 = x.float()
    assert torch.equal(conv_act(x32, conv32, "swish"), F.silu(conv32(x32)))


def test_the_decoder_in_bf16_stays_near_its_float32_decode():
    """The whole narrow decoder (DiCo blocks, the per-pixel path with its row LayerNorm, fused SiLUs and folded
    modulation) in bf16 channels-last against float32: measured 2.7e-3 relative (a GELU fused where the SiLU
    belongs: 2.8e-2)."""
    state = released_state(NARROW, seed=4)
    vae, vae_bf16 = mage_from_state_dict(state), mage_from_state_dict(state, dtype=BF16)
    z = torch.randn(1, 32, 12, 20, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = vae.decode(z)
        out = vae_bf16.decode(z.to(BF16))
    assert out.dtype == torch.float32  # MageVAE.decode keeps the float32 pixels its last layer computes
    assert relative(out, expected) <= 1e-2


def _released_pixel_mlp(unfolded: dict[str, torch.Tensor], x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The per-pixel MLP as the released layers compute it, one op after another on (N, c) rows: ``cond =
    SiLU(cond_embed(tokens))`` position-major, then per block ``x + gate * mlp(LN(x) (1 + scale) + shift)``."""

    def rows_conv(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        image = rows.contiguous().view(1, rows.shape[0], 1, rows.shape[1]).permute(0, 3, 1, 2)
        return F.conv2d(image, weight[:, :, None, None], bias).permute(0, 2, 3, 1).reshape(rows.shape[0], -1)

    px = x.shape[-1]
    flat = tokens.permute(0, 2, 3, 1).reshape(-1, tokens.shape[1])
    cond = F.silu(rows_conv(flat, unfolded["cond_embed.weight"], unfolded["cond_embed.bias"]).reshape(-1, px))
    x = x.clone()
    for i in range(NARROW.pixel_blocks):
        p = f"res_blocks.{i}."
        bias = unfolded[p + "adaLN_modulation.1.bias"].clone()
        bias[px : 2 * px] += 1
        shift, scale, gate = rows_conv(cond, unfolded[p + "adaLN_modulation.1.weight"], bias).chunk(3, dim=-1)
        h = F.layer_norm(x, (px,), unfolded[p + "in_ln.weight"], unfolded[p + "in_ln.bias"], NORM_EPS)
        h = rows_conv(torch.addcmul(shift, h, scale), unfolded[p + "mlp.0.weight"], unfolded[p + "mlp.0.bias"])
        h = rows_conv(F.silu(h), unfolded[p + "mlp.2.weight"], unfolded[p + "mlp.2.bias"])
        x.addcmul_(gate, h)
    return x


def test_the_final_layer_returns_its_float32_sum_from_a_norm_in_the_rows_dtype():
    """``rms_norm_linear`` leaves its float32 sum unrounded (the decoder's float32 image stores it as it is;
    issue 47), its per-row norm from bf16 rows rounded once: near the float64 result, and not bf16 values."""
    generator = torch.Generator().manual_seed(9)
    x = (torch.randn(4096, 32, generator=generator) * 3 + 0.5).to(BF16)
    linear = torch.nn.Linear(32, 3).to(BF16).requires_grad_(False)
    out = mage_vae.rms_norm_linear(x, linear)
    rows = x.double()
    expected = F.linear(
        rows * torch.rsqrt(rows.square().mean(-1, keepdim=True) + NORM_EPS),
        *map(torch.Tensor.double, (linear.weight, linear.bias)),
    )
    assert out.dtype == torch.float32
    assert relative(out, expected) <= 4e-3
    assert not torch.equal(out, out.to(BF16).float())  # not rounded to bf16 on the way


def test_the_decoders_unit_range_image_is_the_released_image_shifted_bit_for_bit_in_float32():
    """``unit_range=True`` (what ``MageVAE.decode`` asks, whole frame and tiled) is ``(x + 1) / 2`` of the
    [-1, 1] image computed in float32 per tile: bit for bit in float32 (whole frame and tiled each). A bf16
    decoder's image comes out float32, nearer float32's than the bf16 image shifted afterwards (measured 2.0e-3
    against 2.2e-3; rounded to bf16 on the way: 2.6e-3) (issue 47)."""
    from flowlift.models.mage_tiling import MageTiling, decode_tiled

    state = released_state(NARROW, seed=10, encoder=False)
    z = torch.randn(1, 128, 8, 12, generator=torch.Generator().manual_seed(11)).contiguous(memory_format=CL)
    tiling = MageTiling(tile=32, pixel_tile=3)
    decoder = mage_from_state_dict(state).model.decoder
    decoder_bf16 = mage_from_state_dict(state, dtype=BF16).model.decoder
    with torch.no_grad():
        released = decoder(z).add(1).div(2)
        assert torch.equal(decoder(z, unit_range=True), released)
        tiled = decode_tiled(decoder, z, tiling=tiling).add(1).div(2)
        assert torch.equal(decode_tiled(decoder, z, tiling=tiling, unit_range=True), tiled)
        unit = decoder_bf16(z.to(BF16), unit_range=True)
        image_bf16 = decoder_bf16(z.to(BF16))
    assert unit.dtype == torch.float32 and image_bf16.dtype == BF16
    shifted_after = image_bf16.float().add(1).div(2)
    assert relative(unit, released) <= relative(shifted_after, released) * 1.1


def test_the_float32_per_pixel_path_is_the_released_layers_bit_for_bit():
    """Float32 keeps the released sums (the LayerNorm with its affine, one modulation layer per block): the
    folded half-precision form reorders them, so float32 must not take it (issue 47: float32 pixels unchanged)."""
    state = released_state(NARROW, seed=7, encoder=False)
    unfolded = {k.removeprefix("pipeline.dec_net."): v for k, v in state.items() if k.startswith("pipeline.dec_net.")}
    net = mage_from_state_dict(state).model.decoder.dec_net
    generator = torch.Generator().manual_seed(8)
    tokens = torch.randn(1, NARROW.hidden, 3, 5, generator=generator).contiguous(memory_format=CL)
    x = torch.randn(3 * 5 * 256, NARROW.pixel_width, generator=generator)
    with torch.no_grad():
        assert torch.equal(net(x.clone(), tokens), _released_pixel_mlp(unfolded, x, tokens))


def test_float32_group_statistics_are_torchs_sums_bit_for_bit():
    """A float32 tile's GroupNorm sums and channel sums are torch's own over the tile, as before the chunked
    (half-precision) form: the float32 decode's statistics, and so its pixels, unchanged."""
    torch.manual_seed(9)
    x = (torch.randn(1, 64, 50, 167) + 2).contiguous(memory_format=CL)
    sums = GroupSums(64)
    sums.add(x)
    grouped = x.reshape(32, -1)
    assert torch.equal(sums.s1, grouped.sum(1).double()) and torch.equal(sums.s2, grouped.square().sum(1).double())
    assert torch.equal(channel_sums(x), x.sum(dim=(0, 2, 3), dtype=torch.float32).double())
    before = x.clone()
    channel_moments(x)  # squares a float32 copy in place, never the tile's own values
    assert torch.equal(x, before)


@pytest.mark.parametrize("layout", [CL, torch.contiguous_format])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_the_tile_statistics_are_the_float64_sums(layout, dtype):
    """Per-channel sums and sums of squares of a tile in either layout (a half tile's from torch's batch-norm
    statistics, in float32); GroupSums folds them into GroupNorm's statistics as group_norm_statistics computes
    them."""
    torch.manual_seed(6)
    x = (torch.randn(1, 64, 50, 167) + 2).to(dtype).contiguous(memory_format=layout)
    values = x.double()
    s1, s2 = channel_moments(x)
    torch.testing.assert_close(s1, values.sum((0, 2, 3)), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s2, values.square().sum((0, 2, 3)), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(channel_sums(x), values.sum((0, 2, 3)), rtol=1e-6, atol=1e-6)
    sums = GroupSums(64)
    sums.add(x)
    mean, inv_std = sums.finish(torch.device("cpu"))
    expected_mean, expected_inv_std = mage_vae.group_norm_statistics(x.float())
    torch.testing.assert_close(mean, expected_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(inv_std, expected_inv_std, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("offset", [0.0, 50.0])
def test_half_tile_mean_and_variance_in_float32_accuracy(offset):
    """A bf16 tile's channel mean and variance are accumulated in float32, never rounded to bf16 (that would be
    ~4e-3 relative, 0.1 standard deviation for the mean below): within 5e-6 of a standard deviation and 2e-4
    relative of float64's, also for channels whose mean is 50 standard deviations (where float32 sums of squares
    lose 4e-4 of the variance)."""
    torch.manual_seed(5)
    x = (torch.randn(1, 384, 64, 96) + offset).to(BF16).contiguous(memory_format=CL)
    mean, var = channel_mean_var(x)
    assert mean.dtype == var.dtype == torch.float32
    values = x.double()
    expected_var = values.var((0, 2, 3), unbiased=False)
    assert float(((mean.double() - values.mean((0, 2, 3))).abs() / expected_var.sqrt()).max()) < 5e-6
    assert float(((var.double() - expected_var).abs() / expected_var).max()) < 2e-4


def _sdpa_windows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """Window attention through torch's fused SDPA kernel in the inputs' dtype (the edge windows replicate-padded)."""
    b, c, h, w = q.shape
    rows, cols = -(-h // window), -(-w // window)

    def cells(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t, (0, -w % window, 0, -h % window), mode="replicate")
        t = t.reshape(b, c, rows, window, cols, window).permute(0, 2, 4, 3, 5, 1)
        return t.reshape(-1, 1, window * window, c)

    out = F.scaled_dot_product_attention(cells(q), cells(k), cells(v))
    out = out.reshape(b, rows, cols, window, window, c).permute(0, 5, 1, 3, 2, 4)
    return out.reshape(b, c, rows * window, cols * window)[:, :, :h, :w]


def test_bf16_window_attention_takes_float32_scores_and_float32_the_fused_kernel():
    """bf16 on the CPU: scores and softmax in float32, ``SCORE_CHUNK`` windows at a time, about as far from
    float32 as torch's fused bf16 kernel (here 5.2e-3 against 5.0e-3; bf16 scores from ``bmm``: 8.7e-3, caught).
    float32: torch's fused kernel, bit for bit as before."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 36, 20, 44, generator=g) * 2 for _ in range(3))  # 3 x 6 windows of 8, edges padded
    exact = mage_vae.window_attention(q, k, v, 8)
    assert torch.equal(exact, _sdpa_windows(q, k, v, 8))
    low = [t.to(BF16) for t in (q, k, v)]
    out = mage_vae.window_attention(*low, 8)
    assert out.dtype == BF16 and out.shape == exact.shape
    assert relative(out, exact) <= 1.25 * relative(_sdpa_windows(*low, 8), exact)


def test_the_folded_attention_projections_are_the_released_four():
    """``WindowAttentionBlock.fold``: ``vo(window_attention(qk(h), h, h))`` is ``proj_out(window_attention(q(h),
    k(h), v(h)))`` (the dropped score term is the same for every key of a query) to float64 rounding, on a frame
    whose last row and column of windows are replicate-padded. bf16 takes the folded two and stays as near the
    exact result as the released four in bf16 (here 6.0e-3 against 7.3e-3: two roundings fewer); float32 keeps
    the released four, bit for bit."""
    torch.manual_seed(9)
    block = mage_vae.WindowAttentionBlock(32, 8).to(torch.float64).eval().requires_grad_(False)
    h = torch.randn(1, 32, 20, 28, dtype=torch.float64)  # 3 x 4 windows of 8, the last row and column padded

    def released(b: mage_vae.WindowAttentionBlock, x: torch.Tensor) -> torch.Tensor:
        return b.proj_out(mage_vae.window_attention(b.q(x), b.k(x), b.v(x), 8))

    with torch.no_grad():
        for p in block.parameters():
            p.mul_(3.0)  # scores of several units: softmax weights far from uniform
        block.fold()
        exact = released(block, h)
        folded = block.vo(mage_vae.window_attention(block.qk(h), h, h, 8))
        torch.testing.assert_close(folded, exact, rtol=0, atol=1e-10)
        low = h.to(BF16)
        block.to(BF16)
        out = block.attend(low)
        assert torch.equal(out, block.vo(mage_vae.window_attention(block.qk(low), low, low, 8)))
        assert relative(out, exact) <= 1.1 * relative(released(block, low), exact)
        block.float()
        assert torch.equal(block.attend(h.float()), released(block, h.float()))


def test_the_pixel_fold_by_positions_is_the_fold_at_once_bit_for_bit():
    """``MageDecoder.fold_pixels`` multiplies ``A = W_in W_xy`` into ``W_y[p]`` a few positions at a time
    (``PIXEL_FOLD_POSITIONS``): the same float64 products, rounded once to the weights' dtype, as all 256 in
    one ``matmul``."""
    torch.manual_seed(3)
    decoder = mage_vae.MageVAEModel(NARROW, encoder=False).decoder
    y, w_x, w_in = decoder.y_embedder_x, decoder.x_embedder.embedder[0].weight, decoder.dec_net.input_proj.weight
    px, c = NARROW.pixel_width, NARROW.hidden
    f64 = torch.float64
    a = w_in.to(f64) @ w_x.to(f64)[:, 3 : 3 + px]
    w_y = y.weight.to(f64).reshape(px, 256, c).transpose(0, 1)
    expected = torch.matmul(a, w_y).reshape(256 * px, c).to(y.weight.dtype)
    decoder.fold_pixels()
    assert mage_vae.PIXEL_FOLD_POSITIONS < 256
    assert torch.equal(decoder.pixel_embed.weight[:, :, 0, 0], expected)


@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
def test_folding_into_the_target_dtype_is_folding_then_converting_bit_for_bit(dtype):
    """``fold_t0(dtype)`` stores the folded DiCo weights in ``dtype`` directly (no float32 copy): the same
    values as folding in float32 and converting after, for every parameter of both sides."""
    config = NARROW
    torch.manual_seed(4)
    plain, direct = mage_vae.MageVAEModel(config), mage_vae.MageVAEModel(config)
    direct.load_state_dict(plain.state_dict())
    expected = plain.fold_t0().to(dtype).state_dict()
    got = direct.fold_t0(dtype).to(dtype).state_dict()
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        assert got[name].dtype == dtype and torch.equal(got[name], value), name
    # The large folded layers come out already in dtype, so the conversion after has nothing to copy.
    fresh = mage_vae.MageVAEModel(config).fold_t0(dtype)
    assert all(b.conv1.weight.dtype == dtype and b.conv5.weight.dtype == dtype for b in fresh.decoder.blocks)
