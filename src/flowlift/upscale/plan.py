"""``flowlift upscale``'s job: planned here once, then handed to :mod:`flowlift.jobs` to run.

The command line turns its options into one :class:`UpscaleRequest` and calls :func:`run_upscale`.
:func:`plan_upscale` decides everything before any model loads, from the inputs' headers alone
(:class:`OutputSizes`): the passes the 16K cap lets run, each output's name, size and format limit,
and, through :func:`flowlift.jobs.batch.plan_targets`, what is skipped or refused. The plan is data:
it writes and removes nothing. :func:`run_upscale` hands its jobs to :mod:`flowlift.jobs` once
(:func:`flowlift.jobs.scaleout.batch_share`: this rank's share), loads the models only when that share
has work, and runs it with :class:`UpscaleStep`, which writes one output per call
(:func:`flowlift.upscale.outputs.upscale_file`).
"""

from __future__ import annotations

import glob
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowlift.errors import FlowliftError
from flowlift.jobs.batch import Job, no_images_in, plan_targets, report
from flowlift.jobs.distributed import DEFAULT_BARRIER_TIMEOUT_S, DistEnv
from flowlift.knobs import OVERWRITE, SCALE, check_dtype, check_kind, check_path, check_paths, check_positive
from flowlift.upscale.asked_size import AskedSize
from flowlift.upscale.loading import DEFAULT_UPSCALER
from flowlift.upscale.output_sizes import OutputSizes
from flowlift.upscale.outputs import UpscaleSettings
from flowlift.upscale.settings import RESIZE_MODE, check_compile

__all__ = [
    "UpscalePlan",
    "UpscaleRequest",
    "UpscaleStep",
    "check_names",
    "plan_files",
    "plan_upscale",
    "run_upscale",
]

COMMAND = "upscale"


@dataclass(frozen=True)
class UpscaleRequest:
    """Everything one ``flowlift upscale`` run asks for: the inputs (files, folders, glob patterns) and
    where their outputs go, the per-image :class:`UpscaleSettings`, the models and how they run, and the
    batch's own options (``device`` is resolved when the request is made, ``dtype`` a floating ``torch.dtype`` or None
    for the device's default; ``upscaler=None`` is the released weights).

    The size, one of: ``passes`` (N 2x passes), ``scale`` (any factor in [1, 8]; 2, 4, 8 are the passes' own
    output), ``long_side`` (pixels) or ``size`` ((width, height) or ``"WxH"``); none of them is ``scale=2``. Two
    at once is one line (:attr:`asked`)."""

    inputs: Sequence[str]
    output: str | None = None
    passes: int | None = None
    scale: float | None = None
    long_side: int | None = None
    size: tuple[int, int] | str | None = None
    output_format: str = "png"
    settings: UpscaleSettings = field(default_factory=UpscaleSettings)
    overwrite: bool = False
    batch_size: int = 1
    device: Any = None
    dtype: Any = None
    chunked: bool | None = None
    vae_tiled: bool | None = None
    max_memory: str | None = None
    compile: bool = False
    barrier_timeout: float = DEFAULT_BARRIER_TIMEOUT_S
    progress: bool | None = False  # flowlift.console.progress_bar's enabled

    def __post_init__(self) -> None:
        """Every field checked when the request is made (one line naming it; nothing is listed or loaded yet)."""
        from flowlift.devices import resolve_device_option
        from flowlift.files.output_paths import check_output_format
        from flowlift.limits import parse_memory

        inputs = check_paths("inputs", self.inputs)
        if not inputs:
            raise FlowliftError("inputs: give input images (files, folders or glob patterns)", field="inputs")
        object.__setattr__(self, "inputs", tuple(str(item) for item in inputs))
        check_path("output", self.output, optional=True)
        object.__setattr__(self, "passes", check_positive("passes", self.passes, integer=True, optional=True))
        check_output_format(self.output_format)
        check_kind("settings", self.settings, UpscaleSettings, "an UpscaleSettings")
        object.__setattr__(self, "overwrite", OVERWRITE.check(self.overwrite))
        object.__setattr__(self, "batch_size", check_positive("batch_size", self.batch_size, integer=True))
        check_kind("chunked", self.chunked, bool, "True, False", optional=True)
        check_kind("vae_tiled", self.vae_tiled, bool, "True, False", optional=True)
        if self.max_memory is not None:
            parse_memory(self.max_memory)
        check_compile(self.compile)
        if self.device is not None:  # a device that is not here: one line now, not after the inputs are listed
            object.__setattr__(self, "device", resolve_device_option(self.device))
        if self.dtype is not None:
            check_dtype(self.dtype)
        object.__setattr__(self, "barrier_timeout", check_positive("barrier_timeout", self.barrier_timeout))
        check_kind("progress", self.progress, bool, "True, False", optional=True)
        self.asked  # noqa: B018  (a bad or doubled size is one line at construction)

    @property
    def asked(self) -> AskedSize:
        """The request's size as one :class:`~flowlift.upscale.asked_size.AskedSize`."""
        from flowlift.knobs import check_count

        if self.passes is not None:
            if any(value is not None for value in (self.scale, self.long_side, self.size)):
                raise FlowliftError("give passes or a scale, long_side or size, not both")
            passes = max(1, check_count("passes", self.passes))
            if 2**passes > SCALE.high:  # as passes, not as the scale they make (was "scale must be in [1, 8]")
                raise FlowliftError(f"passes must be 1, 2 or 3 (2x each, at most {SCALE.high:g}x), got {passes}")
            return AskedSize.of_passes(passes)
        if self.long_side is None and self.size is None:
            return AskedSize(scale=2.0 if self.scale is None else self.scale)
        return AskedSize(scale=self.scale, long_side=self.long_side, size=self.size)


@dataclass
class UpscalePlan:
    """The jobs of one run (inputs refused at listing first; a job that runs fewer passes than asked, the 16K
    cap, carries the line that says so as its ``warning``), the per-input sizes they were planned with, and the
    output folder ``-o`` names (the job manifest's home; None without ``-o`` or for ``-o FILE``)."""

    jobs: list[Job]
    sizes: OutputSizes
    folder: Path | None = None


def plan_files(
    sources: Sequence[Path],
    folder: Path,
    passes: int | AskedSize,
    resize_mode: str = RESIZE_MODE.default,
    output_format: str = "png",
    fraction_last: bool = False,
) -> UpscalePlan:
    """The plan of named files into ``folder`` (the web app's uploads): the names, sizes and refusals of
    :func:`plan_upscale` (an output is named by the scale the 16K cap lets run: a capped 8x is ``_x4``), without
    listing inputs or interpreting ``-o``; nothing is written. ``fraction_last``: a latent upscaler does the
    fraction (:class:`OutputSizes`)."""
    sizes = OutputSizes(passes, resize_mode, fraction_last)
    targets = [sizes.target(Path(path), None, folder, output_format) for path in sources]
    return UpscalePlan(plan_targets(targets), sizes, folder)


def plan_upscale(request: UpscaleRequest) -> UpscalePlan:
    """List the inputs and plan one job per input (see the module docstring); nothing is written."""
    from flowlift.files.images import list_images
    from flowlift.files.output_paths import output_target

    fraction_last = request.settings.latent_upscaler is not None  # SesquiLSR for the fraction
    sizes = OutputSizes(request.asked, request.settings.resize_mode, fraction_last)  # named by what the cap lets run
    problems: list[tuple[str, str]] = []
    inputs = list_images(list(request.inputs), problems)
    if not inputs and not problems:
        raise no_images_in(request.inputs)
    if not inputs and len(request.inputs) == 1 and not glob.has_magic(request.inputs[0]):
        item, message = problems[0]  # the one file asked for is not there: a user error (exit 2), not a batch
        raise FlowliftError(f"{item}: {message}")
    single_file, folder = output_target(request.output, len(inputs))
    targets = [sizes.target(path, single_file, folder, request.output_format) for path in inputs]
    refused = [Job.refusal(Path(item), message) for item, message in problems]
    return UpscalePlan(refused + plan_targets(targets), sizes, folder)


class UpscaleStep:
    """The per-image step of one run on its loaded pipeline: ``step(source, output)`` writes one output
    (:func:`flowlift.upscale.outputs.upscale_file`); with ``batch_size`` N, :meth:`compute` and :meth:`save` run
    same-size inputs together (:class:`flowlift.jobs.same_size.SameSizeBatches`). Built by :meth:`load` only when
    this rank has work."""

    def __init__(self, request: UpscaleRequest, plan: UpscalePlan, pipeline: Any) -> None:
        from flowlift.upscale.outputs import model_hashes

        self.request, self.plan, self.pipeline = request, plan, pipeline
        self.hashes = model_hashes(pipeline)
        self.outputs = {job.source: job.output for job in plan.jobs if job.output is not None}

    @classmethod
    def load(
        cls, request: UpscaleRequest, plan: UpscalePlan, env: DistEnv, todo: Sequence[Job]
    ) -> Callable[[Path, Path], None]:
        """The pipeline on this rank's device, and the step over it; ``todo``: the jobs that need work
        (:attr:`flowlift.jobs.scaleout.BatchShare.todo`), grouped by size with ``batch_size`` N."""
        from flowlift.jobs.distributed import rank_device
        from flowlift.jobs.same_size import SameSizeBatches
        from flowlift.models.vae_loading import ENCODE_DECODE, require_vae_parts
        from flowlift.progress import report_loading
        from flowlift.upscale.loading import check_upscale_weights
        from flowlift.upscale.pipeline import FlowUpscalerPipeline
        from flowlift.upscale.settings import MemoryPolicy
        from flowlift.upscale.stages import loading_description

        upscaler = request.settings.upscaler or DEFAULT_UPSCALER
        settings = request.settings  # every missing piece in one line, before any line:
        check_upscale_weights(upscaler, [settings.vae], settings.latent_upscaler)
        device = rank_device(str(request.device), env) if env.distributed else request.device  # cuda:LOCAL_RANK
        report_loading(loading_description(upscaler, request.settings.vae, request.settings.latent_upscaler))
        pipeline = FlowUpscalerPipeline(
            upscaler,
            request.settings.vae,
            dtype=request.dtype,
            device=device,
            memory=MemoryPolicy(chunked=request.chunked, vae_tiled=request.vae_tiled, max_memory=request.max_memory),
            compile=request.compile,
            latent_upscaler=request.settings.latent_upscaler,
        )  # the loading line stays until the first image's first stage begins
        require_vae_parts(pipeline.vae, ENCODE_DECODE, spec=request.settings.vae)  # once, not once per image
        step = cls(request, plan, pipeline)
        if request.batch_size > 1 and env.distributed:
            print(
                f"flowlift {COMMAND}: --batch-size is not applied under torchrun; images run one by one",
                file=sys.stderr,
            )
        elif request.batch_size > 1:
            return SameSizeBatches([job.source for job in todo], request.batch_size, step.compute, step.save)
        return step

    def compute(self, paths: list[Path]) -> list[tuple[Any, Any, list[str], int | None]]:
        """Same-size inputs through the pipeline at once (the passes the cap lets run are the same for all):
        per input, its result, its :class:`~flowlift.upscale.outputs.SourcePixels`, the pipeline's warnings and
        the passes that ran before a resample to an asked size (None without one)."""
        import torch

        from flowlift.files.images import to_tensor
        from flowlift.upscale.outputs import read_source

        loaded = [read_source(path, self.outputs[path]) for path in paths]
        images = torch.cat([to_tensor(item.pixels) for item in loaded])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UserWarning)
            count = self.plan.sizes.passes_for(paths[0])
            size = self.plan.sizes.resample_to(paths[0])  # same-size inputs: the same size out
            result = self.pipeline.upscale_image(
                images, num_passes=count, output_type="pt", output_size=size, **self.request.settings.pipeline_options()
            )
        notes = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
        ran = None if size is None else count
        return [(result[i : i + 1], item, notes, ran) for i, item in enumerate(loaded)]

    def save(self, path: Path, out: Path, item: tuple[Any, Any, list[str], int | None]) -> None:
        """Write one result of :meth:`compute` (its warnings first, one line each)."""
        from tqdm import tqdm

        from flowlift.upscale.outputs import save_result

        result, loaded, notes, ran = item
        for note in notes:
            report(COMMAND, path, f"warning: {note}", write=lambda line: tqdm.write(line, file=sys.stderr))
        settings = self.request.settings
        save_result(self.pipeline, settings, path, out, loaded, result, self.hashes, ran, self.plan.sizes.asked)

    def expect(self, sources: Sequence[Path]) -> None:
        """The images the batch will run, in order (:func:`flowlift.jobs.batch.run_jobs` says once it knows which
        are skipped): their stages are planned, so the time left covers the whole run."""
        from flowlift.progress import active
        from flowlift.upscale.stages import UpscaleStages

        run = active()
        if run is not None:
            UpscaleStages(run).expect([self.plan.sizes.planned_image(path) for path in sources])

    def __call__(self, path: Path, out: Path) -> None:
        from tqdm import tqdm

        from flowlift.console import progress_bar
        from flowlift.progress import RunProgress, active
        from flowlift.upscale.outputs import upscale_file
        from flowlift.upscale.stages import UpscaleStages

        count = self.plan.sizes.passes_for(path)  # the passes the cap lets run, already said at planning
        stages = UpscaleStages(active() or RunProgress())
        steps = progress_bar(
            total=count + 3, desc=path.name, unit="step", leave=False, enabled=self.request.progress, file=sys.stderr
        )

        def on_stage(finished: str) -> None:
            stages.stage(finished)
            steps.update(1)
            steps.set_postfix_str(_bar_note(stages.run), refresh=False)

        with steps, stages.image(self.plan.sizes.planned_image(path)):
            _, _, notes = upscale_file(
                self.pipeline,
                self.request.settings,
                count,
                path,
                out,
                self.hashes,
                on_stage=on_stage,
                on_decode_tile=stages.decode_tile,
                resample_to=self.plan.sizes.resample_to(path),
                asked=self.plan.sizes.asked,
            )
        for note in notes:  # anything the pipeline warned about this image: one line, not a stack
            report(COMMAND, path, f"warning: {note}", write=lambda line: tqdm.write(line, file=sys.stderr))


def _bar_note(run: Any) -> str:
    """A terminal bar's note: the stage running and the run's time left (``decode, about 40 s left``)."""
    from flowlift.console import format_seconds

    state = run.state()
    what = state.what().rsplit(": ", 1)[-1]
    return what + (f", about {format_seconds(state.left)} left" if state.left is not None else "")


def check_names(request: UpscaleRequest) -> None:
    """The models the request names, checked before the run decides what to skip (every problem in one line): each
    local path found, its header read, and a name that is neither a path nor a hub id refused
    (:func:`flowlift.upscale.loading.upscale_name_checks`; nothing loaded, nothing fetched: a hub id is looked up
    when there is work), and :func:`flowlift.models.sesqui_lsr.require_bn_statistics`' line for a latent upscaler
    given a VAE whose spec says it has no BN statistics (``taef2``, ``mage``). A misspelled option is never passed
    over because every output exists."""
    from flowlift.models.sesqui_lsr import require_bn_statistics
    from flowlift.models.vae_loading import vae_spec_kind
    from flowlift.models.vae_names import NO_BN_STATISTICS
    from flowlift.models.weights import require_all
    from flowlift.upscale.loading import upscale_name_checks

    settings = request.settings
    upscaler, vaes, checks = settings.upscaler or DEFAULT_UPSCALER, [settings.vae], []
    if settings.latent_upscaler is not None and vae_spec_kind(settings.vae) in NO_BN_STATISTICS:
        vaes = []  # that VAE is the one to change: not looked up
        checks.append(lambda: require_bn_statistics(None))  # its line, naming latent_upscaler and vae
    require_all(checks + upscale_name_checks(upscaler, vaes, settings.latent_upscaler))


def run_upscale(request: UpscaleRequest) -> int:
    """Plan the request (from the inputs' headers alone), then run this rank's share of the jobs
    (:func:`flowlift.jobs.scaleout.batch_share`): say what the cap drops (once, before any work), load the
    models only when the share has work, and run it; returns the exit status."""
    from flowlift.console import command_started, run_lines
    from flowlift.jobs.scaleout import batch_share
    from flowlift.progress import RunProgress, running

    run = RunProgress(started=command_started())  # the command's whole time, loading the models included
    plan = plan_upscale(request)
    if any(not job.refused for job in plan.jobs):  # before the skips (every input refused: those lines are the news)
        check_names(request)  # a misspelled --upscaler is refused even when every output exists
    env = DistEnv.from_environ()
    with (
        running(run),
        run_lines(run, request.progress),
        batch_share(
            plan.jobs,
            command=COMMAND,
            folder=plan.folder,
            overwrite=request.overwrite,
            barrier_timeout=request.barrier_timeout,
            env=env,
            progress=request.progress,
        ) as share,
    ):
        if env.is_main:  # the cap's notes before any work (and once, not per rank), for the images that run
            for job in share.todo:
                if job.warning:
                    report(COMMAND, job.source, f"warning: {job.warning}")
        step = UpscaleStep.load(request, plan, env, share.todo) if share.has_work else None
        return share.run(step)
