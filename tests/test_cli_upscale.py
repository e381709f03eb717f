"""``flowlift upscale``: batches, bad inputs, resume, metadata (real TAEF2, small random UNet)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from builders import save_tiny_unet
from flowlift.commands.cli import main
from flowlift.files.image_outputs import file_sha256


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return save_tiny_unet(tmp_path_factory.mktemp("weights") / "flow_upscaler.safetensors")


@pytest.fixture(scope="module")
def photo(shared):
    image = Image.open(shared / "images" / "photos" / "Wine_by_Jakkub_Mede.png").convert("RGB")
    return image.resize((48, 32), Image.Resampling.BOX)


def _common(shared, weights) -> list[str]:
    return ["--upscaler", str(weights), "--vae", str(shared / "models" / "taef2"), "--device", "cpu"]


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("flowlift upscale:")]


def test_batch_with_bad_inputs_then_resume(tmp_path, shared, weights, photo, capsys):
    src = tmp_path / "in"
    src.mkdir()
    photo.save(src / "good.png")
    rgba = photo.copy()
    rgba.putalpha(Image.fromarray(np.tile(np.linspace(0, 255, 48, dtype=np.uint8), (32, 1)), "L"))
    rgba.save(src / "alpha.png")
    # stored 48x32, EXIF orientation 6 (rotate 90 CW to display): displayed 32x48
    exif = Image.Exif()
    exif[0x0112] = 6
    photo.save(src / "rotated.jpg", exif=exif.tobytes(), quality=95)
    photo.convert("CMYK").save(src / "cmyk.jpg", quality=95)
    grey16 = (np.asarray(photo.convert("L"), dtype=np.uint16) * 257).astype(np.uint16)
    Image.frombytes("I;16", photo.size, grey16.astype("<u2").tobytes()).save(src / "grey16.png")
    (src / "corrupt.png").write_bytes((src / "good.png").read_bytes()[:200])
    (src / "notes.png").write_text("not an image")
    out = tmp_path / "out"

    rc = main(["upscale", str(src), "-o", str(out), "--scale", "2", *_common(shared, weights)])
    err = capsys.readouterr().err
    assert rc == 1
    assert "Traceback" not in err
    errors = _error_lines(err)
    assert sum("corrupt.png" in line for line in errors) == 1
    assert sum("notes.png" in line for line in errors) == 1
    expected = ["alpha_x2.png", "cmyk_x2.png", "good_x2.png", "grey16_x2.png", "rotated_x2.png"]
    assert sorted(p.name for p in out.iterdir()) == expected

    with Image.open(out / "good_x2.png") as good:
        assert good.size == (96, 64) and good.mode == "RGB"
        text = good.text
    with Image.open(out / "alpha_x2.png") as alpha:
        assert alpha.mode == "RGBA" and alpha.size == (96, 64)
        a = np.asarray(alpha.getchannel("A"), dtype=np.float64)
        assert a[:, :2].mean() < 10 and a[:, -2:].mean() > 245
    with Image.open(out / "rotated_x2.png") as rotated:
        assert rotated.size == (64, 96)
    for name in ("cmyk_x2.png", "grey16_x2.png"):
        with Image.open(out / name) as converted:
            assert converted.mode == "RGB" and converted.size == (96, 64)
            # colour pinned to the input's at input scale: not black, not clipped
            assert 40 < np.asarray(converted).mean() < 215

    params = json.loads(text["flowlift"])
    assert params["scale"] == 2 and params["seed"] == 0 and params["color_fix"] is True
    models = params["models"]
    assert models["upscaler"] == {"flow_upscaler.safetensors": file_sha256(weights)}
    assert set(models["vae"]) == {"taef2_encoder.pth", "taef2_decoder.pth"}
    assert params["input_sha256"] == file_sha256(src / "good.png")

    # rerun: finished outputs are skipped (not rewritten), the bad inputs fail again
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    rc = main(["upscale", str(src), "-o", str(out), "--scale", "2", *_common(shared, weights)])
    err = capsys.readouterr().err
    assert rc == 1
    assert sum("skipped" in line for line in _error_lines(err)) == 5
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps


def test_overwrite_single_file_output_and_determinism(tmp_path, shared, weights, photo, capsys):
    photo.save(tmp_path / "a.png")
    target = tmp_path / "result.png"
    args = ["upscale", str(tmp_path / "a.png"), "-o", str(target), "--seed", "4", *_common(shared, weights)]
    assert main(args) == 0
    first = target.read_bytes()
    assert main(args) == 0 and "skipped" in capsys.readouterr().err
    os.utime(target, ns=(0, 0))
    assert main([*args, "--overwrite"]) == 0
    assert target.stat().st_mtime_ns != 0
    with Image.open(target) as result, Image.open(io.BytesIO(first)) as earlier:
        assert result.size == (96, 64)
        assert result.tobytes() == earlier.tobytes()  # same seed, same pixels
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png", "result.png"]  # no temporary files left


def test_never_overwrites_inputs_and_never_upscales_own_outputs(tmp_path, shared, weights, photo, capsys):
    photo.save(tmp_path / "a.png")
    common = _common(shared, weights)
    # the output file named as the input: refused, input untouched
    before = (tmp_path / "a.png").read_bytes()
    assert main(["upscale", str(tmp_path / "a.png"), "-o", str(tmp_path / "a.png"), *common]) == 1
    assert any("would overwrite the input" in line for line in _error_lines(capsys.readouterr().err))
    assert (tmp_path / "a.png").read_bytes() == before
    # a folder run without -o writes next to the inputs; rerunning it leaves a_x2.png alone (it is
    # a.png's output, not a new source) and skips a.png (finished): nothing new, exit 0
    assert main(["upscale", str(tmp_path), "--passes", "1", *common]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png", "a_x2.png"]
    capsys.readouterr()
    assert main(["upscale", str(tmp_path / "*.png"), "--passes", "1", *common]) == 0
    lines = _error_lines(capsys.readouterr().err)
    assert any("a_x2.png: skipped, it is the output of" in line for line in lines)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png", "a_x2.png"]


def test_missing_weights_message(tmp_path, shared, photo, capsys):
    photo.save(tmp_path / "a.png")
    rc = main(["upscale", str(tmp_path / "a.png"), "--upscaler", str(tmp_path / "none"), "--vae", "taef2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "flow_upscaler.safetensors" in err[0] and "--upscaler PATH" in err[0]
    assert not (tmp_path / "a_x2.png").exists()


def test_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["upscale", "x.png", "--scale", "9"])  # 3 or 1.5 are scales now (issue 46); past 8x is not
    with pytest.raises(SystemExit):
        main(["upscale", "x.png", "--scale", "3", "--long-side", "100"])
    with pytest.raises(SystemExit):
        main(["upscale", "x.png", "--scale", "2", "--passes", "2"])
    with pytest.raises(SystemExit):
        main(["upscale", "x.png", "--transplant-strength", "1.5"])
    # a missing input is one line and a failed image (exit 1), not a user error that stops the batch
    assert main(["upscale", str(tmp_path / "missing-*.png")]) == 1
    assert "no such file" in capsys.readouterr().err
    # but the one file asked for by name is a user error (issue 21.16): one line, exit 2
    assert main(["upscale", str(tmp_path / "missing.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("flowlift upscale: error: ") and "missing.png: no such" in err


def test_status_of_a_plain_run_comes_from_its_files(tmp_path, shared, weights, photo, capsys):
    """Issue 21.11: without a manifest, `flowlift status` reports done, partial, broken and missing from the files."""
    for name in ("a", "b", "c"):
        photo.save(tmp_path / f"{name}.png")
    assert main(["upscale", str(tmp_path / "a.png"), str(tmp_path / "b.png"), *_common(shared, weights)]) == 0
    damaged = (tmp_path / "b_x2.png").read_bytes()
    (tmp_path / "b_x2.png").write_bytes(damaged[: len(damaged) * 2 // 3])  # cut short since
    killed = (
        "import os, signal, sys; from flowlift.files.atomic import atomic_output\n"
        "with atomic_output(sys.argv[1]) as tmp:\n    os.kill(os.getpid(), signal.SIGKILL)"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    assert subprocess.run([sys.executable, "-c", killed, str(tmp_path / "c_x2.png")], env=env).returncode == -9
    (tmp_path / ".c_x2.k3j4h5l6.flowlift-partial").write_bytes(b"")  # a user's look-alike: not flowlift's debris
    capsys.readouterr()
    assert main(["status", str(tmp_path)]) == 1
    text = capsys.readouterr().out
    assert "no job manifest" in text and "1 done, 1 partial, 1 broken, 1 missing" in text, text
    assert "broken: b_x2.png (truncated; the next run redoes it)" in text and "missing: c.png" in text
    assert "not complete" in text
    assert main(["upscale", str(tmp_path), *_common(shared, weights)]) == 0  # the rerun finishes it
    capsys.readouterr()
    assert main(["status", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "3 done, 0 partial, 0 broken, 0 missing" in text and "complete" in text.splitlines()[-1]


def test_status_from_the_files_tells_changed_inputs_unreadable_inputs_and_output_like_names(
    tmp_path, shared, weights, photo, capsys
):
    """A folder whose input changed since its output was made said "complete" (the rerun redid it); a user's own
    beach_x2.png was never missing (the rerun upscaled it); a user's truncated c.png was a "broken output" the
    rerun would redo (it fails every run)."""
    for name in ("a", "b"):
        photo.save(tmp_path / f"{name}.png")
    assert main(["upscale", str(tmp_path), *_common(shared, weights)]) == 0
    photo.rotate(180).save(tmp_path / "a.png")  # another picture under the same name
    photo.save(tmp_path / "beach_x2.png")  # a user's image at an output-like name, no output of its own
    whole = (tmp_path / "b.png").read_bytes()
    (tmp_path / "c.png").write_bytes(whole[: len(whole) // 2])  # a user's truncated image
    capsys.readouterr()
    assert main(["status", str(tmp_path)]) == 1
    text = capsys.readouterr().out
    assert "1 done, 0 partial, 0 broken, 1 missing, 1 changed, 1 unreadable input(s)" in text, text
    assert "changed: a_x2.png (its input here changed since" in text and "missing: beach_x2.png" in text
    assert "unreadable input: c.png (truncated; every run fails on it" in text and "broken:" not in text
    assert main(["status", str(tmp_path / "a.png")]) == 2
    assert f"{tmp_path / 'a.png'} is a file: give the output folder" in capsys.readouterr().err


def test_manifest_status_after_a_failed_input_is_removed_and_after_the_folder_moves(
    tmp_path, shared, weights, photo, capsys
):
    """A failed input removed since kept the job "not complete" forever; a moved output folder (or one mounted
    elsewhere) listed every output as missing: the manifest's records are read against the folder as it is."""
    inputs, out = tmp_path / "in", tmp_path / "out"
    inputs.mkdir()
    out.mkdir()
    (out / "flowlift-manifest.jsonl").write_text("")  # a job manifest: the records of the scale-out path
    for name in ("a", "b"):
        photo.save(inputs / f"{name}.png")
    (inputs / "bad.png").write_bytes(b"not an image")
    assert main(["upscale", str(inputs), "-o", str(out), *_common(shared, weights)]) == 1
    (inputs / "bad.png").unlink()
    assert main(["upscale", str(inputs), "-o", str(out), *_common(shared, weights)]) == 0
    capsys.readouterr()
    assert main(["status", str(out)]) == 0
    text = capsys.readouterr().out
    assert "failed, its input since removed (nothing to redo):" in text and text.splitlines()[-1] == "complete"
    moved = tmp_path / "moved"
    out.rename(moved)
    assert main(["status", str(moved)]) == 0
    assert "0 recorded but missing on disk" in capsys.readouterr().out


def test_image_too_wide_for_any_pass_is_refused_in_one_line(tmp_path, shared, weights, capsys):
    # 8200 px wide: one pass would give 16400 > MAX_OUTPUT_SIDE; no pass can run, so nothing is
    # written (an unscaled image named _x2 would be a lie that resume then skips forever)
    Image.new("RGB", (8200, 8), (120, 80, 40)).save(tmp_path / "wide.png")
    rc = main(["upscale", str(tmp_path / "wide.png"), "-o", str(tmp_path / "out"), *_common(shared, weights)])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    refused = [line for line in _error_lines(err) if "16384 px cap a side" in line]
    assert len(refused) == 1 and "8200x8 image cannot be upscaled" in refused[0]
    assert "every scale runs a first 2x pass" in refused[0] and "inputs up to 8192 px a side" in refused[0]
    assert not (tmp_path / "out" / "wide_x2.png").exists()


def test_status_is_its_own_command(tmp_path, capsys):
    """Issue 29: `flowlift status OUT` prints the account of the job in OUT and exits 1 while it is not complete."""
    Image.new("RGB", (8, 8), (10, 20, 30)).save(tmp_path / "a.png")  # a source with no output here: missing
    assert main(["status", str(tmp_path)]) == 1
    own = capsys.readouterr()
    assert "1 missing" in own.out and own.err == ""
    assert main(["status", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flowlift status: error: ") and "no such folder" in err and "\n" not in err


def test_an_input_folder_without_images_is_named(tmp_path, capsys):
    """It said ``no input images found`` without the folder given."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("not an image")
    assert main(["upscale", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip()
    expected = f"no input images in {tmp_path / 'empty'}: give image files, or folders holding them "
    expected += "(not searched below)"
    assert err == f"flowlift upscale: error: {expected}", err


def test_upscale_o_with_a_suffix_it_does_not_write_is_one_line_and_no_folder(tmp_path, photo, capsys):
    """``-o out.txt`` (or ``.xyz``) with several inputs made a folder out.txt; the rule colorfix shares refuses it."""
    for name in ("a", "b"):
        photo.save(tmp_path / f"{name}.png")
    for name in ("out.txt", "out.xyz"):
        out = tmp_path / name
        assert main(["upscale", str(tmp_path / "a.png"), str(tmp_path / "b.png"), "-o", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"--output {out}: unsupported output format {out.suffix}; give a file" in err
        assert ".tif, .tiff, or a folder" in err and not out.exists()


@pytest.mark.parametrize(
    ("option", "value", "said"),
    [
        ("--upscaler", "typo", "Flow Upscaler weights: typo: no such file or folder"),
        ("--vae", "typo", "VAE: typo: no such file or folder"),
        ("--latent-upscaler", "sesqui:typo", "SesquiLSR weights: typo: no such file"),
    ],
)
def test_a_misspelled_model_is_refused_although_every_output_exists(
    tmp_path, shared, weights, photo, capsys, option, value, said
):
    """Every output there, a misspelled --upscaler/--vae/--latent-upscaler exited 0 ("0 written, 2 skipped"): the
    names are found before the run decides what to skip."""
    for name in ("a", "b"):
        photo.save(tmp_path / f"{name}.png")
    argv = ["upscale", str(tmp_path / "a.png"), str(tmp_path / "b.png"), "-o", str(tmp_path / "out")]
    assert main([*argv, *_common(shared, weights)]) == 0
    capsys.readouterr()
    common = _common(shared, weights)
    if option in common:
        common[common.index(option) + 1] = value
    else:
        common += [option, value]
    assert main([*argv, *common]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.count("\n") == 0 and err.startswith("flowlift upscale: error: ") and said in err, err
    assert "skipped" not in captured.out + captured.err


def test_a_latent_upscaler_with_taef2_is_refused_before_any_model_loads(tmp_path, shared, weights, photo, capsys):
    """TAEF2 has no BN statistics for SesquiLSR: its name or its folder says so before the pipeline is built (it
    loaded both models first, and with every output there passed silently)."""
    from builders import forbid_call
    from sesqui_reference import save_random_sesqui

    photo.save(tmp_path / "a.png")
    sesqui = save_random_sesqui(tmp_path)
    argv = ["upscale", str(tmp_path / "a.png"), "--scale", "1.5", "--latent-upscaler", f"sesqui:{sesqui}"]
    with pytest.MonkeyPatch.context() as patch:
        forbid_call(patch, "flowlift.upscale.pipeline.FlowUpscalerPipeline.__init__", "a model was loaded")
        for vae in ("taef2", str(shared / "models" / "taef2")):
            assert main([*argv, "--upscaler", str(weights), "--vae", vae, "--device", "cpu"]) == 2
            err = capsys.readouterr().err.strip()
            assert err.count("\n") == 0 and "--latent-upscaler: SesquiLSR works on raw FLUX.2 VAE latents" in err
            assert "set --vae to the FLUX.2 VAE" in err, err
    assert not (tmp_path / "a_x1.5.png").exists()
