"""``flowlift app``: the Gradio page over :class:`flowlift.app.service.AppService`.

Tabs: **Upscale** (one image, before/after slider, full-resolution download; also the API endpoint
``upscale``), **Batch** (several files into a zip with the CLI's names, per-file errors listed) and,
when a FLUX.2 model is configured, **Refine** (img2img / hires fix). Every handler that runs a model
shares one queue slot per device (``concurrency_limit=1``), so requests on one GPU run one at a time
and a waiting request shows its place in the queue. Handlers take the raw upload payloads
(``preprocess=False``): the file is opened only by :func:`flowlift.files.images.load_image`, so a corrupt
file, a decompression bomb or an unsupported format reaches the user as one error line instead of
a failure inside Gradio's own image decoding.

Gradio is imported only when a page is built (it is the optional ``app`` extra).
"""

from __future__ import annotations

import html
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from flowlift.app.service import PREVIEW_MAX_SIDE, SCALES, AppService
from flowlift.errors import FlowliftError

#: Fonts the browser has already: the default theme would fetch web fonts from the internet.
SYSTEM_FONTS = ["ui-sans-serif", "system-ui", "sans-serif"]
MONO_FONTS = ["ui-monospace", "monospace"]


def import_gradio() -> Any:
    """Gradio, with its analytics off, or one error line saying how to install it."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    try:
        import gradio
    except ImportError:
        from flowlift.console import install_command

        raise FlowliftError(f"the app needs Gradio 6: {install_command('app')}") from None
    if int(gradio.__version__.split(".")[0]) < 6:
        raise FlowliftError(f"the app needs Gradio 6.x, found {gradio.__version__}: pip install 'gradio>=6,<7'")
    return gradio


def upload_path(payload: Any) -> str | None:
    """The server-side path of a raw upload payload (a FileData dict, or a path string)."""
    if payload is None:
        return None
    if isinstance(payload, dict):
        return payload.get("path")
    return os.fspath(payload)


def _as_user_error(gr: Any, error: BaseException) -> Exception:
    """A ``gr.Error`` (escaped, shown until closed) for any failure; the server logs unexpected ones."""
    if not isinstance(error, FlowliftError):
        traceback.print_exception(error, file=sys.stderr)
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return gr.Error(html.escape(text), duration=None, print_exception=False)


def _progress_adapter(progress: Any) -> Callable[[float, str], None]:
    def report(fraction: float, description: str) -> None:
        progress(min(max(fraction, 0.0), 1.0), desc=description)

    return report


def build_app(service: AppService) -> Any:
    """The ``gr.Blocks`` page of ``flowlift app`` (not launched)."""
    gr = import_gradio()
    config = service.config
    device = config.device or "the default device"
    queue = {"concurrency_limit": 1, "concurrency_id": f"models-{device}"}

    stage_progress = gr.Progress()

    def upscale(image, scale, seed, transplant_strength, color_fix_strength, vae=None, progress=stage_progress):
        try:
            result = service.upscale(
                upload_path(image),
                scale,
                seed,
                transplant_strength,
                color_fix_strength,
                vae,
                progress=_progress_adapter(progress),
            )
        except Exception as error:  # noqa: BLE001 - every failure becomes a visible message, the server stays up
            raise _as_user_error(gr, error) from None
        for warning in result.warnings:
            gr.Warning(html.escape(warning), duration=None)
        return (result.before, result.after), str(result.output), result.summary()

    def batch(files, scale, seed, transplant_strength, color_fix_strength, vae=None, progress=stage_progress):
        try:
            paths = [upload_path(f) for f in (files or [])]
            result = service.batch(
                paths, scale, seed, transplant_strength, color_fix_strength, vae, progress=_progress_adapter(progress)
            )
        except Exception as error:  # noqa: BLE001
            raise _as_user_error(gr, error) from None
        return (str(result.zip_path) if result.zip_path else None), result.summary()

    with gr.Blocks(title="flowlift", analytics_enabled=False, delete_cache=(3600, 3600)) as demo:
        gr.Markdown(
            "# flowlift\n"
            "The Flow Upscaler in one step per 2x pass, colour drift corrected. "
            f"Requests run one at a time on {html.escape(str(device))}; a request that waits shows its place "
            f"in the queue over the result. Uploads up to {config.max_upload_mb:g} MB.",
            elem_id="intro",
        )
        with gr.Tab("Upscale", id="upscale"):
            with gr.Row():
                with gr.Column():
                    image = gr.Image(
                        label="Image (drop, paste or click to upload)",
                        type="filepath",
                        image_mode=None,
                        sources=["upload", "clipboard"],
                        elem_id="upscale-input",
                    )
                    controls = _upscale_controls(gr, config.vaes, "upscale")
                    run = gr.Button("Upscale", variant="primary", elem_id="upscale-button")
                with gr.Column():
                    slider = gr.ImageSlider(
                        label=f"Before (input, Lanczos-resized) / after; preview up to {PREVIEW_MAX_SIDE} px",
                        type="pil",
                        format="png",
                        elem_id="upscale-slider",
                    )
                    download = gr.File(label="Full-resolution PNG", elem_id="upscale-download")
                    info = gr.Markdown(elem_id="upscale-info")
            run.click(
                upscale,
                inputs=[image, *controls],
                outputs=[slider, download, info],
                api_name="upscale",
                preprocess=False,
                **queue,
            )
        with gr.Tab("Batch", id="batch"):
            with gr.Row():
                with gr.Column():
                    files = gr.File(label="Images", file_count="multiple", elem_id="batch-input")
                    batch_controls = _upscale_controls(gr, config.vaes, "batch")
                    run_batch = gr.Button("Upscale all", variant="primary", elem_id="batch-button")
                with gr.Column():
                    archive = gr.File(
                        label="Zip of the outputs (names as flowlift upscale writes them)", elem_id="batch-zip"
                    )
                    report = gr.Markdown(elem_id="batch-report")
            run_batch.click(
                batch,
                inputs=[files, *batch_controls],
                outputs=[archive, report],
                api_name="batch",
                preprocess=False,
                **queue,
            )
        if config.model:
            from flowlift.app.refine_tab import refine_tab

            refine_tab(gr, service, queue, _as_user_error, upload_path)
    return demo


def _upscale_controls(gr: Any, vaes: list[str], prefix: str) -> list[Any]:
    """Scale, seed, both strengths and the VAE choice (the API's argument order)."""
    scale = gr.Radio(list(SCALES), value=2, label="Scale", elem_id=f"{prefix}-scale")
    seed = gr.Number(value=0, precision=0, minimum=0, label="Seed", elem_id=f"{prefix}-seed")
    transplant = gr.Slider(
        0.0,
        1.0,
        value=1.0,
        step=0.05,
        label="Transplant strength (stage 1: latent low band; lower = truer to the input)",
    )
    color_fix = gr.Slider(0.0, 1.0, value=1.0, step=0.05, label="Colour-fix strength (stage 2: L*a*b* low band)")
    vae = gr.Dropdown(vaes, value=vaes[0], label="VAE", interactive=len(vaes) > 1, elem_id=f"{prefix}-vae")
    return [scale, seed, transplant, color_fix, vae]


def launch(
    demo: Any,
    service: AppService,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    share: bool = False,
    block: bool = True,
) -> Any:
    """Serve ``demo`` (queue on, upload limit, system fonts, no share unless asked); returns after close."""
    gr = import_gradio()
    demo.queue(default_concurrency_limit=1)
    kwargs = dict(
        server_name=host,
        server_port=port,
        share=share,
        max_file_size=int(service.config.max_upload_mb * 2**20),
        allowed_paths=[str(service.work_dir)],
        theme=gr.themes.Default(font=SYSTEM_FONTS, font_mono=MONO_FONTS),
        ssr_mode=False,
        show_error=True,
        quiet=False,
        prevent_thread_lock=not block,
    )
    return demo.launch(**kwargs)
