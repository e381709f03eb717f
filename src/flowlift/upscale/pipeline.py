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
:func:`flowlift.models.vae_loading.load_vae`. Both colour stages live in :mod:`flowlift.upscale.colorfix`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from flowlift.devices import auto_dtype, default_channels_last, resolve_device_option
from flowlift.errors import FlowliftError
from flowlift.flux2.latents import check_latents
from flowlift.knobs import COLOR_FIX, check_callable, check_count, check_dtype, check_kind, check_positive, check_seed
from flowlift.limits import MAX_OUTPUT_SIDE, parse_memory
from flowlift.models.sesqui_bands import sesqui_to_size
from flowlift.models.sesqui_lsr import load_sesqui_lsr, require_bn_statistics
from flowlift.models.upscaler_unet import ONE_STEP_TIMESTEP
from flowlift.upscale.colorfix import LOWFREQ_FACTOR, latent_lowband_transplant
from flowlift.upscale.image_steps import as_output, finish_decoded, to_host_float32, vae_call, vae_input_dtype
from flowlift.upscale.inputs import check_finite, image_alpha
from flowlift.upscale.interrupts import checked_modules, with_check
from flowlift.upscale.latent_fraction import find_sesqui, fraction_plan
from flowlift.upscale.loading import (
    DEFAULT_UPSCALER,
    DEFAULT_VAE,
    first_parameter,
    load_pipeline_models,
    pipeline_model_files,
)
from flowlift.upscale.memory_plan import StageChoices, UpscaleMemoryPlan, check_weights_fit, latent_upscaler_rows
from flowlift.upscale.pass_plan import UNetPassPlan
from flowlift.upscale.pipeline_plans import encode_tiling, pipeline_plan, pipeline_weight_bytes
from flowlift.upscale.settings import (
    COLOR_FIX_STRENGTH,
    RESIZE_MODE,
    TRANSPLANT_STRENGTH,
    ImageStages,
    MemoryPolicy,
    check_compile,
)
from flowlift.upscale.sizes import (
    capped_passes,
    image_seeds,
    pad_to_multiple,
    pass_noise,
    passes_for_output_size,
    resample_to_multiple,
)
from flowlift.upscale.unet_runner import CompiledUNet, velocity_model


class FlowUpscalerPipeline:
    """Flow Upscaler image pipeline (see the module docstring for the loop).

    Parameters
    ----------
    upscaler:
        A model called as ``model(sample, timestep, latents_small) -> velocity``, or a source for
        :func:`flowlift.models.upscaler_weights.load_upscaler` (file, folder, hub id; default
        ``flow_upscaler.safetensors`` in ``TensorForger/FlowUpscaler``).
    vae:
        A VAE object with flowlift's interface (``encode``/``decode``), a bare TAEF2 or diffusers
        ``AutoencoderKLFlux2`` module (wrapped), or a spec for :func:`flowlift.models.vae_loading.load_vae`.
    dtype, device:
        Where and in what precision the UNet and a loaded VAE run. Defaults: a given module's own
        device/dtype; otherwise CUDA if available, else the CPU, in :func:`flowlift.devices.auto_dtype`'s
        dtype (bfloat16 on CUDA and on a CPU with native bfloat16, else float32).
    memory:
        A :class:`flowlift.upscale.settings.MemoryPolicy`: chunked UNet execution, VAE tiling, strip rows, the
        offload device, a ``max_memory`` budget for the whole upscale and the chunking budget, with one
        precedence (its docstring). ``None``: every decision by size.
    compile:
        ``True`` (or a ``torch.compile`` mode string) runs the whole-frame UNet through
        :class:`flowlift.upscale.unet_runner.CompiledUNet`: one compiled graph per input shape, CUDA-graph
        replay on CUDA, eager fallback with one warning when compilation fails.
    channels_last:
        Channels-last weights and inputs for the UNet (``None``: on CUDA and in bfloat16 on the CPU,
        :func:`flowlift.devices.default_channels_last`).
    latent_upscaler:
        ``"sesqui:PATH"``: SesquiLSR's FLUX.2 weights for the fraction of an ``output_size`` in latent space, after
        the passes and before the decode, instead of the pixel resample (:mod:`flowlift.upscale.latent_fraction`;
        the FLUX.2 VAE only: TAEF2/Mage-VAE are one line). None: the pixel resample.
    on_strip:
        ``on_strip(done, total)``, called after every strip of a chunked pass (progress; an exception
        it raises, e.g. a user's cancel, stops the pass). See
        :class:`flowlift.upscale.chunked.executor.ChunkedExecutor`.

    ``vae=None`` makes a latent-only pipeline: :meth:`upscale_latents` works, the image methods raise.
    """

    MAX_OUTPUT_SIDE = MAX_OUTPUT_SIDE
    LOWFREQ_FACTOR = LOWFREQ_FACTOR

    def __init__(
        self,
        upscaler: Any = DEFAULT_UPSCALER,
        vae: Any = DEFAULT_VAE,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        memory: MemoryPolicy | None = None,
        compile: bool | str = False,
        channels_last: bool | None = None,
        on_strip: Callable[[int, int], None] | None = None,
        check_interrupt: Callable[[], None] | None = None,
        latent_upscaler: str | None = None,
    ) -> None:
        memory = check_kind("memory", memory, MemoryPolicy, "a MemoryPolicy", optional=True) or MemoryPolicy()
        param = first_parameter(upscaler) if not isinstance(upscaler, (str, os.PathLike)) else None
        if device is None:
            device = param.device if param is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = resolve_device_option(device)  # one line for a device that does not exist here ('bogus', 'meta')
        floating = param is not None and param.is_floating_point()  # None: the UNet's, else by device
        default_dtype = param.dtype if floating else auto_dtype(self.device, cpu_bf16=True)
        self.dtype = default_dtype if dtype is None else check_dtype(dtype)
        self.memory = memory
        self.chunked = memory.chunked
        self.vae_tiled = memory.vae_tiled
        self.chunk_rows = memory.chunk_rows
        self.offload_device = memory.offload_device
        self.chunk_budget_bytes = memory.chunk_budget_bytes
        self.on_strip = check_callable("on_strip", on_strip)
        self.check_interrupt = check_callable("check_interrupt", check_interrupt)
        if check_kind("channels_last", channels_last, bool, "True, False", optional=True) is None:
            channels_last = default_channels_last(self.device, self.dtype)
        self.max_memory = None if memory.max_memory is None else parse_memory(memory.max_memory)
        # a malformed spec or a missing SesquiLSR file: one line before anything loads
        sesqui_file = None if latent_upscaler is None else find_sesqui(latent_upscaler)
        # both found (or both named as missing) before either loads
        self.upscaler, self.upscaler_path, self.vae, self.vae_spec = load_pipeline_models(
            upscaler, vae, self.device, self.dtype
        )
        self.latent_upscaler = latent_upscaler
        self.sesqui = None
        self.sesqui_file = sesqui_file  # its hash goes into an output's metadata where SesquiLSR ran
        if sesqui_file is not None:  # SesquiLSR for the fraction, in float32, on the pipeline's device
            require_bn_statistics(self.vae)  # TAEF2/Mage-VAE: one line, before its weights load
            self.sesqui = load_sesqui_lsr(sesqui_file, device=self.device, dtype=torch.float32)
        if self.max_memory is not None:  # one line for the whole run, not one per input of a batch
            check_weights_fit(self.max_memory, pipeline_weight_bytes(self))
        self.channels_last = bool(channels_last)
        if self.channels_last and isinstance(self.upscaler, torch.nn.Module):
            self.upscaler.to(memory_format=torch.channels_last)
        self.compiled_upscaler: CompiledUNet | None = None
        if check_compile(compile):
            if not isinstance(self.upscaler, torch.nn.Module):
                raise FlowliftError(f"compile needs the UNet as a torch module, got {type(self.upscaler).__name__}")
            mode = compile if isinstance(compile, str) else None
            self.compiled_upscaler = CompiledUNet(self.upscaler, mode=mode, channels_last=self.channels_last)
        self.last_plan: UpscaleMemoryPlan | None = None

    # -- helpers ------------------------------------------------------------------------------------

    @property
    def spatial_factor(self) -> int:
        """Image pixels per latent pixel (8 for FLUX.2 VAEs)."""
        return int(getattr(self.vae, "spatial_factor", 8))

    def _vae_call(
        self,
        method: str,
        x: torch.Tensor,
        tiled: bool | None = None,
        on_tile: Callable[[int, int], None] | None = None,
    ) -> torch.Tensor:
        """:func:`flowlift.upscale.image_steps.vae_call`, tiled as the memory policy says unless ``tiled`` is given."""
        tiled = self.vae_tiled if tiled is None else tiled
        return vae_call(self.vae, method, x, tiled=tiled, on_tile=on_tile, check_interrupt=self.check_interrupt)

    def _encode(self, prepared: torch.Tensor, tiled: bool | None) -> torch.Tensor:
        """The VAE's float32 latents of the model input, tiled as ``tiled`` says (None: as the VAE decides)."""
        return self._vae_call("encode", prepared.to(vae_input_dtype(self.vae, self.dtype)), tiled).to(torch.float32)

    def _velocity_model(self, sample_shape: tuple[int, ...], pass_plan: UNetPassPlan | None = None) -> Callable:
        """The UNet (compiled when asked), or a ChunkedExecutor around it, for this pass."""
        return velocity_model(
            self.upscaler,
            sample_shape,
            device=self.device,
            dtype=self.dtype,
            chunked=self.chunked,
            chunk_rows=self.chunk_rows,
            offload_device=self.offload_device,
            pass_plan=pass_plan,
            plain=self.compiled_upscaler,
            budget_bytes=self.chunk_budget_bytes,
            on_strip=with_check(self.check_interrupt, self.on_strip),
        )

    def plan_memory(
        self,
        height: int,
        width: int,
        num_passes: int,
        batch: int = 1,
        final_size: tuple[int, int] | None = None,
        latent_fraction: tuple[int, int] | None = None,
        latents_only: bool = False,
    ) -> UpscaleMemoryPlan | None:
        """The :func:`flowlift.upscale.memory_plan.plan_upscale_memory` plan for a (batch, 3, height, width) model input
        (resampled to ``final_size`` (width, height) before stage 2, its float32 frame counted there; SesquiLSR to the
        ``latent_fraction`` (height, width) latent after the passes; ``latents_only``: no encode, decode or stage 2)
        under ``max_memory`` (None without a budget), the memory policy's explicit ``chunked``/``vae_tiled`` held and
        checked; a budget too small is a FlowliftError."""
        latents_only = check_kind("latents_only", latents_only, bool, "True or False")
        if self.max_memory is None:
            return None
        return pipeline_plan(
            self, (height, width, num_passes, batch), StageChoices(latent_fraction, final_size), latents_only
        )

    def plan_passes(self, image_height: int, image_width: int, num_passes: int, resize_mode: str = "pad") -> int:
        """Passes that run for an input of this unpadded size under ``MAX_OUTPUT_SIDE`` (:func:`capped_passes`: a
        warning when the cap drops some, one FlowliftError line when none fits although some were asked for)."""
        num_passes = check_count("num_passes", num_passes)
        sides = {"image_height": image_height, "image_width": image_width}  # "32" was a TypeError, 32.5 taken
        image_height, image_width = (check_positive(name, side, integer=True) for name, side in sides.items())
        return capped_passes(image_height, image_width, num_passes, resize_mode, self.MAX_OUTPUT_SIDE, stacklevel=4)

    # -- the three steps ----------------------------------------------------------------------------

    def prepare_image(self, image: Any, resize_mode: str = "pad") -> tuple[torch.Tensor, torch.Tensor]:
        """(original (B,3,H,W) float32 on the device, the model input at multiples of 16).

        ``resize_mode="pad"`` (default) pads bottom/right by reflection (:func:`pad_to_multiple`) and
        nothing is resampled; ``"resample"`` resizes the whole image (bicubic, antialiased) to the
        nearest multiples of 16.
        """
        from flowlift.files.images import to_tensor

        RESIZE_MODE.check(resize_mode)
        original = to_tensor(image, device=self.device, dtype=torch.float32)
        if resize_mode == "pad":
            return original, pad_to_multiple(original)
        return original, resample_to_multiple(original)

    @torch.inference_mode()
    def encode_image(self, image: Any, resize_mode: str = "pad", return_size: bool = False) -> Any:
        """PIL / ndarray / tensor image -> normalized latents (B, 32, H16/8, W16/8), float32.

        The image is brought to multiples of 16 by :meth:`prepare_image` (``"pad"``: reflection pad
        bottom/right, crop the output back; ``"resample"``: resize). With ``return_size=True`` returns
        ``(latents, (height, width))`` of the original image, so that ``2**n`` times that size can be
        cropped from a padded result.
        """
        return_size = check_kind("return_size", return_size, bool, "True or False")
        original, prepared = self.prepare_image(image, resize_mode)
        latents = self._encode(prepared, encode_tiling(self, tuple(prepared.shape)))
        if return_size:
            return latents, tuple(original.shape[-2:])
        return latents

    @torch.inference_mode()
    def upscale_latents(
        self,
        latents: torch.Tensor,
        num_passes: int = 1,
        seed: int | Sequence[int] = 0,
        transplant_strength: float = 1.0,
        color_fix: bool = True,
        callback: Callable[[str], None] | None = None,
    ) -> torch.Tensor:
        """Chain ``num_passes`` 2x passes on normalized latents; returns float32 latents.

        Pass ``p``: ``noise ~ N(0, I)`` at twice the size, drawn per image from :func:`pass_generator`
        (seed, p) on the CPU in float32 (``seed``: one for every image, or one per image), so an image
        gets the same noise in a batch as alone; ``x0 = noise - v(noise, 1000, cond)``; with ``color_fix`` stage 1
        (:func:`flowlift.upscale.colorfix.latent_lowband_transplant` at ``transplant_strength``) pins x0's low
        band to ``cond``'s; x0 is the next pass's ``cond``. Passes beyond ``MAX_OUTPUT_SIDE`` are
        dropped with a warning.
        """
        check_latents(latents, "Flow Upscaler")
        transplant_strength, color_fix = TRANSPLANT_STRENGTH.check(transplant_strength), COLOR_FIX.check(color_fix)
        seed, callback = check_seed(seed), check_callable("callback", callback)
        height, width = (side * self.spatial_factor for side in latents.shape[-2:])
        passes = self.plan_passes(height, width, num_passes)
        seeds = image_seeds(seed, latents.shape[0])
        plan = self.plan_memory(height, width, passes, latents.shape[0], latents_only=True)  # its own decode: none
        cond = latents.to(device=self.device, dtype=torch.float32)
        with self._cancel_points():
            return self._passes(cond, passes, seeds, plan, transplant_strength, color_fix, callback)

    def _cancel_points(self):
        """``check_interrupt`` before every leaf module of the upscaler, the VAE and SesquiLSR (interrupts.py)."""
        return checked_modules(self.check_interrupt, [self.upscaler, getattr(self.vae, "model", None), self.sesqui])

    def _passes(self, cond, passes, seeds, plan, transplant_strength, color_fix, callback) -> torch.Tensor:
        memory_format = torch.channels_last if self.channels_last else torch.contiguous_format
        for index in range(passes):
            batch, channels, height, width = cond.shape
            shape = (batch, channels, 2 * height, 2 * width)
            noise = pass_noise(seeds, index, shape[1:])
            noise = noise.to(device=self.device, dtype=self.dtype, memory_format=memory_format)
            timestep = torch.full((batch,), ONE_STEP_TIMESTEP, dtype=torch.float32, device=self.device)
            model = self._velocity_model(shape, None if plan is None else plan.passes[index])
            velocity = model(noise, timestep, cond.to(self.dtype, memory_format=memory_format))
            x0 = noise.to(torch.float32) - velocity.to(torch.float32)
            if color_fix and transplant_strength > 0:
                x0 = latent_lowband_transplant(x0, cond, transplant_strength, self.LOWFREQ_FACTOR)
            check_finite(x0, f"pass {index + 1} produced")  # one reduction per pass, never per strip
            cond = x0
            if callback is not None:
                callback(f"pass {index + 1}/{passes}")
        return cond

    @torch.inference_mode()
    def upscale_image(
        self,
        image: Any,
        num_passes: int | None = None,
        seed: int | Sequence[int] = 0,
        color_fix: bool = True,
        transplant_strength: float = 1.0,
        color_fix_strength: float = 1.0,
        *,
        resize_mode: str = "pad",
        output_type: str = "pil",
        callback: Callable[[str], None] | None = None,
        on_decode_tile: Callable[[int, int], None] | None = None,
        output_size: tuple[int, int] | None = None,
    ) -> Any:
        """Encode -> passes -> decode -> stage 2 -> image ``2**passes`` times the input's size (``num_passes``; None:
        1, or the passes ``output_size`` takes, :func:`flowlift.upscale.sizes.passes_for_output_size`).

        ``output_type="pil"`` returns a Pillow image (a list for a batch; RGBA when a Pillow or (H, W, 4) array
        input had alpha: the colour is upscaled, the alpha Lanczos-resized), ``"pt"`` a float (B, 3, H, W) tensor
        in [0, 1]. ``resize_mode="pad"``: exactly ``2**passes`` times the original size; ``"resample"``: that factor
        times the size resampled to multiples of 16. ``color_fix=False`` switches both stages off.
        ``callback(stage)`` is called after each stage (``"encode"``, ``"pass i/n"``, ``"decode"``,
        ``"color fix"``) and ``on_decode_tile(done, total)`` after each tile of the VAE decode (one for
        an untiled decode); both only report progress (an exception they raise stops the run).
        ``output_size`` (width, height) at or above the input's: the decoded frame is resampled to exactly that
        size (:func:`flowlift.upscale.sizes.resample_to_size`) and stage 2 pins it to the input (``scale=3``:
        ``num_passes=2``, then down to 3x); None is the passes' own size. A pipeline made with ``latent_upscaler``
        resizes the latents to it with SesquiLSR instead (``scale=3``: ``num_passes=1``, then 1.5x in latent space;
        :func:`flowlift.upscale.latent_fraction.fraction_passes`).
        """
        if output_type not in ("pil", "pt"):
            raise FlowliftError(f"output_type must be 'pil' or 'pt', got {output_type!r}")
        color_fix_strength = COLOR_FIX_STRENGTH.check(color_fix_strength)
        TRANSPLANT_STRENGTH.check(transplant_strength)  # before the encoder runs
        seed, callback = check_seed(seed), check_callable("callback", callback)
        on_decode_tile = check_callable("on_decode_tile", on_decode_tile)
        alpha = image_alpha(image) if output_type == "pil" else None  # before the work: a batch of RGBA refused
        stages = ImageStages(
            num_passes, seed, color_fix, transplant_strength, color_fix_strength, resize_mode, output_size
        )
        original, prepared = self.prepare_image(image, resize_mode)
        size, sesqui = (original.shape[-1], original.shape[-2]), self.sesqui is not None
        passes = passes_for_output_size(size, stages.output_size, num_passes, fraction_last=sesqui)
        stages = dataclasses.replace(stages, num_passes=passes)
        with self._cancel_points():
            result = self._image_stages(original, prepared, stages, callback, on_decode_tile)
        return as_output(result, alpha, output_type)

    def _image_stages(
        self,
        original: torch.Tensor,
        prepared: torch.Tensor,
        stages: ImageStages,
        callback: Callable[[str], None] | None,
        on_decode_tile: Callable[[int, int], None] | None,
    ) -> torch.Tensor:
        """upscale_image's stages: encode, passes, decode, stage 2; float32 (B, 3, H, W) in [0, 1]."""
        passes = self.plan_passes(original.shape[-2], original.shape[-1], stages.num_passes, stages.resize_mode)
        fraction = None  # with a latent upscaler: SesquiLSR's latent size and the decoded content (h, w)
        if self.sesqui is not None and stages.output_size is not None:
            reference = original if stages.resize_mode == "pad" else prepared
            fraction = fraction_plan(prepared.shape[-2:], reference.shape[-2:], passes, stages.output_size)
        target = None if fraction is None else fraction[0]
        # the whole plan (passes, SesquiLSR, decode) before the encode: a budget a stage cannot meet is refused at once
        size = stages.output_size
        plan = self.plan_memory(prepared.shape[-2], prepared.shape[-1], passes, prepared.shape[0], size, target)
        self.last_plan = plan
        latents = self._encode(
            prepared, self.vae_tiled if self.vae_tiled is not None or plan is None else plan.encode_tiled
        )
        check_finite(latents, "the VAE encoder produced")
        if callback is not None:
            callback("encode")
        latents = self.upscale_latents(
            latents, passes, stages.seed, stages.transplant_strength, stages.color_fix, callback
        )
        if fraction is not None:  # the fraction in latent space: normalized -> raw -> SesquiLSR -> normalized
            rows = latent_upscaler_rows(self, self.sesqui, tuple(latents.shape[-2:]), target, latents.shape[0], plan)
            latents = sesqui_to_size(self.sesqui, latents, target, self.vae.bn_mean, self.vae.bn_std, rows)
        tiled = self.vae_tiled if self.vae_tiled is not None or plan is None else plan.vae_tiled
        decoded = self._vae_call(
            "decode", latents.to(vae_input_dtype(self.vae, self.dtype)), tiled=tiled, on_tile=on_decode_tile
        )
        del latents
        if plan is not None and plan.colour_on_host:  # stage 2 on the host: the device keeps no float32 frame
            decoded = to_host_float32(decoded)
        else:
            decoded = decoded.to(torch.float32)
        check_finite(decoded, "the VAE decoder produced", what="pixels")
        if callback is not None:
            callback("decode")
        result = finish_decoded(
            decoded,
            original,
            prepared,
            passes,
            stages.resize_mode,
            color_fix=stages.color_fix,
            color_fix_strength=stages.color_fix_strength,
            output_size=stages.output_size,
            check_interrupt=self.check_interrupt,
            content=None if fraction is None else fraction[1],
        )
        if callback is not None:
            callback("color fix")
        return result

    # -- provenance ---------------------------------------------------------------------------------

    def model_files(self) -> dict[str, list[Path]]:
        """Weight files behind this pipeline, for provenance: ``{"upscaler": [...], "vae": [...]}``, and
        ``"latent_upscaler"`` with SesquiLSR's file when the pipeline has one.

        The VAE's files come from its ``weight_files`` attribute when it has one, else from a local
        spec (file or folder), else from the Hugging Face cache for ``taef2`` / ``flux2`` / repo ids.
        """
        files = pipeline_model_files(self.upscaler_path, self.vae, self.vae_spec)
        if self.sesqui_file is not None:
            files["latent_upscaler"] = [self.sesqui_file]
        return files
