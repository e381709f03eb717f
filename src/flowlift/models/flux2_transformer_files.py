"""FLUX.2 transformer files as users have them: what a file holds, the diffusers config its shapes imply, and its
tensors in the form diffusers' single-file loader reads.

The files: Black Forest Labs / ComfyUI single ``.safetensors`` (BFL tensor names, optionally under ComfyUI's
``model.diffusion_model.`` prefix; or a transformer saved with diffusers' names), their fp8 variants
(``float8_e4m3fn`` weights, plain or scaled: ComfyUI's ``scale_weight`` / ``weight_scale`` per layer, the
``scaled_fp8`` marker, ``_quantization_metadata`` / ``.comfy_quant`` layer formats) and GGUF files (city96's
layout: BFL names, any quantization diffusers' GGUF loader reads).

:func:`inspect_transformer_file` reads only the headers: it names a file that is not a FLUX.2 transformer in one
line (a LoRA, a VAE, a text encoder, a FLUX.1 transformer...), infers the ``Flux2TransformerConfig`` from the
tensor shapes (Klein 4B, Klein 9B and dev differ in width and block counts; nothing is looked up on the hub) and
checks, on shape-only ``meta`` tensors run through diffusers' own key converter, that the file fills every
parameter of that model exactly (diffusers' loader would leave missing ones at their random initialization).
:func:`read_transformer_state` then reads the tensors: prefix dropped, scaled fp8 dequantized, GGUF tensors as
diffusers' ``GGUFParameter``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flowlift.errors import FIELD_MARK, FlowliftError
from flowlift.files.json_input import parse_json
from flowlift.flux2.latents import PATCHIFIED_CHANNELS

#: Prefixes that ComfyUI (and checkpoints saved by it) put before the BFL tensor names.
BFL_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
#: Hidden widths of the released FLUX.2 transformers (names in messages and metadata only; the config is
#: always inferred from the shapes).
KNOWN_WIDTHS = {3072: "FLUX.2 Klein 4B", 4096: "FLUX.2 Klein 9B", 6144: "FLUX.2 dev"}
FP8 = torch.float8_e4m3fn
#: Tensor names that locate the config in each layout: in-projection, text projection, timestep embedder,
#: guidance embedder, a single block's fused projection and its query norm, the output projection.
_LAYOUT_KEYS = {
    "bfl": {
        "img_in": "img_in.weight",
        "txt_in": "txt_in.weight",
        "time": "time_in.in_layer.weight",
        "guidance": "guidance_in.in_layer.weight",
        "fused": "single_blocks.0.linear1.weight",
        "query_norm": "single_blocks.0.norm.query_norm.scale",
        "out": "final_layer.linear.weight",
        "double": "double_blocks.",
        "single": "single_blocks.",
    },
    "diffusers": {
        "img_in": "x_embedder.weight",
        "txt_in": "context_embedder.weight",
        "time": "time_guidance_embed.timestep_embedder.linear_1.weight",
        "guidance": "time_guidance_embed.guidance_embedder.linear_1.weight",
        "fused": "single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight",
        "query_norm": "single_transformer_blocks.0.attn.norm_q.weight",
        "out": "proj_out.weight",
        "double": "transformer_blocks.",
        "single": "single_transformer_blocks.",
    },
}
_MARKERS = {"bfl": "single_stream_modulation.lin.weight", "diffusers": "single_stream_modulation.linear.weight"}
#: Per-layer fp8 scale tensors (ComfyUI's old and new spellings) and activation-scale hints (unused when computing
#: in bf16/fp32), and the marker tensors of ComfyUI's scaled-fp8 and mixed-precision files.
_WEIGHT_SCALE_SUFFIXES = (".scale_weight", ".weight_scale")
_DROPPED_SUFFIXES = (".scale_input", ".input_scale", ".comfy_quant")
_DROPPED_KEYS = ("scaled_fp8",)


@dataclass(frozen=True)
class TransformerFile:
    """What :func:`inspect_transformer_file` found: container, layout, storage, inferred config, model name."""

    path: Path
    container: str  # "safetensors" or "gguf"
    layout: str  # "bfl" or "diffusers" tensor names
    prefix: str  # dropped from every tensor name
    config: dict[str, Any]
    name: str  # e.g. "FLUX.2 Klein 4B"
    storage: dict[str, int] = field(default_factory=dict)  # storage type -> tensor count

    @property
    def fp8(self) -> bool:
        return "float8_e4m3fn" in self.storage

    def describe(self) -> str:
        """``"FLUX.2 Klein 4B, GGUF (Q4_K 180, F32 40)"`` for messages and metadata."""
        kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(self.storage.items(), key=lambda kv: -kv[1]))
        return f"{self.name}, {self.container} ({kinds})"


# ---------------------------------------------------------------------------------------------- headers


def _safetensors_header(path: Path, option: str) -> tuple[dict[str, tuple[int, ...]], dict[str, str], dict[str, str]]:
    """(shapes, dtype names, header metadata) of a safetensors file, checked strictly
    (:func:`flowlift.models.safetensors_headers.read_header`), without reading its tensors."""
    from flowlift.models.safetensors_headers import read_header

    header = read_header(path, what=f"{option} {path}")
    return header.shapes, header.dtypes, header.metadata


def _gguf_header(path: Path, option: str) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """(logical shapes in torch order, quantization type names) of a GGUF file's tensors (memory-mapped)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise FlowliftError(
            f"{option} {path}: reading GGUF transformers needs the gguf extra (pip install 'flowlift[gguf]')"
        ) from None
    try:
        reader = GGUFReader(str(path))
    except Exception as error:  # noqa: BLE001 - any reader failure is a bad file to the user
        from flowlift.models.safetensors_headers import refetch_hint

        raise FlowliftError(
            f"{option} {path}: not a readable GGUF file ({str(error).splitlines()[0][:160]}); if a download was cut "
            f"short, {refetch_hint(path)}"
        ) from None
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape.tolist())) for t in reader.tensors}
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    return shapes, kinds


# ------------------------------------------------------------------------------------------ identification


def _strip_prefix(names: list[str]) -> str:
    for prefix in BFL_PREFIXES:
        if names and sum(name.startswith(prefix) for name in names) * 2 > len(names):
            return prefix
    return ""


#: The field a file of another kind belongs in (:func:`what_it_is`'s mark), as the Python API names it.
HINT_FIELDS = {"a LoRA": "source.loras", "a VAE": "source.vae"}


def what_it_is(names: list[str]) -> str:
    """A few words on what a tensor file that is not a FLUX.2 transformer holds, judged by its names; a LoRA's or a
    VAE's names the field it belongs in with :data:`~flowlift.errors.FIELD_MARK` (:func:`hint_fields`)."""
    joined = "\n".join(names)
    if re.search(r"lora_(A|B|up|down)\b|\.lora\.|lokr_|\.alpha$", joined, re.M):
        return f"a LoRA (low-rank tensors; pass it with {FIELD_MARK})"
    if re.search(r"(^|\.)double_blocks\.\d+\.img_mod\.", joined, re.M):
        return "a FLUX.1 transformer (per-block img_mod modulation), not FLUX.2"
    if re.search(r"(^|\.)(decoder|encoder)\.(conv_in|up|down|mid)", joined, re.M) or "post_quant_conv" in joined:
        return f"a VAE (encoder/decoder convolutions; pass it with {FIELD_MARK})"
    if re.search(r"(^|\.)layers\.\d+\.(self_attn|mlp)\.|embed_tokens", joined, re.M):
        return "a text encoder (language-model layers)"
    if re.search(r"(^|\.)(down_blocks|up_blocks|input_blocks|output_blocks)\.\d+\.", joined, re.M):
        return "a UNet (input/down blocks), not a FLUX.2 transformer checkpoint"
    sample = ", ".join(names[:3]) or "none"
    return f"not a FLUX.2 transformer checkpoint ({len(names)} tensors, e.g. {sample})"


def hint_fields(said: str) -> tuple[str, ...]:
    """The field :func:`what_it_is`'s words ``said`` name with their mark (none for other kinds)."""
    return tuple(name for kind, name in HINT_FIELDS.items() if FIELD_MARK in said and said.startswith(kind))


def _expected() -> str:
    return (
        "expected a FLUX.2 transformer (Klein 4B/9B or dev: double_blocks.*, single_blocks.*, "
        "single_stream_modulation) as .safetensors (bf16/fp16/fp32 or fp8) or .gguf"
    )


def flux2_config_from_shapes(shapes: dict[str, tuple[int, ...]], layout: str) -> dict[str, Any]:
    """The ``Flux2Transformer2DModel`` config implied by the tensor shapes of a ``layout`` ("bfl"/"diffusers") file.

    Width and input/text/timestep channels come from the projections' shapes, the head size from a query norm,
    the MLP ratio from a single block's fused projection (``3 * inner + 2 * mlp_hidden`` rows), the block counts
    from the highest block indices, guidance from the presence of a guidance embedder. The rotary axes split the
    head evenly in four (FLUX.2: 4 x 32 for heads of 128).
    """
    keys = _LAYOUT_KEYS[layout]
    try:
        inner, in_channels = shapes[keys["img_in"]]
        joint = shapes[keys["txt_in"]][1]
        timestep_channels = shapes[keys["time"]][1]
        head_dim = shapes[keys["query_norm"]][0]
        fused_rows = shapes[keys["fused"]][0]
        out_channels = shapes[keys["out"]][0]
    except (KeyError, ValueError, IndexError) as error:
        raise FlowliftError(f"FLUX.2 transformer file lacks or mis-shapes the tensor {error}") from None
    if head_dim <= 0 or inner % head_dim or head_dim % 4 or (fused_rows - 3 * inner) % 2:
        raise FlowliftError(f"FLUX.2 transformer shapes do not fit together (width {inner}, head {head_dim})")
    if in_channels != PATCHIFIED_CHANNELS or out_channels != in_channels:
        # the refiner feeds and reads FLUX.2 VAE latents, patchified: anything else fails only after a whole run
        raise FlowliftError(
            f"FLUX.2 transformer file maps {in_channels} latent channels ({keys['img_in']}) to {out_channels} "
            f"({keys['out']}); a FLUX.2 transformer maps the VAE's {PATCHIFIED_CHANNELS} patchified channels to "
            f"{PATCHIFIED_CHANNELS}"
        )

    def count(prefix: str) -> int:
        found = [int(m.group(1)) for name in shapes if (m := re.match(re.escape(prefix) + r"(\d+)\.", name))]
        return max(found) + 1 if found else 0

    mlp_hidden = (fused_rows - 3 * inner) // 2
    return {
        "_class_name": "Flux2Transformer2DModel",
        "patch_size": 1,
        "in_channels": in_channels,
        "out_channels": None if out_channels == in_channels else out_channels,
        "num_layers": count(keys["double"]),
        "num_single_layers": count(keys["single"]),
        "attention_head_dim": head_dim,
        "num_attention_heads": inner // head_dim,
        "joint_attention_dim": joint,
        "timestep_guidance_channels": timestep_channels,
        "mlp_ratio": mlp_hidden / inner,
        "axes_dims_rope": [head_dim // 4] * 4,
        "guidance_embeds": keys["guidance"] in shapes,
    }


def model_name(config: dict[str, Any]) -> str:
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    base = KNOWN_WIDTHS.get(inner, f"FLUX.2 (width {inner})")
    return f"{base}, {config['num_layers']}+{config['num_single_layers']} blocks"


def inspect_transformer_file(path: str | Path, *, option: str = "--transformer") -> TransformerFile:
    """Identify a single-file FLUX.2 transformer from its headers (see the module docstring).

    A file of another kind, an unknown suffix or tensors that do not fill the model exactly is one
    :class:`FlowliftError` line naming what the file is and what was expected.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".gguf":
        shapes, kinds = _gguf_header(path, option)
        container, metadata = "gguf", {}
    elif suffix == ".safetensors":
        shapes, kinds, metadata = _safetensors_header(path, option)
        container = "safetensors"
    else:
        raise FlowliftError(
            f"{option} {path}: a {suffix or 'suffix-less'} file; {_expected()} (never pickles: they can run code)"
        )
    names = list(shapes)
    prefix = _strip_prefix(names)
    shapes = {name[len(prefix) :]: shape for name, shape in shapes.items() if name.startswith(prefix)}
    kinds = {name[len(prefix) :]: kind for name, kind in kinds.items() if name.startswith(prefix)}
    layout = next((lay for lay, marker in _MARKERS.items() if marker in shapes), None)
    if layout is None:
        said = what_it_is(names)  # a LoRA or a VAE: the field it belongs in, for each door to word
        raise FlowliftError(f"{option} {path}: {said}; {_expected()}", field=hint_fields(said))
    formats = _layer_formats(metadata)
    kinds = {name: "float8_e4m3fn" if _in_fp8_container(name, kind, formats) else kind for name, kind in kinds.items()}
    _check_storage(path, option, container, kinds, formats)
    _check_scales(path, option, shapes)
    try:
        config = flux2_config_from_shapes(shapes, layout)
    except FlowliftError as error:
        raise FlowliftError(f"{option} {path}: {str(error).removeprefix('FLUX.2 transformer file ')}") from None
    weights = {name: shape for name, shape in shapes.items() if not _is_auxiliary(name)}
    _check_fills_model(path, option, weights, layout, config)
    storage: dict[str, int] = {}
    for name in weights:
        storage[kinds[name]] = storage.get(kinds[name], 0) + 1
    return TransformerFile(path, container, layout, prefix, config, model_name(config), storage)


def _is_auxiliary(name: str) -> bool:
    return name in _DROPPED_KEYS or name.endswith(_DROPPED_SUFFIXES + _WEIGHT_SCALE_SUFFIXES)


def _layer_formats(metadata: dict[str, str]) -> dict[str, str]:
    """Per-layer quantization formats a ComfyUI mixed-precision file declares in its header metadata, if any."""
    raw = metadata.get("_quantization_metadata")
    if not raw:
        return {}
    try:
        layers = parse_json(raw).get("layers", {})
    except (ValueError, AttributeError):
        return {"(all)": "unreadable _quantization_metadata"}
    return {layer: conf.get("format", "?") if isinstance(conf, dict) else str(conf) for layer, conf in layers.items()}


def _in_fp8_container(name: str, kind: str, formats: dict[str, str]) -> bool:
    """An fp8 layer's weight kept in a uint8 container, as the header metadata declares."""
    return kind == "uint8" and name.endswith(".weight") and formats.get(name[: -len(".weight")]) == "float8_e4m3fn"


_FLOAT_KINDS = ("float32", "float16", "bfloat16", "float8_e4m3fn")


def _check_storage(path: Path, option: str, container: str, kinds: dict[str, str], formats: dict[str, str]) -> None:
    """Refuse storage flowlift cannot read exactly (GGUF types are diffusers' GGUF loader's to check)."""
    for layer, kind in formats.items():
        if kind != "float8_e4m3fn":
            raise FlowliftError(
                f"{option} {path}: layer {layer} is stored as {kind} (ComfyUI mixed precision); flowlift reads "
                "float8_e4m3fn (plain or scaled), GGUF and float weights"
            )
    if container == "gguf":
        return
    for name, kind in kinds.items():
        if kind not in _FLOAT_KINDS and not (_is_auxiliary(name) and kind in ("float64", "uint8", "int8")):
            raise FlowliftError(
                f"{option} {path}: tensor {name} is {kind}; a FLUX.2 transformer file holds float weights "
                "(bf16/fp16/fp32, float8_e4m3fn plain or scaled) or is a GGUF file"
            )


def _check_scales(path: Path, option: str, shapes: dict[str, tuple[int, ...]]) -> None:
    """Each fp8 weight scale belongs to a weight and holds one value or one per row of it."""
    for name, shape in shapes.items():
        suffix = next((s for s in _WEIGHT_SCALE_SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            continue
        weight = shapes.get(name.removesuffix(suffix) + ".weight")
        count = math.prod(shape)
        rows = weight[0] if weight else None
        if weight is None or not (count == 1 or (count == rows and shape in ((rows,), (rows, 1)))):
            expected = f"1 or {rows} (one per row of its weight {weight})" if weight else "a weight beside it"
            raise FlowliftError(f"{option} {path}: fp8 scale {name} has shape {shape}; expected {expected}")


def _check_fills_model(path: Path, option: str, shapes: dict, layout: str, config: dict[str, Any]) -> None:
    """The tensors, converted by diffusers' own FLUX.2 key map on ``meta`` tensors, fill the model exactly."""
    from diffusers import Flux2Transformer2DModel

    from flowlift.models.weights import state_dict_mismatch

    with torch.device("meta"):
        model = Flux2Transformer2DModel.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    state = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    if layout == "bfl":
        from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

        try:
            state = convert_flux2_transformer_checkpoint_to_diffusers(state)
        except (KeyError, ValueError, RuntimeError, UnboundLocalError) as error:
            raise FlowliftError(
                f"{option} {path}: unexpected FLUX.2 tensor layout ({error!r}); {_expected()}"
            ) from None
    problem = state_dict_mismatch(model, state)
    if problem:
        raise FlowliftError(f"{option} {path}: does not fill a {model_name(config)} transformer: {problem}")


# ------------------------------------------------------------------------------------------------ reading


def read_transformer_state(
    info: TransformerFile, *, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], tuple[str, ...]]:
    """The file's tensors for ``from_single_file`` and the scaled fp8 layers that were dequantized.

    Names lose the prefix; scale, activation-scale and marker tensors are dropped. GGUF: diffusers'
    ``GGUFParameter`` tensors (quantized blocks stay quantized). Safetensors: as stored, except fp8 weights kept in
    uint8 containers (reinterpreted as ``float8_e4m3fn``) and scaled fp8 layers, dequantized to ``dtype`` as
    ``float32(weight) * scale`` (one scale per tensor or per row); a unit scale leaves the layer plain fp8.
    """
    if info.container == "gguf":
        from diffusers.models.model_loading_utils import load_gguf_checkpoint

        try:
            raw = load_gguf_checkpoint(str(info.path))
        except (ValueError, ImportError) as error:
            raise FlowliftError(f"{info.path}: {str(error).strip().splitlines()[0][:240]}") from None
    else:
        from safetensors.torch import load_file

        try:
            raw = load_file(str(info.path), device="cpu")
        except Exception as error:  # noqa: BLE001 - the file changed since its header was checked
            raise FlowliftError(f"{info.path}: cannot read its tensors ({str(error).splitlines()[0][:200]})") from None
    state = {name[len(info.prefix) :]: t for name, t in raw.items() if name.startswith(info.prefix)}
    del raw
    out, dequantized = {}, []
    for name, tensor in state.items():
        if _is_auxiliary(name):
            continue
        layer = name.removesuffix(".weight")
        if tensor.dtype == torch.uint8 and info.container == "safetensors":
            tensor = tensor.view(FP8)  # inspect_transformer_file let only declared fp8 layers through
        scale = next((state[layer + s] for s in _WEIGHT_SCALE_SUFFIXES if layer + s in state), None)
        if scale is not None and tensor.dtype == FP8 and not (scale.numel() == 1 and float(scale) == 1.0):
            scale = scale.float()
            scale = scale.reshape(-1, *([1] * (tensor.ndim - 1))) if scale.numel() > 1 else scale.reshape(())
            tensor = (tensor.float() * scale).to(dtype)
            dequantized.append(layer)
        out[name] = tensor
    return out, tuple(dequantized)
