"""Training checkpoints: the folder layout, writing, reading and choosing the one to resume from.

A checkpoint ``output/checkpoints/step-NNNNNNNN`` holds the EMA and raw weights in the released
layout, the optimizer/scheduler/RNG state and the id of the run that wrote it; ``latest`` names the
newest. Writes go through a fresh hidden ``.step-NNNNNNNN.XXXX.partial`` folder that holds the run id
from its first moment, so the next write of the same run removes a killed write's folder and nothing
else; only the writing run's own checkpoints are pruned or replaced. A checkpoint written again (a
resume from an earlier one) is swapped in without a moment where no complete copy of it is on disk:
the old folder is first renamed aside to a hidden ``.step-NNNNNNNN.XXXX.replaced.partial`` name.
The training state records the identity of the data it was trained on
(:func:`flowlift.training.data_identity.dataset_identity`).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flowlift.errors import FlowliftError
from flowlift.files.atomic import atomic_write_text
from flowlift.training.config import TrainConfig
from flowlift.training.data_identity import check_same_data

STATE_NAME = "train_state.pt"
EMA_NAME = "flow_upscaler.safetensors"
RAW_NAME = "model.safetensors"
RUN_ID_NAME = "run_id"
#: The files every complete checkpoint folder holds (``run_id`` is absent from older layouts).
COMPLETE_FILES = (STATE_NAME, EMA_NAME, RAW_NAME)
#: How a checkpoint set aside while its step is written again ends (see :func:`_swap_in`).
ASIDE_SUFFIX = ".replaced.partial"
_STEP_NAME = re.compile(r"step-\d{8}")

#: Architecture settings an ``--init`` checkpoint fixes (its own config wins; a contradiction is an error).
ARCHITECTURE_FIELDS = ("base_channels", "time_dim", "cond_dim")


def init_contradictions(config: TrainConfig, init_config: dict[str, Any]) -> str:
    """``"base_channels 384 (not 64), ..."`` for architecture settings changed from their defaults that the
    ``--init`` checkpoint contradicts; empty when none. Settings left at their defaults follow the checkpoint."""
    defaults = TrainConfig()
    clashes = []
    for name in ARCHITECTURE_FIELDS:
        wanted, actual = getattr(config, name), init_config.get(name)
        if wanted != getattr(defaults, name) and actual is not None and int(actual) != int(wanted):
            clashes.append(f"{name} {actual} (not {wanted})")
    return ", ".join(clashes)


def checkpoint_dir(output: Path, step: int) -> Path:
    return output / "checkpoints" / f"step-{step:08d}"


def checkpoint_folders(output: Path) -> list[Path]:
    """Complete-looking checkpoint folders ``output/checkpoints/step-*`` (not ``.partial``), by step."""
    root = output / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".partial"))


def is_complete(path: Path) -> bool:
    """``path`` is a folder holding every file of a checkpoint (:data:`COMPLETE_FILES`)."""
    return path.is_dir() and all((path / name).is_file() for name in COMPLETE_FILES)


def latest_checkpoint(output: Path) -> Path | None:
    """The checkpoint ``output/checkpoints/latest`` names, or None when the folder holds no checkpoints.

    Checkpoints without a pointer, or a pointer to an incomplete checkpoint, raise one FlowliftError line:
    silently starting from step 0 would then overwrite and prune that run's files. A pointer to a missing
    checkpoint names what to do (:func:`_missing_pointer_refusal`).
    """
    root = output / "checkpoints"
    pointer = root / "latest"
    if not pointer.is_file():
        existing = checkpoint_folders(output)
        if existing:
            raise FlowliftError(
                f"{root} holds {len(existing)} checkpoint(s) but no 'latest' pointer; pass --resume "
                f"{existing[-1]} (or another checkpoint folder), or --resume none --overwrite to start over"
            )
        return None
    name = pointer.read_text().strip()
    path = root / name
    if name and (path / STATE_NAME).is_file():
        return path
    if _STEP_NAME.fullmatch(name) and not os.path.lexists(path):
        raise _missing_pointer_refusal(root, name)
    raise FlowliftError(
        f"{pointer} names {name or '(nothing)'}, which is missing or incomplete; pass --resume with a complete "
        "checkpoint folder, or --resume none --overwrite to start over"
    )


def _missing_pointer_refusal(root: Path, name: str) -> FlowliftError:
    """The one line for a ``root/latest`` naming ``name``, a checkpoint that is not there. When a stopped rewrite set
    its complete copy aside (:data:`ASIDE_SUFFIX`; the next run's hold of the folder would delete it), the line says
    how to put it back; otherwise it names the newest complete checkpoint to pass to ``--resume``. Never a silent
    pick: the missing one may have been removed on purpose, or by a failing disk."""
    pointer = root / "latest"
    aside = [p for p in sorted(root.glob(f".{name}.*{ASIDE_SUFFIX}")) if is_complete(p)]
    if aside:
        return FlowliftError(
            f"{pointer} names {name}, which is missing: a rewrite of it was stopped and left the complete checkpoint "
            f"{aside[-1].name}; put it back (mv {aside[-1]} {root / name}) and run again"
        )
    complete = [p for p in checkpoint_folders(root.parent) if is_complete(p)]
    if complete:
        return FlowliftError(
            f"{pointer} names {name}, which is missing; to continue from the newest complete checkpoint pass "
            f"--resume {complete[-1]}, or --resume none --overwrite to start over"
        )
    return FlowliftError(
        f"{pointer} names {name}, which is missing, and {root} holds no complete checkpoint; pass --resume with a "
        "checkpoint folder, or --resume none --overwrite to start over"
    )


def checkpoint_run_id(path: Path) -> str | None:
    """The id of the run that wrote checkpoint folder ``path`` (its ``run_id`` file), or None."""
    try:
        return (path / RUN_ID_NAME).read_text().strip() or None
    except OSError:
        return None


def resume_point(config: TrainConfig, output: Path) -> Path | None:
    """The checkpoint to continue from, or None for a fresh run; refuses to start over another run."""
    mode = (config.resume or "none").strip()
    if mode.lower() == "none":
        existing = checkpoint_folders(output)
        if existing and not config.overwrite:
            raise FlowliftError(
                f"{output} already holds {len(existing)} training checkpoint(s) (last {existing[-1].name}); "
                "--resume none would start a new run over them: pass --overwrite to replace them, "
                "or --resume auto to continue"
            )
        return None
    resume_from = latest_checkpoint(output) if mode == "auto" else Path(mode)
    if resume_from is not None and not (resume_from / STATE_NAME).is_file():
        raise FlowliftError(f"{resume_from} is not a flowlift training checkpoint (no {STATE_NAME})")
    return resume_from


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if hasattr(model, "module") else model


def save_checkpoint(
    output: Path,
    step: int,
    model,
    ema,
    optimizer,
    scheduler,
    global_batch: int,
    world: int,
    *,
    config: TrainConfig,
    run_id: str,
    data: dict[str, Any] | None = None,
) -> Path:
    """Write checkpoint ``step`` of run ``run_id`` under ``output`` (atomically), point ``latest`` at it and
    prune this run's older ones down to ``config.keep_checkpoints``. ``data``: the identity of the run's dataset
    (:func:`~flowlift.training.data_identity.dataset_identity`), which a resume compares."""
    from flowlift.files.atomic_set import deferred_stop_signals

    # A stop signal (a second Ctrl-C, a scheduler's repeated SIGTERM) waits until the checkpoint is whole: cut
    # short, the stop's own checkpoint was lost and its partial folder left behind (seconds of writing).
    with deferred_stop_signals():
        final = checkpoint_dir(output, step)
        final.parent.mkdir(parents=True, exist_ok=True)
        _remove_own_partials(final.parent, run_id)
        tmp = _write_partial(
            final,
            run_id,
            model,
            ema,
            lambda: _train_state(step, optimizer, scheduler, ema, global_batch, world, config, run_id, data),
        )
        _put_in_place(tmp, final, run_id)
        atomic_write_text(output / "checkpoints" / "latest", final.name)
        # Only this run's checkpoints are pruned: another run in the same folder (higher steps, or an
        # older layout without run ids) is never touched.
        mine = [p for p in checkpoint_folders(output) if checkpoint_run_id(p) == run_id]
        for old in mine[: -config.keep_checkpoints]:
            _discard(old)
    return final


def _train_state(step, optimizer, scheduler, ema, global_batch, world, config, run_id, data) -> dict[str, Any]:
    """What ``train_state.pt`` holds (:func:`read_train_state` reads it back)."""
    return {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "ema_num_averaged": int(ema.n_averaged.item()),
        "global_batch": global_batch,
        "world_size": world,
        "config": config.to_dict(),
        "rng": {"torch": torch.get_rng_state()},
        "run_id": run_id,
        "data": data,
    }


def _write_partial(final: Path, run_id: str, model, ema, state: Callable[[], dict[str, Any]]) -> Path:
    """Checkpoint ``final``'s files written into a fresh hidden partial folder beside it (the weights first, checked
    finite, then the training ``state()``); returns the folder. However the write ends early (non-finite weights, a
    full disk, an exception), nothing of it stays."""
    from flowlift.models.upscaler_weights import save_upscaler

    # a fresh hidden folder, never one that is there already; the run id goes in first, so that a
    # killed write's folder carries the proof of whose it is (issue 32.E: only that is ever removed)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent))
    try:
        (tmp / RUN_ID_NAME).write_text(run_id)
        try:
            save_upscaler(ema.module, tmp / EMA_NAME)
            save_upscaler(_unwrap(model), tmp / RAW_NAME)
        except FlowliftError as error:  # non-finite weights
            problem = str(error).split("; nothing written")[0].removeprefix("save_upscaler: ")
            raise FlowliftError(
                f"checkpoint {final} not written: {problem} (the training diverged: lower --lr or weight_decay)"
            ) from None
        torch.save(state(), tmp / STATE_NAME)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def _put_in_place(tmp: Path, final: Path, run_id: str) -> None:
    """The complete partial folder ``tmp`` renamed to ``final``; this run's own checkpoint there is replaced
    (:func:`_swap_in`), anything else there is refused (and ``tmp`` removed)."""
    if os.path.lexists(final) and (final.is_symlink() or not final.is_dir()):
        shutil.rmtree(tmp, ignore_errors=True)  # a link, FIFO or file at the name: never replaced or followed
        raise FlowliftError(f"{final} exists and is not a checkpoint folder of this run; it is not replaced")
    if final.exists():
        if checkpoint_run_id(final) != run_id:  # another run's checkpoint (resume_point refuses those first)
            shutil.rmtree(tmp, ignore_errors=True)
            raise FlowliftError(f"{final} is another run's checkpoint; it is not replaced")
        _swap_in(tmp, final)  # this run's own, written again after a resume
        return
    try:
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _aside_name(final: Path) -> Path:
    return final.parent / f".{final.name}.{uuid.uuid4().hex[:12]}{ASIDE_SUFFIX}"


def _swap_in(tmp: Path, final: Path) -> None:
    """Replace this run's checkpoint folder ``final`` by the complete one at ``tmp``, at no moment without a
    complete copy on disk (a folder cannot be renamed over a full one): the old one is renamed aside to a
    hidden partial name (it holds this run's id, so the run's next write, or the next run that holds the
    folder, removes it), the new one renamed in, and only then the old one deleted. Killed between the
    two renames, ``latest`` may name a missing folder: :func:`latest_checkpoint` handles that."""
    aside = _aside_name(final)
    try:
        os.replace(final, aside)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the old one is untouched: nothing of the new one stays
        raise
    try:
        os.replace(tmp, final)
    except BaseException:
        try:
            os.replace(aside, final)  # the old one back where it was
        except OSError:
            pass  # it stays aside, complete, where latest_checkpoint looks for it
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _discard(folder: Path) -> None:
    """Delete checkpoint ``folder`` as one rename: a deletion stopped midway leaves a hidden partial (removed by
    the run's next write), never a ``step-*`` folder that looks complete but lacks a file."""
    aside = _aside_name(folder)
    try:
        os.replace(folder, aside)
    except OSError:
        return  # gone already, or not ours to move: left as it is
    shutil.rmtree(aside, ignore_errors=True)


def _remove_own_partials(root: Path, run_id: str) -> None:
    """Delete the partial checkpoint folders a killed process of this run left (their run id file says
    so); anything else in ``root`` is never touched."""
    for folder in root.glob(".step-*.partial"):
        if folder.is_dir() and not folder.is_symlink() and checkpoint_run_id(folder) == run_id:
            shutil.rmtree(folder, ignore_errors=True)


#: The settings a resumed run keeps: they shape its trajectory (the samples, the model, the optimizer and schedule the
#: checkpoint's state belongs to). The saved optimizer and scheduler would override a new ``lr`` or
#: ``weight_decay`` while ``config.json`` recorded it; the others would make the run retrace another.
RESUME_KEPT = (
    "crop", "use_stored_noise", "base_channels", "time_dim", "cond_dim", "dropout", "t_sampling", "t_value",
    "t_low", "t_high", "t_mean", "t_std", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "adam_beta1",
    "adam_beta2", "adam_eps", "grad_clip", "ema_decay", "ema_warmup", "seed",
)  # fmt: skip
_STATE_KEYS = {"global_batch": int, "step": int, "optimizer": dict, "scheduler": dict, "ema_num_averaged": int}


def read_train_state(path: Path) -> dict:
    """``path``'s training state (``train_state.pt``, ``weights_only``), or one line naming it: a truncated,
    empty or foreign file, or one missing what a resume restores."""
    file = path / STATE_NAME
    fix = "resume from an earlier checkpoint (--resume FOLDER) or train into a new --output"
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - truncated, empty, a pickle weights_only refuses, another format
        text = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise FlowliftError(f"{file}: not a complete training state ({text[:120]}); {fix}") from None
    problems = [
        key for key, kind in _STATE_KEYS.items() if not isinstance(state, dict) or not _is(state.get(key), kind)
    ]
    rng = state.get("rng", {}).get("torch") if isinstance(state, dict) and isinstance(state.get("rng"), dict) else None
    if not isinstance(rng, torch.Tensor) or rng.dtype != torch.uint8:
        problems.append("rng")
    if not problems and (state["step"] < 0 or state["global_batch"] < 1):
        problems.append("step" if state["step"] < 0 else "global_batch")
    if problems:
        raise FlowliftError(f"{file}: not a flowlift training state (bad or missing {', '.join(problems)}); {fix}")
    return state


def _is(value: object, kind: type) -> bool:
    return isinstance(value, kind) and not isinstance(value, bool)


def check_kept_settings(path: Path, saved: object, config) -> None:
    """One line when this run's :data:`RESUME_KEPT` settings differ from those checkpoint ``path`` was trained with
    (``saved``: its config as a dict; a checkpoint without one is not compared)."""
    if not isinstance(saved, dict):
        return
    now = config.to_dict()
    changed = [
        f"{key} {saved[key]!r} -> {now.get(key)!r}"
        for key in RESUME_KEPT
        if key in saved and saved[key] != now.get(key)
    ]
    if changed:
        raise FlowliftError(
            f"checkpoint {path} was trained with other settings ({'; '.join(changed)}): a resumed run keeps them "
            "(flowlift train --config OUT/config.json --output OUT); to start from its weights with new settings, "
            f"train into a new --output with --init {path}"
        )


def load_checkpoint(
    path: Path,
    model,
    ema,
    optimizer,
    scheduler,
    global_batch: int,
    run_id: str,
    config=None,
    data: dict[str, Any] | None = None,
) -> tuple[int, str]:
    """Restore checkpoint ``path`` into the run's objects; its step and run id (its own, else ``run_id``). With the
    run's ``config``, its :data:`RESUME_KEPT` settings must be the checkpoint's (:func:`check_kept_settings`); with
    the run's ``data`` identity, so must its dataset (:func:`~flowlift.training.data_identity.check_same_data`)."""
    from flowlift.models.weights import load_strict, read_state_dict

    state = read_train_state(path)
    if state["global_batch"] != global_batch:
        raise FlowliftError(
            f"checkpoint {path} was trained with a global batch of {state['global_batch']} samples, "
            f"this run has {global_batch} (world size x batch size x grad accumulation); "
            "keep the global batch to continue the same run"
        )
    if config is not None:
        check_kept_settings(path, state.get("config"), config)
    check_same_data(path, state.get("data"), data)
    load_strict(_unwrap(model), read_state_dict(path / RAW_NAME), what="checkpoint weights", origin=str(path))
    load_strict(ema.module, read_state_dict(path / EMA_NAME), what="checkpoint EMA weights", origin=str(path))
    ema.n_averaged.fill_(int(state["ema_num_averaged"]))
    try:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    except (KeyError, ValueError, TypeError, RuntimeError) as error:
        raise FlowliftError(f"{path / STATE_NAME}: its optimizer state does not fit this model ({error})") from None
    torch.set_rng_state(state["rng"]["torch"])
    run_id = str(state.get("run_id") or checkpoint_run_id(path) or run_id)
    return int(state["step"]), run_id


def check_steps_left(path: Path, step: int, config) -> None:
    """One line when the run resumed from checkpoint ``path`` (at ``step``) has no step left to train: ``steps`` or
    ``stop_after`` at or below it (it trained nothing, wrote its final weights again and said "last loss nan")."""
    if step >= config.steps:
        raise FlowliftError(
            f"{config.output} is already at step {step} (checkpoint {path}) of --steps {config.steps}: nothing to "
            "train; raise --steps to train on"
        )
    if config.stop_after is not None and step >= config.stop_after:
        raise FlowliftError(
            f"{config.output} is already at step {step} (checkpoint {path}): --set stop_after={config.stop_after} "
            "ends this run before its first step; raise it or leave it out"
        )
