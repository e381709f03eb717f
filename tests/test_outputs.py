"""Outputs (issue 15, items 8-13): colour profile and EXIF carried through, metadata in every format,
--format/--quality, every readable format listed, the output-of guard in any folder, one line per
written file, ``<stem>_x<N>`` pairing and ``eval --save-outputs``; 16-bit inputs kept 16-bit and
alpha never dropped without a word (issue 21, items 8-9)."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
from PIL import Image, ImageCms

from builders import save_tiny_unet
from door_helpers import classic_eval_args
from flowlift.commands.cli import main
from flowlift.errors import FlowliftError
from flowlift.files.image_outputs import SourceProfile, read_metadata, read_source_profile, save_image_atomic
from flowlift.files.images import (
    IMAGE_SUFFIXES,
    list_images,
    load_image,
    to_tensor,
)

_ORIENTATION, _MAKE, _EXIF_IFD, _EXIF_WIDTH, _DATETIME_ORIGINAL = 0x0112, 0x010F, 0x8769, 0xA002, 0x9003


def _profile_bytes() -> bytes:
    """A real, non-sRGB ICC profile (CIE L*a*b*-based) - any profile other than the default will do."""
    return ImageCms.ImageCmsProfile(ImageCms.createProfile("LAB")).tobytes()


def _photo(size=(48, 32)) -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def _tagged_source(path, icc: bytes) -> None:
    exif = Image.Exif()
    exif[_ORIENTATION] = 6
    exif[_MAKE] = "TestCam"
    exif.get_ifd(_EXIF_IFD)[_EXIF_WIDTH] = 48
    exif.get_ifd(_EXIF_IFD)[_DATETIME_ORIGINAL] = "2024:01:02 03:04:05"
    _photo().save(path, quality=95, icc_profile=icc, exif=exif.tobytes())


@pytest.mark.parametrize("suffix", [".png", ".jpg", ".webp", ".tif"])
def test_icc_profile_exif_and_metadata_reach_every_format(tmp_path, suffix):
    icc = _profile_bytes()
    source = tmp_path / "src.jpg"
    _tagged_source(source, icc)
    rgb, _ = load_image(source)
    metadata = {"Software": "flowlift test", "flowlift.parameters": {"dtype": "float32", "seed": 3}}
    out = save_image_atomic(rgb, tmp_path / f"out{suffix}", metadata, source=source)
    with Image.open(out) as written:
        assert written.info.get("icc_profile") == icc
        exif = written.getexif()
        assert exif.get(_MAKE) == "TestCam" and _ORIENTATION not in exif
        sub = exif.get_ifd(_EXIF_IFD)
        assert sub.get(_DATETIME_ORIGINAL) == "2024:01:02 03:04:05" and _EXIF_WIDTH not in sub
    assert read_metadata(out)["flowlift.parameters"] == {"dtype": "float32", "seed": 3}


def test_source_without_profile_writes_none(tmp_path):
    source = tmp_path / "plain.png"
    _photo().save(source)
    profile = read_source_profile(source)
    assert profile.icc_profile is None and profile.exif is None
    out = save_image_atomic(_photo(), tmp_path / "o.jpg", source=profile)
    with Image.open(out) as written:
        assert "icc_profile" not in written.info
    assert read_metadata(out) == {}


def test_quality_and_lossless_webp(tmp_path):
    image = _photo((64, 64))
    small = save_image_atomic(image, tmp_path / "q40.jpg", quality=40).stat().st_size
    large = save_image_atomic(image, tmp_path / "q95.jpg").stat().st_size
    assert small < large
    lossless = save_image_atomic(image, tmp_path / "l.webp", quality=100)
    with Image.open(lossless) as written:
        assert np.array_equal(np.asarray(written.convert("RGB")), np.asarray(image))
    with Image.open(save_image_atomic(image, tmp_path / "d.webp")) as written:
        assert not np.array_equal(np.asarray(written.convert("RGB")), np.asarray(image))  # lossy by default
    with pytest.raises(FlowliftError, match="quality"):
        save_image_atomic(image, tmp_path / "bad.jpg", quality=0)
    with pytest.raises(FlowliftError, match="unsupported output format .gif"):
        save_image_atomic(image, tmp_path / "x.gif")


def test_folders_list_every_readable_format_and_multi_frame_files_warn(tmp_path):
    for suffix in (".gif", ".avif", ".tga", ".qoi", ".png", ".apng"):
        assert suffix in IMAGE_SUFFIXES
    frames = [Image.new("RGB", (16, 16), colour) for colour in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    frames[0].save(tmp_path / "anim.gif", save_all=True, append_images=frames[1:])
    _photo().save(tmp_path / "still.avif")
    _photo().save(tmp_path / "still.tga")
    (tmp_path / "notes.txt").write_text("not listed")
    assert [p.name for p in list_images([str(tmp_path)])] == ["anim.gif", "still.avif", "still.tga"]
    with pytest.warns(UserWarning, match="anim.gif: has 3 frames, only the first is used"):
        rgb, _ = load_image(tmp_path / "anim.gif")
    assert rgb.getpixel((0, 0)) == (255, 0, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_image(tmp_path / "still.tga")


def test_output_of_guard_holds_for_any_output_folder(tmp_path):
    from flowlift.jobs.batch import plan_jobs

    src = tmp_path / "in"
    src.mkdir()
    for name in ("a.png", "a_x2.png", "a_x4.jpg", "b_x2.png"):
        (src / name).write_bytes(b"")
    inputs = sorted(src.iterdir())
    jobs = plan_jobs(inputs, str(tmp_path / "out"), lambda p: f"{p.stem}_x2.png")
    by_name = {job.source.name: job for job in jobs}
    assert by_name["a.png"].output == tmp_path / "out" / "a_x2.png"
    for name in ("a_x2.png", "a_x4.jpg"):
        assert by_name[name].output is None and by_name[name].note == f"skipped, it is the output of {src / 'a.png'}"
    assert by_name["b_x2.png"].output is not None  # no b.png beside it: a source of its own


def test_pairing_of_upscale_outputs_with_references(tmp_path):
    from flowlift.files.naming import pair_by_stem, parse_upscaled_stem, upscaled_name

    assert upscaled_name("kodim01", 2, "png") == "kodim01_x2.png"
    assert parse_upscaled_stem("kodim01_x2") == ("kodim01", 2) and parse_upscaled_stem("kodim01_x") is None
    outs = [tmp_path / n for n in ("kodim01_x2.png", "kodim02.png", "kodim03_x4.png", "other_x2.png")]
    refs = [tmp_path / "ref" / n for n in ("kodim01.png", "kodim02.png", "kodim03.png")]
    pairs, unpaired = pair_by_stem(outs, refs)
    assert [(o.name, r.name) for o, r in pairs] == [
        ("kodim01_x2.png", "kodim01.png"),
        ("kodim02.png", "kodim02.png"),
        ("kodim03_x4.png", "kodim03.png"),
    ]
    assert [p.name for p in unpaired] == ["other_x2.png"]
    with pytest.raises(FlowliftError, match="both pair with the reference kodim01.png"):
        pair_by_stem([tmp_path / "kodim01_x2.png", tmp_path / "kodim01_x4.png"], refs)
    # flowlift colorfix's names pair with the source, not with the upscale they were fixed from
    pairs, unpaired = pair_by_stem([tmp_path / "kodim01_x2_colorfix.png", tmp_path / "kodim02_colorfix.png"], refs)
    assert [(o.name, r.name) for o, r in pairs] == [
        ("kodim01_x2_colorfix.png", "kodim01.png"),
        ("kodim02_colorfix.png", "kodim02.png"),
    ]


def test_inspect_existing_tells_whole_truncated_and_flowlifts_own(tmp_path):
    """The resume rule's file check: cut files are incomplete in every output format, data after a
    format's end (a camera's trailer) is not a cut, and flowlift's metadata is recognised."""
    from flowlift.files.image_outputs import inspect_existing

    image = _photo((64, 48))
    for suffix in (".png", ".jpg", ".webp", ".tif", ".bmp"):
        whole = save_image_atomic(image, tmp_path / f"whole{suffix}", {"Software": "flowlift test"})
        data = whole.read_bytes()
        found = inspect_existing(whole, (64, 48))
        assert found.complete and found.size == (64, 48) and found.by_flowlift == (suffix != ".bmp"), suffix
        (tmp_path / f"cut{suffix}").write_bytes(data[: len(data) * 3 // 4])
        cut = inspect_existing(tmp_path / f"cut{suffix}")
        assert not cut.complete, suffix  # (a cut WebP does not even open: not an image)
        (tmp_path / f"trailer{suffix}").write_bytes(data + b"motion-photo trailer" * 50)
        assert inspect_existing(tmp_path / f"trailer{suffix}").complete, suffix
    (tmp_path / "empty.png").write_bytes(b"")
    assert inspect_existing(tmp_path / "empty.png").empty
    plain = tmp_path / "plain.png"
    image.save(plain)
    assert not inspect_existing(plain).by_flowlift and inspect_existing(plain).complete


# ---------------------------------------------------------------------------- 16 bits per sample


def _bit_depth(path) -> int:
    """Bits per sample as stored in the file (OpenCV keeps 16-bit samples that Pillow cuts to 8)."""
    import cv2

    array = cv2.imdecode(np.fromfile(path, dtype=np.uint8), cv2.IMREAD_UNCHANGED)
    return {np.dtype(np.uint8): 8, np.dtype(np.uint16): 16}[array.dtype]


@pytest.mark.parametrize("suffix", [".png", ".tif"])
@pytest.mark.parametrize("alpha", [False, True])
def test_sixteen_bit_files_are_written_and_read_back_exactly(tmp_path, suffix, alpha):
    from flowlift.files.sixteen_bit import has_16bit_samples, load_image_16bit, save_image16_atomic, tensor_to_uint16

    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 65536, (20, 30, 3), dtype=np.uint16)
    transparency = rng.integers(0, 65536, (20, 30), dtype=np.uint16) if alpha else None
    icc = _profile_bytes()
    metadata = {"Software": "flowlift test", "flowlift.parameters": {"scale": 2}}
    out = save_image16_atomic(rgb, transparency, tmp_path / f"o{suffix}", metadata, source=SourceProfile(icc))
    assert _bit_depth(out) == 16 and has_16bit_samples(out) and not has_16bit_samples(tmp_path / "missing.png")
    read_rgb, read_alpha = load_image_16bit(out)
    assert np.array_equal(read_rgb, rgb) and (read_alpha is None) == (not alpha)
    assert not alpha or np.array_equal(read_alpha, transparency)
    assert read_metadata(out)["flowlift.parameters"] == {"scale": 2}
    with Image.open(out) as written:
        assert written.info.get("icc_profile") == icc and written.mode == ("RGBA" if alpha else "RGB")
        written.load()  # Pillow reads it too (as 8-bit)
    assert np.array_equal(tensor_to_uint16(to_tensor(rgb)), rgb)  # the float pipeline loses no 16-bit level
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


def test_sixteen_bit_orientation_matches_pillows(tmp_path):
    from PIL import ImageOps

    from flowlift.files.sixteen_bit import load_image_16bit

    grey = (np.arange(12 * 7, dtype=np.uint16).reshape(12, 7) * 701).astype(np.uint16)
    for orientation in range(1, 9):
        exif = Image.Exif()
        exif[_ORIENTATION] = orientation
        Image.fromarray(grey).save(tmp_path / "o.png", exif=exif.tobytes())  # mode I;16
        rgb, alpha = load_image_16bit(tmp_path / "o.png")
        with Image.open(tmp_path / "o.png") as opened:
            expected = np.asarray(ImageOps.exif_transpose(opened))
        assert alpha is None and np.array_equal(rgb[..., 0], expected) and np.array_equal(rgb[..., 2], expected)


# ---------------------------------------------------------------------------- the upscale command


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return save_tiny_unet(tmp_path_factory.mktemp("weights") / "flow_upscaler.safetensors")


def _common(shared, weights) -> list[str]:
    return ["--upscaler", str(weights), "--vae", str(shared / "models" / "taef2"), "--device", "cpu"]


def test_upscale_writes_one_line_per_file_keeps_the_profile_and_records_the_dtype(
    tmp_path, shared, weights, capsys, single_thread_torch
):
    icc = _profile_bytes()
    src = tmp_path / "in"
    src.mkdir()
    _tagged_source(src / "tagged.jpg", icc)
    _photo().save(src / "plain.png")
    out = tmp_path / "out"
    argv = ["upscale", str(src), "-o", str(out), "--format", "webp", "--quality", "90", *_common(shared, weights)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[:2] == [f"wrote {out / 'plain_x2.webp'}", f"wrote {out / 'tagged_x2.webp'}"] and len(lines) == 3
    # the summary gives the total and the per-image time (issue 21, item 15)
    assert re.fullmatch(
        r"flowlift upscale: 2 written, 0 skipped, 0 failed \(2 inputs\) in [0-9][0-9 .minh]*s, "
        r"[0-9][0-9 .minh]*s per image",
        lines[2],
    ), lines[2]
    assert "\r" not in captured.err  # stderr is not a terminal: no progress bars
    with Image.open(out / "tagged_x2.webp") as written:
        assert written.info.get("icc_profile") == icc and written.getexif().get(_MAKE) == "TestCam"
        assert written.size == (64, 96)  # EXIF orientation 6 applied: 32x48 displayed, x2
    meta = read_metadata(out / "tagged_x2.webp")
    assert meta["flowlift"]["dtype"] == "float32" and meta["flowlift"]["device"] == "cpu"
    assert len(meta["flowlift"]["models"]["upscaler"]["flow_upscaler.safetensors"]) == 64

    # --progress forces the bars into a pipe; the rerun resumes and says so in its summary
    assert main([*argv, "--progress"]) == 0
    captured = capsys.readouterr()
    assert re.search(r"0 written, 2 skipped, 0 failed \(2 inputs\) in [0-9][0-9 .minh]*s$", captured.out.strip())


def test_format_and_output_name_must_agree(tmp_path, shared, weights, capsys):
    source = tmp_path / "a.png"
    _photo().save(source)
    rc = main(["upscale", str(source), "-o", str(tmp_path / "two.jpg"), "--format", "png", *_common(shared, weights)])
    err = capsys.readouterr().err
    assert rc == 2 and "drop one" in err and not (tmp_path / "two.jpg").exists()
    rc = main(["upscale", str(source), "-o", str(tmp_path / "x.gif"), *_common(shared, weights)])
    assert rc == 2 and "unsupported output format .gif" in capsys.readouterr().err


def _sixteen_bit_inputs(folder) -> dict[str, np.ndarray]:
    """A 16-bit RGB PNG and a 16-bit grey PNG with levels 8 bits cannot hold (written by OpenCV)."""
    import cv2

    folder.mkdir()
    ramp = np.linspace(0, 65535, 48, dtype=np.float64)[None, :].repeat(32, axis=0)
    rgb = np.stack([ramp, ramp[::-1, ::-1], np.full_like(ramp, 30001)], axis=-1).round().astype(np.uint16)
    grey = (ramp * 0.5 + 1).round().astype(np.uint16)
    cv2.imwrite(str(folder / "rgb16.png"), rgb[..., ::-1])
    cv2.imwrite(str(folder / "grey16.png"), grey)
    return {"rgb16": rgb, "grey16": np.repeat(grey[..., None], 3, axis=-1)}


def test_upscale_keeps_16_bits_where_the_format_can_and_says_so_where_not(tmp_path, shared, weights, capsys):
    """Issue 21.8: 16-bit inputs stay 16-bit in PNG and TIFF; JPEG costs one warning line per image."""
    from flowlift.files.sixteen_bit import load_image_16bit
    from flowlift.upscale.outputs import read_source

    originals = _sixteen_bit_inputs(tmp_path / "in")
    for name, rgb in originals.items():  # the samples reach the pipeline whole: x / 65535, not x >> 8
        loaded = read_source(tmp_path / "in" / f"{name}.png", tmp_path / "o.png")
        assert loaded.sixteen_bit and torch.equal(loaded.pixels, to_tensor(rgb))
    assert main(["upscale", str(tmp_path / "in"), "-o", str(tmp_path / "png"), *_common(shared, weights)]) == 0
    assert "warning" not in capsys.readouterr().err
    for name in originals:
        out = tmp_path / "png" / f"{name}_x2.png"
        assert _bit_depth(out) == 16 and read_metadata(out)["flowlift"]["scale"] == 2
        levels = load_image_16bit(out)[0]
        assert levels.shape == (64, 96, 3) and np.any(levels % 257)  # not 8-bit values scaled up
    tif = tmp_path / "rgb16_x2.tif"
    assert main(["upscale", str(tmp_path / "in" / "rgb16.png"), "-o", str(tif), *_common(shared, weights)]) == 0
    assert _bit_depth(tif) == 16 and read_metadata(tif)["Software"].endswith("upscale")
    assert (
        main(
            ["upscale", str(tmp_path / "in"), "-o", str(tmp_path / "jpg"), "--format", "jpg", *_common(shared, weights)]
        )
        == 0
    )
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warned) == 2 and all("16-bit" in line and "--format png" in line for line in warned), warned
    assert all(_bit_depth(p) == 8 for p in (tmp_path / "jpg").iterdir())


def test_colorfix_keeps_16_bits_too(tmp_path, capsys):
    """Issue 21.8 in colorfix: a 16-bit upscale is fixed on its 16-bit samples and written 16-bit."""
    import cv2

    from flowlift.files.sixteen_bit import load_image_16bit
    from flowlift.upscale.colorfix_image import color_fix_array

    rng = np.random.default_rng(3)
    small = rng.integers(0, 65536, (10, 12, 3), dtype=np.uint16)
    big = cv2.resize(small, (24, 20), interpolation=cv2.INTER_LINEAR) // 2 + 9000  # drifted, 16-bit levels
    cv2.imwrite(str(tmp_path / "a.png"), small[..., ::-1])
    cv2.imwrite(str(tmp_path / "a_x2.png"), big[..., ::-1])
    assert main(["colorfix", str(tmp_path / "a_x2.png"), "--reference", str(tmp_path / "a.png")]) == 0
    assert "warning" not in capsys.readouterr().err
    out = tmp_path / "a_x2_colorfix.png"
    assert _bit_depth(out) == 16 and read_metadata(out)["Software"].endswith("colorfix")
    assert np.array_equal(load_image_16bit(out)[0], color_fix_array(big, small))
    assert (
        main(
            [
                "colorfix",
                str(tmp_path / "a_x2.png"),
                "--reference",
                str(tmp_path / "a.png"),
                "-o",
                str(tmp_path / "fixed.jpg"),
            ]
        )
        == 0
    )
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warned) == 1 and "16-bit" in warned[0] and _bit_depth(tmp_path / "fixed.jpg") == 8


def test_alpha_written_as_jpeg_costs_one_warning_line(tmp_path, shared, weights, capsys):
    """Issue 21.9: a format without alpha says so and names the fix; PNG keeps the alpha silently."""
    rgba = _photo()
    rgba.putalpha(Image.fromarray(np.tile(np.linspace(0, 255, 48, dtype=np.uint8), (32, 1)), "L"))
    rgba.save(tmp_path / "a.png")
    assert main(["upscale", str(tmp_path / "a.png"), "--format", "jpg", *_common(shared, weights)]) == 0
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if "warning" in line]
    assert len(warned) == 1 and "alpha" in warned[0] and "--format png|webp" in warned[0], err
    with Image.open(tmp_path / "a_x2.jpg") as written:
        assert written.mode == "RGB" and written.size == (96, 64)
    assert main(["upscale", str(tmp_path / "a.png"), *_common(shared, weights)]) == 0
    assert "warning" not in capsys.readouterr().err
    with Image.open(tmp_path / "a_x2.png") as written:
        assert written.mode == "RGBA"
    # colorfix writes through the same saver: the same line
    code = main(["colorfix", str(tmp_path / "a_x2.png"), "--reference", str(tmp_path / "a.png"), "--format", "jpg"])
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert code == 0 and len(warned) == 1 and "--format png|webp" in warned[0]


def test_eval_reads_upscale_outputs_and_save_outputs_recomputes_the_same_numbers(tmp_path, shared, capsys):
    import json

    photos = tmp_path / "photos"
    photos.mkdir()
    for name in ("kodim03", "kodim23"):
        with Image.open(shared / "images" / "kodak" / f"{name}.png") as im:
            im.convert("RGB").crop((300, 200, 428, 296)).save(photos / f"{name}.png")
    out = tmp_path / "run"
    assert main([*classic_eval_args(photos, 2), "-o", str(out)]) == 0
    saved = out / "outputs"
    assert sorted(p.name for p in (saved / "lanczos").iterdir()) == ["kodim03_x2.png", "kodim23_x2.png"]
    run_results = json.loads((out / "results.json").read_text())
    capsys.readouterr()
    again = tmp_path / "again"
    assert (
        main(
            [
                "eval",
                str(saved / "lanczos"),
                "--reference",
                str(saved / "inputs"),
                "--ground-truth",
                str(saved / "ground-truth"),
                "-o",
                str(again),
            ]
        )
        == 0
    )
    pair_results = json.loads((again / "results.json").read_text())

    run_rows = run_results["images"]["lanczos"]
    pair_rows = pair_results["images"]["outputs"]
    assert set(run_rows) == set(pair_rows) == {"kodim03", "kodim23"}
    for name, row in run_rows.items():
        assert "psnr_gt" in row and set(row) == set(pair_rows[name])
        for key, value in row.items():
            assert pair_rows[name][key] == pytest.approx(value, abs=1e-9), (name, key)
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    assert "--save-outputs" in capsys.readouterr().out


def test_a_hub_cached_weight_file_is_hashed_by_its_blob_name_and_any_other_file_by_its_content(tmp_path):
    """The provenance's weight hashes (issue 47): a file in huggingface_hub's cache is an LFS blob named by the
    SHA-256 of its content, so its name is the hash and the file is not read again; everything else is read."""
    import hashlib

    from builders import fake_hub_cache
    from flowlift.files.image_outputs import file_sha256
    from flowlift.models.hub import cached_blob_sha256, weight_file_sha256

    data = b"weights" * 1000
    cache = tmp_path / "hub"
    fake_hub_cache(cache, "owner/model", {"vae/w.safetensors": data, "config.json": b"{}"})
    snapshot = cache / "models--owner--model" / "snapshots" / ("0" * 40)
    linked, config = snapshot / "vae" / "w.safetensors", snapshot / "config.json"
    assert linked.is_symlink() and cached_blob_sha256(linked) == hashlib.sha256(data).hexdigest()
    assert weight_file_sha256(linked) == file_sha256(linked) == hashlib.sha256(data).hexdigest()
    assert cached_blob_sha256(linked.resolve()) == hashlib.sha256(data).hexdigest()  # the blob's own path too
    assert cached_blob_sha256(config) is None  # a plain git file's blob is named by its 40-hex git hash
    # The name is what is trusted: a blob is not read (a blob changed after its download keeps its recorded hash).
    forged = cache / "models--owner--model" / "blobs" / ("ab" * 32)
    forged.write_bytes(b"other")
    assert weight_file_sha256(forged) == "ab" * 32
    # Outside a repository's blobs/ folder a 64-hex name means nothing: the file is read.
    for folder in (tmp_path / "blobs", tmp_path / "models--owner--model" / "elsewhere"):
        folder.mkdir(parents=True)
        (folder / ("ab" * 32)).write_bytes(b"other")
        assert weight_file_sha256(folder / ("ab" * 32)) == hashlib.sha256(b"other").hexdigest()
    plain = tmp_path / "w.safetensors"
    plain.write_bytes(data)
    assert cached_blob_sha256(plain) is None and weight_file_sha256(plain) == hashlib.sha256(data).hexdigest()
