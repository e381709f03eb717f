"""The ``lora_adapter_metadata`` header of a diffusers LoRA file, checked whole before peft sees it.

diffusers saves a LoRA's peft ``LoraConfig`` as JSON in the safetensors header, keys under ``transformer.``;
``load_lora_adapter`` keeps the ``transformer.*`` keys, strips the prefix and calls ``LoraConfig(**those)``,
which peft then applies to every module its ``target_modules`` name. peft trusts the config: an empty
``target_modules`` or one that misses the file's layers drops tensors with a warning, a string is a regular
expression run on every module name, an unknown key or ``target_modules: 5`` is a traceback, ``pissa``
initialisation rewrites the base weights, ``lora_alpha`` 0 turns the LoRA off, and a million target names cost
minutes per module. So every key is checked here, each failure one :class:`FlowliftError` line naming the key:

* :func:`adapter_config` — the header text: at most :data:`MAX_METADATA_BYTES`, JSON (nesting bounded), an
  object; its ``transformer.*`` settings with the prefix stripped (what peft receives), each setting in its
  domain (:func:`check_adapter_config`).
* :func:`check_targets` — ``target_modules`` names exactly the layers the file's tensors hold (peft's rule: a
  module matches a target when its path is the target or ends in ``.target``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

from flowlift.errors import FlowliftError
from flowlift.files.json_input import parse_json

#: diffusers' prefix of the transformer's settings (and tensors) in a pipeline LoRA file.
PREFIX = "transformer."
#: Largest header accepted: a config with a rank for every layer of FLUX.2 [dev] is ~60 kB.
MAX_METADATA_BYTES = 1 << 20
#: The largest ``lora_alpha / r`` accepted (see :data:`flowlift.refine.loras.MAX_ALPHA_SCALE`).
MAX_ALPHA_SCALE = 1e3
#: Settings that describe the file or training and change nothing peft computes at inference.
_DESCRIPTIVE = {
    "task_type",
    "auto_mapping",
    "peft_version",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "lora_dropout",
    "megatron_core",
    "qalora_group_size",
    "runtime_config",
    "ensure_weight_tying",
}
#: Settings with a domain of their own (checked below); every other peft field must keep peft's default.
_CHECKED = {
    "peft_type",
    "r",
    "lora_alpha",
    "rank_pattern",
    "alpha_pattern",
    "target_modules",
    "use_dora",
    "use_rslora",
    "lora_bias",
    "fan_in_fan_out",
    "bias",
    "init_lora_weights",
}
#: ``init_lora_weights`` values that leave the base weights alone (PiSSA, OLoRA, LoftQ, EVA, CorDA rewrite them).
_PLAIN_INITS = (True, False, "gaussian")
#: A module path as diffusers writes it in ``target_modules`` and pattern keys (a pattern may start with ``^``):
#: no regular-expression syntax beyond the dot, so peft's matching stays linear in the name.
_MODULE_PATH = re.compile(r"\^?[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")


def _defaults() -> dict[str, Any]:
    """peft's ``LoraConfig`` fields and their defaults (as JSON would hold them), or {} without peft."""
    import dataclasses

    try:
        from peft import LoraConfig
    except ImportError:
        return {}
    out = {}
    for item in dataclasses.fields(LoraConfig):
        factory = item.default_factory
        out[item.name] = item.default if factory is dataclasses.MISSING else factory()
    return out


def adapter_config(text: object, *, origin: str) -> dict[str, Any]:
    """The ``transformer.*`` settings of a ``lora_adapter_metadata`` header ``text``, prefix stripped (the
    ``LoraConfig`` keywords diffusers passes to peft), each checked (:func:`check_adapter_config`)."""
    what = f"LoRA {origin}: its lora_adapter_metadata header"
    if not isinstance(text, str):
        raise FlowliftError(f"{what} is not text")
    if len(text) > MAX_METADATA_BYTES:
        raise FlowliftError(
            f"{what} holds {len(text)} characters (a peft LoRA config is a few kB; at most {MAX_METADATA_BYTES})"
        )
    try:
        metadata = parse_json(text)
    except ValueError as error:
        raise FlowliftError(f"{what} is not JSON ({str(error)[:120]})") from None
    return transformer_settings(metadata, what=what)


def transformer_settings(metadata: object, *, what: str) -> dict[str, Any]:
    """The ``transformer.*`` settings of the decoded header ``metadata``, prefix stripped, each checked."""
    if not isinstance(metadata, dict):
        raise FlowliftError(f"{what} is a JSON {type(metadata).__name__}, not a peft LoRA config object")
    config = {key.removeprefix(PREFIX): value for key, value in metadata.items() if key.startswith(PREFIX)}
    if not config and metadata:
        shown = ", ".join(sorted(map(str, metadata))[:4])
        raise FlowliftError(f"{what} has no {PREFIX}* settings (it holds {shown}); diffusers reads only those")
    check_adapter_config(config, what=what)
    return config


def check_adapter_config(config: dict[str, Any], *, what: str) -> None:
    """Each peft setting of ``config`` in its domain, else one line starting with ``what`` naming the setting:
    a positive integer rank ``r`` (and ``rank_pattern`` ranks), a positive finite ``lora_alpha`` (and
    ``alpha_pattern``) with ``lora_alpha / r <= MAX_ALPHA_SCALE`` (``/ sqrt(r)`` with ``use_rslora``), a non-empty
    list of module paths ``target_modules``, plain LoRA switches (``use_dora``, ``fan_in_fan_out`` false; a
    weight-preserving ``init_lora_weights``), and every other known field at peft's default."""
    _check_ranks_and_alphas(config, what)
    targets = config.get("target_modules")
    if not isinstance(targets, list) or not targets:
        kind = "an empty list" if targets == [] else f"{type(targets).__name__} {targets!r}"[:80]
        raise FlowliftError(f"{what} has target_modules {kind}; expected a list of the module paths it adapts")
    for target in targets:
        if not isinstance(target, str) or not _MODULE_PATH.fullmatch(target) or target.startswith("^"):
            raise FlowliftError(f"{what} has target_modules entry {target!r:.80}; expected a module path")
    for name in ("use_dora", "use_rslora", "lora_bias", "fan_in_fan_out"):
        if type(config.get(name, False)) is not bool:
            raise FlowliftError(f"{what} has {name} {config[name]!r:.80}; expected true or false")
    if config.get("use_dora"):
        raise FlowliftError(f"{what} has use_dora true: a DoRA, which diffusers' FLUX.2 loader cannot apply")
    if config.get("fan_in_fan_out"):
        raise FlowliftError(f"{what} has fan_in_fan_out true, which no Linear layer of FLUX.2 takes")
    if config.get("bias", "none") not in ("none", "all", "lora_only"):
        raise FlowliftError(f"{what} has bias {config['bias']!r:.80}; expected none, all or lora_only")
    init = config.get("init_lora_weights", True)
    if not any(init is plain or (isinstance(plain, str) and init == plain) for plain in _PLAIN_INITS):
        raise FlowliftError(
            f"{what} has init_lora_weights {init!r:.80}, which rewrites the base weights or needs "
            "training data; flowlift applies plain LoRAs (true, false or gaussian)"
        )
    if config.get("peft_type", "LORA") not in ("LORA", None):
        raise FlowliftError(f"{what} has peft_type {config['peft_type']!r:.80}; expected LORA")
    _check_other_fields(config, what)


def _check_ranks_and_alphas(config: dict[str, Any], what: str) -> None:
    rank = config.get("r")
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    if not isinstance(ranks, dict) or not isinstance(alphas, dict):
        raise FlowliftError(f"{what} has a rank_pattern or alpha_pattern that is not an object")
    for label, pattern in (("rank_pattern", ranks), ("alpha_pattern", alphas)):
        for key in pattern:
            if not _MODULE_PATH.fullmatch(key):
                raise FlowliftError(f"{what} has {label} key {key!r:.80}; expected a module path")
    for label, value in [("r", rank), *((f"rank_pattern {k}", v) for k, v in ranks.items())]:
        if type(value) is not int or value <= 0:
            raise FlowliftError(f"{what} has {label} {value!r:.80}; expected a rank, a positive integer")
    divisor = math.sqrt(rank) if config.get("use_rslora") is True else rank
    alpha = config.get("lora_alpha")
    for label, value in [("lora_alpha", alpha), *((f"alpha_pattern {k}", v) for k, v in alphas.items())]:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not 0 < value <= MAX_ALPHA_SCALE * divisor:  # NaN fails the comparison too
            raise FlowliftError(
                f"{what} has {label} {value!r:.80}; expected a positive finite number of at most "
                f"{MAX_ALPHA_SCALE:g} x the rank"
            )


def _check_other_fields(config: dict[str, Any], what: str) -> None:
    defaults = _defaults()
    for name, value in config.items():
        if name in _CHECKED or name in _DESCRIPTIVE:
            continue
        if defaults and name not in defaults:
            raise FlowliftError(f"{what} has the setting {name!r:.80}, which is no field of peft's LoraConfig")
        default = defaults.get(name)
        if value != default and not (value in (None, {}, []) and default in (None, {}, [])):
            raise FlowliftError(
                f"{what} has {name} {value!r:.80}; flowlift applies plain LoRAs, which leave it at "
                f"peft's default ({default!r})"
            )


def targeted(module: str, targets: Iterable[str]) -> bool:
    """peft's rule for a list of ``target_modules``: ``module`` is one of them or ends in ``.`` + one."""
    return any(module == target or module.endswith(f".{target}") for target in targets)


def check_targets(config: dict[str, Any], layers: Iterable[str], linear_modules: Iterable[str], *, what: str) -> None:
    """``target_modules`` of ``config`` reaches exactly ``layers`` (the module paths the file has tensors for)
    among ``linear_modules`` (the model's): a layer it misses would lose its tensors, a module it adds would get
    an adapter the file has no weights for."""
    targets = config["target_modules"]
    layers = set(layers)
    missed = sorted(layer for layer in layers if not targeted(layer, targets))
    if missed:
        raise FlowliftError(
            f"{what} has target_modules that miss the layer {missed[0]} its tensors adapt ({len(missed)} layers missed)"
        )
    extra = sorted(module for module in linear_modules if module not in layers and targeted(module, targets))
    if extra:
        raise FlowliftError(
            f"{what} has target_modules that also reach {extra[0]}, for which it holds no tensors "
            f"({len(extra)} such layers)"
        )
