"""The models the nodes run, through InvokeAI's model cache: the Flow Upscaler, the VAEs flowlift runs itself
(TAEF2, Mage-VAE: the ``native`` ones of :mod:`flowlift.models.vae_names`), InvokeAI's FLUX.2 VAE.

The upscaler and the flowlift-run VAEs are files outside InvokeAI's model manager (a local path or a Hugging Face repo
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
    MAGE_SAFETENSORS,
    NATIVE_VAE_FILES,
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


def _load_cached(
    context: InvocationContext,
    kind: str,
    name: str,
    title: str,
    digest: str,
    read: Callable[[torch.dtype], torch.nn.Module],
) -> Any:
    """InvokeAI's loaded model (not yet locked) under :func:`~flowlift.invokeai.files.cache_key` (``kind``, the files'
    ``digest``, flowlift's dtype, ``name``); on a cache miss ``read(dtype)`` builds it on the CPU, logged as
    ``<title> (sha256 <12 hex>, <dtype>)`` when it loads and when it is freed."""
    dtype = model_dtype(context)
    variant = str(dtype).removeprefix("torch.")
    what = f"{title} (sha256 {digest[:12]}, {variant})"

    def load(_key: Path) -> torch.nn.Module:
        log.info(f"flowlift: loading {what}")
        model = read(dtype)
        _announce_free(model, what)
        return model

    return context.models.load_local_model(cache_key(kind, digest, variant, name), loader=load)


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

    def read(dtype: torch.dtype) -> torch.nn.Module:
        try:
            return load_upscaler(path, device="cpu", dtype=dtype)
        except FlowliftError:
            raise refusal(UPSCALER_FILE, source) from None  # its tensors are not the Flow Upscaler's

    return _load_cached(context, "upscaler", path.name, f"Flow Upscaler {source}", digest, read)


def _vae_kind_of_source(spec: str) -> str:
    """``"taef2"`` or ``"mage"``: which flowlift-run VAE a source names, by its name, else by a server file's
    tensor names (read only after the file passed Mage-VAE's checks), else TAEF2 (the field's default)."""
    from flowlift.models.safetensors_headers import read_header
    from flowlift.models.vae_names import named_vae

    named = named_vae(spec)
    if named is not None:
        return named.name if named.native else "taef2"
    if is_local(spec) and spec.lower().endswith(".safetensors"):
        try:
            path = check_weight_file(Path(spec).expanduser(), MAGE_SAFETENSORS, shown=spec)
            keys = read_header(path, what=spec).shapes
        except FlowliftError:
            return "taef2"  # then checked, and refused in one line, as TAEF2's
        if any(k.startswith(("student.dconv_encoder.", "pipeline.")) for k in keys):
            return "mage"
    return "taef2"


def _native_vae_files(spec: str, kind: str) -> list[Path]:
    """The checked weight files of a flowlift-run VAE source (a server path, a name or a hub id)."""
    from flowlift.models.vae_loading import check_vae_spec
    from flowlift.models.vae_names import named_vae
    from flowlift.upscale.loading import vae_spec_files

    folder_kind, file_kind = NATIVE_VAE_FILES[kind]
    if is_local(spec) and named_vae(spec) is None:
        if kind == "taef2":
            return local_taef2_files(spec)
        return [check_weight_file(Path(spec).expanduser(), MAGE_SAFETENSORS, shown=spec)]
    with native_vae_words():
        check_vae_spec(spec)  # an uncached repo id offline: one line, before anything loads
    files = [
        check_weight_file(p, file_kind if p.suffix == ".safetensors" else folder_kind, shown=spec)
        for p in vae_spec_files(spec)
    ]
    if not files:
        raise refusal(folder_kind, spec)
    return files


#: How the upscale node names the VAE flowlift runs itself (a core error's ``vae`` field): its TAEF2 field.
NATIVE_VAE_WORDS = {"vae": "the TAEF2 field"}


@contextmanager
def native_vae_words() -> Iterator[None]:
    """Within this block, a :class:`FlowliftError` about the VAE flowlift runs (a decode-only Mage-VAE file asked
    to encode) names it as the node does (:data:`NATIVE_VAE_WORDS`), never as the command line's ``--vae``."""
    try:
        yield
    except FlowliftError as error:
        if not error.fields:
            raise
        raise FlowliftError(error.worded(NATIVE_VAE_WORDS)) from None


def load_native_vae_cached(context: InvocationContext, source: str, should_stop: Callable[[], None]) -> Any:
    """A VAE flowlift runs itself from ``source`` (``taef2``, ``mage``, a server folder or file, a hub id) as
    InvokeAI's loaded model (the adapter's module), checked like the upscaler (:func:`load_upscaler_cached`).

    Which VAE it is comes from the name, else from the file's tensor names (Mage-VAE's released layout),
    else it is TAEF2 (the field's default); the loaded VAE must be that one.
    """
    from flowlift.limits import vae_kind
    from flowlift.models.vae_loading import load_vae
    from flowlift.models.vae_names import NAMED_VAES

    spec = source.strip()
    kind = _vae_kind_of_source(spec)
    title = NAMED_VAES[kind].title
    files = _native_vae_files(spec, kind)
    digest = files_digest(files, should_stop)

    def read(dtype: torch.dtype) -> torch.nn.Module:
        try:
            vae = load_vae(spec, device="cpu", dtype=dtype)
        except FlowliftError:
            raise refusal(NATIVE_VAE_FILES[kind][0], spec) from None
        if vae_kind(vae) != kind:
            raise FlowliftError(
                f"{title}: {spec} is a full FLUX.2 VAE, not {title}; install it in InvokeAI's model manager and "
                "connect it to the vae input instead"
            )
        return vae.model

    return _load_cached(context, kind, kind, f"{title} {spec}", digest, read)


def native_vae_adapter(module: torch.nn.Module) -> Any:
    """flowlift's adapter over a cached native VAE module (TAEF2 or Mage-VAE), in the module's own dtype."""
    from flowlift.models.vae_loading import load_vae

    param = next(module.parameters())
    return load_vae(module, device=param.device, dtype=param.dtype)


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
