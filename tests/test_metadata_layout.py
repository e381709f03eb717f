"""One PNG metadata layout for every writer (issue 48; docs/metadata.md, schema 1).

``upscale`` and ``colorfix`` wrote ``flowlift.parameters``/``flowlift.models``/``flowlift.source`` chunks, ``img2img``
and ``hires`` one ``flowlift`` chunk: a script reading one broke on the other. Every writer (the four commands, the
web app's Upscale and Refine) now writes ``Software`` and one ``flowlift`` object with ``schema``, the version, the
command and the input; :func:`~flowlift.files.image_outputs.read_metadata` reads every output, and files of both
older layouts, with the same keys.
"""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image, PngImagePlugin

from builders import save_tiny_unet as tiny_upscaler
from flowlift.app.refine_tab import refine as refine_handler
from flowlift.app.service import AppConfig, AppService
from flowlift.commands.cli import main
from flowlift.files.image_outputs import read_metadata
from flowlift.files.metadata import METADATA_SCHEMA
from tiny_flux2 import prompt_embeds, write_model_dir

COMMON = {"schema", "flowlift", "command", "input", "input_sha256"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("layout")
    write_model_dir(root / "model")
    save_file({"prompt_embeds": prompt_embeds()}, str(root / "prompt.safetensors"))
    g = torch.Generator().manual_seed(2)
    Image.fromarray((torch.rand(32, 48, 3, generator=g) * 255).to(torch.uint8).numpy(), "RGB").save(root / "p.png")
    tiny_upscaler(root / "flow_upscaler.safetensors")
    return root


def _check(path, command):
    metadata = read_metadata(path)
    record = metadata["flowlift"]
    assert COMMON <= set(record), (command, sorted(record))
    assert record["schema"] == METADATA_SCHEMA and record["command"] == command
    assert metadata["Software"] == f"flowlift {record['flowlift']} {command}"
    with Image.open(path) as image:  # the file itself: the same two chunks, whoever wrote it
        assert {"Software", "flowlift"} <= set(image.text) and json.loads(image.text["flowlift"]) == record
        assert not any(key.startswith("flowlift.") for key in image.text)
    return record


def test_every_writer_writes_one_layout(folder, tmp_path, monkeypatch, shared, single_thread_torch):
    monkeypatch.chdir(folder)
    taef2 = str(shared / "models" / "taef2")
    up = ["--upscaler", "flow_upscaler.safetensors", "--vae", taef2, "--device", "cpu", "--no-progress"]
    assert main(["upscale", "p.png", "-o", str(tmp_path / "up.png"), *up]) == 0
    assert main(["colorfix", str(tmp_path / "up.png"), "--reference", "p.png", "-o", str(tmp_path / "fix.png")]) == 0
    refine = ["--model", "model", "--prompt-embeds", "prompt.safetensors", "--steps", "2", "--no-progress"]
    assert main(["img2img", "p.png", *refine, "-o", str(tmp_path / "i2i.png")]) == 0
    assert (
        main(
            [
                "hires",
                "--image",
                "p.png",
                "--upscaler",
                "flow_upscaler.safetensors",
                *refine,
                "-o",
                str(tmp_path / "hires.png"),
            ]
        )
        == 0
    )
    records = {
        "upscale": _check(tmp_path / "up.png", "upscale"),
        "colorfix": _check(tmp_path / "fix.png", "colorfix"),
        "img2img": _check(tmp_path / "i2i.png", "img2img"),
        "hires": _check(tmp_path / "hires.png", "hires"),
    }
    assert records["upscale"]["input"] == "p.png" and records["upscale"]["scale"] == 2
    assert records["colorfix"]["reference"] == "p.png"
    service = AppService(
        AppConfig(
            upscaler="flow_upscaler.safetensors",
            vaes=[taef2],
            device="cpu",
            model=str(folder / "model"),
            work_dir=tmp_path / "app",
        )
    )
    try:
        app_up = _check(service.upscale(folder / "p.png", 2, 0).output, "upscale")
        app_refine = _check(
            refine_handler(service, folder / "p.png", None, folder / "prompt.safetensors", steps=2).output, "img2img"
        )
    finally:
        service.close()
    assert app_up["input"] == app_refine["input"] == "p.png"


def _png(path, chunks):
    info = PngImagePlugin.PngInfo()
    for key, value in chunks.items():
        info.add_text(key, value if isinstance(value, str) else json.dumps(value))
    Image.new("RGB", (4, 4)).save(path, pnginfo=info)
    return path


def test_files_of_both_older_layouts_read_with_the_same_keys(tmp_path):
    upscale = _png(
        tmp_path / "old_up.png",
        {
            "Software": "flowlift 0.1.0 upscale",
            "flowlift.parameters": {"scale": 4, "seed": 3},
            "flowlift.models": {"upscaler": {"w.safetensors": "ab"}},
            "flowlift.source": {"name": "a.png", "sha256": "cd"},
        },
    )
    colorfix = _png(
        tmp_path / "old_fix.png",
        {
            "Software": "flowlift 0.1.0 colorfix",
            "flowlift.parameters": {"scale": 4, "color_fix_strength": 1.0},
            "flowlift.source": {"name": "a_x4.png", "sha256": "ef"},
            "flowlift.reference": {"name": "a.png", "sha256": "cd"},
        },
    )
    refine = _png(
        tmp_path / "old_refine.png",
        {"flowlift": {"flowlift": "0.1.0", "command": "img2img", "steps": 4, "input": "a.png", "input_sha256": "cd"}},
    )
    for path, command in ((upscale, "upscale"), (colorfix, "colorfix"), (refine, "img2img")):
        metadata = read_metadata(path)
        record = metadata["flowlift"]
        assert COMMON <= set(record) and record["command"] == command and record["flowlift"] == "0.1.0"
        assert metadata["Software"] == f"flowlift 0.1.0 {command}"
    assert read_metadata(upscale)["flowlift"]["models"] == {"upscaler": {"w.safetensors": "ab"}}
    assert read_metadata(upscale)["flowlift"]["seed"] == 3
    assert read_metadata(colorfix)["flowlift"]["reference"] == "a.png"
    assert read_metadata(refine)["flowlift"]["steps"] == 4
