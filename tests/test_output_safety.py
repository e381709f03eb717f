"""Hostile run 4 (issue 32), the output side: what flowlift may delete, replace and fail to write.

* E — the stale-temporary sweep removes only what flowlift itself made (a temporary folder whose
  ``origin`` says so and whose lock no live process holds), never a user's file that looks like one;
* F — one replace rule for every writer: only a regular file is replaced without ``--overwrite``
  (a FIFO, a socket, a link are not);
* D — an output that cannot be written is one line before any model loads, and a write that fails
  during the work (a full disk) is one line with nothing partial left.

Real ``python -m flowlift`` subprocesses where the promise is an exit code, a line or the files left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from builders import command_line, one_error_line, save_tiny_unet
from tiny_flux2 import prompt_embeds

SRC = Path(__file__).resolve().parents[1] / "src"
pytestmark = pytest.mark.usefixtures("single_thread_torch")


def _flowlift(*argv, cwd: Path, timeout: float = 300, preexec_fn=None) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        PYTHONDONTWRITEBYTECODE="1",
    )
    return subprocess.run(
        [sys.executable, "-m", "flowlift", *map(str, argv)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=preexec_fn,
    )


def _one_line(result: subprocess.CompletedProcess, command: str) -> str:
    return one_error_line(result.stderr, command)


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory) -> Path:
    return save_tiny_unet(tmp_path_factory.mktemp("weights") / "flow_upscaler.safetensors", cond_dim=32)


@pytest.fixture(scope="module")
def embeds_file(tmp_path_factory) -> Path:
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("emb") / "prompt.safetensors"
    save_file({"prompt_embeds": prompt_embeds()}, str(path))
    return path


@pytest.fixture(scope="module")
def photo(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("img") / "img.png"
    g = torch.Generator().manual_seed(0)
    Image.fromarray((torch.rand(48, 64, 3, generator=g) * 255).to(torch.uint8).numpy(), "RGB").save(path)
    return path


def _refine_argv(command: str, photo: Path, model_dir: Path, embeds_file: Path, weights: Path, output) -> list:
    """``img2img`` of ``photo``, or ``hires --scale 2`` of it with the Flow Upscaler ``weights``: one step, no
    progress, into ``output`` (None: the default name)."""
    common = command_line(model=model_dir, prompt_embeds=embeds_file, steps="1", no_progress=True, o=output)
    if command == "img2img":
        return ["img2img", photo, *common]
    return ["hires", "--image", photo, "--scale", "2", "--upscaler", weights, *common]


def _upscale_argv(shared: Path, weights: Path, *inputs: Path, out: Path) -> list:
    """``upscale`` of ``inputs`` 2x into the folder ``out`` with the Flow Upscaler ``weights`` and TAEF2, on the CPU."""
    return command_line(
        "upscale", *inputs, o=out, scale="2", upscaler=weights, vae=shared / "models" / "taef2", device="cpu"
    )


# ------------------------------------------------------------------------------------------------
# E: the sweep removes only what flowlift made


_KILLED_WRITER = """
import os, signal, sys
sys.path.insert(0, sys.argv[2])
from flowlift.files.atomic import atomic_output
with atomic_output(sys.argv[1]) as tmp:
    tmp.write_bytes(b"half an image")
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _users_lookalikes(folder: Path) -> dict[Path, bytes | None]:
    """A user's files and folders that look like temporaries, an hour old; what each holds (None: a folder)."""
    from flowlift.files.atomic import ORIGIN_MAGIC

    folder.mkdir(parents=True, exist_ok=True)
    made: dict[Path, bytes | None] = {}
    for name in (
        ".notes.v2.partial.txt",
        ".img_x2.k3j4h5l6.partial.png",
        ".img_x2.abcdefgh.flowlift-partial",
        ".img.abcdefgh.flowlift-partial",
    ):
        (folder / name).write_bytes(b"notes " + name.encode())
        made[folder / name] = (folder / name).read_bytes()
    # folders with the temporary name: no origin, an origin that is not flowlift's, flowlift's origin
    # beside a file of the user's, and one whose origin is a link to a real origin elsewhere
    layouts = {
        ".a.aaaaaaaa.flowlift-partial": {"data": b"user data"},
        ".b.bbbbbbbb.flowlift-partial": {"origin": b"mine\n", "data": b"user data"},
        ".c.cccccccc.flowlift-partial": {"origin": ORIGIN_MAGIC, "data": b"x", "thesis.tex": b"user's"},
    }
    for name, files in layouts.items():
        (folder / name).mkdir()
        for inner, content in files.items():
            (folder / name / inner).write_bytes(content)
        made[folder / name] = None
    real_origin = folder.parent / "origin-elsewhere"
    real_origin.write_bytes(ORIGIN_MAGIC)
    (folder / ".d.dddddddd.flowlift-partial").mkdir()
    (folder / ".d.dddddddd.flowlift-partial" / "origin").symlink_to(real_origin)
    made[folder / ".d.dddddddd.flowlift-partial"] = None
    hour_ago = time.time() - 3600
    for path in list(made) + [p for d in made if made[d] is None for p in d.iterdir()]:
        os.utime(path, (hour_ago, hour_ago), follow_symlinks=False)
    return made


def _still_there(made: dict[Path, bytes | None]) -> None:
    for path, content in made.items():
        if content is None:
            assert path.is_dir() and any(path.iterdir()), path
        else:
            assert path.read_bytes() == content, path


@pytest.mark.parametrize("command", ["upscale", "img2img"])
def test_the_temporary_sweep_never_removes_a_users_files(
    tmp_path, shared, tiny_weights, model_dir, embeds_file, photo, command
):
    """Issue 32.E: files and folders that merely look like temporaries stay; a killed run's temporary goes."""
    out = tmp_path / "out"
    made = _users_lookalikes(out)
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_WRITER, str(out / "img_x2.png"), str(SRC)], capture_output=True, timeout=60
    )
    assert killed.returncode == -signal.SIGKILL
    debris = [p for p in out.iterdir() if p not in made]
    assert len(debris) == 1 and (debris[0] / "data").read_bytes() == b"half an image"
    old = time.time() - 60
    os.utime(debris[0] / "data", (old, old))
    os.utime(debris[0] / "origin", (old, old))
    if command == "upscale":
        argv = _upscale_argv(shared, tiny_weights, photo, out=out)
        written = out / "img_x2.png"
    else:
        written = out / "img_x2.png"
        argv = _refine_argv("img2img", photo, model_dir, embeds_file, tiny_weights, written)
    result = _flowlift(*argv, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert written.is_file()
    _still_there(made)
    assert not debris[0].exists()  # flowlift's own, killed: removed
    assert set(out.iterdir()) == set(made) | {written}


def test_the_sweep_removes_only_unlocked_proven_folders(tmp_path):
    """The sweep itself: the user's look-alikes stay however old; an interrupted write leaves nothing."""
    from flowlift.files.atomic import atomic_output, remove_stale_temporaries, temporary_in_use

    made = _users_lookalikes(tmp_path / "out")
    assert remove_stale_temporaries(tmp_path / "out", before=time.time() + 3600) == []
    _still_there(made)
    assert not any(temporary_in_use(p) for p in made)
    with pytest.raises(KeyboardInterrupt):
        with atomic_output(tmp_path / "out" / "x.png") as temporary:
            temporary.write_bytes(b"part")
            assert temporary_in_use(temporary) and remove_stale_temporaries(tmp_path / "out", time.time() + 9) == []
            raise KeyboardInterrupt
    assert set((tmp_path / "out").iterdir()) == set(made)


# ------------------------------------------------------------------------------------------------
# F: only a regular file is ever replaced, by every writer


def _specials(folder: Path) -> dict[str, str]:
    """A FIFO and a symbolic link at output names; what each is."""
    folder.mkdir(parents=True, exist_ok=True)
    os.mkfifo(folder / "pipe.png")
    (folder / "target.png").write_bytes(b"the link's target")
    (folder / "link.png").symlink_to(folder / "target.png")
    return {"pipe.png": "a FIFO", "link.png": "a symbolic link"}


def _kept(folder: Path) -> None:
    import stat

    assert stat.S_ISFIFO(os.lstat(folder / "pipe.png").st_mode)
    assert (folder / "link.png").is_symlink() and (folder / "target.png").read_bytes() == b"the link's target"


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_fifo_or_link_at_an_output_name_is_never_replaced(
    tmp_path, shared, tiny_weights, model_dir, embeds_file, photo, overwrite
):
    """Issue 32.F: img2img, hires and upscale refuse a FIFO or a link at the output name, in one line
    (exit 2, or exit 1 for a batch's failed image), --overwrite or not; nothing is written."""
    out = tmp_path / "out"
    kinds = _specials(out)
    flag = ["--overwrite"] if overwrite else []
    square = tmp_path / "square.png"
    Image.open(photo).resize((32, 32)).save(square)
    for name, kind in kinds.items():
        for command, image in (("img2img", photo), ("hires", square)):
            argv = [*_refine_argv(command, image, model_dir, embeds_file, tiny_weights, out / name), *flag]
            result = _flowlift(*argv, cwd=tmp_path)
            assert result.returncode == 2, result.stderr
            assert f"exists and is {kind}" in _one_line(result, command)
    # upscale: the output names <stem>_x2.png are a FIFO and a link
    os.mkfifo(out / "pipe_x2.png")
    (out / "link_x2.png").symlink_to(out / "target.png")
    for stem in ("pipe", "link"):
        Image.open(photo).save(tmp_path / f"{stem}.png")
    argv = _upscale_argv(shared, tiny_weights, tmp_path / "pipe.png", tmp_path / "link.png", out=out)
    result = _flowlift(*argv, *flag, cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "pipe_x2.png exists and is a FIFO" in result.stderr
    assert "link_x2.png exists and is a symbolic link" in result.stderr
    _kept(out)
    import stat

    assert stat.S_ISFIFO(os.lstat(out / "pipe_x2.png").st_mode) and (out / "link_x2.png").is_symlink()
    assert sorted(p.name for p in out.iterdir()) == ["link.png", "link_x2.png", "pipe.png", "pipe_x2.png", "target.png"]


def test_every_writer_refuses_a_fifo(tmp_path):
    """The rule lives in atomic_output, which every writer goes through (images, reports, shards, weights)."""
    from flowlift.errors import FlowliftError
    from flowlift.files.atomic import atomic_write_text
    from flowlift.files.image_outputs import save_image_atomic
    from flowlift.training.shards import shard_name, write_shard

    writers = {
        "a.png": lambda p: save_image_atomic(Image.new("RGB", (4, 4)), p),
        "results.json": lambda p: atomic_write_text(p, "{}"),
        "w.safetensors": lambda p: save_tiny_unet(p, seed=None, cond_dim=32),
        shard_name(0): lambda p: write_shard(p.parent, 0, 0, {"target": torch.zeros(1, 2)}, [{}]),
    }
    for name, write in writers.items():
        os.mkfifo(tmp_path / name)
        with pytest.raises(FlowliftError, match="exists and is a FIFO"):
            write(tmp_path / name)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(writers)


# ------------------------------------------------------------------------------------------------
# D: an output that cannot be written is one line before any model loads; a write that fails later is
# one line with nothing partial left


def _mount_tmpfs(folder: Path, options: str) -> bool:
    """A tmpfs at ``folder`` (root only; False where this machine allows no mount)."""
    if os.geteuid() != 0:
        return False
    folder.mkdir(parents=True, exist_ok=True)
    return (
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True).returncode
        == 0
    )


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder no file can be created in: a read-only tmpfs as root (chmod does not stop root), else chmod."""
    folder = tmp_path / "ro"
    if os.geteuid() == 0:
        if not _mount_tmpfs(folder, "ro,size=64k"):
            pytest.skip("root without mount: no read-only file system to test with")
        try:
            yield folder
        finally:
            subprocess.run(["umount", str(folder)], check=True)
    else:
        folder.mkdir()
        folder.chmod(0o555)
        try:
            yield folder
        finally:
            folder.chmod(0o755)


@pytest.fixture(params=["tmpfs", "file-size-limit"])
def full_disk(request, tmp_path):
    """(folder, preexec_fn): a folder whose writes fail mid-file. A 4 KiB tmpfs as root (ENOSPC); anywhere
    else a 2 KiB RLIMIT_FSIZE on the subprocess (EFBIG: the same failed write, reached the same way)."""
    folder = tmp_path / "full"
    if request.param == "tmpfs":
        if not _mount_tmpfs(folder, "size=4k"):
            pytest.skip("no tmpfs mount here (not root); the file-size-limit variant covers it")
        try:
            yield folder, None
        finally:
            subprocess.run(["umount", str(folder)], check=True)
    else:
        import resource

        folder.mkdir()

        def limit() -> None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing
            resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))

        yield folder, limit


@pytest.mark.parametrize("command", ["img2img", "hires"])
def test_unwritable_refine_outputs_are_one_line_before_any_model_loads(
    tmp_path, read_only_folder, tiny_weights, embeds_file, photo, command
):
    """Issue 32.D: -o under a plain file, on a read-only file system, in /proc, or a default name over
    the 255-byte limit: exit 2, one line naming the output, before any model loads (the model folder
    given does not exist, so a later check would name it instead), nothing left."""
    square = tmp_path / "square.png"
    Image.open(photo).resize((32, 32)).save(square)
    (tmp_path / "plain.txt").write_text("a file")
    long_input = tmp_path / ("p" * 245 + ".png")  # a legal 249-byte name; its default output is 257 bytes
    Image.open(photo).resize((32, 32)).save(long_input)
    cases = [
        (square, tmp_path / "plain.txt" / "out.png", "plain.txt is not a folder"),
        (square, read_only_folder / "out.png", "Read-only file system" if os.geteuid() == 0 else "Permission denied"),
        (square, Path("/proc/flowlift-out.png"), "cannot write outputs into /proc"),
        (long_input, None, "over the file system's limit of 255"),
    ]
    before = sorted(tmp_path.iterdir())
    for image, output, message in cases:
        argv = _refine_argv(command, image, tmp_path / "no-such-model", embeds_file, tiny_weights, output)
        result = _flowlift(*argv, cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        line = _one_line(result, command)
        assert message in line and "no-such-model" not in line, line
    assert sorted(tmp_path.iterdir()) == before and list(read_only_folder.iterdir()) == []


@pytest.mark.parametrize("command", ["img2img", "hires"])
def test_a_full_disk_during_a_refine_is_one_line_and_leaves_nothing(
    tmp_path, full_disk, tiny_weights, model_dir, embeds_file, photo, command
):
    folder, limit = full_disk
    square = tmp_path / "square.png"
    Image.open(photo).resize((64, 64)).save(square)
    argv = _refine_argv(command, square, model_dir, embeds_file, tiny_weights, folder / "out.png")
    result = _flowlift(*argv, cwd=tmp_path, preexec_fn=limit)
    assert result.returncode == 2, result.stderr
    line = _one_line(result, command)
    assert f"cannot write {folder / 'out.png'}: " in line
    assert ("No space left on device" if limit is None else "File too large") in line
    assert list(folder.iterdir()) == []  # no output, no temporary


def test_eval_and_dataset_on_a_full_disk_are_one_line_and_leave_no_partial_file(tmp_path, full_disk, shared, photo):
    """Issue 32.D: ``eval --out`` and ``dataset`` shards on a full disk: exit 2, one line, no partial file."""
    folder, limit = full_disk
    photos = tmp_path / "photos"
    photos.mkdir()
    for index in range(2):
        Image.open(photo).rotate(90 * index).resize((64, 64)).save(photos / f"p{index}.png")
    result = _flowlift(
        "eval", photos, "--reference", photos, "-o", folder / "report", "--no-progress", cwd=tmp_path, preexec_fn=limit
    )
    assert result.returncode == 2, result.stderr
    line = _one_line(result, "eval")
    assert "cannot write " in line and str(folder / "report") in line
    result = _flowlift(
        "dataset",
        "images",
        photos,
        "--crop-px",
        "64",
        "--crops-per-image",
        "2",
        "--vae",
        shared / "models" / "taef2",
        "--device",
        "cpu",
        "-o",
        folder / "data",
        cwd=tmp_path,
        preexec_fn=limit,
    )
    assert result.returncode == 2, result.stderr
    line = _one_line(result, "dataset")
    assert "cannot write " in line and str(folder / "data") in line
    from flowlift.files.atomic import is_temporary

    left = [p for p in folder.rglob("*") if is_temporary(p) or p.suffix == ".safetensors"]
    assert left == [], left


def test_a_checkpoint_write_removes_only_its_own_runs_partial_folders(tmp_path):
    """Issue 32.E in training: a killed checkpoint write's folder is removed by the same run (its run id
    is inside from the start); folders that only look like one, or another run's, stay."""
    from torch.optim.swa_utils import AveragedModel

    from flowlift.models.upscaler_unet import FlowUpscalerUNet
    from flowlift.training.checkpoints import RUN_ID_NAME, save_checkpoint
    from flowlift.training.config import build_config

    model = FlowUpscalerUNet(base_channels=32, time_dim=32, cond_dim=32, dropout=0.0)
    ema = AveragedModel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    config = build_config(
        None,
        {
            "data": str(tmp_path / "data"),
            "output": str(tmp_path / "run"),
            "base_channels": 32,
            "time_dim": 32,
            "cond_dim": 32,
        },
    )
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    kept = {}
    for name, run_id in (
        ("step-00000002.partial", "mine"),
        (".step-00000002.aaaa.partial", None),
        (".step-00000002.bbbb.partial", "another run"),
    ):
        (root / name).mkdir()
        (root / name / "notes.txt").write_text("the user's")
        if run_id:
            (root / name / RUN_ID_NAME).write_text(run_id)
        kept[name] = sorted(p.name for p in (root / name).iterdir())
    killed = root / ".step-00000001.cccc.partial"  # this run's, killed mid-write
    killed.mkdir()
    (killed / RUN_ID_NAME).write_text("mine")
    (killed / "ema.safetensors").write_bytes(b"half")
    save_checkpoint(tmp_path / "run", 2, model, ema, optimizer, scheduler, 2, 1, config=config, run_id="mine")
    assert not killed.exists()
    for name, files in kept.items():
        assert sorted(p.name for p in (root / name).iterdir()) == files, name
    assert sorted(p.name for p in root.iterdir()) == sorted([*kept, "latest", "step-00000002"])


def test_the_app_prunes_only_its_own_old_result_folders(tmp_path):
    """Issue 32.E in the web app: a work_dir given by the caller may hold their own ``r-...`` folders."""
    from flowlift.app.service import AppConfig, AppService

    service = AppService(AppConfig(work_dir=tmp_path))
    users = tmp_path / "r-2024-holiday"
    users.mkdir()
    (users / "photo.jpg").write_bytes(b"the user's")
    old = service.new_result_dir()  # the app's own, then left for two hours
    (old / "a_x2.png").write_bytes(b"result")
    hours_ago = time.time() - 7200
    for path in (users, old):
        os.utime(path, (hours_ago, hours_ago))
    fresh = service.new_result_dir()
    assert not old.exists() and fresh.is_dir()
    assert (users / "photo.jpg").read_bytes() == b"the user's"


def test_a_regular_file_flowlift_did_not_write_is_replaced_only_with_overwrite(
    tmp_path, shared, tiny_weights, model_dir, embeds_file, photo
):
    """Issue 32.F: a text file or a truncated picture without flowlift's metadata at an output name is the
    user's, in img2img as in upscale (it used to be redone as 'broken'); an empty file is replaced."""
    picture = (shared / "images" / "kodak" / "kodim23.png").read_bytes()
    theirs = {"notes.png": b"my notes\n", "cut.png": picture[: len(picture) // 2]}
    out = tmp_path / "out"
    out.mkdir()
    for name, content in theirs.items():
        (out / name).write_bytes(content)
        result = _flowlift(
            *_refine_argv("img2img", photo, model_dir, embeds_file, tiny_weights, out / name), cwd=tmp_path
        )
        assert result.returncode == 2 and "was not written by flowlift" in _one_line(result, "img2img")
        assert (out / name).read_bytes() == content
    (out / "empty.png").write_bytes(b"")
    argv = _refine_argv("img2img", photo, model_dir, embeds_file, tiny_weights, out / "empty.png")
    assert _flowlift(*argv, cwd=tmp_path).returncode == 0
    for stem, content in (("notes", theirs["notes.png"]), ("cut", theirs["cut.png"])):
        Image.open(photo).save(tmp_path / f"{stem}.png")
        (out / f"{stem}_x2.png").write_bytes(content)
    argv = _upscale_argv(shared, tiny_weights, tmp_path / "notes.png", tmp_path / "cut.png", out=out)
    result = _flowlift(*argv, cwd=tmp_path)
    assert result.returncode == 1 and result.stderr.count("was not written by flowlift") == 2, result.stderr
    assert (out / "notes_x2.png").read_bytes() == theirs["notes.png"]
    assert (out / "cut_x2.png").read_bytes() == theirs["cut.png"]
    assert _flowlift(*argv, "--overwrite", cwd=tmp_path).returncode == 0
    with Image.open(out / "cut_x2.png") as replaced:
        assert replaced.size == (128, 96)
