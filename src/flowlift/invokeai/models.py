"""The models the nodes run, through InvokeAI's model cache: the Flow Upscaler, TAEF2, InvokeAI's FLUX.2 VAE.

The upscaler and TAEF2 are files outside InvokeAI's model manager (a local path or a Hugging Face repo
id, resolved by flowlift through the Hugging Face cache). They go into InvokeAI's RAM/VRAM cache with
``context.models.load_local_model`` under a key naming their SHA-256 (:mod:`flowlift.invokeai.files`):
loaded once per process and file content, moved to the execution device by the cache, and dropped by
it when other models need the room. Nothing here keeps a reference to a cached model after a node
returns, so the cache's eviction really frees it (a log line says so when it happens).

InvokeAI's FLUX.2 VAE comes from a ``VAEField``; its model config and the loaded module are both
checked, so another family's VAE is one error line instead of wrong colours or a shape error.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from invokeai.invocation_api import BaseModelType, InvocationContext, ModelIdentifierField, VAEField

from flowlift.devices import resolve_device_dtype
from flowlift.errors import FlowliftError
from flowlift.invokeai.files import (
    TAEF2_PTH,
    TAEF2_SAFETENSORS,
    UPSCALER_FILE,
    cache_key,
    check_weight_file,
    file_digest,
    files_digest,
    is_local,
    local_taef2_files,
    local_upscaler_file,
    refusal,
)

#: Cache lifecycle messages go to InvokeAI's own log ("InvokeAI" is the name of InvokeAI's logger); they
#: are not tied to one node's run.
log = logging.getLogger("InvokeAI.flowlift")


def model_dtype(context: InvocationContext) -> torch.dtype:
    """flowlift's rule for InvokeAI's configured device: bfloat16 on CUDA, float32 elsewhere."""
    _, dtype = resolve_device_dtype(str(context.config.get().device), "auto")
    return dtype


def _announce_free(model: torch.nn.Module, what: str) -> None:
    weakref.finalize(model, log.info, f"flowlift: {what} freed")


def load_upscaler_cached(context: InvocationContext, source: str, should_stop: Callable[[], None]) -> Any:
    """The Flow Upscaler from ``source`` (file, folder, hub id) as InvokeAI's loaded model (not yet locked).

    A server path is checked before it is read and refused in one line that names only what was
    expected (:mod:`flowlift.invokeai.files`); ``should_stop`` (the cancel check) runs while it is hashed.
    """
    from flowlift.models.upscaler_weights import load_upscaler
    from flowlift.upscale.loading import resolve_upscaler_file

    source = source.strip()
    if is_local(source):
        path = local_upscaler_file(source)
    else:  # a hub repo id: its file in the Hugging Face cache (or downloaded once), checked the same way
        path = check_weight_file(resolve_upscaler_file(source), UPSCALER_FILE, shown=source)
    digest = file_digest(path, should_stop)
    dtype = model_dtype(context)
    what = f"Flow Upscaler {source} (sha256 {digest[:12]}, {str(dtype).removeprefix('torch.')})"

    def load(_key: Path) -> torch.nn.Module:
        log.info(f"flowlift: loading {what}")
        try:
            model = load_upscaler(path, device="cpu", dtype=dtype)
        except FlowliftError:
            raise refusal(UPSCALER_FILE, source) from None  # its tensors are not the Flow Upscaler's
        _announce_free(model, what)
        return model

    key = cache_key("upscaler", digest, str(dtype).removeprefix("torch."), path.name)
    return context.models.load_local_model(key, loader=load)


def load_taef2_cached(context: InvocationContext, source: str, should_stop: Callable[[], None]) -> Any:
    """TAEF2 from ``source`` (folder, file, hub id; ``taef2`` = madebyollin/taef2) as InvokeAI's loaded model,
    checked like the upscaler (:func:`load_upscaler_cached`)."""
    from flowlift.models.vae import TAEF2VAE
    from flowlift.models.vae_loading import check_vae_spec, load_vae
    from flowlift.upscale.loading import vae_spec_files

    spec = source.strip()
    if is_local(spec) and spec != "taef2":
        files = local_taef2_files(spec)
    else:
        check_vae_spec(spec)  # an uncached repo id offline: one line, before anything loads
        files = [check_weight_file(p, TAEF2_SAFETENSORS if p.suffix == ".safetensors" else TAEF2_PTH, shown=spec)
                 for p in vae_spec_files(spec)]  # fmt: skip
        if not files:
            raise refusal(TAEF2_PTH, spec)
    digest = files_digest(files, should_stop)
    dtype = model_dtype(context)
    what = f"TAEF2 {spec} (sha256 {digest[:12]}, {str(dtype).removeprefix('torch.')})"

    def load(_key: Path) -> torch.nn.Module:
        log.info(f"flowlift: loading {what}")
        try:
            vae = load_vae(spec, device="cpu", dtype=dtype)
        except FlowliftError:
            raise refusal(TAEF2_PTH, spec) from None
        if not isinstance(vae, TAEF2VAE):
            raise FlowliftError(
                f"TAEF2: {spec} is a full FLUX.2 VAE, not TAEF2; install it in InvokeAI's model manager and "
                "connect it to the vae input instead"
            )
        _announce_free(vae.model, what)
        return vae.model

    key = cache_key("taef2", digest, str(dtype).removeprefix("torch."), "taef2")
    return context.models.load_local_model(key, loader=load)


def installed_model_path(context: InvocationContext, field: ModelIdentifierField | None, path: str) -> str:
    """The source a node loads: the model installed in InvokeAI's model manager when ``field`` names one
    (preferred: the server's admin chose what is there), else the ``path`` field's text."""
    if field is None:
        return path
    config = context.models.get_config(field)
    return str(context.models.get_absolute_path(config))


def check_flux2_vae_field(context: InvocationContext, field: VAEField | None, what: str) -> None:
    """One error line unless ``field`` names a FLUX.2 VAE in InvokeAI's model manager (checked on the
    stored model config, not on what the graph claims)."""
    if field is None or getattr(field, "vae", None) is None:
        raise FlowliftError(f"{what} needs a FLUX.2 VAE: connect one (VAE model loader or the FLUX.2 model loader)")
    config = context.models.get_config(field.vae)
    if config.base != BaseModelType.Flux2:
        raise FlowliftError(
            f"{what} needs a FLUX.2 VAE (32 latent channels), got {config.name!r}, a {config.base.value} "
            f"{config.type.value}: connect the FLUX.2 VAE"
        )


def flux2_vae_adapter(module: Any, what: str) -> Any:
    """flowlift's :class:`~flowlift.models.vae.Flux2VAE` over InvokeAI's loaded ``AutoencoderKLFlux2``
    (its BatchNorm statistics are read from the module, as FLUX2 Denoise reads them)."""
    from diffusers import AutoencoderKLFlux2

    from flowlift.models.vae import Flux2VAE

    if not isinstance(module, AutoencoderKLFlux2) or getattr(module, "bn", None) is None:
        raise FlowliftError(f"{what} needs a FLUX.2 VAE (AutoencoderKLFlux2), got a {type(module).__name__}")
    return Flux2VAE(module)


def _same_device(actual: torch.device, wanted: torch.device) -> bool:
    """``cuda:0`` is on ``cuda`` (the current device) and on ``cuda:0``."""
    return actual.type == wanted.type and (wanted.index is None or actual.index == wanted.index)


@contextmanager
def on_device(loaded: Any, what: str) -> Iterator[tuple[torch.nn.Module, torch.device, torch.dtype]]:
    """Lock ``loaded`` on its execution device: ``(module, device, dtype)``.

    flowlift's exact chunked executor reads the layers' weights directly, so the whole model must be on
    the device: a model InvokeAI could only partly load (VRAM nearly full) is one error line.
    """
    with loaded.model_on_device() as (_, module):
        device = torch.device(loaded.compute_device)
        params = list(module.parameters())
        if not all(_same_device(p.device, device) for p in params):
            raise FlowliftError(
                f"{what} did not fit on {device} next to the other models (InvokeAI loaded it only partly); "
                "free VRAM (Models tab: clear the model cache) and run again"
            )
        yield module, device, params[0].dtype if params else torch.float32
