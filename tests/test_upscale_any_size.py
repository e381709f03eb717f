"""``flowlift upscale --scale X / --long-side N / --size WxH`` (issue 46.1): exact sizes, the low band pinned at the
final size, 2/4/8 unchanged, every refusal one line before any work (real TAEF2, small random UNet)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from door_helpers import cpu_upscale_options
from flowlift.commands.cli import main
from flowlift.errors import FlowliftError


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    from flowlift.models.upscaler_unet import FlowUpscalerUNet
    from flowlift.models.upscaler_weights import save_upscaler

    torch.manual_seed(0)
    model = FlowUpscalerUNet(base_channels=32, time_dim=32, cond_dim=64, dropout=0.0)
    return save_upscaler(model, tmp_path_factory.mktemp("weights") / "flow_upscaler.safetensors")


@pytest.fixture(scope="module")
def photo(shared):
    image = Image.open(shared / "images" / "photos" / "Wine_by_Jakkub_Mede.png").convert("RGB")
    return image.resize((48, 32), Image.Resampling.BOX)


def _common(shared, weights) -> list[str]:
    return [*cpu_upscale_options(shared, weights), "--dtype", "float32"]


def _exact_area(n_out: int, n_in: int) -> np.ndarray:
    """Dense exact-area downsampling (row j integrates [j r, (j + 1) r), r = n_in / n_out): written here, not
    taken from flowlift, so the test does not check the code against itself."""
    ratio = n_in / n_out
    return np.array(
        [[max(0.0, min(p + 1, (j + 1) * ratio) - max(p, j * ratio)) / ratio for p in range(n_in)] for j in range(n_out)]
    )


def _cast(result: Image.Image, source: Image.Image) -> float:
    """Largest per-channel mean difference, in 8-bit levels, of ``result`` area-downsampled back to ``source``."""
    out = np.asarray(result, dtype=np.float64)
    rows, cols = _exact_area(source.height, result.height), _exact_area(source.width, result.width)
    back = np.einsum("ih,hwc,jw->ijc", rows, out, cols)
    return float(np.abs((back - np.asarray(source, dtype=np.float64)).mean(axis=(0, 1))).max())


@pytest.mark.parametrize(
    ("scale", "name", "size", "passes"), [("3", "a_x3.png", (144, 96), 2), ("1.5", "a_x1.5.png", (72, 48), 1)]
)
def test_a_fractional_scale_writes_exactly_that_size_with_the_inputs_low_band(
    tmp_path, shared, weights, photo, scale, name, size, passes
):
    photo.save(tmp_path / "a.png")
    assert main(["upscale", str(tmp_path / "a.png"), "--scale", scale, *_common(shared, weights)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png", name]
    with Image.open(tmp_path / name) as result:
        assert result.size == size
        params = json.loads(result.text["flowlift"])
        assert _cast(result.convert("RGB"), photo) <= 0.1  # colour and tone pinned at the final size
        assert params["scale"] == float(scale) and params["size"] == list(size) and params["passes"] == passes
    # without stage 2 the random UNet's cast shows: the test can fail
    assert (
        main(
            [
                "upscale",
                str(tmp_path / "a.png"),
                "--scale",
                scale,
                "--no-color-fix",
                "-o",
                str(tmp_path / "raw.png"),
                *_common(shared, weights),
            ]
        )
        == 0
    )
    with Image.open(tmp_path / "raw.png") as raw:
        assert raw.size == size and _cast(raw.convert("RGB"), photo) > 0.5


def test_long_side_and_size_name_the_output_by_its_size(tmp_path, shared, weights, photo):
    photo.save(tmp_path / "a.png")
    assert main(["upscale", str(tmp_path / "a.png"), "--long-side", "120", *_common(shared, weights)]) == 0
    assert main(["upscale", str(tmp_path / "a.png"), "--size", "100x70", *_common(shared, weights)]) == 0
    with Image.open(tmp_path / "a_120x80.png") as long, Image.open(tmp_path / "a_100x70.png") as sized:
        assert long.size == (120, 80) and sized.size == (100, 70)
        assert json.loads(long.text["flowlift"])["long_side"] == 120
        assert json.loads(sized.text["flowlift"])["size"] == [100, 70]
        assert _cast(sized.convert("RGB"), photo) <= 0.1  # a different factor per side: pinned all the same


@pytest.mark.parametrize("scale", ["2", "4", "8"])
def test_powers_of_two_are_the_plain_pipelines_pixels(tmp_path, shared, weights, photo, scale):
    from flowlift.files.images import tensor_to_pil
    from flowlift.upscale.pipeline import FlowUpscalerPipeline

    photo.save(tmp_path / "a.png")
    assert main(["upscale", str(tmp_path / "a.png"), "--scale", scale, *_common(shared, weights)]) == 0
    pipe = FlowUpscalerPipeline(str(weights), str(shared / "models" / "taef2"), device="cpu", dtype=torch.float32)
    plain = tensor_to_pil(pipe.upscale_image(photo, int(scale).bit_length() - 1, seed=0, output_type="pt"))
    with Image.open(tmp_path / f"a_x{scale}.png") as result:
        assert result.size == (48 * int(scale), 32 * int(scale))
        assert result.convert("RGB").tobytes() == plain.tobytes()  # pixel for pixel, no resample
        assert json.loads(result.text["flowlift"])["scale"] == int(scale)


@pytest.mark.parametrize("scale", [2, 4])
def test_a_size_the_passes_make_exactly_is_the_scales_pixels(tmp_path, shared, weights, photo, scale):
    """``--size`` of exactly 2x / 4x the input ran stage 2's resampled path (6 iterations against the input): 1/255
    from ``--scale``; it is the plain path now, pixel for pixel (the name and metadata still say the size)."""
    photo.save(tmp_path / "a.png")
    assert main(["upscale", str(tmp_path / "a.png"), "--scale", str(scale), *_common(shared, weights)]) == 0
    size = f"{48 * scale}x{32 * scale}"
    out = tmp_path / "sized.png"
    assert main(["upscale", str(tmp_path / "a.png"), "--size", size, "-o", str(out), *_common(shared, weights)]) == 0
    with Image.open(tmp_path / f"a_x{scale}.png") as by_scale, Image.open(out) as by_size:
        assert by_size.size == by_scale.size and by_size.tobytes() == by_scale.tobytes()


@pytest.mark.parametrize(
    ("option", "line"),
    [
        (["--scale", "9"], "argument --scale: must be in [1, 8], got '9'"),
        (["--scale", "0.5"], "argument --scale: must be in [1, 8], got '0.5'"),
        (["--size", "40x20"], "--size 40x20 is below the 48x32 input"),
        (["--long-side", "20000"], "--long-side must be an integer in [1, 16384], got 20000"),
        (["--long-side", "40"], "--long-side 40 (40x27) is below the 48x32 input"),
        (["--scale", "1.5", "--size", "90x60"], "not allowed with argument"),
        (["--size", "400x100"], "--size 400x100 is over 8x the 48x32 input"),
        (["--size", "16400x300"], "--size 16400x300 is over the 16384 px cap a side; ask for at most 16384 px a side"),
    ],
)
def test_every_refusal_is_one_line_before_any_work(tmp_path, shared, photo, capsys, option, line):
    photo.save(tmp_path / "a.png")
    missing = tmp_path / "no-such-weights.safetensors"  # the refusal comes before any model is looked for
    try:
        code = main(["upscale", str(tmp_path / "a.png"), *option, "--upscaler", str(missing), "--device", "cpu"])
    except SystemExit as stop:  # the parser's own refusal (exit 2)
        code = stop.code
    err = capsys.readouterr().err
    assert code != 0 and line in err and "Traceback" not in err and str(missing) not in err
    lines = [text for text in err.splitlines() if text.strip()]
    assert len([text for text in lines if line in text]) == 1  # one line per input, as every batch refusal
    assert all(line in text or text.endswith("1 of 1 image(s) failed") for text in lines)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png"]


@pytest.mark.parametrize(
    ("asked", "python", "cli"),
    [
        ({"size": (100000, 100)}, "size 100000x100 is over the 16384 px cap", "--size 100000x100 is over the 16384"),
        ({"long_side": 10}, "long_side 10 (10x10) is below the 64x64 input", "--long-side 10 (10x10) is below"),
        ({"scale": 3}, "scale 3 (30000x192) is over the 16384 px cap a side", "--scale 3 (30000x192) is over"),
    ],
)
def test_a_size_refusal_names_the_field_the_caller_set_never_the_constant(asked, python, cli):
    """The cap was said as ``MAX_OUTPUT_SIDE=16384`` and the request in prose (``long side 10``): the field, in
    the Python words and the command line's (``--long-side 10``), and the cap as its value."""
    from flowlift.errors import FlowliftError
    from flowlift.upscale.asked_size import AskedSize

    width, height = (10000, 64) if "scale" in asked else (64, 64)
    with pytest.raises(FlowliftError) as caught:
        AskedSize(**asked).target(width, height)
    words = {"size": "--size", "long_side": "--long-side", "scale": "--scale"}
    assert python in str(caught.value) and cli in caught.value.worded(words)
    assert "MAX_OUTPUT_SIDE" not in str(caught.value) and caught.value.field == next(iter(asked))


def test_the_python_api_takes_one_size_and_refuses_two():
    from flowlift.upscale.asked_size import AskedSize
    from flowlift.upscale.plan import UpscaleRequest

    assert UpscaleRequest(["a.png"]).asked == AskedSize(scale=2.0)
    assert UpscaleRequest(["a.png"], scale=3).asked.target(1024, 683) == (3072, 2049)
    assert UpscaleRequest(["a.png"], long_side=3840).asked.target(1536, 1024) == (3840, 2560)
    assert UpscaleRequest(["a.png"], size="3840x2560").asked.passes_for(1024, 683) == 2  # 3.75x: two passes
    assert UpscaleRequest(["a.png"], passes=3).asked.power_of_two
    assert not UpscaleRequest(["a.png"], scale=1).asked.power_of_two
    with pytest.raises(FlowliftError, match="give passes or a scale, long_side or size, not both"):
        UpscaleRequest(["a.png"], passes=2, scale=3)
    with pytest.raises(FlowliftError, match="give one of scale, long_side or size, got scale, size"):
        UpscaleRequest(["a.png"], scale=3, size=(10, 10))
    with pytest.raises(FlowliftError, match=r"scale must be in \[1, 8\]"):
        UpscaleRequest(["a.png"], scale=8.5)


def test_output_names_round_trip():
    from flowlift.files.naming import parse_upscaled_stem, source_stem, upscaled_name

    assert upscaled_name("a", 3.0, "png") == "a_x3.png" and upscaled_name("a", 1.5, "jpg") == "a_x1.5.jpg"
    assert upscaled_name("a", (3840, 2560), "png") == "a_3840x2560.png"
    assert parse_upscaled_stem("a_x1.5") == ("a", 1.5) and parse_upscaled_stem("a_3840x2560") == ("a", (3840, 2560))
    assert source_stem("a_x1.5_colorfix") == "a" and parse_upscaled_stem("a_x4") == ("a", 4)
