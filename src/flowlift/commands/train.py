"""``flowlift train``: train or fine-tune the Flow Upscaler on a dataset built by ``flowlift dataset``.

Settings come from ``--config`` (JSON or TOML, keys of :class:`flowlift.training.config.TrainConfig`),
then the dedicated flags, then ``--set key=value``. Run it under ``torchrun`` for data parallelism::

    python -m torch.distributed.run --standalone --nproc_per_node 8 -m flowlift train --config run.toml
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from flowlift.commands._options import add_output_option, add_vae_option, examples, knob_type, name_or_path
from flowlift.console import show_progress
from flowlift.errors import FlowliftError
from flowlift.training.config import TRAIN_KNOBS

NAME = "train"
HELP = "train or fine-tune the Flow Upscaler (rectified-flow distillation; single process or torchrun DDP)"
EXAMPLES = examples(
    "flowlift train --data data/photos --output runs/a --steps 2000 --batch-size 8 --vae taef2",
    "flowlift train --config run.toml --set ema_decay=0.9999 --print-config",
    "python -m torch.distributed.run --standalone --nproc_per_node 8 -m flowlift train --config run.toml",
)

# flag -> config field
_FLAGS = {
    "data": "data",
    "output": "output",
    "init": "init",
    "steps": "steps",
    "batch_size": "batch_size",
    "grad_accum": "grad_accum",
    "lr": "lr",
    "crop": "crop",
    "resume": "resume",
    "device": "device",
    "vae": "vae",
    "val_every": "val_every",
    "seed": "seed",
    "overwrite": "overwrite",
}


def _config_default(field: str) -> str:
    """`` (default: X; a --config file overrides it)`` from :class:`TrainConfig`'s own default."""
    from dataclasses import fields

    from flowlift.training.config import TrainConfig

    for item in fields(TrainConfig):
        if item.name == field:
            value = getattr(TrainConfig(), field)
            shown = "none" if value in (None, "", []) else value
            return f" (default: {shown}, unless --config sets it)"
    return " (default: none)"


def _type(field: str):
    """A flag's argparse type: its setting's knob (:data:`TRAIN_KNOBS`), the domain ``--set`` and files use too."""
    return knob_type(TRAIN_KNOBS[field])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = _config_default
    parser.add_argument(
        "--config", type=name_or_path, help="JSON or TOML file of training settings (default: none, built-in defaults)"
    )
    parser.add_argument("--data", type=name_or_path, help="dataset folder (from `flowlift dataset`)" + d("data"))
    add_output_option(parser, "run folder: logs, checkpoints, final flow_upscaler.safetensors" + d("output"))
    parser.add_argument(
        "--init",
        type=name_or_path,
        help="fine-tune from this Flow Upscaler checkpoint (file, folder or hub id)" + d("init"),
    )
    parser.add_argument("--steps", type=_type("steps"), help="total optimizer steps" + d("steps"))
    parser.add_argument(
        "--batch-size", type=_type("batch_size"), help="samples per process per micro-batch" + d("batch_size")
    )
    parser.add_argument(
        "--grad-accum", type=_type("grad_accum"), help="micro-batches per optimizer step" + d("grad_accum")
    )
    parser.add_argument("--lr", type=_type("lr"), help="peak learning rate" + d("lr"))
    parser.add_argument(
        "--crop-latent",
        dest="crop",
        type=_type("crop"),
        metavar="N",
        help="crop side in target-latent pixels, 1/8 of image pixels (multiple of 4; 0 = whole items)" + d("crop"),
    )
    parser.add_argument(
        "--resume", help="auto (latest checkpoint in --output), a checkpoint folder, or none" + d("resume")
    )
    parser.add_argument("--device", help="auto (CUDA if available, else cpu), cpu, cuda, cuda:N" + d("device"))
    parser.add_argument(
        "--overwrite",
        action="store_true",
        default=None,
        help="with --resume none: start a new run over the checkpoints already in --output",
    )
    add_vae_option(parser, "for validation" + d("vae"))
    parser.add_argument(
        "--val-images", nargs="+", help="held-out images (files, folders, globs) for validation" + d("val_images")
    )
    parser.add_argument(
        "--val-every", type=_type("val_every"), help="validate every K steps (0 = never)" + d("val_every")
    )
    parser.add_argument("--seed", type=_type("seed"), help="seed of data order, noise and initialisation" + d("seed"))
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other TrainConfig setting, e.g. --set ema_decay=0.9999 (repeatable; "
        "--print-config lists them all with their values)",
    )
    parser.add_argument("--print-config", action="store_true", help="print the resolved settings and exit")


def _settings(args: argparse.Namespace, overrides: dict) -> Any:
    """The run's :class:`TrainConfig`: ``--print-config`` shows it as the files and overrides give it; a run
    gets it whole and checked (:func:`~flowlift.training.config.build_config`)."""
    from flowlift.training.config import TrainConfig, apply_file, apply_overrides, build_config

    if not args.print_config:
        return build_config(args.config, overrides)
    config = TrainConfig()
    if args.config:
        config = apply_file(config, args.config)
    return apply_overrides(config, overrides)


def check(args: argparse.Namespace) -> None:
    """The settings checked as a run checks them, before ``flowlift launch`` starts any rank (a refused value is
    then one line, not one per rank)."""
    if not args.print_config:
        settings(args)


def settings(args: argparse.Namespace) -> Any:
    """The run's :class:`~flowlift.training.config.TrainConfig` from the command line: the flags, ``--set`` and
    the ``--config`` file (a refused value named as the user wrote it)."""
    from flowlift.training.config import parse_assignments

    overrides: dict = {}
    for flag, field in _FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            overrides[field] = value
    if args.val_images:
        overrides["val_images"] = list(args.val_images)
    assigned = parse_assignments(args.set)
    overrides.update(assigned)
    if show_progress(args) is False:  # progress true (the default): a bar on a terminal, lines elsewhere
        overrides.setdefault("progress", False)
    try:
        return _settings(args, overrides)
    except FlowliftError as error:
        given = [key for key in error.fields if key in assigned]
        if given:  # named as the user wrote it (--set crop=...), not as its flag
            raise FlowliftError(f"--set {given[0]}={assigned[given[0]]}: {error}") from None
        raise


def run(args: argparse.Namespace) -> int:
    config = settings(args)
    if args.print_config:
        print(json.dumps(config.to_dict(), indent=2))
        return 0

    from flowlift.training.trainer import Trainer

    summary = Trainer(config, config_file=args.config).run()
    import os

    if int(os.environ.get("RANK", "0")) == 0:
        weights = summary.get("weights", "(not finished: resume to continue)")
        if not summary["losses"]:  # resumed at its last step, stopped before its final weights: they are written
            print(f"step {summary['step']} was the last: nothing left to train; EMA weights: {weights}")
            return 0
        last = summary["losses"][-1][1]
        print(
            f"trained steps {summary['start_step']}->{summary['step']} "
            f"(world {summary['world_size']}, global batch {summary['global_batch']}), "
            f"last loss {last:.5f}; EMA weights: {weights}"
        )
    return 0
