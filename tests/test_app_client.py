"""``flowlift app``'s API endpoint ``upscale`` driven by gradio_client against a live loopback server."""

from __future__ import annotations

import json
import os

import pytest
from gradio_client import Client, handle_file
from PIL import Image

from app_helpers import free_port, is_loopback, listening_addresses, tiny_upscaler
from flowlift.app import build_app, launch
from flowlift.app_service import AppConfig, AppService


@pytest.fixture
def server(shared, tmp_path, monkeypatch, single_thread_torch):
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "gradio"))
    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    weights = tiny_upscaler(tmp_path / "flow_upscaler.safetensors")
    config = AppConfig(
        upscaler=str(weights), vaes=[str(shared / "models" / "taef2")], device="cpu", work_dir=tmp_path / "work"
    )
    service = AppService(config)
    demo = build_app(service)
    port = free_port()
    launch(demo, service, port=port, block=False)
    try:
        yield demo, f"http://127.0.0.1:{port}/"
    finally:
        demo.close()
        service.close()
    assert not [a for a in listening_addresses({os.getpid()}) if a[1] == port], "server still listening"


def test_upscale_endpoint_with_gradio_client(server, shared, tmp_path):
    demo, url = server
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
    slider, download, info = client.predict(handle_file(str(source)), 2, 5, 1.0, 0.5, api_name="/upscale")
    with Image.open(download) as png:
        assert png.size == (128, 96) and png.format == "PNG"
        params = json.loads(png.text["flowlift.parameters"])
        assert json.loads(png.text["flowlift.source"])["name"] == "kodim03.png"
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
