"""Flow Upscaler weights on disk: :func:`load_upscaler` and :func:`save_upscaler`.

The constructor arguments of :class:`~flowlift.models.upscaler_unet.FlowUpscalerUNet` are read back
from the tensor shapes (and the safetensors metadata :func:`save_upscaler` writes) and checked before
anything is allocated, so the released file and smaller trained checkpoints load the same way, strictly.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from flowlift.errors import FIELD_MARK, FlowliftError
from flowlift.files.atomic import atomic_output
from flowlift.models.upscaler_unet import FlowUpscalerUNet, check_unet_config

HUB_REPO_ID = "TensorForger/FlowUpscaler"
WEIGHTS_NAME = "flow_upscaler.safetensors"
WHAT = "Flow Upscaler weights"
CONFIG_KEYS = ("sample_channels", "base_channels", "time_dim", "cond_dim")
DEFAULT_CONFIG = {"sample_channels": 32, "base_channels": 384, "time_dim": 512, "cond_dim": 1024}


def infer_config(state: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> dict[str, int]:
    """Constructor arguments from tensor shapes (falling back to safetensors metadata, then defaults).

    ``in_conv.weight`` is (base, sample_channels, 1, 1); ``conditioning.time_proj.0.weight`` is
    (cond_dim, time_dim).
    """
    config = dict(DEFAULT_CONFIG)
    for key in CONFIG_KEYS:
        value = (metadata or {}).get(key)
        if value is not None and str(value).isdigit():
            config[key] = int(value)
    in_conv = state.get("in_conv.weight")
    if in_conv is not None and in_conv.ndim == 4:
        config["base_channels"], config["sample_channels"] = int(in_conv.shape[0]), int(in_conv.shape[1])
    time_proj = state.get("conditioning.time_proj.0.weight")
    if time_proj is not None and time_proj.ndim == 2:
        config["cond_dim"], config["time_dim"] = int(time_proj.shape[0]), int(time_proj.shape[1])
    return config


def check_config(config: Mapping[str, int], *, origin: str = "") -> None:
    """Refuse constructor arguments that cannot describe a real checkpoint (0, negative, absurdly large).

    They come from file metadata and tensor shapes, i.e. from the user's file: ``base_channels=0``
    would divide by zero and a huge value would allocate gigabytes before the strict key check
    (:func:`flowlift.models.upscaler_unet.check_unet_config`, the constructor's own check).
    """
    check_unet_config(config, f"{WHAT}: {origin}: " if origin else f"{WHAT}: ")


def _safetensors_metadata(path: Path) -> dict[str, str]:
    if path.suffix != ".safetensors":
        return {}
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            return dict(handle.metadata() or {})
    except Exception:  # noqa: BLE001 - read_state_dict reports unreadable files with a clear line
        return {}


def _placed(tensor: torch.Tensor, device: str | torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` on ``device``, floats in ``dtype``, in memory aligned as torch allocates it (64 bytes).

    A file's tensor kept as it is (same dtype) may sit at any 8-byte offset of the file's buffer, and oneDNN's
    kernels then take another path with other float rounding (1e-6 on a float32 forward): such a one is copied.
    """
    placed = tensor.to(device=device, dtype=dtype) if tensor.is_floating_point() else tensor.to(device)
    if placed.device.type == "cpu" and placed.data_ptr() % 64:
        placed = placed.clone()
    return placed


def _fitting_meta_model(state: Mapping[str, torch.Tensor], metadata: Mapping[str, str], path: Path) -> FlowUpscalerUNet:
    """The UNet ``state`` describes, built on the meta device, or one FlowliftError line naming the missing,
    unexpected, mis-shaped and non-float tensors (``state`` may hold meta tensors: nothing is allocated)."""
    from flowlift.models.weights import dtype_mismatch, state_dict_mismatch

    config = infer_config(state, metadata)
    check_config(config, origin=str(path))
    with torch.device("meta"):
        model = FlowUpscalerUNet(**config)
    problem = state_dict_mismatch(model, state, limit=3) or dtype_mismatch(model, state)
    if problem and "head_conv.0.weight" in state and "in_conv.weight" not in state:  # the other upscaler's file
        raise FlowliftError(
            f"{WHAT} from {path}: this file is SesquiLSR (a latent upscaler for factors in [1, 2]), not the Flow "
            f"Upscaler: give it as {FIELD_MARK} sesqui:PATH",
            field="latent_upscaler",
        )
    if problem and (vae := vae_kind(state)):
        raise FlowliftError(
            f"{WHAT} from {path}: this file is a VAE ({vae}), not the Flow Upscaler: give it as {FIELD_MARK} PATH",
            field="vae",
        )
    if problem:
        raise FlowliftError(f"{WHAT} from {path} does not match the architecture: {problem}")
    return model


def vae_kind(state: Mapping[str, torch.Tensor]) -> str | None:
    """Which VAE ``state``'s keys are (``Mage-VAE``, ``TAEF2``, ``FLUX.2 VAE``), or None for no VAE flowlift
    knows: a VAE file given as the upscaler is named so, in one short line, not by its key differences."""
    from flowlift.models.flux2_vae_convert import is_diffusers_flux2_vae, is_original_flux2_vae
    from flowlift.models.mage_vae_files import is_mage_vae
    from flowlift.models.taef2 import detect_layout

    if is_mage_vae(state):
        return "Mage-VAE"
    if is_original_flux2_vae(state) or is_diffusers_flux2_vae(state):
        return "FLUX.2 VAE"
    if detect_layout(state) != "unknown":
        return "TAEF2"
    return None


def check_upscaler_file(path: str | os.PathLike) -> Path:
    """``path``, a Flow Upscaler weights file, checked against the architecture from its header alone: the
    loader's key, shape and dtype checks (the same line) before anything loads, e.g. before a hires fix loads its
    FLUX.2 model. A pickle-based file is checked when it loads (only reading it tells its tensors); so are values."""
    from flowlift.models.weights import header_state

    path = Path(path)
    found = header_state(path, what=f"{WHAT} {path}")
    if found is not None:
        _fitting_meta_model(*found, path)
    return path


def load_upscaler(
    source: str | os.PathLike = HUB_REPO_ID,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> FlowUpscalerUNet:
    """Load the Flow Upscaler from a file, a directory or a hub repo id, strictly, in eval mode.

    The constructor arguments are inferred from the tensor shapes (and the file's metadata), so
    smaller checkpoints written by :func:`save_upscaler` load too. fp32/fp16/bf16 files all load; the
    model is returned in ``dtype`` on ``device``. A file that does not fit raises one FlowliftError
    line naming the missing, unexpected and mis-shaped tensors.
    """
    from flowlift.devices import resolve_device_option
    from flowlift.knobs import check_dtype, check_path
    from flowlift.models.weights import load_strict, read_state_dict, resolve_file

    check_path("source", source)  # 5 was a TypeError inside the file lookup, "" one line naming no field
    device = resolve_device_option(device)  # one line for a device that does not exist here, before the file is read
    dtype = check_dtype(dtype)  # an integer dtype is the caller's, not "the file's tensors have dtype int8"
    path = resolve_file(source, [WEIGHTS_NAME], what=WHAT)
    state = read_state_dict(path, what=WHAT)
    model = _fitting_meta_model(state, _safetensors_metadata(path), path)
    # One cast per tensor, straight into the model (no empty model filled by copy, then converted).
    state = {k: _placed(v, device, dtype) for k, v in state.items()}
    load_strict(model, state, what=WHAT, origin=str(path), assign=True)
    return model.eval()


def save_upscaler(model: FlowUpscalerUNet, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write ``model`` as safetensors in the released tensor layout, constructor args in the metadata.

    The file is written next to ``path`` and renamed into place, so a failure leaves no partial file. A file
    already at ``path`` is replaced only with ``overwrite=True`` (a bool: ``"no"`` is refused); a model with a
    NaN or Inf weight is refused (:func:`load_upscaler` would refuse the file): one FlowliftError line each.
    """
    from safetensors.torch import save_file

    from flowlift.devices import check_holds_values
    from flowlift.knobs import check_kind, check_overwrite, check_path
    from flowlift.models.weights import first_non_finite

    check_kind("model", model, FlowUpscalerUNet, "a FlowUpscalerUNet")
    path = Path(check_path("path", path))
    if path.suffix != ".safetensors":
        raise FlowliftError(f"save_upscaler: {path} must end in .safetensors")
    if not check_overwrite(overwrite) and path.is_file() and not path.is_symlink():  # others: atomic_output's line
        raise FlowliftError(f"save_upscaler: {path} exists; pass overwrite=True to replace it")
    for name, tensor in model.state_dict().items():  # a meta model's weights cannot be copied out
        check_holds_values(tensor, f"save_upscaler: the model's {name}")
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if problem := first_non_finite(state):
        raise FlowliftError(f"save_upscaler: the model has {problem}; nothing written to {path}")
    metadata = {k: str(v) for k, v in model.config.items()} | {"format": "pt"}
    with atomic_output(path) as tmp:
        save_file(state, str(tmp), metadata=metadata)
    return path
