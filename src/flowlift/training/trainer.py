"""The Flow Upscaler trainer: rectified-flow velocity regression, single process or DDP.

Objective (per sample, ``x0`` the target latent, ``n`` noise, ``c`` the conditioning latent)::

    x_t = (1 - t) * x0 + t * n,       v* = n - x0,
    L   = mean || v_theta(x_t, 1000 t, c) - v* ||^2

With ``t = 1`` (the default, pure one-step distillation) ``x_t`` is the noise itself and the
model learns exactly the one Euler step the pipeline takes (``x0 = n - v``); distillation shards
provide the teacher's own noise ``n`` for each target.

Optimisation: AdamW; learning rate ``lr * warmup_cosine(step)``; global-norm gradient clipping;
gradient accumulation (``no_sync`` under DDP for all but the last micro-batch); an EMA copy of the
weights (``torch.optim.swa_utils.AveragedModel``) that is what gets released; bf16 autocast and
channels-last on CUDA.

Distributed: under ``torchrun`` (``WORLD_SIZE > 1``) the process group is initialised from the
environment (NCCL on CUDA, gloo on CPU), the model is wrapped in DDP, and each rank reads its own
slice of every global batch (:class:`~flowlift.training.shards.ShardStream`). Rank 0 writes logs,
checkpoints and validation.

Reproducibility: all randomness is a function of the seed and each sample's global stream position —
data through the stream, the Flow Upscaler's dropout masks through per-sample seeds
(:class:`~flowlift.models.upscaler_unet.SampleDropout`) — so a resumed run retraces the uninterrupted
one, and DDP with batch B on 2 ranks, or 2 accumulated micro-batches of B, match one process with
batch 2B, dropout included. (A custom ``model`` with its own ``nn.Dropout`` gets the global generator
reseeded per (step, micro-batch, rank) instead: reproducible on resume, but not layout-independent.)
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import time
import uuid
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from flowlift.errors import FlowliftError
from flowlift.files.atomic import atomic_write_text
from flowlift.models.upscaler_unet import set_dropout_seeds
from flowlift.training.config import TrainConfig
from flowlift.training.shards import ShardReader, ShardStream, TimeSampling, shard_name

STATE_NAME = "train_state.pt"
EMA_NAME = "flow_upscaler.safetensors"
RAW_NAME = "model.safetensors"
RUN_ID_NAME = "run_id"
LOG_FIELDS = ["step", "loss", "lr", "grad_norm", "samples_per_s", "elapsed_s"]


# ----------------------------------------------------------------------------------------------
# Pure pieces


def interpolate_flow(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``x_t = (1 - t) * x0 + t * noise`` with ``t`` of shape (B,) broadcast over (C, H, W)."""
    t = t.view(-1, *([1] * (x0.ndim - 1))).to(x0.dtype)
    return (1 - t) * x0 + t * noise


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The rectified-flow velocity ``v* = noise - x0`` (``dx_t/dt``)."""
    return noise - x0


def flow_matching_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``mean((v(x_t, 1000 t, cond) - (noise - x0))^2)`` over all elements of the batch."""
    x0, noise, cond, t = batch["target"], batch["noise"], batch["cond"], batch["t"]
    x_t = interpolate_flow(x0, noise, t)
    prediction = model(x_t, t * 1000.0, cond)
    return F.mse_loss(prediction.float(), velocity_target(x0, noise).float())


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> float:
    """Learning-rate multiplier at optimizer step ``step`` (0-based).

    Linear warm-up ``(step + 1) / warmup_steps`` for ``step < warmup_steps``, then cosine decay
    ``min_ratio + (1 - min_ratio) * (1 + cos(pi * p)) / 2`` with
    ``p = (step - warmup_steps) / max(1, total_steps - warmup_steps)`` clipped to [0, 1].
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, max(0.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def ema_decay_at(num_averaged: int, decay: float, warmup: bool) -> float:
    """EMA decay for the update after ``num_averaged`` updates: ``min(decay, (1 + n) / (10 + n))``
    with warm-up, else ``decay``."""
    return min(decay, (1.0 + num_averaged) / (10.0 + num_averaged)) if warmup else decay


def make_ema(model: torch.nn.Module, decay: float, warmup: bool) -> torch.optim.swa_utils.AveragedModel:
    """An :class:`~torch.optim.swa_utils.AveragedModel` doing ``ema <- d * ema + (1 - d) * w``
    with ``d = ema_decay_at(n, decay, warmup)`` (parameters and buffers)."""

    def multi_avg_fn(ema_params, model_params, num_averaged) -> None:
        d = ema_decay_at(int(num_averaged), decay, warmup)
        for e, p in zip(ema_params, model_params, strict=True):
            e.lerp_(p.to(e.dtype), 1.0 - d)

    return torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=multi_avg_fn, use_buffers=True)


def step_seed(seed: int, step: int, micro: int, rank: int) -> int:
    """Seed of the global torch generator (dropout) for one micro-batch on one rank."""
    return (seed * 1_000_003 + step * 7919 + micro * 104_729 + rank * 15_485_863) % (2**62)


def sample_seed(seed: int, position: int) -> int:
    """Dropout seed of the sample at global stream ``position`` (the same on any rank or micro-batch)."""
    return (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + 7) % (2**62)


def prefetched_batches(stream: ShardStream, start_step: int, end_step: int, micro_batches: int, depth: int = 2):
    """Yield ``(step, micro, batch)`` in order, reading up to ``depth`` batches ahead on one
    background thread (the stream is a pure function of its arguments, so order and content are
    exactly those of reading in the loop)."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    keys = ((step, micro) for step in range(start_step, end_step) for micro in range(micro_batches))
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="flowlift-data") as pool:
        pending: deque = deque()
        for key in keys:
            pending.append((key, pool.submit(stream.batch, *key)))
            if len(pending) > depth:
                (step, micro), future = pending.popleft()
                yield step, micro, future.result()
        while pending:
            (step, micro), future = pending.popleft()
            yield step, micro, future.result()


# ----------------------------------------------------------------------------------------------
# Distributed context


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    initialized_here: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

    def mean(self, value: float, device: torch.device) -> float:
        if self.world_size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device)
        torch.distributed.all_reduce(tensor)
        return float(tensor.item()) / self.world_size

    def close(self) -> None:
        if self.initialized_here and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def init_distributed(device_kind: str) -> DistContext:
    """Join the process group set up by ``torchrun`` (``WORLD_SIZE``/``RANK``/``LOCAL_RANK`` in the
    environment), NCCL on CUDA and gloo on CPU; a plain single process otherwise."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistContext()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    created = False
    if not torch.distributed.is_initialized():
        backend = "nccl" if device_kind == "cuda" else "gloo"
        torch.distributed.init_process_group(backend=backend)
        created = True
    return DistContext(rank=rank, world_size=world_size, local_rank=local_rank, initialized_here=created)


def pick_device(setting: str, dist: DistContext) -> torch.device:
    from flowlift.devices import resolve_device

    device = resolve_device(setting)
    if device.type == "cuda":
        if dist.world_size > 1 or device.index is None:
            device = torch.device("cuda", dist.local_rank if dist.world_size > 1 else (device.index or 0))
        torch.cuda.set_device(device)
    return device


# ----------------------------------------------------------------------------------------------
# Checkpoints


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


def latest_checkpoint(output: Path) -> Path | None:
    """The checkpoint ``output/checkpoints/latest`` names, or None when the folder holds no checkpoints.

    A pointer to a missing or incomplete checkpoint, or checkpoints without a pointer, raise one
    FlowliftError line: silently starting from step 0 would then overwrite and prune that run's files.
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
    if not name or not (path / STATE_NAME).is_file():
        raise FlowliftError(
            f"{pointer} names {name or '(nothing)'}, which is missing or incomplete; pass --resume with a complete "
            "checkpoint folder, or --resume none --overwrite to start over"
        )
    return path


def checkpoint_run_id(path: Path) -> str | None:
    """The id of the run that wrote checkpoint folder ``path`` (its ``run_id`` file), or None."""
    try:
        return (path / RUN_ID_NAME).read_text().strip() or None
    except OSError:
        return None


class StopRequest:
    """SIGINT/SIGTERM during training: the first one asks the loop to stop after the current step
    (with a checkpoint); a second one interrupts at once. Handlers are restored on exit."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> StopRequest:
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        import signal

        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if hasattr(model, "module") else model


# ----------------------------------------------------------------------------------------------
# The trainer


class Trainer:
    """One training run described by a :class:`TrainConfig`. ``run()`` trains and returns a summary.

    ``model`` may be passed to train a custom module with the upscaler's call signature; by default a
    :class:`~flowlift.models.upscaler_unet.FlowUpscalerUNet` is built (or loaded from ``config.init``).
    """

    def __init__(self, config: TrainConfig, model: torch.nn.Module | None = None) -> None:
        config.validate()
        if config.steps < config.warmup_steps:
            warnings.warn(
                f"steps {config.steps} < warmup_steps {config.warmup_steps}: the run ends inside the warm-up and "
                f"never reaches lr {config.lr:g} (it peaks at {config.lr * config.steps / config.warmup_steps:.3g}); "
                "lower warmup_steps (--set warmup_steps=N)",
                UserWarning,
                stacklevel=2,
            )
        self.config = config
        self.output = Path(config.output)
        self._custom_model = model
        self.run_id = uuid.uuid4().hex  # replaced by the checkpoint's own when resuming

    # -- set-up ----------------------------------------------------------------------------------
    def _build_model(self) -> torch.nn.Module:
        from flowlift.models.upscaler_unet import FlowUpscalerUNet
        from flowlift.models.upscaler_weights import load_upscaler

        c = self.config
        if self._custom_model is not None:
            return self._custom_model
        torch.manual_seed(c.seed)
        if c.init:
            loaded = load_upscaler(c.init, device="cpu", dtype=torch.float32)
            contradicted = init_contradictions(c, loaded.config)
            if contradicted:
                raise FlowliftError(
                    f"--init {c.init} is a model with {contradicted}; drop those settings or train from scratch"
                )
            model = FlowUpscalerUNet(**loaded.config, dropout=c.dropout)
            model.load_state_dict(loaded.state_dict(), strict=True)
            return model
        return FlowUpscalerUNet(
            base_channels=c.base_channels, time_dim=c.time_dim, cond_dim=c.cond_dim, dropout=c.dropout
        )

    def _autocast(self, device: torch.device):
        c = self.config
        use_bf16 = c.mixed_precision == "bf16" or (c.mixed_precision == "auto" and device.type == "cuda")
        if use_bf16:
            return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        return nullcontext()

    # -- logging ---------------------------------------------------------------------------------
    def _open_log(self, start_step: int) -> None:
        """Create train_log.csv, or keep only the rows up to ``start_step`` of a resumed run."""
        path = self.output / "train_log.csv"
        rows = []
        if path.is_file() and start_step > 0:
            with path.open(newline="") as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= start_step]
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=LOG_FIELDS)
            writer.writeheader()
            writer.writerows(rows)

    def _append_log(self, row: dict[str, Any]) -> None:
        with (self.output / "train_log.csv").open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=LOG_FIELDS).writerow(row)

    # -- checkpoints -----------------------------------------------------------------------------
    def _save_checkpoint(self, step: int, model, ema, optimizer, scheduler, global_batch: int, world: int) -> Path:
        from flowlift.models.upscaler_weights import save_upscaler

        final = checkpoint_dir(self.output, step)
        tmp = final.with_name(final.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_upscaler(ema.module, tmp / EMA_NAME)
        save_upscaler(_unwrap(model), tmp / RAW_NAME)
        state = {
            "step": step,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "ema_num_averaged": int(ema.n_averaged.item()),
            "global_batch": global_batch,
            "world_size": world,
            "config": self.config.to_dict(),
            "rng": {"torch": torch.get_rng_state()},
            "run_id": self.run_id,
        }
        torch.save(state, tmp / STATE_NAME)
        (tmp / RUN_ID_NAME).write_text(self.run_id)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = self.output / "checkpoints" / "latest"
        atomic_write_text(pointer, final.name)
        # Only this run's checkpoints are pruned: another run in the same folder (higher steps, or an
        # older layout without run ids) is never touched.
        mine = [p for p in checkpoint_folders(self.output) if checkpoint_run_id(p) == self.run_id]
        for old in mine[: -self.config.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def _load_checkpoint(self, path: Path, model, ema, optimizer, scheduler, global_batch: int) -> int:
        from flowlift.models.weights import load_strict, read_state_dict

        state = torch.load(path / STATE_NAME, map_location="cpu", weights_only=True)
        if state["global_batch"] != global_batch:
            raise FlowliftError(
                f"checkpoint {path} was trained with a global batch of {state['global_batch']} samples, "
                f"this run has {global_batch} (world size x batch size x grad accumulation); "
                "keep the global batch to continue the same run"
            )
        load_strict(_unwrap(model), read_state_dict(path / RAW_NAME), what="checkpoint weights", origin=str(path))
        load_strict(ema.module, read_state_dict(path / EMA_NAME), what="checkpoint EMA weights", origin=str(path))
        ema.n_averaged.fill_(int(state["ema_num_averaged"]))
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        self.run_id = str(state.get("run_id") or checkpoint_run_id(path) or self.run_id)
        return int(state["step"])

    def _resume_point(self) -> Path | None:
        """The checkpoint to continue from, or None for a fresh run; refuses to start over another run."""
        c = self.config
        mode = (c.resume or "none").strip()
        if mode.lower() == "none":
            existing = checkpoint_folders(self.output)
            if existing and not c.overwrite:
                raise FlowliftError(
                    f"{self.output} already holds {len(existing)} training checkpoint(s) (last {existing[-1].name}); "
                    "--resume none would start a new run over them: pass --overwrite to replace them, "
                    "or --resume auto to continue"
                )
            return None
        resume_from = latest_checkpoint(self.output) if mode == "auto" else Path(mode)
        if resume_from is not None and not (resume_from / STATE_NAME).is_file():
            raise FlowliftError(f"{resume_from} is not a flowlift training checkpoint (no {STATE_NAME})")
        return resume_from

    def _non_finite_message(self, stream: ShardStream, step: int) -> str:
        """Why step ``step``'s gradient is non-finite: corrupt data (named) or, if the data is fine, training."""
        reader = stream.reader
        for micro in range(self.config.grad_accum):
            for position in stream.positions(step, micro):
                index = stream.item_at(position)
                for name, tensor in reader.item(index).items():
                    if not bool(torch.isfinite(tensor).all()):
                        shard = reader.root / shard_name(index // reader.shard_size)
                        return (f"non-finite gradient at step {step + 1}: the training data is non-finite "
                                f"({shard}, item {index}, tensor '{name}' holds NaN/Inf); rebuild that shard")
        return f"non-finite gradient at step {step + 1} (the data of this step is finite); lower the learning rate"

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        c = self.config
        preliminary = "cuda" if (c.device.startswith("cuda") or (c.device == "auto" and torch.cuda.is_available())) \
            else "cpu"
        dist = init_distributed(preliminary)
        try:
            return self._run(dist)
        finally:
            dist.close()

    def _run(self, dist: DistContext) -> dict[str, Any]:
        c = self.config
        device = pick_device(c.device, dist)
        resume_from = self._resume_point()
        if resume_from is None and c.overwrite and dist.is_main:
            # --overwrite: the previous run's checkpoints go, so that nothing can resume into a mix of both
            shutil.rmtree(self.output / "checkpoints", ignore_errors=True)
        reader = ShardReader(c.data)
        if len(reader) == 0:
            raise FlowliftError(f"{c.data}: dataset has no complete items")
        stream = ShardStream(
            reader,
            micro_batch=c.batch_size,
            crop=c.crop or None,
            seed=c.seed,
            rank=dist.rank,
            world_size=dist.world_size,
            grad_accum=c.grad_accum,
            time_sampling=TimeSampling(c.t_sampling, c.t_value, c.t_low, c.t_high, c.t_mean, c.t_std),
            use_stored_noise=c.use_stored_noise,
        )
        model = self._build_model().to(device)  # a bad --init fails here, before anything is written
        if dist.is_main:
            self.output.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        channels_last = c.channels_last == "yes" or (c.channels_last == "auto" and device.type == "cuda")
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        model.train()
        ema = make_ema(model, c.ema_decay, c.ema_warmup)
        decay, no_decay = [], []
        for name, param in model.named_parameters():
            (no_decay if param.ndim <= 1 or name.endswith(".bias") else decay).append(param)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": c.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=c.lr,
            betas=(c.adam_beta1, c.adam_beta2),
            eps=c.adam_eps,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: warmup_cosine(s, c.warmup_steps, c.steps, c.min_lr_ratio)
        )

        start_step = 0
        if resume_from is not None:
            start_step = self._load_checkpoint(resume_from, model, ema, optimizer, scheduler, stream.global_batch)

        if dist.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        else:
            ddp = model

        if dist.is_main:
            (self.output / "config.json").write_text(json.dumps(c.to_dict(), indent=2))
            self._open_log(start_step)
        validator = None
        if c.val_every and dist.is_main:
            from flowlift.training.validation import Validator

            validator = Validator.from_config(c, device=device, output=self.output, start_step=start_step)

        end_step = c.steps if c.stop_after is None else min(c.steps, c.stop_after)
        losses: list[tuple[int, float]] = []
        started = time.perf_counter()
        window_start, window_samples = time.perf_counter(), 0
        from tqdm.auto import tqdm

        bar = tqdm(total=c.steps, initial=start_step, desc="train", disable=not (c.progress and dist.is_main),
                   dynamic_ncols=True)
        batches = prefetched_batches(stream, start_step, end_step, c.grad_accum)
        final_step = start_step
        stop = StopRequest()
        with stop:
            for step in range(start_step, end_step):
                optimizer.zero_grad(set_to_none=True)
                step_loss = 0.0
                for micro in range(c.grad_accum):
                    fetched_step, fetched_micro, cpu_batch = next(batches)
                    assert (fetched_step, fetched_micro) == (step, micro)
                    batch = {k: v.to(device, non_blocking=True) for k, v in cpu_batch.items()}
                    if channels_last:
                        batch = {k: (v.contiguous(memory_format=torch.channels_last) if v.ndim == 4 else v)
                                 for k, v in batch.items()}
                    torch.manual_seed(step_seed(c.seed, step, micro, dist.rank))  # custom models' own dropout
                    set_dropout_seeds(model, [sample_seed(c.seed, p) for p in stream.positions(step, micro)])
                    sync = micro == c.grad_accum - 1 or dist.world_size == 1
                    context = nullcontext() if sync else ddp.no_sync()
                    with context:
                        with self._autocast(device):
                            loss = flow_matching_loss(ddp, batch)
                        (loss / c.grad_accum).backward()
                    step_loss += float(loss.detach()) / c.grad_accum
                if c.grad_clip > 0:
                    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip))
                else:
                    grad_norm = float(torch.linalg.vector_norm(
                        torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])))
                if not math.isfinite(grad_norm):
                    raise FlowliftError(self._non_finite_message(stream, step))
                lr = optimizer.param_groups[0]["lr"]
                optimizer.step()
                scheduler.step()
                ema.update_parameters(model)
                global_loss = dist.mean(step_loss, device)
                done = final_step = step + 1
                last = done == end_step
                if c.time_limit_s > 0 and not last:
                    # every rank must stop at the same step: stop when any rank is out of time
                    out_of_time = float(time.perf_counter() - started > c.time_limit_s)
                    last = dist.mean(out_of_time, device) > 0
                if not last and (stop.requested or dist.world_size > 1):
                    # Ctrl-C / SIGTERM: finish this step, save it, stop (all ranks at the same step)
                    last = dist.mean(float(stop.requested), device) > 0
                    stop.requested = stop.requested or last
                losses.append((done, global_loss))
                window_samples += stream.global_batch
                bar.update(1)
                if dist.is_main and (done % c.log_every == 0 or last):
                    now = time.perf_counter()
                    self._append_log({
                        "step": done, "loss": f"{global_loss:.6g}", "lr": f"{lr:.6g}", "grad_norm": f"{grad_norm:.6g}",
                        "samples_per_s": f"{window_samples / max(now - window_start, 1e-9):.4g}",
                        "elapsed_s": f"{now - started:.2f}",
                    })
                    bar.set_postfix(loss=f"{global_loss:.4f}")
                    window_start, window_samples = now, 0
                if done % c.checkpoint_every == 0 or last:
                    if dist.is_main:
                        self._save_checkpoint(done, model, ema, optimizer, scheduler, stream.global_batch,
                                              dist.world_size)
                    dist.barrier()
                if c.val_every and (done % c.val_every == 0 or done == c.steps or last) and not stop.requested:
                    if validator is not None:
                        validator.evaluate(done, ema.module)
                    dist.barrier()
                if last:
                    break
        bar.close()
        batches.close()
        if stop.requested:
            reader.close()
            raise KeyboardInterrupt(f"training stopped after step {final_step}; checkpoint saved")
        summary: dict[str, Any] = {
            "start_step": start_step,
            "step": final_step,
            "losses": losses,
            "output": str(self.output),
            "world_size": dist.world_size,
            "global_batch": stream.global_batch,
        }
        if dist.is_main:
            if final_step >= c.steps:
                from flowlift.models.upscaler_weights import save_upscaler

                summary["weights"] = str(save_upscaler(ema.module, self.output / EMA_NAME))
            if validator is not None:
                validator.plot(self.output / "curves.png")
            else:
                from flowlift.training.validation import plot_curves

                plot_curves(self.output / "train_log.csv", None, self.output / "curves.png")
        reader.close()
        return summary
