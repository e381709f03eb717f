"""``flowlift app``'s Refine tab (only with ``--model``): FLUX.2 img2img or the hires fix of one upload.

A thin layer over :class:`flowlift.refine.refiner.Flux2Refiner` (``img2img`` and ``hires``), with the output
names and PNG metadata of ``flowlift img2img`` / ``flowlift hires``. The per-step progress is the
refiner's own tqdm bar, which the page follows (``gr.Progress(track_tqdm=True)``).
"""

from __future__ import annotations

import html
import time
from pathlib import Path
from typing import Any

from flowlift.app.progress import ProgressFn
from flowlift.app.results import (
    UpscaleResult,
    check_upload,
    logged_request,
    model_name,
    preview_pair,
    public_message,
)
from flowlift.app.service import AppService
from flowlift.errors import FlowliftError
from flowlift.jobs.batch import ITEM_ERRORS
from flowlift.knobs import SEED, Knob
from flowlift.refine.settings import (
    HIRES_SCALE,
    SAMPLER,
    STEPS,
    STRENGTH,
    STRENGTH_MAP,
    TILE_MULTIPLE,
    TILE_OVERLAP,
    TILE_SIZE,
)

#: Refine modes: img2img at the input size, or the hires fix (Flow Upscaler 2x/4x/8x, then refine).
MODES = {"img2img": 0, **{f"hires fix {factor}x": factor for factor in HIRES_SCALE.choices}}
MAX_STEPS = STEPS.high
#: The tile size menu: the knob's words, then sides FLUX.2 is used at (any multiple of 16 may be typed in).
TILE_SIZE_CHOICES = (*TILE_SIZE.words, "512", "768", "1024", "1536", "2048")


def _no_progress(_fraction: float, _description: str) -> None:
    return None


def _checked(knob: Knob, value: Any) -> Any:
    """A request's value checked against its knob (JSON and form values parsed exactly), in this tab's words."""
    try:
        return knob.check(value, loose=True)
    except FlowliftError:
        if knob.kind is int:
            domain = f"an integer in [{knob.low}, {knob.high}]"
        else:
            domain = f"a number in [{knob.low:g}, {knob.high:g}]"
        raise FlowliftError(f"{knob.name} must be {domain}, got {value}") from None


def _hires_upscaler(service: AppService, refiner: Any) -> Any:
    """A Flow Upscaler pipeline on the refiner's VAE, reusing a UNet the service already loaded."""
    from flowlift.upscale.pipeline import FlowUpscalerPipeline

    with service._lock:
        cached = service._hires_pipeline
        if cached is None:
            loaded = next(iter(service._pipelines.values()), None)
            if loaded is not None:
                cached = FlowUpscalerPipeline(loaded.upscaler, refiner.vae, device=refiner.device, dtype=refiner.dtype)
            else:
                cached = FlowUpscalerPipeline(
                    service.upscaler_source, refiner.vae, device=refiner.device, dtype=refiner.dtype
                )
            service._hires_pipeline = cached
        return cached


def _tiles(tile_size: Any, tile_overlap: Any) -> dict[str, Any]:
    """The mode's ``tile_size``/``tile_overlap`` from the form: each knob's check (text parsed exactly) and the
    tiling module's grid and overlap-below-tile rules, one line in the knobs' words otherwise."""
    from flowlift.refine.tiling import TileRequest

    request = TileRequest.parse(tile_size, tile_overlap)
    return {"tile_size": request.size, "tile_overlap": request.overlap}


def refine(
    service: AppService,
    path: str | Path | None,
    prompt: str | None = None,
    prompt_embeds: str | Path | None = None,
    mode: str = "img2img",
    strength: Any = 0.5,
    strength_map: str = "linear",
    steps: Any = 28,
    seed: Any = 0,
    sampler: str = "euler",
    tile_size: Any = TILE_SIZE.default,
    tile_overlap: Any = TILE_OVERLAP.default,
    progress: ProgressFn = _no_progress,
) -> UpscaleResult:
    """Refine one upload; written as ``<stem>_img2img.png`` / ``<stem>_hires<N>x.png`` with the CLI's metadata.

    ``tile_size`` (px, ``auto`` or ``off``) and ``tile_overlap`` (px) are the tiled refine's knobs
    (:data:`flowlift.refine.settings.TILE_KNOBS`); the tiles that ran are in the metadata as the CLI writes them.
    Logs the server's one line for the request whatever its outcome.
    """
    with logged_request(service.config.log, "refine", Path(path).name if path else "-", str(mode)) as entry:
        tiles = _tiles(tile_size, tile_overlap)
        result = _refine(
            service, path, prompt, prompt_embeds, mode, strength, strength_map, steps, seed, sampler, progress, tiles
        )
        (w0, h0), (w1, h1) = result.input_size, result.output_size
        entry.request = f"{mode} {w0}x{h0} -> {w1}x{h1}"
    return result


def _refine(
    service: AppService,
    path: str | Path | None,
    prompt: str | None = None,
    prompt_embeds: str | Path | None = None,
    mode: str = "img2img",
    strength: Any = 0.5,
    strength_map: str = "linear",
    steps: Any = 28,
    seed: Any = 0,
    sampler: str = "euler",
    progress: ProgressFn = _no_progress,
    tiles: dict[str, Any] | None = None,
) -> UpscaleResult:
    from flowlift.files.image_outputs import input_hashes, save_image_atomic
    from flowlift.files.images import attach_alpha, load_image, tensor_to_pil, to_tensor
    from flowlift.files.naming import refined_output
    from flowlift.refine.prompts import load_prompt_embeds
    from flowlift.refine.settings import SamplingSettings
    from flowlift.upscale.settings import SCALE_PASSES

    if not path:
        raise FlowliftError("no image uploaded")
    if mode not in MODES:
        raise FlowliftError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    strength = _checked(STRENGTH, strength)  # the hires fix's refine strength shares its domain
    steps = _checked(STEPS, steps)
    seed = _checked(SEED, seed)  # exact: never through float()
    strength_map = STRENGTH_MAP.check(strength_map, "strength map")
    sampler = SAMPLER.check(sampler)
    source = check_upload(path, service.config.max_upload_mb)
    embeds = negative = None
    embeds_path = Path(prompt_embeds) if prompt_embeds else None
    if embeds_path is not None:
        check_upload(embeds_path, service.config.max_upload_mb)
        try:
            embeds, negative = load_prompt_embeds(embeds_path)
        except ITEM_ERRORS as error:
            raise FlowliftError(public_message(error, embeds_path)) from None
    elif not (prompt or "").strip():
        raise FlowliftError("give a prompt or a prompt-embeds file (.safetensors with 'prompt_embeds')")
    try:
        rgb, alpha = load_image(source)
    except FlowliftError as error:
        raise FlowliftError(public_message(error, source)) from None
    scale = MODES[mode]
    if scale and (rgb.size[0] % 16 or rgb.size[1] % 16):
        raise FlowliftError(f"{source.name}: the hires fix needs sides that are multiples of 16 px, got {rgb.size}")

    started = time.perf_counter()
    refiner = service.refiner(progress, text_encoder=embeds is None)
    refiner.progress = True  # its tqdm bar is what the page's progress follows
    conditioning = {"prompt": None if embeds is not None else prompt, "prompt_embeds": embeds}
    conditioning["negative_prompt_embeds"] = negative
    sampling = SamplingSettings(steps=steps, seed=seed, sampler=sampler)
    common = dict(strength_map=strength_map, sampling=sampling, **conditioning, **(tiles or {}))
    folder = service._new_result_dir()
    try:
        if scale:
            upscaler = _hires_upscaler(service, refiner)
            passes = SCALE_PASSES[scale]

            def upscale(latents: Any) -> Any:
                return upscaler.upscale_latents(latents, num_passes=passes, seed=seed)

            result = refiner.hires(upscale, images=to_tensor(rgb), refine_strength=strength, scale=scale, **common)
            name = refined_output(source.name, f"hires{scale}x").name
            extra = {"command": "hires", "upscaler": service.upscaler_source, "transplant_strength": 1.0}
            extra["color_fix"] = True
        else:
            result = refiner.img2img(to_tensor(rgb), strength=strength, **common)
            name = refined_output(source.name, "img2img").name
            extra = {"command": "img2img"}
    except ITEM_ERRORS as error:
        raise FlowliftError(public_message(error, source)) from None
    metadata = dict(result.parameters)
    metadata.update(
        input=source.name,
        prompt_embeds=embeds_path.name if embeds_path else None,
        vae=service.config.model_vae or service.config.model,
        **extra,
        **input_hashes({"input": str(source), "prompt_embeds": str(embeds_path) if embeds_path else None}),
    )
    metadata = {key: value for key, value in metadata.items() if value is not None}
    image = attach_alpha(tensor_to_pil(result.images[0]), alpha if not scale else None)
    out = save_image_atomic(image, folder / name, {"flowlift": metadata})
    before, after = preview_pair(rgb, image)
    return UpscaleResult(out, before, after, rgb.size, image.size, time.perf_counter() - started)


def _tile_controls(gr: Any) -> tuple[Any, Any]:
    """Tile size (auto / off / px, typed or picked) and tile overlap (px), from the knobs."""
    with gr.Row():
        tile_size = gr.Dropdown(
            list(TILE_SIZE_CHOICES),
            value=TILE_SIZE.default,
            allow_custom_value=True,
            label="Tile size (px)",
            info=f"auto: 1024 px tiles above FLUX.2's 4 MP; off: one transformer call; or a multiple of "
            f"{TILE_MULTIPLE}, at least {TILE_SIZE.low}",
            elem_id="refine-tile-size",
        )
        tile_overlap = gr.Number(
            value=TILE_OVERLAP.default,
            precision=0,
            minimum=TILE_OVERLAP.low,
            maximum=TILE_OVERLAP.high,
            step=TILE_OVERLAP.step,
            label="Tile overlap (px)",
            info=f"a multiple of {TILE_MULTIPLE}, less than the tile; neighbours crossfade across it",
            elem_id="refine-tile-overlap",
        )
    return tile_size, tile_overlap


def refine_tab(gr: Any, service: AppService, queue: dict[str, Any], as_user_error: Any, upload_path: Any) -> None:
    """The Refine tab and its ``refine`` endpoint (built inside the page's ``gr.Blocks``)."""
    follow_tqdm = gr.Progress(track_tqdm=True)

    def run(image, prompt, embeds, mode, strength, strength_map, steps, seed, sampler, tile_size, tile_overlap,
            progress=follow_tqdm):  # fmt: skip
        try:
            result = refine(
                service,
                upload_path(image),
                prompt,
                upload_path(embeds),
                mode,
                strength,
                strength_map,
                steps,
                seed,
                sampler,
                tile_size,
                tile_overlap,
                progress=lambda fraction, text: progress(fraction, desc=text),
            )
        except Exception as error:  # noqa: BLE001 - every failure becomes a visible message
            raise as_user_error(gr, error) from None
        return (result.before, result.after), str(result.output), result.summary()

    with gr.Tab("Refine", id="refine"):
        gr.Markdown(f"FLUX.2 model: `{html.escape(model_name(str(service.config.model)))}`")
        with gr.Row():
            with gr.Column():
                image = gr.Image(
                    label="Image",
                    type="filepath",
                    image_mode=None,
                    sources=["upload", "clipboard"],
                    elem_id="refine-input",
                )
                prompt = gr.Textbox(label="Prompt (needs flowlift[text]; or give prompt embeddings below)", lines=2)
                embeds = gr.File(label="Prompt embeddings (.safetensors with 'prompt_embeds')", elem_id="refine-embeds")
                mode = gr.Radio(list(MODES), value="img2img", label="Mode")
                strength = gr.Slider(
                    STRENGTH.low,
                    STRENGTH.high,
                    value=STRENGTH.default,
                    step=STRENGTH.step,
                    label="How much to redraw the image",
                    info="0 keeps it, 1 draws it anew from noise (hires fix: the redraw after the upscale). "
                    "Sampling starts at denoising_start = 1 - strength (linear) or 1 - strength**0.2 (canvas).",
                )
                strength_map = gr.Radio(
                    list(STRENGTH_MAP.choices),
                    value=STRENGTH_MAP.default,
                    label="How strength is counted",
                    info="linear: 0.5 redraws the last half of the schedule; canvas: as canvas apps count it, "
                    "much stronger at the same number (0.5 redraws 87%)",
                )
                steps = gr.Number(
                    value=STEPS.default,
                    precision=0,
                    minimum=STEPS.low,
                    maximum=STEPS.high,
                    label="Steps of the full schedule",
                )
                seed = gr.Number(value=SEED.default, precision=0, minimum=SEED.low, maximum=SEED.high, label="Seed")
                sampler = gr.Radio(list(SAMPLER.choices), value=SAMPLER.default, label="Sampler")
                tile_size, tile_overlap = _tile_controls(gr)
                button = gr.Button("Refine", variant="primary", elem_id="refine-button")
            with gr.Column():
                slider = gr.ImageSlider(label="Before / after", type="pil", format="png", elem_id="refine-slider")
                download = gr.File(label="Full-resolution PNG", elem_id="refine-download")
                info = gr.Markdown(elem_id="refine-info")
        button.click(
            run,
            inputs=[image, prompt, embeds, mode, strength, strength_map, steps, seed, sampler, tile_size, tile_overlap],
            outputs=[slider, download, info],
            api_name="refine",
            preprocess=False,
            show_progress_on=[slider],
            **queue,
        )
