"""``flowlift eval``'s job: outputs measured against their inputs, or upscaling methods run on a dataset.

The command line turns its options into one :class:`EvalRequest` and calls :func:`run_eval`, which checks
everything it will write before any model loads or metric runs (the replace rule of
:mod:`flowlift.files.own_files` at the reports, the saved outputs and the cache's entries; no report is one of
the images measured), then measures (:func:`flowlift.measure.pairs.evaluate_pairs` or
:func:`~flowlift.measure.evaluate.evaluate_methods`; under ``torchrun`` each rank its pixel-balanced share,
merged through the cache) and writes the report (:func:`flowlift.measure.report.write_report`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowlift.devices import check_device_and_dtype, resolve_device_dtype
from flowlift.errors import FIELD_MARK, FlowliftError
from flowlift.jobs.distributed import DEFAULT_BARRIER_TIMEOUT_S
from flowlift.knobs import SCALE
from flowlift.measure.methods import SPANDREL_TILE, spandrel_tiling
from flowlift.measure.sr_metrics import Y_CHANNEL
from flowlift.upscale.loading import DEFAULT_VAE

if TYPE_CHECKING:
    from flowlift.jobs.distributed import DistEnv
    from flowlift.measure.evaluate import EvalReport, MeasureSettings
    from flowlift.measure.methods import MethodSpec

__all__ = ["EvalRequest", "run_eval"]

COMMAND = "eval"


@dataclass(frozen=True)
class EvalRequest:
    """Everything one ``flowlift eval`` run asks for. Either ``outputs`` with ``reference`` (and optionally
    ``ground_truth``): images already made, measured against their inputs; or ``run`` (method specs, e.g.
    ``"lanczos,flow:seed=1"``) with ``dataset``: the methods run at ``scale`` on low-res inputs made from the
    photos. ``device``/``dtype`` as the command line spells them (``"auto"``); ``upscaler=None`` is the
    released weights; ``cache=None`` is ``output/cache``; ``tile``/``tile_overlap`` are the spandrel tiling;
    ``y_channel`` is PSNR-Y / SSIM-Y's luma (:data:`flowlift.measure.sr_metrics.Y_CHANNEL`)."""

    output: str | os.PathLike
    outputs: Sequence[str] = ()
    reference: str | None = None
    ground_truth: str | None = None
    run: Sequence[str] | None = None
    dataset: Sequence[str] | None = None
    scale: int | float = SCALE.default  # whole or p/q (measure.inputs.check_scale)
    limit: int | None = None
    box: tuple[int, int, int, int] | None = None
    vae: str = DEFAULT_VAE
    upscaler: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    tile: Any = SPANDREL_TILE.default
    tile_overlap: int | None = None  # None: the knob's default
    overwrite: bool = False
    cache: str | None = None
    no_cache: bool = False
    save_outputs: bool = False
    figure_images: int = 3
    y_channel: str = Y_CHANNEL.default  # PSNR-Y / SSIM-Y's luma: matlab (rounded) or basicsr (unrounded)
    barrier_timeout: float = DEFAULT_BARRIER_TIMEOUT_S
    progress: bool | None = False  # flowlift.console.progress_bar's enabled

    def __post_init__(self) -> None:
        """Every field checked when the request is made, one line naming it as Python spells it: a string of
        ``outputs`` is one path (not its characters), flags are bools (``no_cache="no"`` dropped the cache),
        numbers are numbers; the modes' rules and the files are checked by :func:`run_eval`."""
        from flowlift.knobs import OVERWRITE, check_kind, check_path, check_paths, check_positive
        from flowlift.measure.inputs import check_scale
        from flowlift.measure.metrics import check_box

        check_path("output", self.output)
        object.__setattr__(self, "outputs", tuple(map(str, check_paths("outputs", self.outputs))))
        for name in ("dataset", "run"):  # a string is one folder / one comma-separated list of methods
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(map(str, check_paths(name, getattr(self, name)))))
        for name in ("reference", "ground_truth", "upscaler", "cache"):
            check_path(name, getattr(self, name), optional=True)
        check_path("vae", self.vae)
        for name in ("device", "dtype"):
            check_kind(name, getattr(self, name), str, "a string (auto, cpu, cuda, ...)")
        check_device_and_dtype(self.device, self.dtype)
        object.__setattr__(self, "scale", check_scale(self.scale))
        spandrel_tiling(self.tile, self.tile_overlap)  # with or without a spandrel method: a bad value is refused
        object.__setattr__(self, "box", check_box(self.box))
        object.__setattr__(self, "y_channel", Y_CHANNEL.check(self.y_channel))
        object.__setattr__(self, "limit", check_positive("limit", self.limit, integer=True, optional=True))
        object.__setattr__(self, "figure_images", check_positive("figure_images", self.figure_images, integer=True))
        check_positive("barrier_timeout", self.barrier_timeout)
        OVERWRITE.check(self.overwrite)
        for name in ("no_cache", "save_outputs"):
            check_kind(name, getattr(self, name), bool, "True or False")
        check_kind("progress", self.progress, bool, "True, False", optional=True)

    @property
    def measuring(self) -> MeasureSettings:
        """How each output is measured (:class:`~flowlift.measure.evaluate.MeasureSettings`), from the fields."""
        from flowlift.measure.evaluate import MeasureSettings

        return MeasureSettings(box=self.box, y_channel=self.y_channel)


def run_eval(request: EvalRequest) -> tuple[EvalReport, dict[str, Path]] | None:
    """Check the request (the replace rule at every name, before any model loads or metric runs), measure, write
    the report into ``request.output``; the report and the paths written, or None on a rank other than 0 of a
    sharded run (its share is in the cache)."""
    from flowlift.files.output_paths import folder_problem
    from flowlift.measure.pairs import evaluate_pairs
    from flowlift.measure.report import write_report

    out_dir = Path(request.output)
    if out_dir.exists() and not out_dir.is_dir():
        raise FlowliftError(f"{FIELD_MARK} {out_dir} exists and is not a folder", field="output")
    if problem := folder_problem(out_dir):  # before any model loads or metric runs
        raise FlowliftError(problem)
    _check_reports_are_no_input(request, out_dir)
    if request.run:
        if request.outputs or request.reference:
            raise FlowliftError(f"give either {MODES}, not both", field=MODE_FIELDS)
        if not request.dataset:
            raise FlowliftError(f"{FIELD_MARK} needs {FIELD_MARK} (a folder of photos)", field=("run", "dataset"))
        from flowlift.measure.methods import check_something_measured, parse_methods

        specs = parse_methods(request.run)
        check_something_measured(specs, request.scale)  # before any name is checked or model loads
        _check_replace_rule(request, out_dir)
        _check_before_loading(request, specs)
        from flowlift.jobs.distributed import DistEnv, process_group

        env = DistEnv.from_environ()
        with process_group(env, request.barrier_timeout):
            report = _run_methods(request, env)
        if report is None:  # a rank other than 0 of a sharded run: its share is in the cache
            return None
    else:
        if given := _run_only_fields(request):
            raise FlowliftError(
                f"{', '.join(FIELD_MARK for _ in given)} {'go' if len(given) > 1 else 'goes'} with {FIELD_MARK}; "
                f"{FIELD_MARK} with {FIELD_MARK} measures images already made (their sizes give the scale): drop "
                f"{'them' if len(given) > 1 else 'it'}",
                field=(*given, "run", "outputs", "reference"),
            )
        if not request.outputs or not request.reference:
            raise FlowliftError(f"give {MODES}", field=MODE_FIELDS)
        _check_replace_rule(request, out_dir)
        report = evaluate_pairs(
            request.outputs,
            request.reference,
            request.ground_truth,
            measuring=request.measuring,
            figure_images=request.figure_images,
            progress=request.progress,
        )
    return report, write_report(report, out_dir)


#: The request's fields only ``run`` uses: given with ``outputs`` and ``reference``, each would be ignored without a
#: word.
RUN_ONLY_FIELDS = (
    "dataset",
    "scale",
    "limit",
    "vae",
    "upscaler",
    "device",
    "dtype",
    "tile",
    "tile_overlap",
    "cache",
    "no_cache",
    "save_outputs",
)
#: The two modes, as a line names them (each field a mark: the command line says ``OUTPUTS``, ``--reference``).
MODES = f"{FIELD_MARK} with {FIELD_MARK} (images already made), or {FIELD_MARK} with {FIELD_MARK}"
MODE_FIELDS = ("outputs", "reference", "run", "dataset")


def _run_only_fields(request: EvalRequest) -> list[str]:
    """The :data:`RUN_ONLY_FIELDS` ``request`` sets to other than their defaults."""
    defaults = EvalRequest(output=request.output)
    return [name for name in RUN_ONLY_FIELDS if getattr(request, name) != getattr(defaults, name)]


def _check_reports_are_no_input(request: EvalRequest, out_dir: Path) -> None:
    """No report file is one of the images measured (issue 36.2: by identity, e.g. ``eval OUT ... -o OUT``)."""
    from flowlift.files.images import list_images
    from flowlift.files.output_paths import check_not_an_input, check_report_folder
    from flowlift.measure.report import report_paths

    inputs: dict[str, list[Path]] = {}
    roles = (("outputs", request.outputs), ("reference", request.reference), ("dataset", request.dataset))
    given_items = {role: [given] if isinstance(given, str) else list(given) for role, given in roles if given}
    check_report_folder(out_dir, given_items)  # its figures would be measured as photos next time
    for role, given in roles:
        if given:
            try:
                inputs[role] = list_images([given] if isinstance(given, str) else list(given))
            except FlowliftError:
                pass  # a missing input is named by the measuring itself, in its own words
    for path in report_paths(out_dir).values():
        check_not_an_input(path, inputs)


def _check_replace_rule(request: EvalRequest, out_dir: Path) -> None:
    """The replace rule (:mod:`flowlift.files.own_files`) at every name the run writes, before any work:
    the reports, with ``--save-outputs`` every output, input and ground-truth file, and the cache's entries."""
    from flowlift.files.own_files import check_replaceable, flowlift_image, folder_refusal, replace_error
    from flowlift.measure.cache import ResultCache
    from flowlift.measure.evaluate import saved_output_paths
    from flowlift.measure.inputs import dataset_paths
    from flowlift.measure.methods import method_folder, parse_methods
    from flowlift.measure.report import report_recognisers

    check_replaceable(report_recognisers(out_dir), request.overwrite, COMMAND, FIELD_MARK)
    if not request.run:
        return
    labels = [spec.label for spec in parse_methods(request.run)]
    if request.save_outputs:
        saved = out_dir / "outputs"
        for folder in [saved] + [saved / name for name in ("inputs", "ground-truth", *map(method_folder, labels))]:
            if refusal := folder_refusal(folder):
                raise FlowliftError(refusal)
        stems = [path.stem for path in dataset_paths(request.dataset, request.limit)]
        names = saved_output_paths(saved, labels, stems, request.scale)
        check_replaceable(dict.fromkeys(names, flowlift_image), request.overwrite, COMMAND, FIELD_MARK)
    if not request.no_cache:
        root = Path(request.cache) if request.cache else out_dir / "cache"
        if request.cache and os.path.isdir(root):
            root = Path(os.path.realpath(root))  # a --cache given as a link to a folder is the user's choice
        if problem := ResultCache(root).problems(labels, request.overwrite):
            raise replace_error(problem, "cache")


def _run_methods(request: EvalRequest, env: DistEnv) -> EvalReport | None:
    import torch

    from flowlift.jobs.distributed import rank_device
    from flowlift.measure.cache import model_identity
    from flowlift.measure.evaluate import evaluate_methods
    from flowlift.measure.methods import make_method_fn, parse_methods, unreachable

    specs = parse_methods(request.run)
    given, dtype = resolve_device_dtype(request.device, request.dtype)
    # under torchrun each rank computes on its own cuda:LOCAL_RANK; cache keys and reports name the device given
    device = torch.device(rank_device(str(given), env)) if env.distributed else given
    reachable = [s for s in specs if not unreachable(s, request.scale)]  # the others are skipped
    needs_vae = any(s.needs_vae for s in reachable)
    upscaler = _flow_upscaler(request, reachable)  # found by _check_before_loading, with every other weight
    needs_flow = upscaler is not None
    vae = pipeline = None
    identities: dict = {}
    if needs_vae:
        from flowlift.models.vae_loading import ENCODE_DECODE, load_vae

        vae = load_vae(request.vae, device=device, dtype=dtype, needs=ENCODE_DECODE)  # every VAE method round-trips
        identities.update(
            vae=model_identity(request.vae),
            device=str(given),
            dtype=str(dtype).removeprefix("torch."),
            vae_spec=str(request.vae),
        )
        if getattr(vae, "approximate_decode", False):
            identities["vae_note"] = "approximate decoder"
    if needs_flow:
        from flowlift.upscale.pipeline import FlowUpscalerPipeline

        pipeline = FlowUpscalerPipeline(upscaler, vae, device=device, dtype=dtype)
        identities.update(upscaler=model_identity(upscaler), upscaler_spec=str(upscaler))
    pixel_models = _load_pixel_models(request, specs, device, dtype, identities, given)
    fns = {
        s.label: make_method_fn(
            s, request.scale, vae=vae, pipeline=pipeline, device=device, dtype=dtype, pixel_models=pixel_models
        )
        for s in specs
    }
    cache_dir = None if request.no_cache else Path(request.cache) if request.cache else Path(request.output) / "cache"
    _remove_stale_temporaries(Path(request.output), cache_dir)

    def evaluate(indices=None):
        return evaluate_methods(
            specs,
            request.dataset,
            request.scale,
            method_fns=fns,
            identities=identities,
            cache_dir=cache_dir,
            measuring=request.measuring,
            limit=request.limit,
            figure_images=request.figure_images,
            progress=request.progress if env.is_main else False,  # a launched eval: rank 0's progress only
            save_outputs=Path(request.output) / "outputs" if request.save_outputs else None,
            indices=indices,
        )

    if not env.distributed:
        return evaluate()
    return _run_sharded(request, env, evaluate, cache_dir)


def _check_before_loading(request: EvalRequest, specs: Sequence[MethodSpec]) -> None:
    """What a run refuses before any model loads: every photo's size for the scale and the box (from the headers,
    :func:`flowlift.measure.inputs.check_dataset_sizes`), then every weight file the methods that run need (the VAE,
    the Flow Upscaler's, SesquiLSR's and spandrel models' files), all the missing ones named in one line, and with
    them a SesquiLSR method given a VAE whose spec says it has no BN statistics (``taef2``, ``mage``, a TAEF2
    folder: :func:`flowlift.models.vae_loading.vae_spec_kind`; that VAE is then not looked up)."""
    from flowlift.measure.inputs import check_dataset_sizes, dataset_paths
    from flowlift.measure.methods import SESQUI, SPANDREL, sesqui_vae_refusal, unreachable
    from flowlift.models.sesqui_lsr import check_sesqui_file
    from flowlift.models.weights import require_all
    from flowlift.upscale.loading import upscale_weight_checks

    check_dataset_sizes(dataset_paths(request.dataset, request.limit), request.scale, request.box)
    reachable = [s for s in specs if not unreachable(s, request.scale)]
    sesqui = [s for s in reachable if s.name == SESQUI]
    checks: list[Callable[[], object]] = []
    if sesqui and _no_bn_statistics(request.vae):  # that VAE is the one to change: not looked up
        checks.append(lambda: _raise(sesqui_vae_refusal(sesqui[0].label)))
        checks += upscale_weight_checks(_flow_upscaler(request, reachable), [])
    elif any(s.needs_vae for s in reachable):
        checks += upscale_weight_checks(_flow_upscaler(request, reachable), [request.vae])
    for spec in reachable:
        path = dict(spec.options).get("path")
        if spec.name == SESQUI:
            checks.append(lambda path=path: check_sesqui_file(path))
        elif spec.name == SPANDREL:
            checks.append(lambda path=path: check_spandrel_file(path))
    require_all(checks)


def _raise(error: FlowliftError) -> None:
    raise error


def _no_bn_statistics(vae: Any) -> bool:
    """Whether the VAE spec says, without loading it, that it has no BN statistics (TAEF2, Mage-VAE)."""
    from flowlift.models.vae_loading import vae_spec_kind
    from flowlift.models.vae_names import NO_BN_STATISTICS

    return vae_spec_kind(vae) in NO_BN_STATISTICS


def _flow_upscaler(request: EvalRequest, reachable: Sequence[MethodSpec]) -> str | None:
    """The Flow Upscaler weights the run loads: ``request.upscaler`` or the released ones when a ``flow`` method
    runs at this scale, else None."""
    from flowlift.upscale.loading import DEFAULT_UPSCALER

    return (request.upscaler or DEFAULT_UPSCALER) if any(s.name == "flow" for s in reachable) else None


def check_spandrel_file(path: str) -> None:
    """One line unless ``spandrel:PATH``'s model file exists (its reading is the loader's)."""
    from flowlift.measure.pixel_upscaler import MODEL_SUFFIXES

    if not Path(path).expanduser().is_file():  # the method as the caller wrote it: --run spandrel:PATH
        raise FlowliftError(
            f"{FIELD_MARK} spandrel:{path}: no such model file; give a spandrel model's file "
            f"({', '.join(MODEL_SUFFIXES)})",
            field="run",
        )


def _remove_stale_temporaries(output: Path, cache_dir: Path | None) -> None:
    """A killed run's temporary folders in the report folder, its saved outputs' folders and the cache: a rerun
    takes finished results from the cache and writes nothing there, so no write would sweep them."""
    from flowlift.files.atomic import remove_stale_temporaries

    saved = output / "outputs"
    folders = [output, *(sorted(p for p in saved.iterdir() if p.is_dir()) if saved.is_dir() else [])]
    for folder in [*folders, *([cache_dir] if cache_dir is not None else [])]:
        remove_stale_temporaries(folder)


def _run_sharded(request: EvalRequest, env: DistEnv, evaluate, cache_dir) -> EvalReport | None:
    """Each rank measures its pixel-balanced share into the shared cache; after the barrier rank 0
    builds the report from the cache, exactly as a single process would on a second run (anything a
    rank could not leave in the cache, e.g. a cache folder not shared between hosts, it computes)."""
    from flowlift.jobs.distributed import finish, image_pixels, probe_and_gather, shard_by_pixels, total_counts
    from flowlift.measure.inputs import dataset_paths

    if cache_dir is None:
        raise FlowliftError(
            f"a sharded eval {FIELD_MARK} merges the ranks' results through the cache; drop {FIELD_MARK}",
            field=("run", "no_cache"),
        )
    paths = dataset_paths(request.dataset, request.limit)
    pixels = probe_and_gather(env, paths, image_pixels)
    share = evaluate(shard_by_pixels(pixels, env.world_size)[env.rank])
    per_rank, reason = finish(env, {"computed": share.computed, "cached": share.cached}, request.barrier_timeout)
    if not env.is_main:
        return None
    if per_rank is None:
        raise FlowliftError(f"not every rank finished its share, no report written: {reason}")
    report = evaluate()
    totals = total_counts(per_rank)
    report.computed += totals["computed"]
    report.cached = totals["cached"]
    report.config["world_size"] = env.world_size
    return report


def _load_pixel_models(request: EvalRequest, specs, device, dtype, identities: dict, given=None) -> dict:
    """Load every spandrel model once (by path); record what identifies it in ``identities["spandrel"]``
    (with the device ``given``, default ``device``: under torchrun the setting, not the rank's cuda:N)."""
    given = device if given is None else given
    from flowlift.measure.cache import model_identity
    from flowlift.measure.methods import SPANDREL
    from flowlift.measure.pixel_upscaler import load_pixel_upscaler

    paths: dict[str, list[str]] = {}
    for s in specs:
        if s.name == SPANDREL:
            paths.setdefault(dict(s.options)["path"], []).append(s.label)
    if not paths:
        return {}
    tile, overlap = spandrel_tiling(request.tile, request.tile_overlap)
    models = {}
    info = identities.setdefault("spandrel", {})
    for path, labels in paths.items():
        check_spandrel_file(path)
        model = load_pixel_upscaler(path, device, dtype, tile=tile, overlap=overlap)
        models[path] = model
        info[path] = {
            "labels": ", ".join(labels),
            "model": model_identity(path),
            "architecture": model.architecture,
            "native_scale": model.native_scale,
            "tile": model.tile,
            "overlap": model.overlap,
            "device": str(given),  # as given, not the rank's cuda:N: one cache key for all ranks
            "dtype": str(dtype).removeprefix("torch."),
            "note": model.describe(request.scale),
        }
    return models
