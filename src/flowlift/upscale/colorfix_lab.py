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

import math

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


def above(
    value: torch.Tensor, threshold: float, high: torch.Tensor, low: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``high`` where ``value > threshold``, else ``low`` (finite branches), written into ``out`` or ``low``.

    The values of ``torch.where(value > threshold, high, low)``, bit for bit: ``lerp(low, high, w)`` with the weight
    ``w = 1.0`` or ``0.0`` from the comparison (written as floats), and ``lerp`` returns an end exactly at those
    weights (``low + 0 (high - low)``, ``high - 0 (high - low)``). ``torch.where`` on the CPU reads a bool mask
    element by element (1.0 ns a value on a photo's strip); the float weight and ``lerp`` are vectorised (0.3).
    """
    weight = torch.gt(value, threshold, out=torch.empty_like(value))
    return torch.lerp(low, high, weight, out=low if out is None else out)


def affine(x: torch.Tensor, scale: float, offset: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``scale x + offset`` in one pass (``torch.add(offset, x, alpha=scale)``), into ``out`` or ``x``'s memory.

    ``offset`` is a 0-dim CPU tensor, which torch takes as a scalar with a tensor on any device (no copy to it)."""
    bias = torch.tensor(offset, dtype=x.dtype)
    return torch.add(bias, x, alpha=scale, out=x if out is None else out)


def power(x: torch.Tensor, exponent: float, log_scale: float = 0.0) -> torch.Tensor:
    """``exp(log_scale) x ** exponent`` for positive ``x`` as ``exp(exponent log x + log_scale)``, in ``x``'s memory.

    torch's CPU ``pow`` by a general float runs an extended-precision power (2.5 ns a value in one thread); its
    ``log`` and ``exp`` take 1.9 together, and a constant factor rides along for free. Their float32 rounding
    differs by a few units in the last place (relative 1e-7 here: ``|exponent log x| < 6`` in stage 2's ranges).
    """
    return affine(x.log_(), exponent, log_scale).exp_()


def rgb_to_f(rgb: torch.Tensor, forward: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """sRGB in [0, 1] (B, 3, H, W) float32 -> the CIE cube-root coordinates ``f = f(XYZ / white)``.

    ``lin = ((rgb + 0.055) / 1.055)^2.4`` above 0.04045, ``rgb / 12.92`` below; ``t = diag(1/white) M lin``;
    ``f(t) = t^(1/3)`` above 0.008856, ``7.787 t + 4/29`` below (powers by :func:`power`, branches by
    :func:`above`). Consumes nothing; returns a new tensor, or writes ``out`` (float32, ``rgb``'s shape) and
    returns it.
    """
    if forward is None:
        forward = _matrices(rgb.device)[0]
    lin = above(rgb, SRGB_IN, power(rgb.add(0.055), 2.4, -2.4 * math.log(1.055)), rgb / 12.92)
    t = _apply(forward, lin)
    low = affine(t, 7.787, 4.0 / 29.0, out=lin)
    return above(t, F_IN, power(t.clamp(min=F_IN), 1.0 / 3.0), low, out)


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


def f_to_rgb_(f: torch.Tensor, inverse: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Cube-root coordinates (B, 3, H, W) float32 -> sRGB clamped to [0, 1], reusing ``f``'s memory (or into ``out``).

    ``f_z`` clamped at 0; ``t = f^3`` above 0.2068966, ``(f - 4/29) / 7.787`` below; ``lin = M^-1 diag(white) t``;
    ``rgb = 1.055 lin^(1/2.4) - 0.055`` above 0.0031308, ``12.92 lin`` below (:func:`power`, :func:`above`);
    clamped to [0, 1].
    """
    if inverse is None:
        inverse = _matrices(f.device)[1]
    f[:, 2].clamp_(min=0.0)
    weight = torch.gt(f, F_OUT, out=torch.empty_like(f))
    cube = f.pow(3)
    t = torch.lerp(affine(f, 1.0 / 7.787, -4.0 / 29.0 / 7.787), cube, weight, out=f)  # above(), weight taken first
    lin = _apply(inverse, t)
    high = power(lin.clamp(min=SRGB_OUT), 1.0 / 2.4, math.log(1.055)).sub_(0.055)
    rgb = above(lin, SRGB_OUT, high, torch.mul(lin, 12.92, out=t))
    return rgb.clamp_(0.0, 1.0) if out is None else torch.clamp(rgb, 0.0, 1.0, out=out)


def lab_to_rgb(lab: torch.Tensor) -> torch.Tensor:
    """CIE L*a*b* (B, 3, H, W) float32 -> sRGB clamped to [0, 1] (kornia's ``lab_to_rgb(clip=True)``)."""
    light, a, b = lab.unbind(-3)
    fy = (light + 16.0) / 116.0
    return f_to_rgb_(torch.stack([a / 500.0 + fy, fy, fy - b / 200.0], dim=-3))


def linear_phases(s: int) -> list[tuple[int, float]]:
    """Bilinear upsampling by an integer ``s`` (``align_corners=False``) as ``s`` phases ``(offset, weight)``.

    Output ``s k + j`` samples the input at ``k + d`` with ``d = (j + 1/2) / s - 1/2``: it is
    ``lerp(p[k + o], p[k + o + 1], w)`` on the input padded with one copy of its edge sample at each end
    (``p[i + 1] = x[i]``), with ``(o, w) = (0, 1 + d)`` for ``d < 0`` and ``(1, d)`` otherwise (the padding is
    PyTorch's clamping at the edges: ``lerp`` of two equal values is that value).
    """
    phases = []
    for j in range(s):
        d = (j + 0.5) / s - 0.5
        phases.append((0, 1.0 + d) if d < 0 else (1, d))
    return phases


def upsample_rows(coarse: torch.Tensor, k0: int, k1: int, s_h: int, s_w: int) -> torch.Tensor:
    """Rows ``[s_h k0, s_h k1)`` of the bilinear upsampling (``align_corners=False``) of ``coarse`` (B, C, h, w) by
    the integer factors ``(s_h, s_w)``: the coarse rows ``k0 - 1 .. k1`` (edge rows repeated) upsampled along the
    width, then blended row by row, each phase of :func:`linear_phases` one ``lerp`` over strided views.

    ``F.interpolate``'s values to float32 rounding (its weights in float32, these in float64 then rounded; its
    blend in another order); 0.4 against 3.7 ns an output value in one thread, and no halo rows upsampled.
    """
    h = coarse.shape[-2]
    rows = torch.arange(k0 - 1, k1 + 1, device=coarse.device).clamp_(0, h - 1)
    padded = coarse.index_select(-2, rows)  # (B, C, n + 2, w)
    padded = torch.cat([padded[..., :1], padded, padded[..., -1:]], dim=-1)  # (B, C, n + 2, w + 2)
    b, c, n, w = padded.shape[0], padded.shape[1], k1 - k0, coarse.shape[-1]
    wide = padded.new_empty(b, c, n + 2, w, s_w)
    for j, (o, weight) in enumerate(linear_phases(s_w)):
        torch.lerp(padded[..., o : o + w], padded[..., o + 1 : o + 1 + w], weight, out=wide[..., j])
    wide = wide.view(b, c, n + 2, w * s_w)
    up = padded.new_empty(b, c, n, s_h, w * s_w)
    for j, (o, weight) in enumerate(linear_phases(s_h)):
        torch.lerp(wide[:, :, o : o + n], wide[:, :, o + 1 : o + 1 + n], weight, out=up[:, :, :, j])
    return up.view(b, c, n * s_h, w * s_w)


def block_mean(x: torch.Tensor, s_h: int, s_w: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The mean of every ``s_h x s_w`` block of ``x`` (B, C, s_h h, s_w w) -> (B, C, h, w) (``avg_pool2d``'s values
    to float32 rounding), written into ``out`` when given.

    ``sum_i sum_j x[s_h k + i, s_w l + j] / (s_h s_w)``: the ``s_h`` rows of each block added as strided row views
    (vectorised along the width), then the ``s_w`` columns of the ``1/s_h``-size sum, then one scale; 0.26 against
    0.72 ns an input value for ``avg_pool2d`` in one thread at 4x4.
    """
    x = x.contiguous()
    b, c, height, width = x.shape
    h, w = height // s_h, width // s_w
    rows = x.view(b, c, h, s_h, width)
    total = rows[:, :, :, 0].clone() if s_h == 1 else rows[:, :, :, 0] + rows[:, :, :, 1]
    for i in range(2, s_h):
        total.add_(rows[:, :, :, i])
    columns = total.view(b, c, h, w, s_w)
    result = columns[..., 0].clone() if s_w == 1 else columns[..., 0] + columns[..., 1]
    for j in range(2, s_w):
        result.add_(columns[..., j])
    if out is None:
        return result.mul_(1.0 / (s_h * s_w))
    return torch.mul(result, 1.0 / (s_h * s_w), out=out)


class LabStep:
    """Stage 2's full-resolution map ``T(c) = clamp(RGB(Lab(clamp(out, 0, 1)) + U c), 0, 1)``, strip by strip.

    ``U`` is bilinear upsampling (``align_corners=False``) by the integer factors ``(s_h, s_w)`` of the coarse
    correction ``c`` (B, 3, h, w), done per strip from the coarse rows it needs (:func:`upsample_rows`), in the
    cube-root domain (:func:`lab_delta_to_f` commutes with ``U``).
    """

    def __init__(self, coarse: torch.Tensor | None, s_h: int, s_w: int) -> None:
        self.forward, self.inverse = _matrices(coarse.device if coarse is not None else torch.device("cpu"))
        self.delta_f = None if coarse is None else lab_delta_to_f(coarse.to(torch.float32))
        self.s_h, self.s_w = s_h, s_w

    def __call__(
        self,
        output: torch.Tensor,
        r0: int,
        r1: int,
        keep_f: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows ``r0:r1`` (multiples of ``s_h``) of ``T(c)`` for ``output`` (B, 3, H, W); a new float32 tensor, or
        written into ``out`` (which may be ``keep_f``).

        ``keep_f`` (float32, the strip's shape, with a correction only): also store ``f(clamp(output))`` of the
        strip there, for :meth:`from_f` in a later step (stage 2 keeps it in the output's own memory).
        """
        rgb = output[:, :, r0:r1].to(torch.float32).clamp(0.0, 1.0)
        if self.delta_f is None:
            return rgb if out is None else out.copy_(rgb)
        if keep_f is not None:
            return self.from_f(rgb_to_f(rgb, self.forward, out=keep_f), r0, r1, out=out)
        return f_to_rgb_(rgb_to_f(rgb, self.forward).add_(self._up(r0, r1)), self.inverse, out=out)

    def from_f(self, f: torch.Tensor, r0: int, r1: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``r0:r1`` of ``T(c)`` from the strip's ``f(clamp(output))`` (kept by :meth:`__call__`; not
        modified): the same values as ``self(output, r0, r1)``, without converting the output again. Written
        into ``out`` (which may be ``f`` itself) when given."""
        return f_to_rgb_(f + self._up(r0, r1), self.inverse, out=out)

    def _up(self, r0: int, r1: int) -> torch.Tensor:
        """Rows ``r0:r1`` of ``U delta_f`` (:func:`upsample_rows`)."""
        return upsample_rows(self.delta_f, r0 // self.s_h, r1 // self.s_h, self.s_h, self.s_w)
