"""Checking a user's ``--device`` once, up front, instead of failing deep inside torch with a traceback."""

from __future__ import annotations

import torch

from flowlift.errors import FlowliftError


def resolve_device(setting: str | torch.device | None) -> torch.device:
    """``None``/``"auto"`` -> CUDA if available else CPU; otherwise the named device, checked to exist.

    Raises :class:`FlowliftError` for a name torch does not know (``bogus``), for CUDA/MPS/XPU when that
    backend is not available, and for a device index past the number of devices.
    """
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
