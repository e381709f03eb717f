"""Model-agnostic samplers for rectified flow, in the k-diffusion style.

A *velocity function* ``velocity_fn(x, sigma) -> v`` predicts ``v = noise - x0`` at noise level
``sigma`` (the model sees ``x = sigma * noise + (1 - sigma) * x0``). Integrating ``dx/dsigma = v`` from
the first sigma to the last gives the sample. These loops are shared by the upscaler, img2img,
inpainting and the tests; an optional :class:`~flowlift.flux2.img2img.InpaintMerger`-like object re-imposes
the known region after every step and before Heun's corrector call, so every model input is on the
kept region's trajectory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from flowlift.flux2.settings import SAMPLERS  # noqa: F401  (the one list, torch-free)

VelocityFn = Callable[[torch.Tensor, float], torch.Tensor]


class StepMerger(Protocol):
    def merge(self, x: torch.Tensor, sigma: float) -> torch.Tensor: ...


def euler_step(velocity_fn: VelocityFn, x: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
    """One Euler step: ``x_next = x + (sigma_next - sigma) * v(x, sigma)``."""
    return x + (sigma_next - sigma) * velocity_fn(x, sigma)


def heun_step(
    velocity_fn: VelocityFn,
    x: torch.Tensor,
    sigma: float,
    sigma_next: float,
    inpaint: StepMerger | None = None,
) -> torch.Tensor:
    """One Heun (trapezoidal) step; falls back to Euler when stepping to sigma = 0.

    ``d = v(x, s)``, ``x_e = x + (s' - s) d``, ``x_next = x + (s' - s) (d + v(x_e, s')) / 2``. With an
    ``inpaint`` merger the corrector's input is ``merge(x_e, s')``, so the model sees the kept region on
    its trajectory ``s' * noise + (1 - s') * init`` at every call (as ComfyUI's inpaint wrapper does).
    """
    velocity = velocity_fn(x, sigma)
    x_euler = x + (sigma_next - sigma) * velocity
    if sigma_next == 0:
        return x_euler
    corrector_input = inpaint.merge(x_euler, sigma_next) if inpaint is not None else x_euler
    return x + (sigma_next - sigma) * 0.5 * (velocity + velocity_fn(corrector_input, sigma_next))


def denoise(
    velocity_fn: VelocityFn,
    x: torch.Tensor,
    sigmas: Sequence[float] | torch.Tensor,
    inpaint: StepMerger | None = None,
    callback: Callable[[int, float, float, torch.Tensor], None] | None = None,
    sampler: str = "euler",
) -> torch.Tensor:
    """Integrate ``x`` along ``sigmas`` (decreasing) with ``sampler`` ("euler" or "heun").

    After each step from ``s`` to ``s'`` the optional ``inpaint`` merger re-imposes the known region
    at ``s'``, and ``callback(step_index, s, s', x)`` is called. Heun's corrector input is merged too,
    so every model input's kept region is ``s * noise + (1 - s) * init`` (Euler's inputs already are).
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; choose one of {', '.join(SAMPLERS)}")
    values = [float(s) for s in (sigmas.tolist() if isinstance(sigmas, torch.Tensor) else sigmas)]
    for index, (sigma, sigma_next) in enumerate(zip(values[:-1], values[1:], strict=True)):
        if sampler == "euler":
            x = euler_step(velocity_fn, x, sigma, sigma_next)
        else:
            x = heun_step(velocity_fn, x, sigma, sigma_next, inpaint)
        if inpaint is not None:
            x = inpaint.merge(x, sigma_next)
        if callback is not None:
            callback(index, sigma, sigma_next, x)
    return x
