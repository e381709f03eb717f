"""VAEs behind one interface: TAEF2, the FLUX.2 VAE (diffusers ``AutoencoderKLFlux2``) and Mage-VAE.

:func:`flowlift.models.vae_loading.load_vae` returns one of the adapters below, an object with

* ``encode(images, tiled=None) -> latents`` and ``decode(latents, tiled=None) -> images``: images are
  float [0, 1] NCHW RGB; latents are normalized, unpatchified, 32 channels at 1/8 size (the package
  convention, :mod:`flowlift.flux2.latents`). Decoded images are *not* clamped. Inputs are moved to the
  VAE's device and dtype; outputs stay on the VAE's device in the input's floating dtype. A result with
  NaN or Inf (finite weights that overflow) is a ``weights.NonFiniteResult`` line, never an image.
* ``tiled``: ``None`` switches tiling on by size, ``True`` forces it, ``False`` forbids it.
* ``spatial_factor`` (8), ``approximate_decode`` (True for TAEF2 and Mage-VAE), ``device``, ``dtype``,
  ``bn_mean`` / ``bn_std`` ([128] float32 normalization statistics; None for TAEF2 and Mage-VAE,
  whose latents are already normalized).
* The FLUX.2 adapter also offers ``encode_raw`` / ``decode_raw`` on raw (un-normalized) latents.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from flowlift.errors import FIELD_MARK, FlowliftError
from flowlift.flux2.latents import DEFAULT_BATCH_NORM_EPS, LATENT_CHANNELS, bn_std, denormalize, normalize
from flowlift.models.taef2_tiling import TileCallback
from flowlift.models.vae_checks import check_images, check_latents, out_dtype, tiles_asked
from flowlift.models.weights import check_finite_result, load_strict

#: TAEF2 tiles automatically when the image has more pixels than this (one 1024x1024 frame).
TAEF2_AUTO_TILE_PIXELS = 1024 * 1024
#: The FLUX.2 VAE tiles (diffusers' tiles, :mod:`flowlift.models.flux2_tiling`) above this many pixels on a side.
FLUX2_AUTO_TILE_SIDE = 2048


def diffusers_decode_tiles(
    height: int, width: int, *, batch: int, tiling: bool, slicing: bool, tile_latent: int, overlap: float
) -> int:
    """How many times diffusers' ``AutoencoderKL*`` decode runs its decoder on (batch, C, height, width).

    Tiled (``tiling`` and a side over ``tile_latent``): tiles start every ``stride = int(tile_latent *
    (1 - overlap))`` latent rows and columns, so ``ceil(height / stride) * ceil(width / stride)`` per
    decode; otherwise one. With ``slicing`` a batch of more than one is decoded one image at a time.
    """
    per_decode = 1
    if tiling and (height > tile_latent or width > tile_latent):
        stride = int(tile_latent * (1 - overlap))
        per_decode = -(-height // stride) * -(-width // stride)
    return per_decode * (batch if slicing and batch > 1 else 1)


# --------------------------------------------------------------------------------------------------
# TAEF2
# --------------------------------------------------------------------------------------------------


class _ModuleVAE:
    """What every adapter shares: the wrapped ``model`` and its device and dtype.

    Inputs in any float dtype: each adapter does its own arithmetic on them (``2x - 1``, the latents' BatchNorm) in
    float32 and rounds the result to the model's dtype once, so a caller hands them float32 rather than rounding
    them first (:attr:`rounds_inputs_itself`; rounding before ``2x - 1`` in bfloat16 rounds dark pixels twice).
    """

    model: torch.nn.Module
    #: The pipeline passes such a VAE float32 images and latents (``image_steps.vae_input_dtype``).
    rounds_inputs_itself = True

    def _signed_images(self, images: torch.Tensor) -> torch.Tensor:
        """``2x - 1`` on the model's device, computed in float32 (or the images' wider float) and rounded to the
        model's dtype once."""
        wide = images.to(self.device, torch.promote_types(images.dtype, torch.float32), copy=True)
        return wide.mul_(2).sub_(1).to(self.dtype)  # in place: one wide frame at a time, as the bf16 copy was

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


class TAEF2VAE(_ModuleVAE):
    """TAEF2 adapter: approximate decode, exact tiling (tiled == full frame up to float rounding)."""

    spatial_factor = 8
    approximate_decode = True
    bn_mean: torch.Tensor | None = None
    bn_std: torch.Tensor | None = None

    def __init__(self, model: Any, *, auto_tile_pixels: int = TAEF2_AUTO_TILE_PIXELS) -> None:
        from flowlift.models.taef2 import TAEF2

        if not isinstance(model, TAEF2):
            raise FlowliftError(f"TAEF2VAE needs a flowlift TAEF2 module, got {type(model).__name__}")
        # Channels-last: ~25% less CPU time for these 64-channel 3x3 convolutions (oneDNN), same results.
        self.model = model.eval().requires_grad_(False).to(memory_format=torch.channels_last)
        self.auto_tile_pixels = auto_tile_pixels

    def _use_tiles(self, tiled: bool | None, pixels: int) -> bool:
        return tiles_asked(tiled, pixels > self.auto_tile_pixels)

    @torch.no_grad()
    def encode(self, images: torch.Tensor, *, tiled: bool | None = None) -> torch.Tensor:
        """Images [0, 1] (B, 3, H, W) -> normalized latents (B, 32, H/8, W/8)."""
        check_images(images, self.spatial_factor)
        x = images.to(self.device, self.dtype).contiguous(memory_format=torch.channels_last)
        if self._use_tiles(tiled, images.shape[-2] * images.shape[-1]):
            z = self.model.encode_tiled(x)
        else:
            z = self.model.encode_full(x)
        return check_finite_result(z.to(out_dtype(images)).contiguous(), "TAEF2's encode")

    @torch.no_grad()
    def decode(
        self, latents: torch.Tensor, *, tiled: bool | None = None, on_tile: TileCallback | None = None
    ) -> torch.Tensor:
        """Normalized latents (B, 32, h, w) -> images (B, 3, 8h, 8w), approximately [0, 1], unclamped.

        ``on_tile(done, total)`` after every decoded tile (a whole-frame decode is one tile).
        """
        check_latents(latents, 1)
        z = latents.to(self.device, self.dtype).contiguous(memory_format=torch.channels_last)
        if self._use_tiles(tiled, latents.shape[-2] * latents.shape[-1] * self.spatial_factor**2):
            # Written straight into the answer's dtype: a bf16 frame beside its float32 copy is 18 bytes a pixel.
            progress = {} if on_tile is None else {"on_tile": on_tile}
            x = self.model.decode_tiled(z, dtype=out_dtype(latents), **progress)
        else:
            x = self.model.decode_full(z)
            if on_tile is not None:
                on_tile(1, 1)
        return check_finite_result(x.to(out_dtype(latents)).contiguous(), "TAEF2's decode")

    def __repr__(self) -> str:
        parts = [p for p in ("encoder", "decoder") if getattr(self.model, p) is not None]
        return f"TAEF2VAE({'+'.join(parts)}, device={self.device}, dtype={self.dtype})"


def taef2_from_state_dicts(
    states: list[tuple[Mapping[str, torch.Tensor], str]], *, device: torch.device | str, dtype: torch.dtype
) -> TAEF2VAE:
    """Build a :class:`TAEF2VAE` from one or two state dicts (any layout, see ``detect_layout``).

    ``states`` holds ``(state_dict, origin)`` pairs; layouts are detected from the keys and the
    result is loaded strictly.
    """
    from flowlift.models.taef2 import TAEF2, detect_layout, to_flowlift_layout

    merged: dict[str, torch.Tensor] = {}
    origins = []
    for state, origin in states:
        layout = detect_layout(state)
        if layout == "unknown":
            raise FlowliftError(f"TAEF2: {origin} holds no TAEF2 encoder or decoder (unrecognised keys)")
        merged.update(to_flowlift_layout(state, layout))
        origins.append(origin)
    has_encoder = any(k.startswith("encoder.") for k in merged)
    has_decoder = any(k.startswith("decoder.") for k in merged)
    model = TAEF2(encoder=has_encoder, decoder=has_decoder)
    load_strict(model, merged, what="TAEF2 weights", origin=" + ".join(origins))
    return TAEF2VAE(model.to(device=device, dtype=dtype))


# --------------------------------------------------------------------------------------------------
# FLUX.2 VAE
# --------------------------------------------------------------------------------------------------


class Flux2VAE(_ModuleVAE):
    """Adapter over diffusers' ``AutoencoderKLFlux2``.

    ``encode``: ``z = mode(q(z | 2x - 1))`` (raw), then patchify and ``(z - bn_mean) / bn_std`` with
    ``bn_std = sqrt(bn.running_var + config.batch_norm_eps)``, then unpatchify — exactly the FLUX.2
    pipelines' normalization, kept in the package's 32-channel layout. ``decode`` inverts it and maps
    the VAE's [-1, 1] output to ``(x + 1) / 2`` without clamping.
    """

    spatial_factor = 8
    approximate_decode = False

    def __init__(self, model: Any, *, auto_tile_side: int = FLUX2_AUTO_TILE_SIDE) -> None:
        from diffusers import AutoencoderKLFlux2

        if not isinstance(model, AutoencoderKLFlux2):
            raise FlowliftError(f"Flux2VAE needs a diffusers AutoencoderKLFlux2, got {type(model).__name__}")
        if tuple(model.config.patch_size) != (2, 2) or model.config.latent_channels != LATENT_CHANNELS:
            raise FlowliftError(
                f"Flux2VAE: expected latent_channels={LATENT_CHANNELS} and patch_size=(2, 2), got "
                f"{model.config.latent_channels} and {tuple(model.config.patch_size)}"
            )
        self.model = model.eval().requires_grad_(False)
        self.auto_tile_side = auto_tile_side
        eps = float(getattr(model.config, "batch_norm_eps", DEFAULT_BATCH_NORM_EPS))
        self.bn_mean = model.bn.running_mean.detach().to("cpu", torch.float32).clone()
        self.bn_std = bn_std(model.bn.running_var.detach().to("cpu", torch.float32), eps)

    @contextmanager
    def _whole_frame(self):
        """diffusers' encode/decode on the whole frame: its own tiling (which keeps every tile of the frame at once,
        :mod:`flowlift.models.flux2_tiling`) switched off for the call, whatever the model was set to."""
        before = self.model.use_tiling
        self.model.use_tiling = False
        try:
            yield
        finally:
            self.model.use_tiling = before

    @torch.no_grad()
    def encode_raw(self, images: torch.Tensor, *, tiled: bool | None = None) -> torch.Tensor:
        """Images [0, 1] (B, 3, H, W), sides multiples of 16 -> raw latents (B, 32, H/8, W/8).

        Tiled (``tiled``, or a side over ``auto_tile_side``) where a side exceeds one of diffusers' tiles: its tiles
        and blend in bounded memory (:func:`flowlift.models.flux2_tiling.encode_tiled`, bit for bit diffusers')."""
        from flowlift.models.flux2_tiling import encode_tiled, needs_tiles

        check_images(images, 2 * self.spatial_factor)
        height, width = images.shape[-2:]
        if tiles_asked(tiled, max(height, width) > self.auto_tile_side) and needs_tiles(
            self.model, height, width, latent=False
        ):
            z = encode_tiled(self.model, images, dtype=out_dtype(images))
        else:
            x = self._signed_images(images)
            with self._whole_frame():
                z = self.model.encode(x).latent_dist.mode()
        return check_finite_result(z.to(out_dtype(images)), "the FLUX.2 VAE's encode")

    @torch.no_grad()
    def decode_raw(
        self, raw_latents: torch.Tensor, *, tiled: bool | None = None, on_tile: TileCallback | None = None
    ) -> torch.Tensor:
        """Raw latents (B, 32, h, w), even sides -> images (B, 3, 8h, 8w), about [0, 1], unclamped.

        Tiled (``tiled``, or a side over ``auto_tile_side`` px) where a side exceeds one of diffusers' tiles: its
        tiles and blend in bounded memory (:func:`flowlift.models.flux2_tiling.decode_tiled`, bit for bit
        diffusers'). ``on_tile(done, total)`` after every tile (:func:`diffusers_decode_tiles` of them; a
        whole-frame decode is one per batch slice, counted by a hook on diffusers' decoder).
        """
        from flowlift.models.flux2_tiling import decode_tiled, needs_tiles

        check_latents(raw_latents, 2)
        z = raw_latents.to(self.device, self.dtype)
        height, width = z.shape[-2:]
        dtype = out_dtype(raw_latents)
        if tiles_asked(tiled, max(height, width) * self.spatial_factor > self.auto_tile_side) and needs_tiles(
            self.model, height, width, latent=True
        ):
            x = decode_tiled(self.model, z, dtype=dtype, on_tile=on_tile)
        else:
            with self._whole_frame(), self._tile_hook(z, on_tile):
                x = ((self.model.decode(z).sample.float() + 1) / 2).to(dtype)
        return check_finite_result(x, "the FLUX.2 VAE's decode")

    @contextmanager
    def _tile_hook(self, z: torch.Tensor, on_tile: TileCallback | None):
        """Report each run of diffusers' decoder on the whole frame (one per batch slice) as one tile."""
        if on_tile is None:
            yield
            return
        model = self.model
        total = diffusers_decode_tiles(
            z.shape[-2],
            z.shape[-1],
            batch=z.shape[0],
            tiling=False,
            slicing=bool(getattr(model, "use_slicing", False)),
            tile_latent=int(model.tile_latent_min_size),
            overlap=float(model.tile_overlap_factor),
        )
        done = 0

        def after_decoder(*_: Any) -> None:
            nonlocal done
            done = min(done + 1, total)
            on_tile(done, total)

        handle = model.decoder.register_forward_hook(after_decoder)
        try:
            yield
        finally:
            handle.remove()

    def encode(self, images: torch.Tensor, *, tiled: bool | None = None) -> torch.Tensor:
        """Images [0, 1] -> normalized, unpatchified latents (B, 32, H/8, W/8)."""
        raw = self.encode_raw(images, tiled=tiled)
        return normalize(raw.float(), self.bn_mean, self.bn_std).to(raw.dtype)

    def decode(
        self, latents: torch.Tensor, *, tiled: bool | None = None, on_tile: TileCallback | None = None
    ) -> torch.Tensor:
        """Normalized latents (B, 32, h, w) -> images (B, 3, 8h, 8w), about [0, 1], unclamped."""
        check_latents(latents, 2)
        raw = denormalize(latents.float(), self.bn_mean, self.bn_std)
        return self.decode_raw(raw, tiled=tiled, on_tile=on_tile).to(out_dtype(latents))

    def __repr__(self) -> str:
        return f"Flux2VAE(device={self.device}, dtype={self.dtype})"


# --------------------------------------------------------------------------------------------------
# Mage-VAE
# --------------------------------------------------------------------------------------------------

#: Mage-VAE image sides must be multiples of its 16-pixel patch.
MAGE_IMAGE_MULTIPLE = 16


class MageVAE(_ModuleVAE):
    """Adapter over flowlift's :class:`~flowlift.models.mage_vae.MageVAEModel` (t = 0 folded).

    The codec's latent (B, 128, H/16, W/16) is FLUX.2's normalized, patchified latent, so ``encode`` is
    ``unpatchify(mean(q(z | 2x - 1)))`` (the posterior mean, no sampling) and ``decode`` is
    ``(decoder(patchify(z)) + 1) / 2`` unclamped; no BN statistics are involved (``bn_mean`` /
    ``bn_std`` are None, as for TAEF2). Image sides must be multiples of 16, latent sides even.

    ``tiled``: where :meth:`_use_tiles` says so (``None``: above ``auto_tile_pixels``), encode and
    decode run :attr:`tiled_encoder` / :attr:`tiled_decoder`, called as ``fn(module, x) -> y`` (the
    decoder's as ``fn(module, x, unit_range=True)`` -> the image in [0, 1], float32, also with ``on_tile=``);
    by default the exact, bounded-memory executors of :mod:`flowlift.models.mage_tiling` (tile sides:
    :attr:`tiling`). A hook set to None: whole frame.
    """

    spatial_factor = 8
    image_multiple = MAGE_IMAGE_MULTIPLE
    # Its own decoder, trained toward FLUX.2-VAE latents, not FLUX.2's decoder: FLUX.2 latents decode
    # approximately (as with TAEF2), which is what this flag tells eval and the reports.
    approximate_decode = True
    bn_mean: torch.Tensor | None = None
    bn_std: torch.Tensor | None = None

    def __init__(self, model: Any, *, auto_tile_pixels: int = TAEF2_AUTO_TILE_PIXELS, origin: str = "") -> None:
        from flowlift.models.mage_tiling import MageTiling
        from flowlift.models.mage_vae import MageVAEModel

        if not isinstance(model, MageVAEModel):
            raise FlowliftError(f"MageVAE needs a flowlift MageVAEModel, got {type(model).__name__}")
        if not model.folded:
            model.fold_t0()
        # Channels-last in every dtype, as TAEF2: on the CPU 1.16x / 2.3x less encode / decode time in float32,
        # 1.27x / 3.1x in bfloat16 (benchmarks/bench_cpu_bf16.py, docs/cpu.md), the same numbers to ~1e-6.
        self.model = model.eval().requires_grad_(False).to(memory_format=torch.channels_last)
        self.origin = origin
        self.auto_tile_pixels = auto_tile_pixels
        self.tiled_encoder: Any = None
        self.tiled_decoder: Any = None
        self.tiling = MageTiling.for_dtype(self.dtype)

    @property
    def tiling(self) -> Any:
        """Tile sides (:class:`~flowlift.models.mage_tiling.MageTiling`); setting it re-arms both hooks."""
        return self._tiling

    @tiling.setter
    def tiling(self, value: Any) -> None:
        from flowlift.models.mage_tiling import decode_tiled, encode_tiled

        self._tiling = value
        self.tiled_encoder = partial(encode_tiled, tiling=value)
        self.tiled_decoder = partial(decode_tiled, tiling=value)

    @property
    def has_encoder(self) -> bool:
        return self.model.encoder is not None

    def _use_tiles(self, tiled: bool | None, pixels: int) -> bool:
        return tiles_asked(tiled, pixels > self.auto_tile_pixels)

    @torch.no_grad()
    def encode(self, images: torch.Tensor, *, tiled: bool | None = None) -> torch.Tensor:
        """Images [0, 1] (B, 3, H, W), sides multiples of 16 -> normalized latents (B, 32, H/8, W/8)."""
        from flowlift.flux2.latents import unpatchify

        if self.model.encoder is None:
            where = f" ({self.origin})" if self.origin else ""
            raise FlowliftError(
                f"Mage-VAE{where} is decode-only (the file has no student.dconv_encoder.* tensors); "
                f"encoding needs the full released file, or another VAE: set {FIELD_MARK} to taef2",
                field="vae",
            )
        check_images(images, self.image_multiple)
        x = self._signed_images(images).contiguous(memory_format=torch.channels_last)
        if self.tiled_encoder is not None and self._use_tiles(tiled, images.shape[-2] * images.shape[-1]):
            z = self.tiled_encoder(self.model.encoder, x)
        else:
            z = self.model.encoder(x)
        return check_finite_result(unpatchify(z).to(out_dtype(images)).contiguous(), "Mage-VAE's encode")

    @torch.no_grad()
    def decode(
        self, latents: torch.Tensor, *, tiled: bool | None = None, on_tile: TileCallback | None = None
    ) -> torch.Tensor:
        """Normalized latents (B, 32, h, w), even sides -> images (B, 3, 8h, 8w), about [0, 1], unclamped,
        float32 whatever the latents' dtype: the decoder's last layer computes the pixels in float32 and they
        are kept so (rounding them to a half dtype would only lose precision; ``limits.decoded_image_dtype``).

        ``on_tile(done, total)`` after every decoded tile (a whole-frame decode is one tile).
        """
        from flowlift.flux2.latents import patchify

        if self.model.decoder is None:
            raise FlowliftError("Mage-VAE: this VAE has no decoder")
        check_latents(latents, 2)
        z = patchify(latents.to(self.device, self.dtype)).contiguous(memory_format=torch.channels_last)
        pixels = latents.shape[-2] * latents.shape[-1] * self.spatial_factor**2
        # The decoder writes (x + 1) / 2 in float32 tile by tile: no copy of the frame in another dtype.
        if self.tiled_decoder is not None and self._use_tiles(tiled, pixels):
            progress = {} if on_tile is None else {"on_tile": on_tile}
            x = self.tiled_decoder(self.model.decoder, z, unit_range=True, **progress)
        else:
            x = self.model.decoder(z, unit_range=True)
            if on_tile is not None:
                on_tile(1, 1)
        return check_finite_result(x, "Mage-VAE's decode")

    def __repr__(self) -> str:
        parts = [p for p in ("encoder", "decoder") if getattr(self.model, p) is not None]
        return f"MageVAE({'+'.join(parts)}, device={self.device}, dtype={self.dtype})"
