"""The files ``flowlift train`` writes into its ``--output`` folder, and the one replace rule applied to them.

A run writes, at fixed names: ``config.json``, ``train_log.csv``, ``val.csv`` (with validation),
``curves.png``, ``flow_upscaler.safetensors`` and ``checkpoints/`` (``step-NNNNNNNN/`` folders,
their hidden ``.step-NNNNNNNN.*.partial`` predecessors, the ``latest`` pointer). The project's replace
rule (issue 36.1), checked by :func:`check_run_folder` before any model or data loads:

* at every fixed name, only a regular file (or nothing) may be replaced: a link, FIFO, socket, device
  or folder there is one line, ``--overwrite`` or not (a FIFO is never opened, so it cannot hang
  the run); ``checkpoints`` must be a real folder, not a link;
* without ``--overwrite`` only an empty file or one flowlift's trainer wrote (recognised by its
  content: :data:`RECOGNISERS`) is replaced; anything else is the user's;
* no output is one of the run's input files (``--init``, ``--config``, validation images), by identity,
  except the run's own ``config.json`` given back as ``--config`` to resume from its saved settings
  (:func:`flowlift.files.output_paths.same_file_error`);
* ``--resume none --overwrite`` removes only what runs of flowlift made under ``checkpoints/``
  (:func:`flowlift_checkpoint_entries`: the pointer, and folders holding nothing but a checkpoint's
  own files), never a user's notes or another tool's checkpoints; and only after every check
  passed and the data, model and validation set loaded (:func:`remove_flowlift_checkpoints`).
"""

from __future__ import annotations

import os
import re
import shutil
import stat as stat_module
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flowlift.errors import FIELD_MARK, FlowliftError
from flowlift.files.atomic import remove_stale_temporaries, replace_refusal
from flowlift.files.json_input import parse_json
from flowlift.files.output_paths import folder_problem, same_file, same_file_error
from flowlift.files.own_files import replace_problem, safetensors_metadata
from flowlift.training.checkpoints import EMA_NAME, RAW_NAME, RUN_ID_NAME, STATE_NAME
from flowlift.training.config import TrainConfig
from flowlift.training.validation import CURVES_SOFTWARE, is_val_log

CONFIG_NAME = "config.json"
LOG_NAME = "train_log.csv"
VAL_NAME = "val.csv"
CURVES_NAME = "curves.png"
CHECKPOINTS_NAME = "checkpoints"
LATEST_NAME = "latest"
LOG_FIELDS = ["step", "loss", "lr", "grad_norm", "samples_per_s", "elapsed_s"]
#: The run folder's lock: held by the run training into it (:func:`hold_run_folder`).
LOCK_NAME = ".flowlift-train.lock"
_CHECKPOINT_FILES = {RUN_ID_NAME, STATE_NAME, EMA_NAME, RAW_NAME}
_STEP_NAME = re.compile(r"^step-\d{8}$")
_PARTIAL_NAME = re.compile(r"^\.step-\d{8}\..+\.partial$")
_HEAD_BYTES = 1 << 20  # a recogniser reads at most this much of a file


def _head(path: Path, limit: int = _HEAD_BYTES) -> bytes:
    with open(path, "rb") as handle:
        return handle.read(limit)


def _first_line(path: Path) -> str:
    return _head(path, 4096).split(b"\n", 1)[0].rstrip(b"\r").decode("utf-8", "replace")


def is_run_config(path: Path) -> bool:
    """A JSON object of :class:`TrainConfig` settings (with ``output`` and ``steps``): a run's ``config.json``."""
    fields = set(TrainConfig().to_dict())
    try:
        value = parse_json(_head(path))
    except ValueError:
        return False
    return isinstance(value, dict) and {"output", "steps"} <= set(value) <= fields


def is_train_log(path: Path) -> bool:
    """A CSV whose header is the trainer's (:data:`LOG_FIELDS`)."""
    return _first_line(path) == ",".join(LOG_FIELDS)


def is_curves(path: Path) -> bool:
    """A PNG whose ``Software`` text is :data:`CURVES_SOFTWARE` (the trainer writes it)."""
    from flowlift.files.image_outputs import read_metadata

    try:
        return read_metadata(path).get("Software") == CURVES_SOFTWARE
    except Exception:  # noqa: BLE001 - not an image: not flowlift's curves
        return False


def is_upscaler_weights(path: Path) -> bool:
    """A safetensors file whose metadata names the Flow Upscaler's architecture (what ``save_upscaler`` writes)."""
    metadata = safetensors_metadata(path)
    return metadata is not None and {"base_channels", "time_dim", "cond_dim"} <= set(metadata)


def is_latest_pointer(path: Path) -> bool:
    """A ``latest`` pointer: one checkpoint folder name (``step-NNNNNNNN``)."""
    return bool(_STEP_NAME.match(_head(path, 64).decode("utf-8", "replace").strip()))


#: Every fixed file name a run writes (relative to ``--output``) and how flowlift's own is recognised.
RECOGNISERS: dict[str, Callable[[Path], bool]] = {
    CONFIG_NAME: is_run_config,
    LOG_NAME: is_train_log,
    VAL_NAME: is_val_log,
    CURVES_NAME: is_curves,
    EMA_NAME: is_upscaler_weights,
    f"{CHECKPOINTS_NAME}/{LATEST_NAME}": is_latest_pointer,
}


def run_file_problem(path: Path, recognise: Callable[[Path], bool], overwrite: bool) -> str | None:
    """Why the run must not replace ``path``: not a regular file (never), or a non-empty file flowlift did
    not write (without ``overwrite``); None when it may (the one replace rule, :func:`replace_problem`)."""
    return replace_problem(path, recognise, overwrite, "train")


def _checkpoint_folder_is_flowlifts(folder: Path) -> bool:
    """A real folder holding only regular files of a checkpoint, among them its state or run id."""
    try:
        if not stat_module.S_ISDIR(os.lstat(folder).st_mode):
            return False
        names = set(os.listdir(folder))
        if not names <= _CHECKPOINT_FILES or not names & {STATE_NAME, RUN_ID_NAME}:
            return False
        return all(stat_module.S_ISREG(os.lstat(folder / name).st_mode) for name in names)
    except OSError:
        return False


def flowlift_checkpoint_entries(root: Path) -> tuple[list[Path], list[Path]]:
    """(what flowlift's runs made in ``root``, the ``step-*`` entries that are not flowlift's checkpoints).

    flowlift's: a ``latest`` pointer (:func:`is_latest_pointer`), and ``step-NNNNNNNN`` /
    ``.step-NNNNNNNN.*.partial`` folders that hold nothing but a checkpoint's own files. Everything
    else (a user's notes, another tool's checkpoints, a link) is in neither list or the second.
    """
    mine: list[Path] = []
    foreign: list[Path] = []
    if not root.is_dir() or root.is_symlink():
        return mine, foreign
    for entry in sorted(root.iterdir()):
        if entry.name == LATEST_NAME:
            if run_file_problem(entry, is_latest_pointer, overwrite=False) is None:
                mine.append(entry)
        elif _STEP_NAME.match(entry.name) or _PARTIAL_NAME.match(entry.name):
            (mine if _checkpoint_folder_is_flowlifts(entry) else foreign).append(entry)
    return mine, foreign


def _checkpoints_problem(config: TrainConfig, output: Path) -> str | None:
    root = output / CHECKPOINTS_NAME
    if not os.path.lexists(root):
        return None
    mode = os.lstat(root).st_mode
    if not stat_module.S_ISDIR(mode):
        return replace_refusal(root) or f"{root} exists and is not a folder; remove it or choose another --output"
    _, foreign = flowlift_checkpoint_entries(root)
    for entry in foreign:
        if refusal := replace_refusal(entry):
            return refusal  # a link or FIFO at a checkpoint name: never written through
        if not entry.is_dir():
            return f"{entry} exists and is a file, not a checkpoint folder; remove it or choose another --output"
    fresh = (config.resume or "none").strip().lower() == "none"
    if fresh and config.overwrite and foreign:
        return (
            f"{foreign[0]} is not a flowlift checkpoint (it holds other files); --resume none --overwrite "
            "removes only flowlift's checkpoints: move it away, or choose another --output"
        )
    return None


def run_inputs(config: TrainConfig, config_file: str | os.PathLike | None = None) -> dict[str, Any]:
    """The run's input files by field (``init``, ``config_file``, ``val_images``): no output is one."""
    from flowlift.files.images import list_images

    try:
        val_images = list_images(config.val_images) if config.val_images else []
    except FlowliftError:  # a missing one is named by the validation set's own loading, later
        val_images = [p for p in config.val_images if os.path.isfile(p)]
    return {"init": config.init or None, "config_file": config_file, "val_images": val_images}


def _inputs_it_may_replace(config_path: Path, inputs: dict[str, Any]) -> dict[str, Any]:
    """``inputs`` less ``--config`` when that is this run folder's own ``config.json`` (flowlift wrote it).

    Resuming a run from its saved settings (``--config OUT/config.json --output OUT``) rewrites the
    file it read: safe, as the config is read whole before anything is written, and the new file is
    written atomically. Any other identity (a user's own settings file at that name, an ``--init``
    or validation image that is an output) stays an input no output may replace.
    """
    given = inputs.get("config_file")
    if given is None or not same_file(config_path, given):
        return inputs
    try:
        own = stat_module.S_ISREG(os.lstat(config_path).st_mode) and is_run_config(config_path)
    except OSError:
        own = False
    return {role: paths for role, paths in inputs.items() if role != "config_file"} if own else inputs


def check_run_folder(config: TrainConfig, inputs: dict[str, Any] | None = None) -> None:
    """The replace rule (module docstring) for every file the run would write; one FlowliftError line.

    Reads nothing but the heads of regular files, so it is cheap and never blocks; writes nothing.
    """
    output = Path(config.output)
    if os.path.lexists(output) and not output.is_dir():
        raise FlowliftError(f"{FIELD_MARK} {output} exists and is not a folder", field="output")
    if problem := folder_problem(output):
        raise FlowliftError(problem)
    if config.data and os.path.isdir(output) and os.path.isdir(config.data) and os.path.samefile(output, config.data):
        raise FlowliftError(
            f"{FIELD_MARK} {output} is the {FIELD_MARK} folder; give the run a folder of its own",
            field=("output", "data"),
        )
    if problem := _checkpoints_problem(config, output):
        raise FlowliftError(problem)
    wanted = inputs if inputs is not None else run_inputs(config)
    for name, recognise in RECOGNISERS.items():
        path = output / name
        roles = _inputs_it_may_replace(path, wanted) if name == CONFIG_NAME else wanted
        if error := same_file_error(path, roles):
            raise error
        if problem := run_file_problem(path, recognise, config.overwrite):
            raise FlowliftError(problem)


def remove_flowlift_checkpoints(output: Path) -> list[Path]:
    """Remove what runs of flowlift made under ``output/checkpoints`` (:func:`flowlift_checkpoint_entries`),
    and the folder itself only when that leaves it empty; returns what was removed."""
    root = output / CHECKPOINTS_NAME
    mine, _ = flowlift_checkpoint_entries(root)
    for entry in mine:
        if entry.name == LATEST_NAME:
            entry.unlink(missing_ok=True)
            continue
        for name in _CHECKPOINT_FILES:  # only the checkpoint's own files, then the (now empty) folder
            (entry / name).unlink(missing_ok=True)
        try:
            entry.rmdir()
        except OSError:
            pass  # something arrived meanwhile: it stays
    remove_stale_temporaries(root)  # a killed pointer write's temporary folder (flowlift's own only)
    try:
        root.rmdir()
    except OSError:
        pass  # not empty: the user's files stay, and so does their folder
    return mine


def hold_run_folder(output: Path) -> int | None:
    """Hold ``output`` for this run: an exclusive advisory lock (``flock``) on its :data:`LOCK_NAME`, which the
    system releases when the returned descriptor is closed or the process ends, however it ends. One line when
    another run holds it: two runs into one folder interleaved their logs and left its ``config.json`` naming
    the other's seed. None where the system has no ``flock``.

    Held, the folder's partial checkpoints (``.step-*.partial``, flowlift's own files only) are a dead run's: they
    are removed (a run stopped during its first checkpoint left one under a run id no later run has, which the
    checkpoint writer's own clean-up never matched), and so is a killed ``latest`` pointer write's temporary
    folder (only a resume with ``--resume none --overwrite`` swept it)."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        return None
    descriptor = os.open(output / LOCK_NAME, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(descriptor)
        raise FlowliftError(
            f"{output} is in use by another flowlift train run (it holds {LOCK_NAME}); wait for that run to end, "
            "or train into another --output"
        ) from None
    for entry in (output / CHECKPOINTS_NAME).glob(".step-*.partial"):
        if _PARTIAL_NAME.match(entry.name) and _checkpoint_folder_is_flowlifts(entry):
            shutil.rmtree(entry, ignore_errors=True)
    remove_stale_temporaries(output / CHECKPOINTS_NAME)  # a killed ``latest`` write's (flowlift's own only)
    return descriptor


def release_run_folder(output: Path, descriptor: int) -> None:
    """Give up :func:`hold_run_folder`'s lock and remove its file (the folder is left as the run's files make it)."""
    try:
        (output / LOCK_NAME).unlink(missing_ok=True)
    except OSError:
        pass  # a folder made read-only meanwhile: the lock is released all the same
    os.close(descriptor)
