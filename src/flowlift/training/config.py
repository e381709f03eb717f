"""Training configuration: one dataclass, read from a JSON/TOML file, then ``key=value`` overrides.

Precedence: dataclass defaults < config file < ``--set key=value`` / dedicated CLI flags.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowlift.errors import FlowliftError
from flowlift.files.json_input import MAX_JSON_DEPTH, nesting_depth, parse_json


@dataclass
class TrainConfig:
    """Every setting of a ``flowlift train`` run (see docs/train.md for the meaning of each)."""

    # data and output
    data: str = ""
    output: str = ""
    crop: int = 32  # target-latent crop side (multiple of 4; 0 = whole items)
    use_stored_noise: bool = True  # distillation shards: train on the teacher's own noise
    # model
    init: str | None = None  # released checkpoint to fine-tune (file, folder or hub id); None = scratch
    base_channels: int = 384
    time_dim: int = 512
    cond_dim: int = 1024
    dropout: float = 0.01
    # flow time sampling
    t_sampling: str = "fixed"  # fixed | uniform | logit_normal
    t_value: float = 1.0
    t_low: float = 0.0
    t_high: float = 1.0
    t_mean: float = 0.0
    t_std: float = 1.0
    # optimisation
    steps: int = 10000
    batch_size: int = 8  # per process, per micro-batch
    grad_accum: int = 1
    lr: float = 1e-4
    min_lr_ratio: float = 0.0  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 500
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables
    ema_decay: float = 0.999
    ema_warmup: bool = True  # decay_n = min(ema_decay, (1 + n) / (10 + n))
    seed: int = 0
    # hardware
    device: str = "auto"  # auto | cpu | cuda | cuda:N (under torchrun: cuda:LOCAL_RANK)
    mixed_precision: str = "auto"  # auto (bf16 on CUDA) | no | bf16
    channels_last: str = "auto"  # auto (on CUDA) | yes | no
    # bookkeeping
    log_every: int = 10
    checkpoint_every: int = 1000
    keep_checkpoints: int = 3
    resume: str | None = "auto"  # auto (latest in output, if any) | a checkpoint folder | none
    overwrite: bool = False  # with resume none: replace the output folder's checkpoints (else refused)
    stop_after: int | None = None  # end this invocation after this global step (for time-boxed jobs)
    time_limit_s: float = 0.0  # end this invocation (with a checkpoint) after this many seconds; 0 = none
    # validation
    val_every: int = 0  # 0 disables
    val_images: list[str] = field(default_factory=list)
    val_count: int = 4
    val_size: int = 256  # centre crop side of the high-res ground truth, pixels (multiple of 16)
    vae: str = ""  # VAE spec for validation (flowlift.models.vae_loading.load_vae)
    val_seed: int = 0
    val_color_fix: bool = True
    progress: bool = True

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Raise one FlowliftError line for an impossible setting."""
        if not self.data:
            raise FlowliftError("no training data: set data (a folder built by `flowlift dataset`)")
        if not self.output:
            raise FlowliftError("no output folder: set output")
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise FlowliftError(f"{spec.name} must be a finite number, got {value}")
        if not 0 <= self.dropout < 1:
            raise FlowliftError(f"dropout must be in [0, 1), got {self.dropout}")
        positive = ("steps", "batch_size", "grad_accum", "log_every", "checkpoint_every", "keep_checkpoints")
        for name in positive:
            if getattr(self, name) < 1:
                raise FlowliftError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.crop < 0 or self.crop % 4:
            raise FlowliftError(f"crop must be 0 or a positive multiple of 4 latent pixels, got {self.crop}")
        if self.lr <= 0 or self.warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise FlowliftError("need lr > 0, warmup_steps >= 0 and 0 <= min_lr_ratio <= 1")
        if not 0 <= self.ema_decay < 1:
            raise FlowliftError(f"ema_decay must be in [0, 1), got {self.ema_decay}")
        if self.mixed_precision not in ("auto", "no", "bf16"):
            raise FlowliftError(f"mixed_precision must be auto, no or bf16, got {self.mixed_precision!r}")
        if self.channels_last not in ("auto", "yes", "no"):
            raise FlowliftError(f"channels_last must be auto, yes or no, got {self.channels_last!r}")
        if self.val_every < 0:
            raise FlowliftError("val_every must be >= 0")
        if self.val_every and (not self.val_images or not self.vae):
            raise FlowliftError("validation (val_every > 0) needs val_images and vae")
        if self.val_size % 16 or self.val_size < 128:
            raise FlowliftError(f"val_size must be a multiple of 16 pixels and at least 128, got {self.val_size}")


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _coerce(name: str, value: Any) -> Any:
    """Convert a file or command-line value to the type of field ``name``."""
    default = _FIELDS[name].default
    kind = _FIELDS[name].type
    if isinstance(value, str):
        text = value.strip()
        if "list" in str(kind):
            return [v for v in (s.strip() for s in text.split(",")) if v]
        if text.lower() in ("none", "null") and ("None" in str(kind)):
            return None
        if "bool" in str(kind):
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise FlowliftError(f"{name}: expected true/false, got {value!r}")
        if "int" in str(kind) and "float" not in str(kind):
            try:
                return int(text)
            except ValueError:
                raise FlowliftError(f"{name}: expected an integer, got {value!r}") from None
        if "float" in str(kind):
            try:
                return float(text)
            except ValueError:
                raise FlowliftError(f"{name}: expected a number, got {value!r}") from None
        return text
    if isinstance(default, bool) and not isinstance(value, bool):
        raise FlowliftError(f"{name}: expected true/false, got {value!r}")
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def apply_overrides(config: TrainConfig, overrides: dict[str, Any]) -> TrainConfig:
    """A copy of ``config`` with ``overrides`` applied; unknown keys raise one FlowliftError line."""
    unknown = sorted(set(overrides) - set(_FIELDS))
    if unknown:
        raise FlowliftError(f"unknown training setting(s): {', '.join(unknown)}")
    values = config.to_dict()
    for key, value in overrides.items():
        values[key] = _coerce(key, value)
    return TrainConfig(**values)


def parse_assignments(items: list[str]) -> dict[str, str]:
    """``["lr=1e-4", "steps=100"]`` -> ``{"lr": "1e-4", "steps": "100"}``."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise FlowliftError(f"--set expects key=value, got {item!r}")
        out[key.strip().replace("-", "_")] = value
    return out


def load_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read a ``.json`` or ``.toml`` config file into a dict (keys are TrainConfig fields)."""
    path = Path(path)
    if not path.is_file():
        raise FlowliftError(f"config file not found: {path}")
    try:
        if path.suffix == ".toml":
            import tomllib

            data = tomllib.loads(path.read_text())
            if nesting_depth(data) > MAX_JSON_DEPTH:  # tomllib recurses like json: same bound
                raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep")
        else:
            data = parse_json(path.read_text())
    except Exception as error:  # noqa: BLE001 - any parse failure is a bad file to the user
        raise FlowliftError(f"cannot parse config {path}: {str(error).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise FlowliftError(f"config {path} must hold a table/object of settings")
    return data


def build_config(path: str | os.PathLike | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults, then the file at ``path`` (if any), then ``overrides``; validated."""
    config = TrainConfig()
    if path:
        config = apply_overrides(config, load_config_file(path))
    if overrides:
        config = apply_overrides(config, overrides)
    config.validate()
    return config
