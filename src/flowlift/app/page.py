"""``flowlift app``: the Gradio page over :class:`flowlift.app.service.AppService`.

Tabs: **Upscale** (one image, before/after slider, a detail view at 100%/200% beside the input,
full-resolution download; also the API endpoint ``upscale``), **Batch** (several files into a zip
with the CLI's names, per-file errors listed) and, when a FLUX.2 model is configured, **Refine**
(img2img / hires fix). Every handler that runs a model shares one queue slot per device
(``concurrency_limit=1``), so requests on one GPU run one at a time and a waiting request shows its
place in the queue. Handlers take the raw upload payloads (``preprocess=False``): the file is opened
only by :func:`flowlift.files.images.load_image`, so a corrupt file, a decompression bomb or an
unsupported format reaches the user as one error line instead of a failure inside Gradio's own image
decoding; the file is also read as soon as it is dropped, so such an error shows at once. Each
request has one progress bar (stages, passes and decode tiles, with the time left) over its main
output.

Gradio is imported only when a page is built (it is the optional ``app`` extra).
"""

from __future__ import annotations

import html
import os
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from flowlift.app.controls import image_input, knob_number, knob_slider, result_column, seed_number
from flowlift.app.detail import INPUT_FILTERS, ZOOMS, detail_html, detail_view, overview_to_output
from flowlift.app.gradio_requests import run_stoppable, upload_path
from flowlift.app.progress import RequestStopped
from flowlift.app.results import PREVIEW_MAX_SIDE, first_line
from flowlift.app.service import AppService
from flowlift.errors import FlowliftError
from flowlift.upscale.settings import COLOR_FIX_STRENGTH, SCALE, TRANSPLANT_STRENGTH

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


def _user_text(error: BaseException) -> str:
    """The first line of an error for the page (unescaped); the server logs unexpected errors in full."""
    if not isinstance(error, (FlowliftError, RequestStopped)):
        traceback.print_exception(error, file=sys.stderr)
    return first_line(error)


def _as_user_error(gr: Any, error: BaseException) -> Exception:
    """A ``gr.Error`` (escaped, shown until closed) for any failure; the server logs unexpected ones."""
    return gr.Error(html.escape(_user_text(error)), duration=None, print_exception=False)


#: Styles of the page's status lines (plain text marks: the page needs no emoji font).
#: Gradio's own estimate is hidden (its ETA bar and "processing | 2.1/120.9s" timer come from the averages of earlier
#: requests, issue 48): each request's bar is flowlift's, from the click (flowlift.app.progress).
CSS = """
.flowlift-error { color: var(--error-text-color, #b91c1c); font-weight: 600; }
.flowlift-ok { color: var(--body-text-color-subdued, #4b5563); }
.eta-bar, .progress-text { display: none !important; }
"""

#: Sizes the detail crops in device pixels: at 100% one image pixel per screen pixel, also on a HiDPI
#: screen (devicePixelRatio 2 shows a 512 px crop as 256 CSS px, which are 512 screen pixels).
FIT_DEVICE_PIXELS = """
const fit = () => {
  const ratio = window.devicePixelRatio || 1;
  element.querySelectorAll('img[data-zoom]').forEach((img) => {
    img.style.width = (Number(img.getAttribute('width')) / ratio) + 'px';
    img.style.height = (Number(img.getAttribute('height')) / ratio) + 'px';
  });
};
fit();
watch('value', fit);
"""


def status_line(text: str, error: bool = False) -> str:
    """One status line for a Markdown field, marked by a word and a colour (no icon font needed)."""
    if not text:
        return ""
    kind, mark = ("flowlift-error", "Error:") if error else ("flowlift-ok", "Ready:")
    return f'<span class="{kind}">{mark}</span> {html.escape(text)}'


def build_app(service: AppService) -> Any:
    """The ``gr.Blocks`` page of ``flowlift app`` (not launched)."""
    gr = import_gradio()
    config = service.config
    device = config.device or "the default device"
    queue = {"concurrency_limit": 1, "concurrency_id": f"models-{device}"}
    # Views (the upload check, the detail crops) never wait behind a running upscale, two at a time (each
    # decodes a whole image), and draw no overlay over the crops (a veil would change the pixels shown).
    views = {"concurrency_limit": 2, "concurrency_id": "views", "api_visibility": "private", "show_progress": "hidden"}

    on = _handlers(gr, service)
    with gr.Blocks(title="flowlift", analytics_enabled=False, delete_cache=(3600, 3600)) as demo:
        gr.Markdown(
            "# flowlift\n"
            "The Flow Upscaler in one step per 2x pass, colour drift corrected. "
            f"Requests run one at a time on {html.escape(str(device))}; a request that waits shows its place "
            f"in the queue over the result. Uploads up to {config.max_upload_mb:g} MB.",
            elem_id="intro",
        )
        with gr.Tab("Upscale", id="upscale"):
            _upscale_tab(gr, service, on, queue, views)
        with gr.Tab("Batch", id="batch"):
            _batch_tab(gr, service, on, queue)
        if config.model:
            from flowlift.app.refine_tab import refine_tab

            refine_tab(gr, service, queue, _as_user_error)
    return demo


def _handlers(gr: Any, service: AppService) -> SimpleNamespace:
    """The page's event handlers over ``service``: every failure a visible message, the server up."""
    stage_progress = gr.Progress()

    def upscale(
        image,
        scale,
        seed,
        transplant_strength,
        color_fix_strength,
        vae=None,
        latent_upscaler=False,
        progress=stage_progress,
    ):
        try:
            source = upload_path(image)
            values = (source, scale, seed, transplant_strength, color_fix_strength, vae, latent_upscaler)
            result = run_stoppable(service, service.upscale, values, progress)
        except Exception as error:  # noqa: BLE001 - every failure becomes a visible message, the server stays up
            raise _as_user_error(gr, error) from None
        for warning in result.warnings:
            gr.Warning(html.escape(warning), duration=None)
        shown = {"source": source, "output": str(result.output), "size": result.output_size, "centre": None}
        return (result.before, result.after), str(result.output), result.summary(), shown

    def check(image):
        try:
            return status_line(service.check_image(upload_path(image))), gr.update(interactive=True)
        except Exception as error:  # noqa: BLE001 - shown under the input, where the file was dropped
            return status_line(_user_text(error), error=True), gr.update(interactive=False)

    def show_detail(shown, zoom, input_filter):
        if not shown:
            return None, "", shown
        try:
            view, thumbnail = detail_view(
                Path(shown["source"]), Path(shown["output"]), shown["centre"], zoom, input_filter
            )
        except Exception as error:  # noqa: BLE001
            raise _as_user_error(gr, error) from None
        return thumbnail, detail_html(view, Path(shown["output"]).name), shown

    def pick_region(shown, zoom, input_filter, evt: gr.SelectData):
        if not shown or not isinstance(evt.index, (list, tuple)) or len(evt.index) != 2:
            return show_detail(shown, zoom, input_filter)
        centre = overview_to_output((float(evt.index[0]), float(evt.index[1])), tuple(shown["size"]))
        return show_detail({**shown, "centre": centre}, zoom, input_filter)

    pick_region.__annotations__["evt"] = gr.SelectData  # Gradio finds the event by class; annotations are strings here

    def batch(
        files,
        scale,
        seed,
        transplant_strength,
        color_fix_strength,
        vae=None,
        latent_upscaler=False,
        progress=stage_progress,
    ):
        try:
            paths = [upload_path(f) for f in (files or [])]
            values = (paths, scale, seed, transplant_strength, color_fix_strength, vae, latent_upscaler)
            result = run_stoppable(service, service.batch, values, progress)
        except Exception as error:  # noqa: BLE001
            raise _as_user_error(gr, error) from None
        return (str(result.zip_path) if result.zip_path else None), result.summary()

    return SimpleNamespace(upscale=upscale, check=check, show_detail=show_detail, pick_region=pick_region, batch=batch)


def _upscale_tab(gr: Any, service: AppService, on: SimpleNamespace, queue: dict, views: dict) -> None:
    """The Upscale tab: one image in, the before/after slider, the download and the 1:1 detail."""
    with gr.Row():
        with gr.Column():
            image = image_input(gr, "Image (drop, paste or click to upload)", "upscale-input")
            upload_status = gr.Markdown(elem_id="upscale-upload-status")
            controls = _upscale_controls(gr, service, "upscale")
            run = gr.Button("Upscale", variant="primary", elem_id="upscale-button")
            stop = gr.Button("Stop", variant="stop", elem_id="upscale-stop")
        with gr.Column():
            slider, download, info = result_column(
                gr, "upscale", f"Before (input, Lanczos-resized) / after; preview up to {PREVIEW_MAX_SIDE} px"
            )
    shown = gr.State(None)
    with gr.Column(elem_id="upscale-detail"):
        gr.Markdown(
            "### Detail at 1:1\nA region of the result at 100% or 200% beside the same region of the "
            "input enlarged to the result's size. Click the overview to choose the region (the "
            "centre at first); the full-resolution PNG is the download above."
        )
        with gr.Row():
            overview_image = gr.Image(
                label="Overview: click to move the region",
                type="pil",
                interactive=False,
                buttons=[],
                height=300,
                elem_id="detail-overview",
            )
            with gr.Column():
                zoom = gr.Radio(list(ZOOMS), value="100%", label="Zoom", elem_id="detail-zoom")
                input_filter = gr.Radio(
                    list(INPUT_FILTERS),
                    value="nearest",
                    label="Input enlarged with",
                    info="nearest: every input pixel as a block; Lanczos: smooth, as the slider's 'before'",
                    elem_id="detail-filter",
                )
        detail = gr.HTML(js_on_load=FIT_DEVICE_PIXELS, elem_id="detail-view")
    image.upload(on.check, inputs=[image], outputs=[upload_status, run], preprocess=False, **views)
    image.clear(lambda: ("", gr.update(interactive=True)), outputs=[upload_status, run], **views)
    started = run.click(
        on.upscale,
        inputs=[image, *controls],
        outputs=[slider, download, info, shown],
        api_name="upscale",
        preprocess=False,
        show_progress_on=[slider],
        **queue,
    )
    started.success(
        on.show_detail, inputs=[shown, zoom, input_filter], outputs=[overview_image, detail, shown], **views
    )
    stop.click(None, cancels=[started], api_visibility="private")  # the handler stops within seconds (event_stop_check)
    for choice in (zoom, input_filter):
        choice.change(
            on.show_detail, inputs=[shown, zoom, input_filter], outputs=[overview_image, detail, shown], **views
        )
    overview_image.select(
        on.pick_region, inputs=[shown, zoom, input_filter], outputs=[overview_image, detail, shown], **views
    )


def _batch_tab(gr: Any, service: AppService, on: SimpleNamespace, queue: dict) -> None:
    """The Batch tab: many images in, one zip of the outputs out."""
    with gr.Row():
        with gr.Column():
            files = gr.File(label="Images", file_count="multiple", elem_id="batch-input")
            batch_controls = _upscale_controls(gr, service, "batch")
            run_batch = gr.Button("Upscale all", variant="primary", elem_id="batch-button")
            stop_batch = gr.Button("Stop", variant="stop", elem_id="batch-stop")
        with gr.Column():
            archive = gr.File(label="Zip of the outputs (names as flowlift upscale writes them)", elem_id="batch-zip")
            report = gr.Markdown(elem_id="batch-report")
    started = run_batch.click(
        on.batch,
        inputs=[files, *batch_controls],
        outputs=[archive, report],
        api_name="batch",
        preprocess=False,
        show_progress_on=[archive],
        **queue,
    )
    stop_batch.click(None, cancels=[started], api_visibility="private")


def _upscale_controls(gr: Any, service: AppService, prefix: str) -> list[Any]:
    """Scale, seed, both strengths, the VAE choice and the latent upscaler (the API's argument order). The strengths
    are labelled by what they do; the help line under each gives the stage and its maths. The latent upscaler's box
    shows only where the app was started with ``--latent-upscaler`` (hidden, it is always off)."""
    scale = knob_number(gr, SCALE, label="Scale (1-8x; 2, 4, 8 are whole 2x passes)", elem_id=f"{prefix}-scale")
    seed = seed_number(gr, elem_id=f"{prefix}-seed")
    transplant = knob_slider(
        gr,
        TRANSPLANT_STRENGTH,
        label="Keep the input's broad shapes and shading",
        info="Stage 1, after every 2x pass: this share of the coarse band (below 1/8 of the latent "
        "resolution) is set to the input's. 1 = exactly the input's; 0 = the model's own.",
        elem_id=f"{prefix}-transplant",
    )
    color_fix = knob_slider(
        gr,
        COLOR_FIX_STRENGTH,
        label="Match the input's colours and brightness",
        info="Stage 2, after decoding: 1 = averaged over each input pixel, the result's L*a*b* colour equals "
        "the input's; 0.5 leaves half the difference; 0 = no correction. Fine detail is not touched.",
        elem_id=f"{prefix}-color-fix",
    )
    labels = list(service.vae_labels)
    vae = gr.Dropdown(labels, value=labels[0], label="VAE", interactive=len(labels) > 1, elem_id=f"{prefix}-vae")
    latent = gr.Checkbox(
        value=False,
        label="SesquiLSR for the fraction (FLUX.2 VAE)",
        info="A scale off 2, 4, 8 (1.5, 3, 6): the passes below it, then SesquiLSR resizes the latents before the "
        "decode, instead of resampling the pixels afterwards. 2, 4, 8 do not run it.",
        visible=service.config.latent_upscaler is not None,
        elem_id=f"{prefix}-latent-upscaler",
    )
    return [scale, seed, transplant, color_fix, vae, latent]


def start_lines(local_url: str, share_url: str | None, host: str) -> list[str]:
    """What ``flowlift app`` prints once it serves: where, and how to share (the flag, not Gradio's API)."""
    reach = "this machine only" if host in ("127.0.0.1", "localhost", "::1") else f"bound to {host}"
    lines = [f"flowlift app: serving {local_url} ({reach}); Ctrl-C stops it"]
    if share_url:
        lines.append(f"flowlift app: public link {share_url} (anyone with it can use this server)")
    else:
        lines.append("flowlift app: for a public *.gradio.live link, start it with flowlift app --share")
    return lines


def check_bind_address(host: str, port: int | None = None) -> None:
    """One FlowliftError line unless this machine can listen on ``host`` (and ``port``, when given).

    uvicorn, under Gradio, retries a name that does not resolve or an address this machine does not have
    and logs the same error line again and again instead of exiting; asked first, the answer is one line.
    """
    import socket

    where = f"{host}:{port}" if port else host
    try:
        found = socket.getaddrinfo(host or None, port or 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as error:
        raise FlowliftError(f"cannot serve on {where}: the host does not resolve ({_reason(error)})") from None
    problem: OSError | None = None
    for family, kind, proto, _, address in found:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
            return
        except OSError as error:
            problem = error
    raise FlowliftError(f"cannot serve on {where}: {_reason(problem)}")


#: How long a stopping server waits for a running request to end at its next stop point.
STOP_WAIT_S = 20.0


def _reason(error: BaseException | None) -> str:
    return (getattr(error, "strerror", None) or str(error) or type(error).__name__).splitlines()[0]


def launch(
    demo: Any,
    service: AppService,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    share: bool = False,
    block: bool = True,
) -> Any:
    """Serve ``demo`` (queue on, upload limit, system fonts, no share unless asked); returns after close.

    Gradio's own start-up lines are off (they point at ``launch(share=True)``, which a ``flowlift app``
    user cannot call); :func:`start_lines` says where the page is and that ``--share`` shares it.
    """
    check_bind_address(host, port)  # before Gradio starts a server that would retry forever
    gr = import_gradio()
    demo.queue(default_concurrency_limit=1)
    kwargs = dict(
        server_name=host,
        server_port=port,
        share=share,
        max_file_size=int(service.config.max_upload_mb * 2**20),
        allowed_paths=[str(service.work_dir)],
        theme=gr.themes.Default(font=SYSTEM_FONTS, font_mono=MONO_FONTS),
        css=CSS,
        ssr_mode=False,
        show_error=True,
        quiet=True,
        prevent_thread_lock=True,
    )
    launched = demo.launch(**kwargs)
    for line in start_lines(demo.local_url, getattr(demo, "share_url", None), host):
        print(line, file=sys.stderr, flush=True)
    if block:  # not demo.block_thread(): it swallows Ctrl-C/SIGTERM, and `flowlift app` exits 130 on them
        try:
            while True:
                time.sleep(0.2)
        finally:
            _close(demo, service)
    return launched


def _close(demo: Any, service: AppService) -> None:
    """Stop the running request (it ends at its next layer or report) and the server. A signal past the command
    line's hold (``SIGNAL_HOLD_S``: the user insists) ends the process at once: a normal exit while a request's
    thread is still inside torch aborts in its C++ runtime (``terminate called without an active exception``)."""
    try:
        service.one_run.close(timeout=STOP_WAIT_S)
        demo.close(verbose=False)  # the stop is one line, flowlift's: not Gradio's "Closing server running on port"
    except KeyboardInterrupt:
        print("flowlift app: interrupted again: stopped at once", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)
