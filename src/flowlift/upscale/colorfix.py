"""Two-stage colour-drift correction for chained Flow Upscaler passes.

Stage 1 (:func:`latent_lowband_transplant`) runs on latents after every pass; stage 2
(:func:`lab_lowband_transplant`) runs on the decoded image once, against the input image.

Both stages replace a *low band* exactly. With ``D`` an antialiased (area) downsample to a coarse
grid and ``U`` bilinear upsampling back (PyTorch's ``align_corners=False`` convention), ``D U`` is not
the identity, so adding ``U(r)`` for a coarse residual ``r`` moves the low band by ``D U r`` rather
than ``r`` (a bilinear-up/area-down round trip keeps only 50-100 % of each frequency). Both stages
therefore add ``U (D U)^-1 r``: per axis ``A = D U`` is a small matrix (tridiagonal for integer
factors) and the correction is solved exactly, so ``D(corrected) = D(original) + r`` to floating
point precision. ``U A^-1 D`` is a projector: the "low band" of an image or latent.

All functions are pure; nothing is cached between calls.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from flowlift.errors import FlowliftError

LOWFREQ_FACTOR = 8

# Pixels per strip in stage 2: the strip and its temporaries stay in the CPU's caches, the per-operation overhead
# and the upsampled halo rows stay small; 128K: 3% less CPU than 64K at 6 MP, the same bits (issue 47).
_STRIP_PIXELS = 1 << 17


def _solve_dtype(device: torch.device) -> torch.dtype:
    """float64 for the small exact solves, except on backends without it (MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def linear_taps(n_out: int, n_in: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """Bilinear (1-D linear) resampling taps, PyTorch's ``align_corners=False`` convention.

    For output index ``i``: ``src = max((i + 0.5) * n_in / n_out - 0.5, 0)``, ``i0 = floor(src)``,
    ``i1 = min(i0 + 1, n_in - 1)``, ``w1 = src - i0``; ``out[i] = (1 - w1) * x[i0] + w1 * x[i1]``.
    Returns ``(i0, i1, w1)`` (int64, int64, float64), each of length ``n_out``.
    """
    i = torch.arange(n_out, dtype=torch.float64)
    src = ((i + 0.5) * (n_in / n_out) - 0.5).clamp_min(0.0)
    i0 = src.floor().clamp_max(n_in - 1)
    w1 = (src - i0).clamp(0.0, 1.0)
    i0 = i0.long()
    i1 = (i0 + 1).clamp_max(n_in - 1)
    return i0.to(device), i1.to(device), w1.to(device)


def linear_matrix(n_out: int, n_in: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Dense ``(n_out, n_in)`` matrix ``U`` of :func:`linear_taps` (1-D bilinear upsampling)."""
    i0, i1, w1 = linear_taps(n_out, n_in)
    rows = torch.arange(n_out)
    matrix = torch.zeros(n_out, n_in, dtype=torch.float64)
    matrix.index_put_((rows, i0), 1.0 - w1, accumulate=True)
    matrix.index_put_((rows, i1), w1, accumulate=True)
    return matrix.to(dtype)


def area_matrix(n_out: int, n_in: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Dense ``(n_out, n_in)`` matrix ``D`` of 1-D area downsampling (``adaptive_avg_pool1d``).

    Row ``j`` averages inputs ``floor(j * n_in / n_out) .. ceil((j + 1) * n_in / n_out) - 1``; for an
    integer factor ``s = n_in / n_out`` that is the mean of block ``j`` (``INTER_AREA``).
    """
    eye = torch.eye(n_in, dtype=torch.float64).unsqueeze(0)
    return F.adaptive_avg_pool1d(eye, n_out)[0].T.contiguous().to(dtype)


def lowband_grid(height: int, width: int, factor: int = LOWFREQ_FACTOR) -> tuple[int, int]:
    """Coarse grid of the latent low band: ``(max(1, height // factor), max(1, width // factor))``."""
    return max(1, height // factor), max(1, width // factor)


def area_downsample(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Antialiased (area) downsample of ``(..., H, W)`` to ``size``: ``D_h x D_w^T`` (adaptive average).

    Computed in float32 (or the input's dtype if wider), returned in that dtype.
    """
    dtype = torch.promote_types(x.dtype, torch.float32)
    d_h = area_matrix(size[0], x.shape[-2], dtype).to(x.device)
    d_w = area_matrix(size[1], x.shape[-1], dtype).to(x.device)
    return torch.matmul(torch.matmul(d_h, x.to(dtype)), d_w.T)


def check_strength(strength: float, what: str) -> None:
    """Refuse a strength outside [0, 1], NaN included: NaN passes ``strength == 0`` and would make every
    output value NaN (an all-black image once saved)."""
    if not 0.0 <= strength <= 1.0:
        raise FlowliftError(f"{what}: strength must be a number in [0, 1], got {strength}")


def latent_lowband_transplant(
    output: torch.Tensor,
    conditioning: torch.Tensor,
    strength: float = 1.0,
    factor: int = LOWFREQ_FACTOR,
    strip_rows: int = 256,
) -> torch.Tensor:
    """Stage 1: give ``output`` the low band of ``conditioning`` (latents, any sizes).

    With ``g = lowband_grid(H, W, factor)`` (``H, W`` the output's size), ``D`` the area downsample
    to ``g`` (from either size), ``U`` bilinear upsampling from ``g`` to ``H x W`` and
    ``A = D_out U`` per axis::

        r   = D_cond(conditioning) - D_out(output)          (on the coarse grid g)
        out = output + strength * U_h A_h^-1 r A_w^-T U_w^T

    so ``D_out(out) = D_out(output) + strength * r``: at strength 1 the output's low band equals the
    conditioning's exactly, at 0 the output is returned unchanged. Computed in float32 (float64 for
    the small solves), added in row strips; returns a new float32 tensor ``(B, C, H, W)``.
    """
    if output.ndim != 4 or conditioning.ndim != 4 or output.shape[:2] != conditioning.shape[:2]:
        raise ValueError(
            f"latent_lowband_transplant: expected (B, C, H, W) tensors with equal B and C, "
            f"got {tuple(output.shape)} and {tuple(conditioning.shape)}"
        )
    check_strength(strength, "latent_lowband_transplant")
    result = output.to(torch.float32).clone()
    if strength == 0:
        return result
    device = output.device
    height, width = output.shape[-2:]
    grid = lowband_grid(height, width, factor)
    solve = _solve_dtype(device)
    u_h = linear_matrix(height, grid[0], solve)
    u_w = linear_matrix(width, grid[1], solve)
    a_h_inv = torch.linalg.inv(area_matrix(grid[0], height, solve) @ u_h)
    a_w_inv = torch.linalg.inv(area_matrix(grid[1], width, solve) @ u_w)
    residual = area_downsample(conditioning, grid) - area_downsample(result, grid)
    coarse = torch.matmul(torch.matmul(a_h_inv.to(device), residual.to(solve)), a_w_inv.T.to(device))
    # Fold A^-1 into U (tiny matrices), then add U_h c U_w^T strip by strip.
    right = torch.matmul(coarse, u_w.T.to(device)).to(torch.float32)  # (B, C, g_h, W)
    u_h32 = u_h.to(device=device, dtype=torch.float32)
    for r0 in range(0, height, strip_rows):
        r1 = min(height, r0 + strip_rows)
        result[:, :, r0:r1].add_(torch.matmul(u_h32[r0:r1], right), alpha=float(strength))
    return result


def integer_area_tridiagonal(n_coarse: int, factor: int) -> torch.Tensor:
    """Bands of ``A = D U`` for an integer factor: ``(n, 3)`` float64 = (sub, diagonal, super).

    ``D`` is the block mean over ``factor`` samples, ``U`` bilinear upsampling by ``factor``
    (:func:`linear_taps`); ``A[i, k] = (1/factor) * sum over R in block i of U[R, k]``, nonzero only
    for ``|i - k| <= 1``.
    """
    i0, i1, w1 = linear_taps(n_coarse * factor, n_coarse)
    rows = torch.arange(n_coarse * factor) // factor
    bands = torch.zeros(n_coarse, 3, dtype=torch.float64)
    for column, weight in ((i0, 1.0 - w1), (i1, w1)):
        offset = column - rows + 1
        if offset.min() < 0 or offset.max() > 2:
            raise AssertionError("bilinear-up/area-down is not tridiagonal")  # cannot happen for integers
        bands.index_put_((rows, offset), weight / factor, accumulate=True)
    return bands


def box_taps(n_out: int, n_in: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact area (box) downsampling ``n_in -> n_out``, ``n_in >= n_out``, as taps: ``(index, weight)``, both
    ``(n_out, K)``. Output ``j`` integrates the input over ``[j r, (j + 1) r)`` with ``r = n_in / n_out``: sample
    ``p`` weighs ``|[p, p + 1) ∩ [j r, (j + 1) r)| / r``, so every row sums to 1 and every input sample's weights
    sum to ``1 / r`` (the mean is kept exactly; the block mean for an integer ``r``). Unused taps: weight 0."""
    if n_in < n_out:
        raise ValueError(f"box_taps: {n_in} samples cannot be area-downsampled to {n_out}")
    ratio = n_in / n_out
    first = torch.tensor([j * n_in // n_out for j in range(n_out)], dtype=torch.int64)
    width = int(math.ceil(ratio)) + 1
    index = (first[:, None] + torch.arange(width)).clamp_max(n_in - 1)
    left = torch.arange(n_out, dtype=torch.float64)[:, None] * ratio
    low = torch.maximum(index.to(torch.float64), left)
    high = torch.minimum(index.to(torch.float64) + 1, left + ratio)
    weight = (high - low).clamp_min(0.0) / ratio
    weight[:, 1:] *= (index[:, 1:] != index[:, :-1]).to(torch.float64)  # the clamped repeats of the last sample
    return index, weight


def box_downsample(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Exact area downsample of ``(..., H, W)`` to ``size`` (:func:`box_taps` per axis), float32."""
    x = x.to(torch.float32)
    for dim, n_out in ((-2, size[0]), (-1, size[1])):
        index, weight = (t.to(x.device) for t in box_taps(n_out, x.shape[dim]))
        moved = x.movedim(dim, -1)
        moved = (moved[..., index] * weight.to(torch.float32)).sum(-1)
        x = moved.movedim(-1, dim)
    return x


def box_linear_tridiagonal(n_coarse: int, n_fine: int) -> torch.Tensor:
    """Bands of ``A = D U`` for any ``n_fine >= n_coarse``: ``(n, 3)`` float64 = (sub, diagonal, super).

    ``D`` is the exact area downsample ``n_fine -> n_coarse`` (:func:`box_taps`), ``U`` bilinear upsampling
    ``n_coarse -> n_fine`` (:func:`linear_taps`): ``A[i, k] = sum_t weight[i, t] U[index[i, t], k]``. A fine
    sample of window ``i`` has its bilinear source ``(r + 1/2) n_coarse / n_fine - 1/2`` within ``(i - 1, i + 1)``,
    so ``A`` is tridiagonal; for an integer ratio it equals :func:`integer_area_tridiagonal`.
    """
    index, weight = box_taps(n_coarse, n_fine)
    i0, i1, w1 = linear_taps(n_fine, n_coarse)
    rows = torch.arange(n_coarse)[:, None].expand_as(index)
    bands = torch.zeros(n_coarse, 3, dtype=torch.float64)
    used = weight > 0
    for column, share in ((i0[index], 1.0 - w1[index]), (i1[index], w1[index])):
        offset = column - rows + 1
        if offset[used].min() < 0 or offset[used].max() > 2:
            raise AssertionError("bilinear-up/area-down is not tridiagonal")  # cannot happen for n_fine >= n_coarse
        bands.index_put_((rows[used], offset[used]), (share * weight)[used], accumulate=True)
    return bands


def _box_rows(index: torch.Tensor, weight: torch.Tensor, f0: int, f1: int) -> torch.Tensor:
    """Rows of the area matrix of :func:`box_taps` restricted to the fine samples ``f0:f1`` (dense, float32)."""
    dense = torch.zeros(index.shape[0], f1 - f0, dtype=torch.float64)
    dense.scatter_add_(1, (index - f0).clamp(0, f1 - f0 - 1), weight)
    return dense.to(torch.float32)


def solve_tridiagonal(bands: torch.Tensor, rhs: torch.Tensor, dim: int) -> torch.Tensor:
    """Solve ``A x = rhs`` along ``dim`` for tridiagonal ``A`` given as ``(n, 3)`` (sub, diag, super).

    Thomas algorithm, vectorised over all other dimensions; ``A`` must be diagonally dominant
    (``D U`` is: diagonal >= 3/4, off-diagonals <= 1/8). Returns a tensor like ``rhs``. The rows along ``dim``,
    made contiguous, are taken apart once (``unbind``): one or two torch calls per row.
    """
    x = rhs.movedim(dim, 0).clone(memory_format=torch.contiguous_format)
    rows = x.unbind(0)
    n = len(rows)
    sub, diag, sup = (bands[:, k].tolist() for k in range(3))
    c_prime = [0.0] * n
    m = diag[0]
    c_prime[0] = sup[0] / m
    rows[0].div_(m)
    for i in range(1, n):
        m = diag[i] - sub[i] * c_prime[i - 1]
        c_prime[i] = sup[i] / m
        rows[i].sub_(rows[i - 1], alpha=sub[i]).div_(m)
    for i in range(n - 2, -1, -1):
        rows[i].sub_(rows[i + 1], alpha=c_prime[i])
    return x.movedim(0, dim)


def _upsample_strip(coarse: torch.Tensor, r0: int, r1: int, taps_h: tuple, taps_w: tuple) -> torch.Tensor:
    """Rows ``r0:r1`` of the bilinear upsampling of ``coarse`` (B, C, h, w) to the full grid."""
    i0, i1, w1 = (t[r0:r1] for t in taps_h)
    w1 = w1.to(coarse.dtype).view(-1, 1)
    rows = coarse[:, :, i0] * (1 - w1) + coarse[:, :, i1] * w1
    j0, j1, v1 = taps_w
    v1 = v1.to(coarse.dtype)
    return rows[..., j0] * (1 - v1) + rows[..., j1] * v1


def _stage2_reference(output: torch.Tensor, reference: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Stage 2's shapes checked, and the reference on the low band's grid: itself when the output is an integer
    multiple of it (``True``), else per side the reference's size or half the output's where that is coarser, the
    reference area-downsampled to it (:func:`box_downsample`; ``False``)."""
    if output.ndim != 4 or reference.ndim != 4 or output.shape[1] != 3 or reference.shape[1] != 3:
        raise ValueError(
            f"lab_lowband_transplant: expected RGB (B, 3, H, W) tensors, "
            f"got {tuple(output.shape)} and {tuple(reference.shape)}"
        )
    height, width = output.shape[-2:]
    h, w = reference.shape[-2:]
    if reference.shape[0] != output.shape[0] or height < h or width < w:
        raise ValueError(
            f"lab_lowband_transplant: output {height}x{width} is smaller than the reference {h}x{w} "
            f"(or the batch sizes differ)"
        )
    if height % h == 0 and width % w == 0:  # the passes' own sizes: the block mean, as always
        return reference, True
    grid = tuple(n if out == n else min(n, out // 2) for n, out in ((h, height), (w, width)))
    return box_downsample(reference, grid), False


def lab_lowband_transplant(
    output: torch.Tensor,
    reference: torch.Tensor,
    strength: float = 1.0,
    iterations: int = 2,
    strip_pixels: int = _STRIP_PIXELS,
    inplace: bool = False,
    on_strip: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Stage 2: pin the output's colour and tone below the reference's Nyquist, in CIE L*a*b*.

    ``output`` (B, 3, H, W) and ``reference`` (B, 3, h, w) are RGB in [0, 1] with ``H >= h`` and ``W >= w``
    (integer multiples ``H = s_h h``, ``W = s_w w`` from the 2x passes, or any larger size: a ``scale=3``
    upscale's resampled output). Off the integer ratios the low band's grid ``h x w`` is per side the
    reference's, or half the output's where that is smaller (``min(h, H // 2)``; the reference is area-downsampled
    to it): a grid within 2x of the output would make ``A`` ill-conditioned (``H = h + 1``: the correction is
    nearly the whole image). With ``D`` the area downsample to ``h x w`` (in RGB: the block mean for
    integer ratios, else the exact box integral of :func:`box_taps`, which keeps the mean exactly),
    ``Lab`` the sRGB -> CIE L*a*b* (D65) conversion, ``U`` bilinear upsampling and ``A = D U``::

        target = Lab(D out) + strength * (Lab(reference) - Lab(D out))
        c_0 = 0;  c_{k+1} = c_k + A^-1 (target - Lab(D T(c_k)))      for k < iterations
        T(c) = clamp(RGB(Lab(out) + U c), 0, 1)                       (result: T(c_iterations))

    ``A^-1`` makes each step exact for the linear part (the bilinear correction's area mean equals
    the residual), so the remaining error is only L*a*b*'s nonlinearity and clipping, which the
    iterations remove (each full-resolution step shrinks it by orders of magnitude). At strength 1
    ``Lab(D result)`` equals ``Lab(reference)``; strength ``t`` leaves ``1 - t`` of the difference.
    Above the reference's Nyquist the output's detail is untouched (``U c`` is smooth on the fine
    grid). Work is done in float32 row strips of about ``strip_pixels`` pixels, so the extra memory is
    a few strips plus coarse maps; returns a new float32 tensor (B, 3, H, W) in [0, 1], or with
    ``inplace=True`` writes the result into ``output`` (which must then be float32) and returns it.
    ``on_strip()`` (optional) runs before every strip: a cancel point (it may raise to stop).
    """
    batch, _, height, width = output.shape
    reference, integer = _stage2_reference(output, reference)
    if inplace and output.dtype != torch.float32:
        raise ValueError("lab_lowband_transplant: inplace needs a float32 output tensor")
    check_strength(strength, "lab_lowband_transplant")
    if strength == 0:
        return output.clamp_(0.0, 1.0) if inplace else output.to(torch.float32).clamp(0.0, 1.0)

    from flowlift.devices import one_thread

    transplant = _lab_transplant if integer else _lab_transplant_any
    with one_thread(output.device):
        return transplant(output, reference, strength, iterations, strip_pixels, inplace, on_strip)


def _fit_coarse(
    down_lab: Callable[[torch.Tensor | None], torch.Tensor],
    reference_lab: torch.Tensor,
    strength: float,
    iterations: int,
    bands: tuple[torch.Tensor, torch.Tensor],
    solve: torch.dtype,
) -> torch.Tensor:
    """The coarse Lab correction ``c`` whose upsample moves the output's low band ``strength`` of the way to the
    reference's: ``target = L0 + strength (R - L0)`` with ``L0 = down(output)``, then ``iterations`` of
    ``c += B_w^-1 B_h^-1 (target - down(output + up(c)))`` (``B``: the tridiagonal upsample-then-average operators
    of height and width, ``bands``; ``down_lab(c)`` computes ``down(output + up(c))``, ``down_lab(None)`` ``L0``)."""
    bands_h, bands_w = bands
    current = down_lab(None)
    target = current + float(strength) * (reference_lab - current)
    coarse = torch.zeros_like(current, dtype=torch.float32)
    for k in range(max(1, iterations)):
        if k:
            current = down_lab(coarse)
        residual = (target - current).to(solve)
        step = solve_tridiagonal(bands_w, solve_tridiagonal(bands_h, residual, dim=-2), dim=-1)
        coarse = coarse + step.to(torch.float32)
    return coarse


def _lab_transplant(output, reference, strength, iterations, strip_pixels, inplace, on_strip) -> torch.Tensor:
    """:func:`lab_lowband_transplant` after its checks."""
    from flowlift.upscale.colorfix_lab import LabStep, block_mean, rgb_to_lab

    batch, _, height, width = output.shape
    h, w = reference.shape[-2:]
    s_h, s_w = height // h, width // w
    device = output.device

    solve = _solve_dtype(device)
    bands_h = integer_area_tridiagonal(h, s_h)
    bands_w = integer_area_tridiagonal(w, s_w)
    rows_per_strip = max(s_h, (strip_pixels // max(width, 1)) // s_h * s_h)

    def strips():
        for r0 in range(0, height, rows_per_strip):
            if on_strip is not None:
                on_strip()
            yield r0, min(height, r0 + rows_per_strip)

    # With inplace, the first corrected step leaves f(clamp(output)) in the output's memory and every later step
    # starts from it (the same values, one sRGB -> f conversion per pixel). Each strip depends only on itself.
    holds_f = False

    def corrected(step: LabStep, r0: int, r1: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if holds_f:
            return step.from_f(output[:, :, r0:r1], r0, r1, out=out)
        return step(output, r0, r1, keep_f=output[:, :, r0:r1] if inplace else None, out=out)

    def down_lab(coarse: torch.Tensor | None) -> torch.Tensor:
        nonlocal holds_f
        low = torch.empty(batch, 3, h, w, dtype=torch.float32, device=device)
        step = LabStep(coarse, s_h, s_w)
        for r0, r1 in strips():
            rgb = step(output, r0, r1) if coarse is None else corrected(step, r0, r1)
            block_mean(rgb, s_h, s_w, out=low[:, :, r0 // s_h : r1 // s_h])
        holds_f = holds_f or (inplace and coarse is not None)
        return rgb_to_lab(low)

    reference_lab = rgb_to_lab(reference.to(device=device, dtype=torch.float32).clamp(0.0, 1.0))
    coarse = _fit_coarse(down_lab, reference_lab, strength, iterations, (bands_h, bands_w), solve)

    result = output if inplace else torch.empty(batch, 3, height, width, dtype=torch.float32, device=device)
    step = LabStep(coarse, s_h, s_w)
    for r0, r1 in strips():
        corrected(step, r0, r1, out=result[:, :, r0:r1])
    return result


def _lab_transplant_any(output, reference, strength, iterations, strip_pixels, inplace, on_strip) -> torch.Tensor:
    """:func:`lab_lowband_transplant` off the integer ratios (``reference`` already on the low band's grid,
    :func:`_stage2_reference`): the exact box-area ``D`` (:func:`box_taps`) and its tridiagonal ``D U``
    (:func:`box_linear_tridiagonal`), the bilinear ``U`` from :func:`linear_taps`, the conversions of
    :mod:`flowlift.upscale.colorfix_lab`."""
    from flowlift.upscale.colorfix_lab import lab_to_rgb, rgb_to_lab

    batch, _, height, width = output.shape
    h, w = reference.shape[-2:]
    s_h = height // h
    device = output.device

    solve = _solve_dtype(device)
    bands_h, bands_w = box_linear_tridiagonal(h, height), box_linear_tridiagonal(w, width)
    taps_h = linear_taps(height, h, device)
    taps_w = linear_taps(width, w, device)
    rows_per_strip = max(s_h, (strip_pixels // max(width, 1)) // s_h * s_h)
    box_h = box_taps(h, height)
    index_w, weight_w = (t.to(device) for t in box_taps(w, width))
    weight_w = weight_w.to(torch.float32)
    coarse_rows = max(1, strip_pixels // max(width, 1) // (s_h + 1))  # coarse rows per strip off the integers

    def strip(r0: int, r1: int, coarse: torch.Tensor | None) -> torch.Tensor:
        if on_strip is not None:
            on_strip()
        rgb = output[:, :, r0:r1].to(torch.float32).clamp(0.0, 1.0)
        if coarse is None:
            return rgb
        lab = rgb_to_lab(rgb) + _upsample_strip(coarse, r0, r1, taps_h, taps_w)
        return lab_to_rgb(lab).clamp_(0.0, 1.0)

    def down_lab(coarse: torch.Tensor | None) -> torch.Tensor:
        low = torch.empty(batch, 3, h, w, dtype=torch.float32, device=device)
        index, weight = box_h
        for c0 in range(0, h, coarse_rows):  # each strip holds whole row windows (neighbours share a row)
            c1 = min(h, c0 + coarse_rows)
            f0, f1 = int(index[c0, 0]), int(index[c1 - 1].max()) + 1
            rows = (strip(f0, f1, coarse)[..., index_w] * weight_w).sum(-1)  # the width's windows
            low[:, :, c0:c1] = torch.matmul(_box_rows(index[c0:c1], weight[c0:c1], f0, f1).to(device), rows)
        return rgb_to_lab(low)

    reference_lab = rgb_to_lab(reference.to(device=device, dtype=torch.float32).clamp(0.0, 1.0))
    coarse = _fit_coarse(down_lab, reference_lab, strength, iterations, (bands_h, bands_w), solve)

    # Each strip of the result depends only on the same strip of the output, so inplace is safe.
    result = output if inplace else torch.empty(batch, 3, height, width, dtype=torch.float32, device=device)
    for r0 in range(0, height, rows_per_strip):
        r1 = min(height, r0 + rows_per_strip)
        result[:, :, r0:r1] = strip(r0, r1, coarse)
    return result
