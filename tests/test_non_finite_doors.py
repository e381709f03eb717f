"""Issue 43 class 2: a VAE whose finite weights overflow (a Mage-VAE file scaled by 1e30) never gets its NaN/Inf
written, at any door that stores a VAE's result: ``dataset images`` shards, ``bands`` tables, ``eval``'s VAE
methods and their cache, ComfyUI's VAE made from a flowlift VAE (what VAEEncode / VAEDecode run), and the
InvokeAI latent nodes. Each refuses in one line, exits non-zero, and leaves no file of results behind.

The same doors take the same file unscaled (the refusal is about the values, not the file).
"""

from __future__ import annotations

import math
import sys
import types

import numpy as np
import pytest
import torch
from PIL import Image

from door_helpers import one_crop_dataset_args
from flowlift.commands.cli import main
from flowlift.errors import FlowliftError
from flowlift.models.vae_loading import load_vae
from mage_files import released_state, save_released

SCALE = 1e30


@pytest.fixture(scope="module")
def vae_files(tmp_path_factory):
    """(finite Mage-VAE file, the same weights times 1e30: finite, but every activation overflows)."""
    folder = tmp_path_factory.mktemp("vae")
    state = released_state()
    good = save_released(folder / "mage.safetensors", state)
    hot = save_released(
        folder / "mage-hot.safetensors", {k: v * SCALE if v.is_floating_point() else v for k, v in state.items()}
    )
    return good, hot


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    for index in range(2):
        Image.fromarray(rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)).save(folder / f"p{index}.png")
    return folder


def run(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def assert_one_line_refusal(code: int, err: str, command: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"flowlift {command}: error: "), err
    assert "NaN" in lines[0] or "Inf" in lines[0], err
    assert "nothing was written" in lines[0] and "Traceback" not in err


class TestDatasetShards:
    def argv(self, photos, vae, out):
        return (*one_crop_dataset_args(photos, vae), "--no-progress", "-o", out)

    def test_an_overflowing_vae_writes_no_shard(self, vae_files, photos, tmp_path, capsys):
        out = tmp_path / "data"
        code, err = run(capsys, *self.argv(photos, vae_files[1], out))
        assert_one_line_refusal(code, err, "dataset")
        assert "shard-00000.safetensors" in err
        assert not list(out.glob("shard-*")) and not list(out.glob(".*"))  # no shard, no temporary

    def test_float16_storage_past_its_range_is_refused_too(self, tmp_path):
        from flowlift.training.shards import write_shard

        tensors = {"target": torch.full((1, 32, 4, 4), 1e5), "cond": torch.zeros(1, 32, 2, 2)}
        with pytest.raises(FlowliftError, match=r"Inf in `target` stored as float16"):
            write_shard(tmp_path, 0, 0, tensors, [{"index": 0}], torch.float16)
        assert list(tmp_path.iterdir()) == []
        write_shard(tmp_path, 0, 0, tensors, [{"index": 0}], torch.float32)  # in range there: written

    def test_the_finite_file_builds_its_shards(self, vae_files, photos, tmp_path, capsys):
        out = tmp_path / "data"
        code, err = run(capsys, *self.argv(photos, vae_files[0], out))
        assert code == 0, err
        assert list(out.glob("shard-*.safetensors"))


class TestBandsTables:
    def test_an_overflowing_vae_writes_no_table(self, vae_files, photos, tmp_path, capsys):
        out = tmp_path / "bands"
        code, err = run(capsys, "bands", photos, "--vae", vae_files[1], "--device", "cpu", "-o", out)
        assert_one_line_refusal(code, err, "bands")
        assert not out.exists() or list(out.iterdir()) == []

    def test_the_finite_file_writes_valid_json(self, vae_files, photos, tmp_path, capsys):
        import json

        out = tmp_path / "bands"
        code, err = run(capsys, "bands", photos, "--vae", vae_files[0], "--device", "cpu", "-o", out)
        assert code == 0, err
        text = (out / "bands.json").read_text()
        json.loads(text, parse_constant=lambda name: pytest.fail(f"bands.json holds {name}"))
        assert "nan" not in (out / "bands.md").read_text().lower()


class TestEvalCache:
    @pytest.mark.parametrize("method", ["vae-roundtrip", "latent-bicubic"])
    def test_an_overflowing_vae_is_one_line_and_caches_nothing(self, vae_files, photos, tmp_path, capsys, method):
        out = tmp_path / "report"
        code, err = run(
            capsys,
            "eval",
            "--run",
            method,
            "--dataset",
            photos,
            "--scale",
            "2",
            "--vae",
            vae_files[1],
            "--device",
            "cpu",
            "--no-progress",
            "-o",
            out,
        )
        assert_one_line_refusal(code, err, "eval")
        assert "the VAE's encoder" in err  # says which model gave it, not only that an image holds NaN
        assert not out.exists() or not [p for p in out.rglob("*") if p.is_file()]


def stub_comfy(monkeypatch) -> None:
    """Just enough of ComfyUI's module names for :mod:`flowlift.comfyui.vae_adapters` to import; the class under
    test (what ComfyUI's VAEEncode / VAEDecode call on a flowlift VAE) uses only the interrupt check (never set)."""
    comfy = types.ModuleType("comfy")
    names = ("model_management", "model_patcher", "sd", "taesd", "taesd.taesd")
    parts = {name: types.ModuleType(f"comfy.{name}") for name in names}
    parts["sd"].VAE = type("VAE", (), {})
    parts["model_management"].throw_exception_if_processing_interrupted = lambda: None
    parts["taesd.taesd"].TAESD = type("TAESD", (), {})
    monkeypatch.setitem(sys.modules, "comfy", comfy)
    for name, module in parts.items():
        parent, _, leaf = f"comfy.{name}".rpartition(".")
        setattr(sys.modules[parent] if parent != "comfy" else comfy, leaf, module)
        monkeypatch.setitem(sys.modules, f"comfy.{name}", module)
    monkeypatch.delitem(sys.modules, "flowlift.comfyui.vae_adapters", raising=False)


class TestComfyUIVAE:
    def test_vae_encode_and_decode_refuse_an_overflowing_vae_in_one_line(self, vae_files, monkeypatch):
        stub_comfy(monkeypatch)
        from flowlift.comfyui.vae_adapters import FlowliftLatentModel

        images = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
        good = FlowliftLatentModel(load_vae(vae_files[0]))
        samples = good.encode(images)
        assert samples.shape == (1, 128, 4, 4) and good.decode(samples).shape == (1, 3, 64, 64)
        hot = FlowliftLatentModel(load_vae(vae_files[1]))
        with pytest.raises(FlowliftError) as caught:
            hot.encode(images)
        assert str(caught.value).startswith("VAE Encode: Mage-VAE's encoder gave NaN") and "\n" not in str(caught.value)
        with pytest.raises(FlowliftError, match=r"^VAE Decode: Mage-VAE's decoder gave (NaN|Inf)"):
            hot.decode(samples)  # a finite LATENT from elsewhere: the decode itself overflows

    def test_an_interrupt_is_asked_before_every_layer_of_an_encode_and_a_decode(self, vae_files, monkeypatch):
        """A 3072 px decode through flowlift's VAE loaders ran to its end after ComfyUI's interrupt; the adapter now
        asks ComfyUI's check before each layer, so the run ends at the layer where the interrupt is seen."""
        stub_comfy(monkeypatch)
        import comfy.model_management as mm

        from flowlift.comfyui.vae_adapters import FlowliftLatentModel

        model = FlowliftLatentModel(load_vae(vae_files[0]))
        images = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
        samples = model.encode(images)
        for call in (lambda: model.encode(images), lambda: model.decode(samples)):
            asked: list[int] = []

            def interrupted_at_the_fifth(asked=asked):
                asked.append(1)
                if len(asked) == 5:
                    raise InterruptedError

            monkeypatch.setattr(mm, "throw_exception_if_processing_interrupted", interrupted_at_the_fifth)
            with pytest.raises(InterruptedError):
                call()
            assert len(asked) == 5  # raised from inside the model's layers, and it stopped there
            monkeypatch.setattr(mm, "throw_exception_if_processing_interrupted", lambda: None)
            call()  # the hooks are gone after an interrupted run: the next one runs to its end


class TestInvokeAILatents:
    def test_a_non_finite_latent_input_is_one_line(self):
        from flowlift.invokeai.latents import check_raw_latents

        for bad in (float("nan"), float("inf")):
            latents = torch.zeros(1, 32, 8, 8)
            latents[0, 3, 2, 2] = bad
            with pytest.raises(FlowliftError) as caught:
                check_raw_latents(latents, "Flow Upscale Latents (FLUX.2)")
            assert "non-finite" in str(caught.value) and "\n" not in str(caught.value)

    def test_the_image_nodes_native_vae_path_refuses_an_overflowing_vae(self, vae_files, tmp_path):
        """Flow Upscale Image runs its native VAE through the pipeline, whose checks hold for this file."""
        from flowlift.models.upscaler_unet import FlowUpscalerUNet
        from flowlift.upscale.pipeline import FlowUpscalerPipeline

        torch.manual_seed(0)
        unet = FlowUpscalerUNet(base_channels=32, time_dim=32, cond_dim=64, dropout=0.0)
        pipeline = FlowUpscalerPipeline(unet, load_vae(vae_files[1]), device="cpu", dtype=torch.float32)
        with pytest.raises(FlowliftError, match=r"non-finite latents \(NaN/Inf\); nothing was written"):
            pipeline.upscale_image(Image.new("RGB", (64, 64), (90, 120, 30)), 1, output_type="pil")


class TestPythonAdapters:
    """The Python door: ``load_vae(...).encode`` / ``.decode`` of a VAE whose finite weights overflow was an image
    (or latents) of NaN handed to a direct caller; every adapter now refuses its own result in one line, tiled or
    whole, and a door that knows its stage re-words it (:func:`flowlift.models.weights.finite_result`)."""

    IMAGES = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))

    @staticmethod
    def overflowing(module: torch.nn.Module) -> torch.nn.Module:
        with torch.no_grad():
            for parameter in module.parameters():
                parameter.mul_(SCALE)
        return module

    def assert_refused(self, call, who: str) -> None:
        from flowlift.models.weights import NonFiniteResult

        with pytest.raises(NonFiniteResult, match=rf"^{who} gave (NaN|Inf) \(weights that overflow in float32\?\)"):
            call()

    @pytest.mark.parametrize("tiled", [False, True])
    def test_mage_vae(self, vae_files, tiled):
        latents = load_vae(vae_files[0]).encode(self.IMAGES)
        hot = load_vae(vae_files[1])
        self.assert_refused(lambda: hot.encode(self.IMAGES, tiled=tiled), "Mage-VAE's encode")
        self.assert_refused(lambda: hot.decode(latents, tiled=tiled), "Mage-VAE's decode")

    @pytest.mark.parametrize("tiled", [False, True])
    def test_taef2(self, shared, tiled):
        good = load_vae(str(shared / "models" / "taef2"), device="cpu", dtype=torch.float32)
        latents = good.encode(self.IMAGES)
        hot = load_vae(str(shared / "models" / "taef2"), device="cpu", dtype=torch.float32)
        self.overflowing(hot.model)
        self.assert_refused(lambda: hot.encode(self.IMAGES, tiled=tiled), "TAEF2's encode")
        self.assert_refused(lambda: hot.decode(latents, tiled=tiled), "TAEF2's decode")

    def test_the_flux2_vae(self):
        from flowlift.models.vae import Flux2VAE
        from tiny_flux2 import tiny_vae

        latents = Flux2VAE(tiny_vae()).encode(self.IMAGES)
        hot = Flux2VAE(self.overflowing(tiny_vae()))
        self.assert_refused(lambda: hot.encode(self.IMAGES), "the FLUX.2 VAE's encode")
        self.assert_refused(lambda: hot.encode_raw(self.IMAGES), "the FLUX.2 VAE's encode")
        self.assert_refused(lambda: hot.decode(latents), "the FLUX.2 VAE's decode")

    def test_a_door_names_its_own_stage(self, vae_files):
        from flowlift.models.weights import NonFiniteResult, finite_result

        hot = load_vae(vae_files[1])
        with pytest.raises(NonFiniteResult, match=r"^image 3: the VAE's encoder gave NaN .*; nothing was written$"):
            finite_result("image 3: the VAE's encoder", hot.encode, self.IMAGES)
        with pytest.raises(NonFiniteResult, match=r"^a model gave Inf "):  # checked there for an object that does not
            finite_result("a model", lambda: torch.full((2,), math.inf))
        assert finite_result("a model", torch.ones, 2).tolist() == [1.0, 1.0]
