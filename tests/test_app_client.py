"""``flowlift app``'s API endpoint ``upscale`` driven by gradio_client against a live loopback server."""

from __future__ import annotations

import json
import os
import time
import zipfile

import pytest
from gradio_client import Client, handle_file
from gradio_client.utils import Status
from PIL import Image

from app_helpers import free_port, is_loopback, listening_addresses
from builders import save_tiny_unet
from flowlift.app.page import build_app, launch
from flowlift.app.service import AppConfig, AppService


@pytest.fixture
def server(shared, tmp_path, monkeypatch, single_thread_torch):
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "gradio"))
    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    weights = save_tiny_unet(tmp_path / "flow_upscaler.safetensors")
    config = AppConfig(
        upscaler=str(weights), vaes=[str(shared / "models" / "taef2")], device="cpu", work_dir=tmp_path / "work"
    )
    service = AppService(config)
    demo = build_app(service)
    port = free_port()
    launch(demo, service, port=port, block=False)
    try:
        yield demo, f"http://127.0.0.1:{port}/", service
    finally:
        demo.close()
        service.close()
    assert not [a for a in listening_addresses({os.getpid()}) if a[1] == port], "server still listening"


def test_upscale_endpoint_and_queue_with_gradio_client(server, shared, tmp_path):
    demo, url, service = server
    # every model-running event shares one queue slot per device: requests run one at a time
    model_fns = [fn for fn in demo.fns.values() if fn.api_name in ("upscale", "batch")]
    assert len(model_fns) == 2
    assert {fn.concurrency_limit for fn in model_fns} == {1}
    assert len({fn.concurrency_id for fn in model_fns}) == 1
    listening = listening_addresses({os.getpid()})
    assert listening and all(is_loopback(address) for address, _ in listening), listening

    source = tmp_path / "kodim03.png"
    with Image.open(shared / "images" / "kodak" / "kodim03.png") as image:
        image.convert("RGB").resize((64, 48), Image.Resampling.BOX).save(source)
    client = Client(url, verbose=False)
    # the page's views (upload check, detail crops) are not API endpoints; the API keeps its two
    assert set(client.view_api(print_info=False, return_format="dict")["named_endpoints"]) == {"/upscale", "/batch"}
    slider, download, info = client.predict(handle_file(str(source)), 2, 5, 1.0, 0.5, api_name="/upscale")
    with Image.open(download) as png:
        assert png.size == (128, 96) and png.format == "PNG"
        params = json.loads(png.text["flowlift"])
        assert params["input"] == "kodim03.png"
    assert params["seed"] == 5 and params["color_fix_strength"] == 0.5 and params["scale"] == 2
    assert os.path.basename(download) == "kodim03_x2.png"
    assert len(slider) == 2 and "128x96" in info

    bad = tmp_path / "bad.png"
    bad.write_bytes(b"definitely not a png")
    with pytest.raises(Exception, match="bad.png: not an image file Pillow can read"):
        client.predict(handle_file(str(bad)), 2, 0, 1.0, 1.0, api_name="/upscale")
    # the server still serves the next request
    _, again, _ = client.predict(handle_file(str(source)), 2, 5, 1.0, 0.5, api_name="/upscale")
    with Image.open(again) as png, Image.open(download) as first:
        assert png.tobytes() == first.tobytes()  # same seed, same pixels

    # the batch endpoint: a zip with the CLI's names, the bad file listed
    archive, report = client.predict(
        [handle_file(str(source)), handle_file(str(bad))], 2, 0, 1.0, 1.0, api_name="/batch"
    )
    with zipfile.ZipFile(archive) as members:
        assert members.namelist() == ["kodim03_x2.png"]
    assert "1 of 2 file(s)" in report and "bad.png: not an image file" in report

    # one request at a time per device: while one runs, the other waits IN_QUEUE (the page shows its place).
    # Each request is held for at least a second, so the overlap (or the wait) is long enough to see anywhere.
    pipeline = service.pipeline(service.config.vaes[0])
    upscale_image = pipeline.upscale_image

    def slow_upscale_image(*args, **kwargs):
        time.sleep(1.0)
        return upscale_image(*args, **kwargs)

    pipeline.upscale_image = slow_upscale_image
    jobs = [client.submit(handle_file(str(source)), 2, seed, 1.0, 1.0, api_name="/upscale") for seed in (0, 1)]
    running_states = {Status.PROCESSING, Status.PROGRESS}
    waited_since = None
    waited = 0.0
    while not all(job.done() for job in jobs):
        codes = sorted((job.status().code for job in jobs), key=lambda code: code in running_states)
        if codes[0] == Status.IN_QUEUE and codes[1] in running_states:  # one runs, the other waits
            waited_since = waited_since or time.monotonic()
            waited = time.monotonic() - waited_since
        time.sleep(0.05)
    assert all(job.result()[2] for job in jobs)
    # with two slots both would run at once; with one, one of them waits for the whole other request
    assert waited > 0.5, f"the waiting request was seen in the queue for {waited:.2f} s"


def test_the_api_keeps_large_seeds_exact(server, shared, tmp_path):
    # issue 29: the API passed the seed through float(), so seeds 2^53 and 2^53 + 1 gave the same image
    _demo, url, _service = server
    source = tmp_path / "kodim03.png"
    with Image.open(shared / "images" / "kodak" / "kodim03.png") as image:
        image.convert("RGB").resize((64, 48), Image.Resampling.BOX).save(source)
    client = Client(url, verbose=False)
    seeds, pixels = [], []
    for seed in (2**53, 2**53 + 1, 2**64 - 1):
        _, download, _ = client.predict(handle_file(str(source)), 2, seed, 1.0, 1.0, api_name="/upscale")
        with Image.open(download) as png:
            seeds.append(json.loads(png.text["flowlift"])["seed"])
            pixels.append(png.tobytes())
    assert seeds == [2**53, 2**53 + 1, 2**64 - 1]
    assert pixels[0] != pixels[1]
    with pytest.raises(Exception, match=r"seed must be a non-negative integer at most 18446744073709551615"):
        client.predict(handle_file(str(source)), 2, 2**64, 1.0, 1.0, api_name="/upscale")


def test_a_taken_port_is_one_error_line(capsys, tmp_path, monkeypatch, shared):
    import socket
    import threading

    from flowlift.commands.cli import main

    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "gradio"))
    outcome = []
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        weights = save_tiny_unet(tmp_path / "flow_upscaler.safetensors")  # found: the start-up weight check passes
        argv = ["app", "--port", str(port), "--upscaler", str(weights), "--vae", str(shared / "models" / "taef2")]
        runner = threading.Thread(target=lambda: outcome.append(main(argv)), daemon=True)
        runner.start()
        runner.join(120)
    assert outcome == [2], "flowlift app did not stop with an error on a taken port"
    err = capsys.readouterr().err
    assert f"flowlift app: error: cannot serve on 127.0.0.1:{port}: " in err and "Traceback" not in err


def _sse_outcome(url: str, endpoint: str, data: list) -> tuple[str, str]:
    """POST ``data`` to ``/gradio_api/call/ENDPOINT`` as any HTTP client can, then read the event stream's end."""
    import urllib.request

    post = urllib.request.Request(
        f"{url}gradio_api/call/{endpoint}", json.dumps({"data": data}).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(post, timeout=60) as response:
        event_id = json.loads(response.read())["event_id"]
    with urllib.request.urlopen(f"{url}gradio_api/call/{endpoint}/{event_id}", timeout=120) as stream:
        lines = stream.read().decode().splitlines()
    kinds = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    payloads = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    return kinds[-1], payloads[-1]


def test_a_path_that_is_no_upload_of_the_page_is_refused(server, shared):
    # with preprocess=False Gradio checks no image payload's path: any image on the server was upscaled for the caller
    demo, url, service = server
    photo = str(shared / "images" / "kodak" / "kodim03.png")
    for path in (photo, "/etc/passwd", f"{os.environ['GRADIO_TEMP_DIR']}/../{os.path.basename(photo)}"):
        kind, payload = _sse_outcome(
            url, "upscale", [{"path": path}, 2, 0, 1.0, 1.0, next(iter(service.vae_labels)), False]
        )
        assert kind == "error" and "not a file uploaded to this page; upload it again" in payload, payload
    assert not list((service.work_dir).rglob("*.png"))


def test_a_stopped_request_stops_and_the_next_waits_for_it(server, shared, tmp_path, monkeypatch):
    """Gradio freed a cancelled request's queue slot while its thread ran on to the end, and the next request ran
    beside it; now the stopped one ends at its next layer and the next starts after it."""
    import threading

    demo, url, service = server
    source = tmp_path / "kodim03.png"
    with Image.open(shared / "images" / "kodak" / "kodim03.png") as image:
        image.convert("RGB").resize((64, 48), Image.Resampling.BOX).save(source)
    events, entered, release = [], threading.Event(), threading.Event()
    real = service.upscale_into

    def held_upscale_into(*args, **kwargs):
        events.append(("start", len([e for e in events if e[0] == "start"])))
        first = len(events) == 1
        if first:
            entered.set()
            release.wait(60)  # the test stops the request here, inside the run
        try:
            result = real(*args, **kwargs)
        except BaseException as error:
            events.append(("end", type(error).__name__))
            raise
        events.append(("end", "ok"))
        return result

    monkeypatch.setattr(service, "upscale_into", held_upscale_into)
    client = Client(url, verbose=False)
    first = client.submit(handle_file(str(source)), 2, 0, 1.0, 1.0, api_name="/upscale")
    assert entered.wait(60)
    assert first.cancel()
    second = client.submit(handle_file(str(source)), 2, 1, 1.0, 1.0, api_name="/upscale")
    release.set()
    _, download, _ = second.result(timeout=120)
    assert os.path.basename(download) == "kodim03_x2.png"
    assert events == [("start", 0), ("end", "RequestStopped"), ("start", 1), ("end", "ok")], events
