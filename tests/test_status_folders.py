"""``flowlift status`` on the folders other commands write: a ``flowlift bands`` or ``flowlift eval`` report folder
is one line saying it holds no job's outputs and what status reads (it said "complete": the report's figure counted
as a done output), and a ``flowlift colorfix`` folder's references are not missing inputs (they were listed as
missing, the job "not complete" for good)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flowlift.commands.cli import main


def _status(folder: Path, capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["status", str(folder)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip()


def _refused_as_a_report(folder: Path, command: str, figures: str, capsys) -> None:
    code, out, err = _status(folder, capsys)
    assert code == 2 and out == "" and len(err.splitlines()) == 1, (out, err)
    assert err == (
        f"flowlift status: error: {folder} is a flowlift {command} report ({figures}), not a job's output folder: "
        "status reads the folders upscale and colorfix (img2img, hires) write images into, and a torchrun job's "
        "manifest"
    )


def test_a_bands_report_folder_is_no_job_folder(shared, tmp_path, capsys):
    out = tmp_path / "bands-taef2"
    vae = str(shared / "models" / "taef2")
    argv = ["bands", str(shared / "images" / "kodak"), "--vae", vae, "--max-side", "144", "--limit", "1"]
    assert main([*argv, "-o", str(out), "--device", "cpu", "--no-progress"]) == 0
    _refused_as_a_report(out, "bands", "bands.png", capsys)


def test_an_eval_report_folder_is_no_job_folder(tmp_path, capsys):
    photos = tmp_path / "photos"
    photos.mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(photos / "a.png")
    out = tmp_path / "report"
    argv = ["eval", "--run", "lanczos", "--dataset", str(photos), "--scale", "2", "-o", str(out), "--no-progress"]
    assert main(argv) == 0
    _refused_as_a_report(out, "eval", "crops.png, metrics.png", capsys)


def _sources_and_upscales(folder: Path, names=("a", "b")) -> None:
    rng = np.random.default_rng(1)
    folder.mkdir(exist_ok=True)
    for name in names:
        Image.fromarray(rng.integers(0, 256, (10, 12, 3), dtype=np.uint8)).save(folder / f"{name}.png")
        Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(folder / f"{name}_x2.png")


def test_a_colorfix_folder_holding_its_references_is_complete(tmp_path, capsys):
    """``colorfix DIR --reference DIR``: the sources beside the upscales are references, not inputs left to fix."""
    folder = tmp_path / "photos"
    _sources_and_upscales(folder)
    assert main(["colorfix", str(folder), "--reference", str(folder)]) == 0
    code, out, _ = _status(folder, capsys)
    assert code == 0 and "2 done, 0 partial, 0 broken, 0 missing" in out and "missing:" not in out, out
    (folder / "b_x2_colorfix.png").unlink()  # a run cut short: only the upscale without its fix is missing
    code, out, _ = _status(folder, capsys)
    assert code == 1 and "1 done, 0 partial, 0 broken, 1 missing" in out, out
    assert "missing: b_x2.png has no output here" in out and "missing: b.png" not in out, out


def test_colorfix_outputs_written_into_the_reference_folder_leave_no_reference_missing(tmp_path, capsys):
    _sources_and_upscales(tmp_path / "src")
    (tmp_path / "up").mkdir()
    for name in ("a", "b"):
        (tmp_path / "src" / f"{name}_x2.png").rename(tmp_path / "up" / f"{name}_x2.png")
    assert (
        main(["colorfix", str(tmp_path / "up"), "--reference", str(tmp_path / "src"), "-o", str(tmp_path / "src")]) == 0
    )
    code, out, _ = _status(tmp_path / "src", capsys)
    assert code == 0 and "2 done, 0 partial, 0 broken, 0 missing" in out, out


@pytest.mark.parametrize("figure", ["bands.png", "crops.png"])
def test_a_report_figure_beside_outputs_is_neither_done_nor_missing(tmp_path, capsys, figure):
    """A report drawn into an upscale's output folder: the outputs' status, the figure not counted."""
    from flowlift.files.own_files import software

    folder = tmp_path / "photos"
    _sources_and_upscales(folder, names=("a",))
    assert main(["colorfix", str(folder), "--reference", str(folder)]) == 0
    Image.new("RGB", (8, 8)).save(folder / figure, pnginfo=_software_text(software("bands")))
    code, out, _ = _status(folder, capsys)
    assert code == 0 and "1 done, 0 partial, 0 broken, 0 missing" in out, out


def _software_text(text: str):
    from PIL import PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text("Software", text)
    return info
