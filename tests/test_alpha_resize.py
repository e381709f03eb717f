"""An 8-bit alpha (the command line's PNGs, the Python API's RGBA images) is resized as the float one is: Pillow's own
8-bit Lanczos clipped its first pass's ringing to 0..255 before the second pass, so a hard edge's alpha came out up
to 0.1 from the float path (0.2 on binary noise); now both resize in float and differ by the last rounding only."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from flowlift.files.alpha import attach_alpha, resize_alpha
from flowlift.files.sixteen_bit import resize_alpha16


def _alphas() -> dict[str, np.ndarray]:
    rows, columns = np.mgrid[:48, :64]
    return {
        "disc": (((rows - 24) ** 2 + (columns - 32) ** 2) < 200).astype(np.uint8) * 255,
        "checker": (((rows // 8) + (columns // 8)) % 2).astype(np.uint8) * 255,
        "binary noise": (np.random.default_rng(0).random((48, 64)) > 0.5).astype(np.uint8) * 255,
    }


@pytest.mark.parametrize("scale", [2, 3, 4])
def test_the_8_bit_alpha_is_the_float_alpha_rounded(scale):
    size = (64 * scale, 48 * scale)
    for name, alpha in _alphas().items():
        eight = np.asarray(attach_alpha(Image.new("RGB", size), Image.fromarray(alpha, "L")))[..., 3] / 255.0
        floating = resize_alpha(torch.from_numpy(alpha / np.float32(255)), size).numpy()
        assert np.abs(eight - floating).max() <= 0.5 / 255 + 1e-6, name  # one rounding to 8 bits
        sixteen = resize_alpha16(alpha.astype(np.uint16) * 257, size) / 65535.0
        assert np.abs(sixteen - floating).max() <= 0.5 / 65535 + 1e-6, name
        assert eight.min() == 0.0 and eight.max() == 1.0  # the rings past both ends: clamped once, at the end


def test_an_alpha_of_the_colours_size_is_kept_as_it_is():
    alpha = Image.fromarray(_alphas()["disc"], "L")
    out = attach_alpha(Image.new("RGB", alpha.size), alpha)
    assert np.array_equal(np.asarray(out)[..., 3], np.asarray(alpha)) and out.mode == "RGBA"
