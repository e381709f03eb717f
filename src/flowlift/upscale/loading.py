"""The Flow Upscaler pipeline's models: resolving and loading the UNet and the VAE, provenance lists.

:func:`resolve_upscaler_file` turns a file, folder or hub id into the UNet's safetensors file (or one
error line saying how to get it), :func:`find_upscaler_file` checks its header too; :func:`check_upscale_weights`
finds the UNet, every VAE and SesquiLSR an upscale will use before any model loads and names every missing one
in one message (the command line, the web app at start-up and the pipeline all call it);
:func:`load_pipeline_models` turns what a user passed (a module, an object, a spec) into the two models on the
pipeline's device, finding every weight first; :func:`pipeline_model_files` lists the weight files behind both
so outputs can record their hashes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowlift.errors import FIELD_MARK, FlowliftError

if TYPE_CHECKING:  # torch is imported where it is used: the command line reads the defaults below
    import torch

DEFAULT_UPSCALER = "TensorForger/FlowUpscaler"
#: The VAE of the command line, the web app and :class:`flowlift.upscale.pipeline.FlowUpscalerPipeline`: the
#: full FLUX.2 VAE the upscaler's latents belong to (``taef2`` is the fast, approximate alternative).
DEFAULT_VAE = "flux2"
UPSCALER_WEIGHTS_NAME = "flow_upscaler.safetensors"
WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")

__all__ = [
    "DEFAULT_UPSCALER",
    "DEFAULT_VAE",
    "UPSCALER_WEIGHTS_NAME",
    "check_upscale_weights",
    "first_parameter",
    "load_pipeline_models",
    "find_upscaler_file",
    "pipeline_model_files",
    "resolve_upscaler_file",
    "upscale_name_checks",
    "upscale_weight_checks",
    "vae_spec_files",
]


def first_parameter(obj: Any) -> torch.Tensor | None:
    """The first parameter of a module-like object (its device/dtype stand for the model's), else None."""
    parameters = getattr(obj, "parameters", None)
    if callable(parameters):
        for param in parameters():
            return param
    return None


def resolve_upscaler_file(source: str | os.PathLike) -> Path:
    """Resolve the UNet weights (file, folder, hub id) or raise one line saying how to provide them."""
    from flowlift.models.weights import resolve_file

    try:
        return resolve_file(source, [UPSCALER_WEIGHTS_NAME], what="Flow Upscaler weights")
    except FlowliftError as error:
        if UPSCALER_WEIGHTS_NAME in str(error):
            raise FlowliftError(f"{error} (or give {FIELD_MARK} PATH)", field="upscaler") from None
        raise FlowliftError(
            f"{error} (the Flow Upscaler is {UPSCALER_WEIGHTS_NAME} of the hub repo {DEFAULT_UPSCALER}, "
            f"or a local file/folder: give {FIELD_MARK} PATH)",
            field="upscaler",
        ) from None


def find_upscaler_file(source: str | os.PathLike) -> Path:
    """The UNet's weights file (:func:`resolve_upscaler_file`), a safetensors file's header checked against the
    architecture (:func:`flowlift.models.upscaler_weights.check_upscaler_file`): what a command finds before any
    model loads."""
    from flowlift.models.upscaler_weights import check_upscaler_file

    return check_upscaler_file(resolve_upscaler_file(source))


def upscale_weight_checks(
    upscaler: Any, vaes: Sequence[Any], latent_upscaler: str | None = None
) -> list[Callable[[], object]]:
    """The lookups an upscale with ``upscaler``, ``vaes`` and ``latent_upscaler`` needs: the UNet's file (when
    ``upscaler`` is a path or hub id, not a model), every VAE spec (objects need none) and SesquiLSR's file
    (``"sesqui:PATH"``; None: none), for :func:`flowlift.models.weights.require_all`."""
    from flowlift.models.vae_loading import check_vae_spec
    from flowlift.upscale.latent_fraction import find_sesqui

    checks: list[Callable[[], object]] = []
    if isinstance(upscaler, (str, os.PathLike)):
        checks.append(lambda: find_upscaler_file(upscaler))
    for vae in vaes:
        checks.append(lambda vae=vae: check_vae_spec(vae))
    if latent_upscaler is not None:
        checks.append(lambda: find_sesqui(latent_upscaler))
    return checks


def upscale_name_checks(
    upscaler: Any, vaes: Sequence[Any], latent_upscaler: str | None = None
) -> list[Callable[[], object]]:
    """The checks of :func:`upscale_weight_checks` that need no hub: every local path (found, its header read),
    SesquiLSR's file, and a name that is no path, no VAE name and no hub id (``--upscaler typo``). A VAE name and a
    hub id (``owner/name``) are left to the lookup a run with work makes (it may download them). What a batch checks
    before it decides what to skip, so that a misspelled option is refused when every output exists too."""
    from flowlift.models.vae_names import named_vae
    from flowlift.models.weights import looks_like_repo_id

    def fetched(spec: Any) -> bool:
        return isinstance(spec, (str, os.PathLike)) and looks_like_repo_id(os.fspath(spec))

    local_vaes = [vae for vae in vaes if not fetched(vae) and named_vae(vae) is None]
    return upscale_weight_checks(None if fetched(upscaler) else upscaler, local_vaes, latent_upscaler)


def check_upscale_weights(
    upscaler: Any = DEFAULT_UPSCALER, vaes: Sequence[Any] = (DEFAULT_VAE,), latent_upscaler: str | None = None
) -> None:
    """Find the UNet, every VAE and SesquiLSR (``latent_upscaler``) before any model loads, their headers
    checked; one :class:`FlowliftError` names all that are missing, each with its fix (``hf download ...`` or the
    ``upscaler``/``vae``/``latent_upscaler`` PATH to use).

    Hub ids are looked up in the cache at once when ``HF_HUB_OFFLINE`` is set or the hub does not answer
    (:func:`flowlift.models.hub.hub_offline_reason`); otherwise they are downloaded once, as the loaders would.
    """
    from flowlift.models.weights import require_all

    checks = upscale_weight_checks(upscaler, vaes, latent_upscaler)
    require_all(checks)


def vae_spec_files(spec: str) -> list[Path]:
    """Weight files a VAE spec names: a file, a folder's weight files, or hub-cache files."""
    path = Path(spec).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    from flowlift.models.vae_names import NAMED_VAES, named_vae

    named = named_vae(spec)
    repos = list(named.repos) if named is not None else [spec]
    if named is not None and not named.files:  # a folder of one checkpoint: whatever its snapshot holds
        return _snapshot_weight_files(repos, named.patterns)
    names = list(dict.fromkeys(name for vae in NAMED_VAES.values() for name in vae.files))
    from flowlift.models.hub import cached_file

    for repo in repos:
        found = [Path(cached) for name in names if (cached := cached_file(repo, name))]
        if found:
            return found
    return []


def _snapshot_weight_files(repos: list[str], patterns: Sequence[str]) -> list[Path]:
    """The weight files matching ``patterns`` in the cached snapshot of the first of ``repos`` that has any."""
    from flowlift.models.hub import cached_snapshot

    for repo in repos:
        cached = cached_snapshot(repo)  # the cache only, as the loading found it
        if cached is None:
            continue
        folder = Path(cached)
        found = sorted(
            {p for pattern in patterns for p in folder.glob(pattern) if p.suffix in WEIGHT_SUFFIXES and p.is_file()}
        )
        if found:
            return found
    return []


def pipeline_model_files(upscaler_path: Path | None, vae: Any, vae_spec: str | None) -> dict[str, list[Path]]:
    """``{"upscaler": [...], "vae": [...]}``: the weight files behind a pipeline, for provenance.

    The VAE's files come from its ``weight_files`` attribute when it has one, else from a local
    spec (file or folder), else from the Hugging Face cache for a named VAE (``vae_names``) or a repo id.
    """
    files: dict[str, list[Path]] = {"upscaler": [], "vae": []}
    if upscaler_path is not None:
        files["upscaler"].append(upscaler_path)
    vae_files = getattr(vae, "weight_files", None)
    if vae_files:
        files["vae"].extend(Path(p) for p in vae_files)
    elif vae_spec is not None:
        files["vae"].extend(vae_spec_files(vae_spec))
    return files


def _placed(param: Any, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model whose first parameter is ``param`` is on ``device`` in ``dtype`` (``cuda``: any index)."""
    on_device = param.device.type == device.type and (device.index is None or param.device.index == device.index)
    return on_device and (not param.is_floating_point() or param.dtype == dtype)


def load_pipeline_models(
    upscaler: Any, vae: Any, device: torch.device, dtype: torch.dtype
) -> tuple[Any, Path | None, Any, str | None]:
    """(UNet callable, its weights file or None, VAE or None, its spec string or None), on ``device``.

    Every weight is found first and only then does anything load: a UNet given as a path or hub id is
    resolved once, together with the VAE spec (:func:`upscale_weight_checks`: a missing UNet and VAE are
    named in one line), and loaded from that file. A UNet module already on ``device`` in ``dtype`` is used
    as it is, one elsewhere or in another dtype is *copied* there (issue 36.3: ``Module.to`` converts in
    place, so a UNet shared by several pipelines, like the web app's upscale and hires fix ones, would change
    dtype under the others); any other callable is used as it is. A VAE spec (``taef2``, ``flux2``, path, repo
    id) goes through :func:`flowlift.models.vae_loading.load_vae` in ``dtype``; a bare TAEF2 / diffusers
    ``AutoencoderKLFlux2`` module is wrapped keeping its own dtype; an object with the interface is used as
    it is; ``None`` is no VAE (a latent-only pipeline).
    """
    import torch

    from flowlift.models.upscaler_weights import load_upscaler
    from flowlift.models.vae_loading import load_vae
    from flowlift.models.weights import require_all

    named = isinstance(upscaler, (str, os.PathLike))
    param = None if named else first_parameter(upscaler)
    misplaced = param is not None and not _placed(param, device, dtype)
    vae_param = first_parameter(vae) if isinstance(vae, torch.nn.Module) else None
    checks = upscale_weight_checks(upscaler, [vae]) if named else []
    path: Path | None = require_all(checks)[0] if named else None
    if path is not None:
        upscaler = load_upscaler(path, device=device, dtype=dtype)
    elif misplaced:
        import copy

        upscaler = copy.deepcopy(upscaler).to(device=device, dtype=dtype)
    if not callable(upscaler):
        raise FlowliftError(f"upscaler must be callable like the Flow Upscaler UNet, got {type(upscaler).__name__}")
    spec: str | None = None
    if isinstance(vae, (str, os.PathLike)):
        spec = os.fspath(vae)
        vae = load_vae(spec, device=device, dtype=dtype)
    elif isinstance(vae, torch.nn.Module):  # a bare TAEF2 or diffusers AutoencoderKLFlux2 (the model card's example)
        vae = load_vae(vae, device=device, dtype=vae_param.dtype if vae_param is not None else dtype)
    if vae is not None and not (callable(getattr(vae, "encode", None)) and callable(getattr(vae, "decode", None))):
        raise FlowliftError(f"vae must have encode() and decode(), got {type(vae).__name__}")
    return upscaler, path, vae, spec
