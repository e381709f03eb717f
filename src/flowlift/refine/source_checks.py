"""What a :class:`~flowlift.refine.request.RefinerSource` names, checked before any weights load.

:func:`check_refiner_source` checks the files and extras it names (headers only), then runs the lookups of every
part a refiner needs (:func:`refiner_weight_checks`: :func:`check_model_part` of each, cached, on the hub, or a local
folder) in one :func:`flowlift.models.weights.require_all` at its end. A check's FlowliftError line names the field
(``source.model``: :func:`names_source_fields`, which :mod:`flowlift.refine.loading` uses too), which each door says
in its own words.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from flowlift.errors import FIELD_MARK, FlowliftError
from flowlift.models.weights import looks_like_repo_id
from flowlift.refine.loras import LoraSpec
from flowlift.refine.prompts import _first_line

#: The :class:`~flowlift.refine.request.RefinerSource` fields a loading error can be about, as the API names them.
SOURCE_FIELDS = (
    "source.model",
    "source.transformer",
    "source.vae",
    "source.loras",
    "source.offload",
    "source.max_memory",
)


def names_source_fields(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` whose FlowliftError lines that begin with a source field (``source.model /x: ...``, also those
    the model files' inspectors word with the name given them) carry that field, for a door to say in its words."""

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except FlowliftError as error:
            name = next((name for name in SOURCE_FIELDS if error.template.startswith(name)), None)
            if name is None or name in error.fields or type(error) is not FlowliftError:
                raise  # its other fields (a LoRA given as the transformer: source.loras) kept, each with its mark
            raise FlowliftError(FIELD_MARK + error.template[len(name) :], field=(name, *error.fields)) from None

    return run


def _is_diffusers_folder(path: Path) -> bool:
    return (path / "model_index.json").is_file() or (path / "transformer" / "config.json").is_file()


@names_source_fields
def check_model_part(model: str, part: str, option: str = "source.model") -> None:
    """Raise one line unless the ``part/`` subfolder (``transformer``, ``vae``, ``text_encoder``) of a hub id
    ``model`` can be had: in the cache when offline or the hub is unreachable, else on the hub (its small
    ``config.json`` is fetched, which proves the repository, the part and the access). A local diffusers folder
    needs ``part/config.json``; other local paths pass: their layout is checked when they load."""
    from flowlift.models.hub import access_hint, download_hint, hub_offline_reason, looks_like_path

    path = Path(model).expanduser()
    if path.is_dir() and _is_diffusers_folder(path) and not (path / part / "config.json").is_file():
        from flowlift.refine.prompts import missing_part_error

        raise missing_part_error(model, part, option)  # before any weights load, with the fix
    if path.exists():
        return
    if looks_like_path(model) or not looks_like_repo_id(model):
        raise FlowliftError(f"{option} {model}: no such file or folder, and not a hub repo id (owner/name)")
    from huggingface_hub import hf_hub_download, snapshot_download

    offline = hub_offline_reason()
    hint = download_hint(model, include=f"{part}/*")
    if offline is None:
        try:
            hf_hub_download(model, f"{part}/config.json")
        except Exception as error:  # noqa: BLE001 - missing, gated, misnamed: all "cannot get it"
            if refused := access_hint(model, error):
                raise FlowliftError(f"{option} {model}: cannot get its {part}/ folder: {refused}") from None
            raise FlowliftError(
                f"{option} {model}: cannot get its {part}/ folder from the hub ({_first_line(error)}); {hint} "
                "or pass a local folder"
            ) from None
        return
    try:
        folder = Path(snapshot_download(model, allow_patterns=[f"{part}/*"], local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached at all
        folder = None
    if folder is None or not (folder / part / "config.json").is_file():
        raise FlowliftError(
            f"{option} {model}: its {part}/ folder is not in the Hugging Face cache and {offline}; {hint} "
            "or pass a local folder"
        )


def refiner_weight_checks(
    model: str, *, vae: str | None = None, text_encoder: bool = False, transformer: str | None = None
) -> list[Callable[[], object]]:
    """The lookups a refiner from ``model`` needs (for :func:`flowlift.models.weights.require_all`): the
    transformer (``transformer``, else the model's), the VAE (``vae``, else the model's ``vae/``) and, when
    prompts are embedded here, the text encoder. Local paths are checked to exist; hub ids as
    :func:`check_model_part` says."""
    from flowlift.models.vae_loading import check_vae_spec

    parts = [
        (transformer, "transformer", "source.transformer")
        if transformer is not None
        else (model, "transformer", "source.model")
    ]
    parts += [(model, "vae", "source.model")] if vae is None else []
    parts += [(model, "text_encoder", "source.model")] if text_encoder else []
    checks: list[Callable[[], object]] = [functools.partial(check_model_part, *part) for part in parts]
    single = Path(transformer if transformer is not None else model).expanduser()
    if single.is_file():  # a single transformer file: what it is, from its headers (a garbage file: one line now)
        from flowlift.models.flux2_transformer_files import inspect_transformer_file

        checks.insert(1, names_source_fields(functools.partial(inspect_transformer_file, single, option=parts[0][2])))
    if vae is not None:
        checks.insert(1, lambda: check_vae_spec(vae))
    return checks


@names_source_fields
def check_refiner_source(
    source: Any, *, text_encoder: bool = False, also: Sequence[Callable[[], object]] = ()
) -> list[LoraSpec]:
    """Everything a :class:`~flowlift.refine.request.RefinerSource` names, checked before any weights load (one
    FlowliftError line): the ``transformer`` file is what it claims (headers only) and its extra is installed, the
    LoRAs are ``.safetensors`` files and peft is there, ``group`` offload has accelerate, the budget parses; then
    every weight a refiner needs (:func:`refiner_weight_checks`, the text encoder with ``text_encoder``) and those
    ``also`` finds, all missing ones named in one message (:func:`flowlift.models.weights.require_all`).
    Returns the LoRAs as ``(path, scale)`` pairs."""
    import importlib.util

    from flowlift.models.hub import looks_like_path
    from flowlift.models.safetensors_headers import read_header
    from flowlift.models.weights import require_all
    from flowlift.refine.loras import parse_lora_spec

    loras = [parse_lora_spec(text) for text in source.loras]
    lookups = refiner_weight_checks(
        source.model, vae=source.vae, text_encoder=text_encoder, transformer=source.transformer
    )
    if source.transformer is not None:
        path = Path(source.transformer).expanduser()
        if path.is_file():
            from flowlift.models.flux2_transformer_files import inspect_transformer_file

            info = inspect_transformer_file(path, option="source.transformer")  # headers only: what it is
            if info.container == "gguf" and importlib.util.find_spec("accelerate") is None:
                extra = "pip install 'flowlift[gguf]'"
                raise FlowliftError(f"source.transformer {path}: GGUF needs the gguf extra ({extra})")
        elif not path.exists() and looks_like_path(source.transformer):
            raise FlowliftError(f"source.transformer {source.transformer}: no such file or folder")
    for lora, _ in loras:
        if Path(lora).is_dir():
            raise FlowliftError(f"source.loras {lora} is a folder: give a LoRA .safetensors file")
        if not Path(lora).is_file():
            raise FlowliftError(f"source.loras {lora}: no such file")
        if Path(lora).suffix.lower() != ".safetensors":
            raise FlowliftError(f"source.loras {lora}: LoRAs are read from .safetensors only")
        read_header(Path(lora), what=f"source.loras {lora}")  # garbage or cut short: said before any model loads
    if loras and (importlib.util.find_spec("peft") is None or importlib.util.find_spec("transformers") is None):
        raise FlowliftError(
            "source.loras need peft (pip install 'flowlift[lora]', from a checkout pip install -e '.[lora]')"
        )
    if source.offload == "group" and importlib.util.find_spec("accelerate") is None:
        raise FlowliftError("source.offload group needs accelerate (pip install 'flowlift[offload]')")
    require_all([*lookups, *also])
    return loras


def transformer_config(model: str, transformer: str | None = None) -> dict[str, Any]:
    """What the transformer's config says of its conditioning, read before it loads: ``joint_attention_dim`` (the
    width its prompt embeddings must have) and ``guidance_embeds`` (whether it takes an embedded guidance: dev, not
    Klein), from a single file's headers or a folder's (or a cached hub id's) ``transformer/config.json``. Only the
    keys found there with their type are given (none: the transformer itself says it, once loaded)."""
    from flowlift.files.json_input import parse_json
    from flowlift.models.flux2_transformer_folders import cached_transformer_folder

    source = Path(transformer if transformer is not None else model).expanduser()
    if source.is_file():
        from flowlift.models.flux2_transformer_files import inspect_transformer_file

        return _typed_config(inspect_transformer_file(source, option="source.transformer").config)
    folders = [source / "transformer", source] if source.is_dir() else []
    text = transformer if transformer is not None else model
    if not folders and looks_like_repo_id(text) and (cached := cached_transformer_folder(text)) is not None:
        folders = [cached]
    for folder in folders:
        if (folder / "config.json").is_file():
            try:
                return _typed_config(parse_json((folder / "config.json").read_text()))
            except (OSError, ValueError):
                return {}  # an unreadable config is the loader's to refuse, in its words
    return {}


def _typed_config(config: Any) -> dict[str, Any]:
    """:func:`transformer_config`'s keys of ``config`` that hold their type (an int width, a bool), the rest left
    to the loader."""
    if not isinstance(config, dict):
        return {}
    width, guidance = config.get("joint_attention_dim"), config.get("guidance_embeds")
    typed = {"joint_attention_dim": width} if isinstance(width, int) and not isinstance(width, bool) else {}
    return typed | ({"guidance_embeds": guidance} if isinstance(guidance, bool) else {})
