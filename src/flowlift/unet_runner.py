"""How the Flow Upscaler UNet runs for one sample shape: plain, or strip by strip.

:func:`velocity_model` returns the callable the pipeline evaluates ``v(noise, 1000, cond)`` with: the
UNet itself, or a :class:`flowlift.executor.ChunkedExecutor` around it when chunking is forced or
the size calls for it (:func:`flowlift.executor.should_chunk`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flowlift.errors import FlowliftError

__all__ = ["velocity_model"]


def velocity_model(
    upscaler: Callable,
    sample_shape: tuple[int, ...],
    *,
    device: torch.device,
    dtype: torch.dtype,
    chunked: bool | None = None,
    chunk_rows: int | None = None,
    offload_device: torch.device | str | None = None,
    budget_bytes: int | None = None,
    on_strip: Callable[[int, int], None] | None = None,
) -> Callable:
    """The UNet, or a ChunkedExecutor around it when chunking is on for this (B, C, H, W) sample.

    ``chunked``: ``False`` never chunks, ``True`` always (a custom model that is not a
    ``FlowUpscalerUNet`` then raises), ``None`` chunks by size (above ``budget_bytes`` of estimated
    plain-forward memory; default: :func:`flowlift.executor.should_chunk`'s). ``on_strip`` goes to the
    executor (progress and cancel per strip).
    """
    if chunked is False:
        return upscaler
    try:
        from flowlift.executor import ChunkedExecutor, should_chunk
        from flowlift.models.upscaler_unet import FlowUpscalerUNet
    except ImportError:  # the executor is optional for custom models
        return upscaler
    if not isinstance(upscaler, FlowUpscalerUNet):
        if chunked:
            raise FlowliftError("chunked execution needs a FlowUpscalerUNet, not a custom model")
        return upscaler
    batch, _, height, width = sample_shape
    base = int(upscaler.config.get("base_channels", 384))
    if not should_chunk(
        height, width, device, batch=batch, base_channels=base, dtype=dtype, force=chunked, budget_bytes=budget_bytes
    ):
        return upscaler
    kwargs: dict[str, Any] = {"offload_device": offload_device, "on_strip": on_strip}
    if chunk_rows is not None:
        kwargs["chunk"] = chunk_rows
    return ChunkedExecutor(upscaler, **kwargs)
