"""Checking a user's ``--device`` and ``--dtype`` once, up front, instead of failing deep inside torch."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from flowlift.errors import FlowliftError

if TYPE_CHECKING:
    import torch

#: The ``--dtype`` choices of every command and the web app.
DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_device(setting: str | torch.device | None) -> torch.device:
    """``None``/``"auto"`` -> CUDA if available else CPU; otherwise the named device, checked to exist.

    Raises :class:`FlowliftError` for a name torch does not know (``bogus``), for CUDA/MPS/XPU when that
    backend is not available, and for a device index past the number of devices.
    """
    import torch  # here, not at import: the command line's start-up stays fast

    if setting is None or (isinstance(setting, str) and setting.strip().lower() == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(setting.strip() if isinstance(setting, str) else setting)
    except (RuntimeError, TypeError, ValueError):
        raise FlowliftError(f"{str(setting)!r} is not a torch device (use auto, cpu, cuda, cuda:N or mps)") from None
    if device.type == "meta":
        raise FlowliftError("device 'meta' holds no data; use auto, cpu, cuda, cuda:N or mps")
    if device.type == "cpu":
        return device
    backend = getattr(torch, device.type, None)
    available = getattr(backend, "is_available", None)
    if not callable(available) or not available():
        raise FlowliftError(
            f"device {str(device)!r} requested, but {device.type.upper()} is not available on this machine"
        )
    count = getattr(backend, "device_count", None)
    if device.index is not None and callable(count) and device.index >= count():
        raise FlowliftError(f"device {str(device)!r} requested, but this machine has {count()} {device.type} device(s)")
    return device


def resolve_device_option(device: str | None, option: str = "--device") -> torch.device:
    """:func:`resolve_device` for a command-line option: a bad value is one FlowliftError line naming it."""
    try:
        return resolve_device(device)  # unknown names, missing backends, indices past the device count
    except FlowliftError as error:
        raise FlowliftError(f"{option} {device}: {error}") from None


def default_dtype(device: torch.device | str) -> torch.dtype:
    """The one ``--dtype auto`` rule every front-end and pipeline uses: bfloat16 on CUDA, else float32."""
    import torch

    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def resolve_device_dtype(device: str | None, dtype: str | None) -> tuple[torch.device, torch.dtype]:
    """``(torch.device, torch.dtype)`` from the option values; one FlowliftError line for a bad device.

    float16 on the CPU is allowed but warned about: the CPU has no fast float16 kernels, so it runs many
    times slower than float32 and gains nothing.
    """
    import torch

    dev = resolve_device_option(device)
    if dtype in (None, "auto"):
        dt = default_dtype(dev)
    elif dtype in DTYPES:
        dt = getattr(torch, dtype)
    else:
        raise FlowliftError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    if dev.type == "cpu" and dt == torch.float16:
        warnings.warn(
            "--dtype float16 on the CPU runs many times slower than float32 (no fast CPU float16 kernels) "
            "and is no more accurate; use float32 (the default) or bfloat16",
            UserWarning,
            stacklevel=2,
        )
    return dev, dt
