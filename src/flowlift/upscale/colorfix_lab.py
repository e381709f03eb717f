"""sRGB <-> CIE L*a*b* (D65) for stage 2 of the colour fix, and stage 2's per-pixel step, at the memory's rate.

The conversions are the ones kornia's ``rgb_to_lab`` / ``lab_to_rgb(clip=True)`` compute (the same constants,
thresholds and branches), written so that stage 2's full-resolution step takes few passes over memory:

- the reference white is folded into the two 3x3 matrices, each applied as one small matrix product;
- adding a L*a*b* correction ``c`` is done in the cube-root domain ``f = (f_x, f_y, f_z)``, where
  ``L = 116 f_y - 16``, ``a = 500 (f_x - f_y)``, ``b = 200 (f_y - f_z)`` make it the linear map
  :func:`lab_delta_to_f` (``f_y += c_L / 116``, ``f_x += c_L / 116 + c_a / 500``, ``f_z += c_L / 116 - c_b / 200``),
  which commutes with the bilinear upsampling of the coarse correction;
- each step runs on row strips small enough to stay in the CPU's caches, on the CPU in one thread
  (:func:`flowlift.devices.one_thread`): these are short element-wise operations, where a second OpenMP
  thread mostly waits at each operation's barrier, and on a machine shared with other jobs spins there:
  measured at 6 MP, 1.0-1.3 CPU-seconds in one thread against 4.4-12 with two (and more wall time too) at
  load 10.

The results equal kornia's to float32 rounding (``tests/test_colorfix.py``).
"""

from __future__ import annotations

import torch

#: D65 reference white (X, Y, Z) and the sRGB (linear) <-> XYZ matrices, as kornia has them.
WHITE = (0.95047, 1.0, 1.08883)
RGB_TO_XYZ = ((0.412453, 0.357580, 0.180423), (0.212671, 0.715160, 0.072169), (0.019334, 0.119193, 0.950227))
XYZ_TO_RGB = (
    (3.2404813432005266, -1.5371515162713185, -0.4985363261688878),
    (-0.9692549499965682, 1.8759900014898907, 0.0415559265582928),
    (0.0556466391351772, -0.2040413383665112, 1.0573110696453443),
)
#: Thresholds of the piecewise functions (sRGB transfer, CIE f and its inverse), as kornia has them.
SRGB_IN, SRGB_OUT, F_IN, F_OUT = 0.04045, 0.0031308, 0.008856, 0.2068966


def _matrices(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``diag(1 / white) RGB_TO_XYZ`` and ``XYZ_TO_RGB diag(white)`` (float32, on ``device``)."""
    white = torch.tensor(WHITE, dtype=torch.float64)
    forward = torch.tensor(RGB_TO_XYZ, dtype=torch.float64) / white[:, None]
    inverse = torch.tensor(XYZ_TO_RGB, dtype=torch.float64) * white[None, :]
    return forward.to(device, torch.float32), inverse.to(device, torch.float32)


def _apply(matrix: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``matrix @ x`` over the channel axis of ``x`` (B, 3, H, W)."""
    return torch.matmul(matrix, x.flatten(2)).view(x.shape)


def rgb_to_f(rgb: torch.Tensor, forward: torch.Tensor | None = None) -> torch.Tensor:
    """sRGB in [0, 1] (B, 3, H, W) float32 -> the CIE cube-root coordinates ``f = f(XYZ / white)``.

    ``lin = ((rgb + 0.055) / 1.055)^2.4`` above 0.04045, ``rgb / 12.92`` below; ``t = diag(1/white) M lin``;
    ``f(t) = t^(1/3)`` above 0.008856, ``7.787 t + 4/29`` below. Consumes nothing; returns a new tensor.
    """
    if forward is None:
        forward = _matrices(rgb.device)[0]
    low = rgb / 12.92
    lin = torch.where(rgb > SRGB_IN, rgb.add(0.055).div_(1.055).pow_(2.4), low)
    t = _apply(forward, lin)
    low = torch.mul(t, 7.787, out=low).add_(4.0 / 29.0)
    return torch.where(t > F_IN, t.clamp_(min=F_IN).pow_(1.0 / 3.0), low)


def f_to_lab(f: torch.Tensor) -> torch.Tensor:
    """Cube-root coordinates -> L*a*b*: ``L = 116 f_y - 16``, ``a = 500 (f_x - f_y)``, ``b = 200 (f_y - f_z)``."""
    fx, fy, fz = f.unbind(-3)
    return torch.stack([116.0 * fy - 16.0, 500.0 * (fx - fy), 200.0 * (fy - fz)], dim=-3)


def rgb_to_lab(rgb: torch.Tensor) -> torch.Tensor:
    """sRGB in [0, 1] (B, 3, H, W) float32 -> CIE L*a*b* (D65): :func:`f_to_lab` of :func:`rgb_to_f`."""
    return f_to_lab(rgb_to_f(rgb))


def lab_delta_to_f(delta: torch.Tensor) -> torch.Tensor:
    """A L*a*b* change (B, 3, ...) -> the change of ``f``: ``(c_L/116 + c_a/500, c_L/116, c_L/116 - c_b/200)``."""
    dl, da, db = delta.unbind(1)
    dy = dl / 116.0
    return torch.stack([dy + da / 500.0, dy, dy - db / 200.0], dim=1)


def f_to_rgb_(f: torch.Tensor, inverse: torch.Tensor | None = None) -> torch.Tensor:
    """Cube-root coordinates (B, 3, H, W) float32 -> sRGB clamped to [0, 1], reusing ``f``'s memory.

    ``f_z`` clamped at 0; ``t = f^3`` above 0.2068966, ``(f - 4/29) / 7.787`` below; ``lin = M^-1 diag(white) t``;
    ``rgb = 1.055 lin^(1/2.4) - 0.055`` above 0.0031308, ``12.92 lin`` below; clamped to [0, 1].
    """
    if inverse is None:
        inverse = _matrices(f.device)[1]
    f[:, 2].clamp_(min=0.0)
    cube = f * f
    t = torch.where(f > F_OUT, cube.mul_(f), f.sub_(4.0 / 29.0).div_(7.787))
    lin = _apply(inverse, t)
    low = torch.mul(lin, 12.92, out=t)
    rgb = torch.where(lin > SRGB_OUT, lin.clamp_(min=SRGB_OUT).pow_(1.0 / 2.4).mul_(1.055).sub_(0.055), low)
    return rgb.clamp_(0.0, 1.0)


def lab_to_rgb(lab: torch.Tensor) -> torch.Tensor:
    """CIE L*a*b* (B, 3, H, W) float32 -> sRGB clamped to [0, 1] (kornia's ``lab_to_rgb(clip=True)``)."""
    light, a, b = lab.unbind(-3)
    fy = (light + 16.0) / 116.0
    return f_to_rgb_(torch.stack([a / 500.0 + fy, fy, fy - b / 200.0], dim=-3))


class LabStep:
    """Stage 2's full-resolution map ``T(c) = clamp(RGB(Lab(clamp(out, 0, 1)) + U c), 0, 1)``, strip by strip.

    ``U`` is bilinear upsampling (``align_corners=False``) by the integer factors ``(s_h, s_w)`` of the coarse
    correction ``c`` (B, 3, h, w), done per strip from the coarse rows it needs (one halo row each side), in the
    cube-root domain (:func:`lab_delta_to_f` commutes with ``U``).
    """

    def __init__(self, coarse: torch.Tensor | None, s_h: int, s_w: int) -> None:
        self.forward, self.inverse = _matrices(coarse.device if coarse is not None else torch.device("cpu"))
        self.delta_f = None if coarse is None else lab_delta_to_f(coarse.to(torch.float32))
        self.s_h, self.s_w = s_h, s_w

    def __call__(self, output: torch.Tensor, r0: int, r1: int, keep_f: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``r0:r1`` (multiples of ``s_h``) of ``T(c)`` for ``output`` (B, 3, H, W); a new float32 tensor.

        ``keep_f`` (float32, the strip's shape, with a correction only): also store ``f(clamp(output))`` of the
        strip there, for :meth:`from_f` in a later step (stage 2 keeps it in the output's own memory).
        """
        rgb = output[:, :, r0:r1].to(torch.float32).clamp(0.0, 1.0)
        if self.delta_f is None:
            return rgb
        f = rgb_to_f(rgb, self.forward)
        if keep_f is not None:
            keep_f.copy_(f)
        return f_to_rgb_(f.add_(self._up(r0, r1)), self.inverse)

    def from_f(self, f: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
        """Rows ``r0:r1`` of ``T(c)`` from the strip's ``f(clamp(output))`` (kept by :meth:`__call__`; not
        modified): the same values as ``self(output, r0, r1)``, without converting the output again."""
        return f_to_rgb_(f + self._up(r0, r1), self.inverse)

    def _up(self, r0: int, r1: int) -> torch.Tensor:
        """Rows ``r0:r1`` of ``U delta_f``, from the coarse rows they need (one halo row each side)."""
        s_h, s_w = self.s_h, self.s_w
        c0, c1 = max(0, r0 // s_h - 1), min(self.delta_f.shape[-2], r1 // s_h + 1)
        return torch.nn.functional.interpolate(
            self.delta_f[:, :, c0:c1], scale_factor=(s_h, s_w), mode="bilinear", align_corners=False
        )[:, :, r0 - c0 * s_h : r1 - c0 * s_h]
