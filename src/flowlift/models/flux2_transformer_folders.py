"""A diffusers FLUX.2 transformer folder (``config.json`` and ``diffusion_pytorch_model*.safetensors``), checked
as strictly as a single file before diffusers builds anything from it.

diffusers' ``from_pretrained`` builds the model from ``config.json`` first and then loads what of the weights
fits: a config with fewer blocks than the weights drops the others with a warning, a larger one leaves blocks
at their random initialization (or allocates until the machine gives out, for ``num_layers: 200000``), an
integer tensor is cast to float, and a folder without safetensors falls back to pickles after printing its own
error line. :func:`inspect_transformer_folder` reads only the headers (strictly,
:mod:`flowlift.models.safetensors_headers`), infers the config the weights imply
(:func:`~flowlift.models.flux2_transformer_files.flux2_config_from_shapes`), compares ``config.json`` with it
value by value, and checks on shape-only ``meta`` tensors that the weights fill that model exactly, with float
tensors only. Each problem is one :class:`~flowlift.errors.FlowliftError` line naming the folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flowlift.errors import FlowliftError
from flowlift.files.json_input import parse_json

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = WEIGHTS_NAME + ".index.json"
#: config.json keys that the weights' shapes determine.
_FROM_SHAPES = (
    "in_channels",
    "num_layers",
    "num_single_layers",
    "attention_head_dim",
    "num_attention_heads",
    "joint_attention_dim",
    "timestep_guidance_channels",
    "guidance_embeds",
    "mlp_ratio",
)


def _weight_files(folder: Path, what: str) -> list[Path]:
    """The folder's safetensors weight files: the single file, or the shards its index names."""
    if (folder / WEIGHTS_NAME).is_file():
        return [folder / WEIGHTS_NAME]
    if not (folder / INDEX_NAME).is_file():
        others = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt*"))
        found = f"; it holds {', '.join(others[:3])}, which flowlift never unpickles (pickles can run code)"
        found = found if others else _half_download(folder)
        raise FlowliftError(f"{what}: no {WEIGHTS_NAME} (or {INDEX_NAME}) beside its config.json{found}")
    try:
        index = parse_json((folder / INDEX_NAME).read_text())
        shards = sorted(set(index["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise FlowliftError(f"{what}: {INDEX_NAME} is not a readable shard index ({error!r})"[:300]) from None
    files = []
    for shard in shards:
        if not isinstance(shard, str) or Path(shard).name != shard or not (folder / shard).is_file():
            missing = f"{what}: {INDEX_NAME} names the shard {shard!r}, which is not in the folder"
            raise FlowliftError(missing + (_half_download(folder) if isinstance(shard, str) else ""))
        files.append(folder / shard)
    return files


def _half_download(folder: Path) -> str:
    """For a folder of the Hugging Face cache whose weights are missing (a download cut short): ``; an interrupted
    download? download it once with `hf download OWNER/NAME --include 'transformer/*'` (...)``, else ``""``."""
    from flowlift.models.hub import cached_repo_path, download_hint

    cached = cached_repo_path(folder)
    if cached is None:
        return ""
    repo, inside = cached
    return f"; an interrupted download? {download_hint(repo, include=f'{inside}/*' if inside else None)}"


def _read_config(folder: Path, what: str) -> dict[str, Any]:
    try:
        config = parse_json((folder / "config.json").read_text())
    except (OSError, ValueError, UnicodeDecodeError) as error:
        raise FlowliftError(f"{what}: config.json is not readable JSON ({str(error)[:160]})") from None
    if not isinstance(config, dict):
        raise FlowliftError(f"{what}: config.json is not a JSON object")
    return config


def _defaults() -> dict[str, Any]:
    """``Flux2Transformer2DModel``'s constructor defaults (what a key missing from config.json means)."""
    import inspect

    from diffusers import Flux2Transformer2DModel

    parameters = inspect.signature(Flux2Transformer2DModel.__init__).parameters.values()
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def _config_problem(config: dict[str, Any], implied: dict[str, Any]) -> str | None:
    """The first config.json value that the weights contradict or that cannot build a FLUX.2 transformer."""
    for key in _FROM_SHAPES:
        value, expected = config[key], implied[key]
        if key == "mlp_ratio":
            if not isinstance(value, (int, float)) or isinstance(value, bool) or abs(value - expected) > 1e-6:
                return f"mlp_ratio is {value!r}, the weights' {expected:g}"
        elif type(value) is not type(expected) or value != expected:
            return f"{key} is {value!r}, the weights hold {expected!r}"
    if config.get("out_channels") not in (None, config["in_channels"]):
        return f"out_channels is {config.get('out_channels')!r}; a FLUX.2 transformer gives back its in_channels"
    if config.get("patch_size") != 1:
        return f"patch_size is {config.get('patch_size')!r}; FLUX.2 transformers take patchified latents (1)"
    axes = config.get("axes_dims_rope")
    if not (
        isinstance(axes, (list, tuple))
        and len(axes) == 4
        and all(type(a) is int and a > 0 for a in axes)
        and sum(axes) == implied["attention_head_dim"]
    ):
        return f"axes_dims_rope is {axes!r}; FLUX.2 splits each head of {implied['attention_head_dim']} in 4 axes"
    return None


def inspect_transformer_folder(folder: str | Path, *, option: str = "--model") -> dict[str, Any]:
    """Check a diffusers FLUX.2 transformer folder against its weights' headers (module docstring); its config.

    Nothing is allocated: the model is built on the ``meta`` device, and only after config.json agrees with
    the weights on every block count and width.
    """
    from flowlift.models.flux2_transformer_files import _check_fills_model, _check_storage, flux2_config_from_shapes
    from flowlift.models.safetensors_headers import read_header

    folder = Path(folder)
    what = f"{option} {folder}"
    config = _read_config(folder, what)
    shapes: dict[str, tuple[int, ...]] = {}
    kinds: dict[str, str] = {}
    for file in _weight_files(folder, what):
        header = read_header(file, what=f"{option} {file}")
        shapes.update(header.shapes)
        kinds.update(header.dtypes)
    _check_storage(folder, option, "safetensors", kinds, {})
    try:
        implied = flux2_config_from_shapes(shapes, "diffusers")
    except FlowliftError as error:
        raise FlowliftError(f"{what}: {str(error).removeprefix('FLUX.2 transformer file ')}") from None
    full = {**_defaults(), **config}
    problem = _config_problem(full, implied)
    if problem:
        raise FlowliftError(f"{what}: config.json does not match its weights: {problem}")
    _check_fills_model(folder, option, shapes, "diffusers", {**full, "out_channels": full.get("out_channels")})
    return full


def cached_transformer_folder(repo_id: str) -> Path | None:
    """The ``transformer/`` folder of a hub id in the Hugging Face cache, when it is there (nothing is fetched)."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=["transformer/*"], local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached: diffusers fetches it (or says why it cannot)
        return None
    return folder / "transformer" if (folder / "transformer" / "config.json").is_file() else None
