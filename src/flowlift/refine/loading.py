"""Loading FLUX.2 weights: the transformer from a diffusers folder, a hub id or one file, then the refiner.

Every way a ``--model`` can be wrong (a missing path, a file that is not a FLUX.2 transformer, a hub id
that is not cached or cannot be fetched) ends here as one FlowliftError line.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from flowlift.errors import FlowliftError
from flowlift.flux2.schedule import DEFAULT_MU
from flowlift.models.weights import looks_like_repo_id
from flowlift.refine.loop import check_schedule
from flowlift.refine.prompts import PromptEncoder, _first_line
from flowlift.refine.refiner import Flux2Refiner


def _is_diffusers_folder(path: Path) -> bool:
    return (path / "model_index.json").is_file() or (path / "transformer" / "config.json").is_file()


#: Tensor-name fragments of a FLUX transformer checkpoint (BFL / ComfyUI layout and diffusers layout).
_TRANSFORMER_KEY_MARKERS = ("double_blocks.", "single_blocks.", "transformer_blocks.")


def _check_transformer_file(path: Path) -> None:
    """Refuse a single file that is not a FLUX transformer checkpoint before diffusers guesses a model for it."""
    if path.suffix != ".safetensors":
        raise FlowliftError(f"--model {path}: a single-file transformer must be a .safetensors file")
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            keys = list(handle.keys())
    except Exception as error:  # noqa: BLE001 - any reader failure is a bad file to the user
        raise FlowliftError(f"--model {path}: cannot read it as safetensors ({_first_line(error)})") from None
    if not any(marker in key for key in keys for marker in _TRANSFORMER_KEY_MARKERS):
        raise FlowliftError(
            f"--model {path}: not a FLUX.2 transformer checkpoint (no double/single transformer blocks among its "
            f"{len(keys)} tensors); give the transformer .safetensors, a diffusers folder or a hub id"
        )


def _hub_model_error(model: str, error: BaseException) -> FlowliftError:
    """One actionable line for a hub id that could not be loaded (offline cache miss, gated, missing)."""
    from flowlift.models.hub import download_hint, hub_offline_reason

    offline = hub_offline_reason()
    if offline:
        return FlowliftError(
            f"--model {model}: its transformer/ folder is not in the Hugging Face cache and {offline}; "
            f"{download_hint(model)} or pass a local folder"
        )
    return FlowliftError(
        f"--model {model}: cannot get it from the hub ({_first_line(error)}); {download_hint(model)} "
        "or pass a local folder"
    )


def check_model_part(model: str, part: str) -> None:
    """Raise one line unless the ``part/`` subfolder (``transformer``, ``vae``, ``text_encoder``) of a hub id
    ``model`` can be had: in the cache when offline or the hub is unreachable, else on the hub (its small
    ``config.json`` is fetched, which proves the repository, the part and the access). Local paths pass:
    their layout is checked when they load."""
    from flowlift.models.hub import download_hint, hub_offline_reason, looks_like_path

    path = Path(model).expanduser()
    if path.exists():
        return
    if looks_like_path(model) or not looks_like_repo_id(model):
        raise FlowliftError(f"--model {model}: no such file or folder, and not a hub repo id (owner/name)")
    from huggingface_hub import hf_hub_download, snapshot_download

    offline = hub_offline_reason()
    hint = download_hint(model, include=f"{part}/*")
    if offline is None:
        try:
            hf_hub_download(model, f"{part}/config.json")
        except Exception as error:  # noqa: BLE001 - missing, gated, misnamed: all "cannot get it"
            raise FlowliftError(
                f"--model {model}: cannot get its {part}/ folder from the hub ({_first_line(error)}); {hint} "
                "or pass a local folder"
            ) from None
        return
    try:
        folder = Path(snapshot_download(model, allow_patterns=[f"{part}/*"], local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached at all
        folder = None
    if folder is None or not (folder / part / "config.json").is_file():
        raise FlowliftError(
            f"--model {model}: its {part}/ folder is not in the Hugging Face cache and {offline}; {hint} "
            "or pass a local folder"
        )


def refiner_weight_checks(
    model: str, *, vae: str | None = None, text_encoder: bool = False
) -> list[Callable[[], object]]:
    """The lookups a refiner from ``model`` needs (for :func:`flowlift.models.weights.require_all`): the
    transformer, the VAE (``vae``, else the model's ``vae/``) and, when prompts are embedded here, the
    text encoder. Local paths are checked to exist; hub ids as :func:`check_model_part` says."""
    from flowlift.models.vae_loading import check_vae_spec

    checks: list[Callable[[], object]] = [lambda: check_model_part(model, "transformer")]
    if vae is not None:
        checks.append(lambda: check_vae_spec(vae))
    else:
        checks.append(lambda: check_model_part(model, "vae"))
    if text_encoder:
        checks.append(lambda: check_model_part(model, "text_encoder"))
    return checks


def load_transformer(model: str, *, dtype: torch.dtype) -> torch.nn.Module:
    """A ``Flux2Transformer2DModel`` from a diffusers folder / hub id (``transformer/`` subfolder), a
    transformer folder (``config.json``), or a single BFL/ComfyUI ``.safetensors`` file."""
    from diffusers import Flux2Transformer2DModel

    from flowlift.models.hub import looks_like_path

    path = Path(model).expanduser()
    if not path.exists() and looks_like_path(model):
        raise FlowliftError(f"--model {model}: no such file or folder")
    if path.is_file():
        _check_transformer_file(path)
    from_hub = not path.exists() and looks_like_repo_id(model)
    try:
        if path.is_file():
            return Flux2Transformer2DModel.from_single_file(str(path), torch_dtype=dtype)
        if path.is_dir() and (path / "config.json").is_file() and not _is_diffusers_folder(path):
            return Flux2Transformer2DModel.from_pretrained(str(path), torch_dtype=dtype)
        if path.is_dir() and not (path / "transformer" / "config.json").is_file():
            raise FlowliftError(
                f"--model {model}: not a FLUX.2 transformer folder (it needs transformer/config.json, the diffusers "
                "layout, or config.json, a bare transformer folder)"
            )
        if path.is_dir() or from_hub:
            from flowlift.models.hub import hub_offline_reason

            cache_only = from_hub and hub_offline_reason() is not None  # no retries against an unreachable hub
            return Flux2Transformer2DModel.from_pretrained(
                model, subfolder="transformer", torch_dtype=dtype, local_files_only=cache_only
            )
    except FlowliftError:
        raise
    except Exception as error:  # noqa: BLE001 - any loader failure is a bad --model to the user
        if from_hub:
            raise _hub_model_error(model, error) from None
        raise FlowliftError(f"cannot load a FLUX.2 transformer from {model}: {_first_line(error)}") from None
    raise FlowliftError(f"--model {model}: no such file or folder, and not a hub repo id (owner/name)")


def load_refiner(
    model: str,
    *,
    vae: str | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    text_encoder: bool = False,
    progress: bool = False,
    mu: float | str = DEFAULT_MU,
    schedule: str = "respaced",
) -> Flux2Refiner:
    """A :class:`Flux2Refiner` from FLUX.2 Klein / dev weights (local diffusers folder or hub id).

    ``vae`` (any :func:`flowlift.models.vae_loading.load_vae` spec) defaults to the model's own ``vae/`` subfolder.
    ``text_encoder=True`` also loads the pipeline's text encoder (``flowlift[text]``) so prompts can be
    given as strings. ``mu`` and ``schedule`` are the refiner's schedule (:class:`Flux2Refiner`), checked
    before any weights load.
    """
    from flowlift.models.vae_loading import load_vae

    check_schedule(mu, schedule)
    transformer = load_transformer(model, dtype=dtype)
    # the FLUX.2 VAE overflows in float16; bfloat16 and float32 are fine
    vae_adapter = load_vae(vae or model, device=device, dtype=torch.float32 if dtype == torch.float16 else dtype)
    encoder = PromptEncoder(model, device=device, dtype=dtype) if text_encoder else None
    return Flux2Refiner(
        transformer,
        vae_adapter,
        device=device,
        dtype=dtype,
        prompt_encoder=encoder,
        progress=progress,
        model_name=str(model),
        mu=mu,
        schedule=schedule,
    )
