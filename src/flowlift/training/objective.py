"""The pure maths of a training step: the rectified-flow loss, the learning-rate schedule, the EMA
of the weights and the dropout seeds.

Each is a function of its arguments only (no data, no devices, no files), so the trainer's loop and
the tests use the same formulas; the objective itself is stated in :mod:`flowlift.training.trainer`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def interpolate_flow(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``x_t = (1 - t) * x0 + t * noise`` with ``t`` of shape (B,) broadcast over (C, H, W)."""
    t = t.view(-1, *([1] * (x0.ndim - 1))).to(x0.dtype)
    return (1 - t) * x0 + t * noise


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The rectified-flow velocity ``v* = noise - x0`` (``dx_t/dt``)."""
    return noise - x0


def flow_matching_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``mean((v(x_t, 1000 t, cond) - (noise - x0))^2)`` over all elements of the batch."""
    x0, noise, cond, t = batch["target"], batch["noise"], batch["cond"], batch["t"]
    x_t = interpolate_flow(x0, noise, t)
    prediction = model(x_t, t * 1000.0, cond)
    return F.mse_loss(prediction.float(), velocity_target(x0, noise).float())


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> float:
    """Learning-rate multiplier at optimizer step ``step`` (0-based).

    Linear warm-up ``(step + 1) / warmup_steps`` for ``step < warmup_steps``, then cosine decay
    ``min_ratio + (1 - min_ratio) * (1 + cos(pi * p)) / 2`` with
    ``p = (step - warmup_steps) / max(1, total_steps - warmup_steps)`` clipped to [0, 1].
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, max(0.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def ema_decay_at(num_averaged: int, decay: float, warmup: bool) -> float:
    """EMA decay for the update after ``num_averaged`` updates: ``min(decay, (1 + n) / (10 + n))``
    with warm-up, else ``decay``."""
    return min(decay, (1.0 + num_averaged) / (10.0 + num_averaged)) if warmup else decay


def make_ema(model: torch.nn.Module, decay: float, warmup: bool) -> torch.optim.swa_utils.AveragedModel:
    """An :class:`~torch.optim.swa_utils.AveragedModel` doing ``ema <- d * ema + (1 - d) * w``
    with ``d = ema_decay_at(n, decay, warmup)`` (parameters and buffers)."""

    def multi_avg_fn(ema_params, model_params, num_averaged) -> None:
        d = ema_decay_at(int(num_averaged), decay, warmup)
        for e, p in zip(ema_params, model_params, strict=True):
            e.lerp_(p.to(e.dtype), 1.0 - d)

    return torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=multi_avg_fn, use_buffers=True)


def step_seed(seed: int, step: int, micro: int, rank: int) -> int:
    """Seed of the global torch generator (dropout) for one micro-batch on one rank."""
    return (seed * 1_000_003 + step * 7919 + micro * 104_729 + rank * 15_485_863) % (2**62)


def sample_seed(seed: int, position: int) -> int:
    """Dropout seed of the sample at global stream ``position`` (the same on any rank or micro-batch)."""
    return (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + 7) % (2**62)


def logistic(z: float) -> float:
    """``1 / (1 + exp(-z))``, for any finite ``z``: as ``exp(z) / (1 + exp(z))`` far below 0, where ``exp(-z)``
    would overflow (``t_mean = -710`` raised OverflowError); the first form wherever it is finite, so the samples
    of every run that worked are the same bits."""
    if z > -700.0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)
