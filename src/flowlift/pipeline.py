"""Image in, 2x/4x/8x image out: :class:`FlowUpscalerPipeline`.

The loop, per image::

    x      = image padded (or resampled) to a multiple of 16                      encode_image
    z_0    = VAE.encode(x)                                  normalized 32-ch latents at 1/8 size
    z_p+1  = n_p - v(n_p, 1000, z_p)        n_p ~ N(0, I) at 2x size, own seeded stream per pass
    z_p+1  = stage 1 (latent low-band transplant from z_p)                        upscale_latents
    y      = VAE.decode(z_N), cropped to 2^N x the original size
    y      = stage 2 (pixel L*a*b* low-band transplant from the input image)      upscale_image

``upscaler`` is anything called like the Flow Upscaler UNet (``model(sample, timestep, small)``), a
weights file, a folder or a hub id; ``vae`` is any object with flowlift's VAE interface
(``encode(images) -> latents``, ``decode(latents) -> images``) or a spec for
:func:`flowlift.vae.load_vae`. Both colour stages live in :mod:`flowlift.colorfix`.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from flowlift.colorfix import LOWFREQ_FACTOR, lab_lowband_transplant, latent_lowband_transplant
from flowlift.errors import FlowliftError

MAX_OUTPUT_SIDE = 16384
SIZE_MULTIPLE = 16
ONE_STEP_TIMESTEP = 1000.0
DEFAULT_UPSCALER = "TensorForger/FlowUpscaler"
UPSCALER_WEIGHTS_NAME = "flow_upscaler.safetensors"
RESIZE_MODES = ("pad", "resample")

__all__ = [
    "DEFAULT_UPSCALER",
    "LOWFREQ_FACTOR",
    "MAX_OUTPUT_SIDE",
    "FlowUpscalerPipeline",
    "allowed_passes",
    "pad_to_multiple",
    "pass_generator",
    "padded_size",
]


def padded_size(height: int, width: int, multiple: int = SIZE_MULTIPLE) -> tuple[int, int]:
    """Smallest multiple of ``multiple`` at or above each side: ``ceil(side / m) * m``."""
    return -(-height // multiple) * multiple, -(-width // multiple) * multiple


def pad_to_multiple(images: torch.Tensor, multiple: int = SIZE_MULTIPLE) -> torch.Tensor:
    """Pad (B, C, H, W) on the bottom and right to multiples of ``multiple``.

    Reflection padding (the image mirrored at its edge, no repeated edge row) where the image is
    larger than the pad, edge replication otherwise. The original pixels keep their positions, so
    cropping ``[:H, :W]`` (times the scale) gives back exactly the original area.
    """
    height, width = images.shape[-2:]
    target_h, target_w = padded_size(height, width, multiple)
    pad_h, pad_w = target_h - height, target_w - width
    if pad_h == 0 and pad_w == 0:
        return images
    mode = "reflect" if pad_h < height and pad_w < width else "replicate"
    return F.pad(images, (0, pad_w, 0, pad_h), mode=mode)


def allowed_passes(height: int, width: int, num_passes: int, max_side: int = MAX_OUTPUT_SIDE) -> int:
    """The largest ``n <= num_passes`` with ``max(height, width) * 2**n <= max_side`` (0 if none)."""
    passes = 0
    side = max(height, width)
    while passes < num_passes and side * 2 ** (passes + 1) <= max_side:
        passes += 1
    return passes


def pass_generator(seed: int, pass_index: int) -> torch.Generator:
    """CPU generator of pass ``pass_index``'s noise: seeded from ``SeedSequence([seed, pass_index])``.

    Every (seed, pass) pair gets its own well-separated stream (unlike ``seed + pass``, which makes
    seed 0's second pass equal seed 1's first); the same pair always gives the same noise.
    """
    if seed < 0 or pass_index < 0:
        raise FlowliftError(f"seed must be a non-negative integer, got {seed}")
    state = np.random.SeedSequence([int(seed), int(pass_index)]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator(device="cpu").manual_seed(int(state) & ((1 << 63) - 1))


def _module_param(obj: Any) -> torch.Tensor | None:
    parameters = getattr(obj, "parameters", None)
    if callable(parameters):
        for param in parameters():
            return param
    return None


def _image_alpha(image: Any) -> Any:
    """The alpha channel of a Pillow image (palette transparency included), else None."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        return None
    if image.mode in ("RGBA", "LA", "PA", "La", "RGBa") or (image.mode == "P" and "transparency" in image.info):
        return image.convert("RGBA").getchannel("A")
    return None


class FlowUpscalerPipeline:
    """Flow Upscaler image pipeline (see the module docstring for the loop).

    Parameters
    ----------
    upscaler:
        A model called as ``model(sample, timestep, latents_small) -> velocity``, or a source for
        :func:`flowlift.models.upscaler_unet.load_upscaler` (file, folder, hub id; default
        ``flow_upscaler.safetensors`` in ``TensorForger/FlowUpscaler``).
    vae:
        A VAE object with flowlift's interface (``encode``/``decode``), a bare TAEF2 or diffusers
        ``AutoencoderKLFlux2`` module (wrapped), or a spec for :func:`flowlift.vae.load_vae`.
    dtype, device:
        Where and in what precision the UNet and a loaded VAE run. Defaults: a given module's own
        device/dtype; otherwise CUDA in bfloat16 if available, else CPU float32.
    chunked:
        Run the UNet through :class:`flowlift.executor.ChunkedExecutor` (exact, bounded memory):
        ``None`` switches it on by size (:func:`flowlift.executor.should_chunk`), True/False force it.
    vae_tiled:
        Passed to the VAE's ``encode``/``decode`` as ``tiled`` (``None``: the VAE decides by size).
    """

    MAX_OUTPUT_SIDE = MAX_OUTPUT_SIDE
    LOWFREQ_FACTOR = LOWFREQ_FACTOR

    def __init__(
        self,
        upscaler: Any = DEFAULT_UPSCALER,
        vae: Any = "flux2",
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        chunked: bool | None = None,
        vae_tiled: bool | None = None,
        chunk_rows: int | None = None,
        offload_device: torch.device | str | None = None,
    ) -> None:
        param = _module_param(upscaler) if not isinstance(upscaler, (str, os.PathLike)) else None
        if device is None:
            device = param.device if param is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(device)
        if dtype is None:
            if param is not None and param.is_floating_point():
                dtype = param.dtype
            else:
                dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.dtype = dtype
        self.chunked = chunked
        self.vae_tiled = vae_tiled
        self.chunk_rows = chunk_rows
        self.offload_device = offload_device
        self.upscaler_path: Path | None = None
        if isinstance(upscaler, (str, os.PathLike)):
            self.upscaler_path = resolve_upscaler_file(upscaler)
            from flowlift.models.upscaler_unet import load_upscaler
            from flowlift.vae import check_vae_spec

            check_vae_spec(vae)  # a missing VAE fails before the UNet loads

            upscaler = load_upscaler(self.upscaler_path, device=self.device, dtype=self.dtype)
        elif param is not None:
            upscaler = upscaler.to(device=self.device, dtype=self.dtype)
        if not callable(upscaler):
            raise FlowliftError(f"upscaler must be callable like the Flow Upscaler UNet, got {type(upscaler).__name__}")
        self.upscaler = upscaler
        self.vae_spec: str | None = None
        if isinstance(vae, (str, os.PathLike)):
            self.vae_spec = os.fspath(vae)
            from flowlift.vae import load_vae

            vae = load_vae(self.vae_spec, device=self.device, dtype=self.dtype)
        elif isinstance(vae, torch.nn.Module):
            # A bare TAEF2 or diffusers AutoencoderKLFlux2 (as in the model card's example): wrap it
            # in the package's VAE interface, keeping its own dtype.
            from flowlift.vae import load_vae

            vae_param = _module_param(vae)
            vae_dtype = vae_param.dtype if vae_param is not None else self.dtype
            vae = load_vae(vae, device=self.device, dtype=vae_dtype)
        if not (callable(getattr(vae, "encode", None)) and callable(getattr(vae, "decode", None))):
            raise FlowliftError(f"vae must have encode() and decode(), got {type(vae).__name__}")
        self.vae = vae

    # -- helpers ------------------------------------------------------------------------------------

    @property
    def spatial_factor(self) -> int:
        """Image pixels per latent pixel (8 for FLUX.2 VAEs)."""
        return int(getattr(self.vae, "spatial_factor", 8))

    def _vae_dtype(self) -> torch.dtype:
        param = _module_param(self.vae)
        if param is not None and param.is_floating_point():
            return param.dtype
        dtype = getattr(self.vae, "dtype", None)
        return dtype if isinstance(dtype, torch.dtype) else self.dtype

    def _vae_call(self, method: str, x: torch.Tensor) -> torch.Tensor:
        fn = getattr(self.vae, method)
        if self.vae_tiled is None:
            return fn(x)
        return fn(x, tiled=self.vae_tiled)

    def _velocity_model(self, sample_shape: tuple[int, ...]) -> Callable:
        """The UNet, or a ChunkedExecutor around it when chunking is on for this size."""
        if self.chunked is False:
            return self.upscaler
        try:
            from flowlift.executor import ChunkedExecutor, should_chunk
            from flowlift.models.upscaler_unet import FlowUpscalerUNet
        except ImportError:  # the executor is optional for custom models
            return self.upscaler
        if not isinstance(self.upscaler, FlowUpscalerUNet):
            if self.chunked:
                raise FlowliftError("chunked execution needs a FlowUpscalerUNet, not a custom model")
            return self.upscaler
        batch, _, height, width = sample_shape
        base = int(self.upscaler.config.get("base_channels", 384))
        if not should_chunk(
            height, width, self.device, batch=batch, base_channels=base, dtype=self.dtype, force=self.chunked
        ):
            return self.upscaler
        kwargs: dict[str, Any] = {"offload_device": self.offload_device}
        if self.chunk_rows is not None:
            kwargs["chunk"] = self.chunk_rows
        return ChunkedExecutor(self.upscaler, **kwargs)

    def plan_passes(self, image_height: int, image_width: int, num_passes: int) -> int:
        """Passes that fit under ``MAX_OUTPUT_SIDE`` for an image of this size; warns when dropping."""
        if num_passes < 0:
            raise FlowliftError(f"num_passes must be >= 0, got {num_passes}")
        passes = allowed_passes(image_height, image_width, num_passes, self.MAX_OUTPUT_SIDE)
        if passes < num_passes:
            message = (
                f"Flow Upscaler: {num_passes} pass(es) on a {image_width}x{image_height} image would exceed "
                f"MAX_OUTPUT_SIDE={self.MAX_OUTPUT_SIDE} px; running {passes} pass(es) "
                f"({num_passes - passes} dropped, output {image_width * 2**passes}x{image_height * 2**passes})"
            )
            warnings.warn(message, UserWarning, stacklevel=3)
        return passes

    # -- the three steps ----------------------------------------------------------------------------

    def prepare_image(self, image: Any, resize_mode: str = "pad") -> tuple[torch.Tensor, torch.Tensor]:
        """(original (B,3,H,W) float32 on the device, the model input at multiples of 16).

        ``resize_mode="pad"`` (default) pads bottom/right by reflection (:func:`pad_to_multiple`) and
        nothing is resampled; ``"resample"`` resizes the whole image (bicubic, antialiased) to the
        nearest multiples of 16.
        """
        from flowlift.images import to_tensor

        if resize_mode not in RESIZE_MODES:
            raise FlowliftError(f"resize_mode must be one of {', '.join(RESIZE_MODES)}, got {resize_mode!r}")
        original = to_tensor(image, device=self.device, dtype=torch.float32)
        height, width = original.shape[-2:]
        if resize_mode == "pad":
            return original, pad_to_multiple(original)
        size = (
            max(SIZE_MULTIPLE, round(height / SIZE_MULTIPLE) * SIZE_MULTIPLE),
            max(SIZE_MULTIPLE, round(width / SIZE_MULTIPLE) * SIZE_MULTIPLE),
        )
        if size == (height, width):
            return original, original
        resized = F.interpolate(original, size=size, mode="bicubic", align_corners=False, antialias=True)
        return original, resized.clamp(0.0, 1.0)

    @torch.inference_mode()
    def encode_image(self, image: Any, resize_mode: str = "pad", return_size: bool = False) -> Any:
        """PIL / ndarray / tensor image -> normalized latents (B, 32, H16/8, W16/8), float32.

        The image is brought to multiples of 16 by :meth:`prepare_image` (``"pad"``: reflection pad
        bottom/right, crop the output back; ``"resample"``: resize). With ``return_size=True`` returns
        ``(latents, (height, width))`` of the original image, so that ``2**n`` times that size can be
        cropped from a padded result.
        """
        original, prepared = self.prepare_image(image, resize_mode)
        latents = self._vae_call("encode", prepared.to(self._vae_dtype())).to(torch.float32)
        if return_size:
            return latents, tuple(original.shape[-2:])
        return latents

    @torch.inference_mode()
    def upscale_latents(
        self,
        latents: torch.Tensor,
        num_passes: int = 1,
        seed: int = 0,
        transplant_strength: float = 1.0,
        color_fix: bool = True,
        callback: Callable[[str], None] | None = None,
    ) -> torch.Tensor:
        """Chain ``num_passes`` 2x passes on normalized latents; returns float32 latents.

        Pass ``p``: ``noise ~ N(0, I)`` at twice the size from :func:`pass_generator` (seed, p) drawn on
        the CPU in float32, ``x0 = noise - v(noise, 1000, cond)``; with ``color_fix`` stage 1
        (:func:`flowlift.colorfix.latent_lowband_transplant` at ``transplant_strength``) pins x0's low
        band to ``cond``'s; x0 is the next pass's ``cond``. Passes beyond ``MAX_OUTPUT_SIDE`` are
        dropped with a warning.
        """
        if not 0.0 <= transplant_strength <= 1.0:
            raise FlowliftError(f"transplant_strength must be in [0, 1], got {transplant_strength}")
        factor = self.spatial_factor
        passes = self.plan_passes(latents.shape[-2] * factor, latents.shape[-1] * factor, num_passes)
        cond = latents.to(device=self.device, dtype=torch.float32)
        for index in range(passes):
            batch, channels, height, width = cond.shape
            shape = (batch, channels, 2 * height, 2 * width)
            noise = torch.randn(shape, generator=pass_generator(seed, index), dtype=torch.float32)
            noise = noise.to(device=self.device, dtype=self.dtype)
            timestep = torch.full((batch,), ONE_STEP_TIMESTEP, dtype=torch.float32, device=self.device)
            model = self._velocity_model(shape)
            velocity = model(noise, timestep, cond.to(self.dtype))
            x0 = noise.to(torch.float32) - velocity.to(torch.float32)
            if color_fix and transplant_strength > 0:
                x0 = latent_lowband_transplant(x0, cond, transplant_strength, self.LOWFREQ_FACTOR)
            cond = x0
            if callback is not None:
                callback(f"pass {index + 1}/{passes}")
        return cond

    @torch.inference_mode()
    def upscale_image(
        self,
        image: Any,
        num_passes: int = 1,
        seed: int = 0,
        color_fix: bool = True,
        transplant_strength: float = 1.0,
        color_fix_strength: float = 1.0,
        *,
        resize_mode: str = "pad",
        output_type: str = "pil",
        callback: Callable[[str], None] | None = None,
    ) -> Any:
        """Encode -> passes -> decode -> stage 2 -> image ``2**passes`` times the input's size.

        ``output_type="pil"`` returns a Pillow image (a list for a batch; RGBA when a Pillow input had
        alpha: the colour is upscaled, the alpha Lanczos-resized), ``"pt"`` a float (B, 3, H, W)
        tensor in [0, 1]. With ``resize_mode="pad"`` the output is exactly ``2**passes`` times the
        original size; with ``"resample"`` it is that factor times the size resampled to multiples of
        16. ``color_fix=False`` switches both stages off; ``color_fix_strength`` scales stage 2.
        """
        if output_type not in ("pil", "pt"):
            raise FlowliftError(f"output_type must be 'pil' or 'pt', got {output_type!r}")
        if not 0.0 <= color_fix_strength <= 1.0:
            raise FlowliftError(f"color_fix_strength must be in [0, 1], got {color_fix_strength}")
        original, prepared = self.prepare_image(image, resize_mode)
        passes = self.plan_passes(prepared.shape[-2], prepared.shape[-1], num_passes)
        latents = self._vae_call("encode", prepared.to(self._vae_dtype())).to(torch.float32)
        if callback is not None:
            callback("encode")
        latents = self.upscale_latents(
            latents,
            passes,
            seed=seed,
            transplant_strength=transplant_strength,
            color_fix=color_fix,
            callback=callback,
        )
        decoded = self._vae_call("decode", latents.to(self._vae_dtype())).to(torch.float32)
        del latents
        if callback is not None:
            callback("decode")
        scale = 2**passes
        reference = original if resize_mode == "pad" else prepared
        height, width = reference.shape[-2] * scale, reference.shape[-1] * scale
        if decoded.shape[-2] < height or decoded.shape[-1] < width:
            raise FlowliftError(
                f"VAE decoded {decoded.shape[-1]}x{decoded.shape[-2]}, expected at least {width}x{height}"
            )
        decoded = decoded[..., :height, :width]
        if color_fix and color_fix_strength > 0:
            result = lab_lowband_transplant(decoded, reference, color_fix_strength, inplace=True)
        else:
            result = decoded.clamp(0.0, 1.0)
        if callback is not None:
            callback("color fix")
        if output_type == "pt":
            return result
        from flowlift.images import attach_alpha, tensor_to_pil

        alpha = _image_alpha(image)
        pictures = [attach_alpha(tensor_to_pil(result[i : i + 1]), alpha) for i in range(result.shape[0])]
        return pictures[0] if len(pictures) == 1 else pictures

    # -- provenance ---------------------------------------------------------------------------------

    def model_files(self) -> dict[str, list[Path]]:
        """Weight files behind this pipeline, for provenance: ``{"upscaler": [...], "vae": [...]}``.

        The VAE's files come from its ``weight_files`` attribute when it has one, else from a local
        spec (file or folder), else from the Hugging Face cache for ``taef2`` / ``flux2`` / repo ids.
        """
        files: dict[str, list[Path]] = {"upscaler": [], "vae": []}
        if self.upscaler_path is not None:
            files["upscaler"].append(self.upscaler_path)
        vae_files = getattr(self.vae, "weight_files", None)
        if vae_files:
            files["vae"].extend(Path(p) for p in vae_files)
        elif self.vae_spec is not None:
            files["vae"].extend(_vae_spec_files(self.vae_spec))
        return files


_WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")


def _vae_spec_files(spec: str) -> list[Path]:
    """Weight files a VAE spec names: a file, a folder's weight files, or hub-cache files."""
    path = Path(spec).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.suffix in _WEIGHT_SUFFIXES and p.is_file())
    from flowlift import vae as vae_module

    if spec == "taef2":
        repos = [vae_module.TAEF2_REPO]
    elif spec == "flux2":
        repos = list(vae_module.FLUX2_REPOS)
    else:
        repos = [spec]
    names = [*vae_module.TAEF2_FILES, "diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors"]
    from huggingface_hub import try_to_load_from_cache

    for repo in repos:
        found = []
        for name in names:
            try:
                cached = try_to_load_from_cache(repo, name)
            except Exception:  # noqa: BLE001 - provenance is best effort; an odd id just has no files
                cached = None
            if isinstance(cached, str):
                found.append(Path(cached))
        if found:
            return found
    return []


def resolve_upscaler_file(source: str | os.PathLike) -> Path:
    """Resolve the UNet weights (file, folder, hub id) or raise one line saying how to provide them."""
    from flowlift.weights import resolve_file

    try:
        return resolve_file(source, [UPSCALER_WEIGHTS_NAME], what="Flow Upscaler weights")
    except FlowliftError as error:
        if UPSCALER_WEIGHTS_NAME in str(error):
            raise FlowliftError(f"{error} (CLI: --upscaler PATH)") from None
        raise FlowliftError(
            f"{error} (the Flow Upscaler is {UPSCALER_WEIGHTS_NAME} of the hub repo {DEFAULT_UPSCALER}, "
            "or a local file/folder: CLI --upscaler PATH)"
        ) from None


def output_scale(num_passes: int) -> int:
    """Scale factor of ``num_passes`` 2x passes."""
    return 2**num_passes


def passes_for_scale(scale: int) -> int:
    """Passes for a power-of-two scale (2 -> 1, 4 -> 2, 8 -> 3); anything else raises."""
    passes = int(round(math.log2(scale))) if scale > 0 else -1
    if passes < 1 or 2**passes != scale:
        raise FlowliftError(f"scale must be a power of two >= 2 (2, 4, 8), got {scale}")
    return passes
