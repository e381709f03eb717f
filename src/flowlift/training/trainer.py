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
import io
import json
import math
import time
import uuid
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flowlift.errors import FlowliftError
from flowlift.files.atomic import append_text, atomic_write_text
from flowlift.models.upscaler_unet import set_dropout_seeds
from flowlift.training.checkpoints import (
    EMA_NAME,
    check_steps_left,
    checkpoint_dir,
    init_contradictions,
    load_checkpoint,
    resume_point,
    save_checkpoint,
)
from flowlift.training.config import TrainConfig, saved_settings
from flowlift.training.data_identity import agreed_identity, dataset_identity
from flowlift.training.distributed import DistContext, init_distributed, pick_device
from flowlift.training.loop_support import StopRequest, prefetched_batches
from flowlift.training.objective import flow_matching_loss, make_ema, sample_seed, step_seed, warmup_cosine
from flowlift.training.run_files import (
    CONFIG_NAME,
    CURVES_NAME,
    LOG_FIELDS,
    LOG_NAME,
    check_run_folder,
    hold_run_folder,
    is_train_log,
    release_run_folder,
    remove_flowlift_checkpoints,
    run_inputs,
)
from flowlift.training.shards import ShardReader, ShardStream, TimeSampling, shard_name

# ----------------------------------------------------------------------------------------------
# The trainer


@dataclass
class _Run:
    """What the steps of one training run share (built once by :meth:`Trainer._train`)."""

    dist: DistContext
    device: torch.device
    stream: ShardStream
    model: torch.nn.Module
    ddp: torch.nn.Module
    ema: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    validator: Any
    channels_last: bool


class Trainer:
    """One training run described by a :class:`TrainConfig`. ``run()`` trains and returns a summary.

    ``model`` may be passed to train a custom module with the upscaler's call signature; by default a
    :class:`~flowlift.models.upscaler_unet.FlowUpscalerUNet` is built (or loaded from ``config.init``).
    """

    def __init__(
        self, config: TrainConfig, model: torch.nn.Module | None = None, *, config_file: str | None = None
    ) -> None:
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
        self.config_file = config_file  # an input (``--config``): no output may be it
        self._lock: int | None = None  # the run folder's lock descriptor while rank 0 trains into it
        self.run_id = uuid.uuid4().hex  # replaced by the checkpoint's own when resuming
        self.data: dict[str, Any] | None = None  # the dataset's identity (data_identity.dataset_identity), once open

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
        path = self.output / LOG_NAME
        rows = []
        if start_step > 0 and path.is_file() and not path.is_symlink() and is_train_log(path):  # else: not ours
            with path.open(newline="") as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= start_step]
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=LOG_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_text(path, text.getvalue())

    def _append_log(self, row: dict[str, Any]) -> None:
        text = io.StringIO(newline="")
        csv.DictWriter(text, fieldnames=LOG_FIELDS).writerow(row)
        append_text(self.output / LOG_NAME, text.getvalue())  # never through a link, never blocking on a FIFO

    def _non_finite_message(self, stream: ShardStream, step: int) -> str:
        """Why step ``step``'s gradient is non-finite: corrupt data (named) or, if the data is fine, training. The
        step's data is every rank's (DDP averages the gradients: one rank's NaN is every rank's), so every rank
        looks at all of it (the positions are a pure function of the step) and says the same."""
        reader = stream.reader
        for position in range(step * stream.global_batch, (step + 1) * stream.global_batch):
            index = stream.item_at(position)
            for name, tensor in reader.item(index).items():
                if not bool(torch.isfinite(tensor).all()):
                    shard = reader.root / shard_name(index // reader.shard_size)
                    return (
                        f"non-finite gradient at step {step + 1}: the training data is non-finite "
                        f"({shard}, item {index}, tensor '{name}' holds NaN/Inf); rebuild that shard"
                    )
        return f"non-finite gradient at step {step + 1} (the data of this step is finite); lower the learning rate"

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        c = self.config
        preliminary = (
            "cuda" if (c.device.startswith("cuda") or (c.device == "auto" and torch.cuda.is_available())) else "cpu"
        )
        dist = init_distributed(preliminary)
        try:
            return self._run(dist)
        finally:
            dist.close()

    def _run(self, dist: DistContext) -> dict[str, Any]:
        c = self.config
        device = pick_device(c.device, dist)
        # the replace rule for every file the run writes, before anything loads (issue 36.1)
        check_run_folder(c, run_inputs(c, self.config_file))
        resume_from = resume_point(c, self.output)
        if c.val_every:  # listed and read from their headers before the data opens or the run folder is made
            from flowlift.training.validation import validation_files

            validation_files(c.val_images, c.val_count)
        reader = ShardReader(c.data)
        try:  # the shards' files are closed however the run ends (an error, a stop, the last step)
            return self._train(dist, device, reader, resume_from)
        finally:
            reader.close()
            if self._lock is not None:  # the run folder, held by rank 0 from its first write
                release_run_folder(self.output, self._lock)
                self._lock = None

    def _train(self, dist: DistContext, device: torch.device, reader: ShardReader, resume_from: Any) -> dict[str, Any]:
        c = self.config
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
        channels_last = c.channels_last == "yes" or (c.channels_last == "auto" and device.type == "cuda")
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        model.train()
        ema = make_ema(model, c.ema_decay, c.ema_warmup)
        optimizer, scheduler = self._optimizer(model)

        self.data = agreed_identity(dist, dataset_identity(reader.manifest, c.data))
        start_step = 0
        if resume_from is not None:
            start_step, self.run_id = load_checkpoint(
                resume_from, model, ema, optimizer, scheduler, stream.global_batch, self.run_id, c, self.data
            )
            # a checkpoint at the last step whose final weights were never written (a stop after that step's
            # checkpoint): the run finishes by writing them; with them there, nothing is left to do
            if not (start_step >= c.steps and not (self.output / EMA_NAME).exists()):
                check_steps_left(resume_from, start_step, c)

        if dist.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        else:
            ddp = model

        validator = None

        def prepare_output() -> None:  # rank 0's, every rank failing with it (_on_main)
            nonlocal validator
            self.output.mkdir(parents=True, exist_ok=True)
            self._lock = hold_run_folder(self.output)  # before anything is written into it
            if c.val_every:  # the VAE and the images load (or fail) before anything is removed
                from flowlift.training.validation import Validator

                validator = Validator.from_config(c, device=device, output=self.output, start_step=start_step)
            if resume_from is None and c.overwrite:
                # --resume none --overwrite: the earlier runs' checkpoints go (only flowlift's, issue 36.1),
                # so that nothing can resume into a mix of both; every check has passed by now
                remove_flowlift_checkpoints(self.output)
            atomic_write_text(self.output / CONFIG_NAME, json.dumps(saved_settings(c), indent=2))
            self._open_log(start_step)

        _on_main(dist, prepare_output)
        run = _Run(dist, device, stream, model, ddp, ema, optimizer, scheduler, validator, channels_last)
        final_step, losses, stopped = self._loop(run, start_step)
        if stopped:
            where = checkpoint_dir(self.output, final_step)
            raise KeyboardInterrupt(
                f"training stopped after step {final_step} of {c.steps}; checkpoint {where} "
                "saved: the same command resumes from it (--resume auto, the default, takes the "
                f"latest in {self.output}; or --resume {where})"
            )
        return self._summary(run, start_step, final_step, losses)

    def _optimizer(self, model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
        """AdamW (no weight decay on biases and norms) and the warm-up + cosine schedule."""
        c = self.config
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
        return optimizer, scheduler

    def _loop(self, run: _Run, start_step: int) -> tuple[int, list[tuple[int, float]], bool]:
        """The optimizer steps from ``start_step``: (last step done, (step, loss) per step, stopped by a signal)."""
        c, dist, device, stream = self.config, run.dist, run.device, run.stream
        end_step = c.steps if c.stop_after is None else min(c.steps, c.stop_after)
        losses: list[tuple[int, float]] = []
        started = time.perf_counter()
        window_start, window_samples = time.perf_counter(), 0
        from flowlift.console import progress_bar

        # progress true: a bar on a terminal, a line every interval elsewhere; rank 0's only
        enabled = None if c.progress and dist.is_main else False
        bar = progress_bar(total=c.steps, initial=start_step, desc="train", unit="step", enabled=enabled)
        batches = prefetched_batches(stream, start_step, end_step, c.grad_accum)
        final_step = start_step
        stop = StopRequest()
        try:
            with stop:
                for step in range(start_step, end_step):
                    step_loss, grad_norm, lr = self._step(run, batches, step)
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
                        self._append_log(
                            {
                                "step": done,
                                "loss": f"{global_loss:.6g}",
                                "lr": f"{lr:.6g}",
                                "grad_norm": f"{grad_norm:.6g}",
                                "samples_per_s": f"{window_samples / max(now - window_start, 1e-9):.4g}",
                                "elapsed_s": f"{now - started:.2f}",
                            }
                        )
                        bar.set_postfix(loss=f"{global_loss:.4f}")
                        window_start, window_samples = now, 0
                    self._after_step(run, done, last, stop.requested)
                    if last:
                        break
        finally:
            bar.close()
            batches.close()
        # a stop that came during the last step (or after it) stops nothing: the run is done and ends as one
        return final_step, losses, stop.requested and final_step < end_step

    def _step(self, run: _Run, batches: Any, step: int) -> tuple[float, float, float]:
        """One optimizer step over ``grad_accum`` micro-batches: (this rank's loss, gradient norm, lr)."""
        c, dist, device, model, ddp = self.config, run.dist, run.device, run.model, run.ddp
        run.optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        for micro in range(c.grad_accum):
            fetched_step, fetched_micro, cpu_batch = next(batches)
            assert (fetched_step, fetched_micro) == (step, micro)
            batch = {k: v.to(device, non_blocking=True) for k, v in cpu_batch.items()}
            if run.channels_last:
                batch = {
                    k: (v.contiguous(memory_format=torch.channels_last) if v.ndim == 4 else v) for k, v in batch.items()
                }
            torch.manual_seed(step_seed(c.seed, step, micro, dist.rank))  # custom models' own dropout
            set_dropout_seeds(model, [sample_seed(c.seed, p) for p in run.stream.positions(step, micro)])
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
            grad_norm = float(
                torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
            )
        if not math.isfinite(grad_norm):
            raise FlowliftError(self._non_finite_message(run.stream, step))
        lr = run.optimizer.param_groups[0]["lr"]
        run.optimizer.step()
        run.scheduler.step()
        run.ema.update_parameters(model)
        return step_loss, grad_norm, lr

    def _after_step(self, run: _Run, done: int, last: bool, stopping: bool) -> None:
        """The checkpoint and the validation that fall on step ``done`` (every rank meets their barriers)."""
        c, dist = self.config, run.dist
        if done % c.checkpoint_every == 0 or last:
            state = (run.model, run.ema, run.optimizer, run.scheduler, run.stream.global_batch, dist.world_size)
            _on_main(
                dist, lambda: save_checkpoint(self.output, done, *state, config=c, run_id=self.run_id, data=self.data)
            )
        if c.val_every and (done % c.val_every == 0 or done == c.steps or last) and not stopping:
            _on_main(dist, lambda: run.validator.evaluate(done, run.ema.module) if run.validator is not None else None)

    def _summary(self, run: _Run, start_step: int, final_step: int, losses: list[tuple[int, float]]) -> dict[str, Any]:
        """The run's result; on rank 0 the EMA weights once the last step is done, and the loss curves."""
        summary: dict[str, Any] = {
            "start_step": start_step,
            "step": final_step,
            "losses": losses,
            "output": str(self.output),
            "world_size": run.dist.world_size,
            "global_batch": run.stream.global_batch,
        }
        if run.dist.is_main:
            if final_step >= self.config.steps:
                from flowlift.models.upscaler_weights import save_upscaler

                final = save_upscaler(run.ema.module, self.output / EMA_NAME, overwrite=True)  # the run's own folder
                summary["weights"] = str(final)
            if run.validator is not None:
                run.validator.plot(self.output / CURVES_NAME)
            else:
                from flowlift.training.validation import plot_curves

                plot_curves(self.output / LOG_NAME, None, self.output / CURVES_NAME)
        return summary


def _on_main(dist: DistContext, work: Callable[[], Any]) -> None:
    """``work()`` on rank 0 (a checkpoint, the validation), then every rank meets: a FlowliftError or OSError of rank
    0's is raised on every rank (:meth:`DistContext.main_outcome`), its own line on rank 0."""
    problem = None
    if dist.is_main:
        try:
            work()
        except (FlowliftError, OSError) as error:
            problem = str(error) or type(error).__name__
            if dist.world_size == 1:
                raise
    problem = dist.main_outcome(problem)
    if problem is not None:
        raise FlowliftError(problem if dist.is_main else f"rank 0 stopped the run: {problem}")
