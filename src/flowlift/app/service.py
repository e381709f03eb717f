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

import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowlift.app.progress import OneRun, ProgressFn, request_progress
from flowlift.app.refine_models import RefineModels
from flowlift.app.results import (
    BatchResult,
    UpscaleResult,
    check_upload,
    log_to_stderr,
    logged_request,
    preview_pair,
    public_message,
    strip_folders,
    vae_labels,
)
from flowlift.app.settings import MAX_UPLOAD
from flowlift.errors import ITEM_ERRORS, FlowliftError
from flowlift.knobs import LATENT_UPSCALER, SEED, check_callable, check_kind, check_path, check_paths
from flowlift.upscale.loading import DEFAULT_VAE
from flowlift.upscale.settings import COLOR_FIX_STRENGTH, SCALE, TRANSPLANT_STRENGTH

#: Result folders older than this are removed when a new request starts (Gradio keeps its own copy).
RESULT_MAX_AGE_S = 3600.0
#: The file that marks a result folder as this app's (only those are ever pruned).
RESULT_MARKER = ".flowlift-result"


def _no_progress(_fraction: float, _description: str) -> None:
    return None


@dataclass
class AppConfig:
    """The models and limits of one app process (the ``flowlift app`` options), each field checked when the config is
    made (one :class:`~flowlift.errors.FlowliftError` naming it; the command line says its option).

    ``upscaler``, ``model`` (the Refine tab's FLUX.2 weights) and ``model_vae``: a file, a folder or a hub id (or a
    VAE name), None for the default; kept as text. ``vaes``: the VAEs the page offers, the first the default (one
    ``str`` is one VAE, never its characters; duplicates dropped). ``device``: None or ``auto`` (CUDA if available),
    else a device that is here (kept as torch names it: ``cpu:0`` is ``cpu``); ``dtype``: one of
    :data:`flowlift.devices.DTYPES`. ``work_dir``: the result folders' parent (None: a temporary one, removed on
    close), kept as a Path.
    """

    upscaler: str | None = None
    vaes: Sequence[str] = (DEFAULT_VAE,)
    device: str | None = None
    dtype: str = "auto"
    max_upload_mb: float = MAX_UPLOAD.default
    model: str | None = None
    model_vae: str | None = None
    #: ``sesqui:PATH`` (``--latent-upscaler``): SesquiLSR for the fraction of a scale, where a request asks for it.
    latent_upscaler: str | None = None
    work_dir: Path | None = None
    #: Where the one line per request goes (stderr by default).
    log: Callable[[str], None] = log_to_stderr

    def __post_init__(self) -> None:
        from flowlift.devices import DTYPES, resolve_device_dtype

        for name in ("upscaler", "model", "model_vae"):  # "" would quietly mean the default weights
            value = check_path(name, getattr(self, name), optional=True)
            setattr(self, name, None if value is None else os.fspath(value))
        vaes = [os.fspath(vae) for vae in check_paths("vaes", self.vaes)]
        if not vaes:  # a page with no VAE to offer could upscale nothing
            raise FlowliftError("vaes must name at least one VAE, got an empty sequence", field="vaes")
        self.vaes = list(dict.fromkeys(vaes))
        check_kind("device", self.device, str, "a device name such as auto, cpu or cuda:0", optional=True)
        check_kind("dtype", self.dtype, str, f"one of {', '.join(DTYPES)}")
        # the backend and index checked here, not on the first request; float16 on the CPU warned about now
        device, _ = resolve_device_dtype(self.device, self.dtype, cpu_bf16=True)
        auto = self.device is None or self.device.strip().lower() == "auto"
        self.device = None if auto else str(device)  # None: each model picks CUDA if available
        self.max_upload_mb = MAX_UPLOAD.check(self.max_upload_mb)  # gradio takes the byte count as a 64-bit integer
        self.latent_upscaler = LATENT_UPSCALER.check(self.latent_upscaler)
        work_dir = check_path("work_dir", self.work_dir, optional=True)
        self.work_dir = None if work_dir is None else Path(work_dir)
        self.log = check_callable("log", self.log, optional=False)


class AppService:
    """Models loaded once per process and the request handlers of ``flowlift app``.

    The Flow Upscaler UNet is loaded on the first request and shared by the pipelines of every
    configured VAE; each VAE is loaded on its first use. Loading is serialized by a lock, so two
    first requests never load twice.
    """

    def __init__(self, config: AppConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        #: The page's requests one at a time, each stoppable (:class:`~flowlift.app.progress.OneRun`).
        self.one_run = OneRun()
        self._pipelines: dict[tuple[str, bool], Any] = {}
        self._hashes: dict[tuple[str, bool], dict[str, dict[str, str]]] = {}
        #: Weight files hashed so far (pipelines share the UNet and a VAE's files): each is read once per server.
        self._file_digests: dict[Path, str] = {}
        #: The Refine tab's refiner and hires upscaler (:class:`~flowlift.app.refine_models.RefineModels`).
        self.refine_models = RefineModels(config, self._lock, self.one_run.check, self._pipelines)
        self._own_work_dir = config.work_dir is None
        self.work_dir = Path(config.work_dir or tempfile.mkdtemp(prefix="flowlift-app-"))
        self.work_dir.mkdir(parents=True, exist_ok=True)
        #: The page's VAE choices: label (a name) -> spec (possibly a server path, never shown).
        self.vae_labels = vae_labels(config.vaes)

    def vae_spec(self, vae: str | None) -> str:
        """The configured VAE spec for a page label or a spec (API callers may pass either; None: the first).
        An empty or blank name is refused, as the command line's ``--vae ''`` is: it names no VAE."""
        if vae is None:
            return self.config.vaes[0]
        if isinstance(vae, str) and not vae.strip():
            raise FlowliftError(f"VAE: an empty name names no VAE; choose one of {', '.join(self.vae_labels)}")
        if vae in self.vae_labels:
            return self.vae_labels[vae]
        if vae in self.config.vaes:
            return vae
        raise FlowliftError(f"VAE {vae!r} is not configured; choose one of {', '.join(self.vae_labels)}")

    # -- models ------------------------------------------------------------------------------------

    @property
    def upscaler_source(self) -> str:
        from flowlift.upscale.loading import DEFAULT_UPSCALER

        return self.config.upscaler or DEFAULT_UPSCALER

    def _torch_dtype(self) -> Any:
        import torch

        return None if self.config.dtype == "auto" else getattr(torch, self.config.dtype)

    def pipeline(self, vae: str, latent: bool = False) -> Any:
        """The :class:`~flowlift.upscale.pipeline.FlowUpscalerPipeline` for ``vae`` (one of the configured VAEs), with
        the configured latent upscaler when ``latent``; what loads is reported to the request's run
        (:mod:`flowlift.progress`)."""
        if vae not in self.config.vaes:
            raise FlowliftError(f"VAE {vae!r} is not configured; choose one of {', '.join(self.vae_labels)}")
        key = (vae, latent)
        with self._lock:
            if key in self._pipelines:
                return self._pipelines[key]
            from flowlift.progress import report_loading
            from flowlift.upscale.outputs import model_hashes
            from flowlift.upscale.pipeline import FlowUpscalerPipeline
            from flowlift.upscale.stages import loading_description

            first = next(iter(self._pipelines.values()), None)
            label = next((name for name, spec in self.vae_labels.items() if spec == vae), vae)
            latent_upscaler = self.config.latent_upscaler if latent else None
            what = loading_description(self.upscaler_source if first is None else first.upscaler, vae, latent_upscaler)
            report_loading(f"{what.replace(f'VAE {vae}', f'VAE {label}')} (once per server)")  # no server paths
            sibling = self._pipelines.get((vae, not latent))  # the same VAE without/with SesquiLSR: shared
            if first is None:
                pipe = FlowUpscalerPipeline(
                    self.upscaler_source,
                    vae,
                    dtype=self._torch_dtype(),
                    device=self.config.device,
                    latent_upscaler=latent_upscaler,
                    check_interrupt=self.one_run.check,
                )
            else:  # share the UNet (and the VAE) already in memory
                pipe = FlowUpscalerPipeline(
                    first.upscaler,
                    vae if sibling is None else sibling.vae,
                    dtype=first.dtype,
                    device=first.device,
                    latent_upscaler=latent_upscaler,
                    check_interrupt=self.one_run.check,
                )
                pipe.upscaler_path = first.upscaler_path
                pipe.vae_spec = vae  # the files behind it, for the metadata's hashes
            self._hashes[key] = model_hashes(pipe, self._file_sha256)  # SesquiLSR's file too, where it has one
            self._pipelines[key] = pipe
            report_loading(None)
            return pipe

    def _file_sha256(self, path: Path) -> str:
        """A weight file's SHA-256, found once per server (the lock is held: pipelines are made one at a time)."""
        from flowlift.models.hub import weight_file_sha256

        if path not in self._file_digests:
            self._file_digests[path] = weight_file_sha256(path)
        return self._file_digests[path]

    # -- the command line's settings and names ------------------------------------------------------

    def settings(self, seed: int, transplant: float, color_fix: float, vae: str, latent: bool = False) -> Any:
        """The :class:`~flowlift.upscale.outputs.UpscaleSettings` of a request (``flowlift upscale``'s)."""
        from flowlift.upscale.outputs import UpscaleSettings

        return UpscaleSettings(
            seed=seed,
            transplant_strength=transplant,
            color_fix_strength=color_fix,
            vae=vae,
            upscaler=self.config.upscaler,
            latent_upscaler=self.config.latent_upscaler if latent else None,
        )

    @staticmethod
    def plan(sources: Sequence[Path], out_dir: Path, scale: float, latent: bool = False) -> Any:
        """``flowlift upscale``'s plan of the uploads (:func:`flowlift.upscale.plan.plan_files`): the same output
        names (by the scale the 16K cap lets run: a capped 8x is ``_x4``; ``_x1.5``), sizes and refusals; with
        ``latent``, the passes below the fraction SesquiLSR does (as ``--latent-upscaler`` plans them)."""
        from flowlift.upscale.asked_size import AskedSize
        from flowlift.upscale.plan import plan_files

        return plan_files(sources, out_dir, AskedSize(scale=scale), fraction_last=latent)

    def named_by_vae(self, out: Path | None, vae: str) -> Path | None:
        """``flowlift upscale``'s output name, with the VAE's page label added when the page offers several
        (``photo_x2_mage.png``, ``photo_x2_taef2.png``): two results of one image are never named alike."""
        if out is None or len(self.config.vaes) < 2:
            return out
        label = next((name for name, spec in self.vae_labels.items() if spec == vae), Path(vae).name)
        return out.with_name(f"{out.stem}_{re.sub(r'[^A-Za-z0-9._-]+', '-', label).strip('-')}{out.suffix}")

    def new_result_dir(self) -> Path:
        """A fresh result folder; old ones are pruned, but only those this app made (its marker inside):
        a ``work_dir`` given by the caller may hold folders of theirs named ``r-...``."""
        now = time.time()
        for old in self.work_dir.glob("r-*"):
            if (
                old.is_dir()
                and not old.is_symlink()
                and (old / RESULT_MARKER).is_file()
                and now - old.stat().st_mtime > RESULT_MAX_AGE_S
            ):
                shutil.rmtree(old, ignore_errors=True)
        folder = Path(tempfile.mkdtemp(prefix="r-", dir=self.work_dir))
        (folder / RESULT_MARKER).write_text("made by flowlift app; removed when old\n")
        return folder

    def refine(
        self,
        path: str | Path | None,
        prompt: str | None = None,
        prompt_embeds: str | Path | None = None,
        form: Any = None,
        progress: ProgressFn = _no_progress,
    ) -> UpscaleResult:
        """Refine one upload (the Refine tab, :mod:`flowlift.app.refine`): img2img or ``hires fix <N>x`` as ``form``
        (a :class:`~flowlift.app.refine.RefineForm`; None: its defaults) says, written as ``flowlift img2img`` /
        ``flowlift hires`` name it, with their metadata. The form's ``strength`` is img2img's and ``refine_strength``
        the hires fix's (None: each knob's default), ``steps`` None the model's (4 for a step-distilled Klein, else
        28), as ``flowlift img2img``/``hires`` choose them."""
        from flowlift.app.refine import RefineForm, refine_upload
        from flowlift.knobs import check_kind

        form = RefineForm() if form is None else check_kind("form", form, RefineForm, "a RefineForm")
        return refine_upload(self, path, prompt, prompt_embeds, form, progress)

    # -- handlers ------------------------------------------------------------------------------------

    def validate(self, scale: Any, seed: Any, transplant: Any, color_fix: Any, vae: Any, latent: Any = False) -> tuple:
        """A request's settings checked against the knob table (:data:`flowlift.upscale.settings.UPSCALE_KNOBS`).

        JSON and form values are parsed exactly (``loose``: integers, digit strings, whole floats up to
        2^53), so the seed is never passed through ``float()``: 2^53 + 1 stays 2^53 + 1.
        """
        return (
            SCALE.check(scale, loose=True),
            SEED.check(seed, loose=True),
            TRANSPLANT_STRENGTH.check(transplant, "transplant strength", loose=True),
            COLOR_FIX_STRENGTH.check(color_fix, "colour-fix strength", loose=True),
            self.vae_spec(vae),
            self.latent_choice(latent),
        )

    def latent_choice(self, latent: Any) -> bool:
        """Whether a request runs the configured latent upscaler: ``true`` or ``false`` only (a JSON door: the
        string "false" is not a yes), and ``true`` only where the app was started with ``--latent-upscaler``."""
        if not isinstance(latent, bool):
            raise FlowliftError(f"latent upscaler must be true or false, got {latent!r}")
        if latent and self.config.latent_upscaler is None:
            raise FlowliftError(
                "latent upscaler: none configured; start the app with --latent-upscaler sesqui:PATH to offer SesquiLSR"
            )
        return latent

    def upscale_into(
        self,
        source: Path,
        out: Path,
        settings: Any,
        sizes: Any,
        pipeline: Any,
        key: tuple[str, bool],
        warning: str = "",
    ) -> UpscaleResult:
        """``flowlift upscale``'s per-image step (:func:`~flowlift.upscale.outputs.upscale_file`) on one upload, as
        ``sizes`` (the plan's :class:`~flowlift.upscale.output_sizes.OutputSizes`) planned it, its stages reported to
        the request's run (:class:`~flowlift.upscale.stages.UpscaleStages`); ``warning`` is the plan's word on the
        job (:attr:`flowlift.jobs.batch.Job.warning`, e.g. passes the 16K cap drops), shown first among its notes."""
        from flowlift.files.images import image_size
        from flowlift.progress import RunProgress, active
        from flowlift.upscale.outputs import upscale_file
        from flowlift.upscale.stages import UpscaleStages

        passes = sizes.passes_for(source)  # the passes the 16K cap lets run, as named

        started = time.perf_counter()
        check_upload(source, self.config.max_upload_mb)
        stages = UpscaleStages(active() or RunProgress())
        try:
            image_size(source)  # an unreadable upload: its one line here, before any stage
            with stages.image(sizes.planned_image(source)):
                image, result, notes = upscale_file(
                    pipeline,
                    settings,
                    passes,
                    source,
                    out,
                    self._hashes[key],
                    stages.stage,
                    stages.decode_tile,
                    sizes.resample_to(source),
                    sizes.asked,
                )
        except ITEM_ERRORS as error:
            raise FlowliftError(public_message(error, source)) from None
        before, after = preview_pair(image, result)
        notes = [warning, *notes] if warning else notes
        return UpscaleResult(out, before, after, image.size, result.size, time.perf_counter() - started, notes)

    def check_image(self, path: str | Path | None) -> str:
        """What the page says when a file is dropped: its size, or the one-line error an upscale would give.

        The file is read completely (as the upscale will read it), so a truncated or corrupt image is
        reported on upload, not after the user pressed Upscale.
        """
        from flowlift.files.images import load_image

        if not path:
            return ""
        source = check_upload(path, self.config.max_upload_mb)
        try:
            image, alpha = load_image(source)
        except ITEM_ERRORS as error:
            raise FlowliftError(public_message(error, source)) from None
        transparency = " with transparency" if alpha is not None else ""
        return f"{source.name}: {image.width}x{image.height} px{transparency}"

    def upscale(
        self,
        path: str | Path | None,
        scale: Any = SCALE.default,
        seed: Any = SEED.default,
        transplant_strength: Any = TRANSPLANT_STRENGTH.default,
        color_fix_strength: Any = COLOR_FIX_STRENGTH.default,
        vae: str | None = None,
        latent_upscaler: Any = False,
        progress: ProgressFn = _no_progress,
    ) -> UpscaleResult:
        """Upscale one uploaded file into ``<stem>_x<scale>.png`` (the CLI's name and metadata); ``latent_upscaler``
        True runs the configured SesquiLSR for the fraction of the scale (``flowlift upscale --latent-upscaler``).

        Logs one line (``request_log_line``) whatever the outcome.
        """
        from flowlift.progress import running

        run = request_progress(progress)  # the request's clock from the click: loading the models counts in its time
        run.loading(None)  # the bar shows at once ("starting"), never another request's estimate
        with (
            running(run),
            logged_request(self.config.log, "upscale", Path(path).name if path else "-", f"x{scale}") as entry,
        ):
            if not path:
                raise FlowliftError("no image uploaded")
            source = Path(path)
            scale, seed, transplant, color_fix, vae, latent = self.validate(
                scale, seed, transplant_strength, color_fix_strength, vae, latent_upscaler
            )
            check_upload(source, self.config.max_upload_mb)
            folder = self.new_result_dir()
            settings = self.settings(seed, transplant, color_fix, vae, latent)
            plan = self.plan([source], folder, scale, latent)
            (job,) = plan.jobs
            out = self.named_by_vae(job.output, vae)
            if out is None:
                note = strip_folders(job.note, [source.parent, folder])
                raise FlowliftError(note if note.startswith(source.name) else f"{source.name}: {note}")
            pipeline = self.pipeline(vae, latent)
            result = self.upscale_into(source, out, settings, plan.sizes, pipeline, (vae, latent), job.warning)
            result.seconds = run.state().elapsed  # the request's wall time, loading the models included
            entry.request = result.log_request()
        return result

    def batch(
        self,
        paths: Sequence[str | Path] | None,
        scale: Any = SCALE.default,
        seed: Any = SEED.default,
        transplant_strength: Any = TRANSPLANT_STRENGTH.default,
        color_fix_strength: Any = COLOR_FIX_STRENGTH.default,
        vae: str | None = None,
        latent_upscaler: Any = False,
        progress: ProgressFn = _no_progress,
    ) -> BatchResult:
        """Upscale every file into one zip (CLI names); a failing file is listed and the rest go on
        (:func:`flowlift.app.batch.batch_uploads`). Logs one line for the whole batch."""
        from flowlift.app.batch import batch_uploads

        values = (scale, seed, transplant_strength, color_fix_strength, vae, latent_upscaler)
        return batch_uploads(self, paths, values, progress)

    def close(self) -> None:
        """Remove the result files this service created."""
        if self._own_work_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)
