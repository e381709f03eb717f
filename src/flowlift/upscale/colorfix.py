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

from collections.abc import Callable

import torch
import torch.nn.functional as F

from flowlift.errors import FlowliftError

LOWFREQ_FACTOR = 8

# Pixels per strip in stage 2: small enough for the strip and its temporaries (~10 planes of 3 x 4 bytes a pixel)
# to stay in the CPU's L2/L3 caches, large enough that the per-operation overhead stays small.
_STRIP_PIXELS = 1 << 16


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


def solve_tridiagonal(bands: torch.Tensor, rhs: torch.Tensor, dim: int) -> torch.Tensor:
    """Solve ``A x = rhs`` along ``dim`` for tridiagonal ``A`` given as ``(n, 3)`` (sub, diag, super).

    Thomas algorithm, vectorised over all other dimensions; ``A`` must be diagonally dominant
    (``D U`` is: diagonal >= 3/4, off-diagonals <= 1/8). Returns a tensor like ``rhs``.
    """
    x = rhs.movedim(dim, 0).clone()
    n = x.shape[0]
    sub, diag, sup = (bands[:, k].tolist() for k in range(3))
    c_prime = [0.0] * n
    m = diag[0]
    c_prime[0] = sup[0] / m
    x[0].div_(m)
    for i in range(1, n):
        m = diag[i] - sub[i] * c_prime[i - 1]
        c_prime[i] = sup[i] / m
        x[i].sub_(x[i - 1], alpha=sub[i]).div_(m)
    for i in range(n - 2, -1, -1):
        x[i].sub_(x[i + 1], alpha=c_prime[i])
    return x.movedim(0, dim)


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

    ``output`` (B, 3, H, W) and ``reference`` (B, 3, h, w) are RGB in [0, 1] with ``H = s_h h`` and
    ``W = s_w w`` for integers ``s_h, s_w``. With ``D`` the block mean (area downsample, in RGB),
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
    if output.ndim != 4 or reference.ndim != 4 or output.shape[1] != 3 or reference.shape[1] != 3:
        raise ValueError(
            f"lab_lowband_transplant: expected RGB (B, 3, H, W) tensors, "
            f"got {tuple(output.shape)} and {tuple(reference.shape)}"
        )
    batch, _, height, width = output.shape
    h, w = reference.shape[-2:]
    if reference.shape[0] != batch or height % h or width % w:
        raise ValueError(
            f"lab_lowband_transplant: output {height}x{width} is not an integer multiple of the "
            f"reference {h}x{w} (or the batch sizes differ)"
        )
    if inplace and output.dtype != torch.float32:
        raise ValueError("lab_lowband_transplant: inplace needs a float32 output tensor")
    check_strength(strength, "lab_lowband_transplant")
    if strength == 0:
        return output.clamp_(0.0, 1.0) if inplace else output.to(torch.float32).clamp(0.0, 1.0)

    from flowlift.devices import one_thread

    with one_thread(output.device):
        return _lab_transplant(output, reference, strength, iterations, strip_pixels, inplace, on_strip)


def _lab_transplant(output, reference, strength, iterations, strip_pixels, inplace, on_strip) -> torch.Tensor:
    """:func:`lab_lowband_transplant` after its checks."""
    from flowlift.upscale.colorfix_lab import LabStep, rgb_to_lab

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

    def down_lab(coarse: torch.Tensor | None) -> torch.Tensor:
        low = torch.empty(batch, 3, h, w, dtype=torch.float32, device=device)
        step = LabStep(coarse, s_h, s_w)
        for r0, r1 in strips():
            low[:, :, r0 // s_h : r1 // s_h] = F.avg_pool2d(step(output, r0, r1), (s_h, s_w))
        return rgb_to_lab(low)

    reference_lab = rgb_to_lab(reference.to(device=device, dtype=torch.float32).clamp(0.0, 1.0))
    current = down_lab(None)
    target = current + float(strength) * (reference_lab - current)
    coarse = torch.zeros(batch, 3, h, w, dtype=torch.float32, device=device)
    for k in range(max(1, iterations)):
        if k:
            current = down_lab(coarse)
        residual = (target - current).to(solve)
        step = solve_tridiagonal(bands_w, solve_tridiagonal(bands_h, residual, dim=-2), dim=-1)
        coarse = coarse + step.to(torch.float32)

    # Each strip of the result depends only on the same strip of the output, so inplace is safe.
    result = output if inplace else torch.empty(batch, 3, height, width, dtype=torch.float32, device=device)
    step = LabStep(coarse, s_h, s_w)
    for r0, r1 in strips():
        result[:, :, r0:r1] = step(output, r0, r1)
    return result
