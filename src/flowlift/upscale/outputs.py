"""``flowlift upscale``'s per-image work, shared by the command and the web app.

The command line's job is planned in :mod:`flowlift.upscale.plan` and the web app validates its
form; both describe a request as one :class:`UpscaleSettings`, and this module turns one planned input
into one written output: the pipeline call with those settings, the metadata (parameters, the dtype
and device that ran, weight and source hashes), and the atomic write that keeps the input's ICC
profile and EXIF.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowlift.upscale.loading import DEFAULT_UPSCALER, DEFAULT_VAE


@dataclass(frozen=True)
class UpscaleSettings:
    """What one ``flowlift upscale`` request asks of every image: the pipeline's per-image options and
    what the output's metadata records (``upscaler=None`` is the released weights)."""

    seed: int | list[int] = 0
    color_fix: bool = True
    transplant_strength: float = 1.0
    color_fix_strength: float = 1.0
    resize_mode: str = "pad"
    vae: str = DEFAULT_VAE
    upscaler: str | None = None
    quality: int | None = None
    latent_upscaler: str | None = None  # "sesqui:PATH": the fraction of an asked size in latent space

    def __post_init__(self) -> None:
        """Every field checked by its knob when the settings are made (one line naming it)."""
        from flowlift.knobs import COLOR_FIX, LATENT_UPSCALER, check_path, check_quality, check_seed
        from flowlift.upscale.settings import COLOR_FIX_STRENGTH, RESIZE_MODE, TRANSPLANT_STRENGTH

        object.__setattr__(self, "seed", check_seed(self.seed))
        object.__setattr__(self, "color_fix", COLOR_FIX.check(self.color_fix))
        object.__setattr__(self, "transplant_strength", TRANSPLANT_STRENGTH.check(self.transplant_strength))
        object.__setattr__(self, "color_fix_strength", COLOR_FIX_STRENGTH.check(self.color_fix_strength))
        object.__setattr__(self, "resize_mode", RESIZE_MODE.check(self.resize_mode))
        check_path("vae", self.vae)
        check_path("upscaler", self.upscaler, optional=True)
        object.__setattr__(self, "latent_upscaler", LATENT_UPSCALER.check(self.latent_upscaler))
        object.__setattr__(self, "quality", check_quality(self.quality))

    def pipeline_options(self) -> dict[str, Any]:
        """The :meth:`FlowUpscalerPipeline.upscale_image` keyword arguments these settings set."""
        return {
            "seed": self.seed,
            "color_fix": self.color_fix,
            "transplant_strength": self.transplant_strength,
            "color_fix_strength": self.color_fix_strength,
            "resize_mode": self.resize_mode,
        }


def output_metadata(
    settings: UpscaleSettings,
    passes: int,
    source: Path,
    hashes: dict[str, str],
    pipeline: Any,
    asked: Any = None,
    size: tuple[int, int] | None = None,
    latent_upscaler: str | None = None,
) -> dict[str, object]:
    """The output file's metadata (:mod:`flowlift.files.metadata`, schema 1): the parameters, what ran, the input
    and the weight files' hashes. ``asked`` (an :class:`~flowlift.upscale.asked_size.AskedSize` that is not a power
    of two) and ``size`` (the output's (width, height)): recorded as asked, beside the passes that ran;
    ``latent_upscaler`` where it ran for the fraction (its file's hash in ``models`` then, and only then)."""
    from flowlift.files.image_outputs import file_sha256
    from flowlift.files.metadata import metadata_record

    request = {"scale": 2**passes} if asked is None else {**asked.record(), "size": list(size)}
    request.update({"latent_upscaler": latent_upscaler} if latent_upscaler is not None else {})
    return metadata_record(
        "upscale",
        {
            "input": source.name,
            "input_sha256": file_sha256(source),
            **request,
            "passes": passes,
            "seed": settings.seed,
            "color_fix": settings.color_fix,
            "transplant_strength": settings.transplant_strength,
            "color_fix_strength": settings.color_fix_strength,
            "resize_mode": settings.resize_mode,
            "vae": settings.vae,
            "upscaler": settings.upscaler or DEFAULT_UPSCALER,
            "dtype": str(pipeline.dtype).removeprefix("torch."),  # what ran, not "auto"
            "device": str(pipeline.device),
            "models": {role: files for role, files in hashes.items() if role != "latent_upscaler" or latent_upscaler},
        },
    )


def model_hashes(pipeline: Any, hash_file: Callable[[Path], str] | None = None) -> dict[str, dict[str, str]]:
    """SHA-256 of every weight file behind ``pipeline`` by role: the metadata's ``models``. ``hash_file`` (default
    :func:`~flowlift.models.hub.weight_file_sha256`) lets a caller that holds several pipelines over the same files
    (the web app) hash each file once."""
    from flowlift.models.hub import weight_file_sha256

    digest = hash_file or weight_file_sha256
    return {role: {p.name: digest(p) for p in paths} for role, paths in pipeline.model_files().items() if paths}


def output_name(source: Path, scale: float | tuple[int, int], output_format: str | None = "png") -> str:
    """The file name of ``source``'s result: ``<stem>_x<scale>.<format>`` (``_x4``, ``_x1.5``), or
    ``<stem>_<W>x<H>.<format>`` for a (width, height) (also the web app's names; no format: png)."""
    from flowlift.files.naming import upscaled_name

    return upscaled_name(source.stem, scale, output_format or "png")


@dataclass
class SourcePixels:
    """One input as the upscaler takes it and as its output must be written.

    ``image`` is the 8-bit RGB view (sizes, previews); ``pixels`` what the pipeline gets: ``image``
    itself, or a float tensor of the file's 16-bit samples when the output keeps 16 bits
    (``alpha16`` is then the 16-bit alpha). ``alpha`` is None when the output format cannot hold it.
    """

    image: Any
    pixels: Any
    alpha: Any = None
    alpha16: Any = None

    @property
    def sixteen_bit(self) -> bool:
        return self.pixels is not self.image


def read_source(source: Path, out: Path) -> SourcePixels:
    """Load ``source`` for writing ``out``: 16-bit samples kept when ``out`` is a PNG or TIFF; one
    warning line (before any work) when ``out``'s format drops the 16 bits or the alpha channel."""
    from flowlift.errors import FlowliftWarning
    from flowlift.files.image_outputs import ALPHA_SUFFIXES, warn_alpha_dropped
    from flowlift.files.images import load_image, to_tensor
    from flowlift.files.sixteen_bit import sixteen_bit_source

    image, alpha = load_image(source)
    if alpha is not None and out.suffix.lower() not in ALPHA_SUFFIXES:
        warn_alpha_dropped(out)
        alpha = None
    deep = sixteen_bit_source(source, out)
    if deep is not None and (deep[0].shape[1], deep[0].shape[0]) != image.size:
        warnings.warn(
            FlowliftWarning(f"{source}: its 16-bit samples do not match the image; written 8-bit"), stacklevel=2
        )
        deep = None
    if deep is None:
        return SourcePixels(image, image, alpha)
    rgb16, alpha16 = deep
    return SourcePixels(image, to_tensor(rgb16), alpha, alpha16 if alpha is not None else None)


def upscale_file(
    pipeline: Any,
    settings: UpscaleSettings,
    passes: int,
    source: Path,
    out: Path,
    hashes: dict[str, dict[str, str]],
    on_stage: Callable[[str], None] | None = None,
    on_decode_tile: Callable[[int, int], None] | None = None,
    resample_to: tuple[int, int] | None = None,
    asked: Any = None,
) -> tuple[Any, Any, list[str]]:
    """Load ``source``, upscale it with ``settings``, write ``out`` atomically with the metadata.

    Returns (input image, result image, warnings such as passes dropped at MAX_OUTPUT_SIDE). The one
    per-image step of ``flowlift upscale``; the web app calls it too (with progress callbacks: the
    pipeline's ``callback`` and ``on_decode_tile``). A 16-bit input stays 16-bit in a PNG or TIFF output
    (:func:`read_source`).
    """
    loaded = read_source(source, out)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        result = pipeline.upscale_image(
            loaded.pixels,
            num_passes=passes,
            callback=on_stage,
            on_decode_tile=on_decode_tile,
            output_type="pt",
            output_size=resample_to,
            **settings.pipeline_options(),
        )
    ran = passes if resample_to is not None else None
    picture = save_result(pipeline, settings, source, out, loaded, result, hashes, ran, asked)
    return loaded.image, picture, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def save_result(
    pipeline: Any,
    settings: UpscaleSettings,
    source: Path,
    out: Path,
    loaded: SourcePixels,
    result: Any,
    hashes: dict,
    passes: int | None = None,
    asked: Any = None,
) -> Any:
    """Write ``result`` (a float (1, 3, H, W) tensor upscaled from ``loaded``) atomically with its
    metadata, named in the metadata by the passes that actually ran (fewer when MAX_OUTPUT_SIDE
    dropped some; ``passes`` and ``asked`` given: resampled to an asked size); 16-bit when ``loaded`` is. Returns
    the result as an 8-bit Pillow image (previews)."""
    from flowlift.files.alpha import attach_alpha
    from flowlift.files.image_outputs import save_image_atomic
    from flowlift.files.images import tensor_to_pil
    from flowlift.files.sixteen_bit import resize_alpha16, save_image16_atomic, tensor_to_uint16

    picture = attach_alpha(tensor_to_pil(result), loaded.alpha)
    if passes is None:  # the passes' own size: named by what ran
        ran, asked = max(0, round(math.log2(max(picture.size[0] / loaded.image.size[0], 1.0)))), None
    else:  # resampled to an asked size: the request and the passes before the resample
        ran = passes
    latent = getattr(pipeline, "latent_upscaler", None) if asked is not None else None
    if latent is not None:  # recorded only where SesquiLSR had a fraction to do
        from flowlift.upscale.latent_fraction import fraction_runs

        width, height = loaded.image.size
        latent = latent if fraction_runs(height, width, settings.resize_mode, ran, picture.size) else None
    metadata = output_metadata(settings, ran, source, hashes, pipeline, asked, picture.size, latent)
    if loaded.sixteen_bit:
        alpha16 = None if loaded.alpha16 is None else resize_alpha16(loaded.alpha16, picture.size)
        save_image16_atomic(tensor_to_uint16(result), alpha16, out, metadata, source=source)
        return picture
    save_image_atomic(
        picture,
        out,
        metadata,
        source=source,  # the input's ICC profile and EXIF
        quality=settings.quality,
        overwrite=True,  # the job's own rule ran before any work (--overwrite, flowlift's own or empty files)
    )
    return picture
