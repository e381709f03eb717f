"""``flowlift colorfix``'s job: stage 2 of the colour fix for images made by any upscaler, planned once, then run.

The command line turns its options into one :class:`ColorFixRequest` and calls :func:`run_colorfix`.
:func:`plan_colorfix` pairs each upscaled image with the source it was made from by name (the same stem, or
``<stem>_x<N>`` for ``<stem>``, as ``flowlift eval`` pairs them; one folder may hold both sides, and one file
given with one reference file is a pair whatever their names) and plans one job per pair through
:mod:`flowlift.jobs.batch` (atomic writes; a previous run's whole output is skipped and a user's file at an output's
name fails that image in one line, unless ``overwrite``; one line per failed image). Each job
(:func:`flowlift.upscale.colorfix_image.color_fix_image`, or on 16-bit samples
:func:`~flowlift.upscale.colorfix_image.color_fix_array`) writes ``<stem>_colorfix.<format>`` with its metadata and
the upscaled image's ICC profile and EXIF.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowlift.errors import FlowliftError, from_field
from flowlift.knobs import OVERWRITE, check_path, check_paths, check_quality
from flowlift.upscale.settings import COLOR_FIX_KNOBS

COMMAND = "colorfix"


@dataclass(frozen=True)
class ColorFixRequest:
    """One colour-fix run: the upscaled ``inputs`` and their ``references`` (files, folders, glob patterns), the
    ``output`` (a folder, a file for one input, None: next to each input), ``strength``, ``output_format``,
    ``quality``, ``overwrite`` and the resolved ``device``."""

    inputs: Sequence[str]
    references: Sequence[str]
    output: str | None = None
    strength: float = COLOR_FIX_KNOBS["strength"].default
    output_format: str = "png"
    quality: int | None = None
    overwrite: bool = False
    device: Any = "cpu"

    def __post_init__(self) -> None:
        """Every field checked when the request is made (one line naming it, before any image is read)."""
        from flowlift.devices import resolve_device_option
        from flowlift.files.output_paths import check_output_format

        for name in ("inputs", "references"):
            paths = check_paths(name, getattr(self, name))  # one path string is one path, never its characters
            if not paths:
                raise FlowliftError(f"{name}: give image files, folders or glob patterns", field=name)
            object.__setattr__(self, name, tuple(str(item) for item in paths))
        check_path("output", self.output, optional=True)
        object.__setattr__(self, "strength", COLOR_FIX_KNOBS["strength"].check(self.strength))
        object.__setattr__(self, "quality", check_quality(self.quality))
        object.__setattr__(self, "overwrite", OVERWRITE.check(self.overwrite))
        object.__setattr__(self, "device", resolve_device_option(self.device))
        check_output_format(self.output_format)


def plan_colorfix(request: ColorFixRequest) -> tuple[list[Any], dict[Path, Path]]:
    """The jobs and each upscaled input's reference.

    Inputs pair with references by name (:func:`flowlift.files.naming.reference_of`), never with
    themselves, so a folder given as both inputs and references fixes ``photo_x2.png`` against ``photo.png``; an input
    that pairs with nothing is skipped when it is itself a reference (a source given with its
    upscales), else refused in one line. Nothing is written.
    """
    from flowlift.files.images import image_size, list_images
    from flowlift.files.naming import colorfix_name, explicit_pair, index_by_stem, reference_of, source_stem
    from flowlift.files.output_paths import check_not_an_input
    from flowlift.jobs.batch import Job, no_images_in, plan_jobs

    inputs, refs = list(request.inputs), list(request.references)
    pair = explicit_pair(inputs, refs)
    found = list_images(inputs)
    if not found:
        raise no_images_in(inputs)
    if pair is not None:
        paired = {found[0]: pair[1]}
        reference_files: set[Path] = set()
    else:
        references = index_by_stem(list_images(refs), "reference")
        paired = {p: ref for p in found if (ref := reference_of(p, references)) is not None}
        reference_files = {p.resolve() for p in references.values()}
    jobs = []
    for p in found:
        if p in paired:
            continue
        if p.resolve() in reference_files:
            jobs.append(Job.skip(p, "skipped, it is a reference"))
        else:
            stems = " or ".join(dict.fromkeys(s for s in (p.stem, source_stem(p.stem)) if s))
            jobs.append(Job.refusal(p, f"no reference named {stems} among the references"))
    upscaled = [p for p in found if p in paired]
    fmt = request.output_format
    jobs += plan_jobs(
        upscaled,
        request.output,
        lambda path: colorfix_name(path.stem, fmt),
        expected_size=image_size,
        check_output=lambda path, out: check_not_an_input(out, {"references": paired[path]}),
    )
    return jobs, paired


def _metadata(strength: float, source: Path, reference: Path, scale: int) -> dict[str, object]:
    from flowlift.files.image_outputs import file_sha256
    from flowlift.files.metadata import metadata_record

    return metadata_record(
        COMMAND,
        {
            "input": source.name,
            "input_sha256": file_sha256(source),
            "reference": reference.name,
            "reference_sha256": file_sha256(reference),
            "color_fix_strength": strength,
            "scale": scale,
        },
    )


def fix_file(request: ColorFixRequest, path: Path, reference: Path, out: Path) -> None:
    """One job: ``path`` fixed against ``reference`` into ``out`` (16 bits in, 16 bits out)."""
    import numpy as np

    from flowlift.files.image_outputs import save_image_atomic
    from flowlift.files.images import load_image
    from flowlift.files.sixteen_bit import has_16bit_samples, load_image_16bit, save_image16_atomic, sixteen_bit_source
    from flowlift.upscale.colorfix_image import color_fix_array, color_fix_image, integer_scale

    image, alpha = load_image(path)
    with from_field("references"):  # the reference's own problem, not the input's: says --reference
        source, _ = load_image(reference)
    scale = integer_scale(image.size, source.size)
    metadata = _metadata(request.strength, path, reference, scale)
    deep = sixteen_bit_source(path, out)
    if deep is not None:  # 16 bits in, 16 bits out: the fix runs on the samples themselves
        ref16 = load_image_16bit(reference) if has_16bit_samples(reference) else None
        ref = ref16[0] if ref16 is not None else np.asarray(source)
        fixed = color_fix_array(deep[0], ref, request.strength, device=request.device)
        save_image16_atomic(fixed, deep[1] if alpha is not None else None, out, metadata, source=path)
        return
    if alpha is not None:
        image.putalpha(alpha)
    result = color_fix_image(image, source, request.strength, device=request.device)
    save_image_atomic(result, out, metadata, source=path, quality=request.quality, overwrite=request.overwrite)


def run_colorfix(request: ColorFixRequest) -> int:
    """Plan the request and run its jobs (:func:`flowlift.jobs.batch.run_jobs`); returns the exit status."""
    from flowlift.jobs.batch import run_jobs

    jobs, paired = plan_colorfix(request)
    return run_jobs(
        jobs, lambda path, out: fix_file(request, path, paired[path], out), command=COMMAND, overwrite=request.overwrite
    ).exit_code
