"""The VAE knob's named choices, declared once: what ``--vae NAME`` and every other door's VAE choice can name.

A VAE spec (:mod:`flowlift.models.vae_loading`) is one of these names, a local file or folder, a hub repo
id or a module. Every door derives from :data:`NAMED_VAES`: the command line's ``--vae`` help and
metavar (:func:`vae_metavar`, :func:`vae_help`), :func:`~flowlift.models.vae_loading.load_vae` and
:func:`~flowlift.models.vae_loading.check_vae_spec` (which repositories a name means), the weight
provenance of an output (:func:`flowlift.upscale.loading.vae_spec_files`), the web app's choices, the
ComfyUI loader nodes and the InvokeAI image node (``native`` VAEs, which flowlift runs itself there).
A VAE added here reaches all of them, and the tests parametrized over :data:`VAE_NAMES` run it through
each door. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

#: What a VAE can be on the hub: a repository's VAE files only, never its (large) transformer or text encoder.
HUB_VAE_PATTERNS = ("config.json", "taef2*", "diffusion_pytorch_model*", "*vae*.safetensors", "vae/*")


@dataclass(frozen=True)
class NamedVAE:
    """One named VAE.

    ``repos``: hub repositories whose files are this VAE, tried in order (the first one cached or
    downloadable wins); ``patterns``: the only files fetched from them (never a transformer);
    ``files``: the weight files inside a snapshot (the output's provenance hashes); ``include``: the
    ``hf download --include`` pattern an error line suggests (None: the whole, small, repository).
    ``native``: flowlift's own implementation, so the node packs load it through flowlift (ComfyUI: a
    loader node reading ``comfy_folder``; InvokeAI: the image node's flowlift-VAE field), where the
    FLUX.2 VAE is the host's own model. ``approximate``: its decode only approximates the FLUX.2 VAE's.
    """

    name: str
    title: str
    summary: str
    repos: tuple[str, ...]
    patterns: tuple[str, ...]
    files: tuple[str, ...]
    native: bool
    approximate: bool
    include: str | None = None
    comfy_folder: str = ""
    comfy_node: str = ""


NAMED_TAEF2 = NamedVAE(
    name="taef2",
    title="TAEF2",
    summary="fast, approximate",
    repos=("madebyollin/taef2",),
    patterns=HUB_VAE_PATTERNS,
    files=("taef2_encoder.pth", "taef2_decoder.pth", "taef2.safetensors", "diffusion_pytorch_model.safetensors"),
    native=True,
    approximate=True,
    comfy_folder="vae_approx",
    comfy_node="FlowliftTAEF2Loader",
)
NAMED_FLUX2 = NamedVAE(
    name="flux2",
    title="FLUX.2 VAE",
    summary="the full FLUX.2 VAE",
    # The Klein repos are not gated and carry the same VAE as FLUX.2-dev.
    repos=("black-forest-labs/FLUX.2-klein-4B", "black-forest-labs/FLUX.2-klein-9B", "black-forest-labs/FLUX.2-dev"),
    patterns=("vae/*",),
    files=("vae/diffusion_pytorch_model.safetensors",),
    native=False,
    approximate=False,
    include="vae/*",
)
NAMED_MAGE = NamedVAE(
    name="mage",
    title="Mage-VAE",
    summary="Mage-Flow's VAE, the Flow Upscaler card's choice: FLUX.2 latents at far fewer MACs",
    # microsoft/Mage-Flow itself was removed from the hub; the community mirror comes last.
    repos=(
        "microsoft/Mage-Flow-Base",
        "microsoft/Mage-Flow-Turbo",
        "microsoft/Mage-Flow-Edit",
        "microsoft/Mage-Flow-Edit-Base",
        "microsoft/Mage-Flow-Edit-Turbo",
        "M-vdBerg/Mage-Flow",
    ),
    patterns=("vae/*.safetensors", "vae/*.json"),  # never a pickle, never the transformer
    files=(),  # whatever single .safetensors vae/ holds
    native=True,
    approximate=False,
    include="vae/*",
    comfy_folder="vae",
    comfy_node="FlowliftMageVAELoader",
)

#: Name -> named VAE, in the order the doors show them; the first is no default (that is DEFAULT_VAE).
NAMED_VAES: dict[str, NamedVAE] = {vae.name: vae for vae in (NAMED_FLUX2, NAMED_TAEF2, NAMED_MAGE)}
#: The names ``--vae`` takes besides a path or hub id.
VAE_NAMES: tuple[str, ...] = tuple(NAMED_VAES)
#: The kinds of VAE that encode straight into the normalized latent space and carry no BN statistics, so SesquiLSR
#: (which works on the FLUX.2 VAE's raw latents) cannot run with them.
NO_BN_STATISTICS: tuple[str, ...] = (NAMED_TAEF2.name, NAMED_MAGE.name)
#: The named VAEs flowlift itself runs inside the node packs.
NATIVE_VAES: tuple[NamedVAE, ...] = tuple(vae for vae in NAMED_VAES.values() if vae.native)


def named_vae(spec: object) -> NamedVAE | None:
    """The named VAE ``spec`` is (exactly one of :data:`VAE_NAMES`), else None (a path, hub id or module)."""
    return NAMED_VAES.get(spec) if isinstance(spec, str) else None


def vae_metavar(*, paths: bool = True) -> str:
    """``flux2|taef2|mage|PATH|REPO``: the command line's metavar of a VAE option."""
    return "|".join([*VAE_NAMES, *(("PATH", "REPO") if paths else ())])


def vae_names_text() -> str:
    """``flux2 (the full FLUX.2 VAE), taef2 (fast, approximate), mage (...)``: the names in words."""
    return ", ".join(f"{vae.name} ({vae.summary})" for vae in NAMED_VAES.values())


def vae_help(default: str | None = None) -> str:
    """The help text of a VAE option: every name, then a path or hub id, then the default if any."""
    tail = f" (default {default})" if default else ""
    return f"VAE: {vae_names_text()}, a file/folder or hub id{tail}"


def unknown_vae_message(text: str) -> str:
    """The one line for a VAE spec that is no name, no existing path and no hub id."""
    names = ", ".join(f"'{name}'" for name in VAE_NAMES)
    return f"VAE: {text}: no such file or folder (nor one of {names} or a hub repo id owner/name)"
