"""``flowlift bands``'s job: how a VAE decoder maps latent frequency bands to pixel frequency bands.

The command line turns its options into one :class:`BandsRequest` and calls :func:`run_bands_report`: each
image is encoded, one latent band at a time is perturbed (``amplitude`` sigma, FFT mask), decoded, and the luma
response spectrum integrated per pixel band (:func:`flowlift.measure.bands.run_bands`); the mean table (with the
model card's Mage decoder figures alongside), ``bands.json``, ``bands.md`` and ``bands.png`` (heat map).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from flowlift.devices import check_device_and_dtype, resolve_device_dtype
from flowlift.errors import FIELD_MARK, FlowliftError
from flowlift.knobs import Knob

__all__ = ["BandsRequest", "BandsResult", "report_recognisers", "run_bands_report"]

COMMAND = "bands"

#: The smallest square image whose latent (1/8) grid has an FFT bin in every band of the table.
MIN_SIDE = 144
#: The largest perturbation RMS, in latent sigma (the default 0.1).
MAX_AMPLITUDE = 10.0
#: The perturbation: its help and its domain, one declaration for the command line's help and the request's check.
AMPLITUDE = Knob(
    "amplitude",
    float,
    0.1,
    "perturbation RMS in latent sigma (a latent is ~N(0, 1): past a few sigma the decode saturates)",
    low=0.0,
    high=MAX_AMPLITUDE,
    low_open=True,
)
#: The images' longest side; below MIN_SIDE a latent band holds no FFT bin.
MAX_SIDE = Knob(
    "max_side",
    int,
    None,
    f"downscale images (INTER_AREA) so the long side is at most this (below {MIN_SIDE} a latent band holds no FFT bin)",
    low=MIN_SIDE,
    optional=True,
)


@dataclass(frozen=True)
class BandsRequest:
    """Everything one ``flowlift bands`` run asks for: the images (files or folders), the VAE, the report
    folder, the perturbation (``amplitude`` RMS in latent sigma; band k's noise seed is ``seed + k``), the
    images' longest side (``max_side``, None: as they are) and count (``limit``), ``full`` (every pixel band
    in the printed table, not only the two summaries); ``device``/``dtype`` as the command line spells them."""

    images: Sequence[str]
    vae: str
    output: str | os.PathLike
    amplitude: float = 0.1
    seed: int = 0
    max_side: int | None = None
    limit: int | None = None
    full: bool = False
    overwrite: bool = False
    device: str = "auto"
    dtype: str = "auto"
    progress: bool | None = False  # flowlift.console.progress_bar's enabled

    def __post_init__(self) -> None:
        """Every field checked when the request is made (one line naming it, before anything is read or loaded)."""
        from flowlift.knobs import OVERWRITE, SEED, check_kind, check_path, check_paths, check_positive

        images = check_paths("images", self.images)
        if not images:
            raise FlowliftError("images: give image files or folders", field="images")
        object.__setattr__(self, "images", tuple(str(item) for item in images))
        check_path("vae", self.vae)
        check_path("output", self.output)
        object.__setattr__(self, "amplitude", float(AMPLITUDE.check(self.amplitude)))
        object.__setattr__(self, "seed", SEED.check(self.seed))
        object.__setattr__(self, "max_side", MAX_SIDE.check(self.max_side))
        object.__setattr__(self, "limit", check_positive("limit", self.limit, integer=True, optional=True))
        check_kind("full", self.full, bool, "True or False")
        object.__setattr__(self, "overwrite", OVERWRITE.check(self.overwrite))
        check_kind("device", self.device, str, "a device name such as auto, cpu or cuda")
        check_device_and_dtype(self.device, self.dtype)
        check_kind("progress", self.progress, bool, "True, False", optional=True)


@dataclass(frozen=True)
class BandsResult:
    """What :func:`run_bands_report` made: the table (as the command prints it) and the files it wrote."""

    table: str
    paths: list[Path]


def report_recognisers(out_dir: Path) -> dict:
    """The files ``flowlift bands`` writes into ``out_dir``, with how flowlift's own is told."""
    from flowlift.files.own_files import flowlift_image, json_report, markdown_report

    return {
        out_dir / "bands.json": json_report(COMMAND, {"vae", "band_edges", "mean_percent"}),
        out_dir / "bands.md": markdown_report(COMMAND),
        out_dir / "bands.png": flowlift_image,
    }


def _check_every_band_holds_a_bin(path: Path, size: tuple[int, int], max_side: int | None) -> None:
    """One line when an image (``size`` (h, w) as measured) is too small for a latent band to hold any FFT bin
    on its latent grid (1/8 of the pixels, every flowlift VAE's): its row could not be measured."""
    from flowlift.flux2.latents import VAE_SCALE_FACTOR
    from flowlift.measure import bands as B

    grid = B.latent_size(*size, VAE_SCALE_FACTOR)
    fix = f"; raise --max-side ({max_side})" if max_side is not None else ""
    if min(grid) < 1:  # cropped to a multiple of 2 latent pixels, nothing is left: no grid to count bins on
        raise FlowliftError(
            f"{path}: {size[1]}x{size[0]} px is too small: it has no latent grid "
            f"(give images of at least {MIN_SIDE} px a side{fix})"
        )
    counts = B.latent_bin_counts(*grid)
    if min(counts) == 0:
        empty = counts.index(0)
        lo, hi = B.BAND_EDGES[empty], B.BAND_EDGES[empty + 1]
        raise FlowliftError(
            f"{path}: {size[1]}x{size[0]} px is too small: the latent band {lo:g}-{hi:g} holds no frequency on its "
            f"{grid[1]}x{grid[0]} latent grid (give images of at least {MIN_SIDE} px a side{fix})"
        )


def _warn_saturated(shares: dict[str, float]) -> None:
    """One warning line when an image is mostly black or white (:func:`flowlift.measure.bands.saturated_share` past
    :data:`~flowlift.measure.bands.MAX_SATURATED_SHARE`): its decode saturates, and its rows say so, not what the
    decoder does with detail."""
    from flowlift.measure import bands as B

    over = {stem: share for stem, share in shares.items() if share >= B.MAX_SATURATED_SHARE}
    if over:
        stem, share = max(over.items(), key=lambda item: item[1])
        print(
            f"flowlift bands: warning: {len(over)} image(s) with {B.MAX_SATURATED_SHARE:.0%} or more of their pixels "
            f"black or white (e.g. {stem}: {share:.0%}); the decoder saturates there and moves a perturbation's "
            "power into the lowest pixel band: use images with detail in their mid-tones",
            file=sys.stderr,
        )


def run_bands_report(request: BandsRequest) -> BandsResult:
    """Check the request and the report's names (the replace rule, before any image or model loads), measure
    every image's band response (:func:`flowlift.measure.bands.run_bands`), write ``bands.json``, ``bands.md``
    and ``bands.png`` into ``request.output``; the table to print and the paths written."""
    import numpy as np

    from flowlift.files.atomic_set import atomic_write_set
    from flowlift.files.images import list_images, load_image, to_tensor
    from flowlift.measure import bands as B
    from flowlift.measure import metrics as M
    from flowlift.measure.cache import model_identity
    from flowlift.models.vae_loading import ENCODE_DECODE, load_vae

    device, dtype = resolve_device_dtype(request.device, request.dtype)  # before anything is read
    out_dir = Path(request.output)
    if out_dir.exists() and not out_dir.is_dir():
        raise FlowliftError(f"{FIELD_MARK} {out_dir} exists and is not a folder", field="output")
    from flowlift.files.output_paths import check_report_folder, folder_problem
    from flowlift.files.own_files import check_replaceable, markdown_stamp, report_json, stamp

    if problem := folder_problem(out_dir):  # before any image is read or model loads: the write came after it all
        raise FlowliftError(problem, field="output")
    check_report_folder(out_dir, {"images": request.images})  # its bands.png would be measured next time
    # before any image or model loads
    check_replaceable(report_recognisers(out_dir), request.overwrite, COMMAND, FIELD_MARK)
    paths = list_images(request.images)[: request.limit]
    if not paths:
        raise FlowliftError("no images given")
    images, saturated = [], {}
    for p in paths:
        a = np.asarray(load_image(p)[0])
        h, w = a.shape[:2]
        if request.max_side is not None and max(h, w) > request.max_side:
            s = request.max_side / max(h, w)
            a = np.rint(M.area_resize(a, (round(w * s), round(h * s))) * 255).astype(np.uint8)
        images.append(to_tensor(a))
        saturated[p.stem] = B.saturated_share(a)
        _check_every_band_holds_a_bin(p, a.shape[:2], request.max_side)  # before the VAE loads
    vae = load_vae(request.vae, device=device, dtype=dtype, needs=ENCODE_DECODE)
    mean, per_image = B.run_bands(
        vae,
        images,
        device=device,
        dtype=dtype,
        amplitude=request.amplitude,
        seed=request.seed,
        progress=request.progress,
    )
    factor = int(vae.spatial_factor)
    bins = {
        p.stem: B.latent_bin_counts(*B.latent_size(*im.shape[-2:], factor)) for p, im in zip(paths, images, strict=True)
    }
    sparse = {stem: counts for stem, counts in bins.items() if min(counts) < B.MIN_BINS_PER_BAND}
    if sparse:
        stem, counts = min(sparse.items(), key=lambda item: min(item[1]))
        small = request.max_side is not None and request.max_side < 64 * factor
        shrunk = f" (--max-side {request.max_side} shrinks them below it)" if small else ""
        print(
            f"flowlift bands: warning: {len(sparse)} image(s) too small for every band to hold "
            f">= {B.MIN_BINS_PER_BAND} latent FFT bins (e.g. {stem}: {counts} per band, lowest first); "
            f"their low-band rows are noise — use images of at least {64 * factor} px a side{shrunk}",
            file=sys.stderr,
        )
    _warn_saturated(saturated)
    title = f"{Path(str(request.vae)).name}: latent->pixel band response, {len(images)} image(s)"
    table = B.format_table(mean, full=request.full, reference=B.MAGE_REFERENCE)
    full_table = B.format_table(mean, full=True)
    payload = {
        "flowlift": stamp(COMMAND),  # how a later run knows bands.json as flowlift's own
        "vae": str(request.vae),
        "vae_identity": model_identity(request.vae),
        "spatial_factor": int(vae.spatial_factor),
        "amplitude": request.amplitude,
        "seed": request.seed,
        "max_side": request.max_side,
        "band_edges": list(B.BAND_EDGES),
        "labels": B.band_labels(),
        "columns": B.band_labels() + ["finer than latent Nyquist"],
        "mean_percent": mean.tolist(),
        "min_bins_per_band": B.MIN_BINS_PER_BAND,
        "latent_bins_per_band": bins,
        "saturated_share": saturated,
        "images": {p.stem: m.tolist() for p, m in zip(paths, per_image, strict=True)},
        "reference_mage_same_finer": [list(r) for r in B.MAGE_REFERENCE],
    }
    markdown = f"{markdown_stamp(COMMAND)}{title}\n\n{table}\n\nFull rows (% per pixel band):\n\n{full_table}\n"
    rendered = {  # every file in memory first, then put in place as one set: a stop leaves the old report or the new
        out_dir / "bands.json": report_json(payload),
        out_dir / "bands.md": markdown.encode(),
        out_dir / "bands.png": B.heatmap_png(mean, title),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    return BandsResult(table, atomic_write_set(rendered))
