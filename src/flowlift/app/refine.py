"""The Refine tab's request, without Gradio: one upload refined the way ``flowlift img2img`` / ``hires`` refine it.

The form (:class:`RefineForm`, every default from the knob tables) is checked in the tab's words, then becomes
one :class:`~flowlift.refine.request.RefineRequest`, planned by :func:`flowlift.refine.jobs.plan_refine_job` and
run by :func:`flowlift.refine.jobs.refine_job` on the service's loaded refiner (the hires fix through
:meth:`~flowlift.refine.refiner.Flux2Refiner.hires`, as the command line runs it) and written by
:func:`flowlift.refine.jobs.write_job` with the CLI's metadata (the upload's name where the CLI records a path).
The service is reached through its public parts only (its ``refine_models``,
:class:`~flowlift.app.refine_models.RefineModels`, and ``new_result_dir``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from flowlift.app.progress import ProgressFn
from flowlift.app.results import UpscaleResult, check_upload, logged_request, preview_pair, public_message
from flowlift.errors import ITEM_ERRORS, FlowliftError
from flowlift.knobs import SEED, Knob, labels
from flowlift.refine.settings import (
    HIRES_SCALE,
    REFINE_KNOBS,
    REFINE_STRENGTH,
    SAMPLER,
    STEPS,
    STRENGTH,
    STRENGTH_MAP,
    TILE_OVERLAP,
    TILE_SIZE,
)

#: Refine modes: img2img at the input size, or the hires fix (Flow Upscaler 2x/4x/8x, then refine).
MODES = {"img2img": 0, **{f"hires fix {factor}x": factor for factor in HIRES_SCALE.extra["presets"]}}


@dataclass(frozen=True)
class RefineForm:
    """The Refine tab's controls as sent (form and JSON values, checked by :func:`refine_upload`): ``strength`` is
    img2img's and ``refine_strength`` the hires fix's, two controls as ``--strength`` and ``--refine-strength`` are,
    so that a request leaving one out gets that mode's own default (None: the knob's); ``steps`` None is the loaded
    model's."""

    mode: str = "img2img"
    strength: Any = None
    refine_strength: Any = None
    strength_map: str = STRENGTH_MAP.default
    steps: Any = None  # the model's (4 for a step-distilled Klein, else 28), as the command line's
    seed: Any = SEED.default
    sampler: str = SAMPLER.default
    tile_size: Any = TILE_SIZE.default
    tile_overlap: Any = TILE_OVERLAP.default


def _checked(knob: Knob, value: Any) -> Any:
    """A request's value checked against its knob (JSON and form values parsed exactly), named by its field (the
    page says it with its label)."""
    try:
        return knob.check(value, loose=True)
    except FlowliftError:
        if knob.kind is int:
            domain = f"an integer in [{knob.low}, {knob.high}]"
        else:
            domain = f"a number in [{knob.low:g}, {knob.high:g}]"
        raise FlowliftError(f"{knob.name} must be {domain}, got {value}", field=knob.name) from None


def _text(value: Any, field: str) -> str | None:
    """A text field of the request as sent (JSON may send anything): text or None, else one line naming it."""
    if value is None or isinstance(value, str):
        return value
    raise FlowliftError(f"{field} must be text, got {type(value).__name__} {value!r}"[:200], field=field)


def _request(service: Any, source: Path, prompt: str | None, embeds: Path | None, form: RefineForm) -> Any:
    """The form as a :class:`~flowlift.refine.request.RefineRequest` on the service's model, into a fresh result
    folder under the CLI's output name."""
    from flowlift.files.naming import refined_output
    from flowlift.refine.request import HiresSettings, PromptRequest, RefineRequest, RefinerSource
    from flowlift.refine.settings import SamplingSettings
    from flowlift.refine.tiling import TileRequest
    from flowlift.upscale.latent_source import FlowUpscalerSource

    if not isinstance(form.mode, str) or form.mode not in MODES:
        raise FlowliftError(f"mode must be one of {', '.join(MODES)}, got {form.mode!r}"[:300])
    scale = MODES[form.mode]
    knob, given = (REFINE_STRENGTH, form.refine_strength) if scale else (STRENGTH, form.strength)
    strength = _checked(knob, knob.default if given is None else given)
    steps = None if form.steps is None else _checked(STEPS, form.steps)  # None: the model's, as the CLI's
    sampling = SamplingSettings(steps=steps, seed=_checked(SEED, form.seed), sampler=SAMPLER.check(form.sampler))
    hires = None
    if scale:
        hires = HiresSettings(
            upscaler=FlowUpscalerSource(service.config.upscaler), scale=scale, refine_strength=strength
        )
    config = service.config
    request = RefineRequest(
        mode="hires" if scale else "img2img",
        prompt=PromptRequest(text=prompt if (prompt or "").strip() else None, embeds=embeds),  # with embeds: recorded
        source=RefinerSource(config.model, config.model_vae, device=config.device or "auto", dtype=config.dtype),
        image=source,
        overwrite=True,  # a fresh folder of the app's own
        strength=None if scale else strength,
        strength_map=STRENGTH_MAP.check(form.strength_map, "strength map"),
        sampling=sampling,
        tiles=TileRequest.parse(form.tile_size, form.tile_overlap),
        hires=hires,
        command="hires" if scale else "img2img",
        progress=False,  # the page's bar reads the request's run (flowlift.progress), not a tqdm bar
    )
    name = refined_output(source.name, request.name_suffix).name
    return replace(request, output=service.new_result_dir() / name)


def refine_upload(
    service: Any,
    path: str | Path | None,
    prompt: str | None,
    prompt_embeds: str | Path | None,
    form: RefineForm,
    progress: ProgressFn,
) -> UpscaleResult:
    """Refine one upload as ``form`` says; written as ``<stem>_img2img.png`` / ``<stem>_hires<N>x.png`` with the
    CLI's metadata. Logs the server's one line for the request whatever its outcome."""
    from flowlift.app.progress import request_progress
    from flowlift.progress import running

    run = request_progress(progress)  # from the click: the bar names each stage and step, loading included
    run.loading(None)
    with (
        running(run),
        logged_request(service.config.log, "refine", Path(path).name if path else "-", str(form.mode)) as entry,
    ):
        result = _refine(service, path, prompt, prompt_embeds, form, run)
        (w0, h0), (w1, h1) = result.input_size, result.output_size
        entry.request = f"{form.mode} {w0}x{h0} -> {w1}x{h1}"
    return result


def _refine(
    service: Any,
    path: str | Path | None,
    prompt: str | None,
    prompt_embeds: str | Path | None,
    form: RefineForm,
    run: Any,
) -> UpscaleResult:
    from flowlift.refine.jobs import job_conditioning, plan_refine_job, refine_job, write_job
    from flowlift.refine.stages import plan_job_stages
    from flowlift.upscale.interrupts import checked_modules

    prompt = _text(prompt, "prompt")
    if not path:
        raise FlowliftError("no image uploaded")
    if not service.config.model:
        raise FlowliftError("no FLUX.2 model configured; start the app with --model to refine")
    source = check_upload(path, service.config.max_upload_mb)
    embeds = Path(prompt_embeds) if prompt_embeds else None
    if embeds is not None:
        check_upload(embeds, service.config.max_upload_mb)
    elif not (prompt or "").strip():
        raise FlowliftError("give a prompt or a prompt-embeds file (.safetensors with 'prompt_embeds')")
    try:
        request = _request(service, source, prompt, embeds, form)
    except FlowliftError as error:  # a knob the form got wrong, said as the page labels it
        raise FlowliftError(error.worded(labels(REFINE_KNOBS.values()))) from None
    try:
        job = plan_refine_job(request)
        conditioning = job_conditioning(job)  # the embeddings file read; text goes to the refiner's encoder
    except ITEM_ERRORS as error:
        raise FlowliftError(
            public_message(error, embeds if embeds is not None and embeds.name in str(error) else source)
        ) from None
    started = time.perf_counter()
    refiner = service.refine_models.refiner(text_encoder=request.prompt.embeds is None)
    refiner.progress = False
    plan_job_stages(run, job, request.sampling.steps or refiner.default_steps)
    stoppable = [getattr(refiner.vae, "model", None), refiner.transformer]  # Stop before every layer of each
    try:
        upscaler = service.refine_models.hires_upscaler(refiner) if request.mode == "hires" else None
        with checked_modules(service.one_run.check, stoppable):  # (a VAE's encode or decode is one long stage)
            result = refine_job(job, refiner, conditioning, upscaler)
        run.begin("writing")
        image = write_job(job, result, shown=lambda p: Path(p).name)
        run.finished("writing")
    except ITEM_ERRORS as error:
        raise FlowliftError(public_message(error, source)) from None
    before, after = preview_pair(job.rgb, image)
    return UpscaleResult(request.output, before, after, job.rgb.size, image.size, time.perf_counter() - started)
