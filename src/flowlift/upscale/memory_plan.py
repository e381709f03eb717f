"""One device-memory budget for a whole upscale: parse it, estimate each stage's peak, plan how each runs.

``max_memory`` (``6GB``) bounds the device peak of every stage of
:class:`flowlift.upscale.pipeline.FlowUpscalerPipeline`: the VAE encode, the UNet passes, SesquiLSR, the VAE decode
and both colour stages. :func:`plan_upscale_memory` is a pure function of sizes, dtypes and the budget; it returns an
:class:`UpscaleMemoryPlan` saying, per stage, how it runs:

* the VAE encode of the model input: whole frame when it fits (:func:`flowlift.limits.encode_peak_bytes`), else tiled;
* each UNet pass (:mod:`flowlift.upscale.pass_plan`): ``plain`` (whole-frame forward) when its estimated peak fits;
  else ``chunked`` (:class:`flowlift.upscale.chunked.executor.ChunkedExecutor`, full-frame stores on the device,
  strips as tall as the rest of the budget allows); else ``offload`` (stores in pinned host memory, strips from the
  budget), where the stores can leave the device (not on a CPU run, nor with ``offload_device`` the device itself);
* SesquiLSR (a fraction of the asked size in latent space, after the passes): whole frame when it fits, else in
  bands of rows (:func:`flowlift.models.sesqui_bands.sesqui_banded`, two stored frames);
* the VAE decode (of the passes' frame, or SesquiLSR's): whole frame when it fits, else tiled;
* stage 2 (the pixel colour fix): on the device when the float32 image (and a resampled final frame, for an asked
  size) fits next to the decoder's output, else on the host (the decoded image is copied out in strips and the device
  copy freed).

Modes a caller fixes (:class:`StageChoices`: ``chunked``, ``vae_tiled``, ``chunk_rows``, ``offload_device``,
MemoryPolicy's explicit ones) are not replanned but checked: one that does not fit is one FlowliftError line naming
it.
A budget too small for even the smallest of these raises one :class:`~flowlift.errors.FlowliftError`
line saying what the smallest plan needs. All peaks are *estimates* from the formulas below and the UNet's
in :mod:`flowlift.upscale.chunked.budget` (frame counts calibrated on the CPU, see ``docs/performance.md``);
without a budget the pipeline keeps its size-based defaults (a fraction of the free device memory).

Sizes: ``frame_bytes(b, c, h, w, dtype) = b * c * h * w * itemsize``; UNet sizes are latent pixels of
a pass's *output* (the noise sample), image sizes are pixels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from flowlift.errors import FIELD_MARK, FlowliftError
from flowlift.limits import (
    LATENT_CHANNELS,
    decode_peak_bytes,
    decoded_image_dtype,
    dtype_bytes,
    encode_peak_bytes,
    format_bytes,
    model_bytes,
)
from flowlift.models.sesqui_bands import banded_peak_bytes, rows_for_budget, whole_peak_bytes
from flowlift.upscale.chunked.budget import default_budget_bytes, frame_bytes
from flowlift.upscale.pass_plan import StoreSite, UNetPassPlan, pass_io_bytes, plan_unet_pass

__all__ = [
    "StageChoices",
    "UpscaleMemoryPlan",
    "check_weights_fit",
    "colour_stage_bytes",
    "latent_upscaler_rows",
    "latent_upscaler_rows_by_size",
    "plan_encode",
    "plan_latent_upscaler",
    "plan_upscale_memory",
    "plan_vae_stage",
]

#: The shortest SesquiLSR bands :func:`latent_upscaler_rows_by_size` picks (16 rows cost 1.03x the whole frame's CPU
#: time, 4 rows 1.56x: benchmarks/bench_sesqui_bands.py): without ``max_memory`` the budget is a default, not worth
#: a slower run.
MIN_LATENT_UPSCALER_ROWS = 16
#: Stage 2's strips (a few float32 RGB/Lab strips of ~1M px) and coarse maps, plus the reference image.
COLOUR_STRIP_BYTES = 64 << 20


def colour_stage_bytes(height: int, width: int, *, batch: int = 1, vae_dtype: torch.dtype = torch.float32) -> int:
    """Device peak of stage 2 on the device: the decoder's output, its float32 copy and the strips.

    ``b * 3 * h * w * (itemsize(vae) + 4) + COLOUR_STRIP_BYTES`` (no separate copy when the VAE is
    float32: ``b * 3 * h * w * 4 + COLOUR_STRIP_BYTES``).
    """
    image = batch * 3 * height * width
    copy = 0 if vae_dtype == torch.float32 else image * dtype_bytes(vae_dtype)
    return int(image * 4 + copy + COLOUR_STRIP_BYTES)


@dataclass(frozen=True)
class StageChoices:
    """What the caller fixed for the stages rather than the plan: ``latent_fraction`` (SesquiLSR's (height, width)
    latent after the passes), ``final_size`` ((width, height) the decoded frame is resampled to before stage 2, its
    float32 frame held by the colour stage), and MemoryPolicy's explicit ``chunked`` / ``vae_tiled`` (None: the plan
    decides; True/False: held, and checked against the budget), ``chunk_rows`` (a pass in strips takes that many
    rows, checked against the budget) and where a pass in strips may keep its stores (``stores``: off the device by
    default; :func:`flowlift.upscale.pass_plan.stores_can_leave` for a run's device and ``offload_device``)."""

    latent_fraction: tuple[int, int] | None = None
    final_size: tuple[int, int] | None = None
    chunked: bool | None = None
    vae_tiled: bool | None = None
    chunk_rows: int | None = None
    stores: StoreSite = StoreSite()


@dataclass(frozen=True)
class UpscaleMemoryPlan:
    """Per-stage choices for one upscale under ``budget_bytes`` (see the module docstring)."""

    budget_bytes: int
    passes: tuple[UNetPassPlan, ...]
    vae_tiled: bool
    colour_on_host: bool
    peak_bytes: int
    stage_peaks: dict[str, int] = field(default_factory=dict)
    #: SesquiLSR (a fraction in latent space): ``"whole frame"`` or ``"bands"`` of ``latent_upscaler_rows``
    #: rows (:func:`flowlift.models.sesqui_bands.sesqui_banded`); ``""`` where it does not run.
    latent_upscaler: str = ""
    latent_upscaler_rows: int | None = None
    #: The VAE encode's tiling (``vae_tiled`` is the decode's); only meaningful where ``"encode"`` is a stage.
    encode_tiled: bool = False

    def describe(self) -> str:
        """One line: the choices and the estimated peak against the budget."""
        unet = ", ".join(p.mode if p.strip_rows is None else f"{p.mode}({p.strip_rows} rows)" for p in self.passes)
        sesqui = self.latent_upscaler
        if self.latent_upscaler_rows is not None:
            sesqui = f"{self.latent_upscaler_rows}-row bands"
        image = (
            f"VAE decode {'tiled' if self.vae_tiled else 'whole frame'}; "
            f"colour fix on the {'host' if self.colour_on_host else 'device'}; "
        )
        encode = f"VAE encode {'tiled' if self.encode_tiled else 'whole frame'}; "
        return (
            f"max_memory {format_bytes(self.budget_bytes)}: "
            + (encode if "encode" in self.stage_peaks else "")
            + f"UNet {unet or 'no passes'}; "
            + (f"SesquiLSR {sesqui}; " if sesqui else "")
            + (image if "decode" in self.stage_peaks else "")
            + f"estimated peak {format_bytes(self.peak_bytes)}"
        )


def plan_vae_stage(
    stage: str, peaks: tuple[int, int], budget_bytes: int, what: str, tiled: bool | None = None
) -> tuple[bool, int]:
    """``(tiled, peak)`` of the VAE's ``stage`` (``"encode"`` / ``"decode"``) of ``what`` (``"a 1024x1024 image
    (batch 1)"``), whose whole-frame and tiled peaks are ``peaks``: the whole frame when it fits (it is the faster),
    else tiles. ``tiled`` True/False (MemoryPolicy's explicit ``vae_tiled``) holds that mode. One FlowliftError line
    when the mode taken does not fit: naming the forced mode, else what the smaller of the two needs."""
    whole, tiles = peaks
    if tiled is not None:
        peak = tiles if tiled else whole
        if peak > budget_bytes:
            forced = f"vae_tiled={tiled}"
            raise FlowliftError(
                f"{FIELD_MARK} {format_bytes(budget_bytes)} is too small for the {'tiled' if tiled else 'whole-frame'} "
                f"VAE {stage} of {what} that {FIELD_MARK} forces (about {format_bytes(peak)}): drop {FIELD_MARK} "
                "to let the plan choose",
                field=("max_memory", forced, forced),
            )
        return tiled, peak
    if whole <= budget_bytes:
        return False, whole
    if tiles <= budget_bytes:
        return True, tiles
    least = "tiled" if tiles < whole else "whole-frame"
    raise FlowliftError(
        f"max_memory {format_bytes(budget_bytes)} is too small to {stage} {what}: even the {least} {stage} needs "
        f"about {format_bytes(min(whole, tiles))}",
        field="max_memory",
    )


def plan_encode(
    vae_kind: str,
    height: int,
    width: int,
    budget_bytes: int,
    *,
    batch: int = 1,
    dtype: torch.dtype = torch.float32,
    weight_bytes: int = 0,
    tiled: bool | None = None,
) -> tuple[bool, int]:
    """``(tiled, peak)`` of the VAE encode of a (batch, 3, height, width) model input within ``budget_bytes``
    (:func:`plan_vae_stage`): the weights, the image and the model input in float32 (two frames) and
    :func:`~flowlift.limits.encode_peak_bytes`; ``tiled`` True/False holds that mode."""
    fixed = weight_bytes + 2 * frame_bytes(batch, 3, height, width, torch.float32)
    peaks = (
        fixed + encode_peak_bytes(vae_kind, height, width, batch=batch, dtype=dtype, tiled=t) for t in (False, True)
    )
    return plan_vae_stage("encode", tuple(peaks), budget_bytes, f"a {width}x{height} image (batch {batch})", tiled)


def check_weights_fit(budget_bytes: int, weight_bytes: int) -> None:
    """One FlowliftError line when ``budget_bytes`` cannot hold the models' ``weight_bytes``, whatever the image:
    every stage keeps them on the device (a pipeline checks it when made, before any input is read)."""
    if budget_bytes <= weight_bytes:
        raise FlowliftError(
            f"max_memory {format_bytes(budget_bytes)} does not even hold the model weights "
            f"({format_bytes(weight_bytes)}); give at least {format_bytes(weight_bytes)} plus room for the image",
            field="max_memory",
        )


def plan_upscale_memory(
    height: int,
    width: int,
    num_passes: int,
    budget_bytes: int,
    *,
    batch: int = 1,
    base_channels: int = 384,
    unet_dtype: torch.dtype = torch.float32,
    weight_bytes: int = 0,
    vae_kind: str | None = "flux2",
    vae_dtype: torch.dtype = torch.float32,
    spatial_factor: int = 8,
    choices: StageChoices = StageChoices(),
) -> UpscaleMemoryPlan:
    """Plan an upscale of a (batch, 3, height, width) model input by ``2**num_passes`` within a budget.

    Every model's weights (``weight_bytes``: the UNet's, the VAE's, SesquiLSR's) stay on the device throughout and
    count against every stage. ``vae_kind`` None plans latents only (no encode, no decode, no stage 2: the latent
    doors' and the hires fix's upscale, which decodes with its own plan). The encode holds the input's two float32
    frames (the image and the model input) beside :func:`encode_peak_bytes`. Pass ``p``'s sample is the input latent
    times ``2**(p+1)``. With ``choices.latent_fraction`` (a (height, width) latent within 2x of the passes' output),
    SesquiLSR resizes the passes' latents to it (:func:`plan_latent_upscaler`) and the decode makes its frame. The
    encode and the decode each run whole-frame when that fits, else tiled (:func:`plan_vae_stage`); stage 2 runs on
    the device when the decode's output, its float32 copy and a resampled ``choices.final_size`` frame fit
    (:func:`colour_stage_bytes`), else on the host. Raises a FlowliftError line when some stage cannot fit at all,
    or a mode ``choices`` fixes does not.
    """
    check_weights_fit(budget_bytes, weight_bytes)
    peaks: dict[str, int] = {}
    encode_tiled = False
    if vae_kind is not None:
        coding = {"batch": batch, "dtype": vae_dtype, "weight_bytes": weight_bytes, "tiled": choices.vae_tiled}
        encode_tiled, peaks["encode"] = plan_encode(vae_kind, height, width, budget_bytes, **coding)
    latent_h, latent_w = height // spatial_factor, width // spatial_factor
    passes = []
    for index in range(num_passes):
        h, w = latent_h * 2 ** (index + 1), latent_w * 2 ** (index + 1)
        fixed = weight_bytes + pass_io_bytes(h, w, batch=batch, dtype=unet_dtype)
        unet = {"batch": batch, "base_channels": base_channels, "dtype": unet_dtype, "chunked": choices.chunked}
        held = {"chunk_rows": choices.chunk_rows, "stores": choices.stores}
        passes.append(plan_unet_pass(h, w, budget_bytes, fixed_bytes=fixed, **held, **unet))
    out_h, out_w = height * 2**num_passes, width * 2**num_passes
    sesqui, sesqui_rows, sesqui_peak = "", None, 0
    if choices.latent_fraction is not None:
        passed = (out_h // spatial_factor, out_w // spatial_factor)
        sesqui_rows, sesqui_peak = plan_latent_upscaler(
            passed, choices.latent_fraction, budget_bytes, batch, weight_bytes
        )
        sesqui = "whole frame" if sesqui_rows is None else "bands"
        out_h, out_w = choices.latent_fraction[0] * spatial_factor, choices.latent_fraction[1] * spatial_factor
    peaks.update({f"pass {i + 1}": p.peak_bytes for i, p in enumerate(passes)})
    if sesqui:
        peaks["latent upscaler"] = sesqui_peak
    if vae_kind is None:
        peak = max(peaks.values(), default=weight_bytes)
        return UpscaleMemoryPlan(budget_bytes, tuple(passes), False, False, peak, peaks, sesqui, sesqui_rows)
    latent_bytes = frame_bytes(batch, LATENT_CHANNELS, out_h // spatial_factor, out_w // spatial_factor, torch.float32)
    sizes = {"batch": batch, "dtype": vae_dtype}
    decoded = (
        weight_bytes + latent_bytes + decode_peak_bytes(vae_kind, out_h, out_w, tiled=tiled, **sizes)
        for tiled in (False, True)
    )
    what = f"a {out_w}x{out_h} image (batch {batch})"
    tiled, peaks["decode"] = plan_vae_stage("decode", tuple(decoded), budget_bytes, what, choices.vae_tiled)
    image_dtype = decoded_image_dtype(vae_kind, vae_dtype)
    final_w, final_h = choices.final_size or (0, 0)  # the resampled frame, in float32 beside the decoded one
    final = frame_bytes(batch, 3, final_h, final_w, torch.float32)
    colour = weight_bytes + colour_stage_bytes(out_h, out_w, batch=batch, vae_dtype=image_dtype) + final
    colour_on_host = colour > budget_bytes
    # On the host path the device holds the decoder's output until it is copied out strip by strip; the resample to
    # the final size then runs on the host.
    peaks["colour"] = weight_bytes + frame_bytes(batch, 3, out_h, out_w, image_dtype) if colour_on_host else colour
    return UpscaleMemoryPlan(
        budget_bytes=budget_bytes,
        passes=tuple(passes),
        vae_tiled=tiled,
        colour_on_host=colour_on_host,
        peak_bytes=max(peaks.values()),
        stage_peaks=peaks,
        latent_upscaler=sesqui,
        latent_upscaler_rows=sesqui_rows,
        encode_tiled=encode_tiled,
    )


def plan_latent_upscaler(
    passed: tuple[int, int], target: tuple[int, int], budget_bytes: int, batch: int, fixed_bytes: int
) -> tuple[int | None, int]:
    """How SesquiLSR resizes the passes' ``passed`` (height, width) latents to ``target`` within ``budget_bytes``:
    ``(None, peak)`` whole-frame when :func:`~flowlift.models.sesqui_bands.whole_peak_bytes` fits, else
    ``(rows, peak)`` in bands of the most rows that fit (:func:`~flowlift.models.sesqui_bands.rows_for_budget`).

    ``fixed_bytes`` (the weights) and the latents around the network (the passes' float32 output and its raw
    copy, the network's output and the normalized result: ``2 * b * 32 * 4 * (hw + th tw)`` bytes) come off the
    budget first; a remainder that holds no band of one row is a FlowliftError line.
    """
    (h, w), (th, tw) = passed, target
    fixed = fixed_bytes + 2 * frame_bytes(batch, LATENT_CHANNELS, h, w, torch.float32)
    fixed += 2 * frame_bytes(batch, LATENT_CHANNELS, th, tw, torch.float32)
    whole = fixed + whole_peak_bytes(batch, h, w)
    if whole <= budget_bytes:
        return None, whole
    rows = rows_for_budget(budget_bytes - fixed, batch, h, w, target)
    if rows < 1:
        need = fixed + banded_peak_bytes(batch, h, w, target, 1)
        raise FlowliftError(
            f"max_memory {format_bytes(budget_bytes)} is too small for SesquiLSR from {w}x{h} to {tw}x{th} latents "
            f"(batch {batch}): even in one-row bands it needs about {format_bytes(need)}",
            field="max_memory",
        )
    return rows, fixed + banded_peak_bytes(batch, h, w, target, rows)


def latent_upscaler_rows_by_size(
    passed: tuple[int, int],
    target: tuple[int, int],
    batch: int,
    device: str | torch.device,
    budget_bytes: int | None = None,
) -> int | None:
    """Without ``max_memory``, SesquiLSR by size as the UNet is chunked: whole-frame (None) while its estimated
    peak fits the chunking budget (``budget_bytes``, else a fraction of a CUDA device's free memory or 1 GiB:
    :func:`~flowlift.upscale.chunked.budget.default_budget_bytes`), else bands of the most rows that fit, at least
    :data:`MIN_LATENT_UPSCALER_ROWS` (never a refusal: that budget is no promise)."""
    (h, w), budget = passed, default_budget_bytes(device, budget_bytes)
    if whole_peak_bytes(batch, h, w) <= budget:
        return None
    return min(max(rows_for_budget(budget, batch, h, w, target), MIN_LATENT_UPSCALER_ROWS), 2 * h)


def latent_upscaler_rows(
    pipeline: Any,
    sesqui: Any,
    passed: tuple[int, int],
    target: tuple[int, int],
    batch: int,
    plan: UpscaleMemoryPlan | None = None,
) -> int | None:
    """SesquiLSR's band rows (None: the whole frame) from ``passed`` to ``target`` latents under a
    :class:`~flowlift.upscale.pipeline.FlowUpscalerPipeline`'s memory settings: with its ``max_memory`` the plan's
    (``plan``, else :func:`plan_latent_upscaler` for ``sesqui`` beside the pipeline's models), else by size within
    its chunking budget (:func:`latent_upscaler_rows_by_size`)."""
    if pipeline.max_memory is None:
        return latent_upscaler_rows_by_size(passed, target, batch, pipeline.device, pipeline.chunk_budget_bytes)
    if plan is not None:
        return plan.latent_upscaler_rows
    weights = sum(model_bytes(m) for m in (pipeline.upscaler, pipeline.vae, sesqui))
    return plan_latent_upscaler(passed, target, pipeline.max_memory, batch, weights)[0]
