import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from builders import kodak_crops, save_tiny_unet
from flowlift.commands.cli import main
from flowlift.errors import FlowliftError, FlowliftWarning
from flowlift.measure import cache as C
from flowlift.measure import evaluate as E
from flowlift.measure import inputs as IN
from flowlift.measure import methods as MT
from flowlift.measure import metrics as M
from flowlift.measure import pairs as P
from flowlift.measure import report as R


class BlockVAE:
    """A tiny linear stand-in VAE: 8x8 average pooling in, nearest upsampling out (4 channels)."""

    spatial_factor = 8
    approximate_decode = False

    def __init__(self) -> None:
        self.encoded = 0

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        self.encoded += 1
        pooled = torch.nn.functional.avg_pool2d(images, 8)
        return torch.cat([pooled, pooled[:, :1]], dim=1) * 2 - 1

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        x = (latents[:, :3] + 1) / 2
        return x.repeat_interleave(8, dim=2).repeat_interleave(8, dim=3).clamp(0, 1)


@pytest.fixture(scope="module")
def photos(tmp_path_factory, shared) -> Path:
    """Three small photos (Kodak crops, 136x104 -> cropped to 128x64 multiples of 64 at scale 4)."""
    return kodak_crops(shared, tmp_path_factory.mktemp("photos"))


def test_parse_methods():
    specs = MT.parse_methods(["lanczos,bicubic", "flow:transplant=0.5:seed=3,vae-roundtrip"])
    assert [s.label for s in specs] == ["lanczos", "bicubic", "flow:seed=3:transplant=0.5", "vae-roundtrip"]
    assert [s.needs_vae for s in specs] == [False, False, True, True]
    kw = MT.flow_kwargs(specs[2], 4)
    assert kw == {"num_passes": 2, "seed": 3, "color_fix": True, "transplant_strength": 0.5, "color_fix_strength": 1.0}
    assert MT.flow_kwargs(MT.parse_methods("flow:color=off:color_fix=0")[0], 2)["color_fix"] is False
    for bad, msg in [
        ("nearest", "unknown method"),
        ("lanczos:seed=1", "bad option"),
        ("flow:strength=1", "bad option"),
        ("flow:transplant=2", r"\[0, 1\]"),
        ("flow:seed=x", "seed must be an integer in"),
        ("bicubic,bicubic", "twice"),
        (",", "empty item"),
    ]:
        with pytest.raises(FlowliftError, match=msg):
            MT.parse_methods(bad)
    with pytest.raises(FlowliftError, match="power of 2"):
        MT.flow_kwargs(MT.parse_methods("flow")[0], 3)


def test_prepare_pair_crops_and_area_downsamples():
    rng = np.random.default_rng(0)
    photo = rng.integers(0, 256, size=(150, 201, 3), dtype=np.uint8)
    gt, low = IN.prepare_pair(photo, 4)
    assert gt.shape == (128, 192, 3) and low.shape == (32, 48, 3) and low.dtype == np.uint8
    np.testing.assert_array_equal(gt, photo[11:139, 4:196])
    block = gt[:4, :4].astype(np.float64).mean(axis=(0, 1))
    np.testing.assert_allclose(low[0, 0], block, atol=0.5 + 1e-6)
    with pytest.raises(FlowliftError, match="smaller"):
        IN.prepare_pair(photo[:50], 4)


def test_eval_refusals_name_the_photo_the_option_once_and_the_method(tmp_path, capsys):
    """``photo 64x64 is smaller than 528x528 (16 x the scale's numerator)`` named no file and no fix; ``argument
    --scale: --scale must be ...`` said the option twice; ``model file not found: PATH`` named no method."""
    with pytest.raises(FlowliftError) as caught:
        IN.prepare_pair(np.zeros((64, 64, 3), np.uint8), 8, name="p/a.png")
    assert str(caught.value) == (
        "p/a.png (64x64) is too small for scale 8: it needs at least 128x128 px; use a smaller scale or larger photos"
    )
    (tmp_path / "photos").mkdir()
    Image.new("RGB", (64, 64)).save(tmp_path / "photos" / "a.png")
    photos = str(tmp_path / "photos")
    for argv, line in (
        (["--run", "lanczos", "--scale", "33"], "error: argument --scale: must be above 1 and at most 16, got 33"),
        (
            ["--run", "lanczos", "--scale", "8"],
            "(64x64) is too small for --scale 8: it needs at least 128x128 px; use a smaller --scale or larger photos",
        ),
        (
            ["--run", "spandrel:/no/such.pth"],
            "error: --run spandrel:/no/such.pth: no such model file; give a "
            "spandrel model's file (.safetensors, .pth, .pt, .ckpt, .bin)",
        ),
    ):
        try:
            code = main(["eval", "--dataset", photos, *argv, "-o", str(tmp_path / "out"), "--no-cache"])
        except SystemExit as stop:  # the parser's own refusal
            code = stop.code
        err = capsys.readouterr().err
        assert code == 2 and line in err and "--scale must" not in err and len(err.strip().splitlines()) == 1, err


def test_area_downscale_rounds_exact_halves_to_even_without_bias():
    """Every 2x2 block whose mean is exactly k + 0.5 (a quarter of them in photos), all k: half to even."""
    levels = np.arange(255)
    blocks = np.zeros((255, 2, 2, 3), np.uint8)
    blocks[:, 0, 0] = blocks[:, 0, 1] = levels[:, None]  # sum = 4k + 2: mean k + 0.5
    blocks[:, 1, 0] = levels[:, None] + 1
    blocks[:, 1, 1] = levels[:, None] + 1
    photo = blocks.transpose(1, 0, 2, 3).reshape(2, 255 * 2, 3)[:, :, :]
    photo = np.concatenate([photo] * 16, axis=0)[:32, : 16 * 2 * 15]  # 32 x 480: multiples of 16 x 2
    gt, low = IN.prepare_pair(photo, 2)
    exact = gt.astype(np.float64).reshape(16, 2, 240, 2, 3).mean(axis=(1, 3))
    assert np.all(exact % 1 == 0.5)
    expected = np.floor(exact) + (np.floor(exact) % 2 == 1)  # ties to the even neighbour
    np.testing.assert_array_equal(low, expected.astype(np.uint8))
    assert abs((low - exact).mean()) < 0.01  # unbiased: float32 rounding made inputs ~+0.5/255 here
    # integer factors of any size, against float64 means rounded half to even
    rng = np.random.default_rng(1)
    image = rng.integers(0, 256, size=(48, 64, 3), dtype=np.uint8)
    for factor in (2, 3, 4, 8, 16):
        h, w = 48 - 48 % factor, 64 - 64 % factor
        means = image[:h, :w].astype(np.float64).reshape(h // factor, factor, w // factor, factor, 3).mean((1, 3))
        np.testing.assert_array_equal(IN.box_downscale_uint8(image[:h, :w], factor), np.rint(means).astype(np.uint8))


def test_summarize_worst_rules():
    per_image = {
        "a": {"cast_r": 1.0, "psnr_input": 40.0, "sharpness": 3.0, "l1": 0.1},
        "b": {"cast_r": -2.0, "psnr_input": 30.0, "sharpness": 5.0, "l1": 0.3},
    }
    mean, worst = E.summarize(per_image)
    assert mean == {"cast_r": -0.5, "psnr_input": 35.0, "sharpness": 4.0, "l1": 0.2}
    assert worst == {"cast_r": -2.0, "psnr_input": 30.0, "sharpness": 3.0, "l1": 0.3}


def test_summarize_takes_every_images_metrics():
    # a 2x pair first, a same-size pair second: l1 was left out of the summary (keys from the first image)
    per_image = {"a": {"psnr_input": 40.0}, "b": {"psnr_input": 30.0, "l1": 0.25, "identical_pct": 10.0}}
    mean, worst = E.summarize(per_image)
    assert mean == {"psnr_input": 35.0, "l1": 0.25, "identical_pct": 10.0}
    assert worst == {"psnr_input": 30.0, "l1": 0.25, "identical_pct": 10.0}


def test_run_methods_table_json_figures_and_cache(photos, tmp_path):
    vae = BlockVAE()
    specs = MT.parse_methods("lanczos,bicubic,latent-bicubic,vae-roundtrip")
    fns = {s.label: MT.make_method_fn(s, 4, vae=vae, device="cpu", dtype=torch.float32) for s in specs}
    ident = {"vae": "fake-1", "device": "cpu", "dtype": "float32"}
    cache = tmp_path / "cache"

    def run(folder=photos, identities=ident, methods=specs):
        return E.evaluate_methods(methods, [folder], 4, method_fns=fns, identities=identities, cache_dir=cache)

    report = run()
    assert (report.computed, report.cached) == (12, 0)
    res = report.results
    assert list(res) == ["(ground truth)", "lanczos", "bicubic", "latent-bicubic", "vae-roundtrip"]
    # nearest-decoded block VAE round trip of the ground truth: drift is small but detail is gone
    rt = res["vae-roundtrip"]["kodim03"]
    assert rt["sharpness"] < res["(ground truth)"]["kodim03"]["sharpness"]
    assert rt["psnr_input"] > 25 and abs(rt["cast_r"]) < 0.5
    # lanczos beats latent-bicubic on this blocky decoder's fidelity
    assert res["lanczos"]["kodim03"]["psnr_gt"] > res["latent-bicubic"]["kodim03"]["psnr_gt"]
    # metrics match a direct computation
    with Image.open(photos / "kodim07.png") as im:
        gt, low = IN.prepare_pair(np.asarray(im), 4)
    direct = E.measure(MT.pixel_upscale(low, 4, "bicubic"), low, gt)
    assert res["bicubic"]["kodim07"] == pytest.approx(direct)

    paths = R.write_report(report, tmp_path / "out")
    table = paths["table"].read_text()
    assert table.count("| lanczos | mean |") == 1 and table.count("| vae-roundtrip | worst |") == 1
    assert "PSNR gt (dB)" in table and "3 image(s)" in table
    data = json.loads(paths["json"].read_text())
    assert data["summary"]["bicubic"]["mean"]["psnr_gt"] == pytest.approx(
        np.mean([m["psnr_gt"] for m in res["bicubic"].values()])
    )
    assert set(data["images"]["lanczos"]) == {"kodim03", "kodim07", "kodim23"}
    for key in ("metrics", "crops"):
        assert paths[key].read_bytes()[:4] == b"\x89PNG"
    assert not [p for p in (tmp_path / "out").iterdir() if "partial" in p.name]

    # rerun: everything from the cache, same numbers, VAE untouched
    encoded = vae.encoded
    again = run()
    assert (again.computed, again.cached) == (0, 12) and vae.encoded == encoded
    assert again.results == report.results
    # another VAE identity recomputes only the VAE methods
    other = run(identities={**ident, "vae": "fake-2"})
    assert (other.computed, other.cached) == (6, 6)
    # changed pixels in one photo recompute only that photo
    changed = tmp_path / "changed"
    changed.mkdir()
    for p in photos.iterdir():
        a = np.asarray(Image.open(p)).copy()
        if p.stem == "kodim23":
            a[40:60, 40:60] = 0
        Image.fromarray(a).save(changed / p.name)
    third = run(folder=changed)
    assert (third.computed, third.cached) == (4, 8)
    # method options are part of the key
    assert C.cache_key({"method": "flow", "options": {"transplant": 0.5}}) != C.cache_key(
        {"method": "flow", "options": {"transplant": 1.0}}
    )


def test_pairs_mode_identical_and_shifted(photos, tmp_path):
    outs = tmp_path / "outs"
    outs.mkdir()
    for p in photos.iterdir():
        a = np.asarray(Image.open(p)).astype(np.int16)
        shifted = np.clip(a + (3 if p.stem != "kodim07" else 0), 0, 255).astype(np.uint8)
        Image.fromarray(shifted).save(outs / f"{p.stem}.png")
    (outs / "unpaired.png").write_bytes((outs / "kodim03.png").read_bytes())
    with pytest.warns(FlowliftWarning, match=r"1 output\(s\) left out, each without a reference .*: unpaired.png"):
        report = P.evaluate_pairs([outs], photos, measuring=E.MeasureSettings(box=(0, 0, 32, 32)))
    res = report.results["outputs"]
    assert set(res) == {"kodim03", "kodim07", "kodim23"} and report.config["unpaired_outputs"] == ["unpaired"]
    same = res["kodim07"]
    assert same["identical_pct"] == 100.0 and same["l1"] == 0.0 and same["psnr_input"] == math.inf
    assert res["kodim03"]["cast_g"] == pytest.approx(3.0, abs=0.05) and res["kodim03"]["identical_pct"] < 5
    assert "levels" in same and "grey_sigma" in same
    text = R.markdown_table(report)
    assert "identical %" in text and "inf" in text and "levels" in text
    other = tmp_path / "other"
    other.mkdir()
    (other / "zzz.png").write_bytes((outs / "kodim03.png").read_bytes())
    with pytest.raises(FlowliftError, match="no output file"):
        P.evaluate_pairs([outs], other)


def test_cli_pairs_and_errors(photos, tmp_path, capsys):
    out = tmp_path / "report"
    assert (
        main(
            [
                "eval",
                str(photos),
                "--reference",
                str(photos),
                "--ground-truth",
                str(photos),
                "-o",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "| outputs | mean |" in printed and "SSIM gt" in printed
    assert sorted(p.name for p in out.iterdir()) == ["crops.png", "metrics.png", "results.json", "table.md"]
    # strict JSON: the identical images' infinite PSNRs as "inf" (a bare Infinity is refused by other parsers); the
    # summary counts each at the 100 dB ceiling
    data = json.loads((out / "results.json").read_text(), parse_constant=lambda word: pytest.fail(word))
    assert (
        data["summary"]["outputs"]["mean"]["psnr_gt"] == 100.0
        and float(data["images"]["outputs"]["kodim03"]["psnr_y"]) == math.inf
    )

    bad = tmp_path / "bad"
    for argv, msg in [
        (["eval", "--run", "lanczos", "-o", str(bad)], "--dataset"),
        (["eval", "--run", "latent-bicubic", "--dataset", str(photos), "-o", str(bad)], "--vae"),
        (["eval", "--run", "flow", "--dataset", str(photos), "--vae", "x", "-o", str(bad)], "--upscaler"),
        (["eval", "--run", "sinc", "--dataset", str(photos), "-o", str(bad)], "unknown method"),
        (["eval", str(photos), "-o", str(bad)], "--reference"),
        (["eval", "--run", "lanczos", "--dataset", str(tmp_path / "none"), "-o", str(bad)], "no such"),
        (["eval", "--run", "lanczos", "--dataset", str(photos), "--box", "0,0,999,999", "-o", str(bad)], "not inside"),
        # options of --run given with OUTPUTS --reference were ignored without a word
        (["eval", str(photos), "--reference", str(photos), "--limit", "1", "-o", str(bad)], "--limit goes with --run"),
        (["eval", str(photos), "--reference", str(photos), "--scale", "3", "-o", str(bad)], "--scale goes with --run"),
        (
            ["eval", str(photos), "--reference", str(photos), "--dataset", str(photos), "--no-cache", "-o", str(bad)],
            "--dataset, --no-cache go with --run",
        ),
        (["eval", str(photos), "--reference", str(photos), "--vae", "taef2", "-o", str(bad)], "--vae goes with"),
        (["eval", str(photos), "--reference", str(photos), "--save-outputs", "-o", str(bad)], "--save-outputs goes"),
    ]:
        assert main(argv + ["--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and msg in err and "Traceback" not in err
        assert not bad.exists()


@pytest.mark.parametrize(("output", "reference"), [((100, 77), (64, 48)), ((1, 1), (3, 3)), ((128, 90), (64, 48))])
def test_pairs_that_are_not_an_integer_upscale_are_refused(tmp_path, capsys, output, reference):
    """Issue 22.6: eval measures only pairs that are one integer factor (>= 1) apart on both axes, the
    rule colorfix applies; anything else is one line and exit 2, nothing written."""
    rng = np.random.default_rng(0)
    for folder, size in (("outs", output), ("refs", reference)):
        (tmp_path / folder).mkdir()
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(tmp_path / folder / "a.png")
    report = tmp_path / "report"
    assert (
        main(
            ["eval", str(tmp_path / "outs"), "--reference", str(tmp_path / "refs"), "-o", str(report), "--no-progress"]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not an integer multiple of the reference" in err and "Traceback" not in err
    assert f"{output[0]}x{output[1]}" in err and str(tmp_path / "outs" / "a.png") in err
    assert not report.exists()


@pytest.mark.parametrize(
    ("truth_size", "message"),
    [((63, 48), "but its ground truth .* is 63x48"), ((64, 48), None)],
)
def test_pairs_ground_truth_sizes_checked_before_measuring(tmp_path, capsys, monkeypatch, truth_size, message):
    """A ground truth of another size, or an output too small for SSIM-Y at its shave, is one line naming the
    file before any image is measured (both were found mid-run, without a path)."""
    rng = np.random.default_rng(0)
    small_b = message is None  # a.png is fine: b.png (16 px wide at 4x: 4 px off each border) too small for SSIM-Y
    sizes = {  # (w, h) of a.png and b.png in each folder, every output 4x its reference
        "outs": [(64, 48), (16, 64) if small_b else (64, 64)],
        "refs": [(16, 12), (4, 16) if small_b else (16, 16)],
        "gts": [truth_size, (16, 64) if small_b else (64, 64)],
    }
    for folder, pair in sizes.items():
        (tmp_path / folder).mkdir()
        for name, (w, h) in zip(("a.png", "b.png"), pair, strict=True):
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(tmp_path / folder / name)
    if small_b:
        message = r"b.png: 16x64 is too small for SSIM-Y: 19 px a side at least .* without --ground-truth"
    monkeypatch.setattr(E, "measure", lambda *a, **k: pytest.fail("measured before the sizes were checked"))
    monkeypatch.setattr(P, "measure", lambda *a, **k: pytest.fail("measured before the sizes were checked"))
    argv = ["eval", str(tmp_path / "outs"), "--reference", str(tmp_path / "refs")]
    assert main(argv + ["--ground-truth", str(tmp_path / "gts"), "-o", str(tmp_path / "r"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err and re.search(message, err), err
    assert not (tmp_path / "r").exists()


def test_pairs_with_transparent_pixels_say_so(tmp_path):
    rng = np.random.default_rng(0)
    for folder in ("outs", "refs"):
        (tmp_path / folder).mkdir()
    rgba = rng.integers(0, 256, (48, 64, 4), dtype=np.uint8)
    Image.fromarray(rgba[..., :3]).save(tmp_path / "refs" / "a.png")
    Image.fromarray(rgba, "RGBA").save(tmp_path / "outs" / "a.png")
    with pytest.warns(FlowliftWarning, match="a.png: has transparent pixels"):
        P.evaluate_pairs([tmp_path / "outs"], tmp_path / "refs", figure_images=0)


def test_pairs_at_an_integer_scale_including_1x_are_measured(tmp_path):
    rng = np.random.default_rng(0)
    for folder in ("outs", "refs"):
        (tmp_path / folder).mkdir()
    Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(tmp_path / "refs" / "a.png")
    Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(tmp_path / "refs" / "b.png")
    Image.fromarray(rng.integers(0, 256, (144, 192, 3), dtype=np.uint8)).save(tmp_path / "outs" / "a_x3.png")
    Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(tmp_path / "outs" / "b.png")
    report = P.evaluate_pairs([tmp_path / "outs"], tmp_path / "refs", figure_images=0)
    assert sorted(report.results["outputs"]) == ["a", "b"] and "l1" in report.results["outputs"]["b"]


def test_vae_roundtrip_with_real_taef2_is_clean(shared, photos):
    from flowlift.models.vae_loading import load_vae

    vae = load_vae(str(shared / "models" / "taef2"), device="cpu", dtype=torch.float32)
    with Image.open(photos / "kodim23.png") as im:
        gt, _ = IN.prepare_pair(np.asarray(im), 1)
    out = MT.vae_roundtrip(vae, gt, "cpu", torch.float32)
    drift = M.drift_at_input_scale(out, gt)
    # TAEF2 is an approximate decoder: Kodak round trips cast ~1-5/255 (the card's VAE: <= 0.9/255)
    assert drift["cast_max"] < 2.0 and abs(drift["c_mean_change_pct"]) < 5.0 and drift["psnr_input"] > 25


def test_cli_run_with_vae_methods_and_cache(monkeypatch, photos, tmp_path, capsys):
    import sys
    import types

    module = types.ModuleType("flowlift.models.vae_loading")
    module.ENCODE_DECODE = ("encode", "decode")  # what the job asks of the VAE it loads
    module.load_vae = lambda spec, device="cpu", dtype=torch.float32, needs=(): BlockVAE()
    module.check_vae_spec = lambda spec: None  # the up-front weight check (a local file here)
    monkeypatch.setitem(sys.modules, "flowlift.models.vae_loading", module)
    weights = tmp_path / "vae.safetensors"
    weights.write_bytes(b"one")
    out = tmp_path / "run"
    argv = [
        "eval",
        "--run",
        "bicubic,latent-bicubic",
        "--run",
        "vae-roundtrip",
        "--dataset",
        str(photos),
        "--scale",
        "4",
        "--vae",
        str(weights),
        "-o",
        str(out),
        "--no-progress",
        "--limit",
        "2",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| latent-bicubic | worst |" in printed and "cache: 0 reused, 6 computed" in printed
    data = json.loads((out / "results.json").read_text())
    assert data["config"]["vae"].startswith("sha256:") and data["config"]["images"] == ["kodim03", "kodim07"]
    assert main(argv) == 0 and "cache: 6 reused, 0 computed" in capsys.readouterr().out
    weights.write_bytes(b"two")  # new weights: only the VAE methods recompute
    assert main(argv) == 0 and "cache: 2 reused, 4 computed" in capsys.readouterr().out


def test_flow_method_passes_its_knobs_to_the_pipeline():
    calls = []

    class RecordingPipeline:
        def upscale_image(self, image, **kwargs):
            calls.append(kwargs)
            return image.resize((image.width * 4, image.height * 4), Image.Resampling.BICUBIC)

    spec = MT.parse_methods("flow:transplant=0.25:color_fix=0.5:seed=7")[0]
    fn = MT.make_method_fn(spec, 4, vae=object(), pipeline=RecordingPipeline())
    low = np.zeros((16, 32, 3), dtype=np.uint8)
    out = fn(low, np.zeros((64, 128, 3), dtype=np.uint8))
    assert out.shape == (64, 128, 3)
    assert calls == [
        {"num_passes": 2, "seed": 7, "color_fix": True, "transplant_strength": 0.25, "color_fix_strength": 0.5}
    ]
    with pytest.raises(FlowliftError, match="not 4x"):
        fn(low, np.zeros((60, 128, 3), dtype=np.uint8))
    with pytest.raises(FlowliftError, match=r"Flow Upscaler weights \(upscaler\)") as caught:  # the CLI: --upscaler
        MT.make_method_fn(spec, 4, vae=object(), pipeline=None)
    assert caught.value.field == "upscaler"


def test_latent_bicubic_interpolates_raw_latents_when_the_vae_has_statistics():
    from flowlift.flux2.latents import denormalize, normalize

    mean = torch.linspace(-1, 1, 128)
    std = torch.linspace(0.5, 2, 128)

    class StatVAE:
        """Raw latent = the image's mean grey, constant; decode = raw channel 0 as grey."""

        bn_mean, bn_std, spatial_factor = mean, std, 8

        def encode(self, images):
            raw = torch.full((1, 32, images.shape[-2] // 8, images.shape[-1] // 8), 0.4)
            return normalize(raw, mean, std)

        def decode(self, latents):
            raw = denormalize(latents, mean, std)[:, :1]
            return raw.repeat_interleave(8, 2).repeat_interleave(8, 3).repeat(1, 3, 1, 1)

    out = MT.latent_bicubic(StatVAE(), np.zeros((32, 32, 3), dtype=np.uint8), 2, "cpu", torch.float32)
    # the normalized latent has a 2x2 sub-position pattern; interpolating it would break the constant
    assert out.shape == (64, 64, 3) and np.all(out == round(0.4 * 255))


def test_cli_flow_end_to_end_with_random_weights(shared, tmp_path, capsys):
    """The flow method through the real pipeline and TAEF2 (random tiny UNet: only the plumbing)."""
    weights = save_tiny_unet(tmp_path / "flow_upscaler.safetensors")
    data = tmp_path / "data"
    data.mkdir()
    with Image.open(shared / "images" / "kodak" / "kodim23.png") as im:
        im.convert("RGB").crop((300, 200, 428, 328)).save(data / "k23.png")
    out = tmp_path / "flow"
    taef2 = str(shared / "models" / "taef2")
    argv = [
        "eval",
        "--run",
        "flow:transplant=0.5,flow:color=off",
        "--dataset",
        str(data),
        "--scale",
        "2",
        "--vae",
        taef2,
        "--upscaler",
        str(weights),
        "-o",
        str(out),
        "--no-progress",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| flow:transplant=0.5 | mean |" in printed and "| flow:color=off | mean |" in printed
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["upscaler"].startswith("sha256:")
    fixed, raw = res["images"]["flow:transplant=0.5"]["k23"], res["images"]["flow:color=off"]["k23"]
    # the pixel-space colour fix pins the low band to the input whatever the (random) model does
    assert abs(fixed["cast_max"]) < abs(raw["cast_max"]) and fixed["psnr_input"] > raw["psnr_input"]
