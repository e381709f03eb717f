"""The latent-level FLUX.2 loop, run the way the transformer was trained (``shared/seeds/000_*``), tiled for its frame.

Normalized start latents with unit-scale noise, the shifted schedule's window at the strength (respaced
or clipped, with a fixed or the empirical mu) and the inpaint merge with the start noise, for any
``velocity_fn(x, sigma)``: it needs no transformer, VAE or prompt, so the tests drive it with an
analytic Gaussian velocity. With ``tiles`` (:class:`~flowlift.refine.tiling.TileRequest`) the velocity runs in
overlapping tiles where the frame or the memory plan asks for them (:mod:`flowlift.refine.tiled_velocity`).
Every door runs this one loop: :class:`~flowlift.refine.refiner.Flux2Refiner`'s modes, and
:func:`tiled_refine_raw_latents` on a host application's raw FLUX.2 latents and its own transformer (InvokeAI's
*Tiled FLUX.2 Denoise* node); :func:`tiling_line` words the tiling record for a log. :class:`_Progress` shows its
steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from flowlift.devices import check_holds_values
from flowlift.errors import FlowliftError
from flowlift.flux2.latents import (
    PATCHIFIED_CHANNELS,
    check_bn_statistics,
    image_seq_len,
    normalize,
    seeded_noise,
    unpatchify,
)
from flowlift.flux2.sampling import VelocityFn
from flowlift.flux2.schedule import flux2_sigmas, resolve_mu
from flowlift.limits import LATENT_CHANNELS
from flowlift.refine.memory_plan import RefinePlan
from flowlift.refine.settings import MU, SCHEDULE, STEPS, STRENGTH, STRENGTH_MAP, SamplingSettings
from flowlift.refine.tiling import TileRequest

STRENGTH_MAPS = STRENGTH_MAP.choices

StepCallback = Callable[[int, int, float], None]


def denoising_start_for(strength: float, strength_map: str = STRENGTH_MAP.default) -> float:
    """``denoising_start`` of an img2img ``strength`` in [0, 1].

    ``linear``: ``1 - strength``; ``canvas``: ``1 - strength ** 0.2`` (the canvas "optimized denoising"
    map, far more aggressive at the strengths users pick: 0.5 -> 0.129).
    """
    from flowlift.flux2.schedule import canvas_denoising_start, linear_denoising_start

    strength = STRENGTH.check(strength)  # the knob table's domain (the hires fix's refine strength: the same)
    if strength_map == "linear":
        return float(linear_denoising_start(float(strength)))
    if strength_map == "canvas":
        return float(canvas_denoising_start(float(strength)))
    raise FlowliftError(
        f"strength_map must be one of {', '.join(STRENGTH_MAPS)}, got {strength_map!r}", field="strength_map"
    )


def _window_sigmas(
    steps: int, seq_len: int, start: float, end: float, mu: float | str, schedule: str
) -> tuple[torch.Tensor, float]:
    """``flux2_sigmas`` of the window and the mu it shifted with (a schedule it refuses is its FlowliftError)."""
    value = resolve_mu(mu, seq_len, steps)
    return flux2_sigmas(steps, seq_len, start, end, mu=value, schedule=schedule), value


def latent_noise(shape: Sequence[int], seed: int, *, device: torch.device | str = "cpu") -> torch.Tensor:
    """Unit noise for normalized latents of ``shape`` (B, 32, H, W), drawn in the *patchified* layout.

    Drawn as (B, 128, H/2, W/2) float32 on the CPU (the shape diffusers' FLUX.2 pipelines draw) and
    unpatchified, so a seed gives the same starting noise as ``Flux2KleinPipeline`` with
    ``generator=torch.Generator("cpu").manual_seed(seed)`` in float32.
    """
    b, c, h, w = shape
    if c != LATENT_CHANNELS or h % 2 or w % 2:
        raise ValueError(f"latent noise needs (B, 32, even H, even W), got {tuple(shape)}")
    patches = seeded_noise((b, PATCHIFIED_CHANNELS, h // 2, w // 2), seed, device="cpu", dtype=torch.float32)
    return unpatchify(patches).to(device)


@dataclass
class RefineResult:
    """Normalized output latents, the exact sigmas the model was run on, the start noise level, the
    schedule that made the sigmas (``mu`` the number it shifted with, ``mu_rule`` "fixed" or "empirical"), and
    (set by the refiner) how the transformer was tiled (``tiling``: ``tile_size`` asked, ``tiles`` that ran)."""

    latents: torch.Tensor
    sigmas: list[float]
    t0: float
    model_calls: int = 0
    mu: float | None = None
    mu_rule: str | None = None
    schedule: str | None = None
    tiling: dict[str, Any] = field(default_factory=dict)


def refine_latents(
    velocity_fn: VelocityFn,
    *,
    init_latents: torch.Tensor | None = None,
    shape: Sequence[int] | None = None,
    bn_mean: torch.Tensor | None = None,
    bn_std: torch.Tensor | None = None,
    denoising_start: float = 0.0,
    sampling: SamplingSettings | None = None,
    mask: torch.Tensor | None = None,
    on_step: StepCallback | None = None,
    device: torch.device | str = "cpu",
    tiles: TileRequest | None = None,
    memory_plan: Any = None,
) -> RefineResult:
    """Sample FLUX.2 latents: txt2img (no ``init_latents``), img2img, or inpaint (with ``mask``).

    * ``init_latents``: normalized (B, 32, H, W) latents, or *raw* VAE latents when ``bn_mean``/``bn_std``
      ([128]) are given -- then only they are normalized, never the noise blend.
    * ``sampling`` (:class:`~flowlift.refine.settings.SamplingSettings`: steps, seed, sampler, mu, schedule, each
      checked by its knob when it was made; ``mu``/``schedule`` None are the knobs' 2.02 and ``respaced``; None: the
      knobs' defaults).
    * ``tiles`` (None: one call per step): the velocity tiled for the frame as the knobs and ``memory_plan`` (a
      :class:`~flowlift.refine.memory_plan.RefinePlan`) decide; the result's ``tiling`` records it
      (``tile_size`` as asked; ``tiles`` when they ran). A batch of several images runs one tile of all per call.
    * ``sigmas = flux2_sigmas(steps, image_seq_len(H, W), denoising_start, 1, mu=mu,
      schedule=schedule)``: the shifted schedule (``mu`` 2.02 or a number, or ``"empirical"`` from the full
      sequence length and step count), its window respaced to ``steps`` steps or clipped; ``t0 = sigmas[0]``.
    * start: ``x = t0 * noise + (1 - t0) * normalize(init)`` (txt2img: ``x = noise``).
    * ``mask`` (1 or B, 1, H, W), 1 = regenerate: after each step the kept region is set to
      ``sigma_next * noise + (1 - sigma_next) * init`` with the *same* ``noise`` as the start.
    * ``sampler``: ``euler`` or ``heun`` on those sigmas, in every mode.
    * the window ends at sigma 0; ``denoising_start`` 1 (strength 0) runs no step and returns the normalized init.
    """
    from flowlift.devices import resolve_device_option
    from flowlift.flux2.img2img import InpaintMerger, denoise, prepare_start_latents
    from flowlift.knobs import check_callable, check_kind, check_unit_interval
    from flowlift.models.weights import check_finite_result

    velocity_fn = _shape_checked(check_callable("velocity_fn", velocity_fn))
    on_step = check_callable("on_step", on_step)
    device = resolve_device_option(device)  # one line for a device that is not here ('bogus', 'meta')
    sampling = check_kind("sampling", sampling, SamplingSettings, "a SamplingSettings", optional=True)
    sampling = sampling if sampling is not None else SamplingSettings()
    check_kind("tiles", tiles, TileRequest, "a TileRequest", optional=True)
    check_kind("memory_plan", memory_plan, RefinePlan, "a RefinePlan", optional=True)
    steps = sampling.steps if sampling.steps is not None else STEPS.default
    seed, sampler = sampling.seed, sampling.sampler
    mu = MU.default if sampling.mu is None else sampling.mu
    schedule = SCHEDULE.default if sampling.schedule is None else sampling.schedule
    denoising_start = check_unit_interval("denoising_start", denoising_start)
    if velocity_fn is None and denoising_start < 1.0:
        raise FlowliftError("velocity_fn must be a function (None only with denoising_start 1), got None")
    denoising_end = 1.0  # every refine runs to the clean image
    check_bn_statistics(bn_mean, bn_std, "refine_latents")
    init_latents, shape = _start(init_latents, shape, denoising_start, mask, device)

    record: dict[str, Any] = {}
    if tiles is not None and velocity_fn is not None:  # a batch of several images runs one tile of all per call
        from flowlift.refine.tiled_velocity import tiled_for_frame

        velocity_fn, record = tiled_for_frame(velocity_fn, shape[2:], tiles, memory_plan, images=shape[0])
    init_norm = None
    if init_latents is not None:
        init_norm = normalize(init_latents, bn_mean, bn_std) if bn_mean is not None else init_latents
    if denoising_start >= denoising_end:  # strength 0 (or an empty window): nothing to denoise
        init_norm = check_finite_result(init_norm, "refine_latents: normalizing the init latents (bn_std 0?)")
        return RefineResult(latents=init_norm, sigmas=[], t0=1.0 - denoising_start, tiling=record)

    noise = latent_noise(shape, seed, device=device)
    seq_len = image_seq_len(shape[2], shape[3])
    sigmas, mu_value = _window_sigmas(steps, seq_len, denoising_start, denoising_end, mu, schedule)
    sigma_list = [float(s) for s in sigmas]
    t0 = sigma_list[0]
    if init_latents is None:
        x = noise
    else:
        x = prepare_start_latents(init_latents, noise, t0, bn_mean=bn_mean, bn_std=bn_std)

    merger = None
    if mask is not None:
        merger = InpaintMerger(init_norm, _checked_mask(mask, shape, device), noise)

    calls = 0

    def counted(z: torch.Tensor, sigma: float) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return velocity_fn(z, sigma)

    def callback(i: int, *_: Any) -> None:
        if on_step is not None:
            on_step(i, len(sigma_list) - 1, sigma_list[i + 1])

    with torch.inference_mode():
        out = denoise(counted, x, sigmas, inpaint=merger, callback=callback, sampler=sampler)
    check_finite_result(out, "refine_latents: the velocity model or the init latents")  # never NaN latents
    mu_rule = "empirical" if isinstance(mu, str) else "fixed"
    return RefineResult(out, sigma_list, t0, calls, mu=mu_value, mu_rule=mu_rule, schedule=schedule, tiling=record)


def _shape_checked(velocity_fn: VelocityFn | None) -> VelocityFn | None:
    """``velocity_fn`` whose every answer (a tile's too) is checked: a tensor of its input's shape, else one line
    naming it (a wrong shape was a RuntimeError from the sampler's arithmetic, a broadcastable one a silently wrong
    result). None stays None."""
    if velocity_fn is None:
        return None

    def checked(z: torch.Tensor, sigma: float) -> torch.Tensor:
        v = velocity_fn(z, sigma)
        if not isinstance(v, torch.Tensor) or v.shape != z.shape or not v.is_floating_point():
            got = f"{str(v.dtype).removeprefix('torch.')} {tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v)
            raise FlowliftError(
                f"velocity_fn must return a floating tensor of its input's shape {tuple(z.shape)}, got {got}",
                field="velocity_fn",
            )
        if v.device != z.device:  # a meta or other-device answer: torch's "not on the expected device" in the step
            raise FlowliftError(
                f"velocity_fn must return a tensor on its input's device ({z.device}), got one on {v.device}",
                field="velocity_fn",
            )
        return v

    return checked


def _txt2img_shape(shape: Sequence[int] | None, denoising_start: float, mask: Any) -> tuple[int, ...]:
    """The latent shape of a txt2img run (no init latents), checked: (B, 32, even h, even w), from pure noise."""
    if shape is None:
        raise FlowliftError("refine_latents: txt2img (no init_latents) needs a latent shape")
    if denoising_start != 0.0:
        raise FlowliftError("txt2img starts from pure noise: denoising_start must be 0 (strength 1)")
    if mask is not None:
        raise FlowliftError("a mask needs an init image")
    shape = tuple(shape)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape) or len(shape) != 4:
        raise FlowliftError(f"refine_latents: shape must be four positive integers (B, 32, h, w), got {shape}")
    if shape[1] != LATENT_CHANNELS or shape[2] % 2 or shape[3] % 2:
        raise FlowliftError(f"refine_latents: shape must be (B, 32, even h, even w), got {shape}")
    return shape


def _start(
    init_latents: torch.Tensor | None, shape: Any, denoising_start: float, mask: Any, device: torch.device
) -> tuple[torch.Tensor | None, tuple[int, ...]]:
    """The init latents (checked, float32 on ``device``) and the shape to sample: txt2img's ``shape``, else the init
    latents' (a different ``shape`` beside them is refused: never silently one of the two)."""
    from flowlift.flux2.latents import check_latents

    if init_latents is None:
        return None, _txt2img_shape(shape, denoising_start, mask)
    check_latents(init_latents, "refine_latents", even=True)
    if shape is not None and tuple(shape) != tuple(init_latents.shape):
        raise FlowliftError(f"refine_latents: shape {tuple(shape)} differs from init_latents' (leave it out)")
    init_latents = init_latents.to(device=device, dtype=torch.float32)
    return init_latents, tuple(init_latents.shape)


def _checked_mask(mask: Any, shape: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """An inpaint latent mask (1 or B, 1, h, w) of finite values, as float32 on ``device``."""
    if not isinstance(mask, torch.Tensor) or mask.ndim != 4 or mask.shape[1] != 1 or mask.shape[2:] != shape[2:]:
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise FlowliftError(f"refine_latents: the latent mask must be (B, 1, {shape[2]}, {shape[3]}), got {got}")
    if mask.shape[0] not in (1, shape[0]):
        raise FlowliftError(f"refine_latents: a latent mask batch of {mask.shape[0]} for {shape[0]} latents")
    check_holds_values(mask, "refine_latents: the latent mask")
    mask = mask.to(device=device, dtype=torch.float32)
    if not bool(torch.isfinite(mask).all()):
        raise FlowliftError("refine_latents: the latent mask contains non-finite values (NaN/Inf)")
    if float(mask.min()) < 0.0 or float(mask.max()) > 1.0:
        raise FlowliftError("refine_latents: the latent mask must lie in [0, 1] (1 = regenerate)")
    return mask


def tiled_refine_raw_latents(
    transformer: torch.nn.Module,
    raw_latents: torch.Tensor,
    bn_mean: torch.Tensor,
    bn_std: torch.Tensor,
    prompt_embeds: torch.Tensor,
    *,
    strength: float,
    sampling: SamplingSettings,
    tiles: TileRequest,
    device: torch.device | str,
    on_step: Callable[..., Any] | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Refine raw FLUX.2 latents (B, 32, h, w) at img2img ``strength`` in tiles; (raw latents, tiling record).

    The host's transformer (a diffusers ``Flux2Transformer2DModel``) becomes a
    :class:`~flowlift.flux2.denoiser.Flux2Denoiser` on ``prompt_embeds`` (1, L, D); ``denoising_start = 1 -
    strength`` (linear); the schedule is flowlift's (``mu`` 2.02, respaced, unless ``sampling`` says otherwise).
    The record is the CLI's: ``tile_size`` as asked and ``tiles`` (size, overlap, grid, batch) when tiles ran.
    """
    from flowlift.flux2.denoiser import Flux2Denoiser, check_embeds_batch
    from flowlift.flux2.latents import denormalize

    check_embeds_batch({"prompt_embeds": prompt_embeds}, raw_latents.shape[0])  # one image's tiles, one prompt
    denoiser = Flux2Denoiser(transformer, prompt_embeds.to(device))
    bn_mean, bn_std = bn_mean.to(device), bn_std.to(device)
    result = refine_latents(
        denoiser,
        init_latents=raw_latents.to(device=device, dtype=torch.float32),
        bn_mean=bn_mean,
        bn_std=bn_std,
        denoising_start=denoising_start_for(strength),
        sampling=sampling,
        on_step=on_step,
        device=device,
        tiles=tiles,
    )
    return denormalize(result.latents, bn_mean, bn_std), result.tiling


def tiling_line(frame: tuple[int, int], record: dict[str, Any]) -> str:
    """The tiling ``record`` of a refine of a ``frame`` (h, w px) in one log line: the grid (rows x columns), the
    tile (w x h px), the overlap and tiles per call, or that the frame ran in one transformer call."""
    height, width = frame
    tiles = record.get("tiles")
    if tiles is None:
        return f"{width}x{height} px refined untiled (tile size {record['tile_size']})"
    (rows, cols), (tile_h, tile_w) = tiles["grid"], tiles["size"]
    return (
        f"{width}x{height} px refined in {rows}x{cols} tiles of {tile_w}x{tile_h} px, overlap {tiles['overlap']} px, "
        f"{tiles['batch']} per call"
    )


class _Progress:
    """The sampling steps' bar (``enabled``: :func:`flowlift.console.progress_bar`'s)."""

    def __init__(self, enabled: bool | None, desc: str) -> None:
        self.enabled, self.desc, self.bar = enabled, desc, None

    def __call__(self, i: int, total: int, sigma: float) -> None:
        from flowlift.progress import report_stage, report_step

        if i == 0:
            report_stage("steps")  # the run's stage and steps, for every door's progress (flowlift.progress)
        report_step(i + 1, total)
        if self.enabled is False:
            return
        if self.bar is None:
            from flowlift.console import progress_bar

            self.bar = progress_bar(total=total, desc=self.desc, unit="step", leave=False, enabled=self.enabled)
        self.bar.update(1)
        self.bar.set_postfix(sigma=f"{sigma:.3f}")
        if i + 1 == total:
            self.close()

    def close(self) -> None:
        """Close the bar (at the last step, and after a run that ended before it: stopped or failed)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
