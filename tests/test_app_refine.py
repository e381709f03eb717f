"""``flowlift app``'s Refine tab handler on a tiny diffusers-layout FLUX.2 folder (img2img and hires fix)."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from builders import refine_inputs, save_tiny_unet, tiny_unet
from flowlift.app.refine_tab import refine
from flowlift.app.service import AppConfig, AppService
from flowlift.commands.cli import main
from flowlift.errors import FlowliftError
from tiny_flux2 import write_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("flux2-tiny"))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return refine_inputs(tmp_path_factory.mktemp("refine-in"), "photo.png", (48, 64), seed=0)


@pytest.fixture(scope="module")
def service(model_dir, tmp_path_factory, single_thread_torch):
    weights = save_tiny_unet(tmp_path_factory.mktemp("w") / "flow_upscaler.safetensors")
    service = AppService(AppConfig(upscaler=str(weights), vaes=["taef2"], device="cpu", model=str(model_dir)))
    yield service
    service.close()


def _flowlift_text(path):
    with Image.open(path) as image:
        return image.size, json.loads(image.text["flowlift"])


def test_img2img_matches_the_cli(service, model_dir, inputs, monkeypatch, tmp_path):
    result = refine(
        service, inputs / "photo.png", None, inputs / "prompt.safetensors", "img2img", 0.6, None, "linear", 6, 3
    )
    assert result.output.name == "photo_img2img.png" and result.output_size == (64, 48)
    size, app_meta = _flowlift_text(result.output)
    monkeypatch.chdir(inputs)  # the CLI records the paths as given: give bare names, as the app does
    out = tmp_path / "cli.png"
    argv = ["img2img", "photo.png", "--model", str(model_dir), "--prompt-embeds", "prompt.safetensors"]
    assert main([*argv, "--strength", "0.6", "--steps", "6", "--seed", "3", "-o", str(out), "--no-progress"]) == 0
    cli_size, cli_meta = _flowlift_text(out)
    assert size == cli_size and app_meta == cli_meta
    assert (app_meta["mu"], app_meta["schedule"]) == (2.02, "respaced")  # the refiner's defaults, recorded
    with Image.open(out) as cli_png, Image.open(result.output) as app_png:
        assert cli_png.tobytes() == app_png.tobytes()


def test_hires_fix_and_errors(service, inputs, tmp_path):
    square = tmp_path / "square.png"
    Image.open(inputs / "photo.png").resize((64, 64)).save(square)
    result = refine(service, square, "", inputs / "prompt.safetensors", "hires fix 2x", None, 0.4, "linear", 4, 0)
    assert result.output.name == "square_hires2x.png" and result.output_size == (128, 128)
    _, meta = _flowlift_text(result.output)
    assert meta["command"] == "hires" and meta["scale"] == 2 and meta["refine_strength"] == 0.4
    assert service.refine_models.refiner() is service.refine_models.refiner()  # loaded once
    # Stop reaches the hires fix's upscale passes before every layer, as the Upscale tab's (it waited for the pass)
    hires = service.refine_models.hires_upscaler(service.refine_models.refiner())
    assert hires.pipeline.check_interrupt == service.one_run.check
    Image.open(inputs / "photo.png").resize((40, 24)).save(tmp_path / "odd.png")
    with pytest.raises(FlowliftError, match="multiples of 16"):
        refine(service, tmp_path / "odd.png", None, inputs / "prompt.safetensors", "hires fix 4x")
    with pytest.raises(FlowliftError, match="give a prompt or a prompt-embeds file"):
        refine(service, square, "  ", None)
    with pytest.raises(FlowliftError, match=r"strength must be a number in \[0, 1\]"):
        refine(service, square, None, inputs / "prompt.safetensors", "img2img", 2)
    (tmp_path / "junk.png").write_bytes(b"junk")
    with pytest.raises(FlowliftError, match="^junk.png: not an image file"):
        refine(service, tmp_path / "junk.png", None, inputs / "prompt.safetensors")
    no_model = AppService(AppConfig(vaes=["taef2"], work_dir=tmp_path / "w"))
    with pytest.raises(FlowliftError, match="start the app with --model"):
        refine(no_model, square, None, inputs / "prompt.safetensors")


def test_a_hires_fix_without_its_strength_runs_at_the_hires_default_at_every_door(service, inputs, tmp_path):
    """An API call leaving the strength out got the img2img slider's 0.5 in hires mode (the CLI's 0.3): the two
    strengths are two controls, each starting at its own knob's default, as --strength and --refine-strength."""
    from flowlift.app.page import build_app
    from flowlift.refine.settings import REFINE_STRENGTH, STRENGTH

    square = tmp_path / "square.png"
    Image.open(inputs / "photo.png").resize((64, 64)).save(square)
    result = refine(service, square, None, inputs / "prompt.safetensors", "hires fix 2x", steps=2)
    assert _flowlift_text(result.output)[1]["refine_strength"] == REFINE_STRENGTH.default == 0.3
    page = build_app(service)
    (endpoint,) = [fn for fn in page.fns.values() if fn.api_name == "refine"]
    sliders = {block.label: block.value for block in endpoint.inputs if type(block).__name__ == "Slider"}
    assert sliders == {"How much to redraw the image": STRENGTH.default, "How much to redraw after the upscale": 0.3}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"mode": "hires fix 2x", "refine_strength": 2}, "refine strength must be a number in [0, 1], got 2"),
        ({"mode": "img2img", "strength": 2}, "strength must be a number in [0, 1], got 2"),
        ({"prompt": 5}, "prompt must be text, got int 5"),
        ({"mode": ["img2img"]}, "mode must be one of img2img, hires fix 2x"),
    ],
)
def test_a_bad_form_value_is_one_line_in_the_pages_words(service, inputs, fields, message):
    # hires said its Python name (refine_strength); JSON can send anything:
    # a prompt of 5 was "'int' object has no attribute 'strip'", a list mode "unhashable"
    arguments = {"path": inputs / "photo.png", "prompt_embeds": inputs / "prompt.safetensors", **fields}
    with pytest.raises(FlowliftError) as caught:
        refine(service, **arguments)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_the_form_place_takes_only_a_refine_form(service, inputs):
    with pytest.raises(FlowliftError, match="^form must be a RefineForm"):
        service.refine(inputs / "photo.png", None, inputs / "prompt.safetensors", {"mode": "img2img"})


def test_a_prompt_given_with_embeddings_is_recorded_as_the_cli_records_it(service, inputs):
    result = refine(service, inputs / "photo.png", "a red door", inputs / "prompt.safetensors", "img2img", steps=1)
    assert _flowlift_text(result.output)[1]["prompt"] == "a red door"


def test_stop_reaches_the_refiners_vae_within_its_decode(service, inputs):
    """Stop landed only between the refiner's stages: a VAE decode (minutes at 4K on a CPU) ran to its end. The
    page's stop check now runs before every layer of the refiner's VAE and transformer during a request."""
    from flowlift.app.progress import RequestStopped

    decoder = service.refine_models.refiner().vae.model.decoder
    layers_run: list[int] = []
    stop_after = 3  # the third layer of the decoder: the request is stopped there

    def count(*_):
        layers_run.append(1)

    def stop():
        if len(layers_run) >= stop_after:
            raise RequestStopped("stopped")

    hooks = [leaf.register_forward_pre_hook(count) for leaf in decoder.modules() if not list(leaf.children())]
    try:
        with service.one_run(stop), pytest.raises(RequestStopped):
            refine(service, inputs / "photo.png", None, inputs / "prompt.safetensors", "img2img", steps=1)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(layers_run) == stop_after  # no decoder layer ran after the stop
    assert not any(hasattr(leaf, "_flowlift_interrupt_hook") for leaf in decoder.modules())  # hooks gone


def test_a_text_prompt_on_a_model_without_a_text_encoder_is_refused_before_it_loads(
    model_dir, inputs, tmp_path, monkeypatch
):
    import flowlift.refine.loading

    monkeypatch.setattr(flowlift.refine.loading, "load_refiner", lambda *a, **k: pytest.fail("the model loaded"))
    bare = AppService(AppConfig(vaes=["taef2"], device="cpu", model=str(model_dir), work_dir=tmp_path / "w"))
    try:
        with pytest.raises(FlowliftError) as caught:
            refine(bare, inputs / "photo.png", "a red door", None, "img2img", steps=1)
    finally:
        bare.close()
    assert str(caught.value) == (
        f"the model {model_dir.name} has no text encoder to embed a prompt with; upload prompt embeddings "
        "(.safetensors with 'prompt_embeds') instead"
    )
    assert str(model_dir.parent) not in str(caught.value)  # no server folder on the page


def test_refine_tab_only_with_a_model(service, tmp_path):
    from flowlift.app.page import build_app

    with_model = {fn.api_name for fn in build_app(service).fns.values()}
    without = {fn.api_name for fn in build_app(AppService(AppConfig(work_dir=tmp_path))).fns.values()}
    assert {"upscale", "batch", "refine"} <= with_model
    assert "refine" not in without and {"upscale", "batch"} <= without


def test_tiled_img2img_matches_the_cli(service, model_dir, inputs, monkeypatch, tmp_path):
    # the Refine tab's tile size and overlap reach the refiner: the tiles really run and the metadata names them
    args = (service, inputs / "photo.png", None, inputs / "prompt.safetensors", "img2img", 0.6, None, "linear", 3, 5)
    tiled = refine(*args, tile_size="32", tile_overlap=16)
    untiled = refine(*args, tile_size="off", tile_overlap=16)
    _, meta = _flowlift_text(tiled.output)
    assert meta["tiles"]["grid"] == [2, 3] and meta["tiles"]["overlap"] == 16, meta["tiles"]
    assert "tiles" not in _flowlift_text(untiled.output)[1]
    with Image.open(tiled.output) as a, Image.open(untiled.output) as b:
        assert a.tobytes() != b.tobytes()  # the tiles changed the transformer's view
    monkeypatch.chdir(inputs)
    out = tmp_path / "cli.png"
    argv = ["img2img", "photo.png", "--model", str(model_dir), "--prompt-embeds", "prompt.safetensors", "--no-progress"]
    argv += ["--strength", "0.6", "--steps", "3", "--seed", "5", "--tile-size", "32", "--tile-overlap", "16"]
    assert main([*argv, "-o", str(out)]) == 0
    assert _flowlift_text(out)[1] == meta
    with Image.open(out) as cli_png, Image.open(tiled.output) as app_png:
        assert cli_png.tobytes() == app_png.tobytes()
    for size, overlap, message in [
        ("1000", 128, "multiple of 16"),
        ("64", 64, "smaller than the tile"),
        ("big", 0, "tile size must be"),
        ("64", -16, "tile overlap must be"),
    ]:
        with pytest.raises(FlowliftError, match=message):
            refine(*args, tile_size=size, tile_overlap=overlap)


def _every_ordered_pair(names: list[str]) -> list[str]:
    """A sequence in which every ordered pair of ``names`` (a name after itself too) follows directly
    (an Eulerian circuit of the complete directed graph with loops: len(names)**2 + 1 entries)."""
    edges = {a: list(names) for a in names}
    stack, circuit = [names[0]], []
    while stack:
        if edges[stack[-1]]:
            stack.append(edges[stack[-1]].pop())
        else:
            circuit.append(stack.pop())
    return circuit[::-1]


def test_every_tab_after_every_other_on_one_service(
    model_dir, inputs, shared, tmp_path, monkeypatch, single_thread_torch
):
    # issue 36.3: a hires fix converted the UNet the upscale tabs share to the refiner's dtype in place,
    # and every later Upscale / Batch request failed ("Input type (c10::BFloat16) and bias type (float)").
    # Upscale in bf16 (as on a CPU with native bf16) and refine in float32, so the dtypes differ here too.
    import flowlift.devices

    monkeypatch.setattr(flowlift.devices, "cpu_has_native_bf16", lambda: True)
    weights = save_tiny_unet(tmp_path / "flow_upscaler.safetensors")
    taef2 = str(shared / "models" / "taef2")
    service = AppService(
        AppConfig(upscaler=str(weights), vaes=[taef2], device="cpu", model=str(model_dir), work_dir=tmp_path / "work")
    )
    square = tmp_path / "square.png"
    Image.open(inputs / "photo.png").resize((64, 64)).save(square)
    embeds = inputs / "prompt.safetensors"
    tabs = {
        "upscale": lambda: service.upscale(square, 2, 0).output,
        "batch": lambda: service.batch([square], 2, 0).zip_path,
        "img2img": lambda: refine(service, square, None, embeds, "img2img", 0.5, None, "linear", 2, 0).output,
        "hires": lambda: refine(service, square, None, embeds, "hires fix 2x", None, 0.4, "linear", 2, 0).output,
    }
    order = _every_ordered_pair(list(tabs))
    pairs = set(zip(order, order[1:], strict=False))
    assert len(order) == 17 and pairs == {(a, b) for a in tabs for b in tabs}
    hires_pixels = set()
    try:
        for name in order:
            written = tabs[name]()
            assert written is not None, name
            if name == "hires":
                with Image.open(written) as image:
                    hires_pixels.add(image.tobytes())
            pipe = service.pipeline(taef2)
            assert pipe.dtype == torch.bfloat16
            assert {p.dtype for p in pipe.upscaler.parameters()} == {torch.bfloat16}, f"after {name}"
    finally:
        service.close()
    # the hires fix after an Upscale request ran on the Upscale tab's bf16 UNet made float32 (the file's weights
    # rounded to bf16: 2/255 apart, with the same metadata); whatever ran before, it is the file's own weights, as
    # on a service whose first request is the hires fix
    fresh = AppService(
        AppConfig(upscaler=str(weights), vaes=[taef2], device="cpu", model=str(model_dir), work_dir=tmp_path / "w2")
    )
    try:
        written = refine(fresh, square, None, embeds, "hires fix 2x", None, 0.4, "linear", 2, 0).output
        with Image.open(written) as image:
            assert hires_pixels == {image.tobytes()}
    finally:
        fresh.close()


def test_a_pipeline_never_converts_the_module_it_is_given(shared):
    # the root of 36.3: a second pipeline in another dtype (or device) works on a copy of a shared UNet
    from flowlift.upscale.pipeline import FlowUpscalerPipeline

    unet = tiny_unet().to(torch.bfloat16)
    taef2 = str(shared / "models" / "taef2")
    same = FlowUpscalerPipeline(unet, taef2, device="cpu", dtype=torch.bfloat16)
    assert same.upscaler is unet  # nothing to convert: shared, not copied
    for dtype in (torch.float32, torch.float16):
        other = FlowUpscalerPipeline(unet, taef2, device="cpu", dtype=dtype)
        assert other.upscaler is not unet and {p.dtype for p in other.upscaler.parameters()} == {dtype}
        assert {p.dtype for p in unet.parameters()} == {torch.bfloat16}


def test_the_refine_bar_names_each_stage_and_step(service, inputs):
    """Issue 48: the Refine tab showed only Gradio's generic counter; its bar now names the stage and the step, with
    the request's own time left, from the click on."""
    reports: list[tuple[float, str]] = []
    refine(
        service,
        inputs / "photo.png",
        None,
        inputs / "prompt.safetensors",
        "img2img",
        0.5,
        steps=6,
        progress=lambda fraction, text: reports.append((fraction, text)),
    )
    texts = [text for _, text in reports]
    assert texts[0] == "starting"
    assert any(text.startswith("photo.png: encode") for text in texts)
    steps = [text.split(", about ")[0] for text in texts if ": steps, step " in text]
    assert steps[-1] == "photo.png: steps, step 6/6" and len(steps) == 6  # the respaced window: all 6
    assert any(text.startswith("photo.png: decode") for text in texts)
    assert all(" left" in text for text in texts if ": steps, step " in text)
    fractions = [fraction for fraction, _ in reports]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
