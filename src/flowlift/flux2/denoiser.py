"""A velocity function around a diffusers ``Flux2Transformer2DModel`` (FLUX.2 dev and Klein).

The sampling loops in :mod:`flowlift.flux2.img2img` call ``velocity_fn(x, sigma) -> v`` on flowlift's
latent convention (normalized, unpatchified 32-channel latents at 1/8 image size). This module turns
that call into exactly the transformer call diffusers' ``Flux2Pipeline`` / ``Flux2KleinPipeline`` make:

* latents are patchified 2x2 and packed to tokens ``(B, h*w, 128)`` (h, w = latent size / 2);
* image position ids are 4-D ``(t, h, w, l)`` = ``(0, row, col, 0)``; reference image ``i`` gets
  ``t = 10 + 10*i`` (its clean, normalized latents are appended after the noisy tokens and the
  prediction for them is dropped); text ids are ``(0, 0, 0, k)`` for token ``k``;
* the timestep is the flow-matching ``sigma`` in [0, 1] -- the transformer multiplies by 1000 itself;
* ``guidance`` (the embedded distilled guidance of FLUX.2 dev) is passed for configs with
  ``guidance_embeds=True`` and ``None`` for Klein;
* true classifier-free guidance, when asked: ``v = v_neg + cfg_scale * (v_pos - v_neg)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from flowlift.devices import check_holds_values
from flowlift.errors import FIELD_MARK, FlowliftError
from flowlift.flux2.latents import LATENT_CHANNELS, pack, patchify, unpack, unpatchify
from flowlift.knobs import check_cfg_scale, check_positive

#: FLUX.2 dev's default embedded guidance (``Flux2Pipeline(guidance_scale=4.0)``).
DEFAULT_DEV_GUIDANCE = 4.0
#: Time offset between reference images on the ``t`` position axis: image ``i`` sits at ``10 + 10*i``.
REFERENCE_T_SCALE = 10


def latent_position_ids(height: int, width: int, t: int = 0, *, device: torch.device | str = "cpu") -> torch.Tensor:
    """Position ids of a packed ``height x width`` token grid: ``(height*width, 4)`` int64 ``(t, i, j, 0)``.

    Row-major over ``(i, j)``, matching :func:`flowlift.flux2.latents.pack` and diffusers'
    ``Flux2Pipeline._prepare_latent_ids`` (t = 0) / ``_prepare_image_ids`` (t = 10 + 10*i).
    """
    return torch.cartesian_prod(torch.tensor([t]), torch.arange(height), torch.arange(width), torch.arange(1)).to(
        device
    )


def text_position_ids(seq_len: int, *, device: torch.device | str = "cpu") -> torch.Tensor:
    """Position ids of ``seq_len`` text tokens: ``(seq_len, 4)`` int64 rows ``(0, 0, 0, k)``."""
    return torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(seq_len)).to(device)


def reference_position_ids(
    grids: Sequence[tuple[int, int]], *, scale: int = REFERENCE_T_SCALE, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Ids of reference images with token grids ``grids[i] = (h_i, w_i)``: ``t = scale + scale*i``."""
    parts = [latent_position_ids(h, w, t=scale + scale * i, device=device) for i, (h, w) in enumerate(grids)]
    return torch.cat(parts, dim=0) if parts else torch.zeros(0, 4, dtype=torch.long, device=device)


def cfg_combine(v_pos: torch.Tensor, v_neg: torch.Tensor, cfg_scale: float) -> torch.Tensor:
    """True classifier-free guidance: ``v_neg + cfg_scale * (v_pos - v_neg)``."""
    return v_neg + cfg_scale * (v_pos - v_neg)


def _check_embeds(name: str, embeds: torch.Tensor, joint_dim: int | None) -> None:
    if not isinstance(embeds, torch.Tensor) or not embeds.is_floating_point():
        raise FlowliftError(f"{name} must be a float tensor (batch, tokens, dim), got {type(embeds).__name__}")
    if embeds.ndim != 3 or 0 in embeds.shape:
        raise FlowliftError(f"{name} must have shape (batch, tokens, dim), none 0, got {tuple(embeds.shape)}")
    check_holds_values(embeds, name)
    if not bool(torch.isfinite(embeds).all()):  # a NaN here is a NaN image at the end
        raise FlowliftError(f"{name} contain NaN or Inf")
    if joint_dim is not None and embeds.shape[-1] != joint_dim:
        raise FlowliftError(
            f"{name} have dim {embeds.shape[-1]} but the transformer expects {joint_dim} "
            "(embeddings from another model's text encoder?)"
        )


def check_guidance(
    guidance: float | None, guidance_embeds: bool, fields: tuple[str, str] = ("guidance", "cfg_scale")
) -> float | None:
    """The embedded guidance a transformer runs with: ``guidance`` (None: dev's :data:`DEFAULT_DEV_GUIDANCE`) when
    its config has a guidance embedding (``guidance_embeds``, FLUX.2 dev), None when it has none (Klein), where a
    guidance given is one line naming ``fields`` (the guidance, then true CFG's scale, what such a model takes
    instead). The one rule: :class:`Flux2Denoiser` applies it, and a refine job from the transformer's config before
    the model loads."""
    guidance = check_positive(fields[0], guidance, optional=True)
    if guidance_embeds:
        return DEFAULT_DEV_GUIDANCE if guidance is None else float(guidance)
    if guidance is not None:
        raise FlowliftError(
            f"{FIELD_MARK} {guidance:g}: this transformer has no guidance embedding (a FLUX.2 Klein config): drop it; "
            f"for classifier-free guidance give {FIELD_MARK} with a negative prompt",
            field=fields,
        )
    return None


def check_embeds_batch(conditioning: Mapping[str, Any], images: int, field: str | None = None) -> None:
    """One line unless the ``prompt_embeds`` and ``negative_prompt_embeds`` of ``conditioning`` (tensors or None) have
    a batch of 1 (one prompt for every image) or of ``images`` (one per image), naming ``field`` (None: each key).
    The one rule of the embeddings' batch, checked where the image count is known before any step (the refiner's
    modes; a refine job, one image, from its embeddings file before any model loads): :class:`Flux2Denoiser` takes
    any batch its call's latents have, and a tiled refine stacks one image's tiles on that axis, so embeddings of
    batch 2 for one image would condition its tiles on different prompts."""
    for key, what in (("prompt_embeds", "prompt embeddings"), ("negative_prompt_embeds", "negative prompt embeddings")):
        embeds = conditioning.get(key)  # (batch, tokens, dim): the denoiser's or the file reader's
        if embeds is not None and embeds.shape[0] not in (1, images):
            raise FlowliftError(
                f"{FIELD_MARK}: {what} have a batch of {embeds.shape[0]} for {images} image"
                f"{'s' if images != 1 else ''}: give a batch of 1 (one prompt for every image) or one per image",
                field=field or key,
            )


class Flux2Denoiser:
    """``velocity_fn(x, sigma)`` over a FLUX.2 transformer; ``x`` is normalized 32-channel latents.

    Args:
        transformer: a diffusers ``Flux2Transformer2DModel`` (or a module with its forward signature
            and a ``config`` with ``guidance_embeds`` / ``joint_attention_dim``).
        prompt_embeds: ``(1 or B, L, joint_attention_dim)`` text embeddings.
        negative_prompt_embeds: embeddings of the negative prompt, needed when ``cfg_scale != 1``.
        cfg_scale: true classifier-free guidance scale; 1 runs the transformer once per call.
        guidance: embedded guidance for dev-style configs (``guidance_embeds=True``; default 4.0).
            Must be None for Klein (no guidance embedding).
        reference_latents: normalized clean latents ``(1, 32, H_i, W_i)`` of reference images.
    """

    def __init__(
        self,
        transformer: torch.nn.Module,
        prompt_embeds: torch.Tensor,
        *,
        negative_prompt_embeds: torch.Tensor | None = None,
        cfg_scale: float = 1.0,
        guidance: float | None = None,
        reference_latents: Sequence[torch.Tensor] = (),
    ) -> None:
        config = getattr(transformer, "config", None)
        self.guidance_embeds = bool(getattr(config, "guidance_embeds", False))
        joint_dim = getattr(config, "joint_attention_dim", None)
        _check_embeds("prompt embeddings", prompt_embeds, joint_dim)
        if negative_prompt_embeds is not None:
            _check_embeds("negative prompt embeddings", negative_prompt_embeds, joint_dim)
        cfg_scale = check_cfg_scale("cfg_scale", cfg_scale)  # finite, in (0, 100]: not NaN, not "2"
        if cfg_scale != 1.0 and negative_prompt_embeds is None:
            raise FlowliftError(f"cfg scale {cfg_scale} needs a negative prompt (use '' for the empty prompt)")
        guidance = check_guidance(guidance, self.guidance_embeds)
        self.transformer = transformer
        self.prompt_embeds = prompt_embeds
        self.negative_prompt_embeds = negative_prompt_embeds
        self.cfg_scale = float(cfg_scale)
        self.guidance = guidance
        self.reference_latents = list(reference_latents)
        self.calls = 0

    @property
    def dtype(self) -> torch.dtype:
        """The transformer's compute dtype: a diffusers model's own answer (it sees through fp8-stored layers and
        GGUF blocks), else its first parameter's."""
        dtype = getattr(self.transformer, "dtype", None)
        if isinstance(dtype, torch.dtype):
            return dtype
        param = next(self.transformer.parameters(), None)
        return param.dtype if param is not None else torch.float32

    def _reference_tokens(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, grids = [], []
        for ref in self.reference_latents:
            if ref.ndim != 4 or ref.shape[1] != LATENT_CHANNELS or ref.shape[0] != 1:
                raise FlowliftError(f"reference latents must be (1, 32, H, W), got {tuple(ref.shape)}")
            patches = patchify(ref.to(device=device, dtype=torch.float32))
            grids.append((patches.shape[2], patches.shape[3]))
            tokens.append(pack(patches))
        ids = reference_position_ids(grids, device=device)
        return torch.cat(tokens, dim=1).to(dtype), ids

    def _forward(self, tokens: torch.Tensor, ids: torch.Tensor, embeds: torch.Tensor, sigma: float) -> torch.Tensor:
        batch = tokens.shape[0]
        device, dtype = tokens.device, tokens.dtype
        if embeds.shape[0] not in (1, batch):
            raise FlowliftError(f"prompt embeddings batch {embeds.shape[0]} does not match latents batch {batch}")
        embeds = embeds.to(device=device, dtype=dtype).expand(batch, -1, -1)
        # the timestep is sigma in [0, 1]: Flux2Transformer2DModel multiplies it by 1000 itself
        timestep = torch.full((batch,), float(sigma), device=device, dtype=dtype)
        guidance = (
            torch.full((batch,), self.guidance, device=device, dtype=torch.float32) if self.guidance_embeds else None
        )
        self.calls += 1
        out = self.transformer(
            hidden_states=tokens,
            encoder_hidden_states=embeds,
            timestep=timestep,
            img_ids=ids,
            txt_ids=text_position_ids(embeds.shape[1], device=device),
            guidance=guidance,
            return_dict=False,
        )[0]
        return out

    def __call__(self, x: torch.Tensor, sigma: float) -> torch.Tensor:
        """Velocity ``v = dx/dsigma`` at noise level ``sigma`` for normalized latents ``x`` (B, 32, H, W)."""
        if x.ndim != 4 or x.shape[1] != LATENT_CHANNELS:
            raise ValueError(f"expected normalized (B, 32, H, W) latents, got {tuple(x.shape)}")
        dtype = self.dtype
        patches = patchify(x.to(torch.float32))
        h, w = patches.shape[2], patches.shape[3]
        tokens = pack(patches).to(dtype)
        ids = latent_position_ids(h, w, device=x.device)
        n_img = tokens.shape[1]
        if self.reference_latents:
            ref_tokens, ref_ids = self._reference_tokens(x.device, dtype)
            tokens = torch.cat([tokens, ref_tokens.expand(tokens.shape[0], -1, -1)], dim=1)
            ids = torch.cat([ids, ref_ids], dim=0)
        v = self._forward(tokens, ids, self.prompt_embeds, sigma)[:, :n_img]
        if self.cfg_scale != 1.0:
            v_neg = self._forward(tokens, ids, self.negative_prompt_embeds, sigma)[:, :n_img]
            v = cfg_combine(v.float(), v_neg.float(), self.cfg_scale)
        return unpatchify(unpack(v.float(), h, w)).to(x.dtype)
