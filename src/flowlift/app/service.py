"""What ``flowlift app`` does per request, without Gradio: upscale one file, a batch into a zip, refine.

:class:`AppService` holds the models of one process (loaded on first use, reused by every request)
and turns an uploaded file into result files the way ``flowlift upscale`` does: the same output
names (``<stem>_x<scale>.png``), the same per-image step and the same PNG metadata, all from
:mod:`flowlift.upscale.outputs` (one :class:`~flowlift.upscale.outputs.UpscaleSettings` per request),
so the app and the command cannot drift apart. Every user error is
one :class:`~flowlift.errors.FlowliftError` line that names the uploaded file, never the server's
temporary path. :mod:`flowlift.app.page` is the Gradio page over this.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowlift.errors import FlowliftError
from flowlift.jobs.batch import ITEM_ERRORS

#: Progress reporter: ``progress(fraction_done, description)``.
ProgressFn = Callable[[float, str], None]

SCALES = (2, 4, 8)
DEFAULT_MAX_UPLOAD_MB = 50.0
#: Longest side of the before/after preview sent to the browser (the download is full resolution).
PREVIEW_MAX_SIDE = 2048
#: Result folders older than this are removed when a new request starts (Gradio keeps its own copy).
RESULT_MAX_AGE_S = 3600.0


def _no_progress(_fraction: float, _description: str) -> None:
    return None


@dataclass
class AppConfig:
    """The models and limits of one app process (the ``flowlift app`` options)."""

    upscaler: str | None = None
    vaes: Sequence[str] = ("flux2",)
    device: str | None = None
    dtype: str = "auto"
    max_upload_mb: float = DEFAULT_MAX_UPLOAD_MB
    model: str | None = None
    model_vae: str | None = None
    work_dir: Path | None = None

    def __post_init__(self) -> None:
        self.vaes = list(dict.fromkeys(self.vaes)) or ["flux2"]
        if self.max_upload_mb <= 0:
            raise FlowliftError(f"--max-upload-mb must be > 0, got {self.max_upload_mb}")


@dataclass
class UpscaleResult:
    """One upscaled file: the full-resolution PNG, the preview pair, and what to show under it."""

    output: Path
    before: Any
    after: Any
    input_size: tuple[int, int]
    output_size: tuple[int, int]
    seconds: float
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One Markdown paragraph: sizes, time, warnings."""
        (w0, h0), (w1, h1) = self.input_size, self.output_size
        text = f"**{self.output.name}**: {w0}x{h0} → **{w1}x{h1}** px in {self.seconds:.1f} s"
        for warning in self.warnings:
            text += f"\n\n⚠️ {warning}"
        return text


@dataclass
class BatchResult:
    """A batch: the zip of every output written (None when nothing succeeded) and one line per failure."""

    zip_path: Path | None
    written: list[str]
    errors: list[str]
    seconds: float

    def summary(self) -> str:
        total = len(self.written) + len(self.errors)
        lines = [f"{len(self.written)} of {total} file(s) upscaled in {self.seconds:.1f} s"]
        lines += [f"- ✅ {name}" for name in self.written]
        lines += [f"- ❌ {error}" for error in self.errors]
        return "\n".join(lines)


def check_upload(path: str | Path, max_upload_mb: float) -> Path:
    """The uploaded file as a Path, or one error line when it is missing or over ``max_upload_mb``."""
    path = Path(path)
    if not path.is_file():
        raise FlowliftError(f"{path.name}: the upload is missing on the server; upload it again")
    size_mb = path.stat().st_size / 2**20
    if size_mb > max_upload_mb:
        raise FlowliftError(
            f"{path.name}: {size_mb:.1f} MB is over the {max_upload_mb:g} MB upload limit (--max-upload-mb)"
        )
    return path


def _public_message(error: BaseException, path: Path) -> str:
    """An error's first line with the server-side folder of ``path`` cut off (only the file name stays)."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    text = text.replace(str(path), path.name)
    return text if text.startswith(path.name) else f"{path.name}: {text}"


def _strip_folders(text: str, folders: Sequence[Path]) -> str:
    """``text`` with the server-side ``folders`` cut from any path in it (users see file names only)."""
    for folder in sorted({str(f) for f in folders}, key=len, reverse=True):
        text = text.replace(folder + "/", "")
    return text


def preview_pair(image: Any, result: Any, max_side: int = PREVIEW_MAX_SIDE) -> tuple[Any, Any]:
    """(input Lanczos-resized, output) at the output's size, both shrunk to fit ``max_side``."""
    from PIL import Image

    width, height = result.size
    shrink = min(1.0, max_side / max(width, height))
    size = (max(1, round(width * shrink)), max(1, round(height * shrink)))
    before = image.convert("RGB").resize(size, Image.Resampling.LANCZOS)
    after = result.convert("RGB")
    if after.size != size:
        after = after.resize(size, Image.Resampling.LANCZOS)
    return before, after


class AppService:
    """Models loaded once per process and the request handlers of ``flowlift app``.

    The Flow Upscaler UNet is loaded on the first request and shared by the pipelines of every
    configured VAE; each VAE is loaded on its first use. Loading is serialized by a lock, so two
    first requests never load twice.
    """

    def __init__(self, config: AppConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._pipelines: dict[str, Any] = {}
        self._hashes: dict[str, dict[str, dict[str, str]]] = {}
        self._refiner: Any = None
        self._hires_pipeline: Any = None
        self._own_work_dir = config.work_dir is None
        self.work_dir = Path(config.work_dir or tempfile.mkdtemp(prefix="flowlift-app-"))
        self.work_dir.mkdir(parents=True, exist_ok=True)

    # -- models ------------------------------------------------------------------------------------

    @property
    def upscaler_source(self) -> str:
        from flowlift.upscale.loading import DEFAULT_UPSCALER

        return self.config.upscaler or DEFAULT_UPSCALER

    def _torch_dtype(self) -> Any:
        import torch

        return None if self.config.dtype == "auto" else getattr(torch, self.config.dtype)

    def pipeline(self, vae: str, progress: ProgressFn = _no_progress) -> Any:
        """The :class:`~flowlift.upscale.pipeline.FlowUpscalerPipeline` for ``vae`` (one of the configured VAEs)."""
        if vae not in self.config.vaes:
            raise FlowliftError(f"VAE {vae!r} is not configured; choose one of {', '.join(self.config.vaes)}")
        with self._lock:
            if vae in self._pipelines:
                return self._pipelines[vae]
            from flowlift.upscale.outputs import model_hashes
            from flowlift.upscale.pipeline import FlowUpscalerPipeline

            first = next(iter(self._pipelines.values()), None)
            progress(0.0, f"loading the Flow Upscaler and VAE {vae} (once per server)")
            if first is None:
                pipe = FlowUpscalerPipeline(
                    self.upscaler_source, vae, dtype=self._torch_dtype(), device=self.config.device
                )
            else:  # share the UNet already in memory
                pipe = FlowUpscalerPipeline(first.upscaler, vae, dtype=first.dtype, device=first.device)
                pipe.upscaler_path = first.upscaler_path
            self._hashes[vae] = model_hashes(pipe)
            self._pipelines[vae] = pipe
            return pipe

    def refiner(self, progress: ProgressFn = _no_progress, text_encoder: bool = False) -> Any:
        """The FLUX.2 refiner of ``--model`` (loaded on first use; the text encoder only once a prompt needs it)."""
        if not self.config.model:
            raise FlowliftError("no FLUX.2 model configured; start the app with --model to refine")
        with self._lock:
            from flowlift.devices import resolve_device_dtype

            device, dtype = resolve_device_dtype(self.config.device or "auto", self.config.dtype)
            if self._refiner is None:
                from flowlift.refine.loading import load_refiner

                progress(0.0, "loading the FLUX.2 model (once per server)")
                self._refiner = load_refiner(self.config.model, vae=self.config.model_vae, device=device, dtype=dtype)
            if text_encoder and self._refiner.prompt_encoder is None:
                from flowlift.refine.prompts import PromptEncoder

                progress(0.0, "loading the FLUX.2 text encoder (once per server)")
                self._refiner.prompt_encoder = PromptEncoder(self.config.model, device=device, dtype=dtype)
            return self._refiner

    # -- the command line's settings and names ------------------------------------------------------

    def settings(self, seed: int, transplant: float, color_fix: float, vae: str) -> Any:
        """The :class:`~flowlift.upscale.outputs.UpscaleSettings` of a request (``flowlift upscale``'s)."""
        from flowlift.upscale.outputs import UpscaleSettings

        return UpscaleSettings(
            seed=seed,
            transplant_strength=float(transplant),
            color_fix_strength=float(color_fix),
            vae=vae,
            upscaler=self.config.upscaler,
        )

    @staticmethod
    def plan(sources: Sequence[Path], out_dir: Path, scale: int) -> list[Any]:
        """``flowlift upscale``'s plan (:func:`flowlift.jobs.batch.plan_jobs` with its output names)."""
        from flowlift.files.images import IMAGE_SUFFIXES
        from flowlift.jobs.batch import plan_jobs
        from flowlift.upscale.outputs import output_name

        return plan_jobs(sources, out_dir, lambda path: output_name(path, scale), IMAGE_SUFFIXES)

    def _new_result_dir(self) -> Path:
        now = time.time()
        for old in self.work_dir.glob("r-*"):
            if old.is_dir() and now - old.stat().st_mtime > RESULT_MAX_AGE_S:
                shutil.rmtree(old, ignore_errors=True)
        return Path(tempfile.mkdtemp(prefix="r-", dir=self.work_dir))

    # -- handlers ------------------------------------------------------------------------------------

    def _validate(self, scale: Any, seed: Any, transplant: Any, color_fix: Any, vae: Any) -> tuple:
        try:
            scale_i = int(scale)
            seed_f = float(seed)
            transplant_f, color_f = float(transplant), float(color_fix)
        except (TypeError, ValueError):
            raise FlowliftError(
                f"scale, seed and strengths must be numbers, got {scale!r}, {seed!r}, {transplant!r}, {color_fix!r}"
            ) from None
        if scale_i not in SCALES:
            raise FlowliftError(f"scale must be one of {', '.join(map(str, SCALES))}, got {scale}")
        if not seed_f.is_integer() or not 0 <= seed_f < 2**63:
            raise FlowliftError(f"seed must be a non-negative integer, got {seed}")
        for name, value in (("transplant strength", transplant_f), ("colour-fix strength", color_f)):
            if not 0.0 <= value <= 1.0:
                raise FlowliftError(f"{name} must be in [0, 1], got {value}")
        vae = vae or self.config.vaes[0]
        if vae not in self.config.vaes:
            raise FlowliftError(f"VAE {vae!r} is not configured; choose one of {', '.join(self.config.vaes)}")
        return scale_i, int(seed_f), transplant_f, color_f, vae

    def _upscale_into(
        self,
        source: Path,
        out: Path,
        settings: Any,
        passes: int,
        pipeline: Any,
        vae: str,
        progress: ProgressFn,
        base: float = 0.0,
        span: float = 1.0,
    ) -> UpscaleResult:
        """``flowlift upscale``'s per-image step (:func:`~flowlift.upscale.outputs.upscale_file`) on one upload."""
        from flowlift.upscale.outputs import upscale_file

        started = time.perf_counter()
        check_upload(source, self.config.max_upload_mb)
        stages = ["encode", *(f"pass {i + 1}/{passes}" for i in range(passes)), "decode", "color fix"]
        done = iter(range(1, len(stages) + 1))

        def on_stage(stage: str) -> None:
            step = next(done, len(stages))
            following = stages[step] if step < len(stages) else "saving"
            progress(base + span * step / (len(stages) + 1), f"{source.name}: {stage} done, {following}")

        progress(base, f"{source.name}: encode")
        try:
            image, result, notes = upscale_file(pipeline, settings, passes, source, out, self._hashes[vae], on_stage)
        except ITEM_ERRORS as error:
            raise FlowliftError(_public_message(error, source)) from None
        before, after = preview_pair(image, result)
        return UpscaleResult(out, before, after, image.size, result.size, time.perf_counter() - started, notes)

    def upscale(
        self,
        path: str | Path | None,
        scale: Any = 2,
        seed: Any = 0,
        transplant_strength: Any = 1.0,
        color_fix_strength: Any = 1.0,
        vae: str | None = None,
        progress: ProgressFn = _no_progress,
    ) -> UpscaleResult:
        """Upscale one uploaded file into ``<stem>_x<scale>.png`` (the CLI's name and metadata)."""
        if not path:
            raise FlowliftError("no image uploaded")
        source = Path(path)
        scale, seed, transplant, color_fix, vae = self._validate(
            scale, seed, transplant_strength, color_fix_strength, vae
        )
        check_upload(source, self.config.max_upload_mb)
        from flowlift.upscale.sizes import passes_for_scale

        folder = self._new_result_dir()
        settings = self.settings(seed, transplant, color_fix, vae)
        (job,) = self.plan([source], folder, scale)
        out = job.output
        if out is None:
            raise FlowliftError(f"{source.name}: {_strip_folders(job.note, [source.parent, folder])}")
        pipeline = self.pipeline(vae, progress)
        return self._upscale_into(source, out, settings, passes_for_scale(scale), pipeline, vae, progress)

    def batch(
        self,
        paths: Sequence[str | Path] | None,
        scale: Any = 2,
        seed: Any = 0,
        transplant_strength: Any = 1.0,
        color_fix_strength: Any = 1.0,
        vae: str | None = None,
        progress: ProgressFn = _no_progress,
    ) -> BatchResult:
        """Upscale every file into one zip (CLI names); a failing file is listed and the rest go on."""
        if not paths:
            raise FlowliftError("no files uploaded")
        started = time.perf_counter()
        sources = [Path(p) for p in paths]
        scale, seed, transplant, color_fix, vae = self._validate(
            scale, seed, transplant_strength, color_fix_strength, vae
        )
        from flowlift.files.atomic import atomic_output
        from flowlift.upscale.sizes import passes_for_scale

        folder = self._new_result_dir()
        out_dir = folder / f"x{scale}"
        settings = self.settings(seed, transplant, color_fix, vae)
        plan = self.plan(sources, out_dir, scale)
        pipeline = self.pipeline(vae, progress)
        written: list[Path] = []
        errors: list[str] = []
        for index, (source, out, note) in enumerate((job.source, job.output, job.note) for job in plan):
            if out is None:
                errors.append(f"{source.name}: {_strip_folders(note, [*(s.parent for s in sources), out_dir])}")
                continue
            try:
                share = (index / len(plan), 1 / len(plan))
                self._upscale_into(source, out, settings, passes_for_scale(scale), pipeline, vae, progress, *share)
                written.append(out)
            except ITEM_ERRORS as error:
                errors.append(_public_message(error, source))
        zip_path = None
        if written:
            zip_path = folder / f"flowlift_x{scale}.zip"
            with atomic_output(zip_path) as temporary, zipfile.ZipFile(temporary, "w") as archive:
                for out in written:  # PNGs are compressed already
                    archive.write(out, out.name, compress_type=zipfile.ZIP_STORED)
        progress(1.0, "done")
        return BatchResult(zip_path, [p.name for p in written], errors, time.perf_counter() - started)

    def close(self) -> None:
        """Remove the result files this service created."""
        if self._own_work_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)
