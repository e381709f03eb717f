"""FLUX.2 txt2img, img2img, inpaint, outpaint, reference images and the hires fix.

Everything runs the FLUX.2 transformer the way it was trained to be run (see
``shared/seeds/000_*``, the img2img posterization write-up):

* start latents are built in **normalized** space with **unit-scale** noise:
  ``x0 = t0 * noise + (1 - t0) * normalize(init)`` -- only the init latents are normalized
  (:func:`flowlift.flux2.img2img.prepare_start_latents`);
* the sigma schedule is the **shifted** FLUX.2 schedule with ``mu`` from the full image sequence
  length and the full step count, clipped to ``[1 - denoising_start, 1 - denoising_end]``
  (:func:`flowlift.flux2.schedule.flux2_sigmas`), for every sampler (Euler and Heun alike);
* inpaint / outpaint re-noise the kept region after each step with the **same** noise as the start
  latents (:class:`flowlift.flux2.img2img.InpaintMerger`).

The latent-level core is :func:`refine_latents` (any ``velocity_fn(x, sigma)``; the tests drive it with
an analytic Gaussian velocity). :class:`Flux2Refiner` adds the VAE, the prompt conditioning and the
image modes; :func:`load_refiner` builds one from FLUX.2 Klein / dev weights (diffusers layout, local
folder or hub id).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from flowlift.errors import FlowliftError
from flowlift.flux2.latents import (
    LATENT_CHANNELS,
    PATCHIFIED_CHANNELS,
    VAE_SCALE_FACTOR,
    image_seq_len,
    normalize,
    seeded_noise,
    unpatchify,
)
from flowlift.flux2.sampling import SAMPLERS
from flowlift.models.weights import looks_like_repo_id

STRENGTH_MAPS = ("linear", "canvas")
#: Images are processed on a 16-pixel grid (8x VAE, then 2x2 patches); other sizes are edge-padded.
PIXEL_MULTIPLE = VAE_SCALE_FACTOR * 2

VelocityFn = Callable[[torch.Tensor, float], torch.Tensor]
StepCallback = Callable[[int, int, float], None]


# --------------------------------------------------------------------------------------------- maths


def denoising_start_for(strength: float, strength_map: str = "linear") -> float:
    """``denoising_start`` of an img2img ``strength`` in [0, 1].

    ``linear``: ``1 - strength``; ``canvas``: ``1 - strength ** 0.2`` (the canvas "optimized denoising"
    map, far more aggressive at the strengths users pick: 0.5 -> 0.129).
    """
    from flowlift.flux2.schedule import canvas_denoising_start, linear_denoising_start

    if not 0.0 <= float(strength) <= 1.0:
        raise FlowliftError(f"strength must be in [0, 1], got {strength}")
    if strength_map == "linear":
        return float(linear_denoising_start(float(strength)))
    if strength_map == "canvas":
        return float(canvas_denoising_start(float(strength)))
    raise FlowliftError(f"unknown strength map {strength_map!r}; choose one of {', '.join(STRENGTH_MAPS)}")


def check_sampler(sampler: str) -> str:
    """Return ``sampler`` if flowlift can run it on the shifted schedule, else one FlowliftError line."""
    if sampler not in SAMPLERS:
        raise FlowliftError(f"unknown sampler {sampler!r}; flowlift runs {', '.join(SAMPLERS)}")
    return sampler


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
    """Normalized output latents plus the exact sigmas the model was run on and the start noise level."""

    latents: torch.Tensor
    sigmas: list[float]
    t0: float
    model_calls: int = 0


def refine_latents(
    velocity_fn: VelocityFn,
    *,
    init_latents: torch.Tensor | None = None,
    shape: Sequence[int] | None = None,
    bn_mean: torch.Tensor | None = None,
    bn_std: torch.Tensor | None = None,
    denoising_start: float = 0.0,
    denoising_end: float = 1.0,
    steps: int = 28,
    seed: int = 0,
    sampler: str = "euler",
    mask: torch.Tensor | None = None,
    on_step: StepCallback | None = None,
    device: torch.device | str = "cpu",
) -> RefineResult:
    """Sample FLUX.2 latents: txt2img (no ``init_latents``), img2img, or inpaint (with ``mask``).

    * ``init_latents``: normalized (B, 32, H, W) latents, or *raw* VAE latents when ``bn_mean``/``bn_std``
      ([128]) are given -- then only they are normalized, never the noise blend.
    * ``sigmas = flux2_sigmas(steps, image_seq_len(H, W), denoising_start, denoising_end)``: the shifted
      schedule with mu from the full sequence length and step count, clipped; ``t0 = sigmas[0]``.
    * start: ``x = t0 * noise + (1 - t0) * normalize(init)`` (txt2img: ``x = noise``).
    * ``mask`` (1 or B, 1, H, W), 1 = regenerate: after each step the kept region is set to
      ``sigma_next * noise + (1 - sigma_next) * init`` with the *same* ``noise`` as the start.
    * ``sampler``: ``euler`` or ``heun`` on those sigmas, in every mode.
    * ``denoising_start >= denoising_end`` (strength 0) runs no step and returns the normalized init.
    """
    from flowlift.flux2.img2img import InpaintMerger, denoise, prepare_start_latents
    from flowlift.flux2.schedule import flux2_sigmas

    check_sampler(sampler)
    if steps < 1:
        raise FlowliftError(f"steps must be >= 1, got {steps}")
    if not 0.0 <= denoising_start <= 1.0 or not 0.0 <= denoising_end <= 1.0 or denoising_start > denoising_end:
        raise FlowliftError(f"need 0 <= denoising_start <= denoising_end <= 1, got {denoising_start}, {denoising_end}")
    if (bn_mean is None) != (bn_std is None):
        raise ValueError("give both bn_mean and bn_std, or neither")
    if init_latents is None:
        if shape is None:
            raise ValueError("txt2img needs a latent shape")
        if denoising_start != 0.0:
            raise FlowliftError("txt2img starts from pure noise: denoising_start must be 0 (strength 1)")
        if mask is not None:
            raise FlowliftError("a mask needs an init image")
        shape = tuple(shape)
    else:
        init_latents = init_latents.to(device=device, dtype=torch.float32)
        shape = tuple(init_latents.shape)
    if len(shape) != 4 or shape[1] != LATENT_CHANNELS or shape[2] % 2 or shape[3] % 2:
        raise ValueError(f"expected (B, 32, even H, even W) latents, got {shape}")

    init_norm = None
    if init_latents is not None:
        init_norm = normalize(init_latents, bn_mean, bn_std) if bn_mean is not None else init_latents
    if denoising_start >= denoising_end:  # strength 0 (or an empty window): nothing to denoise
        return RefineResult(latents=init_norm, sigmas=[], t0=1.0 - denoising_start)

    noise = latent_noise(shape, seed, device=device)
    sigmas = flux2_sigmas(steps, image_seq_len(shape[2], shape[3]), denoising_start, denoising_end)
    sigma_list = [float(s) for s in sigmas]
    t0 = sigma_list[0]
    if init_latents is None:
        x = noise
    else:
        x = prepare_start_latents(init_latents, noise, t0, bn_mean=bn_mean, bn_std=bn_std)

    merger = None
    if mask is not None:
        mask = mask.to(device=device, dtype=torch.float32)
        if mask.ndim != 4 or mask.shape[1] != 1 or mask.shape[2:] != shape[2:]:
            raise ValueError(f"latent mask must be (B, 1, {shape[2]}, {shape[3]}), got {tuple(mask.shape)}")
        merger = InpaintMerger(init_norm, mask, noise)

    calls = 0

    def counted(z: torch.Tensor, sigma: float) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return velocity_fn(z, sigma)

    n_steps = len(sigma_list) - 1

    def callback(i: int, *_: Any) -> None:
        if on_step is not None:
            on_step(i, n_steps, sigma_list[i + 1])

    with torch.inference_mode():
        out = denoise(counted, x, sigmas, inpaint=merger, callback=callback, sampler=sampler)
    return RefineResult(latents=out, sigmas=sigma_list, t0=t0, model_calls=calls)


# ------------------------------------------------------------------------------------- image helpers


def pad_to_multiple(images: torch.Tensor, multiple: int = PIXEL_MULTIPLE) -> tuple[torch.Tensor, tuple[int, int]]:
    """Edge-replicate pad (B, C, H, W) on the right/bottom to multiples of ``multiple``; returns the pad."""
    h, w = images.shape[-2:]
    ph, pw = (-h) % multiple, (-w) % multiple
    if ph or pw:
        images = F.pad(images, (0, pw, 0, ph), mode="replicate")
    return images, (ph, pw)


def latent_mask(mask: torch.Tensor) -> torch.Tensor:
    """Pixel mask (B, 1, H, W) in [0, 1] (1 = regenerate) -> latent mask at 1/8: the mean of each 8x8 cell.

    Cells entirely outside the masked region are exactly 0, so they are kept exactly.
    """
    if mask.ndim != 4 or mask.shape[1] != 1:
        raise ValueError(f"mask must be (B, 1, H, W), got {tuple(mask.shape)}")
    return F.avg_pool2d(mask.float(), VAE_SCALE_FACTOR)


def outpaint_pads(height: int, width: int, left: int, top: int, right: int, bottom: int) -> tuple[int, int, int, int]:
    """The borders rounded up to multiples of 16 px, checked before anything is allocated.

    The canvas ``(height + top + bottom) x (width + left + right)`` must stay within
    :data:`flowlift.upscale.pipeline.MAX_OUTPUT_SIDE` per side (the package's output cap), else one
    FlowliftError line: ``--outpaint 0,0,1000000,0`` would otherwise try to allocate the canvas.
    """
    from flowlift.upscale.pipeline import MAX_OUTPUT_SIDE

    pads = tuple(-(-max(0, int(p)) // PIXEL_MULTIPLE) * PIXEL_MULTIPLE for p in (left, top, right, bottom))
    if not any(pads):
        raise FlowliftError("outpaint needs a border: give at least one of left/top/right/bottom > 0")
    canvas_h, canvas_w = height + pads[1] + pads[3], width + pads[0] + pads[2]
    if max(canvas_h, canvas_w) > MAX_OUTPUT_SIDE:
        raise FlowliftError(
            f"outpaint canvas {canvas_w}x{canvas_h} exceeds MAX_OUTPUT_SIDE={MAX_OUTPUT_SIDE} px per side; "
            "use smaller borders"
        )
    return pads  # type: ignore[return-value]


def outpaint_canvas(
    images: torch.Tensor, left: int, top: int, right: int, bottom: int
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int, int]]:
    """Edge-replicate canvas for outpainting and its pixel mask (1 on the new border).

    The image sides must be multiples of 16 px; the pads are rounded up to multiples of 16 px so the
    original region stays aligned with the transformer's 2x2 latent patches.
    """
    h, w = images.shape[-2:]
    if h % PIXEL_MULTIPLE or w % PIXEL_MULTIPLE:
        raise FlowliftError(
            f"outpaint needs image sides that are multiples of {PIXEL_MULTIPLE} px, got {w}x{h}; crop or resize first"
        )
    pads = outpaint_pads(h, w, left, top, right, bottom)
    left, top, right, bottom = pads
    canvas = F.pad(images, (left, right, top, bottom), mode="replicate")
    mask = torch.ones(images.shape[0], 1, canvas.shape[-2], canvas.shape[-1], device=images.device)
    mask[:, :, top : top + h, left : left + w] = 0.0
    return canvas, mask, (left, top, right, bottom)


# ----------------------------------------------------------------------------------------------- VAE


class RefineVAE(Protocol):
    """What :class:`Flux2Refiner` needs from a VAE: normalized latents in and out.

    A FLUX.2 VAE also has ``encode_raw`` (raw 32-channel latents) and ``bn_mean``/``bn_std`` ([128]);
    img2img then blends noise with ``normalize(raw)`` (the normalization touches the init only).
    """

    def encode(self, images: torch.Tensor) -> torch.Tensor: ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor: ...


# -------------------------------------------------------------------------------------- conditioning


class PromptEncoder:
    """Prompt -> FLUX.2 embeddings with the matching diffusers pipeline's text encoder (optional extra).

    Loads the pipeline of ``model`` (``Flux2Pipeline``: Mistral-3; ``Flux2KleinPipeline``: Qwen3) without
    its transformer and VAE, and calls its ``encode_prompt``. Needs ``pip install 'flowlift[text]'``.
    """

    def __init__(self, model: str, *, device: torch.device | str, dtype: torch.dtype) -> None:
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise FlowliftError(
                "computing prompt embeddings needs the text extra (pip install 'flowlift[text]'); "
                "or pass precomputed --prompt-embeds"
            ) from None
        from diffusers import DiffusionPipeline

        try:
            self.pipe = DiffusionPipeline.from_pretrained(model, transformer=None, vae=None, torch_dtype=dtype)
        except Exception as error:  # noqa: BLE001 - any loader failure is a bad --model to the user
            raise FlowliftError(f"cannot load the text encoder of {model}: {_first_line(error)}") from None
        self.pipe.text_encoder.to(device)
        self.device = torch.device(device)

    @torch.inference_mode()
    def __call__(self, prompt: str) -> torch.Tensor:
        embeds, _ = self.pipe.encode_prompt(prompt=prompt, device=self.device)
        return embeds.float()


def check_prompt_embeds(state: dict[str, torch.Tensor], *, origin: str) -> None:
    """Refuse prompt embeddings that are not floating point or hold NaN/Inf (checked once, at load).

    Non-finite embeddings propagate through every attention layer and decode to a black image.
    """
    from flowlift.models.weights import check_finite_state

    for name in ("prompt_embeds", "negative_prompt_embeds"):
        tensor = state.get(name)
        if tensor is not None and not tensor.is_floating_point():
            dtype = str(tensor.dtype).removeprefix("torch.")
            raise FlowliftError(f"prompt embeddings ({origin}): `{name}` has dtype {dtype}, expected floating point")
    check_finite_state(state, what="prompt embeddings", origin=origin)


def load_prompt_embeds(path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Read ``prompt_embeds`` (and optional ``negative_prompt_embeds``) from a safetensors/.pt file."""
    from flowlift.models.weights import read_state_dict

    state = read_state_dict(path, what="prompt embeddings")
    if "prompt_embeds" not in state:
        raise FlowliftError(f"prompt embeddings: {path} has no 'prompt_embeds' tensor (keys: {', '.join(state)})")
    check_prompt_embeds(state, origin=str(path))
    embeds = state["prompt_embeds"].float()
    if embeds.ndim == 2:
        embeds = embeds[None]
    negative = state.get("negative_prompt_embeds")
    if negative is not None:
        negative = negative.float()
        if negative.ndim == 2:
            negative = negative[None]
    return embeds, negative


# ---------------------------------------------------------------------------------------- the refiner


class _Progress:
    def __init__(self, enabled: bool, desc: str) -> None:
        self.enabled, self.desc, self.bar = enabled, desc, None

    def __call__(self, i: int, total: int, sigma: float) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=self.desc, unit="step", leave=False)
        self.bar.update(1)
        self.bar.set_postfix(sigma=f"{sigma:.3f}")
        if i + 1 == total:
            self.bar.close()
            self.bar = None


@dataclass
class RefineOutput:
    """Images (B, 3, H, W) in [0, 1], their normalized latents, and the parameters that made them."""

    images: torch.Tensor
    latents: torch.Tensor
    parameters: dict[str, Any]


class Flux2Refiner:
    """txt2img / img2img / inpaint / outpaint / hires on a FLUX.2 transformer and VAE.

    ``transformer`` is a diffusers ``Flux2Transformer2DModel`` (or a module with its forward signature);
    ``vae`` follows :class:`RefineVAE` (e.g. a :func:`flowlift.models.vae_loading.load_vae` adapter).
    ``prompt_encoder`` (optional) turns prompt strings into embeddings; without it, pass
    ``prompt_embeds`` tensors.
    """

    def __init__(
        self,
        transformer: torch.nn.Module,
        vae: RefineVAE,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        prompt_encoder: Callable[[str], torch.Tensor] | None = None,
        progress: bool = False,
        model_name: str = "",
    ) -> None:
        self.transformer = transformer.to(device=device, dtype=dtype).eval()
        self.vae = vae
        self.device, self.dtype = torch.device(device), dtype
        self.prompt_encoder = prompt_encoder
        self.progress = progress
        self.model_name = model_name

    # -- conditioning

    def _embeds(self, prompt: str | None, embeds: torch.Tensor | None, what: str) -> torch.Tensor | None:
        if embeds is not None:
            return embeds.to(self.device, torch.float32)
        if prompt is None:
            return None
        if self.prompt_encoder is None:
            raise FlowliftError(
                f"no text encoder loaded to embed the {what}; pass precomputed embeddings (--prompt-embeds)"
            )
        return self.prompt_encoder(prompt).to(self.device, torch.float32)

    def denoiser(
        self,
        *,
        prompt: str | None = None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt: str | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        cfg_scale: float = 1.0,
        guidance: float | None = None,
        reference_images: Sequence[torch.Tensor] = (),
    ):
        """The :class:`~flowlift.flux2.denoiser.Flux2Denoiser` for a prompt (and references)."""
        from flowlift.flux2.denoiser import Flux2Denoiser

        pos = self._embeds(prompt, prompt_embeds, "prompt")
        if pos is None:
            raise FlowliftError("give a prompt or prompt embeddings")
        neg = None
        if cfg_scale != 1.0:
            neg = self._embeds(
                "" if negative_prompt is None else negative_prompt, negative_prompt_embeds, "negative prompt"
            )
        refs = [self.encode(img) for img in reference_images]  # clean normalized latents, no noise
        return Flux2Denoiser(
            self.transformer,
            pos,
            negative_prompt_embeds=neg,
            cfg_scale=cfg_scale,
            guidance=guidance,
            reference_latents=refs,
        )

    # -- VAE

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images [0, 1] (sides multiples of 16) -> normalized latents."""
        return self.vae.encode(images.to(self.device)).float()

    def _encode_init(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Init latents for img2img: raw + BN stats when the VAE exposes them, else normalized."""
        if hasattr(self.vae, "encode_raw") and getattr(self.vae, "bn_mean", None) is not None:
            raw = self.vae.encode_raw(images.to(self.device)).float()
            return raw, self.vae.bn_mean.to(self.device), self.vae.bn_std.to(self.device)
        return self.encode(images), None, None

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalized latents -> images clamped to [0, 1]."""
        return self.vae.decode(latents).float().clamp(0.0, 1.0)

    # -- modes

    def _run(
        self,
        mode: str,
        velocity_fn: VelocityFn,
        *,
        init: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None,
        shape: Sequence[int] | None,
        denoising_start: float,
        steps: int,
        seed: int,
        sampler: str,
        mask: torch.Tensor | None = None,
        denoising_end: float = 1.0,
    ) -> RefineResult:
        init_latents, bn_mean, bn_std = init if init is not None else (None, None, None)
        return refine_latents(
            velocity_fn,
            init_latents=init_latents,
            shape=shape,
            bn_mean=bn_mean,
            bn_std=bn_std,
            denoising_start=denoising_start,
            denoising_end=denoising_end,
            steps=steps,
            seed=seed,
            sampler=sampler,
            mask=mask,
            on_step=_Progress(self.progress, mode),
            device=self.device,
        )

    def _parameters(self, mode: str, result: RefineResult, **kwargs: Any) -> dict[str, Any]:
        from flowlift import __version__

        params = {"flowlift": __version__, "mode": mode, "model": self.model_name}
        # what ran, not what was asked for ("auto")
        params.update(dtype=str(self.dtype).removeprefix("torch."), device=str(self.device))
        params.update({k: v for k, v in kwargs.items() if v is not None})
        params["sigmas"] = [round(s, 6) for s in result.sigmas]
        params["t0"] = round(result.t0, 6)
        params["model_calls"] = result.model_calls
        return params

    def txt2img(
        self,
        *,
        height: int,
        width: int,
        steps: int = 28,
        seed: int = 0,
        sampler: str = "euler",
        batch: int = 1,
        **conditioning: Any,
    ) -> RefineOutput:
        """Generate from pure noise (``denoising_start = 0``) at ``height x width`` (multiples of 16)."""
        if height % PIXEL_MULTIPLE or width % PIXEL_MULTIPLE or height <= 0 or width <= 0:
            raise FlowliftError(f"txt2img size must be positive multiples of {PIXEL_MULTIPLE}, got {width}x{height}")
        den = self.denoiser(**conditioning)
        shape = (batch, LATENT_CHANNELS, height // VAE_SCALE_FACTOR, width // VAE_SCALE_FACTOR)
        result = self._run(
            "txt2img", den, init=None, shape=shape, denoising_start=0.0, steps=steps, seed=seed, sampler=sampler
        )
        params = self._parameters(
            "txt2img",
            result,
            height=height,
            width=width,
            steps=steps,
            seed=seed,
            sampler=sampler,
            **_conditioning_params(conditioning, den),
        )
        return RefineOutput(self.decode(result.latents), result.latents, params)

    def img2img(
        self,
        images: torch.Tensor,
        *,
        strength: float,
        strength_map: str = "linear",
        steps: int = 28,
        seed: int = 0,
        sampler: str = "euler",
        mask: torch.Tensor | None = None,
        **conditioning: Any,
    ) -> RefineOutput:
        """Refine ``images`` (B, 3, H, W) in [0, 1] at ``strength``; with ``mask`` (B|1, 1, H, W) inpaint.

        Sides that are not multiples of 16 are edge-padded for the model and cropped back.
        ``strength`` 0 returns the VAE round trip of the input; 1 ignores the input (txt2img noise).
        """
        check_sampler(sampler)
        start = denoising_start_for(strength, strength_map)
        h, w = images.shape[-2:]
        padded, _ = pad_to_multiple(images.to(self.device, torch.float32))
        lmask = None
        if mask is not None:
            if mask.shape[-2:] != (h, w):
                raise FlowliftError(f"mask size {mask.shape[-1]}x{mask.shape[-2]} differs from the image {w}x{h}")
            lmask = latent_mask(pad_to_multiple(mask.to(self.device, torch.float32))[0])
        den = self.denoiser(**conditioning) if start < 1.0 else None
        mode = "inpaint" if mask is not None else "img2img"
        result = self._run(
            mode,
            den,
            init=self._encode_init(padded),
            shape=None,
            denoising_start=start,
            steps=steps,
            seed=seed,
            sampler=sampler,
            mask=lmask,
        )
        out = self.decode(result.latents)[..., :h, :w]
        params = self._parameters(
            mode,
            result,
            strength=strength,
            strength_map=strength_map,
            denoising_start=round(start, 6),
            steps=steps,
            seed=seed,
            sampler=sampler,
            width=w,
            height=h,
            **(_conditioning_params(conditioning, den) if den is not None else {}),
        )
        return RefineOutput(out, result.latents, params)

    def inpaint(
        self, images: torch.Tensor, mask: torch.Tensor, *, strength: float = 1.0, **kwargs: Any
    ) -> RefineOutput:
        """Regenerate where ``mask`` is 1 (soft masks blend); the rest is kept (re-noised with the same noise)."""
        return self.img2img(images, strength=strength, mask=mask, **kwargs)

    def outpaint(
        self,
        images: torch.Tensor,
        *,
        left: int = 0,
        top: int = 0,
        right: int = 0,
        bottom: int = 0,
        strength: float = 1.0,
        strength_map: str = "linear",
        steps: int = 28,
        seed: int = 0,
        sampler: str = "euler",
        **conditioning: Any,
    ) -> RefineOutput:
        """Extend the canvas by the given borders (rounded up to 16 px) and paint them in.

        The border starts from an edge-replicated canvas; the original region's latents are the
        encoding of the original image alone and are kept exactly (mask 0) through every step.
        """
        check_sampler(sampler)
        images = images.to(self.device, torch.float32)
        canvas, mask, pads = outpaint_canvas(images, left, top, right, bottom)
        start = denoising_start_for(strength, strength_map)
        lmask = latent_mask(mask)
        init, bn_mean, bn_std = self._encode_init(canvas)
        original, _, _ = self._encode_init(images)
        l8, t8 = pads[0] // VAE_SCALE_FACTOR, pads[1] // VAE_SCALE_FACTOR
        init = init.clone()
        init[:, :, t8 : t8 + original.shape[2], l8 : l8 + original.shape[3]] = original
        den = self.denoiser(**conditioning) if start < 1.0 else None
        result = self._run(
            "outpaint",
            den,
            init=(init, bn_mean, bn_std),
            shape=None,
            denoising_start=start,
            steps=steps,
            seed=seed,
            sampler=sampler,
            mask=lmask,
        )
        params = self._parameters(
            "outpaint",
            result,
            left=pads[0],
            top=pads[1],
            right=pads[2],
            bottom=pads[3],
            strength=strength,
            strength_map=strength_map,
            denoising_start=round(start, 6),
            steps=steps,
            seed=seed,
            sampler=sampler,
            **(_conditioning_params(conditioning, den) if den is not None else {}),
        )
        return RefineOutput(self.decode(result.latents), result.latents, params)

    def hires(
        self,
        upscale: Callable[[torch.Tensor], torch.Tensor],
        *,
        images: torch.Tensor | None = None,
        height: int | None = None,
        width: int | None = None,
        base_steps: int = 28,
        refine_strength: float = 0.3,
        strength_map: str = "linear",
        steps: int = 28,
        seed: int = 0,
        sampler: str = "euler",
        scale: int = 2,
        **conditioning: Any,
    ) -> RefineOutput:
        """The hires fix: base latents -> ``upscale`` (Flow Upscaler) -> refine at low strength -> decode.

        The base is ``images`` encoded, or a txt2img at ``height x width`` (``base_steps``). ``upscale``
        maps normalized latents to normalized latents ``scale`` times larger. The refine pass is img2img
        on the upscaled normalized latents on the shifted schedule clipped at ``1 - refine_strength``.
        """
        check_sampler(sampler)
        start = denoising_start_for(refine_strength, strength_map)
        den = self.denoiser(**conditioning)
        params: dict[str, Any] = {}
        if images is not None:
            h, w = images.shape[-2:]
            if h % PIXEL_MULTIPLE or w % PIXEL_MULTIPLE:
                raise FlowliftError(f"hires input sides must be multiples of {PIXEL_MULTIPLE} px, got {w}x{h}")
            base = self.encode(images.to(self.device, torch.float32))
            params["base"] = "image"
        else:
            if height is None or width is None:
                raise FlowliftError("hires needs an input image or a txt2img size")
            base = self.txt2img(
                height=height, width=width, steps=base_steps, seed=seed, sampler=sampler, **conditioning
            ).latents
            params.update(base="txt2img", base_steps=base_steps, height=height, width=width)
        up = upscale(base).float().to(self.device)
        expect = (base.shape[2] * scale, base.shape[3] * scale)
        if tuple(up.shape[2:]) != expect:
            raise FlowliftError(f"the upscaler returned {tuple(up.shape[2:])} latents, expected {expect}")
        result = self._run(
            "hires refine",
            den,
            init=(up, None, None),
            shape=None,
            denoising_start=start,
            steps=steps,
            seed=seed,
            sampler=sampler,
        )
        params.update(
            self._parameters(
                "hires",
                result,
                scale=scale,
                refine_strength=refine_strength,
                strength_map=strength_map,
                denoising_start=round(start, 6),
                steps=steps,
                seed=seed,
                sampler=sampler,
                **_conditioning_params(conditioning, den),
            )
        )
        return RefineOutput(self.decode(result.latents), result.latents, params)


def _conditioning_params(conditioning: dict[str, Any], den: Any) -> dict[str, Any]:
    negative = None
    if den.cfg_scale != 1.0:
        negative = conditioning.get("negative_prompt")
        if negative is None and conditioning.get("negative_prompt_embeds") is None:
            negative = ""  # the default negative prompt under true CFG
    return {
        "prompt": conditioning.get("prompt"),
        "negative_prompt": negative,
        "cfg_scale": den.cfg_scale,
        "guidance": den.guidance,
        "reference_images": len(den.reference_latents) or None,
    }


# ------------------------------------------------------------------------------------------- loading


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return (lines[0][:200] if lines else "") or type(error).__name__


def _is_diffusers_folder(path: Path) -> bool:
    return (path / "model_index.json").is_file() or (path / "transformer" / "config.json").is_file()


#: Tensor-name fragments of a FLUX transformer checkpoint (BFL / ComfyUI layout and diffusers layout).
_TRANSFORMER_KEY_MARKERS = ("double_blocks.", "single_blocks.", "transformer_blocks.")


def _check_transformer_file(path: Path) -> None:
    """Refuse a single file that is not a FLUX transformer checkpoint before diffusers guesses a model for it."""
    if path.suffix != ".safetensors":
        raise FlowliftError(f"--model {path}: a single-file transformer must be a .safetensors file")
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            keys = list(handle.keys())
    except Exception as error:  # noqa: BLE001 - any reader failure is a bad file to the user
        raise FlowliftError(f"--model {path}: cannot read it as safetensors ({_first_line(error)})") from None
    if not any(marker in key for key in keys for marker in _TRANSFORMER_KEY_MARKERS):
        raise FlowliftError(
            f"--model {path}: not a FLUX.2 transformer checkpoint (no double/single transformer blocks among its "
            f"{len(keys)} tensors); give the transformer .safetensors, a diffusers folder or a hub id"
        )


def _hub_model_error(model: str, error: BaseException) -> FlowliftError:
    """One actionable line for a hub id that could not be loaded (offline cache miss, gated, missing)."""
    from flowlift.models.hub import download_hint

    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    if offline:
        return FlowliftError(
            f"--model {model}: its transformer/ folder is not in the Hugging Face cache and HF_HUB_OFFLINE=1; "
            f"{download_hint(model)} or pass a local folder"
        )
    return FlowliftError(
        f"--model {model}: cannot get it from the hub ({_first_line(error)}); {download_hint(model)} "
        "or pass a local folder"
    )


def load_transformer(model: str, *, dtype: torch.dtype) -> torch.nn.Module:
    """A ``Flux2Transformer2DModel`` from a diffusers folder / hub id (``transformer/`` subfolder), a
    transformer folder (``config.json``), or a single BFL/ComfyUI ``.safetensors`` file."""
    from diffusers import Flux2Transformer2DModel

    from flowlift.models.hub import looks_like_path

    path = Path(model).expanduser()
    if not path.exists() and looks_like_path(model):
        raise FlowliftError(f"--model {model}: no such file or folder")
    if path.is_file():
        _check_transformer_file(path)
    from_hub = not path.exists() and looks_like_repo_id(model)
    try:
        if path.is_file():
            return Flux2Transformer2DModel.from_single_file(str(path), torch_dtype=dtype)
        if path.is_dir() and (path / "config.json").is_file() and not _is_diffusers_folder(path):
            return Flux2Transformer2DModel.from_pretrained(str(path), torch_dtype=dtype)
        if path.is_dir() and not (path / "transformer" / "config.json").is_file():
            raise FlowliftError(
                f"--model {model}: not a FLUX.2 transformer folder (it needs transformer/config.json, the diffusers "
                "layout, or config.json, a bare transformer folder)"
            )
        if path.is_dir() or from_hub:
            return Flux2Transformer2DModel.from_pretrained(model, subfolder="transformer", torch_dtype=dtype)
    except FlowliftError:
        raise
    except Exception as error:  # noqa: BLE001 - any loader failure is a bad --model to the user
        if from_hub:
            raise _hub_model_error(model, error) from None
        raise FlowliftError(f"cannot load a FLUX.2 transformer from {model}: {_first_line(error)}") from None
    raise FlowliftError(f"--model {model}: no such file or folder, and not a hub repo id (owner/name)")


def load_refiner(
    model: str,
    *,
    vae: str | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    text_encoder: bool = False,
    progress: bool = False,
) -> Flux2Refiner:
    """A :class:`Flux2Refiner` from FLUX.2 Klein / dev weights (local diffusers folder or hub id).

    ``vae`` (any :func:`flowlift.models.vae_loading.load_vae` spec) defaults to the model's own ``vae/`` subfolder.
    ``text_encoder=True`` also loads the pipeline's text encoder (``flowlift[text]``) so prompts can be
    given as strings.
    """
    from flowlift.models.vae_loading import load_vae

    transformer = load_transformer(model, dtype=dtype)
    # the FLUX.2 VAE overflows in float16; bfloat16 and float32 are fine
    vae_adapter = load_vae(vae or model, device=device, dtype=torch.float32 if dtype == torch.float16 else dtype)
    encoder = PromptEncoder(model, device=device, dtype=dtype) if text_encoder else None
    return Flux2Refiner(
        transformer,
        vae_adapter,
        device=device,
        dtype=dtype,
        prompt_encoder=encoder,
        progress=progress,
        model_name=str(model),
    )
