"""``flowlift upscale --latent-upscaler sesqui:PATH`` (issue 46.3, its upscale half): Flow passes for the powers of
two, SesquiLSR for the fraction in latent space, then the decode and stage 2 against the input at the final size; a
tiny random FLUX.2 VAE (with BN statistics), a tiny Flow Upscaler for 32-channel latents and a random SesquiLSR file
in the released layout. The rule (upscale/latent_fraction.py): SesquiLSR to the smallest even latent size covering
the asked size, the decoded content cropped and resampled to it; 2, 4, 8 run no SesquiLSR and are byte for byte
the run without the option; TAEF2 with the option, a missing file, a side outside [1, 2]: one line, nothing written.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from builders import one_error_line, save_tiny_unet
from flowlift.commands.cli import main
from flowlift.errors import FlowliftError
from sesqui_reference import save_random_sesqui


@pytest.fixture(scope="module")
def sesqui(tmp_path_factory):
    return save_random_sesqui(tmp_path_factory.mktemp("sesqui"))


@pytest.fixture(scope="module")
def flux2_vae(tmp_path_factory):
    """A tiny random FLUX.2 VAE folder (diffusers layout, BN statistics like the real one's)."""
    from tiny_flux2 import tiny_vae

    folder = tmp_path_factory.mktemp("vae") / "vae"
    tiny_vae().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def upscaler(tmp_path_factory):
    """A tiny Flow Upscaler for FLUX.2 latents (cond_dim 32), seed 0."""
    return save_tiny_unet(tmp_path_factory.mktemp("flow") / "flow_upscaler.safetensors", seed=0, cond_dim=32)


@pytest.fixture(scope="module")
def photo(tmp_path_factory):
    """48x32 random RGB (multiples of 16: nothing padded)."""
    path = tmp_path_factory.mktemp("img") / "a.png"
    g = torch.Generator().manual_seed(0)
    Image.fromarray((torch.rand(32, 48, 3, generator=g) * 255).to(torch.uint8).numpy(), "RGB").save(path)
    return path


def _upscale(capsys, photo, out, *options):
    code = main(["upscale", str(photo), "-o", str(out), "--device", "cpu", "--dtype", "float32", *options])
    return code, capsys.readouterr().err


def _models(upscaler, vae):
    return ["--upscaler", str(upscaler), "--vae", str(vae)]


@pytest.mark.parametrize(("scale", "size", "passes"), [("3", (144, 96), 1), ("1.5", (72, 48), 0)])
def test_a_fraction_runs_sesquilsr_after_the_passes_to_exactly_the_asked_size(
    capsys, tmp_path, photo, upscaler, flux2_vae, sesqui, scale, size, passes
):
    out = tmp_path / "x.png"
    code, err = _upscale(
        capsys, photo, out, "--scale", scale, *_models(upscaler, flux2_vae), "--latent-upscaler", f"sesqui:{sesqui}"
    )
    assert code == 0, err
    with Image.open(out) as image:
        assert image.size == size
        meta = json.loads(image.text["flowlift"])
    assert meta["latent_upscaler"] == f"sesqui:{sesqui}" and meta["passes"] == passes and meta["size"] == list(size)
    # its weights recorded as the upscaler's and the VAE's are: by their SHA-256
    assert meta["models"]["latent_upscaler"] == {sesqui.name: hashlib.sha256(sesqui.read_bytes()).hexdigest()}
    assert f"and SesquiLSR ({sesqui.name}, " in err  # the loading line names all three models it loads


@pytest.mark.parametrize(("size", "recorded"), [("96x64", False), ("72x48", True)])
def test_the_metadata_names_sesquilsr_only_where_it_ran(
    capsys, tmp_path, photo, upscaler, flux2_vae, sesqui, size, recorded
):
    # 96x64 is exactly one pass of the 48x32 input: SesquiLSR has nothing to do and the record must not claim it
    out = tmp_path / "x.png"
    options = ("--size", size, "--latent-upscaler", f"sesqui:{sesqui}")
    code, err = _upscale(capsys, photo, out, *_models(upscaler, flux2_vae), *options)
    assert code == 0, err
    with Image.open(out) as image:
        assert image.size == tuple(int(side) for side in size.split("x"))
        meta = json.loads(image.text["flowlift"])
    assert ("latent_upscaler" in meta) is recorded and ("latent_upscaler" in meta["models"]) is recorded


@pytest.mark.parametrize("mode", ["pad", "resample"])
def test_an_input_off_the_16_px_grid_gets_exactly_the_asked_size(capsys, tmp_path, upscaler, flux2_vae, sesqui, mode):
    # 50x30 at 2.5: one pass, then SesquiLSR to the even latent size covering 125x75, cropped and resampled to it
    photo = tmp_path / "odd.png"
    g = torch.Generator().manual_seed(1)
    Image.fromarray((torch.rand(30, 50, 3, generator=g) * 255).to(torch.uint8).numpy(), "RGB").save(photo)
    out = tmp_path / "x.png"
    options = ("--scale", "2.5", "--resize-mode", mode, "--latent-upscaler", f"sesqui:{sesqui}")
    code, err = _upscale(capsys, photo, out, *_models(upscaler, flux2_vae), *options)
    assert code == 0, err
    with Image.open(out) as image:
        assert image.size == (125, 75)
        assert json.loads(image.text["flowlift"])["passes"] == 1


def _by_hand(photo, upscaler, vae_folder, sesqui, passes, latent, content, out_size):
    """Flow passes -> SesquiLSR -> decode -> crop -> resample -> stage 2, composed from the pieces."""
    from flowlift.files.images import to_tensor
    from flowlift.models.sesqui_lsr import load_sesqui_lsr, sesqui_upscale_latents
    from flowlift.upscale.colorfix import lab_lowband_transplant
    from flowlift.upscale.image_steps import RESAMPLED_COLOUR_ITERATIONS
    from flowlift.upscale.pipeline import FlowUpscalerPipeline
    from flowlift.upscale.sizes import resample_to_size

    plain = FlowUpscalerPipeline(str(upscaler), str(vae_folder), device="cpu", dtype=torch.float32)
    image = to_tensor(Image.open(photo).convert("RGB"))
    with torch.inference_mode():
        z = plain.upscale_latents(plain.encode_image(image), passes, seed=0)
        z = sesqui_upscale_latents(load_sesqui_lsr(sesqui), z, latent, plain.vae.bn_mean, plain.vae.bn_std)
        decoded = plain.vae.decode(z).float()[..., : content[0], : content[1]]
        decoded = resample_to_size(decoded, out_size[1], out_size[0])
        return lab_lowband_transplant(decoded, image, 1.0, RESAMPLED_COLOUR_ITERATIONS)


@pytest.mark.parametrize(
    # (output size, passes, SesquiLSR's latent (h, w), the decoded content (h, w)): 3x = one pass (8x12 latents)
    # then 1.5x to 12x18 (144x96 exactly); 1.5x: 4x6 -> 6x10 (the even latent side covering 72 px is 10: 80 px,
    # resampled to 72)
    ("out_size", "passes", "latent", "content"),
    [((144, 96), 1, (12, 18), (96, 144)), ((72, 48), 0, (6, 10), (48, 80))],
)
def test_the_api_equals_the_pieces_composed_by_hand(
    photo, upscaler, flux2_vae, sesqui, out_size, passes, latent, content
):
    from flowlift.upscale.pipeline import FlowUpscalerPipeline

    pipeline = FlowUpscalerPipeline(
        str(upscaler), str(flux2_vae), device="cpu", dtype=torch.float32, latent_upscaler=f"sesqui:{sesqui}"
    )
    result = pipeline.upscale_image(
        Image.open(photo).convert("RGB"), num_passes=passes, output_type="pt", output_size=out_size
    )
    expected = _by_hand(photo, upscaler, flux2_vae, sesqui, passes, latent, content, out_size)
    assert result.shape == expected.shape == (1, 3, out_size[1], out_size[0])
    # float32: the decoded frames agree to ~4e-6; stage 2's six clipped iterations carry that to <= ~7e-5
    assert torch.allclose(result, expected, atol=2e-4, rtol=0), (result - expected).abs().max()
    # and not the pixel resample's result: SesquiLSR ran
    pixel = FlowUpscalerPipeline(str(upscaler), str(flux2_vae), device="cpu", dtype=torch.float32)
    other = pixel.upscale_image(
        Image.open(photo).convert("RGB"), num_passes=passes + 1, output_type="pt", output_size=out_size
    )
    assert (other - result).abs().max() > 1e-3


def test_scale_2_with_the_option_is_byte_for_byte_the_run_without(capsys, tmp_path, photo, upscaler, flux2_vae, sesqui):
    models = _models(upscaler, flux2_vae)
    code, err = _upscale(capsys, photo, tmp_path / "plain.png", "--scale", "2", *models)
    assert code == 0, err
    code, err = _upscale(
        capsys, photo, tmp_path / "with.png", "--scale", "2", *models, "--latent-upscaler", f"sesqui:{sesqui}"
    )
    assert code == 0, err
    assert (tmp_path / "with.png").read_bytes() == (tmp_path / "plain.png").read_bytes()


def test_taef2_with_the_option_is_one_line_and_writes_nothing(capsys, tmp_path, shared, photo, upscaler, sesqui):
    folder = tmp_path / "out"
    folder.mkdir()
    taef2 = shared / "models" / "taef2"
    code, err = _upscale(
        capsys,
        photo,
        folder / "x.png",
        "--scale",
        "3",
        *_models(upscaler, taef2),
        "--latent-upscaler",
        f"sesqui:{sesqui}",
    )
    line = one_error_line(err, "upscale")
    assert code == 2 and line.startswith("flowlift upscale: error: --latent-upscaler: "), err
    assert "BN statistics" in line, err
    assert "set --vae to the FLUX.2 VAE" in line, err  # the fix, in the command line's words
    assert list(folder.iterdir()) == []


def test_a_missing_sesqui_file_is_one_line_pointing_at_the_models_folder(capsys, tmp_path, photo, upscaler, flux2_vae):
    code, err = _upscale(
        capsys,
        photo,
        tmp_path / "x.png",
        "--scale",
        "3",
        *_models(upscaler, flux2_vae),
        "--latent-upscaler",
        f"sesqui:{tmp_path / 'nope.safetensors'}",
    )
    line = one_error_line(err, "upscale")
    assert code == 2 and "models/" in line, err
    assert not (tmp_path / "x.png").exists()


def _refused_before_any_work(capsys, tmp_path, image, sesqui, *options) -> str:
    """The one error line of an upscale with the latent upscaler whose models do not exist: refused at planning (exit
    2, no output), before any weight is looked up."""
    never = ["--upscaler", str(tmp_path / "never.safetensors"), "--vae", str(tmp_path / "never-vae")]
    code, err = _upscale(capsys, image, tmp_path / "x.png", *options, *never, "--latent-upscaler", f"sesqui:{sesqui}")
    line = one_error_line(err, "upscale")
    assert code == 2 and "--latent-upscaler" in line and "never" not in line, err
    assert not (tmp_path / "x.png").exists()
    return line


def test_a_size_that_needs_sesquilsr_outside_1_to_2_is_one_line_before_any_work(capsys, tmp_path, photo, sesqui):
    # 48x32 -> 144x32: 3x wide, 1x high; after one pass the height would need SesquiLSR at 0.5x
    line = _refused_before_any_work(capsys, tmp_path, photo, sesqui, "--size", "144x32")
    assert "outside its [1, 2]" in line


def test_an_input_too_small_for_sesquilsr_is_one_line_before_any_work(capsys, tmp_path, sesqui):
    """A 16x16 input at 1.5x starts SesquiLSR from 2x2 latents, under its 3 a side: refused by the network only after
    the three models had loaded and the VAE had encoded; now at planning, the models never looked up."""
    small = tmp_path / "small.png"
    Image.new("RGB", (16, 16), (90, 120, 30)).save(small)
    line = _refused_before_any_work(capsys, tmp_path, small, sesqui, "--scale", "1.5")
    assert "2x2 latents, under its 3 a side" in line


@pytest.mark.parametrize("scale", ["1", "1.0001"])
def test_the_inputs_own_size_with_the_latent_upscaler_is_one_line_before_any_work(
    capsys, tmp_path, photo, sesqui, scale
):
    """No Flow pass and SesquiLSR at 1x: only the VAE's round trip, written as ``a_x1.0001.png`` with exit 0."""
    line = _refused_before_any_work(capsys, tmp_path, photo, sesqui, "--scale", scale)
    assert "--latent-upscaler: 48x32 is the input's own size" in line


def test_one_knob_for_both_commands_and_the_settings():
    from flowlift.knobs import LATENT_UPSCALER
    from flowlift.upscale.outputs import UpscaleSettings
    from test_knobs import action_of, parser_of

    for command in ("upscale", "hires"):
        action = action_of(parser_of(command), "--latent-upscaler")
        assert action.default is None and action.type("sesqui:a.safetensors") == "sesqui:a.safetensors"
        assert action.type.__name__ == LATENT_UPSCALER.name
    assert UpscaleSettings(latent_upscaler="sesqui:a.safetensors").latent_upscaler == "sesqui:a.safetensors"
    with pytest.raises(FlowliftError, match="latent_upscaler must be sesqui:PATH") as caught:
        UpscaleSettings(latent_upscaler="bicubic")
    assert caught.value.field == "latent_upscaler"


@pytest.mark.parametrize("scale", [1.0, 1.01, 1.5, 1.99, 2.01, 3.0, 3.75, 5.5, 6.0, 7.9, 8.0])
@pytest.mark.parametrize("mode", ["pad", "resample"])
def test_the_fraction_left_to_sesquilsr_is_within_1_to_2_by_construction(scale, mode):
    """Any scale, any input size, either resize mode: the planned passes leave each side 1-2x to SesquiLSR
    (fraction_passes raises its one line otherwise), on an even latent grid whose decoded frame covers the size.
    A size that leaves SesquiLSR nothing after no pass (the input's own: 1x, or 1.01 of 1x1) is refused, and so are
    latents under SesquiLSR's 3 a side, before any work."""
    from flowlift.upscale.asked_size import AskedSize
    from flowlift.upscale.latent_fraction import fraction_passes, fraction_plan
    from flowlift.upscale.sizes import prepared_size

    asked = AskedSize(scale=scale)
    for width, height in [(48, 32), (33, 17), (100, 7), (1, 1), (1000, 999), (31, 1), (2000, 1500)]:
        out = asked.target(width, height)
        if mode == "resample" and min(width, height) < 16:  # a canvas of 16 px for 7: its aspect is not the input's
            try:
                fraction_passes(height, width, mode, out)
            except FlowliftError as error:
                assert error.field == "latent_upscaler"
            continue
        try:
            passes = fraction_passes(height, width, mode, out)
        except FlowliftError as error:  # the passes' latents under SesquiLSR's 3 a side (a canvas under 24 px), or
            # no model at all: the input's own size
            own = out == (width, height) and "is the input's own size" in str(error)
            small = "a side; give a larger image" in str(error) and min(width, height) < 24
            assert own or small, str(error)
            continue
        assert 2**passes <= scale * 1.5 and 2 ** (passes + 1) >= scale / 1.5  # the passes that reach it, less one
        prepared = prepared_size(height, width, mode)
        plan = fraction_plan(prepared, (height, width) if mode == "pad" else prepared, passes, out)
        if plan is not None:
            latent, content = plan
            assert all(
                0 <= c - o < 16 if mode == "pad" else abs(c - o) <= 16 for c, o in zip(content, out[::-1], strict=True)
            )
            assert all(side % 2 == 0 for side in latent)
            factors = [t / (p * 2**passes / 8) for t, p in zip(latent, prepared, strict=True)]
            assert all(1 <= factor <= 2 for factor in factors)


def test_the_app_offers_sesquilsr_and_writes_what_the_command_writes(
    capsys, tmp_path, shared, photo, upscaler, flux2_vae, sesqui, monkeypatch
):
    """issue 46.3 at the web app: started with ``--latent-upscaler``, a request that asks for it (the Upscale and Batch
    tabs' box, the API's ``latent_upscaler``) writes the file ``flowlift upscale --latent-upscaler`` writes, pixels
    and metadata; without it the same scale is the pixel resample. TAEF2, a non-boolean, or a request for it on an
    app started without the option: one line each."""
    from flowlift.app.results import first_line
    from flowlift.app.service import AppConfig, AppService

    spec = f"sesqui:{sesqui}"
    taef2 = str(shared / "models" / "taef2")
    vaes = [str(flux2_vae), taef2]
    config = AppConfig(
        str(upscaler), vaes, device="cpu", dtype="float32", work_dir=tmp_path / "w", latent_upscaler=spec
    )
    import flowlift.files.image_outputs as image_outputs

    hashed: list[str] = []
    real_sha256 = image_outputs.file_sha256
    monkeypatch.setattr(image_outputs, "file_sha256", lambda path: hashed.append(Path(path).name) or real_sha256(path))
    service = AppService(config)
    try:
        latent = service.upscale(photo, 3, 4, 1.0, 1.0, str(flux2_vae), True)
        pixels = service.upscale(photo, 3, 4, 1.0, 1.0, str(flux2_vae), False)
        # the two pipelines share the UNet's and the VAE's files: each weight file is read for its hash once
        weights = [name for name in hashed if name.endswith(".safetensors")]
        assert sorted(weights) == sorted(set(weights)) and {upscaler.name, sesqui.name} <= set(weights)
        monkeypatch.undo()
        code, err = _upscale(
            capsys, photo, tmp_path / "cli.png", "--scale", "3", "--seed", "4", *_models(upscaler, flux2_vae)
        )
        assert code == 0, err
        code, err = _upscale(
            capsys,
            photo,
            tmp_path / "cli_sesqui.png",
            "--scale",
            "3",
            "--seed",
            "4",
            "--latent-upscaler",
            spec,
            *_models(upscaler, flux2_vae),
        )
        assert code == 0, err
        for result, cli in ((latent, "cli_sesqui.png"), (pixels, "cli.png")):
            with Image.open(result.output) as app_png, Image.open(tmp_path / cli) as cli_png:
                assert app_png.size == (144, 96) and app_png.tobytes() == cli_png.tobytes()
                assert app_png.text == cli_png.text
        with Image.open(latent.output) as a, Image.open(pixels.output) as b:
            assert a.tobytes() != b.tobytes() and json.loads(a.text["flowlift"])["latent_upscaler"] == spec
        with pytest.raises(FlowliftError, match=r"latent_upscaler: .*FLUX\.2 VAE") as refused:
            service.upscale(photo, 3, 4, 1.0, 1.0, taef2, True)
        shown = first_line(refused.value)  # the page's line names the fields as the page does
        assert shown.startswith("latent upscaler: ") and "set VAE to the FLUX.2 VAE" in shown, shown
        with pytest.raises(FlowliftError, match="latent upscaler must be true or false, got 'false'"):
            service.batch([photo], 3, 4, 1.0, 1.0, str(flux2_vae), "false")
    finally:
        service.close()
    plain = AppService(AppConfig(str(upscaler), vaes, device="cpu", work_dir=tmp_path / "p"))
    try:
        with pytest.raises(FlowliftError, match="start the app with --latent-upscaler sesqui:PATH"):
            plain.upscale(photo, 3, 4, 1.0, 1.0, str(flux2_vae), True)
    finally:
        plain.close()
