"""``flowlift hires --scale 1.5 / 3 --latent-upscaler sesqui:PATH`` (issue 46.3): Flow passes for the powers of
two, SesquiLSR for the fraction in latent space, on a tiny FLUX.2 model and a random SesquiLSR file in the
released layout; without the option, a fractional scale is one line naming it."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from flowlift.errors import FlowliftError
from sesqui_reference import save_random_sesqui
from test_cli_refine import _run, embeds_file, tiny_model, upscaler  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def sesqui(tmp_path_factory):
    return save_random_sesqui(tmp_path_factory.mktemp("sesqui"))


@pytest.fixture(scope="module")
def square(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "square.png"
    g = torch.Generator().manual_seed(0)
    Image.fromarray((torch.rand(64, 64, 3, generator=g) * 255).to(torch.uint8).numpy(), "RGB").save(path)
    return path


@pytest.mark.parametrize(("scale", "side", "passes"), [("1.5", 96, 0), ("3", 192, 1)])
def test_hires_fractional_scale_runs_flow_passes_then_sesquilsr(
    capsys,
    tmp_path,
    tiny_model,  # noqa: F811  (the fixtures imported from test_cli_refine)
    upscaler,  # noqa: F811
    sesqui,
    square,
    scale,
    side,
    passes,
):
    out = tmp_path / "hires.png"
    hires = {"image": square, "scale": scale, "upscaler": upscaler, "latent_upscaler": f"sesqui:{sesqui}"}
    code, _, err = _run(capsys, "hires", **hires, **tiny_model, steps="2", o=out)
    assert code == 0, err
    with Image.open(out) as image:
        assert image.size == (side, side)
        meta = json.loads(image.text["flowlift"])
    assert meta["scale"] == float(scale) and meta["passes"] == passes
    assert meta["latent_upscaler"] == f"sesqui:{sesqui}"


def test_hires_fractional_scale_without_the_option_is_one_line(capsys, tmp_path, square):
    never = {"model": tmp_path / "never-loaded", "prompt": "p"}
    code, _, err = _run(capsys, "hires", image=square, scale="1.5", **never, o=tmp_path / "x.png")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "--scale 1.5 is not a whole number of 2x passes" in err and "--latent-upscaler sesqui:PATH" in err
    assert not (tmp_path / "x.png").exists()


def test_hires_passes_and_sizes_follow_the_one_rule():
    from flowlift.limits import hires_latent_size
    from flowlift.refine.request import HiresSettings
    from flowlift.upscale.latent_source import FlowUpscalerSource

    source = FlowUpscalerSource(latent_upscaler="sesqui:x.safetensors")
    assert [HiresSettings(upscaler=source, scale=s).passes for s in (1.5, 2, 3, 4, 6, 8)] == [0, 1, 1, 2, 2, 3]
    assert [HiresSettings(scale=s).passes for s in (2, 4, 8)] == [1, 2, 3]  # no option needed for whole passes
    assert hires_latent_size(128, 126, 1.5) == (192, 190) and hires_latent_size(126, 64, 3) == (378, 192)
    assert hires_latent_size(128, 64, 4) == (512, 256)
    with pytest.raises(FlowliftError, match="latent_upscaler must be sesqui:PATH"):
        FlowUpscalerSource(latent_upscaler="bicubic")


def test_hires_says_when_the_grid_changes_its_size_and_refuses_no_enlargement(
    capsys,
    tmp_path,
    tiny_model,  # noqa: F811
    upscaler,  # noqa: F811
    sesqui,
):
    """1.5x of 64x48 came out 96x80 (not 96x72) and 1.1x came out 64x48 named _hires1.1x, both without a word."""
    photo = tmp_path / "wide.png"
    g = torch.Generator().manual_seed(1)
    Image.fromarray((torch.rand(48, 64, 3, generator=g) * 255).to(torch.uint8).numpy(), "RGB").save(photo)
    hires = {"image": photo, "upscaler": upscaler, "latent_upscaler": f"sesqui:{sesqui}"}
    code, _, err = _run(capsys, "hires", **hires, scale="1.1", **tiny_model, steps="2", o=tmp_path / "no.png")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "hires at 1.1x of a 64x48 base is 64x48 on the 16 px grid" in err and "at least 1.167" in err
    assert not (tmp_path / "no.png").exists()
    out = tmp_path / "grid.png"
    code, _, err = _run(capsys, "hires", **hires, scale="1.5", **tiny_model, steps="2", o=out)
    assert code == 0, err
    assert "hires at 1.5x of 64x48 is 96x72, off the 16 px grid the refine needs: the image is 96x80" in err
    with Image.open(out) as image:
        assert image.size == (96, 80)
