"""``flowlift app``'s handlers without a browser: sizes, the CLI's names and metadata, errors, the batch zip."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from app_helpers import bomb_png
from builders import resized_photo, save_tiny_unet
from flowlift.app.results import check_upload, vae_labels
from flowlift.app.service import AppConfig, AppService
from flowlift.commands.cli import main
from flowlift.errors import FlowliftError

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return save_tiny_unet(tmp_path_factory.mktemp("weights") / "flow_upscaler.safetensors")


@pytest.fixture(scope="module")
def service(shared, weights, tmp_path_factory, single_thread_torch):
    config = AppConfig(
        upscaler=str(weights),
        vaes=[str(shared / "models" / "taef2")],
        device="cpu",
        work_dir=tmp_path_factory.mktemp("app-work"),
    )
    service = AppService(config)
    yield service
    service.close()


@pytest.fixture(scope="module")
def photo(shared, tmp_path_factory):
    return resized_photo(shared / "images" / "kodak" / "kodim23.png", tmp_path_factory.mktemp("in") / "parrots.png")


def test_upscale_writes_the_cli_file_name_size_and_metadata(service, photo, shared, weights, tmp_path):
    progress = []
    result = service.upscale(photo, 2, 7, 0.5, 0.75, progress=lambda f, d: progress.append((f, d)))
    assert result.output.name == "parrots_x2.png"
    assert result.input_size == (48, 32) and result.output_size == (96, 64)
    assert result.before.size == result.after.size == (96, 64)
    assert "96x64" in result.summary() and not result.warnings
    fractions = [f for f, _ in progress]
    assert fractions == sorted(fractions) and 0 <= fractions[0] and fractions[-1] <= 1
    assert progress[0] == (0.0, "starting")  # the bar from the click, before the models load (issue 48)
    stages = " ".join(d for _, d in progress)
    for stage in ("parrots.png: encode", "pass 1/1", "decode", "color fix", "writing", " left"):
        assert stage in stages

    # the same request through the CLI gives the same pixels and the same metadata
    cli_out = tmp_path / "cli"
    argv = ["upscale", str(photo), "-o", str(cli_out), "--scale", "2", "--seed", "7"]
    argv += ["--transplant-strength", "0.5", "--color-fix-strength", "0.75", "--vae", str(shared / "models" / "taef2")]
    assert main([*argv, "--upscaler", str(weights), "--device", "cpu"]) == 0
    with Image.open(result.output) as app_png, Image.open(cli_out / "parrots_x2.png") as cli_png:
        assert app_png.size == (96, 64)
        assert app_png.tobytes() == cli_png.tobytes()
        assert app_png.text == cli_png.text
        params = json.loads(app_png.text["flowlift"])
    assert params["seed"] == 7 and params["transplant_strength"] == 0.5 and params["color_fix_strength"] == 0.75


def test_the_time_shown_is_the_requests_own_loading_included(shared, weights, photo, tmp_path, monkeypatch):
    """Issue 39: "in 22.8 s" after a 53 s wait, the models' loading left out. The first request on a fresh server
    loads them; the time it shows covers that loading (measured around it on the same clock, no speed assumed)."""
    import time

    config = AppConfig(
        upscaler=str(weights), vaes=[str(shared / "models" / "taef2")], device="cpu", work_dir=tmp_path / "work"
    )
    fresh = AppService(config)
    loading: list[float] = []
    original = AppService.pipeline

    def timed(self, vae, latent=False):
        began = time.monotonic()
        try:
            return original(self, vae, latent)
        finally:
            loading.append(time.monotonic() - began)

    monkeypatch.setattr(AppService, "pipeline", timed)
    try:
        began = time.monotonic()
        result = fresh.upscale(photo, 2, 0)
        request = time.monotonic() - began
    finally:
        fresh.close()
    assert loading and loading[0] <= result.seconds <= request
    assert f"in {result.seconds:.1f} s" in result.summary()


def test_models_load_once_and_are_reused(service, photo):
    first = service.pipeline(service.config.vaes[0])
    service.upscale(photo, 2, 0)
    assert service.pipeline(service.config.vaes[0]) is first


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("corrupt.png", b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, "corrupt.png: "),
        ("notes.txt", b"not an image at all", "notes.txt: not an image file"),
        ("bomb.png", None, "decompression bomb"),
    ],
)
def test_bad_uploads_are_one_line_naming_the_file_only(service, tmp_path, name, content, message):
    path = tmp_path / "server" / "side" / name
    path.parent.mkdir(parents=True)
    if content is None:
        bomb_png(path)
    else:
        path.write_bytes(content)
    with pytest.raises(FlowliftError) as caught:
        service.upscale(path, 2, 0)
    text = str(caught.value)
    assert message in text and "\n" not in text
    assert str(tmp_path) not in text  # the server's folders are not shown to users


def test_upload_limit_and_parameter_errors(service, photo, tmp_path):
    big = tmp_path / "big.png"
    big.write_bytes(b"\0" * (2 * 2**20))
    with pytest.raises(FlowliftError, match=r"big.png: 2.0 MB is over the 1 MB upload limit"):
        check_upload(big, 1)
    small = AppService(AppConfig(upscaler="unused", vaes=["taef2"], max_upload_mb=1, work_dir=tmp_path / "w"))
    with pytest.raises(FlowliftError, match="upload limit"):
        small.upscale(big, 2, 0)  # refused before any model is loaded
    with pytest.raises(FlowliftError, match=r"scale must be in \[1, 8\]"):
        service.upscale(photo, 9, 0)  # 3 and 1.5 are scales (issue 46): test_app_any_scale
    with pytest.raises(FlowliftError, match="seed must be a non-negative integer"):
        service.upscale(photo, 2, -1)
    with pytest.raises(FlowliftError, match=r"transplant strength must be in \[0, 1\]"):
        service.upscale(photo, 2, 0, 1.5)
    with pytest.raises(FlowliftError, match="VAE 'flux2' is not configured"):
        service.upscale(photo, 2, 0, 1.0, 1.0, "flux2")
    with pytest.raises(FlowliftError, match="no image uploaded"):
        service.upscale(None)


def test_app_any_scale(service, photo):
    # issue 46: the Upscale tab takes any factor in [1, 8], named and sized as the command line does it
    result = service.upscale(photo, 1.5, 0)
    assert result.output.name == "parrots_x1.5.png" and result.output_size == (72, 48)
    with Image.open(result.output) as image:
        assert image.size == (72, 48)


def test_missing_weights_are_one_clear_line(tmp_path, photo):
    lazy = AppService(AppConfig(upscaler=str(tmp_path / "nowhere.safetensors"), vaes=["taef2"], work_dir=tmp_path))
    with pytest.raises(FlowliftError, match="Flow Upscaler weights"):
        lazy.upscale(photo, 2, 0)


def test_output_cap_warning_is_returned(service, photo):
    pipeline = service.pipeline(service.config.vaes[0])
    pipeline.MAX_OUTPUT_SIDE = 96  # 48 px wide: 2x fits, 4x does not
    try:
        result = service.upscale(photo, 4, 0)
    finally:
        del pipeline.MAX_OUTPUT_SIDE
    assert result.output_size == (96, 64)
    assert result.output.name == "parrots_x4.png"  # the CLI's name for the request, as the CLI writes it
    assert len(result.warnings) == 1 and "the 96 px cap a side" in result.warnings[0]
    assert "**Warning:** Flow Upscaler: 2 pass(es)" in result.summary()


def test_batch_zip_has_cli_names_and_lists_failures(service, photo, tmp_path):
    folder = tmp_path / "uploads"
    folder.mkdir()
    good = folder / "a.png"
    good.write_bytes(photo.read_bytes())
    with Image.open(photo) as image:
        image.save(folder / "b.jpg", quality=95)
    (folder / "broken.png").write_bytes(b"garbage")
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "a.png").write_bytes(photo.read_bytes())  # same name, another upload: same CLI output name
    result = service.batch([good, folder / "broken.png", folder / "b.jpg", other / "a.png"], 2, 0)
    assert result.written == ["a_x2.png", "b_x2.png"]
    assert len(result.errors) == 2
    assert result.errors[0].startswith("broken.png: ")
    assert result.errors[1].startswith("a.png: output a_x2.png is also the output of a.png")
    assert all(str(tmp_path) not in line for line in result.errors)
    with zipfile.ZipFile(result.zip_path) as archive:
        assert sorted(archive.namelist()) == ["a_x2.png", "b_x2.png"]
        with archive.open("b_x2.png") as member, Image.open(member) as png:
            assert png.size == (96, 64) and "flowlift" in png.text
    summary = result.summary()
    assert "2 of 4 file(s)" in summary and "**failed:** broken.png" in summary


def test_batch_with_only_failures_has_no_zip(service, tmp_path):
    (tmp_path / "x.png").write_bytes(b"nope")
    result = service.batch([tmp_path / "x.png"], 2, 0)
    assert result.zip_path is None and result.written == [] and len(result.errors) == 1


LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d flowlift app: (.*) (\d+\.\d) s (.*)$")
#: Characters that need an emoji font (pictographs, dingbats, the emoji variation selector).
EMOJI = re.compile("[\U0001f000-\U0001faff\u2600-\u27bf\ufe0f]")


def test_each_request_logs_one_line(service, photo, tmp_path, monkeypatch):
    lines: list[str] = []
    monkeypatch.setattr(service.config, "log", lines.append)
    service.upscale(photo, 2, 0)
    corrupt = tmp_path / "server" / "corrupt.png"
    corrupt.parent.mkdir()
    corrupt.write_bytes(photo.read_bytes()[:100])
    with pytest.raises(FlowliftError):
        service.upscale(corrupt, 4, 0)
    service.batch([photo, corrupt], 2, 0)
    parsed = [LOG_LINE.match(line) for line in lines]
    assert all(parsed) and len(parsed) == 3, lines
    assert [(m.group(1), m.group(3)) for m in parsed] == [
        ("upscale parrots.png 48x32 x2 -> 96x64", "ok"),
        ("upscale corrupt.png x4", f"error: {lines[1].split('error: ', 1)[1]}"),
        ("batch 2 file(s) x2", "1 ok, 1 failed"),
    ]
    assert "error: corrupt.png: unreadable or truncated image" in lines[1]
    assert all(str(tmp_path) not in line for line in lines)
    lines.clear()
    with pytest.raises(FlowliftError):
        service.upscale(photo, "2\nforged line", 0)  # an API caller's value cannot add a log line
    assert len(lines) == 1 and "\n" not in lines[0] and "x2 forged line" in lines[0]


def test_decode_tiles_move_the_bar(service, photo, monkeypatch):
    pipeline = service.pipeline(service.config.vaes[0])
    monkeypatch.setattr(pipeline, "vae_tiled", True)
    monkeypatch.setattr(pipeline.vae.model, "decode_tiled", functools.partial(pipeline.vae.model.decode_tiled, tile=2))
    progress: list[tuple[float, str]] = []
    service.upscale(photo, 2, 0, progress=lambda f, d: progress.append((f, d)))
    tiles = [d.split(", about ")[0] for _, d in progress if ": decode, tile " in d]
    assert len(tiles) > 1 and tiles[-1].endswith(f"tile {len(tiles)}/{len(tiles)}")  # 2x2-latent tiles of 12x8
    assert all(", about " in d for _, d in progress if ": decode, tile " in d)  # each with this request's time left
    fractions = [f for f, _ in progress]
    assert fractions == sorted(fractions) and fractions[-1] <= 1


def test_a_dropped_file_is_checked_at_once(service, photo, tmp_path):
    assert service.check_image(photo) == "parrots.png: 48x32 px"
    truncated = tmp_path / "deep" / "folder" / "cut.png"
    truncated.parent.mkdir(parents=True)
    truncated.write_bytes(photo.read_bytes()[:200])
    with pytest.raises(FlowliftError) as caught:
        service.check_image(truncated)
    message = str(caught.value)
    assert message.startswith("cut.png: unreadable or truncated image") and str(tmp_path) not in message
    with pytest.raises(FlowliftError, match="decompression bomb"):
        service.check_image(bomb_png(tmp_path / "bomb.png"))
    assert service.check_image(None) == ""


def test_vaes_are_shown_by_name_and_chosen_by_name_or_spec(service, photo, shared, tmp_path):
    (tmp_path / "a" / "taef2").mkdir(parents=True)
    (tmp_path / "b" / "taef2").mkdir(parents=True)
    specs = [str(tmp_path / "a" / "taef2"), str(tmp_path / "b" / "taef2"), "flux2", "org/some-vae"]
    assert vae_labels(specs) == dict(zip(["a/taef2", "b/taef2", "flux2", "org/some-vae"], specs, strict=True))
    assert service.vae_labels == {"taef2": str(shared / "models" / "taef2")}
    by_name = service.upscale(photo, 2, 3, 1.0, 1.0, "taef2")
    by_spec = service.upscale(photo, 2, 3, 1.0, 1.0, str(shared / "models" / "taef2"))
    with Image.open(by_name.output) as first, Image.open(by_spec.output) as second:
        assert first.tobytes() == second.tobytes()
    with pytest.raises(FlowliftError, match="choose one of taef2$"):
        service.upscale(photo, 2, 0, 1.0, 1.0, "flux2")
    assert by_name.output.name == "parrots_x2.png"  # one VAE offered: the command line's name


def test_results_of_two_vaes_are_named_apart(shared, weights, photo, tmp_path):
    """Issue 48: a Mage and a TAEF2 result of one image were both ``<stem>_x2.png``. With several VAEs offered,
    the result's name carries the VAE's page label."""
    taef2 = str(shared / "models" / "taef2")
    copy = tmp_path / "other" / "taef2"
    shutil.copytree(taef2, copy)
    service = AppService(
        AppConfig(upscaler=str(weights), vaes=[taef2, str(copy)], device="cpu", work_dir=tmp_path / "work")
    )
    try:
        names = {label: service.upscale(photo, 2, 0, 1.0, 1.0, label).output.name for label in service.vae_labels}
        archive = service.batch([photo], 2, 0, 1.0, 1.0, str(copy))
    finally:
        service.close()
    assert names == {"models/taef2": "parrots_x2_models-taef2.png", "other/taef2": "parrots_x2_other-taef2.png"}
    assert archive.written == ["parrots_x2_other-taef2.png"]


def test_summaries_need_no_emoji_font(service, photo, tmp_path):
    (tmp_path / "bad.png").write_bytes(b"nope")
    texts = [service.upscale(photo, 2, 0).summary(), service.batch([photo, tmp_path / "bad.png"], 2, 0).summary()]
    assert not [text for text in texts if EMOJI.search(text)], texts
    assert "- done: parrots_x2.png" in texts[1] and "- **failed:** bad.png: " in texts[1]


def test_start_up_lines_name_the_share_flag():
    from flowlift.app.page import start_lines

    local = start_lines("http://127.0.0.1:7860/", None, "127.0.0.1")
    assert local == [
        "flowlift app: serving http://127.0.0.1:7860/ (this machine only); Ctrl-C stops it",
        "flowlift app: for a public *.gradio.live link, start it with flowlift app --share",
    ]
    shared_lines = start_lines("http://0.0.0.0:7860/", "https://abc.gradio.live", "0.0.0.0")
    assert "bound to 0.0.0.0" in shared_lines[0] and "https://abc.gradio.live" in shared_lines[1]
    assert not [line for line in local + shared_lines if "share=True" in line or "launch()" in line]


#: Run in a fresh interpreter, so the heap it measures holds only what it allocated itself: one worker-thread
#: "request" frees 180 MB of blocks below glibc's mmap threshold (so they stay in that thread's arena, between
#: blocks still in use), then prints its own RSS before and after the release (or, as the control, nothing).
RELEASE_PROBE = r"""
import re, sys, threading
from pathlib import Path
from flowlift.app.memory import release_freed_memory

def rss():
    return int(re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024

kept = []
def request():  # each 60 kB block is followed by a 1 kB one that stays (both from malloc, not pymalloc): the
    blocks = []  # freed blocks are holes in the arena that only malloc_trim returns, never a free top to cut off
    for _ in range(3000):
        blocks.append(bytearray(60_000))
        kept.append(bytearray(1_000))
    del blocks

worker = threading.Thread(target=request)
worker.start()
worker.join()
before = rss()
released = release_freed_memory() if sys.argv[1] == "release" else False
print(before, rss(), released)
"""


def _release_probe(mode: str) -> tuple[int, int, bool]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [sys.executable, "-c", RELEASE_PROBE, mode], capture_output=True, text=True, env=env, timeout=120, check=True
    )
    before, after, released = result.stdout.split()
    return int(before), int(after), released == "True"


def test_freed_memory_goes_back_to_the_system():
    """What a request freed on a worker thread is returned (glibc keeps it in that thread's arena otherwise:
    the server grew with every Gradio worker that ever ran the model; see flowlift.app.memory). Measured in a
    fresh process, so nothing an earlier test left on this process's heap can change the verdict."""
    import platform

    if platform.libc_ver()[0] != "glibc" or not Path("/proc/self/status").exists():
        pytest.skip("malloc_trim is glibc's; RSS is read from /proc")
    kept_before, kept_after, _ = _release_probe("keep")
    assert kept_before - kept_after < 20 * 2**20  # without the release the arena keeps it: the probe can fail
    before, after, released = _release_probe("release")
    assert released
    assert before - after > 100 * 2**20


def test_passes_the_16k_cap_drops_are_said_on_the_page(service, tmp_path):
    # a 4100 px wide image at 8x: the plan runs one 2x pass (two would pass 16384 px); the command line warned, the
    # app said nothing and showed a 2x result under the 8x request
    wide = tmp_path / "wide.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (8, 4100, 3), dtype=np.uint8)).save(wide)
    result = service.upscale(wide, 8, 0)
    assert result.output_size == (8200, 16)
    assert len(result.warnings) == 1 and "pass" in result.warnings[0] and "16384" in result.warnings[0]
    assert "**Warning:**" in result.summary()
    batch = service.batch([wide], 8, 0)
    assert len(batch.warnings) == 1 and batch.warnings[0].startswith("wide.png: ") and "16384" in batch.warnings[0]
    assert "- **warning:** wide.png: " in batch.summary()


# ----------------------------------------------------------- AppConfig: every field checked when it is made


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("upscaler", 5, "must be a path"),
        ("upscaler", "", "an empty name names nothing"),
        ("vaes", [5], "must be a path"),
        ("vaes", [], "at least one VAE"),
        ("vaes", 5, "a path or a sequence of paths"),
        ("vaes", None, "a path or a sequence of paths"),
        ("device", "bogus", "is not a torch device"),
        ("device", 5, "a device name"),
        ("dtype", "bf16x", "choose one of auto"),
        ("dtype", 5, "one of auto"),
        ("dtype", None, "one of auto"),
        ("max_upload_mb", True, "in (0, 1048576]"),
        ("max_upload_mb", "50", "in (0, 1048576]"),
        ("max_upload_mb", 0, "in (0, 1048576]"),
        ("max_upload_mb", float("nan"), "a finite number"),
        ("max_upload_mb", 2**30, "in (0, 1048576]"),
        ("model", 5, "must be a path"),
        ("model", "", "an empty name names nothing"),
        ("model_vae", 5, "must be a path"),
        ("model_vae", " ", "an empty name names nothing"),
        ("latent_upscaler", "x", "sesqui:PATH"),
        ("work_dir", 5, "must be a path"),
        ("work_dir", "", "an empty name names nothing"),
        ("log", "x", "must be a function"),
        ("log", None, "must be a function"),
    ],
)
def test_app_config_refuses_a_wrong_field_by_its_name(field, value, said):
    # before, only max_upload_mb (said as the command line's --max-upload-mb) and latent_upscaler were checked: a
    # Python caller's device="bogus" or dtype="bf16x" failed on the first request, max_upload_mb=True was 1 MB
    with pytest.raises(FlowliftError) as caught:
        AppConfig(**{field: value})
    assert caught.value.fields == (field,)
    assert str(caught.value).startswith(field) and said in str(caught.value), str(caught.value)


def test_app_config_keeps_one_vae_name_as_one_vae(tmp_path):
    # vaes="taef2" was five VAEs, one per character ({'t': 't', 'a': 'a', ...} on the page)
    service = AppService(AppConfig(vaes="taef2", work_dir=str(tmp_path / "w")))
    try:
        assert service.config.vaes == ["taef2"] and service.vae_labels == {"taef2": "taef2"}
        assert service.config.work_dir == tmp_path / "w"
    finally:
        service.close()
    config = AppConfig(upscaler=tmp_path / "u.safetensors", vaes=("taef2", "taef2", "flux2"), device="auto")
    assert config.upscaler == str(tmp_path / "u.safetensors") and config.vaes == ["taef2", "flux2"]
    assert config.device is None and AppConfig(device=" cpu:0 ").device == "cpu"  # as torch names it
    assert AppConfig(max_upload_mb=1).max_upload_mb == 1.0


def _app_parser():
    from flowlift.commands.cli import build_parser

    parser = build_parser()
    return parser._chosen_command(parser.parse_args(["app"]))


def test_the_app_command_names_its_own_options(monkeypatch, capsys):
    """The values the config refuses are said in the command line's words (``--device``, ``--model-vae``), one line,
    before any page is built; every field with an option is said as it."""
    import importlib.util

    from builders import forbid_call
    from flowlift.commands._options import option_words

    real_find_spec = importlib.util.find_spec  # the refusals come before Gradio is used: no need to have it here
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "gradio" else real_find_spec(name, *a)
    )
    for target in ("build_app", "launch", "check_bind_address"):
        forbid_call(monkeypatch, f"flowlift.app.page.{target}", "the app went on past a refused option")
    for options, said in (
        (["--device", "bogus"], "--device bogus: 'bogus' is not a torch device"),
        (["--model-vae="], "--model-vae: an empty name names nothing"),
    ):
        assert main(["app", *options]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"flowlift app: error: {said}") and "\n" not in err, err
    with pytest.raises(SystemExit) as caught:  # argparse's own line: the option's type is the config's knob
        main(["app", "--max-upload-mb", "0"])
    err = capsys.readouterr().err.strip()
    assert caught.value.code == 2 and err.startswith(
        "flowlift app: error: argument --max-upload-mb: must be in (0, 1048576]"
    )
    words = option_words(_app_parser())
    fields = [name for name in AppConfig.__dataclass_fields__ if name not in ("work_dir", "log")]  # no option
    assert {field: words.get(field) for field in fields} == {
        field: "--" + {"vaes": "vae"}.get(field, field).replace("_", "-") for field in fields
    }
