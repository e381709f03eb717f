"""Mage-VAE: the one-step diffusion codec of Microsoft's Mage-Flow, at t = 0, in flowlift's own code.

Written from the published description of the reference (``mage_flow/models/modules/mage_vae.py`` in
the public MIT-licensed repository ``microsoft/Mage``); module and parameter names follow the released
checkpoint's keys (``student.dconv_encoder.*`` -> ``encoder.*``, ``pipeline.*`` -> ``decoder.*``), so a
released file loads strictly (:mod:`flowlift.models.mage_vae_files`, through ``load_vae``).

The codec's latent is 128 channels at 1/16 of the image: FLUX.2's *normalized, patchified* latent
(Mage-Flow regularizes it toward FLUX.2-VAE latents; the diffusers port unpatchifies it 2x2 and
denormalizes it with FLUX.2's BN statistics to get raw FLUX.2 latents). Images are [-1, 1] here.

**Encoder** (image -> posterior mean), ``DConvEncoder`` at t = 0 with z_t = 0::

    cond = proj_down(head_blocks(patch_cond_embed(x)))       # 16-px patches -> 768 -> 2 DiCo -> 384
    s    = fuse_proj([cond, z_proj(z_t)])                    # z_t = 0: z_proj(0) = z_proj.bias, a constant
    s    = blocks(s)                                         # 21 DiCo blocks, adaLN at t = 0
    mean = proj_out(norm_out(s))[:, :128]                    # the log-variance half is never computed

**Decoder** (latent -> image), the CoD decoder then the DConv denoiser at t = 0 with noise x = 0::

    cond = cod_decoder(z)                                    # conv, 3 GN ResNet + 2 window-attention blocks, conv
    s    = blocks(s_embedder(x, cond))                       # x = 0: proj1(0) = 0, so s = proj2([0, cond])
    y    = per-pixel features: y_embedder_x(cond) (32 per pixel), DCT position features, x = 0
    out  = final_layer(dec_net(x_embedder(y), s))            # 3 adaLN MLP blocks per pixel, RMSNorm, linear
    image = fold(out)                                        # 16x16 pixels per latent position

**The t = 0 fold.** A DiCo block's adaLN modulation ``(shift, scale, gate) x 2 = adaLN(t_embedder(0))``
is one constant per block. :meth:`MageVAEModel.fold_t0` computes it once, after loading, and folds it
into the block's 1x1 convolutions (exact algebra, float rounding aside), since every modulation sits
next to a pointwise convolution::

    conv1(n * (1 + scale) + shift) = (W1 diag(1 + scale)) n + (W1 shift + b1)
    inp + gate * conv3(h)          = inp + (diag(gate) W3) h + gate * b3

The folded block then has the form of the encoder's head blocks (no modulation; plain LayerNorms), and ``t_embedder``
and ``adaLN_modulation`` are dropped (~37M parameters). The per-pixel MLP blocks' adaLN is *not*
constant (it is conditioned on the per-position feature) and stays.

**Global operations** (what a tiled executor must gather over the whole frame) are small separate
functions: :func:`channel_means` / :func:`channel_gate` (every DiCo block's channel attention),
:func:`group_norm_statistics` / :func:`group_norm_apply` (the CoD decoder's GroupNorms) and
:func:`window_attention` (self-attention over a fixed 32x32-latent window grid anchored at the top-left,
the last row/column of windows replicate-padded). Everything else is pointwise or a 3x3 convolution.
:mod:`flowlift.models.mage_tiling` runs the codec exactly on tiles from these pieces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flowlift.models.fused_conv import conv_act

#: Latent channels of the codec (FLUX.2's patchified latent) and its downsampling factor.
MAGE_LATENT_CHANNELS = 128
MAGE_PATCH = 16
#: Every norm of the codec uses this epsilon; the CoD decoder's GroupNorms have 32 groups.
NORM_EPS = 1e-6
GROUPS = 32
#: Pixel positions per step of :meth:`MageDecoder.fold_pixels` (16 of the 256: 1.5 MB of float64 at a time).
PIXEL_FOLD_POSITIONS = 16


@dataclass(frozen=True)
class MageVAEConfig:
    """Widths and depths; the defaults are the released codec. Tests build narrow ones."""

    hidden: int = 384  # DiCo width of both sides, CoD decoder width
    encoder_head: int = 768  # width of the encoder's patch embedding and head blocks
    encoder_head_blocks: int = 2
    encoder_blocks: int = 21
    decoder_blocks: int = 21  # the denoiser's DiCo ("cond") blocks
    pixel_width: int = 32  # per-pixel feature width of the decoder's MLP
    pixel_blocks: int = 3  # adaLN MLP residual blocks per pixel (24 blocks - 21 cond blocks)
    mlp_ratio: float = 4.0
    dct_freqs: int = 8
    attention_window: int = 32  # latent pixels per side of an attention window
    timestep_features: int = 256


def infer_config(shapes: dict[str, tuple[int, ...]]) -> MageVAEConfig:
    """The :class:`MageVAEConfig` that ``shapes`` (flowlift names ``encoder.*`` / ``decoder.*``) were made with.

    Widths and depths are read from the tensors; ``attention_window`` leaves no trace in the weights and
    keeps the released 32. Missing tensors fall back to the released values (the strict load that follows
    then names them).
    """
    base = MageVAEConfig()

    def dim(key: str, axis: int, default: int) -> int:
        shape = shapes.get(key)
        return int(shape[axis]) if shape is not None and len(shape) > axis else default

    def count(prefix: str, default: int) -> int:
        found = {k[len(prefix) :].split(".", 1)[0] for k in shapes if k.startswith(prefix)}
        return len(found) if found else default

    side = "decoder" if any(k.startswith("decoder.") for k in shapes) else "encoder"
    hidden = dim(f"{side}.blocks.0.conv1.weight", 0, base.hidden)
    pixel_width = dim("decoder.dec_net.input_proj.weight", 0, base.pixel_width)
    x_in = dim("decoder.x_embedder.embedder.0.weight", 1, 3 + pixel_width + base.dct_freqs**2)
    return MageVAEConfig(
        hidden=hidden,
        encoder_head=dim("encoder.patch_cond_embed.weight", 0, base.encoder_head),
        encoder_head_blocks=count("encoder.head_blocks.", base.encoder_head_blocks),
        encoder_blocks=count("encoder.blocks.", base.encoder_blocks),
        decoder_blocks=count("decoder.blocks.", base.decoder_blocks),
        pixel_width=pixel_width,
        pixel_blocks=count("decoder.dec_net.res_blocks.", base.pixel_blocks),
        mlp_ratio=dim(f"{side}.blocks.0.conv4.weight", 0, int(base.mlp_ratio * hidden)) / hidden,
        dct_freqs=max(1, round(math.sqrt(max(x_in - 3 - pixel_width, 1)))),
        timestep_features=dim(f"{side}.t_embedder.mlp.0.weight", 1, base.timestep_features),
    )


# --------------------------------------------------------------------------------------------------
# Small pure functions (the global ones are what a tiled executor calls)
# --------------------------------------------------------------------------------------------------


def keeps_released_sums(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` runs the released sums bit for bit (float32 and wider: issue 47's "float32 pixels
    unchanged"); half dtypes take the folded and reordered forms (per-pixel modulation, attention projections,
    tile statistics), each within a stated distance of float32."""
    return torch.finfo(dtype).bits >= 32


def layer_norm_2d(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """LayerNorm over channels at every pixel of (B, C, H, W): ``(x - mean_c) / sqrt(var_c + 1e-6) * w + b``."""
    y = F.layer_norm(x.permute(0, 2, 3, 1), (x.shape[1],), weight, bias, NORM_EPS)
    return y.permute(0, 3, 1, 2)


def channel_means(x: torch.Tensor) -> torch.Tensor:
    """Global average over the frame, (B, C, H, W) -> (B, C, 1, 1): the only global input of a DiCo block.

    A tiled executor sums each tile's ``x.sum((2, 3))`` and divides by ``H * W``.
    """
    return x.mean(dim=(2, 3), keepdim=True)


def channel_gate(means: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """Channel attention weights ``sigmoid(conv1x1(means))``, (B, C, 1, 1)."""
    return torch.sigmoid(conv(means))


def group_norm_statistics(x: torch.Tensor, groups: int = GROUPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (sample, group) mean and ``1 / sqrt(var + 1e-6)`` over the whole frame, each (B, groups).

    Computed in float32 (biased variance, as GroupNorm). A tiled executor gathers the per-group sums
    of ``x`` and ``x**2`` instead (a first pass) and finishes with the same formula.
    """
    b, c = x.shape[:2]
    grouped = x.reshape(b, groups, -1).float()
    var, mean = torch.var_mean(grouped, dim=2, unbiased=False)
    return mean, torch.rsqrt(var + NORM_EPS)


def group_norm_apply(
    x: torch.Tensor, mean: torch.Tensor, inv_std: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """``(x - mean_g) * inv_std_g * weight_c + bias_c`` with group statistics from :func:`group_norm_statistics`.

    Pointwise given the statistics, so it runs on any tile of the frame. As ``x * scale_c + shift_c`` with
    ``scale = inv_std * weight`` and ``shift = bias - mean * scale`` in float32, rounded once to x's dtype;
    for one sample that is an inference-mode batch norm with mean 0, variance 1 and epsilon 0 (one pass
    over x, in its layout, where the plain formula takes four).
    """
    b, c = x.shape[:2]
    groups = mean.shape[1]
    scale = inv_std.repeat_interleave(c // groups, dim=1) * weight.float()  # (B, C)
    shift = bias.float() - mean.repeat_interleave(c // groups, dim=1) * scale
    if b == 1:
        zero, one = torch.zeros_like(scale[0]), torch.ones_like(scale[0])
        return F.batch_norm(x, zero, one, scale[0], shift[0], False, 0.0, 0.0)
    return (x.float() * scale[:, :, None, None] + shift[:, :, None, None]).to(x.dtype)


def group_norm(x: torch.Tensor, norm: nn.GroupNorm) -> torch.Tensor:
    """Whole-frame GroupNorm: :func:`group_norm_statistics` then :func:`group_norm_apply`."""
    mean, inv_std = group_norm_statistics(x, norm.num_groups)
    return group_norm_apply(x, mean, inv_std, norm.weight, norm.bias)


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """Single-head softmax attention inside each ``window x window`` cell of a grid anchored at (0, 0).

    q, k, v: (B, C, H, W). Sides that are not multiples of ``window`` are first padded at the bottom
    and right by repeating the last row / column (those padded keys *take part* in the edge windows'
    softmax, as in the reference), and the output is cropped back. Scale ``C ** -0.5``. Each window
    is independent: a tile aligned to the grid that holds whole windows computes them exactly.
    """
    b, c, h, w = q.shape
    pad_h, pad_w = -h % window, -w % window
    if pad_h or pad_w:
        q, k, v = (F.pad(t, (0, pad_w, 0, pad_h), mode="replicate") for t in (q, k, v))
    rows, cols = (h + pad_h) // window, (w + pad_w) // window

    def to_windows(t: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B * cells, window², C)
        t = t.reshape(b, c, rows, window, cols, window).permute(0, 2, 4, 3, 5, 1)
        return t.reshape(b * rows * cols, window * window, c)

    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        out = attention_float32_scores(*(to_windows(t) for t in (q, k, v)))
    else:
        # (cells, 1 head, window², C): the 4-D form takes torch's fused CPU kernel, not the one that
        # materializes every window's (window², window²) softmax weights.
        out = F.scaled_dot_product_attention(*(to_windows(t).unsqueeze(1) for t in (q, k, v)))
    out = out.reshape(b, rows, cols, window, window, c).permute(0, 5, 1, 3, 2, 4)
    return out.reshape(b, c, rows * window, cols * window)[:, :, :h, :w]


#: Windows per step of :func:`attention_float32_scores` (2 windows of 1024 positions: 8 MiB of float32 scores).
SCORE_CHUNK = 2


def attention_float32_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``softmax(q k^T / sqrt(C)) v`` per window, q, k, v (cells, n, C) in bf16 -> (cells, n, C) in bf16.

    The scores and the softmax in float32 (q and k converted, so the products are exact and summed in float32,
    as torch's fused kernel does), the weights rounded to bf16 for the product with v; :data:`SCORE_CHUNK`
    windows at a time. On the 2-core AMD EPYC, 16 windows of 1024 x 384: 220 against 280 ms for torch's fused
    SDPA kernel, relative error vs float32 2.3e-3 against 2.2e-3 (bf16 scores were faster still but doubled it).
    """
    out = torch.empty_like(q)
    scale = q.shape[-1] ** -0.5
    for i in range(0, q.shape[0], SCORE_CHUNK):
        part = slice(i, i + SCORE_CHUNK)
        scores = torch.bmm(q[part].float(), k[part].float().transpose(1, 2)).mul_(scale)
        torch.bmm(torch.softmax(scores, -1).to(v.dtype), v[part], out=out[part])
    return out


def timestep_features(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features ``[cos(t f_i), sin(t f_i)]`` with ``f_i = max_period ** (-i / (dim/2))``.

    At t = 0 this is ``dim/2`` ones then ``dim/2`` zeros.
    """
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def dct_position_features(patch: int, freqs: int, *, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """DCT features of the ``patch x patch`` pixel positions inside a patch, (patch², freqs²).

    For pixel (y, x) with ``py = y / (patch - 1)``, ``px = x / (patch - 1)`` and frequencies
    ``f_0..f_{n-1} = linspace(0, n, n)`` (so 0 .. n, not 0 .. n-1), feature ``i * n + j`` is
    ``cos(pi px f_i) cos(pi py f_j) / (1 + f_i f_j)``. Positions are row-major (``y * patch + x``).
    """
    pos = torch.linspace(0, 1, patch, dtype=torch.float32, device=device)
    pos_y, pos_x = torch.meshgrid(pos, pos, indexing="ij")
    f = torch.linspace(0, freqs, freqs, dtype=torch.float32, device=device)
    cos_x = torch.cos(pos_x.reshape(-1, 1, 1) * f[None, :, None] * math.pi)  # (P², n, 1)
    cos_y = torch.cos(pos_y.reshape(-1, 1, 1) * f[None, None, :] * math.pi)  # (P², 1, n)
    weight = 1.0 / (1.0 + f[:, None] * f[None, :])
    return (cos_x * cos_y * weight).reshape(patch * patch, freqs * freqs).to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight * x / sqrt(mean(x²) + 1e-6)`` over the last dim, computed in float32."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS)).to(x.dtype)


# --------------------------------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------------------------------


class TimestepEmbedder(nn.Module):
    """``mlp(timestep_features(t))``: Linear(256 -> C), SiLU, Linear(C -> C). Used only to fold t = 0."""

    def __init__(self, hidden: int, features: int = 256, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.features = features
        self.mlp = nn.Sequential(
            nn.Linear(features, hidden, device=device), nn.SiLU(), nn.Linear(hidden, hidden, device=device)
        )

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(timestep_features(t, self.features).to(self.mlp[0].weight.dtype))


class DiCoBlock(nn.Module):
    """Depthwise-conv block with channel attention; ``modulated`` blocks carry adaLN until folded.

    Folded (or unmodulated) form, on (B, C, H, W)::

        h = conv3(a * gate),  a = gelu(dwconv3x3(conv1(norm1(x)))),  gate = channel_gate(channel_means(a))
        x = x + h
        x = x + conv5(gelu(conv4(norm2(x))))

    The encoder's head blocks have affine LayerNorms; modulated blocks have plain ones, and their
    ``adaLN_modulation`` (SiLU, Linear(C -> 6C)) gives shift/scale/gate for each half, folded by
    :meth:`fold_modulation`.
    """

    def __init__(
        self, channels: int, mlp_ratio: float, *, modulated: bool, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        ffn = int(mlp_ratio * channels)
        self.conv1 = nn.Conv2d(channels, channels, 1, device=device)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, groups=channels, device=device)
        self.conv3 = nn.Conv2d(channels, channels, 1, device=device)
        # Index 1 of the released Sequential (pool, conv, sigmoid); the pool and sigmoid are channel_gate.
        self.ca = nn.Sequential(nn.Identity(), nn.Conv2d(channels, channels, 1, device=device))
        self.conv4 = nn.Conv2d(channels, ffn, 1, device=device)
        self.conv5 = nn.Conv2d(ffn, channels, 1, device=device)
        self.norm1 = nn.LayerNorm(channels, eps=NORM_EPS, elementwise_affine=not modulated, device=device)
        self.norm2 = nn.LayerNorm(channels, eps=NORM_EPS, elementwise_affine=not modulated, device=device)
        self.adaLN_modulation = (
            nn.Sequential(nn.SiLU(), nn.Linear(channels, 6 * channels, device=device)) if modulated else None
        )

    @torch.no_grad()
    def fold_modulation(self, c: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Fold ``adaLN_modulation(c)`` (c: (1, C), the t = 0 embedding) into conv1/conv3/conv4/conv5; the
        folded weights stored in ``dtype`` (default: theirs)."""
        if self.adaLN_modulation is None:
            return
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaLN_modulation(c)[0].chunk(6)
        _fold_input_affine(self.conv1, 1 + scale1, shift1, dtype)
        _fold_output_scale(self.conv3, gate1, dtype)
        _fold_input_affine(self.conv4, 1 + scale2, shift2, dtype)
        _fold_output_scale(self.conv5, gate2, dtype)
        self.adaLN_modulation = None

    def gated_conv3(self, a: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``conv3(a * gate)``; for one sample as ``(W3 diag(gate)) a + b3``, the gate folded into the weight."""
        if gate.shape[0] != 1:
            return self.conv3(a * gate)
        return F.conv2d(a, self.conv3.weight * gate.reshape(1, -1, 1, 1), self.conv3.bias)

    def branch_pre_gate(self, x: torch.Tensor) -> torch.Tensor:
        """``gelu(dwconv(conv1(norm1(x))))``: local (a 3x3 halo); its channel means feed the gate. The GELU
        runs in the depthwise convolution's pass (:func:`~flowlift.models.fused_conv.conv_act`)."""
        return conv_act(self.conv1(layer_norm_2d(x, self.norm1.weight, self.norm1.bias)), self.conv2, "gelu")

    def mlp_half(self, x: torch.Tensor) -> torch.Tensor:
        """The second residual branch, pointwise; the GELU runs in conv4's pass (``fused_conv.conv_act``).

        The residual adds stay separate ``add_`` passes: oneDNN's fused add (``conv_add_act``) measured slower here
        (conv5 at 64x192 positions 67.3 against 65.7 ms, conv3 20.3 against 18.3; bf16, the 2-core AMD EPYC).
        """
        return self.conv5(conv_act(layer_norm_2d(x, self.norm2.weight, self.norm2.bias), self.conv4, "gelu"))

    def finish(self, x: torch.Tensor, a: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The block from its branch ``a`` and gate: ``y = x + conv3(a * gate)``, then ``y + mlp_half(y)``."""
        y = self.gated_conv3(a, gate).add_(x)
        return self.mlp_half(y).add_(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.adaLN_modulation is not None:
            raise RuntimeError("DiCoBlock: call MageVAEModel.fold_t0() after loading, before running")
        a = self.branch_pre_gate(x)
        return self.finish(x, a, channel_gate(channel_means(a), self.ca[1]))


def _fold_input_affine(conv: nn.Conv2d, scale: torch.Tensor, shift: torch.Tensor, dtype: torch.dtype | None) -> None:
    """conv1x1(x * scale + shift) == conv'(x): W' = W diag(scale), b' = b + W shift."""
    w = conv.weight[:, :, 0, 0]
    bias = conv.bias + w.float().matmul(shift.float()).to(conv.bias.dtype)
    _replace(conv, _product(conv.weight, scale.to(conv.weight.dtype)[None, :, None, None], dtype), bias)


def _fold_output_scale(conv: nn.Conv2d, gate: torch.Tensor, dtype: torch.dtype | None) -> None:
    """gate * conv1x1(x) == conv'(x): W' = diag(gate) W, b' = gate * b."""
    weight = _product(conv.weight, gate.to(conv.weight.dtype)[:, None, None, None], dtype)
    _replace(conv, weight, conv.bias * gate.to(conv.bias.dtype))


def _product(weight: torch.Tensor, factor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``weight * factor`` computed in their dtype and stored in ``dtype``: the same values as
    ``(weight * factor).to(dtype)`` without the intermediate tensor (the weights' float32 products rounded
    once more)."""
    out = torch.empty(weight.shape, dtype=dtype or weight.dtype, device=weight.device)
    return torch.mul(weight, factor, out=out)


def _replace(conv: nn.Conv2d, weight: torch.Tensor, bias: torch.Tensor) -> None:
    """Give ``conv`` new parameter tensors. Folding into new tensors, not in place: loaded weights are often
    pages of the mapped file, and writing into them copies each page on a fault (on the 2-core AMD EPYC,
    Mage-VAE's load took 1.55 CPU-s so, 0.60 without; issue 47)."""
    conv.weight = nn.Parameter(weight, conv.weight.requires_grad)
    conv.bias = nn.Parameter(bias, conv.bias.requires_grad)


class ResnetBlock(nn.Module):
    """``x + conv2(silu(GN(conv1(silu(GN(x))))))`` with 3x3 convolutions and 32-group GroupNorms."""

    def __init__(self, channels: int, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(GROUPS, channels, eps=NORM_EPS, device=device)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, device=device)
        self.norm2 = nn.GroupNorm(GROUPS, channels, eps=NORM_EPS, device=device)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(group_norm(x, self.norm1), inplace=True))
        return self.conv2(F.silu(group_norm(h, self.norm2), inplace=True)).add_(x)


class WindowAttentionBlock(nn.Module):
    """``x + proj_out(window_attention(q(GN(x)), k(GN(x)), v(GN(x))))`` with 1x1 projections.

    **The projections folded** (:meth:`fold`, for half dtypes): with ``h`` the normalized input, a query
    ``q_i = W_q h_i + b_q`` and a key ``k_j = W_k h_j + b_k`` score ``q_i . k_j = (W_k^T W_q h_i + W_k^T b_q) . h_j
    + (q_i . b_k)``, and the last term is the same for every key of a query, which its softmax ignores; the
    weights ``P_ij`` of a query sum to 1, so ``proj_out(sum_j P_ij v_j) = (W_o W_v) sum_j P_ij h_j + (W_o b_v +
    b_o)``. Two 1x1 convolutions instead of four: ``qk`` (``W_k^T W_q``, ``W_k^T b_q``) gives the queries that
    score the normalized input itself, and ``vo`` (``W_o W_v``, ``W_o b_v + b_o``) maps the weighted sums of the
    normalized input to the output. Float32 (and wider) keeps the released four.
    """

    def __init__(self, channels: int, window: int, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.window = window
        self.norm = nn.GroupNorm(GROUPS, channels, eps=NORM_EPS, device=device)
        self.q = nn.Conv2d(channels, channels, 1, device=device)
        self.k = nn.Conv2d(channels, channels, 1, device=device)
        self.v = nn.Conv2d(channels, channels, 1, device=device)
        self.proj_out = nn.Conv2d(channels, channels, 1, device=device)
        self.qk: nn.Conv2d | None = None
        self.vo: nn.Conv2d | None = None

    @torch.no_grad()
    def fold(self) -> None:
        """Make ``qk`` and ``vo`` (see the class), computed in float64, stored in the weights' dtype."""
        f64 = torch.float64
        w_q, w_k, w_v, w_o = (c.weight[:, :, 0, 0].to(f64) for c in (self.q, self.k, self.v, self.proj_out))
        dtype = self.q.weight.dtype
        qk = (w_k.t() @ w_q, w_k.t() @ self.q.bias.to(f64))
        vo = (w_o @ w_v, w_o @ self.v.bias.to(f64) + self.proj_out.bias.to(f64))
        self.qk, self.vo = (_conv_from(_linear_from(w.to(dtype), b.to(dtype))) for w, b in (qk, vo))

    def attend(self, h: torch.Tensor) -> torch.Tensor:
        """``proj_out(window_attention(q(h), k(h), v(h)))`` of the normalized input ``h``: the released four
        projections in float32 and wider (and before :meth:`fold`), else the folded two."""
        if self.qk is None or self.vo is None or keeps_released_sums(h.dtype):
            return self.proj_out(window_attention(self.q(h), self.k(h), self.v(h), self.window))
        return self.vo(window_attention(self.qk(h), h, h, self.window))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attend(group_norm(x, self.norm))


class CoDDecoder(nn.Module):
    """Latent (B, 128, h, w) -> conditioning features (B, C, h, w): conv, R A R A R, GN, SiLU, conv."""

    def __init__(self, channels: int, window: int, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.window = window
        self.conv_in = nn.Conv2d(MAGE_LATENT_CHANNELS, channels, 3, padding=1, device=device)
        self.block = nn.Sequential(
            ResnetBlock(channels, device=device),
            WindowAttentionBlock(channels, window, device=device),
            ResnetBlock(channels, device=device),
            WindowAttentionBlock(channels, window, device=device),
            ResnetBlock(channels, device=device),
        )
        self.norm_out = nn.GroupNorm(GROUPS, channels, eps=NORM_EPS, device=device)
        self.conv_out = nn.Conv2d(channels, channels, 3, padding=1, device=device)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.block(self.conv_in(z))
        return self.conv_out(F.silu(group_norm(h, self.norm_out), inplace=True))


class _Holder(nn.Module):
    """A named container, so that state-dict keys keep the released nesting (``y_embedder.decoder``)."""


# --------------------------------------------------------------------------------------------------
# Encoder
# --------------------------------------------------------------------------------------------------


class MageEncoder(nn.Module):
    """``student.dconv_encoder``: image [-1, 1] (B, 3, H, W), sides multiples of 16 -> mean (B, 128, H/16, W/16)."""

    def __init__(self, config: MageVAEConfig, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        c, head = config.hidden, config.encoder_head
        self.patch_cond_embed = nn.Conv2d(3, head, MAGE_PATCH, stride=MAGE_PATCH, device=device)
        self.head_blocks = nn.ModuleList(
            DiCoBlock(head, config.mlp_ratio, modulated=False, device=device) for _ in range(config.encoder_head_blocks)
        )
        self.proj_down = nn.Conv2d(head, c, 1, device=device)
        self.z_proj = nn.Conv2d(MAGE_LATENT_CHANNELS, c, 1, device=device)
        self.fuse_proj = nn.Conv2d(2 * c, c, 1, device=device)
        self.t_embedder: TimestepEmbedder | None = TimestepEmbedder(c, config.timestep_features, device=device)
        self.blocks = nn.ModuleList(
            DiCoBlock(c, config.mlp_ratio, modulated=True, device=device) for _ in range(config.encoder_blocks)
        )
        self.norm_out = nn.LayerNorm(c, eps=NORM_EPS, device=device)
        self.proj_out = nn.Conv2d(c, 2 * MAGE_LATENT_CHANNELS, 1, device=device)

    def stem(self, x: torch.Tensor) -> torch.Tensor:
        """Patch embedding, head blocks, projection and the fuse with z_t = 0: (B, 3, H, W) -> (B, C, H/16, W/16).

        ``fuse_proj([cond, z_proj(0)]) = W_cond cond + (W_z z_proj.bias + fuse_proj.bias)``.
        """
        cond = self.patch_cond_embed(x)
        for block in self.head_blocks:
            cond = block(cond)
        return self.project(cond)

    def project(self, cond: torch.Tensor) -> torch.Tensor:
        """``proj_down`` and the fuse with z_t = 0 (pointwise), the last step of :meth:`stem`."""
        cond = self.proj_down(cond)
        c = cond.shape[1]
        w_cond = self.fuse_proj.weight[:, :c]
        w_zero = self.fuse_proj.weight[:, c:, 0, 0]
        bias = self.fuse_proj.bias + w_zero.matmul(self.z_proj.bias)
        return F.conv2d(cond, w_cond, bias)

    def head(self, s: torch.Tensor) -> torch.Tensor:
        """LayerNorm and the mean half of ``proj_out``: (B, C, h, w) -> (B, 128, h, w)."""
        s = layer_norm_2d(s, self.norm_out.weight, self.norm_out.bias)
        return F.conv2d(s, self.proj_out.weight[:MAGE_LATENT_CHANNELS], self.proj_out.bias[:MAGE_LATENT_CHANNELS])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stem(x)
        for block in self.blocks:
            s = block(s)
        return self.head(s)


# --------------------------------------------------------------------------------------------------
# Decoder
# --------------------------------------------------------------------------------------------------


class PixelResBlock(nn.Module):
    """Per-pixel ``x + gate * mlp(LN(x) * (1 + scale) + shift)``, (shift, scale, gate) = Linear(SiLU(cond)).

    After :meth:`PixelMLP.fold` the three blocks' ``adaLN_modulation`` live in ``PixelMLP.modulation`` (the
    ``1 +`` in its bias) and, with the LayerNorm's affine folded in too, ``PixelMLP.modulation_ln``; they are
    None here, and ``mlp``'s layers are 1x1 convolutions (``lin1``, ``lin2``) on channels-last rows.
    """

    def __init__(self, channels: int, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_ln = nn.LayerNorm(channels, eps=NORM_EPS, device=device)
        self.mlp: nn.Sequential | None = nn.Sequential(
            nn.Linear(channels, channels, device=device), nn.SiLU(), nn.Linear(channels, channels, device=device)
        )
        self.adaLN_modulation: nn.Sequential | None = nn.Sequential(
            nn.SiLU(), nn.Linear(channels, 3 * channels, device=device)
        )
        self.lin1: nn.Conv2d | None = None
        self.lin2: nn.Conv2d | None = None

    def forward(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The released sums (float32 and wider, bit for bit): ``x + gate * mlp(LN(x) * scale + shift)`` on
        contiguous (N, c) rows, ``scale`` already ``1 + scale`` (``PixelMLP.modulation``); in place on x."""
        h = F.layer_norm(x, x.shape[-1:], self.in_ln.weight, self.in_ln.bias, NORM_EPS)
        h = conv_rows(torch.addcmul(shift, h, scale), self.lin1)
        h = conv_rows(F.silu(h, inplace=True), self.lin2)
        return x.addcmul_(gate, h)

    def forward_folded(
        self, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, gate: torch.Tensor, center: torch.Tensor
    ) -> torch.Tensor:
        """The half-precision form of :meth:`forward`: ``x + gate * mlp(n(x) * scale + shift)``, ``n(x)`` the
        plain (affine-free) LayerNorm, ``scale``/``shift`` from ``PixelMLP.modulation_ln``, ``center`` the
        :func:`centering_weight`. As :func:`layer_norm_rows` then one ``addcmul``, the SiLU in ``lin1``'s pass
        (:func:`~flowlift.models.fused_conv.conv_act`, bf16 on the CPU)."""
        h = torch.addcmul(shift, layer_norm_rows(x, center), scale)
        h = conv_act(rows_as_image(h), self.lin1, "swish")
        return x.addcmul_(gate, image_as_rows(self.lin2(h)))


def centering_weight(width: int, *, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The 1x1 convolution weight (width, width, 1, 1) of ``x - mean(x)`` over channels: ``I - 1/width``.

    Exact in bfloat16 when ``width`` is a power of two (the released 32: 31/32 and 1/32 are exact)."""
    eye = torch.eye(width, device=device, dtype=torch.float32)
    return (eye - 1.0 / width).to(dtype)[:, :, None, None]


def layer_norm_rows(x: torch.Tensor, center: torch.Tensor) -> torch.Tensor:
    """Affine-free LayerNorm of contiguous (N, c) rows: ``y / sqrt(mean(y**2) + 1e-6)`` with ``y = x - mean(x)``.

    ``y`` from a 1x1 convolution with ``center`` (:func:`centering_weight`), the per-row ``1 / rms(y)`` from
    ``vector_norm`` in x's dtype (torch accumulates a bf16 norm in float32 and rounds it once; asking for a
    float32 result converts all of y first), then one multiply in place. On the 2-core AMD EPYC in bf16 over
    262144 rows of 32: 6.9 ms where ``F.layer_norm`` takes 12.0 (its per-row reductions over 32 values) and
    the float32 norm 10.5; the decode's bf16 PSNR against float32 58.17 -> 58.10 dB for the float32 norm.
    """
    c = x.shape[-1]
    y = image_as_rows(F.conv2d(rows_as_image(x), center))
    r = torch.linalg.vector_norm(y, dim=-1, keepdim=True).float()
    return y.mul_(torch.rsqrt(r.square_().div_(c).add_(NORM_EPS)).to(y.dtype))


def image_as_rows(x: torch.Tensor) -> torch.Tensor:
    """A channels-last (1, K, N, 1) image as the (N, K) matrix it is in memory (a view)."""
    return x.permute(0, 2, 3, 1).reshape(-1, x.shape[1])


def rows_as_image(x: torch.Tensor) -> torch.Tensor:
    """An (N, K) matrix as the channels-last (1, K, N, 1) image it is in memory (a view when contiguous)."""
    return x.contiguous().view(1, x.shape[0], 1, x.shape[1]).permute(0, 3, 1, 2)


def conv_rows(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """A 1x1 ``conv`` over (N, K) rows (a linear layer on each row), run on their channels-last image: the same
    sums as ``F.linear``, where oneDNN adds the bias in the convolution (``F.linear`` copies it into the output
    first; on the CPU in bf16 the 32-wide per-pixel layers run 1.2-1.4x faster so)."""
    return image_as_rows(F.conv2d(rows_as_image(x), conv.weight, conv.bias))


def rms_norm_linear(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """``linear(rms_norm(x))`` over the last dim of a contiguous x, in float32, as ``s * (W x) + b`` with the
    per-row ``s = 1 / sqrt(mean(x**2) + 1e-6)`` applied to the narrow output rather than to x: no normalized
    copy of x (the final layer's 3-wide output of 32-wide rows: 2.3x faster in bf16).

    The norm from ``vector_norm`` in x's dtype (a half norm is accumulated in float32 and rounded once; asking
    for a float32 result converts all of x first), then ``s`` and the sum in float32, not rounded back to x's
    dtype: the caller stores it (the decoder's float32 image, :meth:`MageDecoder.pixels`). In bf16 that is one
    rounding of the image traded for one of the norm: on the 2-core AMD EPYC 0.19 against 0.41 CPU-s per
    3072x2048 decode for the final layer and the image's conversion, and the decode 58.16 dB from float32's
    where it was 58.10 (docs/cpu.md, issue 47). Float32 x: the same sums as before, bit for bit.
    """
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    s = torch.linalg.vector_norm(rows, dim=-1, keepdim=True).float()
    s = torch.rsqrt(s.square_().div_(k).add_(NORM_EPS))
    y = (
        F.conv2d(rows_as_image(rows), linear.weight[:, :, None, None])
        .permute(0, 2, 3, 1)
        .reshape(-1, linear.out_features)
    )
    out = torch.addcmul(linear.bias.float(), y.float(), s)
    return out.reshape(*x.shape[:-1], linear.out_features)


def _linear_from(weight: torch.Tensor, bias: torch.Tensor) -> nn.Linear:
    """An ``nn.Linear`` holding these tensors (made on meta: no random init)."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], device="meta")
    layer.weight, layer.bias = nn.Parameter(weight, weight.requires_grad), nn.Parameter(bias, bias.requires_grad)
    return layer


def _conv_from(linear: nn.Linear) -> nn.Conv2d:
    """A 1x1 ``nn.Conv2d`` holding ``linear``'s weight (as (out, in, 1, 1)) and bias (made on meta: no random init)."""
    conv = nn.Conv2d(linear.in_features, linear.out_features, 1, device="meta")
    conv.weight = nn.Parameter(linear.weight[:, :, None, None], linear.weight.requires_grad)
    conv.bias = nn.Parameter(linear.bias, linear.bias.requires_grad)
    return conv


class PixelMLP(nn.Module):
    """``dec_net``: per-pixel features (N, c) conditioned on tokens (n, C), ``N = 256 n`` -> (N, c) in place.

    ``input_proj`` is folded into the decoder's ``pixel_embed`` (:meth:`MageDecoder.fold_pixels`), so the
    features arrive projected; the blocks' modulations are one layer (:meth:`fold`). Float32 (and wider) runs
    the released sums bit for bit; bfloat16 and float16 the folded form (:meth:`forward`).
    """

    def __init__(self, config: MageVAEConfig, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        px = config.pixel_width
        self.cond_embed = nn.Linear(config.hidden, MAGE_PATCH * MAGE_PATCH * px, device=device)
        self.input_proj: nn.Linear | None = nn.Linear(px, px, device=device)
        self.res_blocks = nn.ModuleList(PixelResBlock(px, device=device) for _ in range(config.pixel_blocks))
        self.modulation: nn.Conv2d | None = None
        self.modulation_ln: nn.Conv2d | None = None
        self.cond_conv: nn.Conv2d | None = None

    @torch.no_grad()
    def fold(self) -> None:
        """The blocks' three ``adaLN_modulation`` layers (they all read ``SiLU(cond)``) as two 1x1 layers (c -> 9c):

        * ``modulation``: the layers stacked, (shift, scale, gate) per block, ``+ 1`` added to each scale's bias;
        * ``modulation_ln``: (scale, shift, gate) per block with its LayerNorm's affine (weight ``g``, bias
          ``b``) folded in, in float64::

            LN(x) (1 + s) + t = n(x) (g (1 + s)) + (b (1 + s) + t),   n(x) the plain LayerNorm

          and ``s``, ``t`` are linear in ``SiLU(cond)``: ``scale' = diag(g) W_s c + g (1 + b_s)``, ``shift' =
          (diag(b) W_s + W_t) c + b (1 + b_s) + b_t``.

        The blocks' linear layers become 1x1 convolutions, and so does ``cond_embed`` (``cond_conv``); the
        blocks' ``adaLN_modulation`` are dropped.
        """
        if self.modulation is not None:
            return
        f64, released, released_bias, weights, biases = torch.float64, [], [], [], []
        for block in self.res_blocks:
            layer, norm = block.adaLN_modulation[1], block.in_ln
            px = layer.in_features
            bias = layer.bias.clone()
            bias[px : 2 * px] += 1
            released, released_bias = released + [layer.weight], released_bias + [bias]
            w_t, w_s, w_g = layer.weight.to(f64).chunk(3)
            b_t, b_s, b_g = layer.bias.to(f64).chunk(3)
            g, b = norm.weight.to(f64), norm.bias.to(f64)
            weights += [g[:, None] * w_s, b[:, None] * w_s + w_t, w_g]
            biases += [g * (1 + b_s), b * (1 + b_s) + b_t, b_g]
            block.lin1, block.lin2 = _conv_from(block.mlp[0]), _conv_from(block.mlp[2])
            block.adaLN_modulation = block.mlp = None
        dtype = self.cond_embed.weight.dtype
        self.modulation = _conv_from(_linear_from(torch.cat(released), torch.cat(released_bias)))
        self.modulation_ln = _conv_from(_linear_from(torch.cat(weights).to(dtype), torch.cat(biases).to(dtype)))
        self.cond_conv, self.cond_embed = _conv_from(self.cond_embed), None

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Features x (N, c), contiguous, updated in place; tokens (1, C, h, w) channels-last, ``N = 256 h w``."""
        if self.modulation is None:
            raise RuntimeError("PixelMLP: call MageVAEModel.fold_t0() after loading, before running")
        if keeps_released_sums(x.dtype):
            return self._released(x, tokens)
        return self._folded(x, tokens)

    def _released(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The released sums: ``SiLU(cond_embed(tokens))`` one row per pixel (position-major), each block's
        (shift, scale, gate) from its 3c-wide slice of ``modulation``, then :meth:`PixelResBlock.forward`."""
        px = x.shape[-1]
        flat = tokens.permute(0, 2, 3, 1).reshape(-1, tokens.shape[1])
        cond = rows_as_image(F.silu(conv_rows(flat, self.cond_conv).reshape(-1, px), inplace=True))
        weight, bias = self.modulation.weight, self.modulation.bias
        for i, block in enumerate(self.res_blocks):
            rows = slice(3 * px * i, 3 * px * (i + 1))
            mod = image_as_rows(F.conv2d(cond, weight[rows], bias[rows]))
            x = block(x, *mod.chunk(3, dim=-1))
        return x

    def _folded(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The half-precision form: ``SiLU(cond_embed(tokens))`` in one pass
        (:func:`~flowlift.models.fused_conv.conv_act`), then each block's scale, shift and gate as three c-wide
        1x1 convolutions of ``modulation_ln`` (contiguous rows: the element-wise passes over strided thirds of
        one 3c-wide output ran ~1.8x slower) and :meth:`PixelResBlock.forward_folded`."""
        px = x.shape[-1]
        cond = conv_act(tokens.contiguous(memory_format=torch.channels_last), self.cond_conv, "swish")
        cond = rows_as_image(cond.permute(0, 2, 3, 1).reshape(-1, px))  # position-major: (1, c, n * 256, 1)
        weight, bias = self.modulation_ln.weight, self.modulation_ln.bias
        center = centering_weight(px, device=x.device, dtype=x.dtype)
        for i, block in enumerate(self.res_blocks):
            mod = [
                image_as_rows(F.conv2d(cond, weight[k * px : (k + 1) * px], bias[k * px : (k + 1) * px]))
                for k in range(3 * i, 3 * i + 3)
            ]
            x = block.forward_folded(x, *mod, center)
        return x


class MageDecoder(nn.Module):
    """``pipeline``: the DConv denoiser with its CoD decoder; latent (B, 128, h, w) -> image [-1, 1] (B, 3, 16h, 16w).

    ``s_embedder.proj1`` (the noise's patch embedding) and the noise channels of ``x_embedder`` act on
    the zero noise only, so they are loaded but never computed.

    **The per-pixel fold** (:meth:`fold_pixels`, run by :meth:`MageVAEModel.fold_t0`): the features
    ``input_proj(x_embedder([0, y_embedder_x(cond), dct]))`` are affine in ``cond`` per pixel position ``p``::

        x0[p] = W_in (W_xy (W_y[p] cond + b_y[p]) + W_xd dct[p] + b_x) + b_in = W'[p] cond + b'[p]

    so one 1x1 convolution ``pixel_embed`` (C -> 256 c, position-major) computes them; ``y_embedder_x``,
    ``x_embedder`` and ``input_proj`` are dropped. The final RMSNorm's weight folds into ``final_layer.linear``.
    """

    def __init__(self, config: MageVAEConfig, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        c, px, p2 = config.hidden, config.pixel_width, MAGE_PATCH * MAGE_PATCH
        self.dct_freqs = config.dct_freqs
        self.t_embedder: TimestepEmbedder | None = TimestepEmbedder(c, config.timestep_features, device=device)
        self.y_embedder_x: nn.Conv2d | None = nn.Conv2d(c, px * p2, 1, device=device)
        self.x_embedder: _Holder | None = _Holder()
        self.x_embedder.embedder = nn.Sequential(nn.Linear(3 + px + config.dct_freqs**2, px, device=device))
        self.pixel_embed: nn.Conv2d | None = None
        self.s_embedder = _Holder()
        self.s_embedder.proj1 = nn.Conv2d(
            3, MAGE_LATENT_CHANNELS, MAGE_PATCH, stride=MAGE_PATCH, bias=False, device=device
        )
        self.s_embedder.proj2 = nn.Conv2d(MAGE_LATENT_CHANNELS + c, c, 1, device=device)
        self.blocks = nn.ModuleList(
            DiCoBlock(c, config.mlp_ratio, modulated=True, device=device) for _ in range(config.decoder_blocks)
        )
        self.dec_net = PixelMLP(config, device=device)
        self.final_layer = _Holder()
        self.final_layer.norm = _Holder()
        self.final_layer.norm.weight = nn.Parameter(torch.ones(px, device=device))
        self.final_layer.linear = nn.Linear(px, 3, device=device)
        self.y_embedder = _Holder()
        self.y_embedder.decoder = CoDDecoder(c, config.attention_window, device=device)

    @torch.no_grad()
    def fold_pixels(self) -> None:
        """The per-pixel fold (see the class); computed in float64, stored in the weights' dtype."""
        if self.pixel_embed is not None:
            return
        y, linear, proj = self.y_embedder_x, self.x_embedder.embedder[0], self.dec_net.input_proj
        p2 = MAGE_PATCH * MAGE_PATCH
        px, c = y.out_channels // p2, y.in_channels
        f64, dtype = torch.float64, y.weight.dtype
        b_y = y.bias.to(f64).reshape(px, p2).t()  # (256, c)
        dct = dct_position_features(MAGE_PATCH, self.dct_freqs, device=y.weight.device, dtype=f64)
        w_x = linear.weight.to(f64)
        w_in = proj.weight.to(f64)
        a = w_in @ w_x[:, 3 : 3 + px]  # (c, c)
        const = dct @ w_x[:, 3 + px :].t() + linear.bias.to(f64)  # (256, c)
        bias = (b_y @ a.t() + const @ w_in.t() + proj.bias.to(f64)).reshape(p2 * px)
        # W'[p] = A W_y[p] for each position (position-major rows), PIXEL_FOLD_POSITIONS positions at a time: the
        # float64 products stay in the cache (all at once they were 75 MB of fresh float64 temporaries).
        w_y = y.weight.reshape(px, p2, c)  # W_y[p] = w_y[:, p]
        weight = torch.empty(p2, px, c, dtype=dtype, device=y.weight.device)
        for p0 in range(0, p2, PIXEL_FOLD_POSITIONS):
            part = w_y[:, p0 : p0 + PIXEL_FOLD_POSITIONS].to(f64).transpose(0, 1)
            weight[p0 : p0 + PIXEL_FOLD_POSITIONS] = torch.matmul(a, part)
        self.pixel_embed = nn.Conv2d(c, p2 * px, 1, device="meta")  # no random init of 3M parameters
        weight = weight.reshape(p2 * px, c, 1, 1)
        self.pixel_embed.weight = nn.Parameter(weight, y.weight.requires_grad)
        self.pixel_embed.bias = nn.Parameter(bias.to(dtype), y.bias.requires_grad)
        self.y_embedder_x = self.x_embedder = self.dec_net.input_proj = None
        final = self.final_layer.linear
        folded = (final.weight.to(f64) * self.final_layer.norm.weight.to(f64)).to(final.weight.dtype)
        final.weight = nn.Parameter(folded, final.weight.requires_grad)
        del self.final_layer.norm
        self.dec_net.fold()

    def tokens_in(self, cond: torch.Tensor) -> torch.Tensor:
        """``s_embedder(0, cond) = proj2([proj1(0), cond]) = W2[:, 128:] cond + b2``."""
        proj2 = self.s_embedder.proj2
        return F.conv2d(cond, proj2.weight[:, MAGE_LATENT_CHANNELS:], proj2.bias)

    def pixels(
        self, cond: torch.Tensor, tokens: torch.Tensor, out: torch.Tensor, *, unit_range: bool = False
    ) -> torch.Tensor:
        """The per-pixel path of one sample: cond and tokens (1, C, h, w) -> ``out`` (1, 3, 16h, 16w), written.

        ``pixel_embed`` (the folded features), ``dec_net``, RMSNorm and ``final_layer.linear`` (its weight
        folded in) in float32 (:func:`rms_norm_linear`), ``unit_range``: as ``(x + 1) / 2`` (flowlift's [0, 1]
        images), then the 16x16 fold straight into ``out`` (which may be a view of a larger image), rounded to
        its dtype there.
        """
        if self.pixel_embed is None:
            raise RuntimeError("MageDecoder: call MageVAEModel.fold_t0() after loading, before running")
        _, _, h, w = cond.shape
        px = self.pixel_embed.out_channels // (MAGE_PATCH * MAGE_PATCH)
        x = self.pixel_embed(cond.contiguous(memory_format=torch.channels_last))  # (1, 256 c, h, w)
        x = x.permute(0, 2, 3, 1).reshape(-1, px)  # (h w 256, c): a view of the channels-last output
        x = self.dec_net(x, tokens)
        rgb = rms_norm_linear(x, self.final_layer.linear)
        if unit_range:
            rgb = rgb.add_(1).div_(2)
        p = MAGE_PATCH
        out.view(1, 3, h, p, w, p).copy_(rgb.view(1, h, w, p, p, 3).permute(0, 5, 1, 3, 2, 4))
        return out

    def forward(self, z: torch.Tensor, *, unit_range: bool = False) -> torch.Tensor:
        """Latent (B, 128, h, w) -> the image (B, 3, 16h, 16w): in about [-1, 1] and z's dtype, or with
        ``unit_range`` as ``(x + 1) / 2`` in float32 (:meth:`pixels`)."""
        b, _, h, w = z.shape
        cond = self.y_embedder.decoder(z)
        s = self.tokens_in(cond)
        for block in self.blocks:
            s = block(s)
        out = torch.empty(b, 3, h * MAGE_PATCH, w * MAGE_PATCH, device=z.device, dtype=image_dtype(z, unit_range))
        for i in range(b):
            self.pixels(cond[i : i + 1], s[i : i + 1], out[i : i + 1], unit_range=unit_range)
        return out


def image_dtype(z: torch.Tensor, unit_range: bool) -> torch.dtype:
    """The decoded image's dtype: float32 for ``unit_range`` (flowlift's [0, 1] images, stored without a rounding
    to a half dtype), else the latent's."""
    return torch.float32 if unit_range else z.dtype


# --------------------------------------------------------------------------------------------------
# The codec
# --------------------------------------------------------------------------------------------------


class MageVAEModel(nn.Module):
    """Encoder and/or decoder of Mage-VAE. Load the released weights, then :meth:`fold_t0` once."""

    def __init__(
        self,
        config: MageVAEConfig | None = None,
        *,
        encoder: bool = True,
        decoder: bool = True,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.config = config or MageVAEConfig()
        self.encoder = MageEncoder(self.config, device=device) if encoder else None
        self.decoder = MageDecoder(self.config, device=device) if decoder else None
        self.folded = False

    @torch.no_grad()
    def fold_t0(self, dtype: torch.dtype | None = None) -> MageVAEModel:
        """Fold every DiCo block's t = 0 adaLN modulation into its convolutions; drop the timestep MLPs. The
        folded DiCo weights are stored in ``dtype`` (default: the weights' own), for a model about to move to
        it: the large folded layers then skip a float32 copy and its conversion. The decoder's per-pixel path
        (:meth:`MageDecoder.fold_pixels`) and its attention projections (:meth:`WindowAttentionBlock.fold`,
        used in half dtypes) are folded too."""
        for part in (self.encoder, self.decoder):
            if part is None or part.t_embedder is None:
                continue
            embedder = part.t_embedder
            c = embedder(torch.zeros(1, device=embedder.mlp[0].weight.device))
            for block in part.blocks:
                block.fold_modulation(c, dtype)
            part.t_embedder = None
        if self.decoder is not None:
            self.decoder.fold_pixels()
            for block in self.decoder.y_embedder.decoder.block:
                if isinstance(block, WindowAttentionBlock):
                    block.fold()
        self.folded = True
        return self

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images [-1, 1] (B, 3, H, W), sides multiples of 16 -> posterior mean (B, 128, H/16, W/16)."""
        if self.encoder is None:
            raise RuntimeError("this Mage-VAE has no encoder")
        return self.encoder(images)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents (B, 128, h, w) -> images in about [-1, 1] (B, 3, 16h, 16w), unclamped."""
        if self.decoder is None:
            raise RuntimeError("this Mage-VAE has no decoder")
        return self.decoder(latents)
