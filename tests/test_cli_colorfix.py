"""`flowlift colorfix`: stage 2 for any upscaler's outputs, with upscale's batch semantics."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from flowlift.files.image_outputs import file_sha256
from flowlift.files.images import tensor_to_uint8, to_tensor
from flowlift.measure.metrics import drift_at_input_scale
from flowlift.upscale.colorfix import lab_lowband_transplant
from test_colorfix_image import make_drifted_pair


@pytest.fixture(scope="module")
def drifted_pair(shared):
    return make_drifted_pair(shared)


# -- flowlift colorfix -------------------------------------------------------------------------------


def _colorfix(argv: list[str], capsys) -> tuple[int, list[str]]:
    from flowlift.commands.cli import main

    code = main(["colorfix", *argv])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.startswith("flowlift")]


def test_colorfix_command_pairs_x4_names_and_matches_stage2(drifted_pair, tmp_path, capsys):
    reference, drifted = drifted_pair
    (tmp_path / "src").mkdir()
    (tmp_path / "up").mkdir()
    Image.fromarray(reference).save(tmp_path / "src" / "wine.png")
    Image.fromarray(drifted).save(tmp_path / "up" / "wine_x4.png")
    code, lines = _colorfix(
        [str(tmp_path / "up"), "--reference", str(tmp_path / "src"), "-o", str(tmp_path / "out")], capsys
    )
    assert code == 0 and lines == [], lines
    out_path = tmp_path / "out" / "wine_x4_colorfix.png"
    with Image.open(out_path) as written:
        fixed = np.asarray(written.convert("RGB"))
        info = dict(written.info)
    stage2 = tensor_to_uint8(lab_lowband_transplant(to_tensor(drifted), to_tensor(reference), 1.0))[0]
    assert np.array_equal(fixed, stage2)  # the pipeline's stage 2, to the bit
    assert drift_at_input_scale(fixed, reference)["cast_max"] <= 0.05
    record = json.loads(info["flowlift"])
    assert "colorfix" in info["Software"] and record["scale"] == 4 and record["command"] == "colorfix"
    assert record["reference"] == "wine.png" and record["input"] == "wine_x4.png"
    # resume: a second run skips the existing output and leaves it untouched
    before = out_path.stat().st_mtime_ns
    code, lines = _colorfix(
        [str(tmp_path / "up"), "--reference", str(tmp_path / "src"), "-o", str(tmp_path / "out")], capsys
    )
    assert code == 0 and len(lines) == 1 and "skipped" in lines[0] and out_path.stat().st_mtime_ns == before
    # the same output name for another input (a second folder of the same stems) is redone, not skipped as done
    (tmp_path / "up2").mkdir()
    Image.fromarray(np.ascontiguousarray(drifted[::-1])).save(tmp_path / "up2" / "wine_x4.png")
    code, lines = _colorfix(
        [str(tmp_path / "up2"), "--reference", str(tmp_path / "src"), "-o", str(tmp_path / "out")], capsys
    )
    assert code == 0 and len(lines) == 1 and "made from another input than wine_x4.png" in lines[0], lines
    with Image.open(out_path) as written:
        assert json.loads(written.info["flowlift"])["input_sha256"] == file_sha256(tmp_path / "up2" / "wine_x4.png")


def test_colorfix_command_refuses_a_non_integer_ratio_in_one_line(tmp_path, capsys):
    rng = np.random.default_rng(0)
    (tmp_path / "src").mkdir()
    (tmp_path / "up").mkdir()
    for name in ("a", "b"):
        Image.fromarray(rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)).save(tmp_path / "src" / f"{name}.png")
    Image.fromarray(rng.integers(0, 256, (66, 99, 3), dtype=np.uint8)).save(tmp_path / "up" / "a_x4.png")  # 3.3x
    Image.fromarray(rng.integers(0, 256, (40, 60, 3), dtype=np.uint8)).save(tmp_path / "up" / "b.png")  # 2x
    Image.fromarray(rng.integers(0, 256, (40, 60, 3), dtype=np.uint8)).save(tmp_path / "up" / "c_x2.png")  # no source
    code, lines = _colorfix([str(tmp_path / "up"), "--reference", str(tmp_path / "src")], capsys)
    assert code == 1
    assert len([line for line in lines if "a_x4.png" in line]) == 1
    assert any("a_x4.png" in line and "3.3x by 3.3x" in line for line in lines), lines
    assert any("c_x2.png" in line and "no reference" in line for line in lines), lines
    assert lines[-1].endswith("2 of 3 image(s) failed")
    assert (tmp_path / "up" / "b_colorfix.png").is_file()  # the batch went on
    assert sorted(p.name for p in (tmp_path / "up").iterdir()) == ["a_x4.png", "b.png", "b_colorfix.png", "c_x2.png"]


def test_colorfix_command_leaves_references_given_as_inputs_alone(tmp_path, capsys):
    rng = np.random.default_rng(1)
    Image.fromarray(rng.integers(0, 256, (10, 12, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(tmp_path / "a_x2.png")
    code, lines = _colorfix([str(tmp_path), "--reference", str(tmp_path / "a.png")], capsys)
    assert code == 0 and len(lines) == 1 and "a.png: skipped, it is a reference" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png", "a_x2.png", "a_x2_colorfix.png"]


def test_colorfix_command_keeps_the_icc_profile(tmp_path, capsys):
    from PIL import ImageCms

    rng = np.random.default_rng(2)
    icc = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    Image.fromarray(rng.integers(0, 256, (10, 12, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(tmp_path / "a_x2.png", icc_profile=icc)
    out = tmp_path / "fixed.jpg"
    code, lines = _colorfix(
        [str(tmp_path / "a_x2.png"), "--reference", str(tmp_path / "a.png"), "-o", str(out)], capsys
    )
    assert code == 0 and lines == [], lines
    with Image.open(out) as written:
        assert written.format == "JPEG" and written.info.get("icc_profile") == icc


def test_colorfix_one_folder_holding_sources_and_upscales(drifted_pair, tmp_path, capsys):
    """Issue 22.11: ``DIR --reference DIR`` pairs by name, not by which flag listed the folder."""
    reference, drifted = drifted_pair
    Image.fromarray(reference).save(tmp_path / "photo.png")
    Image.fromarray(drifted).save(tmp_path / "photo_x4.png")
    code, lines = _colorfix([str(tmp_path), "--reference", str(tmp_path)], capsys)
    assert code == 0 and lines == ["flowlift colorfix: " + str(tmp_path / "photo.png") + ": skipped, it is a reference"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["photo.png", "photo_x4.png", "photo_x4_colorfix.png"]
    with Image.open(tmp_path / "photo_x4_colorfix.png") as written:
        assert drift_at_input_scale(np.asarray(written.convert("RGB")), reference)["cast_max"] <= 0.05
    # the rerun: the fix is skipped as photo_x4's output (not fixed against photo_x4), nothing written
    code, lines = _colorfix([str(tmp_path), "--reference", str(tmp_path)], capsys)
    assert code == 0 and sorted(p.name for p in tmp_path.iterdir())[-1] == "photo_x4_colorfix.png"
    assert any("photo_x4_colorfix.png: skipped, it is the output of" in line for line in lines), lines


def test_colorfix_then_eval_chain_and_explicit_pairs_of_any_names(drifted_pair, tmp_path, capsys):
    """Issue 21.10: eval pairs colorfix's <stem>_x4_colorfix outputs with <stem>; one file and one
    reference file are a pair whatever their names, in colorfix and in eval."""
    import json

    from flowlift.commands.cli import main

    reference, drifted = drifted_pair
    for folder in ("src", "up"):
        (tmp_path / folder).mkdir()
    Image.fromarray(reference).save(tmp_path / "src" / "wine.png")
    Image.fromarray(drifted).save(tmp_path / "up" / "wine_x4.png")  # an upscaler's output, as named by flowlift
    code, lines = _colorfix(
        [str(tmp_path / "up"), "--reference", str(tmp_path / "src"), "-o", str(tmp_path / "fixed")], capsys
    )
    assert code == 0 and lines == [], lines
    assert (
        main(
            [
                "eval",
                str(tmp_path / "fixed"),
                "--reference",
                str(tmp_path / "src"),
                "-o",
                str(tmp_path / "r1"),
                "--no-progress",
            ]
        )
        == 0
    )
    first = json.loads((tmp_path / "r1" / "results.json").read_text())
    assert first["config"]["images"] == ["wine"] and first["images"]["outputs"]["wine"]["cast_max"] <= 0.05

    # names that share nothing: given as one file each, they are the pair
    Image.fromarray(drifted).save(tmp_path / "esrgan result.png")
    Image.fromarray(reference).save(tmp_path / "small.png")
    code, lines = _colorfix([str(tmp_path / "esrgan result.png"), "--reference", str(tmp_path / "small.png")], capsys)
    assert code == 0 and lines == [], lines
    fixed = tmp_path / "esrgan result_colorfix.png"
    assert (
        main(
            [
                "eval",
                str(fixed),
                "--reference",
                str(tmp_path / "small.png"),
                "-o",
                str(tmp_path / "r2"),
                "--no-progress",
            ]
        )
        == 0
    )
    second = json.loads((tmp_path / "r2" / "results.json").read_text())
    assert second["images"]["outputs"]["small"] == first["images"]["outputs"]["wine"]
    # a folder is not an explicit pair: names still decide there
    code, lines = _colorfix([str(tmp_path / "up"), "--reference", str(tmp_path / "small.png")], capsys)
    assert code == 1 and any("no reference named wine_x4" in line for line in lines), lines


def test_colorfix_lines_name_the_reference_option_the_real_stems_and_the_empty_folder(tmp_path, capsys):
    """It said ``bad.png: not an image file Pillow can read`` without --reference, printed its template
    (``no reference named a_x2 or (for <stem>_x<N>) <stem>``) and ``no input images found`` without the folder."""
    Image.new("RGB", (16, 16), (90, 60, 30)).save(tmp_path / "a_x2.png")
    (tmp_path / "bad.png").write_bytes(b"not an image")
    code, lines = _colorfix([str(tmp_path / "a_x2.png"), "--reference", str(tmp_path / "bad.png")], capsys)
    assert code == 1 and f"{tmp_path / 'a_x2.png'}: --reference {tmp_path / 'bad.png'}: not an image file" in lines[0]
    (tmp_path / "up").mkdir()
    (tmp_path / "refs").mkdir()
    Image.new("RGB", (16, 16), (90, 60, 30)).save(tmp_path / "up" / "a_x2.png")
    Image.new("RGB", (16, 16), (90, 60, 30)).save(tmp_path / "up" / "b.png")
    Image.new("RGB", (8, 8), (90, 60, 30)).save(tmp_path / "refs" / "other.png")
    code, lines = _colorfix([str(tmp_path / "up"), "--reference", str(tmp_path / "refs")], capsys)
    assert code == 1 and "<stem>" not in "".join(lines), lines
    assert lines[:2] == [
        f"flowlift colorfix: {tmp_path / 'up' / 'a_x2.png'}: no reference named a_x2 or a among the references",
        f"flowlift colorfix: {tmp_path / 'up' / 'b.png'}: no reference named b among the references",
    ], lines
    (tmp_path / "empty").mkdir()
    code, lines = _colorfix([str(tmp_path / "empty"), "--reference", str(tmp_path / "refs")], capsys)
    assert code == 2 and lines == [
        f"flowlift colorfix: error: no input images in {tmp_path / 'empty'}: give image files, or folders holding "
        "them (not searched below)"
    ], lines


def _pairs(folder, names=("a", "b")) -> None:
    """``folder/src/<name>.png`` (10x12) and ``folder/up/<name>_x2.png`` (20x24) for each name."""
    rng = np.random.default_rng(3)
    (folder / "src").mkdir()
    (folder / "up").mkdir()
    for name in names:
        Image.fromarray(rng.integers(0, 256, (10, 12, 3), dtype=np.uint8)).save(folder / "src" / f"{name}.png")
        Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(folder / "up" / f"{name}_x2.png")


@pytest.mark.parametrize("name", ["new.txt", "x.xyz", "x.gif"])
@pytest.mark.parametrize("count", [1, 2])
def test_colorfix_o_with_a_suffix_it_does_not_write_is_one_line_and_no_folder(tmp_path, capsys, name, count):
    """``-o new.txt`` with several inputs made a folder named new.txt (and with one, a folder too): a file-like name
    in a format flowlift does not write is refused, as upscale's and refine's -o are, listing what it writes."""
    _pairs(tmp_path)
    inputs = [str(tmp_path / "up")] if count == 2 else [str(tmp_path / "up" / "a_x2.png")]
    out = tmp_path / name
    code, lines = _colorfix([*inputs, "--reference", str(tmp_path / "src"), "-o", str(out)], capsys)
    assert code == 2 and len(lines) == 1, lines
    suffix = out.suffix
    assert lines[0] == (
        f"flowlift colorfix: error: --output {out}: unsupported output format {suffix}; give a file name ending "
        f".png, .jpg, .jpeg, .webp, .bmp, .tif, .tiff, or a folder ({out}/ names one)"
    )
    assert not out.exists()


@pytest.mark.parametrize(("name", "fmt"), [("fixed.tiff", "TIFF"), ("fixed.tif", "TIFF"), ("fixed.bmp", "BMP")])
def test_colorfix_o_writes_every_format_flowlift_writes_for_one_input(tmp_path, capsys, name, fmt):
    """TIFF and BMP are written by upscale's and refine's -o FILE too: colorfix takes them alike, and says so."""
    _pairs(tmp_path)
    out = tmp_path / name
    argv = [str(tmp_path / "up" / "a_x2.png"), "--reference", str(tmp_path / "src"), "-o", str(out)]
    code, lines = _colorfix(argv, capsys)
    assert code == 0 and lines == [], lines
    with Image.open(out) as written:
        assert written.format == fmt and written.size == (24, 20)


def test_colorfix_o_file_for_several_inputs_or_a_folder_with_a_dot(tmp_path, capsys):
    _pairs(tmp_path)
    argv = [str(tmp_path / "up"), "--reference", str(tmp_path / "src")]
    code, lines = _colorfix([*argv, "-o", str(tmp_path / "one.png")], capsys)
    assert code == 2 and len(lines) == 1 and "one.png names one file but 2 inputs were given; pass a folder" in lines[0]
    assert not (tmp_path / "one.png").exists()
    code, lines = _colorfix([*argv, "-o", f"{tmp_path / 'fixed.v2'}/"], capsys)  # the separator: a folder
    assert code == 0, lines
    assert sorted(p.name for p in (tmp_path / "fixed.v2").iterdir()) == ["a_x2_colorfix.png", "b_x2_colorfix.png"]


def test_colorfix_help_lists_the_suffixes_o_takes(capsys):
    from flowlift.commands.cli import main

    with pytest.raises(SystemExit):
        main(["colorfix", "-h"])
    text = " ".join(capsys.readouterr().out.split())
    assert "a file name ending .png, .jpg, .jpeg, .webp, .bmp, .tif or .tiff" in text, text
