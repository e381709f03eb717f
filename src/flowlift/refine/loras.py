"""LoRAs on the FLUX.2 transformer, through diffusers' own ``Flux2LoraLoaderMixin`` conversions and peft.

A LoRA file is read from safetensors only and checked before anything touches the model: every tensor floating
point and finite. Its keys are converted by diffusers (``Flux2LoraLoaderMixin.lora_state_dict``: diffusers/peft
keys, kohya's ``lora_unet_*`` with ``alpha``, ai-toolkit's ``diffusion_model.*``); ComfyUI's files use the
ai-toolkit names with ``lora_down``/``lora_up`` and an ``alpha`` per layer, which diffusers' converter does not
take, so they are renamed and each alpha is folded into its ``lora_A`` (down) matrix first, ``A * alpha / rank``,
the scaling kohya's conversion applies. Keys that
match no layer of the transformer are one :class:`FlowliftError` line naming them, never a silent no-op. Each
LoRA becomes a peft adapter at its own scale (``set_adapters``); scale 0 leaves the model's output unchanged
bit for bit (the adapter adds an exact zero).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from flowlift.errors import FlowliftError
from flowlift.refine import lora_config

#: ``(path, scale)`` pairs as :func:`flowlift.refine.loading.load_refiner` takes them.
LoraSpec = tuple[str | os.PathLike, float]
#: Keys of a diffusers-format LoRA carry their module path between this prefix and ``.lora_A`` / ``.lora_B``.
_PREFIX = "transformer."
_ADAPTER_PARTS = (".lora_A", ".lora_B", ".lora_magnitude_vector", ".lokr_")
#: The (down, up) matrix suffixes of the LoRA formats read here.
_PAIRS = ((".lora_A.weight", ".lora_B.weight"), (".lora_down.weight", ".lora_up.weight"))
#: The largest ``alpha / rank`` accepted: trained LoRAs scale their rank-r update by 1/r to about 2 (alpha = 1, r
#: or 2r); a thousand times the update is a damaged file, whose images would only come out black or noise.
MAX_ALPHA_SCALE = lora_config.MAX_ALPHA_SCALE


@dataclass(frozen=True)
class LoadedLora:
    """One LoRA on the transformer: its file, the file's SHA-256, its scale and the peft adapter name."""

    path: str
    sha256: str
    scale: float
    adapter: str

    def record(self) -> dict[str, object]:
        """The metadata entry of an output (``loras`` list)."""
        return {"path": self.path, "sha256": self.sha256, "scale": self.scale}


def parse_lora_spec(text: str) -> tuple[str, float]:
    """``FILE[:SCALE]`` -> ``(FILE, SCALE)`` (scale 1 when absent; a Windows drive colon is part of the path)."""
    path, sep, tail = text.rpartition(":")
    if sep and path and not tail.startswith(("\\", "/")):
        try:
            scale = float(tail)
        except ValueError:
            return text, 1.0
        if scale != scale or scale in (float("inf"), float("-inf")):
            raise FlowliftError(f"source.loras {text}: the scale must be a finite number", field="source.loras")
        return path, scale
    return text, 1.0


def read_lora(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict | None]:
    """The tensors and the diffusers adapter metadata (if any) of a LoRA ``.safetensors`` file, checked.

    Only safetensors (a pickle can run code); every tensor must be floating point (``alpha`` scalars may be
    integers) and finite.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    from flowlift.models.weights import check_finite_state

    path = Path(path)
    if not path.is_file():
        raise FlowliftError(
            f"LoRA {path} is a folder: give a LoRA .safetensors file" if path.is_dir() else f"LoRA {path}: no such file"
        )
    if path.suffix.lower() != ".safetensors":
        raise FlowliftError(
            f"LoRA {path}: a {path.suffix or 'suffix-less'} file; LoRAs are read from .safetensors only"
        )
    try:
        state = load_file(str(path), device="cpu")
        with safe_open(str(path), framework="pt") as handle:
            header = handle.metadata() or {}
    except Exception as error:  # noqa: BLE001 - any reader failure is a bad file to the user
        raise FlowliftError(
            f"LoRA {path}: not a readable safetensors file ({str(error).splitlines()[0][:160]})"
        ) from None
    if not state:
        raise FlowliftError(f"LoRA {path}: holds no tensors")
    for name in sorted(state):
        tensor = state[name]
        if not tensor.is_floating_point() and not (name.endswith(".alpha") and tensor.numel() == 1):
            dtype = str(tensor.dtype).removeprefix("torch.")
            raise FlowliftError(f"LoRA {path}: `{name}` has dtype {dtype}, expected floating point")
    check_finite_state(state, what="LoRA weights", origin=str(path))
    check_lora_matrices(state, origin=str(path))
    metadata = None
    if "lora_adapter_metadata" in header:
        config = lora_config.adapter_config(header["lora_adapter_metadata"], origin=str(path))
        metadata = {_PREFIX + key: value for key, value in config.items()}  # what diffusers passes to peft
    return state, metadata


def check_lora_matrices(state: dict[str, torch.Tensor], *, origin: str) -> None:
    """Each down matrix (``lora_A`` / ``lora_down``, rank x in) has its up matrix (out x rank) of the same rank r > 0,
    and each ``alpha`` is one number with ``|alpha| / r <= MAX_ALPHA_SCALE``; else one line naming the tensor."""
    ranks = {}
    for name in state:
        for down, up in _PAIRS:
            if not name.endswith((down, up)):
                continue
            is_down = name.endswith(down)
            layer = name.removesuffix(down if is_down else up)
            partner = layer + (up if is_down else down)
            if partner not in state:
                raise FlowliftError(f"LoRA {origin}: `{name}` has no {partner[len(layer) + 1 :]} beside it")
            a, b = (state[name], state[partner]) if is_down else (state[partner], state[name])
            if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1] or a.shape[0] == 0:
                raise FlowliftError(
                    f"LoRA {origin}: `{layer}` has down {tuple(a.shape)} and up {tuple(b.shape)} matrices; expected "
                    "(rank, in) and (out, rank) with the same rank > 0"
                )
            ranks[layer] = a.shape[0]
    for name in (n for n in state if n.endswith(".alpha")):
        alpha, rank = state[name], ranks.get(name.removesuffix(".alpha"))
        if alpha.numel() != 1:
            raise FlowliftError(f"LoRA {origin}: `{name}` holds {alpha.numel()} values; an alpha is one number")
        if rank and abs(float(alpha)) / rank > MAX_ALPHA_SCALE:
            raise FlowliftError(
                f"LoRA {origin}: `{name}` is {float(alpha):g} for rank {rank}, a scale of {float(alpha) / rank:g} "
                f"(trained LoRAs stay near 1; at most {MAX_ALPHA_SCALE:g})"
            )


def check_adapter_metadata(metadata: object, *, origin: str) -> None:
    """diffusers' decoded ``lora_adapter_metadata`` (a peft ``LoraConfig``, keys under ``transformer.``) holds
    only settings flowlift can apply, each in its domain (:func:`flowlift.refine.lora_config.check_adapter_config`:
    a rank ``r`` > 0, a positive finite ``lora_alpha`` with ``lora_alpha / r <= MAX_ALPHA_SCALE``, per-layer
    patterns alike, a list of ``target_modules``, no DoRA), else one line naming the setting."""
    lora_config.transformer_settings(metadata, what=f"LoRA {origin}: its lora_adapter_metadata header")


def normalize_comfyui_lora(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI / ai-toolkit LoRAs (``diffusion_model.*`` keys) in the form diffusers' ai-toolkit converter takes.

    ``lora_down``/``lora_up`` become ``lora_A``/``lora_B`` (diffusers would otherwise take the file for kohya's and
    convert none of it) and each layer's ``alpha`` is folded into its ``lora_A``: ``A * alpha / rank``. Other
    formats are returned unchanged (diffusers' kohya conversion applies kohya's alphas itself).
    """
    if not any(k.startswith("diffusion_model.") for k in state):
        return state
    renames = ((".lora_down.weight", ".lora_A.weight"), (".lora_up.weight", ".lora_B.weight"))
    out = {}
    for key, value in state.items():
        for old, new in renames:
            key = key.removesuffix(old) + new if key.endswith(old) else key
        out[key] = value
    for key in [k for k in out if k.endswith(".alpha")]:
        down = key.removesuffix(".alpha") + ".lora_A.weight"
        if down not in out:
            raise FlowliftError(f"LoRA: `{key}` has no lora_A/lora_down matrix beside it")
        out[down] = out[down] * (float(out.pop(key)) / out[down].shape[0])
    return out


@contextmanager
def _diffusers_warnings() -> Iterator[list[str]]:
    """Collect the warnings diffusers logs (dropped keys, unexpected keys) instead of letting them pass."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage().strip())

    logger = logging.getLogger("diffusers")
    handlers, level = logger.handlers[:], logger.level
    logger.handlers = [Collect(level=logging.WARNING)]  # collected here, not printed by diffusers' own handler
    logger.setLevel(min(level or logging.WARNING, logging.WARNING))
    try:
        yield messages
    finally:
        logger.handlers = handlers
        logger.setLevel(level)


def _short(names: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... (+{len(names) - limit} more)" if len(names) > limit else "")


def convert_lora(
    state: dict[str, torch.Tensor], transformer: torch.nn.Module, *, origin: str
) -> dict[str, torch.Tensor]:
    """diffusers-format (``transformer.<module>.lora_A.weight``) tensors of a LoRA in any supported format.

    Raises one line when a key matches no layer of ``transformer`` (a LoRA for another model, text-encoder
    layers, keys diffusers' converters drop).
    """
    from diffusers.loaders.lora_pipeline import Flux2LoraLoaderMixin

    source = normalize_comfyui_lora(dict(state))
    if any(".dora_scale" in k for k in source):
        raise FlowliftError(f"LoRA {origin}: a DoRA (dora_scale tensors), which diffusers' FLUX.2 loader cannot apply")
    work = dict(source)  # diffusers' kohya conversion pops what it converts from the dict it is given
    try:
        with _diffusers_warnings() as warned:
            converted = Flux2LoraLoaderMixin.lora_state_dict(work)
    except ValueError as error:  # ai-toolkit conversion: "should be empty at this point but has ... dict_keys([...])"
        left = re.findall(r"'([^']+)'", str(error).split("dict_keys", 1)[-1]) if "dict_keys" in str(error) else []
        names = f"{len(left)} tensors: {_short(left)}" if left else "its tensors"
        raise FlowliftError(f"LoRA {origin}: {names} match no layer of a FLUX.2 transformer") from None
    if any(k.endswith(".lora_down.weight") for k in source) and work:  # kohya's: what it did not convert
        raise FlowliftError(
            f"LoRA {origin}: {len(work)} of {len(source)} tensors match no layer of a FLUX.2 transformer: "
            f"{_short(sorted(work))}"
        )
    if warned:
        raise FlowliftError(f"LoRA {origin}: {warned[0].splitlines()[0][:300]}")
    modules = dict(transformer.named_modules())
    unmatched = []
    for key in converted:
        path = key.removeprefix(_PREFIX)
        cut = min((path.find(part) for part in _ADAPTER_PARTS if part in path), default=-1)
        if not key.startswith(_PREFIX) or cut < 0 or path[:cut] not in modules:
            unmatched.append(key)
    check_fit(converted, transformer, origin=origin)
    if unmatched:
        raise FlowliftError(
            f"LoRA {origin}: {len(unmatched)} of {len(converted)} tensors match no layer of this FLUX.2 transformer: "
            f"{_short(sorted(unmatched))}"
        )
    if not converted:
        raise FlowliftError(f"LoRA {origin}: no LoRA tensors for the transformer")
    return converted


def _made_for(converted: dict[str, torch.Tensor], width_here: int) -> str:
    """The model a LoRA seems made for, from the width its attention projections take."""
    from collections import Counter

    from flowlift.models.flux2_transformer_files import KNOWN_WIDTHS

    widths = Counter(
        tensor.shape[1]
        for key, tensor in converted.items()
        if key.endswith(".lora_A.weight")
        and tensor.ndim == 2
        and key.removesuffix(".lora_A.weight").rsplit(".", 1)[-1] in ("to_q", "to_k", "to_v", "to_qkv_mlp_proj")
    )
    if not widths:
        return "the LoRA seems made for another model"
    width = widths.most_common(1)[0][0]
    if width == width_here:
        return f"its attention layers take this model's width {width} (a damaged or edited file?)"
    name = f"{KNOWN_WIDTHS[width]} (width {width})" if width in KNOWN_WIDTHS else f"a FLUX.2 of width {width}"
    return f"the LoRA seems made for {name}"


def check_fit(
    converted: dict[str, torch.Tensor], transformer: torch.nn.Module, *, origin: str, rank: int | None = None
) -> None:
    """Every LoRA pair on a layer of ``transformer`` fits it: ``lora_A`` (r, in_features), ``lora_B``
    (out_features, r), r the metadata's ``rank`` when given; else one line naming the first tensor that does not
    fit, the layer and the model the LoRA seems made for."""
    from flowlift.models.flux2_transformer_files import model_name

    modules = dict(transformer.named_modules())
    config = dict(transformer.config)
    width = config["num_attention_heads"] * config["attention_head_dim"]
    for key, tensor in converted.items():
        part = next((p for p in (".lora_A.weight", ".lora_B.weight") if key.endswith(p)), None)
        layer = modules.get(key.removeprefix(_PREFIX).removesuffix(part or ""))
        if part is None or not isinstance(layer, torch.nn.Linear):
            continue
        a = converted[key.replace(".lora_B.", ".lora_A.")] if part == ".lora_B.weight" else tensor
        want = (a.shape[0], layer.in_features) if part == ".lora_A.weight" else (layer.out_features, a.shape[0])
        if tuple(tensor.shape) != want or (rank is not None and a.shape[0] != rank):
            sizes = f"{layer.in_features} in, {layer.out_features} out" + (f", rank {rank}" if rank else "")
            raise FlowliftError(
                f"LoRA {origin}: `{key}` is {tuple(tensor.shape)}, which does not fit the layer ({sizes}) of this "
                f"{model_name(config)} transformer; {_made_for(converted, width)}"
            )


def _check_metadata_fits(
    metadata: dict, converted: dict[str, torch.Tensor], transformer: torch.nn.Module, *, origin: str
) -> None:
    """The adapter config reaches exactly the layers the tensors adapt, at the tensors' rank (when one rank)."""
    config = {key.removeprefix(_PREFIX): value for key, value in metadata.items()}
    layers = {key.removeprefix(_PREFIX).split(".lora_", 1)[0] for key in converted if ".lora_" in key}
    linear = [name for name, module in transformer.named_modules() if isinstance(module, torch.nn.Linear)]
    what = f"LoRA {origin}: its lora_adapter_metadata header"
    lora_config.check_targets(config, layers, linear, what=what)
    if config.get("lora_bias") and not any(key.endswith(".lora_B.bias") for key in converted):
        raise FlowliftError(f"{what} has lora_bias true but the file holds no lora_B bias")
    if not config.get("rank_pattern"):
        check_fit(converted, transformer, origin=origin, rank=config["r"])


def apply_loras(transformer: torch.nn.Module, loras: Sequence[LoraSpec]) -> list[LoadedLora]:
    """Load each ``(path, scale)`` LoRA onto ``transformer`` as a peft adapter and activate them at their scales.

    Needs peft (``pip install 'flowlift[lora]'``). Every file is read, checked and converted before the first
    adapter touches the model, so a refused LoRA leaves the others unloaded too.
    """
    if not loras:
        return []
    from diffusers.utils import USE_PEFT_BACKEND

    if not USE_PEFT_BACKEND:
        raise FlowliftError("LoRAs need peft (pip install 'flowlift[lora]', from a checkout pip install -e '.[lora]')")
    from flowlift.models.hub import weight_file_sha256

    prepared = []
    for index, (path, scale) in enumerate(loras):
        scale = float(scale)
        if scale != scale or abs(scale) == float("inf"):
            raise FlowliftError(f"LoRA {path}: the scale must be a finite number, got {scale}")
        state, metadata = read_lora(path)
        converted = convert_lora(state, transformer, origin=os.fspath(path))
        if metadata is not None:
            _check_metadata_fits(metadata, converted, transformer, origin=os.fspath(path))
        prepared.append((os.fspath(path), scale, f"lora{index}", converted, metadata))
    loaded = []
    for path, scale, adapter, converted, metadata in prepared:
        with _diffusers_warnings() as warned:
            transformer.load_lora_adapter(converted, prefix="transformer", adapter_name=adapter, metadata=metadata)
        if warned:
            raise FlowliftError(f"LoRA {path}: {warned[0].splitlines()[0][:300]}")
        loaded.append(LoadedLora(path, weight_file_sha256(path), scale, adapter))
    transformer.set_adapters([lora.adapter for lora in loaded], weights=[lora.scale for lora in loaded])
    return loaded
