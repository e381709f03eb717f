"""``flowlift app``'s Refine tab (only with ``--model``): FLUX.2 img2img or the hires fix of one upload.

The Gradio controls over :meth:`flowlift.app.service.AppService.refine` (:mod:`flowlift.app.refine`: one
:class:`~flowlift.refine.request.RefineRequest`, refine's own plan and hires composition), with the output names
and PNG metadata of ``flowlift img2img`` / ``flowlift hires``. Every control's range and default is its knob's:
img2img's strength and the hires fix's refine strength are two sliders (one shown per mode), and the steps start at
the loaded model's (4 for a step-distilled Klein, else 28: :func:`flowlift.refine.loading.model_default_steps`, as
``flowlift img2img``/``hires`` choose them). The bar names each stage and step with the time left (the request's
:class:`~flowlift.progress.RunProgress`).
"""

from __future__ import annotations

import html
from typing import Any

from flowlift.app.controls import image_input, knob_number, knob_slider, result_column, seed_number
from flowlift.app.gradio_requests import run_stoppable, upload_path
from flowlift.app.refine import MODES, RefineForm
from flowlift.app.results import UpscaleResult, model_name
from flowlift.app.service import AppService
from flowlift.limits import PIXEL_MULTIPLE
from flowlift.refine.loading import model_default_steps
from flowlift.refine.settings import REFINE_STRENGTH, SAMPLER, STEPS, STRENGTH, STRENGTH_MAP, TILE_OVERLAP, TILE_SIZE

MAX_STEPS = STEPS.high
#: The tile size menu: the knob's words, then sides FLUX.2 is used at (any multiple of 16 may be typed in).
TILE_SIZE_CHOICES = (*TILE_SIZE.words, "512", "768", "1024", "1536", "2048")


def refine(
    service: AppService,
    path: Any,
    prompt: str | None = None,
    prompt_embeds: Any = None,
    *form: Any,
    progress: Any = None,
    **named: Any,
) -> UpscaleResult:
    """The tab's handler: :meth:`flowlift.app.service.AppService.refine` with the form's controls in the page's order
    (:class:`~flowlift.app.refine.RefineForm`'s fields: mode, strength, refine strength, strength map, steps, seed,
    sampler, tile size, tile overlap), positional or by name."""
    extra = {} if progress is None else {"progress": progress}
    return service.refine(path, prompt, prompt_embeds, RefineForm(*form, **named), **extra)


def _tile_controls(gr: Any) -> tuple[Any, Any]:
    """Tile size (auto / off / px, typed or picked) and tile overlap (px), from the knobs."""
    with gr.Row():
        tile_size = gr.Dropdown(
            list(TILE_SIZE_CHOICES),
            value=TILE_SIZE.default,
            allow_custom_value=True,
            label="Tile size (px)",
            info=f"auto: 1024 px tiles above FLUX.2's 4 MP; off: one transformer call; or a multiple of "
            f"{PIXEL_MULTIPLE}, at least {TILE_SIZE.low}",
            elem_id="refine-tile-size",
        )
        tile_overlap = knob_number(
            gr,
            TILE_OVERLAP,
            label="Tile overlap (px)",
            info=f"a multiple of {PIXEL_MULTIPLE}, less than the tile; neighbours crossfade across it",
            elem_id="refine-tile-overlap",
        )
    return tile_size, tile_overlap


def _handler(gr: Any, service: AppService, as_user_error: Any) -> Any:
    """The ``refine`` endpoint's function: uploads to paths, the stage bar, any failure one visible message."""
    stage_progress = gr.Progress()

    def run(
        image,
        prompt,
        embeds,
        mode,
        strength,
        refine_strength,
        strength_map,
        steps,
        seed,
        sampler,
        tile_size,
        tile_overlap,
        progress=stage_progress,
    ):
        try:
            form = (mode, strength, refine_strength, strength_map, steps, seed, sampler, tile_size, tile_overlap)
            values = (service, upload_path(image), prompt, upload_path(embeds), *form)
            result = run_stoppable(service, refine, values, progress)
        except Exception as error:  # noqa: BLE001 - every failure becomes a visible message
            raise as_user_error(gr, error) from None
        return (result.before, result.after), str(result.output), result.summary()

    return run


def _redraw_controls(gr: Any, service: AppService) -> tuple[Any, Any, Any, Any]:
    """The two strengths (img2img's, the hires fix's: one shown per mode, each with its knob's default, so that an
    API call leaving one out gets its mode's), how strength is counted, and the steps (the loaded model's default)."""
    formula = "Sampling starts at denoising_start = 1 - strength (linear) or 1 - strength**0.2 (canvas)."
    strength = knob_slider(
        gr,
        STRENGTH,
        label="How much to redraw the image",
        info=f"0 keeps it, 1 draws it anew from noise. {formula}",
    )
    refine_strength = knob_slider(
        gr,
        REFINE_STRENGTH,
        label="How much to redraw after the upscale",
        info=f"hires fix: 0 keeps the upscaled image, 1 draws it anew from noise. {formula}",
        visible=False,
    )
    strength_map = gr.Radio(
        list(STRENGTH_MAP.choices),
        value=STRENGTH_MAP.default,
        label="How strength is counted",
        info="linear: 0.5 redraws the last half of the schedule; canvas: as canvas apps count it, "
        "much stronger at the same number (0.5 redraws 87%)",
    )
    model_steps, why = model_default_steps(service.config.model) if service.config.model else (STEPS.default, "")
    steps = gr.Number(
        value=model_steps,
        precision=0,
        minimum=STEPS.low,
        maximum=STEPS.high,
        label="Steps of the full schedule",
        info=f"the model's default: {model_steps} ({why}), as flowlift img2img and hires choose it",
    )
    return strength, refine_strength, strength_map, steps


def refine_tab(gr: Any, service: AppService, queue: dict[str, Any], as_user_error: Any) -> None:
    """The Refine tab and its ``refine`` endpoint (built inside the page's ``gr.Blocks``)."""
    run = _handler(gr, service, as_user_error)
    with gr.Tab("Refine", id="refine"):
        gr.Markdown(f"FLUX.2 model: `{html.escape(model_name(str(service.config.model)))}`")
        with gr.Row():
            with gr.Column():
                image = image_input(gr, "Image", "refine-input")
                prompt = gr.Textbox(label="Prompt (needs flowlift[text]; or give prompt embeddings below)", lines=2)
                embeds = gr.File(label="Prompt embeddings (.safetensors with 'prompt_embeds')", elem_id="refine-embeds")
                mode = gr.Radio(list(MODES), value="img2img", label="Mode")
                strength, refine_strength, strength_map, steps = _redraw_controls(gr, service)
                seed = seed_number(gr)
                sampler = gr.Radio(list(SAMPLER.choices), value=SAMPLER.default, label="Sampler")
                tile_size, tile_overlap = _tile_controls(gr)
                button = gr.Button("Refine", variant="primary", elem_id="refine-button")
                stop = gr.Button("Stop", variant="stop", elem_id="refine-stop")
            with gr.Column():
                slider, download, info = result_column(gr, "refine", "Before / after")
        mode.change(
            lambda chosen: (gr.update(visible=not MODES[chosen]), gr.update(visible=bool(MODES[chosen]))),
            inputs=[mode],
            outputs=[strength, refine_strength],
            api_name=False,
        )
        form = [mode, strength, refine_strength, strength_map, steps, seed, sampler, tile_size, tile_overlap]
        started = button.click(
            run,
            inputs=[image, prompt, embeds, *form],
            outputs=[slider, download, info],
            api_name="refine",
            preprocess=False,
            show_progress_on=[slider],
            **queue,
        )
        stop.click(None, cancels=[started], api_visibility="private")  # the handler stops at its next step or tile
