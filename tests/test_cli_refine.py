"""``flowlift img2img`` and ``flowlift hires`` end to end on a tiny diffusers-layout FLUX.2 folder."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from builders import command_line, save_tiny_unet
from flowlift.commands.cli import main
from tiny_flux2 import prompt_embeds, write_model_dir

W, H = 64, 48


@pytest.fixture(scope="module")
def embeds_file(tmp_path_factory):
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("emb") / "prompt.safetensors"
    save_file({"prompt_embeds": prompt_embeds(), "negative_prompt_embeds": prompt_embeds(3, seed=9)}, str(path))
    return path


@pytest.fixture(scope="module")
def photo(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "photo.png"
    g = torch.Generator().manual_seed(0)
    array = (torch.rand(H, W, 3, generator=g) * 255).to(torch.uint8).numpy()
    Image.fromarray(array, "RGB").save(path)
    return path


@pytest.fixture(scope="module")
def tiny_model(model_dir, embeds_file):
    """The options that point a refine command at the tiny model folder and its prompt embeddings."""
    return {"model": model_dir, "prompt_embeds": embeds_file}


@pytest.fixture(scope="module")
def upscaler(tmp_path_factory):
    """A tiny Flow Upscaler for FLUX.2 latents (cond_dim 32), seed 0."""
    return save_tiny_unet(tmp_path_factory.mktemp("flow") / "flow_upscaler.safetensors", seed=0, cond_dim=32)


@pytest.fixture(scope="module")
def square_photo(tmp_path_factory, photo):
    """:func:`photo` resized to 64x64."""
    path = tmp_path_factory.mktemp("square") / "square.png"
    Image.open(photo).resize((64, 64)).save(path)
    return path


def _run(capsys, *words, **options):
    """``flowlift`` with :func:`~builders.command_line`'s words and options: (exit code, stdout, stderr)."""
    code = main(command_line(*words, **options))
    out = capsys.readouterr()
    return code, out.out, out.err


def _metadata(path):
    with Image.open(path) as img:
        return json.loads(img.text["flowlift"])


def test_img2img_writes_png_with_all_parameters(capsys, tmp_path, model_dir, tiny_model, photo):
    out = tmp_path / "out.png"
    sampling = {"strength": "0.6", "steps": "6", "seed": "7", "sampler": "heun"}
    code, stdout, stderr = _run(
        capsys, "img2img", photo, **tiny_model, prompt="a cat", **sampling, progress=True, o=out
    )
    assert code == 0, stderr
    assert "img2img" in stderr and "step" in stderr  # the per-step progress bar, forced with --progress
    with Image.open(out) as img:
        assert img.size == (W, H)
    meta = _metadata(out)
    for key, value in {
        "command": "img2img",
        "mode": "img2img",
        "strength": 0.6,
        "strength_map": "linear",
        "steps": 6,
        "seed": 7,
        "sampler": "heun",
        "prompt": "a cat",
        "cfg_scale": 1.0,
        "model": str(model_dir),
        "dtype": "float32",  # what ran, not "auto"
        "device": "cpu",
        "mu": 2.02,  # the schedule's defaults
        "mu_rule": "fixed",
        "schedule": "respaced",
    }.items():
        assert meta[key] == value, key
    assert meta["denoising_start"] == pytest.approx(0.4) and meta["t0"] == pytest.approx(0.6)
    assert meta["sigmas"][0] == pytest.approx(0.6) and meta["sigmas"][-1] == 0.0
    assert len(meta["sigmas"]) == 6 + 1  # respaced: every step runs in the window
    assert len(meta["input_sha256"]) == 64 and len(meta["prompt_embeds_sha256"]) == 64


def test_same_seed_same_output_and_cfg(capsys, tmp_path, tiny_model, photo):
    outs = []
    for i, extra in enumerate(({}, {}, {"cfg_scale": "3"})):
        out = tmp_path / f"o{i}.png"
        code, _, err = _run(capsys, "img2img", photo, **tiny_model, steps="4", no_progress=True, o=out, **extra)
        assert code == 0, err
        outs.append(Image.open(out).tobytes())
    assert outs[0] == outs[1] and outs[0] != outs[2]
    assert _metadata(tmp_path / "o2.png")["cfg_scale"] == 3.0


def test_inpaint_and_outpaint(capsys, tmp_path, tiny_model, photo):
    mask = tmp_path / "mask.png"
    m = Image.new("L", (W, H), 0)
    m.paste(255, (16, 16, 48, 32))
    m.save(mask)
    out = tmp_path / "inpaint.png"
    code, _, err = _run(
        capsys, "img2img", photo, mask=mask, strength="1", **tiny_model, steps="3", no_progress=True, o=out
    )
    assert code == 0, err
    meta = _metadata(out)
    assert meta["mode"] == "inpaint" and meta["mask"] == str(mask)
    out = tmp_path / "outpaint.png"
    code, _, err = _run(
        capsys, "img2img", photo, outpaint="16,0,10,0", **tiny_model, steps="3", no_progress=True, o=out
    )
    assert code == 0, err
    with Image.open(out) as img:
        assert img.size == (W + 32, H)
    meta = _metadata(out)
    assert meta["mode"] == "outpaint" and meta["strength"] == 1.0 and (meta["left"], meta["right"]) == (16, 16)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["missing.png"], "missing.png"),
        (["{photo}", "--outpaint", "1,2"], "--outpaint"),
        (["{photo}", "--mask", "{photo}", "--outpaint", "0,0,16,0"], "exclusive"),
        (["{photo}", "--guidance", "3.5"], "no guidance embedding"),
        (["{photo}", "--prompt-embeds", "nowhere.safetensors"], "file not found"),
        (["{photo}", "-o", "{tmp}/out.xyz"], "unsupported image format"),
        (["{photo}", "-o", "{tmp}/notes.txt"], "unsupported image format .txt: give a file name ending .png, .jpg"),
        (["{photo}", "-o", "{tmp}/x.gif"], "unsupported image format .gif: give a file name ending .png"),  # read only
        (["{photo}", "-o", "{tmp}"], "--output {tmp} is a folder: give a file name ending .png, .jpg, .jpeg, .webp"),
        (["{photo}", "--outpaint", "0,0,16,0", "--strength", "0"], "paints nothing into the new border"),
        (["{photo}", "--mask", "{tmp}/alpha_mask.png"], "mask has transparent pixels"),
        (["{photo}", "--mask", "{tmp}/red_mask.png"], "mask is coloured"),
        (["{photo}", "--mask", "{tmp}/small_mask.png"], "give a mask of the image's size"),
        # a file that is no image is named by the option that gave it (the reader knows only the path)
        (["{photo}", "--mask", "{tmp}/junk.png"], "error: --mask {tmp}/junk.png: not an image file"),
        (["{photo}", "--reference", "{tmp}/junk.png"], "error: --reference {tmp}/junk.png: not an image file"),
        # a folder where a file is expected is said so, with what to give (it was "no such file")
        (["{tmp}"], "error: {tmp} is a folder: give an image file"),
        (["{photo}", "--mask", "{tmp}"], "error: --mask {tmp} is a folder: give an image file"),
        (["{photo}", "--reference", "{tmp}"], "error: --reference {tmp} is a folder: give an image file"),
        (["{photo}", "--lora", "{tmp}"], "error: --lora {tmp} is a folder: give a LoRA .safetensors file"),
        (["{photo}", "--prompt-embeds", "{tmp}"], "error: --prompt-embeds: {tmp} is a folder: give a .safetensors"),
    ],
)
def test_bad_inputs_one_line_no_output(capsys, tmp_path, model_dir, embeds_file, photo, argv, message):
    argv = [a.format(photo=photo, tmp=tmp_path) for a in argv]
    message = message.format(tmp=tmp_path)
    (tmp_path / "junk.png").write_bytes(b"junk")
    region = Image.new("L", (W, H), 0)
    region.paste(255, (8, 8, 32, 32))
    alpha_mask = Image.new("RGBA", (W, H), (255, 255, 255, 0))  # white everywhere, the region in alpha only
    alpha_mask.putalpha(region)
    alpha_mask.save(tmp_path / "alpha_mask.png")  # would have regenerated the whole image
    Image.merge("RGB", (region, Image.new("L", (W, H)), Image.new("L", (W, H)))).save(tmp_path / "red_mask.png")
    region.resize((W + 1, H)).save(tmp_path / "small_mask.png")
    if "--prompt-embeds" not in argv:
        argv += ["--prompt-embeds", str(embeds_file)]
    before = set(tmp_path.iterdir())
    never = None if "-o" in argv else tmp_path / "never.png"
    code, _, err = _run(capsys, "img2img", *argv, model=model_dir, steps="2", no_progress=True, o=never)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert set(tmp_path.iterdir()) == before


def test_an_image_flowlift_did_not_write_is_replaced_only_with_overwrite(
    capsys, tmp_path, model_dir, embeds_file, photo
):
    """Issue 22.1 in the refine commands: -o naming a user's picture is one line (exit 2), before any model
    loads; flowlift's own earlier result is replaced as before; --overwrite replaces the user's too."""
    mine = tmp_path / "mine.png"
    Image.new("RGB", (5, 5), (1, 2, 3)).save(mine)
    kept = mine.read_bytes()
    argv = ["img2img", photo, "--model", model_dir, "--prompt-embeds", embeds_file, "--steps", "1", "--no-progress"]
    for command in (argv, ["hires", "--image", photo, *argv[2:]]):
        code, _, err = _run(capsys, *command, "-o", mine)
        assert code == 2 and "was not written by flowlift; use --overwrite" in err
        assert len(err.strip().splitlines()) == 1
        assert mine.read_bytes() == kept
    assert _run(capsys, *argv, "-o", mine, "--overwrite")[0] == 0
    assert _run(capsys, *argv, "-o", mine)[0] == 0  # now it is flowlift's own result: replaced without asking
    assert _metadata(mine)["mode"] == "img2img"


def test_prompt_text_needs_text_encoder_or_embeds(capsys, tmp_path, model_dir, photo):
    code, _, err = _run(capsys, "img2img", photo, "--model", model_dir, "--no-progress", "-o", tmp_path / "x.png")
    assert code == 2 and "--prompt" in err
    # a text prompt without embeddings needs the pipeline's text encoder, which this folder lacks
    code, _, err = _run(
        capsys, "img2img", photo, "--model", model_dir, "--prompt", "a cat", "--no-progress", "-o", tmp_path / "x.png"
    )
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "flowlift[text]" in err or "text encoder" in err
    assert not (tmp_path / "x.png").exists()


def test_bad_model_is_one_line(capsys, tmp_path, embeds_file, photo):
    code, _, err = _run(
        capsys, "img2img", photo, model=tmp_path, prompt_embeds=embeds_file, no_progress=True, o=tmp_path / "x.png"
    )
    assert code == 2 and "FLUX.2 transformer" in err and len(err.strip().splitlines()) == 1


def test_argument_choices_mirror_the_api():
    from flowlift.commands import img2img
    from flowlift.flux2 import schedule
    from flowlift.flux2.sampling import SAMPLERS
    from flowlift.refine.loop import STRENGTH_MAPS

    assert img2img.SAMPLERS == SAMPLERS and img2img.STRENGTH_MAPS == STRENGTH_MAPS
    assert img2img.SCHEDULES == schedule.SCHEDULES and img2img.MU_RANGE == schedule.MU_RANGE
    assert img2img.DEFAULT_MU == schedule.DEFAULT_MU


def test_mu_and_schedule_options(capsys, tmp_path, model_dir, embeds_file, photo):
    from flowlift.flux2.schedule import compute_empirical_mu, flux2_sigmas

    out = tmp_path / "empirical.png"
    argv = ["img2img", photo, "--model", model_dir, "--prompt-embeds", embeds_file, "--steps", "9", "--no-progress"]
    code, _, err = _run(capsys, *argv, "--strength", "0.5", "--mu", "empirical", "--schedule", "clipped", "-o", out)
    assert code == 0, err
    meta = _metadata(out)
    seq = (H // 16) * (W // 16)
    assert (meta["mu_rule"], meta["schedule"]) == ("empirical", "clipped")
    assert meta["mu"] == pytest.approx(compute_empirical_mu(seq, 9), abs=1e-6)
    expected = flux2_sigmas(9, seq, 0.5, mu="empirical", schedule="clipped").tolist()
    assert meta["sigmas"] == pytest.approx(expected, abs=1e-6) and len(expected) < 10
    code, _, err = _run(capsys, *argv, "--strength", "0.5", "--mu", "3.5", "-o", out)
    assert code == 0, err
    meta = _metadata(out)
    assert (meta["mu"], meta["mu_rule"], meta["schedule"]) == (3.5, "fixed", "respaced") and len(meta["sigmas"]) == 10
    for bad, message in [
        ("-1", "must be in [0, 15]"),
        ("15.5", "must be in [0, 15]"),
        ("auto", "must be in [0, 15] or empirical, got 'auto'"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main([str(a) for a in argv] + ["--mu", bad])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(a) for a in argv] + ["--schedule", "linear"])
    assert "invalid choice" in capsys.readouterr().err


def test_empirical_mu_out_of_range_is_refused_before_loading(capsys, tmp_path, embeds_file, photo):
    """hires 4x of a 2048 px base refines at 8192 px, where diffusers' formula gives mu 44.8."""
    base = {"width": "2048", "height": "2048", "scale": "4", "mu": "empirical"}
    never = {"model": tmp_path / "never-loaded", "prompt_embeds": embeds_file}
    code, _, err = _run(capsys, "hires", **base, **never, no_progress=True, o=tmp_path / "x.png")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--mu: mu='empirical' gives 44.8" in err and "8192x8192" in err


def test_hires_from_image_and_from_txt2img(capsys, tmp_path, tiny_model, upscaler, square_photo):
    out = tmp_path / "hires.png"
    hires = {"image": square_photo, "scale": "2", "upscaler": upscaler}
    code, _, err = _run(capsys, "hires", **hires, refine_strength="0.4", **tiny_model, steps="8", o=out)
    assert code == 0, err
    with Image.open(out) as img:
        assert img.size == (128, 128)
    meta = _metadata(out)
    assert meta["command"] == "hires" and meta["scale"] == 2 and meta["refine_strength"] == 0.4
    assert meta["sigmas"][0] == pytest.approx(0.4) and meta["base"] == "image"
    out = tmp_path / "gen.png"
    base = {"width": "64", "height": "64", "base_steps": "2", "scale": "4", "upscaler": upscaler}
    code, _, err = _run(capsys, "hires", **base, **tiny_model, steps="4", no_progress=True, o=out)
    assert code == 0, err
    with Image.open(out) as img:
        assert img.size == (256, 256)
    assert _metadata(out)["base"] == "txt2img"


def test_alpha_channel_is_kept(capsys, tmp_path, tiny_model, photo):
    rgba = tmp_path / "rgba.png"
    img = Image.open(photo).convert("RGBA")
    img.putalpha(Image.new("L", img.size, 128))
    img.save(rgba)
    out = tmp_path / "rgba_out.png"
    code, _, err = _run(capsys, "img2img", rgba, **tiny_model, steps="2", no_progress=True, o=out)
    assert code == 0, err
    with Image.open(out) as result:
        assert result.mode == "RGBA" and result.getchannel("A").getextrema() == (128, 128)


def test_tile_options_in_every_mode_and_the_metadata(capsys, tmp_path, model_dir, embeds_file, photo):
    base = ["img2img", photo, "--model", model_dir, "--prompt-embeds", embeds_file, "--steps", "2", "--no-progress"]
    tiles = ["--tile-size", "32", "--tile-overlap", "16"]
    grey = tmp_path / "grey_mask.png"
    Image.open(photo).convert("L").save(grey)  # a soft mask of every grey level (a coloured one is refused)
    runs = {
        "default": [],
        "img2img": [*tiles, "--tile-batch", "2"],
        "outpaint": [*tiles, "--outpaint", "0,0,16,0"],
        "inpaint": [*tiles, "--mask", grey],
    }
    meta = {}
    for name, extra in runs.items():
        out = tmp_path / f"{name}.png"
        code, _, err = _run(capsys, *base, *extra, "-o", out)
        assert code == 0, err
        meta[name] = _metadata(out)
    assert meta["default"]["tile_size"] == "auto" and "tiles" not in meta["default"]  # 64x48: one call
    assert meta["img2img"]["tiles"] == {"size": [32, 32], "overlap": 16, "grid": [2, 3], "batch": 2}
    assert meta["outpaint"]["mode"] == "outpaint" and meta["outpaint"]["tiles"]["grid"] == [2, 4]  # 80x48 canvas
    assert meta["inpaint"]["mode"] == "inpaint" and meta["inpaint"]["tiles"]["grid"] == [2, 3]
    never = ["img2img", photo, "--model", tmp_path / "never-loaded", "--prompt-embeds", embeds_file]
    code, _, err = _run(capsys, *never, "--tile-size", "64", "--tile-overlap", "64", "-o", tmp_path / "x.png")
    assert code == 2 and "must be smaller than the tile (64 px)" in err and len(err.strip().splitlines()) == 1
    code, _, err = _run(capsys, *never, "--tile-size", "32", "-o", tmp_path / "x.png")  # only the tile given
    assert (
        code == 2
        and len(err.strip().splitlines()) == 1
        and err.strip().endswith(
            "--tile-size 32 px must be larger than the tile overlap (--tile-overlap, 128 px by default); give a "
            "--tile-size above 128 or a smaller --tile-overlap"
        )
    ), err
    for extra, message in [
        (["--tile-size", "40"], "argument --tile-size: tile size must be a multiple of 16"),
        (["--tile-overlap", "8"], "argument --tile-overlap: tile overlap must be a multiple of 16"),
        (["--tile-batch", "0"], "argument --tile-batch: tile batch must be an integer >= 1 or auto"),
    ]:
        with pytest.raises(SystemExit) as exit_info:  # argparse: one error line, exit 2
            main([str(a) for a in [*never, *extra, "-o", tmp_path / "x.png"]])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "x.png").exists()


def test_hires_scale_8_refines_in_tiles(capsys, tmp_path, tiny_model, upscaler, square_photo):
    out = tmp_path / "hires8.png"
    hires = {"image": square_photo, "scale": "8", "upscaler": upscaler}
    tiles = {"tile_size": "256", "tile_overlap": "64"}
    code, _, err = _run(capsys, "hires", **hires, **tiny_model, steps="2", **tiles, no_progress=True, o=out)
    assert code == 0, err
    with Image.open(out) as img:
        assert img.size == (512, 512)
    meta = _metadata(out)
    assert meta["scale"] == 8 and meta["tiles"] == {"size": [256, 256], "overlap": 64, "grid": [3, 3], "batch": 1}


def test_steps_follow_the_model(capsys, tmp_path, embeds_file, photo, monkeypatch):
    """Issue 39: ``--steps`` left out is the model's: 4 for a step-distilled Klein (its model_index.json says
    ``is_distilled``, or a Klein file name without ``base``), 28 for base and dev; the metadata says which."""
    from flowlift.refine.loading import model_default_steps

    distilled = write_model_dir(tmp_path / "klein")
    index = json.loads((distilled / "model_index.json").read_text())
    (distilled / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    assert model_default_steps(str(distilled))[0] == 4
    assert model_default_steps(str(tmp_path / "nowhere"), "flux-2-klein-4b.safetensors")[0] == 4
    assert model_default_steps(str(tmp_path / "nowhere"), "flux-2-klein-base-4b.safetensors")[0] == 28
    assert model_default_steps("black-forest-labs/FLUX.2-dev-not-cached")[0] == 28
    # a hub id read from the Hugging Face cache (its model_index.json, through models.hub.cached_file)
    import huggingface_hub.constants as hub_constants

    from builders import fake_hub_cache

    fake_hub_cache(
        tmp_path / "hub", "owner/klein-cached", {"model_index.json": json.dumps({"is_distilled": True}).encode()}
    )
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert model_default_steps("owner/klein-cached")[0] == 4
    out = tmp_path / "out.png"
    code, _, err = _run(capsys, "img2img", photo, "--model", distilled, "--prompt-embeds", embeds_file, "-o", out)
    assert code == 0, err
    meta = _metadata(out)
    assert meta["steps"] == 4 and meta["default_steps"] == "4 (model_index.json: is_distilled)"
    code, _, err = _run(
        capsys, "img2img", photo, "--model", distilled, "--prompt-embeds", embeds_file, "--steps", "2", "-o", out
    )
    assert code == 0, err
    assert _metadata(out)["steps"] == 2
    with pytest.raises(SystemExit):
        main(["img2img", "--help"])
    assert "the model's: 4 for a step-distilled Klein" in " ".join(capsys.readouterr().out.split())


def test_a_local_folder_without_a_text_encoder_is_refused_before_the_transformer_loads(
    capsys, tmp_path, model_dir, photo, monkeypatch
):
    """Issue 48: ``--prompt`` with a local folder holding transformer/ and vae/ only failed after the transformer
    had loaded (131 s), in diffusers' words cut at 200 characters mid-word, naming no fix. Now it is one line before
    any weights load, naming the folder, the missing part and the two ways out."""
    pytest.importorskip("transformers")  # without the text extra, the extra is what is named (up front too)
    from flowlift.refine import loading

    def never(*_args, **_kwargs):
        raise AssertionError("the transformer loaded before the missing text encoder was named")

    monkeypatch.setattr(loading, "load_transformer", never)
    code, _, err = _run(capsys, "img2img", photo, "--model", model_dir, "--prompt", "a cat", "-o", tmp_path / "x.png")
    (line,) = err.strip().splitlines()
    assert code == 2 and line.startswith(f"flowlift img2img: error: --model {model_dir}: --prompt needs the model's ")
    assert "no text_encoder/" in line and "tokenizer/" in line and line.endswith("or pass precomputed --prompt-embeds")
    assert not (tmp_path / "x.png").exists()


def test_an_upstream_message_is_never_cut_inside_a_word():
    from flowlift.refine.prompts import UPSTREAM_WORDS_MAX, _first_line

    words = " ".join(f"word{i:03d}" for i in range(100))  # 799 characters of whole words
    line = _first_line(ValueError(words + "\nsecond line"))
    assert line.endswith(" ...") and len(line) <= UPSTREAM_WORDS_MAX + 4
    assert all(word.startswith("word") and len(word) == 7 for word in line.removesuffix(" ...").split())
    assert _first_line(ValueError("short\nmore")) == "short" and _first_line(ValueError()) == "ValueError"
