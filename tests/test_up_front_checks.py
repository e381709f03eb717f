"""What was checked late or not at all (issue 36, class 5): the hires fix's whole pass plan, ``--device cpu:N``,
``eval --tile`` without a spandrel method, ``flowlift app``'s device and host. Each is one line and exit 2 before
any model loads or any server starts."""

from __future__ import annotations

import pytest
from PIL import Image

from flowlift.commands.cli import main
from flowlift.errors import FlowliftError


def _one_line(capsys, argv) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.splitlines() == [err] and "Traceback" not in err, (code, err)
    return err


# ------------------------------------------------------------------------------------------ hires: the pass plan


@pytest.mark.parametrize(("width", "height", "scale"), [
    (16400, 16, 2), (16384, 16, 2), (16, 16384, 2), (8208, 16, 2), (4112, 64, 4), (2064, 16, 8), (16, 2064, 8),
    (32768, 32768, 2),
])  # fmt: skip
def test_hires_txt2img_past_the_cap_is_refused_before_loading(capsys, tmp_path, width, height, scale):
    err = _one_line(capsys, ["hires", "--width", width, "--height", height, "--scale", scale, "--prompt", "p",
                             "--model", tmp_path / "never-loaded", "-o", tmp_path / "x.png"])  # fmt: skip
    assert "MAX_OUTPUT_SIDE=16384" in err and "never-loaded" not in err, err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(("size", "scale", "hint"), [((2064, 16), 8, "at most 4"), ((16, 8208), 2, "at most 8192"),
                                                     ((4112, 16), 4, "at most 2")])  # fmt: skip
def test_hires_image_past_the_cap_is_refused_before_loading(capsys, tmp_path, size, scale, hint):
    image = tmp_path / "strip.png"
    Image.new("RGB", size, (90, 40, 20)).save(image)
    err = _one_line(capsys, ["hires", "--image", image, "--scale", scale, "--prompt", "p",
                             "--model", tmp_path / "never-loaded", "-o", tmp_path / "x.png"])  # fmt: skip
    assert f"{size[0]}x{size[1]} base" in err and hint in err, err


@pytest.mark.parametrize(("width", "height", "scale"), [(8192, 16, 2), (16, 4096, 4), (2048, 2048, 8), (16, 16, 8)])
def test_hires_sizes_at_the_cap_pass_the_plan(width, height, scale):
    from flowlift.refine.settings import check_hires_size

    check_hires_size(width, height, scale)


@pytest.mark.parametrize(("width", "height", "scale"), [(0, 16, 2), (8, 16, 2), (24, 16, 2), (16, 16, 3), (16, 16, 1)])
def test_hires_plan_refuses_bad_sides_and_scales(width, height, scale):
    from flowlift.refine.settings import check_hires_size

    with pytest.raises(FlowliftError):
        check_hires_size(width, height, scale)


def test_the_python_api_checks_the_plan_before_the_base_runs():
    from flowlift.refine.refiner import Flux2Refiner

    class NoModels(Flux2Refiner):
        def __init__(self):  # nothing loaded: the plan must be refused before anything would run
            pass

    def never(latents):
        raise AssertionError("the upscaler ran")

    with pytest.raises(FlowliftError, match="over MAX_OUTPUT_SIDE"):
        NoModels().hires(never, height=16, width=2064, scale=8)
