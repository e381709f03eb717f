"""An input's alpha channel, resized to its upscaled colour's size and put back: one filter and one arithmetic at
every door (the command line's 8- and 16-bit files, the Python API's Pillow images, the node packs' float masks).

The resize is Pillow's Lanczos on float32 samples (mode ``"F"``), clamped to the range once at the end. Pillow's own
8-bit (``"L"``) resize rounds and clips to 0..255 between its horizontal and vertical passes, so at a hard edge the
first pass's ringing is cut before the second pass sees it: an 8-bit alpha came out up to 0.1 (26/255) from the same
alpha resized in float at a disc's edge, and 0.2 on binary noise. In float every door's alpha agrees to within the
last rounding (1/255 on 8 bits).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

if TYPE_CHECKING:
    import torch

#: The filter an alpha channel is resized with to its upscaled colour's size, at every door.
ALPHA_RESAMPLING = Image.Resampling.LANCZOS


def lanczos_plane(values: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """An HW plane resized to ``size`` (width, height) with :data:`ALPHA_RESAMPLING` in float32, unclamped (the filter
    rings past both ends of the range: the caller clamps to its own); the plane itself when it has that size."""
    if (values.shape[1], values.shape[0]) == tuple(size):
        return values
    return np.asarray(Image.fromarray(values.astype(np.float32), "F").resize(size, ALPHA_RESAMPLING))


def attach_alpha(rgb: Image.Image, alpha: Image.Image | None) -> Image.Image:
    """Put an 8-bit ``alpha`` (``"L"``) back onto ``rgb``, resized to the RGB size if needed as every door resizes
    one (:func:`lanczos_plane`, then rounded once to 0..255)."""
    if alpha is None:
        return rgb
    if alpha.size != rgb.size:
        resized = lanczos_plane(np.asarray(alpha, dtype=np.float32), rgb.size)
        alpha = Image.fromarray(np.clip(np.rint(resized), 0, 255).astype(np.uint8), "L")
    out = rgb.copy()
    out.putalpha(alpha)
    return out


def resize_alpha(alpha: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """A float alpha (H, W) in [0, 1] resized to ``size`` (width, height) as :func:`attach_alpha` resizes one, in
    float32 (no rounding to 8 bits) and clamped to [0, 1] (the filter rings past both ends)."""
    import torch

    if (alpha.shape[-1], alpha.shape[-2]) == tuple(size):
        return alpha
    plane = lanczos_plane(alpha.detach().to("cpu", torch.float32).numpy(), size)
    return torch.from_numpy(np.array(plane, dtype=np.float32)).clamp_(0.0, 1.0).to(alpha.device)
