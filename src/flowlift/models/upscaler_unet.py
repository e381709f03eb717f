"""The Flow Upscaler UNet: a one-step rectified-flow 2x latent upscaler for FLUX.2 latents.

Released as ``flow_upscaler.safetensors`` (166 tensors, 59,267,104 parameters) in the hub repository
``TensorForger/FlowUpscaler``. The module names below reproduce that file's tensor names exactly, so
the released file loads with ``strict=True`` (:mod:`flowlift.models.upscaler_weights`) and computes
what its authors' code computes.

Architecture (SDXL-style ResNet blocks, FiLM conditioning, no attention):

* ``sample`` (B, 32, H, W): the noisy latent at output size (H, W multiples of 4);
  ``timestep`` (B,): sigma * 1000; ``latents_small`` (B, 32, H/2, W/2): the conditioning latent.
  Output: the velocity (B, 32, H, W). All latents are normalized, unpatchified FLUX.2 latents.
* ``c = time_proj(sinusoidal(timestep))`` conditions every residual block (scale/shift after norm2).
* A low-resolution encoder turns ``latents_small`` into features at 1, 1/2 and 1/4 of its size; they
  are bilinearly resized to H, H/2, H/4 and injected by FiLM before each encoder level of the UNet.
* UNet: ``in_conv`` -> FiLM 1 -> down stage (3 blocks, skip s1, stride-2 conv) -> FiLM 2 -> down stage
  (2 blocks, skip s2, stride-2 conv) -> FiLM 3 -> mid block -> up stage (x2 bilinear, concat s2,
  2 blocks) -> up stage (x2 bilinear, concat s1, 3 blocks) -> ``out_conv``.

One-step sampling (diffusers' ``FlowMatchEulerDiscreteScheduler().set_timesteps(1)`` gives sigmas
[1, 0]): ``x0 = noise - v(noise, 1000, latents_small)`` — :func:`one_step_upscale`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flowlift.errors import FlowliftError

GROUP_NORM_EPS = 1e-6
ONE_STEP_TIMESTEP = 1000.0


# --------------------------------------------------------------------------------------------------
# small pure functions


def group_count(channels: int, max_groups: int = 32) -> int:
    """GroupNorm group count: ``g = min(32, C)``, decremented until it divides ``C``."""
    groups = min(max_groups, channels)
    while channels % groups:
        groups -= 1
    return groups


def timestep_embedding(timestep: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding, computed in ``timestep``'s dtype.

    ``half = dim // 2``, ``freqs_k = exp(-ln(10000) * k / half)``, ``args = t[:, None] * freqs``,
    ``emb = cat(sin(args), cos(args))`` -> (B, dim).
    """
    half = dim // 2
    k = torch.arange(half, device=timestep.device, dtype=timestep.dtype)
    freqs = torch.exp(-math.log(10000.0) * k / half)
    args = timestep[:, None] * freqs[None, :]
    return torch.cat([torch.sin(args), torch.cos(args)], dim=-1)


def film(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Feature-wise linear modulation: ``x * (1 + scale) + shift``."""
    return x * (1 + scale) + shift


def resize_bilinear(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bilinear resize to ``size`` with ``align_corners=False`` (no antialiasing); identity if equal."""
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    return F.interpolate(x, size=size, mode="bilinear", align_corners=False)


def upsample2x_to(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """The up stage's resize: bilinear x2 (``align_corners=False``), then to ``size`` if it differs."""
    x = F.interpolate(x, scale_factor=2.0, mode="bilinear", align_corners=False)
    return resize_bilinear(x, size)


# --------------------------------------------------------------------------------------------------
# modules


def _group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(group_count(channels), channels, eps=GROUP_NORM_EPS, affine=True)


class SampleDropout(nn.Dropout):
    """Dropout whose mask for each sample depends only on that sample's seed, not on the batch layout.

    ``torch.nn.Dropout`` draws one mask for the whole batch from the global generator, so a batch of
    2B on one process and two batches of B on two DDP ranks (or two accumulated micro-batches) drop
    different units. With :attr:`sample_seeds` set (one int per sample; the trainer derives them from
    the samples' global stream positions), sample ``i``'s mask in this layer is
    ``rand(C, H, W; generator seeded by (sample_seeds[i], layer_index)) < 1 - p`` on the input's device,
    scaled by ``1 / (1 - p)`` — the same whichever rank or micro-batch the sample lands in. Without seeds
    (``None``) it is plain ``nn.Dropout``. Inactive in eval mode either way.
    """

    def __init__(self, p: float = 0.0) -> None:
        super().__init__(p)
        self.layer_index = 0
        self.sample_seeds: list[int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0 or self.sample_seeds is None:
            return super().forward(x)
        if len(self.sample_seeds) != x.shape[0]:
            raise ValueError(f"SampleDropout: {len(self.sample_seeds)} sample seeds for a batch of {x.shape[0]}")
        keep = 1.0 - self.p
        masks = []
        for seed in self.sample_seeds:
            generator = torch.Generator(device=x.device)
            generator.manual_seed((int(seed) * 1_000_003 + self.layer_index * 7919) % (2**63 - 1))
            masks.append(torch.rand(x.shape[1:], generator=generator, device=x.device) < keep)
        return x * torch.stack(masks).to(x.dtype) / keep


def set_dropout_seeds(model: nn.Module, seeds: list[int] | None) -> None:
    """Give every :class:`SampleDropout` in ``model`` the per-sample seeds of the next forward (None: plain)."""
    for module in model.modules():
        if isinstance(module, SampleDropout):
            module.sample_seeds = None if seeds is None else list(seeds)


class ResBlock(nn.Module):
    """SDXL-style residual block with time (FiLM-after-norm2) conditioning.

    ``h = conv1(silu(norm1(x)))``; ``scale, shift = chunk(cond_proj(c), 2)``;
    ``h = norm2(h) * (1 + scale) + shift``; ``h = conv2(dropout(silu(h)))``; ``return h + skip(x)``.
    """

    def __init__(self, in_channels: int, out_channels: int, cond_dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.norm1 = _group_norm(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.cond_proj = nn.Sequential(nn.SiLU(), nn.Linear(cond_dim, 2 * out_channels))
        self.norm2 = _group_norm(out_channels)
        self.dropout = SampleDropout(dropout)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.skip: nn.Module = (
            nn.Conv2d(in_channels, out_channels, 1, bias=False) if in_channels != out_channels else nn.Identity()
        )

    def scale_shift(self, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's FiLM parameters from the conditioning vector: two (B, out, 1, 1) tensors."""
        scale, shift = self.cond_proj(cond).chunk(2, dim=1)
        return scale[:, :, None, None], shift[:, :, None, None]

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():  # autograd keeps the intermediates: every step makes a new tensor
            h = self.conv1(F.silu(self.norm1(x)))
            scale, shift = self.scale_shift(cond)
            h = film(self.norm2(h), scale, shift)
            h = self.conv2(self.dropout(F.silu(h)))
            return h + self.skip(x)
        # inference: the element-wise steps work in place on the block's own intermediates (same values)
        h = self.conv1(F.silu(self.norm1(x), inplace=True))
        h = self.conv2(self.dropout(F.silu(self.norm2_film(h, cond), inplace=True)))
        return h.add_(self.skip(x))

    def norm2_film(self, h: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """``norm2(h) * (1 + scale) + shift`` without autograd, consuming ``h``'s norm output in place.

        In float32: those very operations (the same bits). In a half dtype with one FiLM row (a batch of one):
        folded into the GroupNorm's affine map, ``gamma' = gamma (1 + scale)``, ``beta' = beta (1 + scale) +
        shift`` (computed in float32, rounded once): one pass over the frame instead of three, and one rounding
        instead of three (closer to float32; the chunked executor folds them the same way).
        """
        scale, shift = self.scale_shift(cond)
        norm = self.norm2
        if h.dtype == torch.float32 or scale.shape[0] != 1 or norm.weight is None:
            return norm(h).mul_(1 + scale).add_(shift)
        factor = 1 + scale.float().view(-1)
        weight = norm.weight.float() * factor
        bias = norm.bias.float() * factor + shift.float().view(-1)
        return F.group_norm(h, norm.num_groups, weight.to(h.dtype), bias.to(h.dtype), norm.eps)


def strided_conv2d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: Any, padding: Any
) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, stride, padding)``, in float32 where torch's CPU bfloat16 kernel is wrong.

    torch's CPU bfloat16 convolution (oneDNN, torch 2.13 on AVX512-BF16/AMX) returns garbage -- huge or
    non-finite values, different on every call -- for a strided convolution whose output is one column
    wide, e.g. the 3x3 stride-2 downsample of a 16x512 image's latents; float32 and wider outputs are
    right (tests/test_cpu_dtype.py asserts torch still does this, so that the detour can go when torch is
    fixed). There the convolution runs in float32 and is rounded back to bfloat16, which is what a correct
    bfloat16 kernel returns to its rounding; it is the narrowest layer of the model, so the cost is nil.
    """
    stride_w = stride[1] if isinstance(stride, (tuple, list)) else stride
    pad_w = padding[1] if isinstance(padding, (tuple, list)) else padding
    out_w = (x.shape[-1] + 2 * pad_w - weight.shape[-1]) // stride_w + 1
    if x.device.type == "cpu" and x.dtype == torch.bfloat16 and out_w == 1:
        bias32 = None if bias is None else bias.float()
        return F.conv2d(x.float(), weight.float(), bias32, stride, padding).to(x.dtype)
    return F.conv2d(x, weight, bias, stride, padding)


class StridedConv2d(nn.Conv2d):
    """An ``nn.Conv2d`` (same parameters, same state-dict keys) that convolves with :func:`strided_conv2d`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return strided_conv2d(x, self.weight, self.bias, self.stride, self.padding)


class DownStage(nn.Module):
    """``n`` residual blocks and a 3x3 stride-2 ``downsample``.

    Normally ``blocks -> skip = x -> downsample``; with ``downsample_first``: ``downsample -> blocks``
    and the skip is the output. ``forward`` returns ``(x, skip)``.
    """

    def __init__(
        self, channels: int, num_blocks: int, cond_dim: int, dropout: float, downsample_first: bool = False
    ) -> None:
        super().__init__()
        self.downsample_first = downsample_first
        self.blocks = nn.ModuleList(ResBlock(channels, channels, cond_dim, dropout) for _ in range(num_blocks))
        self.downsample = StridedConv2d(channels, channels, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.downsample_first:
            x = self.downsample(x)
            for block in self.blocks:
                x = block(x, cond)
            return x, x
        for block in self.blocks:
            x = block(x, cond)
        return self.downsample(x), x


class UpStage(nn.Module):
    """Bilinear x2 upsample (resized to the skip's size if needed), concat ``[x, skip]``, ``n`` blocks."""

    def __init__(self, channels: int, skip_channels: int, num_blocks: int, cond_dim: int, dropout: float) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            ResBlock(channels + skip_channels if i == 0 else channels, channels, cond_dim, dropout)
            for i in range(num_blocks)
        )

    def forward(self, x: torch.Tensor, skip: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        x = torch.cat([upsample2x_to(x, tuple(skip.shape[-2:])), skip], dim=1)
        for block in self.blocks:
            x = block(x, cond)
        return x


class LowResEncoder(nn.Module):
    """Encodes the small latent into features at its size, 1/2 and 1/4 (stride-2 convs, ceil sizes)."""

    def __init__(self, sample_channels: int, channels: int, cond_dim: int, dropout: float) -> None:
        super().__init__()
        self.in_conv = nn.Conv2d(sample_channels, channels, 1)
        self.block_1 = ResBlock(channels, channels, cond_dim, dropout)
        self.block_2 = DownStage(channels, 1, cond_dim, dropout, downsample_first=True)
        self.block_3 = DownStage(channels, 1, cond_dim, dropout, downsample_first=True)

    def forward(self, small: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        l1 = self.block_1(self.in_conv(small), cond)
        l2, _ = self.block_2(l1, cond)
        l3, _ = self.block_3(l2, cond)
        return l1, l2, l3


class FiLMCond(nn.Module):
    """FiLM from a feature map: ``scale, shift = chunk(conv1x1(silu(f)), 2)``; ``x * (1 + scale) + shift``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.cond_proj = nn.Sequential(nn.SiLU(), nn.Conv2d(channels, 2 * channels, 1))

    def forward(self, x: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        """``x`` modulated; without autograd ``x`` itself, modulated in place (the same values)."""
        scale, shift = self.cond_proj(feature).chunk(2, dim=1)
        if torch.is_grad_enabled():
            return film(x, scale, shift)
        return x.mul_(1 + scale).add_(shift)


class TimeConditioning(nn.Module):
    """``c = Linear(cond, cond)(silu(Linear(time_dim, cond)(sinusoidal(t))))``."""

    def __init__(self, time_dim: int, cond_dim: int) -> None:
        super().__init__()
        self.time_dim = time_dim
        self.time_proj = nn.Sequential(nn.Linear(time_dim, cond_dim), nn.SiLU(), nn.Linear(cond_dim, cond_dim))

    def forward(self, timestep: torch.Tensor) -> torch.Tensor:
        emb = timestep_embedding(timestep, self.time_dim)
        return self.time_proj(emb.to(self.time_proj[0].weight.dtype))


#: Largest accepted value per constructor argument (the released model: 32 / 384 / 512 / 1024).
CONFIG_LIMITS = {"sample_channels": 1024, "base_channels": 8192, "time_dim": 8192, "cond_dim": 16384}


def check_unet_config(config: Mapping[str, Any], prefix: str = "FlowUpscalerUNet: ") -> None:
    """One FlowliftError line (``prefix`` first) unless every size of ``config`` is an integer in
    1..:data:`CONFIG_LIMITS` and ``time_dim`` is even (the sinusoidal embedding's halves), and its ``dropout``
    (when given) a probability in [0, 1)."""
    for key, limit in CONFIG_LIMITS.items():
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
            raise FlowliftError(f"{prefix}{key}={value!r} is not a valid size (1..{limit})")
    if config["time_dim"] % 2:
        raise FlowliftError(f"{prefix}time_dim={config['time_dim']} must be even")
    dropout = config.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise FlowliftError(f"{prefix}dropout={dropout!r} must be a probability in [0, 1)")


class FlowUpscalerUNet(nn.Module):
    """The Flow Upscaler UNet; ``forward(sample, timestep, latents_small) -> velocity``."""

    def __init__(
        self,
        sample_channels: int = 32,
        base_channels: int = 384,
        time_dim: int = 512,
        cond_dim: int = 1024,
        dropout: float = 0.01,
    ) -> None:
        super().__init__()
        self.config = {
            "sample_channels": sample_channels,
            "base_channels": base_channels,
            "time_dim": time_dim,
            "cond_dim": cond_dim,
        }
        check_unet_config({**self.config, "dropout": dropout})  # before anything is allocated
        base = base_channels
        self.conditioning = TimeConditioning(time_dim, cond_dim)
        self.in_conv = nn.Conv2d(sample_channels, base, 1)
        self.low_res_encoder = LowResEncoder(sample_channels, base, cond_dim, dropout)
        self.film_cond_1 = FiLMCond(base)
        self.film_cond_2 = FiLMCond(base)
        self.film_cond_3 = FiLMCond(base)
        self.down_stages = nn.ModuleList([DownStage(base, 3, cond_dim, dropout), DownStage(base, 2, cond_dim, dropout)])
        self.mid_stages = nn.ModuleList([ResBlock(base, base, cond_dim, dropout)])
        self.up_stages = nn.ModuleList(
            [UpStage(base, base, 2, cond_dim, dropout), UpStage(base, base, 3, cond_dim, dropout)]
        )
        self.out_conv = nn.Conv2d(base, sample_channels, 1)
        for index, module in enumerate(m for m in self.modules() if isinstance(m, SampleDropout)):
            module.layer_index = index

    def time_conditioning(self, timestep: torch.Tensor | float, batch: int) -> torch.Tensor:
        """The conditioning vector ``c`` (B, cond_dim) for a scalar, (1,) or (B,) timestep."""
        param = self.in_conv.weight
        t = torch.as_tensor(timestep, device=param.device)
        if not t.is_floating_point():
            t = t.float()
        t = t.reshape(-1)
        if t.numel() == 1:
            t = t.expand(batch)
        return self.conditioning(t)

    def forward(
        self, sample: torch.Tensor, timestep: torch.Tensor | float, latents_small: torch.Tensor
    ) -> torch.Tensor:
        check_inputs(sample, timestep, latents_small, self.config["sample_channels"], self.config["base_channels"])
        height, width = sample.shape[-2:]
        cond = self.time_conditioning(timestep, sample.shape[0])
        l1, l2, l3 = self.low_res_encoder(latents_small, cond)
        x = self.film_cond_1(self.in_conv(sample), resize_bilinear(l1, (height, width)))
        x, s1 = self.down_stages[0](x, cond)
        x = self.film_cond_2(x, resize_bilinear(l2, (height // 2, width // 2)))
        x, s2 = self.down_stages[1](x, cond)
        x = self.film_cond_3(x, resize_bilinear(l3, (height // 4, width // 4)))
        x = self.mid_stages[0](x, cond)
        x = self.up_stages[0](x, s2, cond)
        x = self.up_stages[1](x, s1, cond)
        return self.out_conv(x)


def check_inputs(
    sample: torch.Tensor,
    timestep: torch.Tensor | float,
    latents_small: torch.Tensor,
    channels: int,
    base_channels: int | None = None,
) -> None:
    """Raise one FlowliftError line unless the shapes fit (B,C,H,W), (B,C,H/2,W/2), H and W multiples of 4.

    With ``base_channels``, also refuse inputs so small that torch's GroupNorm refuses them: a batch of
    one whose groups at the low-res encoder's deepest level (1/4 of ``latents_small``) hold a single
    value (only possible for narrow models, e.g. 32 channels in 32 groups, at 1x1).
    """
    if sample.ndim != 4 or latents_small.ndim != 4:
        raise FlowliftError(
            f"Flow Upscaler: sample and latents_small must be 4-D (B, C, H, W), got "
            f"{tuple(sample.shape)} and {tuple(latents_small.shape)}"
        )
    b, c, h, w = sample.shape
    if c != channels or h % 4 or w % 4 or h == 0 or w == 0:
        raise FlowliftError(
            f"Flow Upscaler: sample must be (B, {channels}, H, W) with H and W positive multiples of 4, "
            f"got {tuple(sample.shape)}"
        )
    if tuple(latents_small.shape) != (b, channels, h // 2, w // 2):
        raise FlowliftError(
            f"Flow Upscaler: latents_small must be {(b, channels, h // 2, w // 2)} for sample "
            f"{tuple(sample.shape)}, got {tuple(latents_small.shape)}"
        )
    n = torch.as_tensor(timestep).numel()
    if n not in (1, b):
        raise FlowliftError(f"Flow Upscaler: timestep must be a scalar or have {b} entries, got {n}")
    if base_channels is not None:
        deepest = math.ceil(math.ceil(h / 2 / 2) / 2) * math.ceil(math.ceil(w / 2 / 2) / 2)
        if b * (base_channels // group_count(base_channels)) * deepest < 2:  # torch's own GroupNorm condition
            raise FlowliftError(
                f"Flow Upscaler: latents_small {tuple(latents_small.shape)} is too small for a "
                f"{base_channels}-channel model (its deepest GroupNorm would see one value per group)"
            )


# --------------------------------------------------------------------------------------------------
# sampling


VelocityFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def one_step_upscale(model: VelocityFn, noise: torch.Tensor, latents_small: torch.Tensor) -> torch.Tensor:
    """One Euler step of the rectified flow from sigma 1 to 0: ``x0 = noise - v(noise, 1000, small)``.

    ``model`` is a :class:`FlowUpscalerUNet` or anything called the same way (e.g. a
    :class:`flowlift.upscale.chunked.executor.ChunkedExecutor`). The timestep is ``sigma * 1000 = 1000.0`` per sample,
    in float32 on ``noise``'s device.
    """
    timestep = torch.full((noise.shape[0],), ONE_STEP_TIMESTEP, dtype=torch.float32, device=noise.device)
    velocity = model(noise, timestep, latents_small)
    return noise - velocity.to(noise.dtype)
