"""Precomputed FLUX.2 prompt embeddings: a safetensors (or ``torch.load(weights_only=True)``) file holding
``prompt_embeds`` and, optionally, ``negative_prompt_embeds``, read and checked once, at load.

Either tensor must be floating point and finite: a non-finite embedding propagates through every attention layer
and decodes to a black image.
"""

from __future__ import annotations

import os

import torch

from flowlift.errors import FlowliftError
from flowlift.models.weights import check_finite_state, read_state_dict


def check_prompt_embeds(state: dict[str, torch.Tensor], *, origin: str) -> None:
    """Refuse prompt embeddings that are not floating point or hold NaN/Inf (checked once, at load).

    Non-finite embeddings propagate through every attention layer and decode to a black image.
    """
    for name in ("prompt_embeds", "negative_prompt_embeds"):
        tensor = state.get(name)
        if tensor is not None and not tensor.is_floating_point():
            dtype = str(tensor.dtype).removeprefix("torch.")
            raise FlowliftError(f"prompt embeddings ({origin}): `{name}` has dtype {dtype}, expected floating point")
        if tensor is not None and (tensor.ndim not in (2, 3) or 0 in tensor.shape):  # (tokens, dim) or (1, ...)
            raise FlowliftError(
                f"prompt embeddings ({origin}): `{name}` has shape {tuple(tensor.shape)}, expected ([batch,] tokens, "
                "dim) with at least one token"
            )
    check_finite_state(state, what="prompt embeddings", origin=origin)


def load_prompt_embeds(path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Read ``prompt_embeds`` (and optional ``negative_prompt_embeds``) from a safetensors/.pt file."""
    state = read_state_dict(path, what="prompt embeddings")
    if "prompt_embeds" not in state:
        keys = sorted(state)
        shown = ", ".join(keys[:4]) + (f", ... (+{len(keys) - 4} more)" if len(keys) > 4 else "")
        raise FlowliftError(
            f"prompt.embeds {path} has no 'prompt_embeds' tensor (keys: {shown or 'none'}); give a file that holds "
            "prompt_embeds (and optionally negative_prompt_embeds)",
            field="prompt.embeds",
        )
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
