"""``flowlift train``: train or fine-tune the Flow Upscaler on a dataset built by ``flowlift dataset``.

Settings come from ``--config`` (JSON or TOML, keys of :class:`flowlift.training.config.TrainConfig`),
then the dedicated flags, then ``--set key=value``. Run it under ``torchrun`` for data parallelism::

    python -m torch.distributed.run --standalone --nproc_per_node 8 -m flowlift.cli train --config run.toml
"""

from __future__ import annotations

import argparse
import json

from flowlift.commands._options import finite_float

NAME = "train"
HELP = "train or fine-tune the Flow Upscaler (rectified-flow distillation; single process or torchrun DDP)"

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="JSON or TOML file of training settings")
    parser.add_argument("--data", help="dataset folder (from `flowlift dataset`)")
    parser.add_argument("--output", help="run folder: logs, checkpoints, final flow_upscaler.safetensors")
    parser.add_argument("--init", help="fine-tune from this Flow Upscaler checkpoint (file, folder or hub id)")
    parser.add_argument("--steps", type=int, help="total optimizer steps")
    parser.add_argument("--batch-size", type=int, help="samples per process per micro-batch")
    parser.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=finite_float, help="peak learning rate")
    parser.add_argument("--crop", type=int, help="target-latent crop side (multiple of 4; 0 = whole items)")
    parser.add_argument("--resume", help="auto (default: latest checkpoint in --output), a checkpoint folder, or none")
    parser.add_argument("--device", help="auto, cpu, cuda")
    parser.add_argument("--overwrite", action="store_true", default=None,
                        help="with --resume none: start a new run over the checkpoints already in --output")
    parser.add_argument("--vae", help="VAE for validation (e.g. madebyollin/taef2 or a local folder)")
    parser.add_argument("--val-images", nargs="+", help="held-out images (files, folders, globs) for validation")
    parser.add_argument("--val-every", type=int, help="validate every K steps (0 = never)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any other TrainConfig setting, e.g. --set ema_decay=0.9999 (repeatable)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved settings and exit")


def run(args: argparse.Namespace) -> int:
    from flowlift.training.config import build_config, parse_assignments

    overrides: dict = {}
    for flag, field in _FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            overrides[field] = value
    if args.val_images:
        overrides["val_images"] = list(args.val_images)
    overrides.update(parse_assignments(args.set))
    if args.print_config:
        from flowlift.training.config import TrainConfig, apply_overrides, load_config_file

        config = TrainConfig()
        if args.config:
            config = apply_overrides(config, load_config_file(args.config))
        config = apply_overrides(config, overrides)
        print(json.dumps(config.to_dict(), indent=2))
        return 0
    config = build_config(args.config, overrides)

    from flowlift.training.trainer import Trainer

    summary = Trainer(config).run()
    import os

    if int(os.environ.get("RANK", "0")) == 0:
        last = summary["losses"][-1][1] if summary["losses"] else float("nan")
        weights = summary.get("weights", "(not finished: resume to continue)")
        print(
            f"trained steps {summary['start_step']}->{summary['step']} "
            f"(world {summary['world_size']}, global batch {summary['global_batch']}), "
            f"last loss {last:.5f}; EMA weights: {weights}"
        )
    return 0
