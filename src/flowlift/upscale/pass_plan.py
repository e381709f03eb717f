"""How one UNet pass of an upscale runs within ``max_memory``: plain, chunked (the exact row-strip executor with its
full-frame stores on the device) or offloaded (the stores off the device, in host memory), and the caller's
explicit ``chunked`` / ``chunk_rows`` / ``offload_device`` held and checked against the budget.

The budget bounds the device the UNet runs on. Stores count against it wherever they stay on that device: in
``chunked`` mode, and in every mode when there is no other memory to put them in (a CPU run, whose host memory is
the device's; or an explicit ``offload_device`` that is the compute device itself, which the executor then treats
as no offload at all). :func:`stores_can_leave` says which; a plan never takes the ``offload`` mode where they cannot
leave, and an explicit choice that then does not fit is one line naming both knobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flowlift.errors import FIELD_MARK, FlowliftError
from flowlift.limits import LATENT_CHANNELS, dtype_bytes, format_bytes
from flowlift.upscale.chunked.budget import (
    MIN_DEVICE_STRIP_ROWS,
    chunked_store_bytes,
    plain_peak_bytes,
    strip_bytes_per_row,
    strip_rows_for_budget,
)

__all__ = ["StoreSite", "UNetPassPlan", "pass_io_bytes", "plan_unet_pass", "stores_can_leave"]


def pass_io_bytes(height: int, width: int, *, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
    """A pass's latent tensors besides the UNet's activations, and stage 1 (the latent colour fix).

    The noise and the velocity in the UNet's dtype, ``x0`` and stage 1's float32 result, the small
    conditioning in float32 and the UNet's dtype (a quarter frame each):
    ``b * 32 * h * w * (2 * itemsize + 2 * 4 + (4 + itemsize) / 4)``.
    """
    latent = batch * LATENT_CHANNELS * height * width
    itemsize = dtype_bytes(dtype)
    return int(latent * (2 * itemsize + 2 * 4 + (4 + itemsize) / 4))


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are one memory: same type and index (an index left out is the current one)."""

    def index(device: torch.device) -> int:
        if device.index is not None:
            return device.index
        if device.type == "cuda" and torch.cuda.is_available():
            return torch.cuda.current_device()
        return 0

    return a.type == b.type and index(a) == index(b)


def stores_can_leave(device: Any, offload_device: Any = None) -> bool:
    """Whether a pass in strips can keep its stores off ``device`` (the one the budget bounds): on the explicit
    ``offload_device`` when given, else on the host (the executor's ``"cpu"``), so False on a CPU run."""
    target = torch.device("cpu" if offload_device is None else offload_device)
    return not _same_device(torch.device(device), target)


@dataclass(frozen=True)
class StoreSite:
    """Where a pass in strips may keep its full-frame stores: ``can_leave`` (off the budgeted device, the
    ``offload`` mode) and the caller's explicit ``offload_device`` (None: not given), named where it keeps them on
    the device and that does not fit."""

    can_leave: bool = True
    offload_device: str | None = None

    def pinned_by_knob(self) -> bool:
        """Whether the caller's ``offload_device`` is what keeps the stores on the device."""
        return not self.can_leave and self.offload_device is not None


@dataclass(frozen=True)
class UNetPassPlan:
    """How one UNet pass runs: ``mode`` (plain / chunked / offload), rows per strip, estimated peak."""

    mode: str
    height: int
    width: int
    strip_rows: int | None
    peak_bytes: int


def plan_unet_pass(
    height: int,
    width: int,
    budget_bytes: int,
    *,
    batch: int = 1,
    base_channels: int = 384,
    dtype: torch.dtype = torch.float32,
    fixed_bytes: int = 0,
    chunked: bool | None = None,
    chunk_rows: int | None = None,
    stores: StoreSite = StoreSite(),
) -> UNetPassPlan:
    """The fastest way to run one pass (output latent ``height x width``) within ``budget_bytes``.

    ``fixed_bytes`` (weights, the pass's latent tensors) is taken off the budget first. Plain when
    :func:`plain_peak_bytes` fits; else chunked when the stores fit and leave at least
    ``MIN_DEVICE_STRIP_ROWS`` rows of strip (one row where ``stores`` cannot leave the device); else offload with
    strips from the whole remainder, where ``stores.can_leave``; else one FlowliftError line. ``chunked``
    (MemoryPolicy's explicit mode): False holds the pass plain (one line naming it when that does not fit), True
    never plain. ``chunk_rows`` (MemoryPolicy's explicit strip height): a pass in strips takes that many rows
    (:func:`_held_strips`).
    """
    sizes = {"batch": batch, "base_channels": base_channels, "dtype": dtype}
    free = budget_bytes - fixed_bytes
    plain = plain_peak_bytes(height, width, **sizes)
    if plain <= free and not chunked:
        return UNetPassPlan("plain", height, width, None, fixed_bytes + plain)
    if chunked is False:
        raise FlowliftError(
            f"{FIELD_MARK} {format_bytes(budget_bytes)} is too small for the whole-frame UNet pass to a "
            f"{width}x{height} latent (batch {batch}) that {FIELD_MARK} forces (about "
            f"{format_bytes(fixed_bytes + plain)}): drop {FIELD_MARK} to let the plan run it in strips",
            field=("max_memory", "chunked=False", "chunked=False"),
        )
    per_row = strip_bytes_per_row(width, **sizes)
    store_bytes = chunked_store_bytes(height, width, **sizes)
    if chunk_rows is not None:
        frame = (height, width, batch)
        return _held_strips(frame, chunk_rows, fixed_bytes, (store_bytes, per_row), budget_bytes, stores)
    rows = strip_rows_for_budget(free, height, width, offloaded=False, **sizes)
    least = MIN_DEVICE_STRIP_ROWS if stores.can_leave else 1
    if free - store_bytes >= (least + 2) * per_row:
        return UNetPassPlan("chunked", height, width, rows, fixed_bytes + store_bytes + (rows + 2) * per_row)
    if not stores.can_leave or free < 3 * per_row:
        kept = 0 if stores.can_leave else store_bytes
        need = fixed_bytes + kept + 3 * per_row
        raise FlowliftError(
            f"{FIELD_MARK} {format_bytes(budget_bytes)} is too small for a {width}x{height}-latent UNet pass "
            f"(batch {batch}): even {_where(stores)} with one-row strips it needs about {format_bytes(need)}"
            + _unpin(stores),
            field=("max_memory", "offload_device", "offload_device") if stores.pinned_by_knob() else "max_memory",
        )
    rows = strip_rows_for_budget(free, height, width, offloaded=True, **sizes)
    return UNetPassPlan("offload", height, width, rows, fixed_bytes + (rows + 2) * per_row)


def _where(stores: StoreSite) -> str:
    """Where the leanest strips keep the stores, in a refusal's words."""
    if stores.can_leave:
        return "offloaded"
    if stores.offload_device is not None:
        return f"with its stores on {FIELD_MARK}={stores.offload_device}, the device the budget bounds,"
    return "with its stores on the device (a CPU run has no other memory to offload them to)"


def _unpin(stores: StoreSite) -> str:
    """The fix a refusal ends on where the caller's ``offload_device`` keeps the stores on the device."""
    return f"; drop {FIELD_MARK} to let the plan offload them to the host" if stores.pinned_by_knob() else ""


def _held_strips(
    frame: tuple[int, int, int],
    rows: int,
    fixed_bytes: int,
    sizes: tuple[int, int],
    budget_bytes: int,
    stores: StoreSite,
) -> UNetPassPlan:
    """A pass (``frame``: latent height, width, batch) in the caller's strips of ``rows``: chunked where its stores and
    strips (``sizes``: their bytes, a row's) fit, else offloaded where ``stores`` can leave the device, else one line
    giving the most rows that fit (naming ``offload_device`` too where it keeps the stores on the device)."""
    (height, width, batch), (store_bytes, per_row) = frame, sizes
    strip = (min(rows, height) + 2) * per_row  # the executor's strips are at most the frame's rows
    modes = (("chunked", store_bytes), ("offload", 0)) if stores.can_leave else (("chunked", store_bytes),)
    for mode, on_device in modes:
        if fixed_bytes + on_device + strip <= budget_bytes:
            return UNetPassPlan(mode, height, width, rows, fixed_bytes + on_device + strip)
    kept = modes[-1][1]
    fits = (budget_bytes - fixed_bytes - kept) // per_row - 2
    fix = f"lower {FIELD_MARK} to at most {fits}" if fits >= 1 else f"drop {FIELD_MARK} and raise the budget"
    fields: tuple[str, ...] = ("max_memory", "chunk_rows", "chunk_rows")
    if stores.pinned_by_knob():
        fields = ("max_memory", "chunk_rows", "offload_device", "chunk_rows", "offload_device")
    raise FlowliftError(
        f"{FIELD_MARK} {format_bytes(budget_bytes)} is too small for the UNet pass to a {width}x{height} latent "
        f"(batch {batch}) in strips of {FIELD_MARK}={rows} rows (about {format_bytes(fixed_bytes + kept + strip)} "
        f"even {_where(stores)}): {fix}{_unpin(stores)}",
        field=fields,
    )
