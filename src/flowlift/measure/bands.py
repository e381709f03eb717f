"""Latent -> pixel band response of a VAE decoder (the model card's band table, for any VAE).

Frequencies are written as **fractions of the latent grid's Nyquist**. A latent pixel decodes to
``f`` image pixels (``f = 8`` for FLUX.2), so the latent Nyquist (0.5 cycles per latent pixel) sits
at ``0.5 / f`` cycles per image pixel. A spectral bin at ``(u, v)`` cycles/px has the radial
frequency ``r = sqrt(u^2 + v^2) / 0.5`` on its own grid; in pixel space ``r_pix = sqrt(u^2 + v^2) *
2 f``, so ``r_pix > 1`` is detail finer than the latent grid can represent.

Measurement (:func:`band_response`), for one image's latent ``z`` and each latent band ``[lo, hi)``:

1. ``delta = amplitude * n / rms(n)`` with ``n`` Gaussian noise masked in the 2-D FFT of every
   latent channel to ``lo <= r < hi`` (the last band is closed, ``r <= 1``; corner frequencies with
   ``r > 1`` are never perturbed). The latents are normalized (unit sigma), so ``amplitude = 0.1``
   is the card's "0.1 sigma" perturbation.
2. ``d = Y(decode(z + delta)) - Y(decode(z))`` with luma ``Y = 0.299 R + 0.587 G + 0.114 B``.
3. The power spectrum ``|FFT(d)|^2`` is integrated over the pixel bands ``[lo, hi)`` of the same
   edges (the last closed) plus ``r_pix > 1`` ("finer than latent Nyquist"), as percentages of the total (no window;
   the mean of ``d`` counts in the lowest band).

:func:`run_bands` averages the per-image rows over a set of images (each image weighs the same).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from flowlift.errors import FlowliftError
from flowlift.knobs import wrap_seed

#: Latent bands as fractions of the latent Nyquist (model card): 0-1/16 ... 1/2-1.
BAND_EDGES: tuple[float, ...] = (0.0, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)

#: A decoder: latents (1, C, h, w) -> images (1, 3, f*h, f*w), float, nominally [0, 1].
Decoder = Callable[[torch.Tensor], torch.Tensor]

#: The model card's figures for the Mage decoder: (% in the same pixel band, % finer than latent Nyquist).
MAGE_REFERENCE: tuple[tuple[float, float], ...] = (
    (87.7, 7.8),
    (90.6, 4.2),
    (77.1, 15.0),
    (64.7, 26.2),
    (38.0, 58.1),
)


def band_labels(edges: Sequence[float] = BAND_EDGES) -> list[str]:
    """Human labels ``"0-1/16"``, ..., ``"1/2-1"`` for consecutive edges."""

    def frac(x: float) -> str:
        if x == 0 or x == 1:
            return str(int(x))
        return f"1/{round(1 / x)}" if abs(1 / x - round(1 / x)) < 1e-9 else f"{x:g}"

    return [f"{frac(lo)}-{frac(hi)}" for lo, hi in zip(edges[:-1], edges[1:], strict=True)]


def radial_frequency(height: int, width: int) -> np.ndarray:
    """``r[i, j] = sqrt(u_i^2 + v_j^2) / 0.5``: FFT bin radius as a fraction of the grid's Nyquist.

    ``u, v`` are :func:`numpy.fft.fftfreq` frequencies in cycles per sample, so ``r`` runs from 0
    (DC) to 1 on the axes' Nyquist and up to ``sqrt(2)`` in the corners. Shape ``(height, width)``.
    """
    u = np.fft.fftfreq(height)[:, None]
    v = np.fft.fftfreq(width)[None, :]
    return np.sqrt(u**2 + v**2) / 0.5


def band_mask(height: int, width: int, lo: float, hi: float, *, closed: bool = False) -> np.ndarray:
    """Boolean FFT mask ``lo <= r < hi`` (``r <= hi`` when ``closed``), ``r`` from :func:`radial_frequency`."""
    r = radial_frequency(height, width)
    upper = r <= hi if closed else r < hi
    return (r >= lo) & upper


def band_limited_noise(
    shape: tuple[int, int, int, int],
    lo: float,
    hi: float,
    amplitude: float,
    *,
    seed: int = 0,
    closed: bool = False,
) -> torch.Tensor:
    """Gaussian noise of ``shape = (B, C, h, w)`` restricted to the band ``lo <= r < hi``.

    ``n`` is drawn on the CPU in float32 (``torch.Generator`` seeded with ``seed``), every channel's
    2-D FFT is multiplied by :func:`band_mask`, and the real inverse is scaled to an RMS of
    ``amplitude`` over the whole tensor: ``delta = amplitude * n_band / sqrt(mean(n_band^2))``.
    Returns float32 on the CPU. Raises :class:`FlowliftError` when the band holds no FFT bin.
    """
    b, c, h, w = shape
    mask = band_mask(h, w, lo, hi, closed=closed)
    if not mask.any():
        raise FlowliftError(f"latent band {lo:g}-{hi:g} holds no frequency on a {w}x{h} latent grid")
    generator = torch.Generator().manual_seed(int(seed))
    noise = torch.randn(shape, generator=generator, dtype=torch.float32).double()
    spectrum = torch.fft.fft2(noise) * torch.from_numpy(mask)
    band = torch.fft.ifft2(spectrum).real
    rms = band.pow(2).mean().sqrt()
    return (amplitude * band / rms).float()


def pixel_band_fractions(diff: np.ndarray, factor: int, edges: Sequence[float] = BAND_EDGES) -> np.ndarray:
    """Percent of the power of an HW ``diff`` per pixel band, bands in latent-Nyquist fractions.

    With ``P = |FFT(diff)|^2`` and ``r_pix = sqrt(u^2 + v^2) * 2 * factor`` (``u, v`` in cycles per
    pixel), returns ``100 * sum(P[band]) / sum(P)`` for each ``[edges[k], edges[k+1])`` and, last,
    for ``r_pix >= edges[-1]`` ("finer than the latent Nyquist"). The entries sum to 100; an all-zero
    ``diff`` gives all zeros.
    """
    d = np.asarray(diff, dtype=np.float64)
    if d.ndim != 2:
        raise ValueError(f"expected an HW difference map, got shape {d.shape}")
    power = np.abs(np.fft.fft2(d)) ** 2
    r = radial_frequency(*d.shape) * factor  # grid Nyquist 0.5 cyc/px = `factor` latent Nyquists
    total = float(power.sum())
    out = np.zeros(len(edges))
    if total == 0.0:
        return out
    last = len(edges) - 2
    for k, (lo, hi) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
        out[k] = power[(r >= lo) & ((r <= hi) if k == last else (r < hi))].sum()
    out[-1] = power[r > edges[-1]].sum()
    return 100.0 * out / total


def _luma(images: torch.Tensor) -> np.ndarray:
    """(1, 3, H, W) [0, 1] -> HW float64 luma 0.299 R + 0.587 G + 0.114 B."""
    weights = torch.tensor([0.299, 0.587, 0.114], dtype=torch.float64).view(1, 3, 1, 1)
    return (images.detach().cpu().double() * weights).sum(dim=1)[0].numpy()


#: A response whose RMS is under this many rounding steps of the decoded luma (its dtype's epsilon times the luma's
#: RMS) is the decode's rounding, not the band's response: its table would be noise (or, at zero, all zeros). One
#: rounding to nearest leaves an RMS error of about a quarter of a step, two decodes' difference about a third, so at
#: half a step the rounding is a third of the response's power or more. Not more: in bfloat16 the real TAEF2's
#: band 1/4-1/2 responds to the default amplitude 0.1 with 0.0095 RMS (~2.7 steps of a Kodak luma) and its row is
#: within 0.7 points of float32's (kodim01-02).
ROUNDING_STEPS = 0.5


def check_response(diff: np.ndarray, base: np.ndarray, dtype: torch.dtype, band: str, amplitude: float) -> None:
    """One FlowliftError line (naming ``amplitude``, and ``dtype`` below float32) when the luma response ``diff`` to
    a band perturbation is zero or under :data:`ROUNDING_STEPS` rounding steps of the decoded luma ``base`` in
    ``dtype``: the perturbation was lost in the latent's or the decode's rounding."""
    from flowlift.errors import FIELD_MARK

    rms = float(np.sqrt(np.mean(np.square(diff))))
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 1.0
    floor = ROUNDING_STEPS * eps * float(np.sqrt(np.mean(np.square(base))))
    if rms > floor:
        return
    what = "zero" if rms == 0 else f"{rms:.2g} RMS, within the decode's rounding ({floor:.2g})"
    fields: tuple[str, ...] = ("amplitude", "amplitude")
    wider = ""
    if eps > torch.finfo(torch.float32).eps:
        fields, wider = (*fields, "dtype"), f" or decode in float32 ({FIELD_MARK} float32)"
    raise FlowliftError(
        f"latent band {band}: the decoded response to a perturbation of {FIELD_MARK} {amplitude:g} is {what}; "
        f"raise {FIELD_MARK}{wider}",
        field=fields,
    )


@torch.no_grad()
def band_response(
    decode: Decoder,
    latents: torch.Tensor,
    factor: int,
    *,
    amplitude: float = 0.1,
    seed: int = 0,
    edges: Sequence[float] = BAND_EDGES,
) -> np.ndarray:
    """Band response matrix of ``decode`` around one latent, shape ``(bands, bands + 1)`` in %.

    Row ``k``: the pixel-band power fractions (:func:`pixel_band_fractions`) of the luma response
    ``Y(decode(latents + delta_k)) - Y(decode(latents))`` to a band-``k`` perturbation
    ``delta_k = band_limited_noise(..., amplitude, seed=(seed + k) mod 2^64)``; the last band is closed at the
    latent Nyquist. ``latents`` is one (1, C, h, w) latent; the perturbation is added in its dtype on
    its device.
    """
    if latents.ndim != 4 or latents.shape[0] != 1:
        raise ValueError(f"expected one (1, C, h, w) latent, got shape {tuple(latents.shape)}")
    base = _luma(decode(latents))
    rows = []
    n_bands = len(edges) - 1
    for k, (lo, hi) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
        delta = band_limited_noise(
            tuple(latents.shape), lo, hi, amplitude, seed=wrap_seed(seed + k), closed=(k == n_bands - 1)
        )
        perturbed = _luma(decode(latents + delta.to(device=latents.device, dtype=latents.dtype)))
        if perturbed.shape != base.shape:
            raise ValueError("decoder output size changed between calls")
        check_response(perturbed - base, base, latents.dtype, band_labels(edges)[k], amplitude)
        rows.append(pixel_band_fractions(perturbed - base, factor, edges))
    return np.stack(rows)


def format_table(
    matrix: np.ndarray,
    edges: Sequence[float] = BAND_EDGES,
    *,
    full: bool = False,
    reference: Sequence[tuple[float, float]] | None = None,
    reference_name: str = "Mage",
) -> str:
    """Markdown table of a band-response matrix.

    Columns: latent band, % in the same pixel band, % finer than latent Nyquist; ``reference``
    (one ``(same, finer)`` pair per row) adds the card's figures; ``full`` adds every pixel band.
    """
    labels = band_labels(edges)
    header = ["Latent band", "-> same pixel band", "-> finer than latent Nyquist"]
    if reference is not None:
        header += [f"{reference_name}: same", f"{reference_name}: finer"]
    if full:
        header += [f"px {lab}" for lab in labels] + ["px > 1"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for k, label in enumerate(labels):
        cells = [label, f"{matrix[k, k]:.1f}%", f"{matrix[k, -1]:.1f}%"]
        if reference is not None:
            cells += [f"{reference[k][0]:.1f}%", f"{reference[k][1]:.1f}%"]
        if full:
            cells += [f"{v:.1f}" for v in matrix[k]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def heatmap_png(matrix: np.ndarray, title: str, edges: Sequence[float] = BAND_EDGES) -> bytes:
    """The band-response matrix as a heat map (rows latent bands, columns pixel bands): PNG bytes marked as
    flowlift's (its ``Software`` text, which a later run looks for)."""
    import io

    import matplotlib

    from flowlift.files.own_files import software

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    labels = band_labels(edges)
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    im = ax.imshow(matrix, cmap="viridis", vmin=0, vmax=100, aspect="auto")
    ax.set_xticks(range(matrix.shape[1]), labels + ["> 1"])
    ax.set_yticks(range(matrix.shape[0]), labels)
    ax.set_xlabel("pixel band (fraction of latent Nyquist)")
    ax.set_ylabel("perturbed latent band")
    for i in range(matrix.shape[0]):
        for j in range(matrix.shape[1]):
            value = matrix[i, j]
            ax.text(j, i, f"{value:.1f}", ha="center", va="center", color="w" if value < 60 else "k", fontsize=8)
    fig.colorbar(im, ax=ax, label="% of response power")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", metadata={"Software": software("bands")})
    plt.close(fig)
    return buffer.getvalue()


#: Fewest latent FFT bins a band should hold for its row to mean something. A 256 px image (a 32x32
#: latent) has only the DC bin in 0-1/16; from 512 px (64x64 latent) every band has at least 9.
MIN_BINS_PER_BAND = 8


#: A pixel within this many 8-bit levels of black or white in all three channels is saturated: there the decoder's
#: response to a perturbation is weak and lopsided, and what it rectifies lands in the lowest pixel band (TAEF2 at
#: 512 px: a white image sends 65 % of the top latent band's response there, kodim01 0.0 %; docs/measure.md).
SATURATION_LEVELS = 3
#: The share of saturated pixels from which ``flowlift bands`` warns that an image's rows are not the decoder's
#: response to detail (at half, kodim01's lowest band keeps 71 % in its own pixel band; 91 % with that half grey).
MAX_SATURATED_SHARE = 0.25


def saturated_share(rgb: np.ndarray) -> float:
    """The share of an 8-bit HWC RGB image's pixels within :data:`SATURATION_LEVELS` of black or of white in every
    channel."""
    low = (rgb <= SATURATION_LEVELS).all(axis=-1)
    high = (rgb >= 255 - SATURATION_LEVELS).all(axis=-1)
    return float((low | high).mean())


def latent_bin_counts(height: int, width: int, edges: Sequence[float] = BAND_EDGES) -> list[int]:
    """Number of FFT bins of an ``height x width`` latent in each band ``[lo, hi)`` (the last closed)."""
    last = len(edges) - 2
    return [
        int(band_mask(height, width, lo, hi, closed=i == last).sum())
        for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:], strict=True))
    ]


def latent_size(image_height: int, image_width: int, factor: int) -> tuple[int, int]:
    """Latent (h, w) that :func:`run_bands` measures for an image: cropped to ``2 * factor``, divided by ``factor``."""
    multiple = 2 * factor
    return (image_height - image_height % multiple) // factor, (image_width - image_width % multiple) // factor


def crop_to_multiple(images: torch.Tensor, multiple: int) -> torch.Tensor:
    """Centre-crop (B, C, H, W) so that H and W are multiples of ``multiple``."""
    h, w = images.shape[-2:]
    nh, nw = h - h % multiple, w - w % multiple
    if nh == 0 or nw == 0:
        raise FlowliftError(f"image {w}x{h} is smaller than {multiple} pixels")
    top, left = (h - nh) // 2, (w - nw) // 2
    return images[..., top : top + nh, left : left + nw]


def mean_rows(matrices: Sequence[np.ndarray]) -> np.ndarray:
    """Average of per-image band matrices (every image weighs the same)."""
    if not matrices:
        raise FlowliftError("no images to measure")
    return np.mean(np.stack(matrices), axis=0)


def run_bands(
    vae,
    images: Sequence[torch.Tensor],
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    amplitude: float = 0.1,
    seed: int = 0,
    edges: Sequence[float] = BAND_EDGES,
    progress: bool | None = False,
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Band response of ``vae``'s decoder averaged over ``images``; returns ``(mean, per_image)``.

    ``vae`` offers ``encode(images) -> latents``, ``decode(latents) -> images`` (float [0, 1] NCHW,
    normalized latents) and ``spatial_factor``. Each (1, 3, H, W) image is centre-cropped to a
    multiple of ``2 * spatial_factor``, encoded on ``device`` in ``dtype`` and measured with
    :func:`band_response` (same ``seed`` for every image, so every image sees the same noise draw
    where sizes agree).
    """
    from flowlift.console import progress_bar
    from flowlift.models.weights import finite_result

    factor = int(vae.spatial_factor)
    per_image = []
    with progress_bar(images, desc="bands", unit="img", enabled=progress) as bar:
        for number, image in enumerate(bar, 1):
            x = crop_to_multiple(image, 2 * factor).to(device=device, dtype=dtype)
            with torch.no_grad():
                z = finite_result(f"image {number}: the VAE's encoder", vae.encode, x)

            def decode(latents: torch.Tensor, number: int = number) -> torch.Tensor:
                return finite_result(f"image {number}: the VAE's decoder", vae.decode, latents)

            per_image.append(band_response(decode, z, factor, amplitude=amplitude, seed=seed, edges=edges))
    return mean_rows(per_image), per_image
