"""FLUX.2 sigma schedules: the empirical shift, the exponential time shift, and clipping.

FLUX.2 runs rectified flow from sigma = 1 (pure noise) to sigma = 0 (data) on a *shifted* schedule:
linear sigmas ``1 -> 1/N`` are pushed towards 1 by :func:`time_shift_flux2` with a ``mu`` that grows
with the image's token count (:func:`compute_empirical_mu`). img2img and inpainting run a *part* of
that same schedule: :func:`flux2_sigmas` shifts the full schedule first, then clips it to
``[1 - denoising_end, 1 - denoising_start]``, so the model is only ever evaluated at sigmas it was
trained to see (running img2img on the unshifted linear schedule leaves a grainy residue).
"""

from __future__ import annotations

import math

import torch

_A1, _B1 = 8.73809524e-05, 1.89833333  # the 10-step line
_A2, _B2 = 0.00016927, 0.45666666  # the 200-step line


def compute_empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """FLUX.2's schedule shift ``mu`` for a token count and step count (diffusers' form).

    Above 4300 tokens: ``mu = a2 * seq + b2``. Otherwise the value is interpolated linearly in
    ``num_steps`` between the 10-step line ``a1 * seq + b1`` and the 200-step line ``a2 * seq + b2``.
    """
    m_200 = _A2 * image_seq_len + _B2
    if image_seq_len > 4300:
        return float(m_200)
    m_10 = _A1 * image_seq_len + _B1
    slope = (m_200 - m_10) / 190.0
    return float(slope * num_steps + (m_200 - 200.0 * slope))


def time_shift_flux2(mu: float, t: torch.Tensor | float) -> torch.Tensor | float:
    """Exponential time shift ``exp(mu) / (exp(mu) + (1/t - 1))``, with t = 0 -> 0 and t = 1 -> 1.

    This is diffusers' ``_time_shift_exponential(mu, 1.0, t)``, the shift its
    ``FlowMatchEulerDiscreteScheduler(time_shift_type="exponential")`` applies for FLUX.2.
    """
    e = math.exp(mu)
    if isinstance(t, torch.Tensor):
        safe = torch.where(t > 0, t, torch.ones_like(t))
        return torch.where(t > 0, e / (e + (1.0 / safe - 1.0)), torch.zeros_like(t))
    return 0.0 if t <= 0 else e / (e + (1.0 / t - 1.0))


def flux2_sigmas(
    num_steps: int,
    image_seq_len: int,
    denoising_start: float = 0.0,
    denoising_end: float = 1.0,
) -> torch.Tensor:
    """The shifted FLUX.2 sigma schedule, clipped to a denoising window (1-D float32, decreasing).

    1. linear sigmas ``linspace(1, 1/N, N)``;
    2. shifted by :func:`time_shift_flux2` with ``mu = compute_empirical_mu(image_seq_len, N)``
       (always the *full* schedule's mu), and a final 0 appended;
    3. clipped: the result starts exactly at ``1 - denoising_start`` and ends exactly at
       ``1 - denoising_end``; the shifted schedule's own points strictly between are kept.

    With start 0 and end 1 this equals diffusers' ``FlowMatchEulerDiscreteScheduler(
    use_dynamic_shifting=True, time_shift_type="exponential")`` sigmas after
    ``set_timesteps(sigmas=linspace(1, 1/N, N), mu=mu)``. ``1 - denoising_start`` is also the noise
    level ``t0`` of img2img start latents.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if not 0.0 <= denoising_start < denoising_end <= 1.0:
        raise ValueError(
            f"need 0 <= denoising_start < denoising_end <= 1, got {denoising_start} and {denoising_end}"
        )
    mu = compute_empirical_mu(image_seq_len, num_steps)
    linear = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64)
    shifted = torch.cat([time_shift_flux2(mu, linear), torch.zeros(1, dtype=torch.float64)]).to(torch.float32)
    # Clip in float32, the dtype the schedule is used in, so the kept points are the scheduler's own.
    high = torch.tensor(1.0 - denoising_start, dtype=torch.float32)
    low = torch.tensor(1.0 - denoising_end, dtype=torch.float32)
    inside = shifted[(shifted < high) & (shifted > low)]
    return torch.cat([high.view(1), inside, low.view(1)])


def linear_denoising_start(strength: float) -> float:
    """img2img strength -> denoising_start, the plain map ``1 - strength``."""
    _check_strength(strength)
    return 1.0 - strength


def canvas_denoising_start(strength: float) -> float:
    """img2img strength -> denoising_start, the canvas ("optimized denoising") map ``1 - strength**0.2``."""
    _check_strength(strength)
    return 1.0 - strength**0.2


def _check_strength(strength: float) -> None:
    if not 0.0 <= strength <= 1.0:
        raise ValueError(f"strength must be in [0, 1], got {strength}")
