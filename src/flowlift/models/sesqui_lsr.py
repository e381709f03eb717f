"""SesquiLSR: a ~3.1M-parameter latent upscaler for raw FLUX.2 VAE latents, any factor in [1, 2] per axis.

Written from the published description of ``LatentUpscaler(in_channels=32)`` in the public repository
``LoganBooker/SesquiLSR`` (MIT); the released weights are ``models/upscaler_Flux2.safetensors`` there (80
tensors, not on the Hugging Face hub). Module names follow that file's tensor names.

Architecture (``C`` = 32 latent channels, width ``W`` = 128; every 3x3/5x5 conv pads by reflection):

* ``head_conv``: 3x3 conv C -> W/2 (no bias), Mish, 3x3 conv W/2 -> W.
* ``in_blocks``: 8 :class:`GatedBlock` (expand 1.5, shrink 0.75).
* ``upsample`` (:class:`ReassemblyHead`): ``pixel_shuffle(ps_expand(h), 2) + lift_mix(pixel_shuffle(
  lift_expand(h), 2))`` (a 2x grid ``S``), one more gated block (``refine``), then a rank-2 separable
  4-tap resampling from ``S`` to the target size whose taps a small MLP predicts per output row/column.
* ``out_blocks``: 6 :class:`GatedBlock` (expand 2, shrink 1); ``tail_conv``: 1x1 W -> W/2, Mish,
  3x3 W/2 -> C.
* Output: ``tail + skip_conv(bicubic(x, target_size))`` (5x5 conv C -> C over the bicubic upsample,
  ``align_corners=False``).

The network works on *raw* latents (B, 32, h, w): the FLUX.2 VAE's output before its 2x2 patchify and BN
normalization. flowlift's latents are normalized (:mod:`flowlift.flux2.latents`), so
:func:`raw_from_latents` / :func:`latents_from_raw` convert with the FLUX.2 VAE's statistics
(``vae.bn_mean`` / ``vae.bn_std``). TAEF2 and Mage-VAE encode straight into the normalized space and carry
no statistics (``bn_mean is None``): their latents have no raw form of their own, so SesquiLSR runs with
them only when the FLUX.2 VAE's statistics are passed in (:func:`sesqui_upscale_latents` refuses otherwise).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from flowlift.errors import FIELD_MARK, FlowliftError
from flowlift.limits import SESQUI_MIN_SIDE

WHAT = "SesquiLSR weights"
WEIGHTS_NAME = "upscaler_Flux2.safetensors"
WHERE_TO_GET = f"get {WEIGHTS_NAME} from the models/ folder of https://github.com/LoganBooker/SesquiLSR"
LATENT_CHANNELS = 32
WIDTH = 128
MIN_FACTOR, MAX_FACTOR = 1.0, 2.0
#: ``IRLayerNorm``'s variance floor and the taps' relative offsets around ``floor(position)``.
NORM_EPS = 1e-6
TAP_OFFSETS = (-1, 0, 1, 2)


def reflect_conv(n_in: int, n_out: int, kernel: int, *, bias: bool) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, kernel, padding=kernel // 2, padding_mode="reflect", bias=bias)


def gate_sizes(channels: int, expand: float, shrink: float, values_per_gate: int = 8) -> tuple[int, int, int]:
    """``(value_ch, gate_ch, mid_ch)`` of a gated block: ``gate = ceil(expand * channels / (v + 1))`` rounded
    up to a multiple of ``v`` (values per gate), ``value = gate * v``, ``mid = ceil(shrink * channels)``."""
    gate = math.ceil(expand * channels / (values_per_gate + 1))
    gate = math.ceil(gate / values_per_gate) * values_per_gate
    return gate * values_per_gate, gate, math.ceil(channels * shrink)


class ScaleOnlyNorm(nn.Module):
    """Whole-sample normalization: ``((x - mean) / s) * weight`` with ``s = sqrt(var + 1e-6)`` over (C, H, W)
    (population variance), no bias; also returns ``s`` so the block can scale its residual back."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, spread = sample_statistics(x)
        return self.apply_statistics(x, mean, spread), spread

    def apply_statistics(self, x: torch.Tensor, mean: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
        """``(x - mean) / spread * weight`` with the sample's (B, 1, 1, 1) statistics given (any rows of it)."""
        return (x - mean) / spread * self.weight[None, :, None, None]


def sample_statistics(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's ``mean`` and ``spread = sqrt(var + 1e-6)`` over (C, H, W), population variance: (B, 1, 1, 1)."""
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    spread = torch.sqrt((x - mean).square().mean(dim=(1, 2, 3), keepdim=True) + NORM_EPS)
    return mean, spread


class GatedBlock(nn.Module):
    """A wide-activation residual block with lopsided gating.

    ``y, s = norm(x)``; ``[v, g] = up(y)`` (1x1, values first); value channel ``i * 8 + j`` is
    ``mish(v) * tanh(g_i / 2)``; ``x + mix(down(gated)) * s`` with ``down`` 1x1 and ``mix`` 3x3 (no biases).
    """

    def __init__(self, channels: int, expand: float, shrink: float) -> None:
        super().__init__()
        self.value_ch, self.gate_ch, mid = gate_sizes(channels, expand, shrink)
        self.norm = ScaleOnlyNorm(channels)
        self.up = nn.Conv2d(channels, self.value_ch + self.gate_ch, 1, bias=False)
        self.down = nn.Conv2d(self.value_ch, mid, 1, bias=False)
        self.mix = reflect_conv(mid, channels, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.with_statistics(x, *sample_statistics(x))

    def with_statistics(self, x: torch.Tensor, mean: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
        """The block on ``x`` (the whole frame, or rows of it with a halo) normalized by the frame's statistics."""
        hidden = self.up(self.norm.apply_statistics(x, mean, spread))
        values, gates = hidden[:, : self.value_ch], hidden[:, self.value_ch :]
        gated = F.mish(values) * torch.tanh(gates * 0.5).repeat_interleave(self.value_ch // self.gate_ch, dim=1)
        return x + self.mix(self.down(gated)) * spread


class Frequencies(nn.Module):
    """Holds ``freqs`` (4 values, ``2 ** linspace(0, 2, 4)`` in the released file): ``[sin(pi f t), cos(pi f t)]``."""

    def __init__(self, count: int = 4, highest: float = 4.0) -> None:
        super().__init__()
        self.register_buffer("freqs", 2.0 ** torch.linspace(0.0, math.log2(highest), count))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        angle = t[:, None] * self.freqs.float() * math.pi
        return torch.cat([angle.sin(), angle.cos()], dim=1)


def resample_positions(n_src: int, n_out: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-pixel-centred source positions of ``n_out`` samples over ``n_src``: ``p = (i + 1/2) n_src/n_out - 1/2``
    (float32); returns ``(p - b, b)`` with ``b = clamp(floor(p), 0, n_src - 1)``."""
    p = (torch.arange(n_out, device=device, dtype=torch.float32) + 0.5) * (n_src / n_out) - 0.5
    b = p.floor().long().clamp(0, n_src - 1)
    return p - b.float(), b


def separable_taps(x: torch.Tensor, base: torch.Tensor, weights: torch.Tensor, dim: int) -> torch.Tensor:
    """Resample ``x`` (B, C, H, W) along ``dim`` (2 or 3): ``out[.., i] = sum_k w[c, i, k] x[.., b_i + o_k]``
    with taps ``o = (-1, 0, 1, 2)``, indices clamped to the edge, ``weights`` (C, n_out, 4)."""
    last = x.shape[dim] - 1
    out = None
    for k, offset in enumerate(TAP_OFFSETS):
        picked = x.index_select(dim, (base + offset).clamp(0, last))
        w = weights[:, :, k]
        w = w[None, :, :, None] if dim == 2 else w[None, :, None, :]
        out = picked * w if out is None else out + picked * w
    return out


class ReassemblyHead(nn.Module):
    """2x by pixel shuffle, then a learned rank-2 separable resampling to the exact target size.

    Taps of rank ``r``, axis ``a`` at output position ``i`` (source fraction ``f_i``, footprint
    ``log2(n_src / n_out)``): ``base_taps[r, a] + d - mean_k(d)`` with
    ``d = 0.2 tanh(filter_net([sin/cos(pi F f_i), footprint, axis_emb[a], rank_emb[r]]))`` per channel and tap;
    the output is ``sum_r sigmoid(rank_gain[r]) * rows_r(columns_r(S))``.
    """

    def __init__(self, channels: int, rank: int = 2) -> None:
        super().__init__()
        self.channels, self.rank = channels, rank
        lift = min(64, channels // 2)
        self.ps_expand = nn.Conv2d(channels, channels * 4, 1, bias=True)
        self.lift_expand = nn.Conv2d(channels, lift * 4, 1, bias=False)
        self.lift_mix = reflect_conv(lift, channels, 3, bias=False)
        self.refine = GatedBlock(channels, 2.0, 1.0)
        self.base_taps = nn.Parameter(torch.zeros(rank, 2, channels, len(TAP_OFFSETS)))
        self.pe = Frequencies()
        self.axis_emb = nn.Embedding(2, 8)
        self.rank_emb = nn.Embedding(rank, 8)
        self.filter_net = nn.Sequential(
            nn.Linear(2 * 4 + 1 + 8 + 8, 64), nn.Mish(), nn.Linear(64, channels * len(TAP_OFFSETS))
        )
        self.rank_gain = nn.Parameter(torch.zeros(rank))

    def taps(self, frac: torch.Tensor, footprint: float, axis: int, rank: int) -> torch.Tensor:
        """(C, n_out, 4) taps of one rank on one axis."""
        n = frac.numel()
        ids = torch.full((n,), axis, dtype=torch.long, device=frac.device)
        rank_ids = torch.full((n,), rank, dtype=torch.long, device=frac.device)
        cond = torch.cat(
            [
                self.pe(frac),
                torch.full((n, 1), footprint, dtype=torch.float32, device=frac.device),
                self.axis_emb(ids).float(),
                self.rank_emb(rank_ids).float(),
            ],
            dim=1,
        ).to(self.base_taps.dtype)
        delta = 0.2 * torch.tanh(self.filter_net(cond).view(n, self.channels, len(TAP_OFFSETS)))
        delta = delta - delta.mean(dim=2, keepdim=True)
        return (delta + self.base_taps[rank, axis][None]).permute(1, 0, 2)

    def forward(self, h: torch.Tensor, target_size: tuple[int, int]) -> torch.Tensor:
        grid = self.refine(self.expand(h))
        return self.resample_rows(grid, self.resampling(tuple(grid.shape[-2:]), target_size))

    def expand(self, h: torch.Tensor) -> torch.Tensor:
        """The 2x grid before ``refine``: ``pixel_shuffle(ps_expand(h)) + lift_mix(pixel_shuffle(lift_expand(h)))``."""
        return F.pixel_shuffle(self.ps_expand(h), 2) + self.lift_mix(F.pixel_shuffle(self.lift_expand(h), 2))

    def resampling(self, grid_size: tuple[int, int], target_size: tuple[int, int]) -> list[ResampleRank]:
        """Each rank's gain and taps (float32; the grid's dtype at use) from a ``grid_size`` grid to
        ``target_size``, both (height, width)."""
        (h_src, w_src), (h_out, w_out) = grid_size, target_size
        device = self.base_taps.device
        frac_y, base_y = resample_positions(h_src, h_out, device)
        frac_x, base_x = resample_positions(w_src, w_out, device)
        foot_y, foot_x = math.log2(max(h_src / h_out, 0.01)), math.log2(max(w_src / w_out, 0.01))
        gains = torch.sigmoid(self.rank_gain)
        return [
            ResampleRank(gains[r], base_x, self.taps(frac_x, foot_x, 1, r), base_y, self.taps(frac_y, foot_y, 0, r))
            for r in range(self.rank)
        ]

    def resample_rows(
        self, grid: torch.Tensor, ranks: list[ResampleRank], rows: tuple[int, int] | None = None, first: int = 0
    ) -> torch.Tensor:
        """``sum_r gain_r * rows_r(columns_r(grid))`` at the target's output rows ``rows`` (all of them by
        default); ``grid`` may be a band of the grid starting at row ``first`` that holds every source row those
        output rows read (:func:`source_rows`)."""
        out = None
        for rank in ranks:
            base_y, taps_y = rank.base_y, rank.taps_y
            if rows is not None:
                base_y, taps_y = base_y[rows[0] : rows[1]] - first, taps_y[:, rows[0] : rows[1]]
            cols = separable_taps(grid, rank.base_x, rank.taps_x.to(grid.dtype), 3)
            resampled = separable_taps(cols, base_y, taps_y.to(grid.dtype), 2)
            out = rank.gain * resampled if out is None else out + rank.gain * resampled
        return out


@dataclass(frozen=True)
class ResampleRank:
    """One rank of :class:`ReassemblyHead`'s resampling: its gain, and per axis the base rows/columns and taps."""

    gain: torch.Tensor
    base_x: torch.Tensor
    taps_x: torch.Tensor
    base_y: torch.Tensor
    taps_y: torch.Tensor


def source_rows(base_y: torch.Tensor, rows: tuple[int, int], grid_height: int) -> tuple[int, int]:
    """The grid rows ``[first, end)`` that output rows ``rows`` of a resampling read: their bases plus the taps'
    offsets, clamped to the grid as :func:`separable_taps` clamps them."""
    bases = base_y[rows[0] : rows[1]]
    first = max(int(bases.min()) + TAP_OFFSETS[0], 0)
    end = min(int(bases.max()) + TAP_OFFSETS[-1], grid_height - 1) + 1
    return first, end


class SesquiLSR(nn.Module):
    """The FLUX.2 SesquiLSR network: ``forward(raw_latents, target_size)`` -> raw latents at ``target_size``.

    ``raw_latents`` are (B, 32, h, w) raw FLUX.2 VAE latents (before patchify and BN normalization), each
    side at least :data:`SESQUI_MIN_SIDE`; ``target_size`` is ``(H, W)`` with ``H / h`` and ``W / w`` in [1, 2]
    (the axes may differ). Anything else is one FlowliftError line.
    """

    def __init__(self) -> None:
        super().__init__()
        c, w = LATENT_CHANNELS, WIDTH
        self.head_conv = nn.Sequential(
            reflect_conv(c, w // 2, 3, bias=False), nn.Mish(), reflect_conv(w // 2, w, 3, bias=True)
        )
        self.in_blocks = nn.Sequential(*[GatedBlock(w, 1.5, 0.75) for _ in range(8)])
        self.upsample = ReassemblyHead(w)
        self.out_blocks = nn.Sequential(*[GatedBlock(w, 2.0, 1.0) for _ in range(6)])
        self.tail_conv = nn.Sequential(
            nn.Conv2d(w, w // 2, 1, bias=False), nn.Mish(), reflect_conv(w // 2, c, 3, bias=True)
        )
        self.skip_conv = reflect_conv(c, c, 5, bias=False)

    def forward(self, raw_latents: torch.Tensor, target_size: tuple[int, int]) -> torch.Tensor:
        target = check_target_size(tuple(raw_latents.shape), target_size)
        h = self.out_blocks(self.upsample(self.in_blocks(self.head_conv(raw_latents)), target))
        skip = F.interpolate(raw_latents, size=target, mode="bicubic", align_corners=False)
        return self.tail_conv(h) + self.skip_conv(skip)


def check_target_size(shape: tuple[int, ...], target_size: tuple[int, int]) -> tuple[int, int]:
    """``target_size`` as two ints when (B, 32, h, w) ``shape`` can reach it (a factor in [1, 2] on each axis);
    else one FlowliftError line."""
    if len(shape) != 4 or shape[1] != LATENT_CHANNELS:
        raise FlowliftError(f"SesquiLSR: raw latents must have shape (B, {LATENT_CHANNELS}, h, w), got {shape}")
    h, w = shape[2], shape[3]
    if min(h, w) < SESQUI_MIN_SIDE:
        raise FlowliftError(f"SesquiLSR: latents of {h}x{w} are too small (each side at least {SESQUI_MIN_SIDE})")
    from flowlift.knobs import exact_int

    sides = tuple(exact_int(v) for v in target_size) if isinstance(target_size, (tuple, list)) else ()
    if len(sides) != 2 or None in sides:  # (12.9, 12) was cut to 12, ("12", 12) read as 12
        raise FlowliftError(
            f"target_size must be (height, width), two integers (latent px), got {target_size!r}", field="target_size"
        )
    th, tw = sides
    if not (h <= th <= 2 * h and w <= tw <= 2 * w):
        raise FlowliftError(
            f"SesquiLSR: target {th}x{tw} from {h}x{w} latents is a factor of {th / h:g}x{tw / w:g}; "
            f"each axis must be in [{MIN_FACTOR:g}, {MAX_FACTOR:g}]"
        )
    return th, tw


def _fitting_meta_model(state: dict[str, torch.Tensor], path: Path) -> SesquiLSR:
    """SesquiLSR on the meta device when ``state`` (meta tensors too) fits it, else one FlowliftError line."""
    from flowlift.models.upscaler_weights import vae_kind
    from flowlift.models.weights import dtype_mismatch, state_dict_mismatch

    with torch.device("meta"):
        model = SesquiLSR()
    problem = state_dict_mismatch(model, state) or dtype_mismatch(model, state)
    if problem and "in_conv.weight" in state and "head_conv.0.weight" not in state:  # the other upscaler's file
        raise FlowliftError(
            f"{WHAT} from {path}: this file is the Flow Upscaler (the 2x-pass UNet), not SesquiLSR: give it as "
            f"{FIELD_MARK} PATH",
            field="upscaler",
        )
    if problem and (vae := vae_kind(state)):
        raise FlowliftError(
            f"{WHAT} from {path}: this file is a VAE ({vae}), not SesquiLSR: give it as {FIELD_MARK} PATH", field="vae"
        )
    if problem:
        raise FlowliftError(f"{WHAT} from {path} do not match the FLUX.2 SesquiLSR network: {problem}")
    return model


def check_sesqui_file(path: str | os.PathLike) -> Path:
    """``path`` as a SesquiLSR checkpoint, checked without reading its tensors: a file, safetensors, and its
    header's tensors those of the network (:func:`load_sesqui_lsr`'s lines, before anything loads)."""
    from flowlift.models.weights import header_state

    path = Path(os.fspath(path)).expanduser()
    if path.is_dir():
        raise FlowliftError(f"{WHAT}: {path} is a folder; give the weights file itself ({WEIGHTS_NAME})")
    if not path.is_file():
        raise FlowliftError(f"{WHAT}: {path}: no such file; {WHERE_TO_GET}")
    if path.suffix.lower() != ".safetensors":
        raise FlowliftError(f"{WHAT}: {path} is not a .safetensors file (the released weights are {WEIGHTS_NAME})")
    state, _ = header_state(path, what=f"{WHAT} {path}")
    _fitting_meta_model(state, path)
    return path


def load_sesqui_lsr(
    path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> SesquiLSR:
    """Load a SesquiLSR FLUX.2 checkpoint (safetensors only) strictly, in eval mode, on ``device`` in ``dtype``.

    Every tensor is checked before any memory is allocated (the network is built on the meta device): a
    missing, extra or mis-shaped tensor, a non-float tensor or a NaN/Inf is one FlowliftError line naming it.
    A missing file is one line saying where the released weights are; a ``path`` that is no file name, a
    ``device`` that is not here or a ``dtype`` that is no floating torch dtype one line naming it.
    """
    from flowlift.devices import resolve_device_option
    from flowlift.knobs import check_dtype, check_path
    from flowlift.models.weights import load_strict, read_state_dict

    device, dtype = resolve_device_option(device), check_dtype(dtype)
    path = check_sesqui_file(check_path("path", path))
    state = read_state_dict(path, what=WHAT)
    model = _fitting_meta_model(state, path).to_empty(device="cpu")
    load_strict(model, state, what=WHAT, origin=str(path))
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def require_bn_statistics(vae: object) -> None:
    """One line unless ``vae`` carries the FLUX.2 VAE's BN statistics, which SesquiLSR's raw latents need: TAEF2
    and Mage-VAE have none. Checked before SesquiLSR's weights load; the refusal names the ``latent_upscaler`` and
    ``vae`` fields, which each door words as its own (``--latent-upscaler`` and ``--vae`` on the command line)."""
    if getattr(vae, "bn_mean", None) is None or getattr(vae, "bn_std", None) is None:
        raise FlowliftError(
            f"{FIELD_MARK}: SesquiLSR works on raw FLUX.2 VAE latents and needs the FLUX.2 VAE's BN statistics, "
            f"which this VAE (TAEF2 or Mage-VAE) lacks: set {FIELD_MARK} to the FLUX.2 VAE or drop the latent upscaler",
            field=("latent_upscaler", "vae"),
        )


def raw_from_latents(latents: torch.Tensor, bn_mean: torch.Tensor, bn_std: torch.Tensor) -> torch.Tensor:
    """flowlift's normalized latents -> raw FLUX.2 VAE latents: ``patchify``, ``z * bn_std + bn_mean`` per
    patchified channel, ``unpatchify`` (:func:`flowlift.flux2.latents.denormalize`; even sides)."""
    from flowlift.flux2.latents import denormalize

    return denormalize(latents, bn_mean, bn_std)


def latents_from_raw(raw_latents: torch.Tensor, bn_mean: torch.Tensor, bn_std: torch.Tensor) -> torch.Tensor:
    """Raw FLUX.2 VAE latents -> flowlift's normalized latents: ``(z - bn_mean) / bn_std`` per patchified
    channel (:func:`flowlift.flux2.latents.normalize`; even sides). Inverse of :func:`raw_from_latents`."""
    from flowlift.flux2.latents import normalize

    return normalize(raw_latents, bn_mean, bn_std)


def sesqui_upscale_latents(
    model: SesquiLSR,
    latents: torch.Tensor,
    target_size: tuple[int, int],
    bn_mean: torch.Tensor | None,
    bn_std: torch.Tensor | None,
    *,
    forward: Callable[[SesquiLSR, torch.Tensor, tuple[int, int]], torch.Tensor] | None = None,
) -> torch.Tensor:
    """flowlift's normalized latents (B, 32, h, w) -> normalized latents at ``target_size`` (even sides):
    :func:`raw_from_latents`, the network in its dtype, :func:`latents_from_raw`, in float32 around it.

    ``bn_mean`` / ``bn_std`` are the FLUX.2 VAE's ([128]); None (TAEF2, Mage-VAE) is one line. ``forward(model,
    raw, target_size)`` runs the network (default: whole-frame; :func:`flowlift.models.sesqui_bands.sesqui_banded`
    in bands, for a memory budget).
    """
    from flowlift.flux2.latents import check_bn_statistics, check_latents
    from flowlift.models.weights import check_finite_result

    if bn_mean is None or bn_std is None:
        raise FlowliftError(
            "SesquiLSR works on raw FLUX.2 VAE latents and needs the FLUX.2 VAE's BN statistics; this VAE "
            f"(TAEF2 or Mage-VAE) encodes straight into the normalized space and has none: set {FIELD_MARK} to flux2",
            field="vae",
        )
    check_bn_statistics(bn_mean, bn_std, "SesquiLSR")
    if not isinstance(latents, torch.Tensor) or not latents.is_floating_point():
        got = latents.dtype if isinstance(latents, torch.Tensor) else type(latents).__name__
        raise FlowliftError(f"latents must be a floating tensor (normalized latents), got {got}", field="latents")
    # the input's own refusals (odd sides, NaN) before the network's: NaN in was said as "SesquiLSR produced NaN"
    check_latents(latents, "SesquiLSR", even=True)
    th, tw = check_target_size(tuple(latents.shape), target_size)
    if th % 2 or tw % 2:
        raise FlowliftError(f"SesquiLSR: target {th}x{tw} latents must have even sides (FLUX.2's 2x2 patches)")
    param = next(model.parameters())
    with torch.no_grad():
        raw = raw_from_latents(latents.float(), bn_mean, bn_std)
        raw = raw.to(param.device, param.dtype)
        out = (model(raw, (th, tw)) if forward is None else forward(model, raw, (th, tw))).float()
        result = latents_from_raw(out, bn_mean.to(out.device), bn_std.to(out.device))
    return check_finite_result(result, "SesquiLSR").to(latents.dtype)
