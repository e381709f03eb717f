"""The replace rule at every fixed name of ``flowlift eval``, ``flowlift bands`` and ``flowlift dataset``
(issue 36.4).

At each name a command writes, for each of: a link, a dangling link, a FIFO, a folder, a foreign file, an
empty file and flowlift's own file (copied from a real earlier run), with and without ``--overwrite``:
links, FIFOs and folders are one line before any model loads or any work starts (``--overwrite`` or
not; nothing is written, nothing followed, the FIFO never opened); a foreign file is one line without
``--overwrite`` and replaced with it; an empty file and flowlift's own are replaced either way, and what
is left at the name is flowlift's own.
"""

from __future__ import annotations

import functools
import json
import os
import stat
from pathlib import Path

import pytest
from PIL import Image

from builders import command_line, one_error_line, put_kind, snapshot
from flowlift.commands.cli import main
from flowlift.files.image_outputs import is_flowlift_metadata, read_metadata
from flowlift.files.own_files import safetensors_metadata

KINDS = ["link", "dangling link", "fifo", "folder", "foreign file", "empty file", "own file"]
SPECIAL = {"link", "dangling link", "fifo", "folder"}


pytestmark = pytest.mark.usefixtures("fifo_alarm")


def _is_own(path: Path) -> bool:
    """What is at ``path`` is a regular file flowlift wrote (checked independently of the code under test)."""
    if not stat.S_ISREG(os.lstat(path).st_mode) or path.stat().st_size == 0:
        return False
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        return "flowlift" in data or data.get("format") == "flowlift-latent-dataset"
    if path.suffix == ".md":
        return path.read_text().startswith("<!-- written by flowlift ")
    if path.suffix == ".png":
        return is_flowlift_metadata(read_metadata(path))
    return (safetensors_metadata(path) or {}).get("format") == "flowlift-shard"


def _one_line(capsys, command: str) -> str:
    return one_error_line(capsys.readouterr().err, command)


def _case(tmp_path, capsys, monkeypatch, command, argv, out, name, kind, overwrite, *, own, no_work) -> bool:
    """Run one (name, kind, --overwrite) case of ``command``; ``no_work`` patches the first step of work
    (a model load, the measuring) to fail, for the cases that must be refused before it. True when it ran."""
    victim = tmp_path / "notes.txt"
    victim.write_text("my notes\n")
    words = put_kind(out / name, kind, victim, own / name)
    refused = kind in SPECIAL or (kind == "foreign file" and not overwrite)
    before = snapshot(tmp_path)
    if refused:
        no_work(monkeypatch)
    code = main([*argv, *(["--overwrite"] if overwrite else [])])
    if refused:
        assert code == 2
        line = _one_line(capsys, command)
        assert words in line and Path(name).name in line, line
        if kind == "foreign file":
            assert "use --overwrite" in line
        assert snapshot(tmp_path) == before  # nothing written, nothing through a link, no FIFO opened
        return False
    assert code == 0, capsys.readouterr().err
    assert _is_own(out / name)
    assert victim.read_text() == "my notes\n"
    return True


@pytest.fixture
def replace_case(tmp_path, capsys, monkeypatch):
    """:func:`_case` in this test's folder, with its captured output and monkeypatch."""
    return functools.partial(_case, tmp_path, capsys, monkeypatch)


def _fail(what: str):
    def patch(monkeypatch) -> None:
        module, attribute = what.rsplit(".", 1)

        def refuse(*args, **kwargs):
            raise AssertionError(f"{what} ran although the command had to be refused before it")

        monkeypatch.setattr(f"{module}.{attribute}", refuse)

    return patch


# ------------------------------------------------------------------------------------------------
# flowlift eval


@pytest.fixture(scope="module")
def photos(tmp_path_factory, shared) -> Path:
    folder = tmp_path_factory.mktemp("photos")
    with Image.open(shared / "images" / "kodak" / "kodim03.png") as im:
        im.convert("RGB").crop((300, 200, 364, 264)).save(folder / "kodim03.png")
    return folder


def _eval_argv(photos: Path, out: Path) -> list[str]:
    return command_line(
        "eval", run="lanczos", dataset=photos, scale="2", save_outputs=True, no_progress=True, output=out
    )


@pytest.fixture(scope="module")
def eval_reference(tmp_path_factory, photos) -> Path:
    """A real earlier eval: the source of flowlift's own files, and of the cache's entry names."""
    out = tmp_path_factory.mktemp("eval-reference") / "report"
    assert main(_eval_argv(photos, out)) == 0
    return out


def _eval_names() -> list[str]:
    names = [
        "results.json",
        "table.md",
        "metrics.png",
        "crops.png",
        "outputs/lanczos/kodim03_x2.png",
        "outputs/inputs/kodim03.png",
        "outputs/ground-truth/kodim03.png",
    ]
    return names + ["cache entry .json", "cache entry .png"]


def _resolve(reference: Path, name: str) -> str:
    """A cache entry's name (its key is the reference run's) relative to the report folder."""
    if not name.startswith("cache entry"):
        return name
    found = sorted((reference / "cache" / "lanczos").glob(f"*{name.split()[-1]}"))
    assert len(found) == 1, found
    return str(found[0].relative_to(reference))


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", _eval_names())
def test_eval_applies_the_replace_rule_at_every_name(
    tmp_path, replace_case, photos, eval_reference, name, kind, overwrite
):
    name = _resolve(eval_reference, name)
    out = tmp_path / "report"
    refuse = _fail("flowlift.measure.evaluate.evaluate_methods")
    replace_case("eval", _eval_argv(photos, out), out, name, kind, overwrite, own=eval_reference, no_work=refuse)


@pytest.mark.parametrize("kind", ["fifo", "foreign file"])
@pytest.mark.parametrize("name", ["results.json", "table.md", "metrics.png"])
def test_eval_of_pairs_applies_the_rule_to_its_reports(tmp_path, replace_case, photos, eval_reference, name, kind):
    out = tmp_path / "report"
    outputs = eval_reference / "outputs"
    argv = command_line("eval", outputs / "lanczos", reference=outputs / "inputs", no_progress=True, output=out)
    refuse = _fail("flowlift.measure.pairs.evaluate_pairs")
    replace_case("eval", argv, out, name, kind, False, own=eval_reference, no_work=refuse)


@pytest.mark.parametrize("kind", ["link", "file"])
@pytest.mark.parametrize("folder", ["cache", "cache/lanczos", "outputs", "outputs/lanczos"])
def test_eval_folders_it_makes_must_be_real_folders(tmp_path, capsys, monkeypatch, photos, folder, kind):
    out = tmp_path / "report"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / folder).parent.mkdir(parents=True, exist_ok=True)
    if kind == "link":
        (out / folder).symlink_to(elsewhere, target_is_directory=True)
    else:
        (out / folder).write_text("the user's")
    before = snapshot(tmp_path)
    _fail("flowlift.measure.evaluate.evaluate_methods")(monkeypatch)
    assert main(_eval_argv(photos, out)) == 2
    assert Path(folder).name in _one_line(capsys, "eval")
    assert snapshot(tmp_path) == before


def test_a_second_eval_reuses_its_own_reports_and_cache(tmp_path, capsys, photos):
    out = tmp_path / "report"
    assert main(_eval_argv(photos, out)) == 0
    assert main(_eval_argv(photos, out)) == 0
    assert "cache: 1 reused, 0 computed" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# flowlift bands


@pytest.fixture
def fake_vae(monkeypatch):
    from test_bands import IdealVAE, _fake_vae_module

    _fake_vae_module(monkeypatch, IdealVAE)


def _bands_argv(shared: Path, out: Path) -> list[str]:
    photo = shared / "images" / "kodak" / "kodim01.png"
    return command_line("bands", photo, vae="fake", max_side="256", no_progress=True, output=out)


@pytest.fixture(scope="module")
def bands_reference(tmp_path_factory, shared) -> Path:
    from test_bands import IdealVAE, _fake_vae_module

    out = tmp_path_factory.mktemp("bands-reference") / "bands"
    with pytest.MonkeyPatch.context() as patch:
        _fake_vae_module(patch, IdealVAE)
        assert main(_bands_argv(shared, out)) == 0
    return out


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["bands.json", "bands.md", "bands.png"])
def test_bands_applies_the_replace_rule_at_every_name(
    tmp_path, replace_case, shared, bands_reference, fake_vae, name, kind, overwrite
):
    out = tmp_path / "bands"

    def no_model(patch) -> None:
        import sys

        patch.setattr(sys.modules["flowlift.models.vae_loading"], "load_vae", _fail_now, raising=False)
        patch.setattr("flowlift.files.images.load_image", _fail_now)

    replace_case("bands", _bands_argv(shared, out), out, name, kind, overwrite, own=bands_reference, no_work=no_model)


def _fail_now(*args, **kwargs):
    raise AssertionError("work started although the command had to be refused before it")


# ------------------------------------------------------------------------------------------------
# flowlift dataset


@pytest.fixture(scope="module")
def crops(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("crops")
    for i, colour in enumerate([(200, 40, 40), (40, 200, 40)]):
        Image.new("RGB", (40, 40), colour).save(folder / f"img{i}.png")
    return folder


def _dataset_argv(shared: Path, crops: Path, out: Path) -> list[str]:
    crop = {"crop_px": "32", "crops_per_image": "1", "shard_size": "1"}
    vae = {"vae": shared / "models" / "taef2", "device": "cpu"}
    return command_line("dataset", "images", crops, **crop, **vae, no_progress=True, output=out)


@pytest.fixture(scope="module")
def dataset_reference(tmp_path_factory, shared, crops) -> Path:
    out = tmp_path_factory.mktemp("dataset-reference") / "data"
    assert main(_dataset_argv(shared, crops, out)) == 0
    return out


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["dataset.json", "shard-00001.safetensors"])
def test_dataset_applies_the_replace_rule_at_every_name(
    tmp_path, replace_case, shared, crops, dataset_reference, name, kind, overwrite
):
    out = tmp_path / "data"
    refuse = _fail("flowlift.models.vae_loading.load_vae")
    ran = replace_case(
        "dataset", _dataset_argv(shared, crops, out), out, name, kind, overwrite, own=dataset_reference, no_work=refuse
    )
    if ran:
        from flowlift.training.shards import ShardReader

        assert len(ShardReader(out)) == 2  # every shard flowlift's and readable: the dataset is whole (2 items)


def test_an_interrupted_dataset_build_resumes_keeping_its_shards(tmp_path, capsys, shared, crops):
    out = tmp_path / "data"
    assert main(_dataset_argv(shared, crops, out)) == 0
    kept = os.stat(out / "shard-00000.safetensors")
    (out / "shard-00001.safetensors").unlink()  # killed before its last shard
    assert main(_dataset_argv(shared, crops, out)) == 0, capsys.readouterr().err
    again = os.stat(out / "shard-00000.safetensors")
    assert (again.st_ino, again.st_mtime_ns) == (kept.st_ino, kept.st_mtime_ns)  # flowlift's own shard: kept
    assert _is_own(out / "shard-00001.safetensors")
