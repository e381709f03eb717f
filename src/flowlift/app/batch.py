"""The Batch tab's request, without Gradio: every upload upscaled as ``flowlift upscale`` upscales a folder, into one
zip of the outputs under the command's names; a file that fails is listed and the rest go on.

The service is reached through its public methods only (:meth:`~flowlift.app.service.AppService.validate`,
``new_result_dir``, ``settings``, ``plan``, ``pipeline``, ``named_by_vae``, ``upscale_into``), as the Refine tab's
:mod:`flowlift.app.refine` reaches it.
"""

from __future__ import annotations

import time
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flowlift.app.progress import ProgressFn, request_progress
from flowlift.app.results import BatchResult, logged_request, public_message, strip_folders
from flowlift.errors import ITEM_ERRORS, FlowliftError


def batch_uploads(service: Any, paths: Sequence[str | Path] | None, values: tuple, progress: ProgressFn) -> BatchResult:
    """Upscale every file of ``paths`` with the request's ``values`` (scale, seed, the two strengths, the VAE, the
    latent upscaler: :meth:`~flowlift.app.service.AppService.validate`'s order) into one zip; one log line."""
    from flowlift.progress import running

    started = time.perf_counter()
    run = request_progress(progress)  # the request's clock from the click: loading the models counts in its time
    run.loading(None)
    with (
        running(run),
        logged_request(service.config.log, "batch", f"{len(paths or [])} file(s)", f"x{values[0]}") as entry,
    ):
        if not paths:
            raise FlowliftError("no files uploaded")
        sources = [Path(p) for p in paths]
        scale, seed, transplant, color_fix, vae, latent = service.validate(*values)
        folder = service.new_result_dir()
        out_dir = folder / f"x{scale:g}"
        settings = service.settings(seed, transplant, color_fix, vae, latent)
        planned = service.plan(sources, out_dir, scale, latent)
        _expect_stages(run, planned)
        pipeline = service.pipeline(vae, latent)
        written: list[Path] = []
        errors: list[str] = []
        warnings: list[str] = []
        for job in planned.jobs:
            out = service.named_by_vae(job.output, vae)
            if out is None:
                errors.append(f"{job.source.name}: {strip_folders(job.note, [*(s.parent for s in sources), out_dir])}")
                continue
            try:
                done = service.upscale_into(job.source, out, settings, planned.sizes, pipeline, (vae, latent))
                written.append(out)
                warnings += [
                    f"{job.source.name}: {note}" for note in ([job.warning] if job.warning else []) + done.warnings
                ]
            except ITEM_ERRORS as error:
                errors.append(public_message(error, job.source))
        zip_path = _zip(folder / f"flowlift_x{scale:g}.zip", written) if written else None
        progress(1.0, "done")
        result = BatchResult(zip_path, [p.name for p in written], errors, time.perf_counter() - started, warnings)
        if result.errors:
            entry.outcome = f"{len(result.written)} ok, {len(result.errors)} failed"
    return result


def _expect_stages(run: Any, planned: Any) -> None:
    """Every planned image's stages on the request's run, so the time left covers the whole batch (an image whose
    header cannot be read is left out: its own step says what is wrong)."""
    from flowlift.upscale.stages import UpscaleStages

    expected = []
    for job in planned.jobs:
        if job.output is None or planned.sizes.input_size(job.source) is None:  # the plan read each header once
            continue
        expected.append(planned.sizes.planned_image(job.source))
    UpscaleStages(run).expect(expected)


def _zip(path: Path, files: Sequence[Path]) -> Path:
    """``files`` stored (PNGs are compressed already) in a zip written atomically at ``path``."""
    from flowlift.files.atomic import atomic_output

    with atomic_output(path) as temporary, zipfile.ZipFile(temporary, "w") as archive:
        for file in files:
            archive.write(file, file.name, compress_type=zipfile.ZIP_STORED)
    return path
