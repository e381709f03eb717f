"""`flowlift colorfix`: stage 2 for any upscaler's outputs, with upscale's batch semantics."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

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
    code, lines = _colorfix([str(tmp_path / "up"), "--reference", str(tmp_path / "src"), "-o", str(tmp_path / "out")],
                            capsys)  # fmt: skip
    assert code == 0 and lines == [], lines
    out_path = tmp_path / "out" / "wine_x4_colorfix.png"
    with Image.open(out_path) as written:
        fixed = np.asarray(written.convert("RGB"))
        info = dict(written.info)
    stage2 = tensor_to_uint8(lab_lowband_transplant(to_tensor(drifted), to_tensor(reference), 1.0))[0]
    assert np.array_equal(fixed, stage2)  # the pipeline's stage 2, to the bit
    assert drift_at_input_scale(fixed, reference)["cast_max"] <= 0.05
    assert "colorfix" in info["Software"] and '"scale": 4' in info["flowlift.parameters"]
    assert "wine.png" in info["flowlift.reference"] and "wine_x4.png" in info["flowlift.source"]
    # resume: a second run skips the existing output and leaves it untouched
    before = out_path.stat().st_mtime_ns
    code, lines = _colorfix([str(tmp_path / "up"), "--reference", str(tmp_path / "src"), "-o", str(tmp_path / "out")],
                            capsys)  # fmt: skip
    assert code == 0 and len(lines) == 1 and "skipped" in lines[0] and out_path.stat().st_mtime_ns == before


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
    code, lines = _colorfix([str(tmp_path / "a_x2.png"), "--reference", str(tmp_path / "a.png"), "-o", str(out)],
                            capsys)  # fmt: skip
    assert code == 0 and lines == [], lines
    with Image.open(out) as written:
        assert written.format == "JPEG" and written.info.get("icc_profile") == icc
