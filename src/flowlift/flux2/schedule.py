"""FLUX.2 sigma schedules: the shift ``mu``, the exponential time shift and its inverse, the window.

FLUX.2 runs rectified flow from sigma = 1 (pure noise) to sigma = 0 (data) on a *shifted* schedule:
linear sigmas ``1 -> 1/N`` are pushed towards 1 by :func:`time_shift_flux2`. The shift ``mu`` is a fixed
2.02 by default (:data:`DEFAULT_MU`: InvokeAI's and ComfyUI's FLUX.2 default, the founding document's
table), or ``"empirical"``: diffusers' :func:`compute_empirical_mu`, which grows with the token count.
img2img and inpainting run a *window* of that same schedule, ``[1 - denoising_end, 1 - denoising_start]``
(:func:`flux2_sigmas`): ``clipped`` keeps only the shifted points inside it (diffusers' img2img
pipelines), ``respaced`` puts ``num_steps`` steps in it, evenly spaced before the shift
(:func:`respaced_window`), so a low strength still gets every step. Either way the model is evaluated
only at shifted sigmas (running img2img on the unshifted linear schedule leaves a grainy residue).
"""

from __future__ import annotations

import math
from numbers import Real

import torch

from flowlift.errors import FIELD_MARK, FlowliftError
from flowlift.flux2.settings import DEFAULT_MU, EMPIRICAL_MU, MU_RANGE, SCHEDULES  # noqa: F401
from flowlift.knobs import exact_int

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


def inverse_time_shift_flux2(mu: float, s: torch.Tensor | float) -> torch.Tensor | float:
    """The unshifted sigma of a shifted one: ``t = 1 / (exp(mu) (1/s - 1) + 1)``, with s = 0 -> 0.

    Solves ``s = exp(mu) / (exp(mu) + (1/t - 1))`` for t: ``1/s - 1 = (1/t - 1) / exp(mu)``.
    """
    e = math.exp(mu)
    if isinstance(s, torch.Tensor):
        safe = torch.where(s > 0, s, torch.ones_like(s))
        return torch.where(s > 0, 1.0 / (e * (1.0 / safe - 1.0) + 1.0), torch.zeros_like(s))
    return 0.0 if s <= 0 else 1.0 / (e * (1.0 / s - 1.0) + 1.0)


def resolve_mu(mu: float | str, image_seq_len: int, num_steps: int) -> float:
    """The number a schedule shifts with: ``mu`` itself, or for ``"empirical"``
    ``compute_empirical_mu(image_seq_len, num_steps)`` (the full sequence length and step count).

    Refused (:class:`FlowliftError`, naming ``mu``): another string, a non-finite number, or a value outside
    :data:`MU_RANGE` (the empirical formula leaves it above about 4700 px square: 44.8 at 8192 px).
    """
    if isinstance(mu, str):
        if mu != EMPIRICAL_MU:
            raise FlowliftError(f"mu must be a number or {EMPIRICAL_MU!r}, got {mu!r}", field="mu")
        value = compute_empirical_mu(image_seq_len, num_steps)
        origin = f"mu='empirical' gives {value:.4g} at {image_seq_len} tokens, which is "
    else:
        value = float(mu)
        origin = f"mu {value:g} is "
        if not math.isfinite(value):
            raise FlowliftError(f"mu must be a finite number, got {mu}", field="mu")
    low, high = MU_RANGE
    if not low <= value <= high:
        raise FlowliftError(f"{origin}outside [{low:g}, {high:g}]; give a fixed mu such as {DEFAULT_MU}", field="mu")
    return value


def respaced_window(mu: float, high: float, low: float, num_steps: int) -> torch.Tensor:
    """``num_steps`` steps from sigma ``high`` down to ``low``, evenly spaced in *unshifted* sigma (float64).

    ``u_k = u_high + (u_low - u_high) k / N`` for k = 0..N, with ``u = inverse_time_shift_flux2(mu, s)``,
    then ``s_k = time_shift_flux2(mu, u_k)``; the endpoints are set to ``high`` and ``low`` exactly (the
    round trip through the shift need not be exact). Decreasing because the shift is increasing.
    """
    u_high = inverse_time_shift_flux2(mu, high)
    u_low = inverse_time_shift_flux2(mu, low)
    unshifted = torch.linspace(u_high, u_low, num_steps + 1, dtype=torch.float64)
    sigmas = time_shift_flux2(mu, unshifted)
    sigmas[0], sigmas[-1] = high, low
    return sigmas


#: The most steps a schedule is built with: 100x a refine's own limit (``refine.settings.MAX_STEPS``), room for a
#: many-step reference solution, and a few megabytes at most.
MAX_SCHEDULE_STEPS = 100_000


def flux2_sigmas(
    num_steps: int,
    image_seq_len: int,
    denoising_start: float = 0.0,
    denoising_end: float = 1.0,
    *,
    mu: float | str = DEFAULT_MU,
    schedule: str = "respaced",
) -> torch.Tensor:
    """The shifted FLUX.2 sigma schedule of a denoising window (1-D float32, strictly decreasing).

    1. linear sigmas ``linspace(1, 1/N, N)``;
    2. shifted by :func:`time_shift_flux2` with ``mu`` (:func:`resolve_mu`: a number, default
       :data:`DEFAULT_MU`, or ``"empirical"`` from the *full* sequence length and step count), a final 0
       appended;
    3. clipped: the window starts exactly at ``1 - denoising_start`` and ends exactly at
       ``1 - denoising_end``; the shifted schedule's own points strictly between are kept;
    4. ``schedule="respaced"`` only: if the clipped window holds fewer than N steps, it is replaced by
       :func:`respaced_window` (N steps evenly spaced in unshifted sigma, the same mu, the same
       endpoints). A window that holds N or more steps (txt2img, strength 1) is the clipped one, bit for
       bit. ``"clipped"`` keeps step 3's window (diffusers' img2img pipelines).

    With start 0 and end 1 and ``mu="empirical"`` this equals diffusers' ``FlowMatchEulerDiscreteScheduler(
    use_dynamic_shifting=True, time_shift_type="exponential")`` sigmas after
    ``set_timesteps(sigmas=linspace(1, 1/N, N), mu=compute_empirical_mu(seq, N))``. ``1 - denoising_start``
    is also the noise level ``t0`` of img2img start latents. A schedule whose float32 sigmas would repeat
    (a shift too strong for the step count) is refused rather than run with zero-length steps.
    """
    for name, value in (("num_steps", num_steps), ("image_seq_len", image_seq_len)):
        if (exact_int(value) or 0) < 1:  # not True, 2.5, NaN or "4"
            raise FlowliftError(f"{name} must be a whole number >= 1, got {value!r}", field=name)
    if num_steps > MAX_SCHEDULE_STEPS:  # 10**9 steps: gigabytes of float64 sigmas, then the process killed
        raise FlowliftError(f"num_steps must be at most {MAX_SCHEDULE_STEPS}, got {num_steps!r}", field="num_steps")
    for name, value in (("denoising_start", denoising_start), ("denoising_end", denoising_end), ("mu", mu)):
        if isinstance(value, bool) or not isinstance(value, (Real, str) if name == "mu" else Real):
            raise FlowliftError(f"{name} must be a number, got {value!r}", field=name)
    denoising_start, denoising_end = float(denoising_start), float(denoising_end)  # numpy's float32 too
    if not 0.0 <= denoising_start < denoising_end <= 1.0:
        raise FlowliftError(
            f"need 0 <= {FIELD_MARK} < {FIELD_MARK} <= 1, got {denoising_start} and {denoising_end}",
            field=("denoising_start", "denoising_end"),
        )
    if schedule not in SCHEDULES:
        raise FlowliftError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}", field="schedule")
    mu = resolve_mu(mu, image_seq_len, num_steps)
    linear = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64)
    shifted = torch.cat([time_shift_flux2(mu, linear), torch.zeros(1, dtype=torch.float64)]).to(torch.float32)
    # Clip in float32, the dtype the schedule is used in, so the kept points are the scheduler's own.
    high = torch.tensor(1.0 - denoising_start, dtype=torch.float32)
    low = torch.tensor(1.0 - denoising_end, dtype=torch.float32)
    inside = shifted[(shifted < high) & (shifted > low)]
    sigmas = torch.cat([high.view(1), inside, low.view(1)])
    if schedule == "respaced" and len(sigmas) - 1 < num_steps:
        # its float64 endpoints are exactly 1 - start and 1 - end, so in float32 they are ``high`` and ``low``
        sigmas = respaced_window(mu, 1.0 - denoising_start, 1.0 - denoising_end, num_steps).to(torch.float32)
    repeated = sigmas[1:] >= sigmas[:-1]
    if bool(repeated.any()):
        at = float(sigmas[int(repeated.nonzero()[0])])
        raise FlowliftError(
            f"mu {mu:.4g} with {num_steps} steps repeats sigma {at:.9g} in float32 (steps of zero length); "
            "use fewer steps or a smaller mu"
        )
    return sigmas


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
        raise FlowliftError(f"strength must be in [0, 1], got {strength}", field="strength")
