"""pixel_upscaler and tiled_inference without spandrel: safe reading, tiling, memory probe, eval parsing.

The spandrel models themselves run in the ComfyUI venv (tests/test_spandrel_eval.py): spandrel needs
torchvision, which cannot live in this environment.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from flowlift.errors import FlowliftError
from flowlift.measure import methods as MT
from flowlift.measure.pixel_upscaler import PixelUpscaler, load_pixel_upscaler, read_model_state
from flowlift.measure.tiled_inference import peak_bytes_per_pixel, run_tiled, tile_side_for, tile_spans

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("single_thread_torch")


class _Payload:
    """A class a weights-only unpickler must refuse."""

    def __init__(self) -> None:
        self.weight = torch.zeros(2)


# -- reading model files -------------------------------------------------------------------------------


def test_read_model_state_reads_safetensors_and_plain_pth(tmp_path):
    state = {"model.0.weight": torch.randn(4, 3, 3, 3), "model.0.bias": torch.randn(4)}
    save_file(state, tmp_path / "m.safetensors")
    torch.save({"params_ema": state}, tmp_path / "m.pth")
    a = read_model_state(tmp_path / "m.safetensors")
    b = read_model_state(tmp_path / "m.pth")
    assert set(a) == set(state) and all(torch.equal(a[k], state[k]) for k in state)
    assert set(b) == {"params_ema"} and torch.equal(b["params_ema"]["model.0.bias"], state["model.0.bias"])


def test_read_model_state_refuses_pickles_that_need_more(tmp_path):
    path = tmp_path / "evil.pth"
    with open(path, "wb") as handle:
        pickle.dump({"model": _Payload()}, handle, protocol=2)
    torch.save({"w": _Payload()}, tmp_path / "evil2.pth")
    for p in (path, tmp_path / "evil2.pth"):
        with pytest.raises(FlowliftError, match="refused: this pickle needs more") as info:
            read_model_state(p)
        assert "\n" not in str(info.value)
    (tmp_path / "m.onnx").write_bytes(b"x")
    with pytest.raises(FlowliftError, match="not a model file"):
        read_model_state(tmp_path / "m.onnx")
    with pytest.raises(FlowliftError, match="not found"):
        read_model_state(tmp_path / "missing.safetensors")


def test_eval_refuses_a_whole_pickled_model_with_one_line(tmp_path, shared, capsys):
    from flowlift.commands.cli import main

    torch.save({"model": torch.nn.Linear(2, 2)}, tmp_path / "whole.pth")  # a pickled module, not a state dict
    code = main(
        [
            "eval",
            "--run",
            f"spandrel:{tmp_path / 'whole.pth'}",
            "--dataset",
            str(shared / "images" / "kodak"),
            "-o",
            str(tmp_path / "report"),
            "--no-progress",
        ]
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "refused: this pickle needs more" in lines[0], lines
    assert not (tmp_path / "report" / "results.json").exists()


def test_load_without_spandrel_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    save_file({"w": torch.zeros(1)}, tmp_path / "m.safetensors")
    monkeypatch.setitem(sys.modules, "spandrel", None)  # as if not installed
    with pytest.raises(FlowliftError, match=r"\[pixel\]"):
        load_pixel_upscaler(tmp_path / "m.safetensors")


# -- tiling --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length,tile,overlap", [(10, 16, 4), (100, 32, 8), (97, 40, 0), (33, 32, 15), (64, 20, 2)])
def test_tile_spans_cover_once_with_context(length, tile, overlap):
    spans = tile_spans(length, tile, overlap)
    covered = []
    for core0, core1, ctx0, ctx1 in spans:
        covered.extend(range(core0, core1))
        assert 0 <= ctx0 <= core0 < core1 <= ctx1 <= length
        assert ctx1 - ctx0 == min(tile, length)
        assert ctx0 == 0 or core0 - ctx0 >= overlap
        assert ctx1 == length or ctx1 - core1 >= overlap
    assert covered == list(range(length))


def test_tile_spans_refuse_a_tile_without_core():
    with pytest.raises(FlowliftError, match="no core"):
        tile_spans(100, 16, 8)


class _ConvUpscaler(torch.nn.Module):
    """Three 3x3 convolutions (receptive radius 3 input pixels), then a 2x pixel shuffle."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1),
            torch.nn.LeakyReLU(0.2),
            torch.nn.Conv2d(8, 8, 3, padding=1),
            torch.nn.LeakyReLU(0.2),
            torch.nn.Conv2d(8, 12, 3, padding=1),
            torch.nn.PixelShuffle(2),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_run_tiled_equals_untiled_when_overlap_covers_receptive_field():
    model = _ConvUpscaler().eval()
    image = torch.rand(1, 3, 45, 70, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(image)
        exact = run_tiled(model, image, 2, tile=20, overlap=3)
        short = run_tiled(model, image, 2, tile=20, overlap=1)
        whole = run_tiled(model, image, 2, tile=None)
    assert exact.shape == full.shape == (1, 3, 90, 140)
    assert (exact - full).abs().max().item() <= 1e-6
    assert torch.equal(whole, full)
    # with too little context the seams differ (the test would catch tiles placed or cropped wrongly)
    assert (short - full).abs().max().item() > 1e-3


def test_run_tiled_rejects_a_model_of_another_scale():
    model = _ConvUpscaler().eval()
    with pytest.raises(FlowliftError, match="tile at scale 4"), torch.no_grad():
        run_tiled(model, torch.rand(1, 3, 40, 40), 4, tile=20, overlap=2)


def test_memory_probe_and_tile_side():
    model = _ConvUpscaler().eval()
    per_pixel = peak_bytes_per_pixel(model, torch.device("cpu"), torch.float32, side=32)
    # at least the 12-channel conv output (12 float32 per input pixel), at most the sum of all activations
    assert 12 * 4 <= per_pixel <= (3 + 8 * 4 + 12 + 12) * 4 * 1.5
    assert tile_side_for(per_pixel, budget=int(per_pixel * 300 * 300), overlap=16) == 300
    assert tile_side_for(per_pixel, budget=1, overlap=16) == 64  # floor: 2 * overlap + 32
    assert tile_side_for(1.0, budget=1 << 40, overlap=16, multiple_of=12) == 2040  # capped, multiple kept


def test_pixel_upscaler_resizes_to_the_requested_scale_and_reuses_its_last_result():
    class _Descriptor:
        scale = 2
        architecture = SimpleNamespace(name="Nearest")

        def __call__(self, x):
            return torch.nn.functional.interpolate(x, scale_factor=2, mode="nearest")

    model = PixelUpscaler(_Descriptor(), Path("m.safetensors"), torch.device("cpu"), torch.float32)
    low = (torch.rand(20, 30, 3) * 255).round().to(torch.uint8).numpy()
    out4 = model.upscale(low, 4)
    assert out4.shape == (80, 120, 3)
    assert model.upscale(low, 4) is out4
    assert model.upscale(low, 2).shape == (40, 60, 3)
    assert "resized 2x -> 4x with Lanczos" in model.describe(4) and "resized" not in model.describe(2)


# -- eval method parsing -----------------------------------------------------------------------------


def test_parse_spandrel_methods():
    specs = MT.parse_methods(
        "lanczos,spandrel:models/4x-UltraSharp.pth,spandrel:C:/m/x.safetensors:hat+colorfix,"
        "spandrel:m/esr.pth+colorfix:esr"
    )
    labels = [s.label for s in specs]
    assert labels == ["lanczos", "spandrel:4x-UltraSharp", "spandrel:hat+colorfix", "spandrel:esr+colorfix"]
    opts = [dict(s.options) for s in specs[1:]]
    assert [o["path"] for o in opts] == ["models/4x-UltraSharp.pth", "C:/m/x.safetensors", "m/esr.pth"]
    assert [o["colorfix"] for o in opts] == [False, True, True]
    assert not any(s.needs_vae for s in specs)
    with pytest.raises(FlowliftError, match="model file"):
        MT.parse_methods("spandrel:model.onnx")
    with pytest.raises(FlowliftError, match="given twice"):
        MT.parse_methods("spandrel:a/m.pth,spandrel:b/m.pth")
    with pytest.raises(FlowliftError, match="label"):
        MT.parse_methods("spandrel:m.pth:bad label")


def test_eval_help_lists_the_spandrel_method_with_an_example():
    result = subprocess.run(
        [sys.executable, "-m", "flowlift", "eval", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "spandrel:PATH[:label][+colorfix]" in result.stdout
    assert "--run spandrel:models/4x-UltraSharp.pth:ultrasharp" in result.stdout


# -- models that cannot give a right result (issue 22 items 5 and 9) -------------------------------------


def test_weight_dtype_check_refuses_integers_also_under_renamed_keys():
    from flowlift.models.weights import dtype_mismatch

    module = torch.nn.Conv2d(3, 4, 1)
    module.register_buffer("index", torch.zeros(3, dtype=torch.long))  # an index buffer, as SwinIR's
    fine = {"weight": torch.randn(4, 3, 1, 1), "bias": torch.randn(4), "index": torch.arange(3)}
    assert dtype_mismatch(module, fine) is None
    assert "`bias` has dtype int8" in dtype_mismatch(module, {**fine, "bias": torch.ones(4, dtype=torch.int8)})
    # a loader that renames keys (spandrel's ESRGAN: conv_first -> model.0) loads what the module does not name
    renamed = {"conv_first.weight": torch.ones(4, 3, 1, 1, dtype=torch.int8), "index": torch.arange(3)}
    assert "`conv_first.weight` has dtype int8" in dtype_mismatch(module, renamed)


def test_a_model_that_fails_or_gives_nan_is_one_line_naming_the_file():
    class _Descriptor:
        scale = 2
        architecture = SimpleNamespace(name="Broken")

        def __init__(self, behaviour):
            self.behaviour = behaviour

        def __call__(self, x):
            if self.behaviour == "raise":
                raise RuntimeError("\n Error while processing pattern\n Shape mismatch, can't divide 24 by 32")
            return torch.full((1, 3, x.shape[-2] * 2, x.shape[-1] * 2), float("nan"))

    low = (torch.rand(20, 30, 3) * 255).round().to(torch.uint8).numpy()
    broken = PixelUpscaler(_Descriptor("raise"), Path("m/odd.safetensors"), torch.device("cpu"), torch.float32)
    with pytest.raises(FlowliftError) as info:
        broken.upscale(low, 2)
    text = str(info.value)
    assert "\n" not in text and text.startswith("m/odd.safetensors: Broken cannot run on a 20x30 input")
    assert "RuntimeError: Error while processing pattern ... Shape mismatch" in text
    with pytest.raises(FlowliftError, match="odd.safetensors: Broken cannot run on a 64x64"):  # the tile probe
        peak_bytes_per_pixel(broken._forward, torch.device("cpu"), torch.float32, side=64)
    nan = PixelUpscaler(_Descriptor("nan"), Path("m/nan.safetensors"), torch.device("cpu"), torch.float16)
    with pytest.raises(FlowliftError, match=r"m/nan.safetensors: Broken gave NaN or Inf .* float16"):
        nan.upscale(low, 2)
