"""``flowlift upscale --batch-size N / --max-memory / --compile`` (real TAEF2, small random UNet)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from builders import save_tiny_unet
from flowlift.commands.cli import main


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return save_tiny_unet(tmp_path_factory.mktemp("weights") / "flow_upscaler.safetensors")


def _common(shared, weights) -> list[str]:
    return ["--upscaler", str(weights), "--vae", str(shared / "models" / "taef2"), "--device", "cpu"]


def test_batch_size_groups_same_size_inputs_and_matches_one_by_one(tmp_path, shared, weights, capsys):
    photo = Image.open(shared / "images" / "photos" / "Wine_by_Jakkub_Mede.png").convert("RGB")
    src = tmp_path / "in"
    src.mkdir()
    photo.resize((48, 32)).save(src / "a.png")
    photo.crop((0, 0, 300, 200)).resize((48, 32)).save(src / "b.png")
    photo.resize((64, 48)).save(src / "c.png")  # another size: its own group
    photo.crop((50, 50, 350, 250)).resize((48, 32)).save(src / "d.png")
    rgba = photo.resize((48, 32))
    rgba.putalpha(Image.fromarray(np.tile(np.linspace(0, 255, 48, dtype=np.uint8), (32, 1)), "L"))
    rgba.save(src / "e.png")
    (src / "f.png").write_text("not an image")

    single, batched = tmp_path / "one", tmp_path / "batched"
    assert main(["upscale", str(src), "-o", str(single), *_common(shared, weights)]) == 1
    capsys.readouterr()
    from flowlift.jobs.same_size import SameSizeBatches

    runs: list[int] = []
    original = SameSizeBatches.__call__

    def counting(self, source, output):
        original(self, source, output)
        runs.append(self.batches_run)

    SameSizeBatches.__call__ = counting
    try:
        rc = main(["upscale", str(src), "-o", str(batched), "--batch-size", "4", *_common(shared, weights)])
    finally:
        SameSizeBatches.__call__ = original
    err = capsys.readouterr().err
    assert rc == 1 and "f.png" in err  # the unreadable input fails alone, in one line
    # a, b, d, e (48x32) in one batch, c alone, f alone (failed)
    assert runs[-1] == 2, (runs, err)
    for name in ("a", "b", "c", "d", "e"):
        one = np.asarray(Image.open(single / f"{name}_x2.png"), dtype=np.int16)
        many = np.asarray(Image.open(batched / f"{name}_x2.png"), dtype=np.int16)
        assert one.shape == many.shape
        assert np.abs(one - many).max() <= 1, name  # 8-bit rounding of float-rounding differences
    assert Image.open(batched / "e_x2.png").mode == "RGBA"


def test_max_memory_and_compile_options(tmp_path, shared, weights, capsys, monkeypatch):
    photo = Image.open(shared / "images" / "photos" / "Wine_by_Jakkub_Mede.png").convert("RGB").resize((48, 32))
    photo.save(tmp_path / "p.png")
    rc = main(["upscale", str(tmp_path / "p.png"), "-o", str(tmp_path / "plain"), *_common(shared, weights)])
    assert rc == 0
    rc = main(
        ["upscale", str(tmp_path / "p.png"), "-o", str(tmp_path / "budget"), "--max-memory", "2GB"]
        + _common(shared, weights)
    )
    assert rc == 0
    plain = np.asarray(Image.open(tmp_path / "plain" / "p_x2.png"), dtype=np.int16)
    budget = np.asarray(Image.open(tmp_path / "budget" / "p_x2.png"), dtype=np.int16)
    assert np.abs(plain - budget).max() <= 1
    capsys.readouterr()
    rc = main(
        ["upscale", str(tmp_path / "p.png"), "-o", str(tmp_path / "x"), "--max-memory", "lots"]
        + _common(shared, weights)
    )
    assert rc == 2 and "--max-memory must be a size" in capsys.readouterr().err

    # --compile: a failing compiler falls back to eager with one warning line, same image
    import torch._dynamo

    def broken(*args, **kwargs):
        raise RuntimeError("compiler missing")

    monkeypatch.setattr(torch, "compile", broken)
    rc = main(
        ["upscale", str(tmp_path / "p.png"), "-o", str(tmp_path / "compiled"), "--compile"] + _common(shared, weights)
    )
    assert rc == 0
    err = capsys.readouterr().err
    assert err.count("running the UNet eagerly") == 1, err
    compiled = np.asarray(Image.open(tmp_path / "compiled" / "p_x2.png"), dtype=np.int16)
    assert np.array_equal(compiled, plain)
