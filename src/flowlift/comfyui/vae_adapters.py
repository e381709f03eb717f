"""VAEs between ComfyUI and flowlift.

* :class:`ComfyFlux2VAE` gives a ComfyUI FLUX.2 ``VAE`` object flowlift's VAE interface
  (``encode``/``decode`` on NCHW images and normalized 32-channel latents), so that
  :class:`flowlift.upscale.pipeline.FlowUpscalerPipeline` runs on it. ComfyUI keeps doing the work: memory
  management, batching, and its own tiled decode (used for large outputs).
* :class:`FlowliftComfyVAE` is the other direction: a VAE flowlift runs itself (the ``native`` ones of
  :mod:`flowlift.models.vae_names`: TAEF2, Mage-VAE) as a ComfyUI ``VAE`` (a subclass of ``comfy.sd.VAE``),
  so that VAEEncode / VAEDecode / VAEDecodeTiled accept it, in ComfyUI's FLUX.2 LATENT layout (128
  channels, patchified, normalized — both encoders already output normalized latents, so no BN
  statistics are involved, for Mage-VAE as for TAEF2).

Needs ComfyUI (``comfy``) on the import path.
"""

from __future__ import annotations

from typing import Any

import comfy.model_management as mm
import comfy.model_patcher
import comfy.sd
import comfy.taesd.taesd
import torch

from flowlift.comfyui.layouts import comfy_words
from flowlift.errors import FlowliftError
from flowlift.flux2.latents import PATCHIFIED_CHANNELS, patchify, unpatchify
from flowlift.flux2.latents import bn_std as batch_norm_std
from flowlift.limits import vae_kind
from flowlift.models.vae_names import NAMED_VAES
from flowlift.models.weights import finite_result
from flowlift.upscale.interrupts import checked_modules

#: ComfyUI FLUX.2 decodes above this many output pixels go through ComfyUI's tiled decode.
TILED_DECODE_PIXELS = 2048 * 2048
#: Tiles of that decode, in 128-channel latent pixels (16 image pixels each): 1024 px tiles, 256 px overlap.
TILE_LATENT, TILE_OVERLAP_LATENT = 64, 16
#: Activation bytes per image pixel and per byte of dtype (ComfyUI uses the estimate to decide what to
#: unload before a run). TAEF2: 64-channel full-resolution convolutions, a few live at once; Mage-VAE: its
#: per-pixel MLP, 290-310 channels measured (flowlift.limits.DECODE_PLAIN_CHANNELS), costed at 352.
BYTES_PER_PIXEL = {"taef2": 64 * 6, "mage": 352}
TAEF2_BYTES_PER_PIXEL = BYTES_PER_PIXEL["taef2"]


def is_comfy_taef2(vae: Any) -> bool:
    """Whether ``vae`` is ComfyUI's own TAEF2 (``VAELoader`` ``taef2``: its TAESD class at 128 latent channels)."""
    return isinstance(getattr(vae, "first_stage_model", None), comfy.taesd.taesd.TAESD)


class ComfyFlux2VAE:
    """flowlift's VAE interface over a ComfyUI FLUX.2 ``VAE`` (any VAE whose LATENT is (B, 128, H/16, W/16)).

    ``encode``: NCHW [0, 1] -> ComfyUI's VAE.encode (NHWC) -> unpatchify -> normalized (B, 32, H/8, W/8).
    ``decode``: the inverse; ComfyUI's VAE clamps its output to [0, 1]. Results are moved to ``device``.
    """

    spatial_factor = 8
    approximate_decode = False
    dtype = torch.float32
    # ComfyUI's VAE.encode computes its 2x - 1 in the images' dtype, then rounds to its own: hand it float32
    rounds_inputs_itself = True

    def __init__(
        self, vae: comfy.sd.VAE, device: torch.device, tile_above_pixels: int | None = TILED_DECODE_PIXELS
    ) -> None:
        channels = getattr(vae, "latent_channels", None)
        ratio = vae.spacial_compression_encode() if hasattr(vae, "spacial_compression_encode") else None
        if channels == PATCHIFIED_CHANNELS and is_comfy_taef2(vae):
            # ComfyUI's own TAEF2 reports 1/8 but its FLUX.2 encoder patchifies to 1/16; its tiled decode would place
            # tiles at 1/8, so it always decodes the whole frame (FlowliftTAEF2Loader's exact tiling bounds memory)
            ratio, tile_above_pixels = 2 * self.spatial_factor, None
        if channels != PATCHIFIED_CHANNELS or ratio != 2 * self.spatial_factor:
            raise FlowliftError(
                "the Flow Upscaler needs a FLUX.2-latent VAE (128-channel latents at 1/16 size: the FLUX.2 VAE, "
                f"TAEF2 or Mage-VAE), got a VAE with {channels} latent channels at 1/{ratio} size"
            )
        self.vae = vae
        self.device = torch.device(device)
        self.tile_above_pixels = tile_above_pixels

    @property
    def model(self) -> torch.nn.Module | None:
        """ComfyUI's VAE module (the pipeline checks for interruption before each of its layers)."""
        return getattr(self.vae, "first_stage_model", None)

    @property
    def bn_mean(self) -> torch.Tensor | None:
        """The FLUX.2 VAE's BatchNorm mean ([128] float32 on the CPU) from ComfyUI's own module, the statistics its
        LATENT is normalized with; None for a VAE without them (ComfyUI's TAEF2): SesquiLSR's raw latents."""
        bn = getattr(self.model, "bn", None)
        return None if bn is None else bn.running_mean.detach().to("cpu", torch.float32).clone()

    @property
    def bn_std(self) -> torch.Tensor | None:
        """``sqrt(running_var + eps)`` of the same BatchNorm, with ComfyUI's own ``bn_eps`` (None without one)."""
        bn = getattr(self.model, "bn", None)
        if bn is None:
            return None
        return batch_norm_std(bn.running_var.detach().to("cpu", torch.float32), self.model.bn_eps)

    def encode(self, images: torch.Tensor, *, tiled: bool | None = None) -> torch.Tensor:
        samples = self.vae.encode(images.movedim(1, -1))
        return unpatchify(samples.to(torch.float32)).to(self.device)

    def decode(self, latents: torch.Tensor, *, tiled: bool | None = None) -> torch.Tensor:
        samples = patchify(latents.to(torch.float32))
        pixels = samples.shape[-2] * samples.shape[-1] * (2 * self.spatial_factor) ** 2
        whole = self.tile_above_pixels is None
        if not whole and (tiled if tiled is not None else pixels > self.tile_above_pixels):
            images = self.vae.decode_tiled(samples, tile_x=TILE_LATENT, tile_y=TILE_LATENT, overlap=TILE_OVERLAP_LATENT)
        else:
            images = self.vae.decode(samples)
        return images.movedim(-1, 1).to(device=self.device, dtype=torch.float32)


class FlowliftLatentModel(torch.nn.Module):
    """A flowlift VAE adapter speaking ComfyUI's FLUX.2 LATENT: ``encode`` [0, 1] NCHW -> (B, 128, H/16, W/16),
    ``decode`` back. The adapter's own rule by size picks full frame or its exact tiling. A result holding
    NaN or Inf (weights that overflow) fails the node in one line: ComfyUI would pass an all-NaN LATENT on
    and save a black image with status success."""

    def __init__(self, adapter: Any) -> None:
        super().__init__()
        self.inner = adapter.model  # registered, so ComfyUI's ModelPatcher moves and measures it
        self.adapter = adapter

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        with self._interruptible(), comfy_words("VAE Encode"):
            return patchify(finite_result(f"VAE Encode: {self._name()}'s encoder", self.adapter.encode, images))

    def decode(self, samples: torch.Tensor) -> torch.Tensor:
        with self._interruptible(), comfy_words("VAE Decode"):
            return finite_result(f"VAE Decode: {self._name()}'s decoder", self.adapter.decode, unpatchify(samples))

    def _interruptible(self) -> Any:
        """ComfyUI's interrupt asked before every layer (one call of a 16K Mage-VAE decode runs for minutes: the
        stop came only at the next node), as the upscale nodes ask it (:mod:`flowlift.upscale.interrupts`)."""
        return checked_modules(mm.throw_exception_if_processing_interrupted, [self.adapter.model])

    def _name(self) -> str:
        return NAMED_VAES[vae_kind(self.adapter)].title


class FlowliftComfyVAE(comfy.sd.VAE):
    """A VAE flowlift runs itself (TAEF2, Mage-VAE) as a ComfyUI ``VAE``: ComfyUI's own encode/decode/tiled
    code drives it.

    ``comfy.sd.VAE.__init__`` builds a model from a state dict by key sniffing (neither VAE is there), so
    this sets the same attributes itself and leaves every method to ComfyUI.
    """

    def __init__(self, adapter: Any) -> None:  # deliberately not calling super().__init__
        per_pixel = BYTES_PER_PIXEL.get(vae_kind(adapter))
        if per_pixel is None:
            raise FlowliftError(f"a flowlift VAE for ComfyUI must be TAEF2 or Mage-VAE, got {type(adapter).__name__}")

        def bytes_for(pixels: int, dtype: torch.dtype) -> int:
            return int(per_pixel * pixels * mm.dtype_size(dtype))

        self.memory_used_encode = lambda shape, dtype: bytes_for(shape[0] * shape[-2] * shape[-1], dtype)
        self.memory_used_decode = lambda shape, dtype: bytes_for(shape[0] * shape[-2] * shape[-1] * 256, dtype)
        self.downscale_ratio = self.upscale_ratio = 16
        self.latent_channels = PATCHIFIED_CHANNELS
        self.latent_dim = 2
        self.output_channels = 3
        self.pad_channel_value = None
        self.process_input = lambda image: image  # flowlift's adapters take [0, 1] images
        self.process_output = lambda image: torch.clamp(image, min=0.0, max=1.0)
        self.working_dtypes = [torch.float16, torch.bfloat16, torch.float32]
        self.disable_offload = False
        self.not_video = False
        self.size = None
        self.downscale_index_formula = None
        self.upscale_index_formula = None
        self.extra_1d_channel = None
        self.crop_input = True  # sides cropped to multiples of 16: what Mage-VAE needs, and TAEF2's LATENT
        self.handles_tiling = False  # VAEDecodeTiled tiles with ComfyUI's own code
        self.format_encoded = None
        self.audio_sample_rate = 44100  # ComfyUI's default for every VAE (unused by image VAEs)

        self.first_stage_model = FlowliftLatentModel(adapter).eval()
        self.device = mm.vae_device()
        offload_device = mm.vae_offload_device()
        self.vae_dtype = mm.vae_dtype(self.device, self.working_dtypes)
        self.first_stage_model.to(self.vae_dtype)
        mm.archive_model_dtypes(self.first_stage_model)  # what ComfyUI's VAE records before its patcher sees it
        self.output_device = mm.intermediate_device()
        self.patcher = comfy.model_patcher.ModelPatcher(
            self.first_stage_model, load_device=self.device, offload_device=offload_device
        )
        self.model_size()

    @property
    def adapter(self) -> Any:
        """flowlift's adapter (exact tiling where it has one); load ``self.patcher`` first to have it on the device."""
        return self.first_stage_model.adapter
