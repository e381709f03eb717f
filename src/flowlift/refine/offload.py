"""Where the FLUX.2 transformer's weights live while the refiner runs: ``offload none|model|group``.

* ``none``: on the device throughout.
* ``model``: in host memory, moved whole to the device for each sampling loop and back after it, so the VAE, the
  Flow Upscaler and the next image's encode get the device to themselves (what diffusers' model CPU offload does
  for a pipeline's components, here around the one stage that runs the transformer).
* ``group``: diffusers' group offloading (``apply_group_offloading``, block level, one transformer block per group):
  each block is copied to the device just before it runs; on CUDA with a side stream, so the next block's copy
  overlaps the current block's compute. diffusers moves the groups with accelerate's helpers: ``flowlift[offload]``.

The arithmetic is the same in every mode (the same kernels on the same values), so offloaded outputs equal the
outputs without offload; ``tests/test_refine_memory.py`` checks it bit for bit on the CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from flowlift.errors import FlowliftError

OFFLOAD_MODES = ("none", "model", "group")
_HOST = torch.device("cpu")
Run = TypeVar("Run", bound=Callable[..., Any])


@dataclass(frozen=True)
class Placement:
    """Where a refiner's models run, as one object: ``offload`` (:data:`OFFLOAD_MODES`: where the transformer
    waits), ``vae_tiled`` (None: by size) and the ``max_memory`` ``plan`` they came from
    (:class:`~flowlift.refine.memory_plan.RefinePlan`; it also sizes the tiles), or None without a budget."""

    offload: str = "none"
    vae_tiled: bool | None = None
    plan: Any = None

    def __post_init__(self) -> None:
        """Each field checked when the placement is made: ``vae_tiled="no"`` would read as True, ``plan=5`` fail
        where the tiles are sized."""
        from flowlift.knobs import check_kind
        from flowlift.refine.memory_plan import RefinePlan

        check_offload(self.offload)
        check_kind("vae_tiled", self.vae_tiled, bool, "True, False", optional=True)
        check_kind("plan", self.plan, RefinePlan, "a RefinePlan (Placement.planned)", optional=True)

    @classmethod
    def planned(cls, plan: Any) -> Placement:
        """The placement a memory plan decided (its offload mode and VAE tiling)."""
        return cls(plan.offload, plan.vae_tiled, plan)


def storage_is_managed(transformer: torch.nn.Module) -> bool:
    """True for a GGUF-quantized or fp8-stored transformer: its loader set each weight's dtype, and a blanket
    ``.to(dtype)`` would dequantize or upcast the stored weights."""
    if getattr(transformer, "hf_quantizer", None) is not None:
        return True
    return any(p.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for p in transformer.parameters())


def check_offload(offload: str) -> str:
    if not isinstance(offload, str) or offload not in OFFLOAD_MODES:
        raise FlowliftError(f"offload must be one of {', '.join(OFFLOAD_MODES)}, got {offload!r}", field="offload")
    return offload


def place_transformer(
    transformer: torch.nn.Module, *, offload: str, device: torch.device, dtype: torch.dtype
) -> torch.nn.Module:
    """Put ``transformer`` where ``offload`` keeps it between calls (see the module docstring); returns it."""
    check_offload(offload)
    grouped = getattr(transformer, "flowlift_group_offload", None)
    if grouped is not None:  # the hooks stay: the same placement again is fine, another one is not
        if offload != "group" or grouped != device:
            raise FlowliftError(
                f"this transformer is group-offloaded to {grouped}; load it again for offload {offload} on {device}"
            )
        return transformer
    if not storage_is_managed(transformer):
        transformer.to(dtype=dtype)
    if offload == "none":
        return transformer.to(device)
    transformer.to(_HOST)
    if offload == "group":
        from diffusers.hooks import apply_group_offloading
        from diffusers.utils import is_accelerate_available

        if not is_accelerate_available():  # diffusers' group offloading moves tensors with accelerate's helpers
            raise FlowliftError("offload group needs accelerate (pip install 'flowlift[offload]')")
        cuda = device.type == "cuda"
        apply_group_offloading(
            transformer,
            onload_device=device,
            offload_device=_HOST,
            offload_type="block_level",
            num_blocks_per_group=1,
            use_stream=cuda,
            record_stream=cuda,
            non_blocking=cuda,
        )
        transformer.flowlift_group_offload = device
    return transformer


@contextmanager
def transformer_on_device(transformer: torch.nn.Module, *, offload: str, device: torch.device) -> Iterator[None]:
    """For ``model`` offload: the whole transformer on ``device`` inside, back in host memory after (also on error).
    Other modes: nothing to do (``none`` stays, ``group`` moves block by block inside the forward)."""
    if offload != "model":
        yield
        return
    transformer.to(device)
    try:
        yield
    finally:
        transformer.to(_HOST)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def with_transformer_on_device(run: Run) -> Run:
    """Decorates a method of an object with ``transformer``, ``offload`` and ``device`` (the refiner's sampling
    loop): the method runs inside :func:`transformer_on_device`."""

    @functools.wraps(run)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        with transformer_on_device(self.transformer, offload=self.offload, device=self.device):
            return run(self, *args, **kwargs)

    return wrapped  # type: ignore[return-value]
