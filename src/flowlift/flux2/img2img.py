"""img2img and inpainting start latents for FLUX.2, built in normalized space.

The FLUX.2 transformer works on normalized latents, in which the noise it expects is N(0, 1). Two
bugs posterize real FLUX.2 img2img output and must never come back:

1. blending noise and init latents in *raw* space and normalizing the mixture divides the noise by
   ``bn_std`` (~1.77 on the real VAE: only ~57% of the nominal noise) — :func:`prepare_start_latents`
   normalizes only the init latents;
2. running img2img on an unshifted linear schedule — use :func:`flowlift.flux2.schedule.flux2_sigmas`.
"""

from __future__ import annotations

import torch

from flowlift.flux2.latents import normalize
from flowlift.flux2.sampling import denoise  # noqa: F401  (the sampling loop img2img runs; re-exported)


def prepare_start_latents(
    init_latents: torch.Tensor,
    noise: torch.Tensor,
    t0: float,
    bn_mean: torch.Tensor | None = None,
    bn_std: torch.Tensor | None = None,
    add_noise: bool = True,
) -> torch.Tensor:
    """Start latents at noise level ``t0``: ``t0 * noise + (1 - t0) * normalize(init_latents)``.

    With BN stats, ``init_latents`` are *raw* VAE latents (32- or 128-channel) and only they are
    normalized; ``noise`` is unit-scale noise in normalized space and is never rescaled. Without BN
    stats the blend ``t0 * noise + (1 - t0) * init_latents`` happens in the latents' own space (VAEs
    that expose no statistics). ``add_noise=False`` returns the (normalized) init latents, as used for
    reference images.
    """
    if not 0.0 <= t0 <= 1.0:
        raise ValueError(f"t0 must be in [0, 1], got {t0}")
    if (bn_mean is None) != (bn_std is None):
        raise ValueError("pass both bn_mean and bn_std, or neither")
    clean = normalize(init_latents, bn_mean, bn_std) if bn_mean is not None else init_latents
    if not add_noise:
        return clean
    if noise.shape != clean.shape:
        raise ValueError(f"noise shape {tuple(noise.shape)} != latents shape {tuple(clean.shape)}")
    return t0 * noise + (1.0 - t0) * clean


class InpaintMerger:
    """Keeps the known region on the flow trajectory during inpainting and outpainting.

    ``init_latents`` are normalized, ``mask`` is 1 where the model regenerates (broadcastable to the
    latents), and ``noise`` is the *same* unit-scale noise the start latents were built from. After a
    step to ``sigma``: ``x = mask * x + (1 - mask) * (sigma * noise + (1 - sigma) * init)``.
    """

    def __init__(self, init_latents: torch.Tensor, mask: torch.Tensor, noise: torch.Tensor) -> None:
        if noise.shape != init_latents.shape:
            raise ValueError(f"noise shape {tuple(noise.shape)} != latents shape {tuple(init_latents.shape)}")
        self.init_latents = init_latents
        self.mask = mask.to(init_latents.dtype)
        self.noise = noise

    def renoised_init(self, sigma: float) -> torch.Tensor:
        """The init latents re-noised to ``sigma`` with the stored noise."""
        return sigma * self.noise + (1.0 - sigma) * self.init_latents

    def merge(self, x: torch.Tensor, sigma: float) -> torch.Tensor:
        return self.mask * x + (1.0 - self.mask) * self.renoised_init(sigma)


def gaussian_flow_velocity(x: torch.Tensor, sigma: float, mean: float, std: float) -> torch.Tensor:
    """Exact rectified-flow velocity for data ``x0 ~ N(mean, std^2)`` (elementwise), an oracle model.

    With ``x = sigma * eps + (1 - sigma) * x0`` and ``var = (1 - sigma)^2 std^2 + sigma^2``:
    ``E[x0 | x] = mean + (1 - sigma) std^2 (x - (1 - sigma) mean) / var``,
    ``E[eps | x] = sigma (x - (1 - sigma) mean) / var``, and ``v = E[eps | x] - E[x0 | x]``.
    Integrating it from correctly noised start latents returns data with exactly this mean and std.
    """
    centred = x - (1.0 - sigma) * mean
    var = (1.0 - sigma) ** 2 * std**2 + sigma**2
    expected_x0 = mean + (1.0 - sigma) * std**2 * centred / var
    expected_eps = sigma * centred / var
    return expected_eps - expected_x0
