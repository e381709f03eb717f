"""Issue 36.2: no writer replaces one of its own inputs, however the output path spells it.

The same file is found by identity (device and inode), so the input reached through a symlinked
folder, through ``..``, under another name by a hard link, or given relative to the working folder is
the input; ``--overwrite`` changes nothing, and an input flowlift wrote itself (an earlier output)
is still refused. Every case is one line, exit 2 (a batch's refused image: exit 1), before any model
loads (the model folders given do not exist: a later check would name them), and the input is left
byte for byte.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from PIL import Image

from flowlift.commands.cli import main
from flowlift.errors import FlowliftError
from flowlift.files.image_outputs import save_image_atomic
from flowlift.files.output_paths import check_not_an_input, same_file, same_file_error


def _earlier_output(path: Path, size: tuple[int, int] = (32, 32)) -> Path:
    """An image flowlift wrote (its metadata says so): the foreign-file rule alone would replace it."""
    g = torch.Generator().manual_seed(1)
    array = (torch.rand(size[1], size[0], 3, generator=g) * 255).to(torch.uint8).numpy()
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_image_atomic(Image.fromarray(array, "RGB"), path, {"flowlift": {"command": "img2img"}})


def _spellings(tmp_path: Path, image: Path) -> dict[str, Path]:
    """The output names that are ``image``: as given, through a folder link, through ``..``, a hard link."""
    (tmp_path / "linked").symlink_to(image.parent, target_is_directory=True)
    (image.parent / "sub").mkdir(exist_ok=True)
    (tmp_path / "elsewhere").mkdir(exist_ok=True)
    hard = tmp_path / "elsewhere" / f"hard{image.suffix}"
    os.link(image, hard)
    return {
        "same": image,
        "linked-folder": tmp_path / "linked" / image.name,
        "dotdot": image.parent / "sub" / ".." / image.name,
        "hard-link": hard,
    }


def test_same_file_is_identity_not_spelling(tmp_path):
    image = _earlier_output(tmp_path / "dir" / "r.png")
    for name, spelling in _spellings(tmp_path, image).items():
        assert same_file(spelling, image), name
        error = same_file_error(spelling, {"image": image})
        assert error is not None and "is the input image" in str(error) and error.fields == ("image",), name
        assert "is the input --image" in error.worded({"image": "--image"})  # a door names the field its own way
        with pytest.raises(FlowliftError, match="is the input source.loras.*choose another output"):
            check_not_an_input(spelling, {"mask": None, "source.loras": [tmp_path / "x.safetensors", image]})
    other = _earlier_output(tmp_path / "dir" / "other.png")
    assert not same_file(other, image) and same_file_error(other, {"image": image}) is None
    assert same_file_error(tmp_path / "dir" / "new.png", {"image": image}) is None  # not there yet
    assert same_file_error(image, {"image": tmp_path / "missing.png"}) is None


def _error_lines(capsys, command: str) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith(f"flowlift {command}")]


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("spelling", ["same", "linked-folder", "dotdot", "hard-link", "relative"])
@pytest.mark.parametrize("role", ["img2img --image", "img2img --mask", "outpaint --image", "hires --image"])
def test_a_refine_never_replaces_its_input(tmp_path, monkeypatch, capsys, role, spelling, overwrite):
    image = _earlier_output(tmp_path / "dir" / "r.png")
    mask = _earlier_output(tmp_path / "dir" / "m.png")
    victim = mask if role.endswith("--mask") else image
    spellings = _spellings(tmp_path, victim)
    monkeypatch.chdir(tmp_path)
    output = Path("dir") / victim.name if spelling == "relative" else spellings[spelling]
    before = victim.read_bytes()
    common = [
        "--model",
        str(tmp_path / "no-such-model"),
        "--prompt",
        "a photo",
        "--steps",
        "1",
        "--no-progress",
        "-o",
        str(output),
        *(["--overwrite"] if overwrite else []),
    ]
    command, flag = role.split()
    if command == "hires":
        argv = ["hires", "--image", str(image), "--scale", "2", "--upscaler", str(tmp_path / "no.safetensors"), *common]
    else:
        argv = ["img2img", str(image), *common]
        if flag == "--mask":
            argv += ["--mask", str(mask)]
        if command == "outpaint":
            argv += ["--outpaint", "16,0,16,0"]
    assert main(argv) == 2
    lines = _error_lines(capsys, "hires" if command == "hires" else "img2img")
    named = "image" if flag == "--image" and command != "hires" else flag  # img2img's image: its positional argument
    assert len(lines) == 1 and f"is the input {named}" in lines[0] and "no-such-model" not in lines[0], lines
    assert victim.read_bytes() == before
    assert sorted(p.name for p in victim.parent.iterdir()) == ["m.png", "r.png", "sub"]  # nothing else written


@pytest.mark.parametrize("spelling", ["linked-folder", "dotdot", "hard-link"])
def test_upscale_refuses_its_input_by_identity(tmp_path, capsys, spelling, shared):
    image = _earlier_output(tmp_path / "dir" / "r.png")
    output = _spellings(tmp_path, image)[spelling]
    before = image.read_bytes()
    code = main(
        [
            "upscale",
            str(image),
            "-o",
            str(output),
            "--overwrite",
            "--upscaler",
            str(tmp_path / "no.safetensors"),
            "--vae",
            str(shared / "models" / "taef2"),
            "--no-progress",
        ]
    )
    assert code in (1, 2)
    lines = _error_lines(capsys, "upscale")
    assert any("would overwrite the input" in line for line in lines), lines
    assert image.read_bytes() == before


@pytest.mark.parametrize("spelling", ["same", "linked-folder", "hard-link"])
@pytest.mark.parametrize("victim_name", ["reference", "upscaled"])
def test_colorfix_never_replaces_its_reference_or_input(tmp_path, capsys, spelling, victim_name):
    reference = _earlier_output(tmp_path / "dir" / "photo.png", (16, 16))
    upscaled = _earlier_output(tmp_path / "dir" / "photo_x2.png", (32, 32))
    victim = reference if victim_name == "reference" else upscaled
    output = _spellings(tmp_path, victim)[spelling]
    before = victim.read_bytes()
    code = main(["colorfix", str(upscaled), "--reference", str(reference), "-o", str(output), "--overwrite"])
    assert code != 0
    lines = _error_lines(capsys, "colorfix")
    wanted = "is the input --reference" if victim_name == "reference" else "would overwrite the input"
    assert any(wanted in line for line in lines), lines
    assert victim.read_bytes() == before


@pytest.mark.parametrize("how", ["report name in the measured folder", "hard link", "linked folder"])
def test_eval_reports_never_replace_a_measured_image(tmp_path, capsys, how):
    outputs, references = tmp_path / "outs", tmp_path / "refs"
    measured = _earlier_output(outputs / "crops.png", (32, 32))
    _earlier_output(references / "crops.png", (16, 16))
    out = outputs
    if how == "hard link":
        out = tmp_path / "report"
        out.mkdir()
        os.link(measured, out / "metrics.png")
    elif how == "linked folder":
        out = tmp_path / "linked"
        out.symlink_to(outputs, target_is_directory=True)
    before = measured.read_bytes()
    assert main(["eval", str(outputs), "--reference", str(references), "-o", str(out)]) == 2
    lines = _error_lines(capsys, "eval")
    # a report's file that is a measured image (by identity); a report folder that is the measured one, also by
    # identity, is refused as a whole first (its figures would be measured next time)
    wanted = "is the input OUTPUTS" if how == "hard link" else "is the OUTPUTS folder"
    assert len(lines) == 1 and wanted in lines[0], lines
    assert measured.read_bytes() == before


def test_dataset_never_replaces_an_input_image(tmp_path, capsys):
    photo = _earlier_output(tmp_path / "photos" / "a.png", (64, 64))
    out = tmp_path / "ds"
    out.mkdir()
    os.link(photo, out / "shard-00000.safetensors")
    before = photo.read_bytes()
    code = main(["dataset", "images", str(photo), "-o", str(out), "--vae", str(tmp_path / "no-such-vae")])
    assert code == 2
    lines = _error_lines(capsys, "dataset")
    assert len(lines) == 1 and "is the input INPUT" in lines[0] and "no-such-vae" not in lines[0], lines
    assert photo.read_bytes() == before


def test_the_python_api_names_the_input_by_its_field(tmp_path, shared):
    """An output that is an input, or a report folder that is an input folder, is named by the request's field
    (the keyword a caller wrote), never by a command-line option: each door says it in its own words."""
    from flowlift.measure.bands_job import BandsRequest, run_bands_report
    from flowlift.measure.eval_job import EvalRequest, run_eval
    from flowlift.training.config import TrainConfig
    from flowlift.training.dataset_jobs import DatasetRequest, PhotoCrops, run_dataset
    from flowlift.training.run_files import check_run_folder, run_inputs
    from flowlift.upscale.colorfix_job import ColorFixRequest, plan_colorfix

    photos = tmp_path / "photos"
    photo = _earlier_output(photos / "a.png", (64, 64))
    vae = str(shared / "models" / "taef2")
    with pytest.raises(FlowliftError, match=r"^output .* is the images folder") as caught:
        run_bands_report(BandsRequest(images=[str(photos)], vae=vae, output=photos))
    assert caught.value.fields == ("output", "images")
    with pytest.raises(FlowliftError, match=r"^output .* is the dataset folder") as caught:
        run_eval(EvalRequest(run="lanczos", dataset=str(photos), output=photos))
    assert caught.value.fields == ("output", "dataset")
    report = tmp_path / "report"
    report.mkdir()
    os.link(photo, report / "metrics.png")
    with pytest.raises(FlowliftError, match="is the input outputs"):
        run_eval(EvalRequest(outputs=[str(photos)], reference=str(photos), output=report))
    shards = tmp_path / "ds"
    shards.mkdir()
    os.link(photo, shards / "shard-00000.safetensors")
    with pytest.raises(FlowliftError, match="is the input crops.inputs"):
        run_dataset(DatasetRequest(output=shards, vae=vae, crops=PhotoCrops(inputs=[str(photo)], crop_px=32)))
    upscaled = _earlier_output(tmp_path / "up" / "a_x2.png", (128, 128))
    jobs, _ = plan_colorfix(ColorFixRequest(inputs=[str(upscaled)], references=[str(photo)], output=str(photo)))
    assert [job.refused and "is the input references" in job.note for job in jobs] == [True], jobs
    run = tmp_path / "run"
    run.mkdir()
    os.link(photo, run / "curves.png")
    config = TrainConfig(data=str(tmp_path / "data"), output=str(run), val_images=[str(photo)], overwrite=True)
    with pytest.raises(FlowliftError, match="is the input val_images"):
        check_run_folder(config, run_inputs(config))
