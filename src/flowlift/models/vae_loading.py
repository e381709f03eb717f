"""VAE specs: :func:`load_vae` builds a :mod:`flowlift.models.vae` adapter; :func:`check_vae_spec` fails fast.

``spec`` is a name of :data:`flowlift.models.vae_names.VAE_NAMES`, the one declaration of the VAE knob's
choices (``"taef2"``: hub ``madebyollin/taef2``; ``"flux2"``: the ``vae/`` folder of a FLUX.2 Klein or dev
repository; ``"mage"``: Mage-VAE, the ``vae/`` folder of a Mage-Flow repository; each name's repositories
are tried in order), a local file or directory, a hub repo id, or an already-built
:class:`~flowlift.models.taef2.TAEF2` / ``AutoencoderKLFlux2`` / :class:`~flowlift.models.mage_vae.MageVAEModel`
module. Hub lookups go through the huggingface_hub cache and honour ``HF_HUB_OFFLINE=1``; an unreachable hub
is treated as offline (:func:`flowlift.models.hub.hub_offline_reason`). Every weight load is strict.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from flowlift.devices import resolve_device_option
from flowlift.errors import FIELD_MARK, FlowliftError
from flowlift.files.json_input import parse_json
from flowlift.knobs import check_dtype
from flowlift.models.flux2_vae_convert import flux2_from_state_dict, is_diffusers_flux2_vae, is_original_flux2_vae
from flowlift.models.mage_vae_files import is_mage_vae, mage_from_state_dict
from flowlift.models.vae import TAEF2VAE, Flux2VAE, MageVAE, taef2_from_state_dicts
from flowlift.models.vae_names import (
    HUB_VAE_PATTERNS,
    NAMED_FLUX2,
    NAMED_MAGE,
    NAMED_TAEF2,
    NAMED_VAES,
    VAE_NAMES,
    NamedVAE,
    named_vae,
    unknown_vae_message,
)
from flowlift.models.weights import WEIGHT_SUFFIXES, header_state, looks_like_repo_id, read_state_dict

# Each name's repositories and files are declared once, in flowlift.models.vae_names.
TAEF2_REPO = NAMED_TAEF2.repos[0]
#: Repositories whose ``vae/`` folder holds the FLUX.2 VAE, tried in order.
FLUX2_REPOS = NAMED_FLUX2.repos
TAEF2_FILES = ("taef2_encoder.pth", "taef2_decoder.pth")
#: Repositories whose ``vae/`` folder holds the released Mage-VAE, tried in order.
MAGE_REPOS = NAMED_MAGE.repos
#: Only the VAE of a Mage-Flow repository (never its transformer or text encoder; no pickles).
MAGE_PATTERNS = list(NAMED_MAGE.patterns)
#: The class of the diffusers port ``MinhNH232331M/MageFlow-VAE-diffusers``, whose key layout is unpublished.
MAGE_DIFFUSERS_PORT_CLASS = "AutoencoderKLMega"
#: What flowlift reads, for the errors that refuse something else.
READABLE_LAYOUTS = (
    "TAEF2 (taef2_encoder/decoder .pth or .safetensors), a FLUX.2 VAE (single file with BFL/ComfyUI keys, or a "
    "diffusers AutoencoderKLFlux2 folder) or Mage-VAE as released (one .safetensors with student.dconv_encoder.* "
    "and pipeline.* tensors, or a Mage-Flow repository's vae/ folder)"
)


AnyVAE = TAEF2VAE | Flux2VAE | MageVAE


#: What a VAE does with each half: a command needs one or both (:func:`require_vae_parts`).
VAE_PARTS = {"encode": "encoder", "decode": "decoder"}
#: What a whole-image round trip needs (upscale, img2img, eval, bands, training's validation).
ENCODE_DECODE = ("encode", "decode")


def load_vae(
    spec: Any,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    needs: tuple[str, ...] = (),
) -> AnyVAE:
    """Load a VAE from ``spec`` (see the module docstring) onto ``device`` in ``dtype``.

    ``needs``: the halves the caller will run (``"encode"``, ``"decode"``, :data:`ENCODE_DECODE`); a VAE that
    lacks one (a TAEF2 folder or file holding one half, a decode-only Mage-VAE) is refused here in one line
    (:func:`require_vae_parts`) instead of on every image. Empty: whatever the files hold (a decode-only node).
    """
    vae = _load_vae(spec, device, dtype)
    require_vae_parts(vae, needs, spec=spec)
    return vae


def require_vae_parts(vae: Any, needs: tuple[str, ...], *, spec: Any = None) -> None:
    """One line (field ``vae``) naming the missing half when ``vae`` cannot do all of ``needs``, with the fix:
    the other TAEF2 file beside this one, or the full Mage-VAE file. Objects without ``encoder`` / ``decoder``
    modules (a caller's own VAE) pass."""
    from flowlift.models.taef2 import TAEF2

    model = getattr(vae, "model", None)
    missing = [p for p in needs if model is not None and getattr(model, VAE_PARTS[p], True) is None]
    if not missing:
        return
    half = VAE_PARTS[missing[0]]
    other = "encoder" if half == "decoder" else "decoder"
    named = f" {os.fspath(spec)}" if isinstance(spec, (str, os.PathLike)) else ""
    asked = " and ".join("encodes" if p == "encode" else "decodes" for p in needs)
    if isinstance(model, TAEF2):
        raise FlowliftError(
            f"VAE{named}: this TAEF2 has no {half} (its weights hold only the {other}); this run {asked}: put "
            f"taef2_{half}.pth beside taef2_{other}.pth in one folder (TAEF2 is released as those two files), or "
            "give a file holding both halves",
            field="vae",
        )
    raise FlowliftError(
        f"VAE{named}: this VAE has no {half} (a decode-only Mage-VAE file); this run {asked}: give the full "
        f"released file, or set {FIELD_MARK} to taef2",
        field="vae",
    )


def _load_vae(spec: Any, device: torch.device | str, dtype: torch.dtype) -> AnyVAE:
    device = resolve_device_option(device)  # one line for a device that does not exist here ('bogus', 'meta')
    dtype = check_dtype(dtype)  # before a file is read: "bf16" is one line, not a TypeError from torch's .to()
    if isinstance(spec, (TAEF2VAE, Flux2VAE, MageVAE)):
        spec.model.to(device=device, dtype=dtype)
        return spec
    if isinstance(spec, torch.nn.Module):
        return _from_module(spec, device, dtype)
    if not isinstance(spec, (str, os.PathLike)):
        raise FlowliftError(f"VAE spec must be a name, path, hub repo id or module, got {type(spec).__name__}")
    text = _non_empty(spec)
    named = named_vae(text)
    if named is not None:
        return _from_dir(named_vae_folder(named), device, dtype)
    path = Path(text).expanduser()
    if path.is_file():
        return _from_file(path, device, dtype)
    if path.is_dir():
        return _from_dir(path, device, dtype)
    if looks_like_repo_id(text):
        return _from_hub(text, device, dtype)
    raise FlowliftError(unknown_vae_message(text))


def _non_empty(spec: str | os.PathLike) -> str:
    """The spec's text, unless it is empty or blank: that names no VAE (it would read the working folder)."""
    text = os.fspath(spec)
    if not str(text).strip():
        raise FlowliftError(
            f"VAE: an empty name or path names no VAE, got {text!r}; give a name "
            f"({', '.join(VAE_NAMES)}), a file or folder, or a hub repo id"
        )
    return text


def _from_module(module: torch.nn.Module, device: torch.device | str, dtype: torch.dtype) -> AnyVAE:
    from flowlift.models.mage_vae import MageVAEModel
    from flowlift.models.taef2 import TAEF2

    if isinstance(module, TAEF2):
        return TAEF2VAE(module.to(device=device, dtype=dtype))
    if isinstance(module, MageVAEModel):
        return MageVAE(module.to(device=device, dtype=dtype))
    from diffusers import AutoencoderKLFlux2  # only now: importing diffusers takes seconds

    if isinstance(module, AutoencoderKLFlux2):
        return Flux2VAE(module.to(device=device, dtype=dtype))
    raise FlowliftError(
        "VAE module must be a flowlift TAEF2 or MageVAEModel or a diffusers AutoencoderKLFlux2, "
        f"got {type(module).__name__}"
    )


def _from_file(path: Path, device: torch.device | str, dtype: torch.dtype) -> AnyVAE:
    from flowlift.models.taef2 import detect_layout

    state = read_state_dict(path, what="VAE weights")
    layout = detect_layout(state)
    if layout in ("encoder", "decoder"):
        states = [(state, str(path))]
        other = "decoder" if layout == "encoder" else "encoder"
        sibling = path.with_name(path.name.replace(layout, other))
        if sibling != path and sibling.is_file():
            states.append((read_state_dict(sibling, what="TAEF2 weights"), str(sibling)))
        return taef2_from_state_dicts(states, device=device, dtype=dtype)
    if layout != "unknown":
        return taef2_from_state_dicts([(state, str(path))], device=device, dtype=dtype)
    if is_original_flux2_vae(state) or is_diffusers_flux2_vae(state):
        config, config_path = None, path.with_name("config.json")
        if is_diffusers_flux2_vae(state) and config_path.is_file():
            config = _read_config(config_path)
        return flux2_from_state_dict(
            state,
            config=config,
            config_file=str(config_path) if config is not None else None,
            origin=str(path),
            device=device,
            dtype=dtype,
        )
    if is_mage_vae(state):
        if path.suffix != ".safetensors":
            raise FlowliftError(
                f"VAE: {path} is a pickled Mage-VAE checkpoint; flowlift reads Mage-VAE only as the released "
                ".safetensors file (student.dconv_encoder.* and pipeline.* tensors)"
            )
        return mage_from_state_dict(state, origin=str(path), device=device, dtype=dtype, owned=True)
    raise FlowliftError(
        f"VAE: {path} is neither a TAEF2, a FLUX.2 VAE nor a Mage-VAE checkpoint (unrecognised keys); "
        f"flowlift reads {READABLE_LAYOUTS}"
    )


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = parse_json(path.read_text())
    except (OSError, ValueError) as error:
        raise FlowliftError(f"VAE: cannot read {path}: {str(error).splitlines()[0][:200]}") from None
    if not isinstance(config, dict):
        raise FlowliftError(f"VAE: {path} is not a JSON object")
    return config


def _diffusers_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The state dict of a diffusers model folder (single or sharded safetensors, or .bin)."""
    for name in ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin"):
        if (folder / name).is_file():
            return read_state_dict(folder / name, what="VAE weights")
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(_read_config(index).get("weight_map", {}).values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(read_state_dict(folder / shard, what="VAE weights"))
        if state:
            return state
    raise FlowliftError(f"VAE: no diffusion_pytorch_model weights in {folder}")


def _from_dir(path: Path, device: torch.device | str, dtype: torch.dtype) -> AnyVAE:
    pth = [path / name for name in TAEF2_FILES if (path / name).is_file()]
    if pth:
        states = [(read_state_dict(p, what="TAEF2 weights"), str(p)) for p in pth]
        return taef2_from_state_dicts(states, device=device, dtype=dtype)
    for folder in (path / "vae", path):
        config_path = folder / "config.json"
        if not config_path.is_file():
            continue
        config = _read_config(config_path)
        if config.get("_class_name") == MAGE_DIFFUSERS_PORT_CLASS:
            raise FlowliftError(
                f"VAE: {folder} is the diffusers port of Mage-VAE ({MAGE_DIFFUSERS_PORT_CLASS}, t = 0-folded weights "
                f"in a layout its model card does not publish), which flowlift cannot load; flowlift reads "
                f"{READABLE_LAYOUTS} (set {FIELD_MARK} to mage for the released one)",
                field="vae",
            )
        if config.get("_class_name") == "AutoencoderKLFlux2":
            return flux2_from_state_dict(
                _diffusers_weights(folder),
                config=config,
                config_file=str(config_path),
                origin=str(folder),
                device=device,
                dtype=dtype,
            )
        weights = [folder / n for n in ("diffusion_pytorch_model.safetensors", "taef2.safetensors")]
        for file in weights:
            if file.is_file():
                return _from_file(file, device, dtype)
    for folder in (path, path / "vae"):  # a lone checkpoint, e.g. a Mage-Flow repository's vae/ file
        files = sorted(p for p in folder.iterdir() if p.suffix == ".safetensors") if folder.is_dir() else []
        if len(files) == 1:
            return _from_file(files[0], device, dtype)
    raise FlowliftError(
        f"VAE: {path} holds no TAEF2 files ({', '.join(TAEF2_FILES)}), no diffusers VAE folder "
        "(config.json + weights, also under vae/) and no single .safetensors checkpoint (also under vae/); "
        f"flowlift reads {READABLE_LAYOUTS}"
    )


def _snapshot(repo_id: str, patterns: list[str]) -> Path:
    from flowlift.models.hub import access_hint, cached_snapshot, download_hint, hub_offline_reason

    offline = hub_offline_reason()  # offline or unreachable: the cache only, at once, instead of ~25 s of retries
    found, hint = None, f"it is not in the Hugging Face cache and {offline}"
    if offline:  # the cache's own layout: no hub client imported (~0.3 CPU-s)
        found = cached_snapshot(repo_id)
    else:
        from huggingface_hub import snapshot_download

        try:
            found = snapshot_download(repo_id, allow_patterns=patterns)
        except Exception as error:  # noqa: BLE001 - any hub failure is "not available" to the user
            hint = type(error).__name__
            if refused := access_hint(repo_id, error):
                raise FlowliftError(
                    f"VAE: cannot get {repo_id}: {refused}, or set {FIELD_MARK} to a local path", field="vae"
                ) from None
    if found is None:
        raise FlowliftError(
            f"VAE: cannot get {repo_id} ({hint}); {download_hint(repo_id)} or set {FIELD_MARK} to a local path",
            field="vae",
        )
    return Path(found)


#: Only what a VAE can be: never a repository's (large) transformer or text-encoder files.
_VAE_PATTERNS = list(HUB_VAE_PATTERNS)


def check_vae_spec(spec: Any) -> None:
    """Fail fast, before any model loads, when a VAE spec cannot be found.

    Local paths must exist; the names of :data:`~flowlift.models.vae_names.VAE_NAMES` and hub ids are
    resolved to their cached (or, online, downloaded) files, which :func:`load_vae` then reads without
    fetching again. Objects pass unchecked.
    """
    if not isinstance(spec, (str, os.PathLike)):
        return
    text = _non_empty(spec)
    named = named_vae(text)
    if named is not None:
        named_vae_folder(named)
        return
    path = Path(text).expanduser()
    if path.exists():
        if path.is_file():
            _check_file_header(path)
        return
    if looks_like_repo_id(text):
        _snapshot(text, _VAE_PATTERNS)
        return
    raise FlowliftError(unknown_vae_message(text))


def _check_file_header(path: Path) -> None:
    """A safetensors VAE file's header, read (no tensor): unreadable, truncated, or no layout flowlift reads is
    :func:`_from_file`'s line before any model loads (a pickle is checked when it loads)."""
    from flowlift.models.taef2 import detect_layout
    from flowlift.models.weights import header_state

    found = header_state(path, what=f"VAE weights {path}")
    if found is None:
        return
    state = found[0]
    known = is_original_flux2_vae(state) or is_diffusers_flux2_vae(state) or is_mage_vae(state)
    if detect_layout(state) == "unknown" and not known:
        raise FlowliftError(
            f"VAE: {path} is neither a TAEF2, a FLUX.2 VAE nor a Mage-VAE checkpoint (unrecognised keys); "
            f"flowlift reads {READABLE_LAYOUTS}"
        )


def _from_hub(repo_id: str, device: torch.device | str, dtype: torch.dtype) -> AnyVAE:
    folder = _snapshot(repo_id, _VAE_PATTERNS)
    return _from_dir(folder, device, dtype)


def _has_weights(folder: Path, patterns: tuple[str, ...]) -> bool:
    return any(p.suffix in WEIGHT_SUFFIXES and p.is_file() for pattern in patterns for p in folder.glob(pattern))


def named_vae_folder(named: NamedVAE) -> Path:
    """The cached (or downloaded) snapshot of the first of ``named.repos`` that holds its VAE files.

    One repository: its own error is passed on (it names its download command). Several: one line names
    them all and the first one's download command (``named.include``: only its VAE files).
    """
    from flowlift.models.hub import download_hint, hub_offline_reason

    if len(named.repos) == 1:
        folder = _snapshot(named.repos[0], list(named.patterns))
        if _has_weights(folder, named.patterns):
            return folder
    else:
        for repo in named.repos:
            try:
                folder = _snapshot(repo, list(named.patterns))
            except FlowliftError:
                continue
            if _has_weights(folder, named.patterns):
                return folder
    offline = hub_offline_reason()
    where = f"none of {', '.join(named.repos)} has" if len(named.repos) > 1 else f"{named.repos[0]} has no"
    other = "" if named is NAMED_TAEF2 else " (or to taef2, the fast approximate VAE)"
    raise FlowliftError(
        f"VAE '{named.name}': {where} its VAE files in the Hugging Face cache"
        f"{f' and {offline}' if offline else ''}; {download_hint(named.repos[0], include=named.include)} "
        f"or set {FIELD_MARK} to a local path{other}",
        field="vae",
    )


def vae_spec_kind(spec: Any) -> str | None:
    """The kind of VAE ``spec`` names (``"taef2"``, ``"flux2"`` or ``"mage"``), told without reading a tensor: from
    its name, a named VAE's hub repository, a folder's file names and ``config.json`` (in :func:`_from_dir`'s order)
    or a safetensors file's header. None where only loading tells: a pickle file, another hub id, a module, a path
    that is not there (:func:`check_vae_spec` says what is wrong with those). For refusals that depend on the kind
    (SesquiLSR needs the FLUX.2 VAE) before anything loads."""
    if not isinstance(spec, (str, os.PathLike)):
        return None
    text = os.fspath(spec)
    named = named_vae(text) or next((vae for vae in NAMED_VAES.values() if text in vae.repos), None)
    if named is not None:
        return named.name
    path = Path(text).expanduser()
    try:
        return _file_kind(path) if path.is_file() else _folder_kind(path) if path.is_dir() else None
    except (FlowliftError, OSError):  # an unreadable header or config: the loader's line, not this question's
        return None


def _file_kind(path: Path) -> str | None:
    if path.name in TAEF2_FILES:  # the released pickles: their names are all that tells, short of reading them
        return NAMED_TAEF2.name
    found = header_state(path, what=f"VAE weights {path}")
    if found is None:
        return None
    from flowlift.models.taef2 import detect_layout

    state = found[0]
    if detect_layout(state) != "unknown":
        return NAMED_TAEF2.name
    if is_original_flux2_vae(state) or is_diffusers_flux2_vae(state):
        return NAMED_FLUX2.name
    return NAMED_MAGE.name if is_mage_vae(state) else None


def _folder_kind(path: Path) -> str | None:
    if any((path / name).is_file() for name in TAEF2_FILES):
        return NAMED_TAEF2.name
    for folder in (path / "vae", path):
        if not (folder / "config.json").is_file():
            continue
        if _read_config(folder / "config.json").get("_class_name") == "AutoencoderKLFlux2":
            return NAMED_FLUX2.name
        for file in (folder / "diffusion_pytorch_model.safetensors", folder / "taef2.safetensors"):
            if file.is_file():
                return _file_kind(file)
    for folder in (path, path / "vae"):
        files = sorted(p for p in folder.iterdir() if p.suffix == ".safetensors") if folder.is_dir() else []
        if len(files) == 1:
            return _file_kind(files[0])
    return None
