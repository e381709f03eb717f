"""Loading FLUX.2 weights: the transformer from a diffusers folder, a hub id or one file, then the refiner.

Every way a ``--model`` can be wrong (a missing path, a file that is not a FLUX.2 transformer, a hub id
that is not cached or cannot be fetched) ends here as one FlowliftError line.
"""

from __future__ import annotations

import os
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
    from flowlift.models.hub import download_hint

    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    if offline:
        return FlowliftError(
            f"--model {model}: its transformer/ folder is not in the Hugging Face cache and HF_HUB_OFFLINE=1; "
            f"{download_hint(model)} or pass a local folder"
        )
    return FlowliftError(
        f"--model {model}: cannot get it from the hub ({_first_line(error)}); {download_hint(model)} "
        "or pass a local folder"
    )


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
            return Flux2Transformer2DModel.from_pretrained(model, subfolder="transformer", torch_dtype=dtype)
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
