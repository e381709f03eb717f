"""Loading FLUX.2 weights: the transformer from a diffusers folder, a hub id or one file (BFL/ComfyUI
safetensors, fp8, GGUF), LoRAs on it, then the refiner placed in device memory as planned.

Every way a source's ``model`` / ``transformer`` can be wrong (a missing path, a file that is not a FLUX.2
transformer, a hub id that is not cached or cannot be fetched) ends here as one FlowliftError line naming the field
(``source.model``: :func:`flowlift.refine.source_checks.names_source_fields`), which each door says in its own words.
What a source names is checked before any of this runs (:mod:`flowlift.refine.source_checks`).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from flowlift.errors import FlowliftError
from flowlift.models.weights import looks_like_repo_id
from flowlift.refine.loras import LoraSpec
from flowlift.refine.memory_plan import RefineMemory
from flowlift.refine.prompts import PromptEncoder, _first_line
from flowlift.refine.refiner import Flux2Refiner
from flowlift.refine.settings import MU, SCHEDULE
from flowlift.refine.source_checks import _is_diffusers_folder, names_source_fields
from flowlift.refine.tiling import TileRequest

#: Suffixes of single-file transformers (everything else is a folder or a hub id).
TRANSFORMER_FILE_SUFFIXES = (".safetensors", ".gguf")


def _hub_model_error(model: str, error: BaseException, option: str) -> FlowliftError:
    """One actionable line for a hub id that could not be loaded (offline cache miss, gated, missing)."""
    from flowlift.models.hub import access_hint, download_hint, hub_offline_reason

    if refused := access_hint(model, error):  # `hf download` would be refused the same way
        return FlowliftError(f"{option} {model}: cannot get it from the hub: {refused}")
    offline = hub_offline_reason()
    if offline:
        return FlowliftError(
            f"{option} {model}: its transformer/ folder is not in the Hugging Face cache and {offline}; "
            f"{download_hint(model)} or pass a local folder"
        )
    return FlowliftError(
        f"{option} {model}: cannot get it from the hub ({_first_line(error)}); {download_hint(model)} "
        "or pass a local folder"
    )


@names_source_fields
def load_transformer_file(
    path: str | os.PathLike, *, dtype: torch.dtype, option: str = "source.model"
) -> torch.nn.Module:
    """A ``Flux2Transformer2DModel`` from one BFL/ComfyUI ``.safetensors`` (float or fp8) or ``.gguf`` file.

    The config comes from the file's shapes (:func:`flowlift.models.flux2_transformer_files.inspect_transformer_file`;
    nothing is fetched), the tensors go through diffusers' ``from_single_file`` (its FLUX.2 key converter; GGUF via
    ``GGUFQuantizationConfig(compute_dtype=dtype)``: blocks stay quantized and are dequantized per layer when it
    runs). fp8 weights stay stored in ``float8_e4m3fn`` and are computed in ``dtype`` (diffusers' layerwise casting,
    :func:`store_fp8_layers`); scaled fp8 layers are dequantized to ``dtype`` once, here.
    """
    from diffusers import Flux2Transformer2DModel

    from flowlift.models.flux2_transformer_files import inspect_transformer_file, read_transformer_state

    info = inspect_transformer_file(path, option=option)
    kwargs: dict[str, Any] = {}
    if info.container == "gguf":
        from diffusers import GGUFQuantizationConfig
        from diffusers.utils import is_accelerate_available

        if not is_accelerate_available():
            raise FlowliftError(
                f"{option} {path}: GGUF transformers need the gguf extra (pip install 'flowlift[gguf]')"
            )
        kwargs["quantization_config"] = GGUFQuantizationConfig(compute_dtype=dtype)
    state, dequantized = read_transformer_state(info, dtype=dtype)
    _refuse_non_finite(state, Path(path), f"{option} {path}")
    fp8_modules = _fp8_module_names(state, info.layout)  # before from_single_file: its converter empties ``state``
    if dequantized:
        warnings.warn(
            f"{option} {path}: {len(dequantized)} scaled fp8 layers dequantized to {str(dtype).removeprefix('torch.')} "
            "(diffusers stores fp8 without per-layer scales), so they take that dtype's memory",
            UserWarning,
            stacklevel=2,
        )
    try:
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "config.json").write_text(json.dumps(info.config))
            model = Flux2Transformer2DModel.from_single_file(state, config=folder, torch_dtype=dtype, **kwargs)
    except FlowliftError:
        raise
    except Exception as error:  # noqa: BLE001 - any loader failure is a bad file to the user
        raise FlowliftError(f"{option} {path}: cannot load it as {info.describe()}: {_first_line(error)}") from None
    model.flowlift_source = {"transformer_file": info.describe()}
    model.flowlift_fp8_modules = fp8_modules
    return model.eval().requires_grad_(False)


def _refuse_non_finite(state: dict[str, torch.Tensor], file: Path, what: str) -> None:
    """One line, ``what`` first, naming the tensor and how to replace ``file`` when a floating tensor of the
    transformer ``state`` holds NaN or Inf: every sampling step would give NaN, and refine_latents' own check says
    so only after all of them, naming no file.

    :func:`~flowlift.models.weights.first_non_finite` reads each tensor once as it is (bf16, fp16, fp32; an fp8
    tensor's bytes, a GGUF tensor's block scales): no copy of the model. Measured on a 2-core CPU, one thread:
    about 0.1 s per GB of bf16 weights, 0.2 s per GB of fp8 and 0.15-0.45 s per GB of GGUF blocks (a 9B Klein in
    bf16 ~2 s, small beside reading it from disk).
    """
    from flowlift.models.safetensors_headers import refetch_hint
    from flowlift.models.weights import first_non_finite

    bad = first_non_finite(state)
    if bad:
        raise FlowliftError(
            f"{what}: its weights contain {bad}, so every image would be NaN; {refetch_hint(file)} or use another"
        )


def _refuse_non_finite_folder(module: torch.nn.Module, folder: Path | None, model: str, option: str) -> None:
    """:func:`_refuse_non_finite` for a transformer diffusers loaded from ``folder`` (a transformer folder, a hub
    id's cached one; None: not found), on its tensors as loaded; the line names the weight file holding the tensor
    (the shard the folder's index maps it to)."""
    from flowlift.models.flux2_transformer_folders import INDEX_NAME, WEIGHTS_NAME
    from flowlift.models.weights import first_non_finite

    state = module.state_dict()
    bad = first_non_finite(state)
    if not bad:
        return
    name = bad.split("`")[1]
    file = (folder or Path(model)) / WEIGHTS_NAME
    if folder is not None and (folder / INDEX_NAME).is_file():
        try:
            file = folder / json.loads((folder / INDEX_NAME).read_text())["weight_map"][name]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # the index was checked before diffusers read it; the line names the folder's usual file
    _refuse_non_finite({name: state[name]}, file, f"{option} {model}: {file}")


def _fp8_module_names(state: dict[str, torch.Tensor], layout: str) -> set[str]:
    """The diffusers module names of the layers whose weights the file stores in fp8 (keys mapped by diffusers'
    own converter, on shape-only copies)."""
    meta = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in state.items()}
    if layout == "bfl" and any(t.dtype == torch.float8_e4m3fn for t in meta.values()):
        from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

        meta = convert_flux2_transformer_checkpoint_to_diffusers(meta)
    return {name.removesuffix(".weight") for name, t in meta.items() if t.dtype == torch.float8_e4m3fn}


def store_fp8_layers(transformer: torch.nn.Module, *, dtype: torch.dtype) -> int:
    """Keep the layers the file stored in fp8 stored in ``float8_e4m3fn``, computed in ``dtype``; returns their count.

    diffusers' layerwise casting (``apply_layerwise_casting``) on exactly those layers (a LoRA's peft wrapper
    holds the layer as ``base_layer``); every other layer keeps ``dtype``. The stored values are the file's fp8
    values, so nothing is rounded. Applied after the LoRAs, whose small matrices stay in ``dtype``.
    """
    fp8 = getattr(transformer, "flowlift_fp8_modules", None)
    if not fp8:
        return 0
    from diffusers.hooks import apply_layerwise_casting
    from diffusers.hooks._common import _GO_LC_SUPPORTED_PYTORCH_LAYERS

    keep = [
        name
        for name, module in transformer.named_modules()
        if isinstance(module, _GO_LC_SUPPORTED_PYTORCH_LAYERS) and name.removesuffix(".base_layer") not in fp8
    ]
    skip = ("^(" + "|".join(re.escape(name) for name in keep) + ")$",) if keep else ()
    apply_layerwise_casting(transformer, torch.float8_e4m3fn, dtype, skip_modules_pattern=skip)
    return len(fp8)


@names_source_fields
def load_transformer(model: str, *, dtype: torch.dtype, option: str = "source.model") -> torch.nn.Module:
    """A ``Flux2Transformer2DModel`` from a diffusers folder / hub id (``transformer/`` subfolder), a
    transformer folder (``config.json``), or a single BFL/ComfyUI ``.safetensors`` (float or fp8) or ``.gguf`` file
    (:func:`load_transformer_file`)."""
    from diffusers import Flux2Transformer2DModel

    from flowlift.models.flux2_transformer_folders import cached_transformer_folder, inspect_transformer_folder
    from flowlift.models.hub import looks_like_path

    if not str(model).strip():  # Path("") is the working folder: an empty name names no model
        raise FlowliftError(f"{option}: an empty name or path names no model, got {model!r}")
    path = Path(model).expanduser()
    if not path.exists() and looks_like_path(model):
        raise FlowliftError(f"{option} {model}: no such file or folder")
    if path.is_file():
        return load_transformer_file(path, dtype=dtype, option=option)
    from_hub = not path.exists() and looks_like_repo_id(model)
    try:
        if path.is_dir() and (path / "config.json").is_file() and not _is_diffusers_folder(path):
            inspect_transformer_folder(path, option=option)
            module = Flux2Transformer2DModel.from_pretrained(str(path), torch_dtype=dtype)
            _refuse_non_finite_folder(module, path, model, option)
            return module
        if path.is_dir() and not (path / "transformer" / "config.json").is_file():
            raise FlowliftError(
                f"{option} {model}: not a FLUX.2 transformer folder (it needs transformer/config.json, the diffusers "
                "layout, or config.json, a bare transformer folder)"
            )
        if path.is_dir():
            inspect_transformer_folder(path / "transformer", option=option)
        cached = cached_transformer_folder(model) if from_hub else None
        if cached is not None:  # what diffusers would load from the cache, checked the same way
            inspect_transformer_folder(cached, option=f"{option} {model}:")
        if path.is_dir() or from_hub:
            from flowlift.models.hub import hub_offline_reason

            cache_only = from_hub and hub_offline_reason() is not None  # no retries against an unreachable hub
            module = Flux2Transformer2DModel.from_pretrained(
                model, subfolder="transformer", torch_dtype=dtype, local_files_only=cache_only
            )
            folder = path / "transformer" if path.is_dir() else cached_transformer_folder(model)
            _refuse_non_finite_folder(module, folder, model, option)
            return module
    except FlowliftError:
        raise
    except Exception as error:  # noqa: BLE001 - any loader failure is a bad model to the user
        if from_hub:
            raise _hub_model_error(model, error, option) from None
        raise FlowliftError(f"cannot load a FLUX.2 transformer from {model}: {_first_line(error)}") from None
    raise FlowliftError(f"{option} {model}: no such file or folder, and not a hub repo id (owner/name)")


@names_source_fields
def load_refiner(
    model: str,
    *,
    vae: str | None = None,
    transformer: str | None = None,
    loras: Sequence[LoraSpec] = (),
    memory: RefineMemory | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    text_encoder: bool = False,
    progress: bool | None = False,
    mu: float | str = MU.default,
    schedule: str = SCHEDULE.default,
    tiles: TileRequest | None = None,
) -> Flux2Refiner:
    """A :class:`Flux2Refiner` from FLUX.2 Klein / dev weights.

    ``model``: a diffusers folder or hub id (``transformer/`` and ``vae/``), a transformer folder or a single
    transformer file. ``transformer`` (optional) takes the transformer from elsewhere (a BFL/ComfyUI single file,
    fp8, GGUF, a folder or hub id; :func:`load_transformer`), the VAE and text encoder still from ``model``.
    ``vae`` (any :func:`flowlift.models.vae_loading.load_vae` spec) defaults to the model's own ``vae/``.
    ``loras``: ``(path, scale)`` pairs applied to the transformer (:func:`flowlift.refine.loras.apply_loras`;
    needs ``flowlift[lora]``), active in every pass. ``memory`` (:class:`~flowlift.refine.memory_plan.RefineMemory`):
    ``offload`` ``none``, ``model``, ``group`` (:mod:`flowlift.refine.offload`) or ``auto``: with ``max_memory``, what
    :func:`flowlift.refine.memory_plan.plan_refine` picks for images up to ``image_size`` (height, width) pixels
    (it also decides the VAE's tiling), else ``none``. ``text_encoder=True`` also loads the pipeline's text encoder
    (``flowlift[text]``) so prompts can be strings; with an offload mode it waits in host memory between prompts.
    To free its memory before the transformer loads, embed the prompts first
    (:func:`flowlift.refine.prompts.embed_prompts`) and pass ``prompt_embeds``.
    ``mu`` and ``schedule`` are the refiner's schedule (:class:`Flux2Refiner`), checked before any weights load.
    ``tiles`` (:class:`~flowlift.refine.tiling.TileRequest`) is its tiling, also checked first; with ``max_memory``
    the plan counts a tile's tokens instead of the frame's where it tiles.
    """
    from flowlift.models.vae_loading import load_vae
    from flowlift.refine.loras import apply_loras
    from flowlift.refine.offload import OFFLOAD_MODES, Placement

    device, tiling, memory = _checked_arguments(vae, loras, memory, device, dtype, text_encoder, progress, tiles)
    mu, schedule = MU.check(mu), SCHEDULE.check(schedule)
    offload = memory.offload
    if offload != "auto" and offload not in OFFLOAD_MODES:
        raise FlowliftError(f"offload must be auto or one of {', '.join(OFFLOAD_MODES)}, got {offload!r}")
    option = "source.transformer" if transformer is not None else "source.model"
    module = load_transformer(transformer if transformer is not None else model, dtype=dtype, option=option)
    # the FLUX.2 VAE overflows in float16; bfloat16 and float32 are fine
    vae_dtype = torch.float32 if dtype == torch.float16 else dtype
    vae_adapter = load_vae(vae or model, device=device, dtype=vae_dtype)
    loaded_loras = apply_loras(module, loras)
    fp8_layers = store_fp8_layers(module, dtype=dtype)
    plan = None
    if memory.max_memory is not None:
        plan = _plan(module, vae_adapter, memory, dtype, vae_dtype, tiling)
    placement = Placement.planned(plan) if plan is not None else Placement("none" if offload == "auto" else offload)
    encoder = None
    if text_encoder:
        encoder = PromptEncoder(model, device=device, dtype=dtype, offload=placement.offload != "none")
    provenance: dict[str, Any] = dict(getattr(module, "flowlift_source", {}))
    if transformer is not None:
        provenance["transformer"] = str(transformer)
    if fp8_layers:
        provenance["fp8_layers"] = fp8_layers
    if loaded_loras:
        provenance["loras"] = [lora.record() for lora in loaded_loras]
    provenance["offload"] = placement.offload
    if plan is not None:
        provenance["memory_plan"] = plan.describe()
    steps, why = model_default_steps(model, transformer)
    provenance["default_steps"] = f"{steps} ({why})"
    refiner = Flux2Refiner(
        module,
        vae_adapter,
        device=device,
        dtype=dtype,
        prompt_encoder=encoder,
        progress=progress,
        model_name=str(model),
        mu=mu,
        schedule=schedule,
        placement=placement,
        provenance=provenance,
        tiles=tiling,
    )
    refiner.default_steps = steps
    return refiner


def _checked_arguments(
    vae: Any,
    loras: Any,
    memory: Any,
    device: Any,
    dtype: Any,
    text_encoder: Any,
    progress: Any,
    tiles: Any,
) -> tuple[torch.device, TileRequest, RefineMemory]:
    """:func:`load_refiner`'s arguments checked before any weights load, each refusal one line naming its keyword:
    ``vae`` None or a non-empty name, ``loras`` ``(path, scale)`` pairs of existing files and finite scales, the
    settings objects of their kinds, a device that exists here, a floating ``dtype``, ``text_encoder`` a bool and
    ``progress`` a bool or None. Returns the device, the tiling and the memory settings (defaults for None)."""
    import math

    from flowlift.devices import resolve_device_option
    from flowlift.knobs import check_dtype, check_kind

    if vae is not None and not str(os.fspath(vae) if isinstance(vae, (str, os.PathLike)) else "").strip():
        raise FlowliftError(f"vae must be a VAE name or path (None: the model's own), got {vae!r}", field="vae")
    if isinstance(loras, (str, os.PathLike)) or not isinstance(loras, Sequence):
        raise FlowliftError(f"loras must be a list of (path, scale) pairs, got {loras!r}", field="loras")
    for pair in loras:
        path, scale = pair if isinstance(pair, (tuple, list)) and len(pair) == 2 else (None, None)
        number = isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale)
        if not isinstance(path, (str, os.PathLike)) or not number:
            raise FlowliftError(f"loras: each must be a (path, finite scale) pair, got {pair!r}", field="loras")
        if not Path(os.fspath(path)).expanduser().is_file():
            raise FlowliftError(f"LoRA {os.fspath(path)}: no such file", field="loras")
    memory = check_kind("memory", memory, RefineMemory, "a RefineMemory", optional=True) or RefineMemory()
    tiling = check_kind("tiles", tiles, TileRequest, "a TileRequest", optional=True) or TileRequest()
    check_dtype(dtype)
    check_kind("text_encoder", text_encoder, bool, "True or False")
    if progress is not None:
        check_kind("progress", progress, bool, "True, False or None")
    return resolve_device_option(device), tiling, memory


def _plan(module, vae_adapter, memory: RefineMemory, dtype, vae_dtype, tiling: TileRequest):
    from flowlift.limits import model_bytes, parse_memory, vae_kind
    from flowlift.refine.memory_plan import DEFAULT_TEXT_TOKENS, VAESizes, plan_refine, transformer_sizes

    sizes = transformer_sizes(module)
    height, width = memory.image_size
    return plan_refine(
        height,
        width,
        parse_memory(memory.max_memory),
        sizes,
        dtype=dtype,
        vae=VAESizes(vae_kind(vae_adapter), model_bytes(vae_adapter), vae_dtype),
        text_tokens=memory.text_tokens or DEFAULT_TEXT_TOKENS,
        offload=None if memory.offload == "auto" else memory.offload,
        tiles=tiling,
    )


def model_default_steps(model: str, transformer: str | None = None) -> tuple[int, str]:
    """The steps a model is made for, and why: a diffusers folder's (or cached hub id's) ``model_index.json`` says
    ``is_distilled`` (diffusers' ``Flux2KleinPipeline``: True is the step-distilled Klein, 4 steps; False or absent
    the base model, 28); without one (a single transformer file), a Klein name without ``base`` (BFL's
    ``flux-2-klein-4b.safetensors``) is the distilled model; anything else 28 (:data:`STEPS`' default). Nothing is
    fetched."""
    from flowlift.refine.settings import DISTILLED_STEPS, STEPS

    index = _model_index(model)
    if index is not None:
        if index.get("is_distilled") is True:
            return DISTILLED_STEPS, "model_index.json: is_distilled"
        return STEPS.default, "model_index.json: not distilled"
    name = Path(transformer or model).name.lower()
    if "klein" in name and "base" not in name:
        return DISTILLED_STEPS, "a Klein model without 'base' in its name: step-distilled"
    return STEPS.default, "not a step-distilled Klein"


def _model_index(model: str) -> dict[str, Any] | None:
    """``model_index.json`` of a local diffusers folder, or of a hub id in the Hugging Face cache; None without one."""
    path = Path(model).expanduser() / "model_index.json"
    if not path.is_file() and not Path(model).expanduser().exists() and looks_like_repo_id(model):
        from flowlift.models.hub import cached_file

        cached = cached_file(model, "model_index.json")
        path = Path(cached) if cached is not None else path
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return index if isinstance(index, dict) else None
