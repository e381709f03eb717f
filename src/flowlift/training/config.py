"""Training configuration: one dataclass, read from a JSON/TOML file, then ``key=value`` overrides.

Precedence: dataclass defaults < config file < ``--set key=value`` / dedicated CLI flags.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowlift.errors import FIELD_MARK, FlowliftError
from flowlift.files.json_input import MAX_JSON_DEPTH, nesting_depth, parse_json
from flowlift.knobs import SEED, Knob, comma_items, table


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
            raise FlowliftError(
                f"no training data: set {FIELD_MARK} (a folder built by `flowlift dataset`)", field="data"
            )
        if not self.output:
            raise FlowliftError(f"no output folder: set {FIELD_MARK}", field="output")
        for name, knob in TRAIN_KNOBS.items():  # an object built in Python skips apply_overrides
            knob.check(getattr(self, name), label=name)
        if self.t_low > self.t_high:  # TimeSampling draws from [t_low, t_high] in any mode
            raise FlowliftError(f"t_low must be at most t_high, got {self.t_low} > {self.t_high}")
        if self.lr * self.weight_decay >= 1:  # AdamW scales every weight by 1 - lr * weight_decay each step
            raise FlowliftError(
                f"lr x weight_decay must be below 1 (AdamW multiplies the weights by 1 - lr x weight_decay each "
                f"step), got {self.lr:g} x {self.weight_decay:g}; lower {FIELD_MARK}",
                field="weight_decay",
            )
        if self.val_every and (not self.val_images or not self.vae):
            raise FlowliftError(
                f"validation ({FIELD_MARK} > 0) needs {FIELD_MARK} and {FIELD_MARK}",
                field=("val_every", "val_images", "vae"),
            )


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_DEFAULTS = TrainConfig()
_TEXT = ".*"
#: A name that names something: ``init`` and ``resume`` mean "none" by None, so an empty name (which the
#: checkpoint code would read as none: scratch, a fresh run) is refused rather than quietly taken as unset.
_NAME = ".+"
#: What ``device`` may name; whether that device exists is checked when the run starts (devices.py).
_DEVICE = r"auto|cpu(:0)?|cuda(:\d+)?|mps"


def _knob(name: str, kind: type, help: str, **domain: Any) -> Knob:
    """One training setting's knob, with :class:`TrainConfig`'s default."""
    return Knob(name, kind, getattr(_DEFAULTS, name), help, **domain)


#: Every training setting's domain, the one table that ``--set``, a ``--config`` file and the dedicated
#: flags all go through (:func:`apply_overrides`); settings that depend on each other are checked by
#: :meth:`TrainConfig.validate`.
TRAIN_KNOBS: dict[str, Knob] = table(
    _knob("data", str, "dataset folder (from `flowlift dataset`)", pattern=_TEXT),
    _knob("output", str, "run folder: logs, checkpoints, final flow_upscaler.safetensors", pattern=_TEXT),
    _knob("crop", int, "target-latent crop side (0 = whole items)", low=0, multiple=4, unit="latent px"),
    _knob("use_stored_noise", bool, "distillation shards: train on the teacher's own noise"),
    _knob(
        "init",
        str,
        "released checkpoint to fine-tune (file, folder or hub id); none = scratch",
        pattern=_NAME,
        optional=True,
        extra={"spelled": "a checkpoint (a file, folder or hub id; an empty name names nothing)"},
    ),
    _knob("base_channels", int, "UNet width", low=1),
    _knob("time_dim", int, "sinusoidal time embedding width (sin and cos halves)", low=2, multiple=2),
    _knob("cond_dim", int, "conditioning vector width", low=1),
    _knob("dropout", float, "dropout probability", low=0.0, high=1.0, high_open=True),
    _knob("t_sampling", str, "flow time sampling", choices=("fixed", "uniform", "logit_normal")),
    _knob("t_value", float, "flow time of t_sampling fixed", low=0.0, high=1.0),
    _knob("t_low", float, "lower end of t_sampling uniform", low=0.0, high=1.0),
    _knob("t_high", float, "upper end of t_sampling uniform", low=0.0, high=1.0),
    _knob("t_mean", float, "mean of t_sampling logit_normal (logit space)"),
    _knob("t_std", float, "standard deviation of t_sampling logit_normal", low=0.0, low_open=True),
    _knob("steps", int, "total optimizer steps", low=1),
    _knob("batch_size", int, "samples per process per micro-batch", low=1),
    _knob("grad_accum", int, "micro-batches per optimizer step", low=1),
    _knob("lr", float, "peak learning rate (AdamW: past 1 every step overshoots)", low=0.0, low_open=True, high=1.0),
    _knob("min_lr_ratio", float, "cosine decays to lr * min_lr_ratio", low=0.0, high=1.0),
    _knob("warmup_steps", int, "linear warm-up steps", low=0),
    _knob("weight_decay", float, "AdamW weight decay", low=0.0),
    _knob("adam_beta1", float, "AdamW beta1", low=0.0, high=1.0, high_open=True),
    _knob("adam_beta2", float, "AdamW beta2", low=0.0, high=1.0, high_open=True),
    _knob("adam_eps", float, "AdamW epsilon", low=0.0, low_open=True),
    _knob("grad_clip", float, "max global grad norm (0 disables)", low=0.0),
    _knob("ema_decay", float, "EMA decay of the saved weights", low=0.0, high=1.0, high_open=True),
    _knob("ema_warmup", bool, "decay_n = min(ema_decay, (1 + n) / (10 + n))"),
    _knob("seed", int, SEED.help, low=SEED.low, high=SEED.high),
    _knob(
        "device",
        str,
        "auto (CUDA if available, else cpu), cpu, cuda, cuda:N",
        pattern=_DEVICE,
        extra={"spelled": "one of auto, cpu, cuda, cuda:N, mps"},
    ),
    _knob("mixed_precision", str, "auto (bf16 on CUDA), no or bf16", choices=("auto", "no", "bf16")),
    _knob("channels_last", str, "auto (on CUDA), yes or no", choices=("auto", "yes", "no")),
    _knob("log_every", int, "log the loss every K steps", low=1),
    _knob("checkpoint_every", int, "checkpoint every K steps", low=1),
    _knob("keep_checkpoints", int, "checkpoints kept", low=1),
    _knob(
        "resume",
        str,
        "auto (latest in output, if any), a checkpoint folder, or none",
        pattern=_NAME,
        optional=True,
        extra={"spelled": "auto or a checkpoint folder (an empty name names nothing)"},
    ),
    _knob("overwrite", bool, "with resume none: replace the output folder's checkpoints"),
    _knob("stop_after", int, "end this invocation after this global step (none = at steps)", low=1, optional=True),
    _knob(
        "time_limit_s", float, "end this invocation (with a checkpoint) after this long; 0 = none", low=0.0, unit="s"
    ),
    _knob("val_every", int, "validate every K steps (0 = never)", low=0),
    _knob("val_images", list, "held-out images (files, folders, globs) for validation"),
    _knob("val_count", int, "validation images used", low=1),
    _knob("val_size", int, "centre crop side of the validation ground truth", low=128, multiple=16, unit="px"),
    _knob("vae", str, "VAE spec for validation", pattern=_TEXT),
    _knob("val_seed", int, "seed of the validation noise", low=SEED.low, high=SEED.high),
    _knob("val_color_fix", bool, "colour-fix the validation images"),
    _knob("progress", bool, "progress bars"),
)


def _coerce(name: str, value: Any) -> Any:
    """A file or command-line value of setting ``name``, checked against its domain (:data:`TRAIN_KNOBS`).

    Text is what the command line gives (``--set``) and what a file may hold: ``true``/``false`` for a
    switch, comma-separated items for a list; numbers are parsed exactly (:meth:`Knob.check`, loose).
    """
    knob = TRAIN_KNOBS[name]
    if isinstance(value, str) and knob.kind is bool:
        text = value.strip().lower()
        value = True if text in _TRUE else False if text in _FALSE else value
    elif isinstance(value, str) and knob.kind is list:
        value = comma_items(value, name) if value.strip() else []  # an empty text is the empty list
    return knob.check(value, label=name, loose=True)


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def apply_overrides(config: TrainConfig, overrides: dict[str, Any]) -> TrainConfig:
    """A copy of ``config`` with ``overrides`` applied; unknown keys raise one FlowliftError line."""
    # a key that is no string (a tuple, a number) is unknown too, named by its repr: never joined or compared as text
    unknown = sorted(key if isinstance(key, str) else repr(key) for key in overrides if key not in _FIELDS)
    if unknown:
        near = difflib.get_close_matches(unknown[0], _FIELDS, n=1)
        hint = f" (did you mean {near[0]}?)" if near else " (--print-config lists them)"
        raise FlowliftError(f"unknown training setting(s): {', '.join(unknown)}{hint}", field=tuple(unknown))
    values = config.to_dict()
    for key, value in overrides.items():
        values[key] = _coerce(key, value)
    return TrainConfig(**values)


def apply_file(config: TrainConfig, path: str | os.PathLike) -> TrainConfig:
    """``config`` with the settings file at ``path`` applied (:func:`load_config_file`); a refused value or an
    unknown key is one line that starts with the file's name and names the key as written there."""
    values = load_config_file(path)
    try:
        return apply_overrides(config, values)
    except FlowliftError as error:
        raise FlowliftError(f"{path}: {error}") from None  # str(): the file's own key, no door's option


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
    if path.is_dir():
        raise FlowliftError(f"config {path} is a folder: give the settings file (.json or .toml) in it")
    if not path.is_file():
        raise FlowliftError(f"config file not found: {path}")
    if path.suffix.lower() in (".yaml", ".yml"):
        raise FlowliftError(f"config {path}: flowlift reads JSON (.json) or TOML (.toml) settings, not YAML")
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
    """Defaults, then the file at ``path`` (if any), then ``overrides``; validated. A value the file holds that
    its setting refuses is one line naming the file and the setting as the file spells it."""
    config = TrainConfig()
    if path:
        config = apply_file(config, path)
    if overrides:
        config = apply_overrides(config, overrides)
    config.validate()
    return config


#: Settings of one invocation, not of the run: left out of the run's ``config.json``, so that the documented resume
#: (``--config OUT/config.json --output OUT``) neither stops where the last invocation stopped nor starts over.
INVOCATION_ONLY = ("stop_after", "time_limit_s", "resume", "overwrite", "progress")


def saved_settings(config: TrainConfig) -> dict[str, Any]:
    """What the run's ``config.json`` holds: ``config`` without :data:`INVOCATION_ONLY`."""
    return {key: value for key, value in config.to_dict().items() if key not in INVOCATION_ONLY}
