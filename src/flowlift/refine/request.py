"""What one refine asks for, as data: a :class:`RefineRequest` and the settings objects it carries.

A front-end (``flowlift img2img`` / ``hires``, the web app's Refine tab, a script) builds one request from its
controls and the knob tables (:mod:`flowlift.refine.settings`), and :mod:`flowlift.refine.jobs` plans and runs it:

* :class:`PromptRequest` -- the prompt as text or an embeddings file, the negative prompt, CFG and guidance;
* :class:`RefinerSource` -- the weights (model, VAE, transformer, LoRAs) and where and how they run (device,
  dtype, offload, ``--max-memory``);
* :class:`~flowlift.refine.settings.SamplingSettings` and :class:`~flowlift.refine.tiling.TileRequest`, handed
  down as they are to the refiner;
* :class:`HiresSettings` -- the hires fix's upscale (scale, the upscaler, its colour knobs) and refine strength.

The hires fix's upscaler comes in as a :class:`LatentUpscalerSource`: refine/ knows only this protocol, the Flow
Upscaler's implementation lives in :mod:`flowlift.upscale.latent_source` (refine and upscale are siblings). No
torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from flowlift.errors import FlowliftError
from flowlift.knobs import COLOR_FIX, OVERWRITE
from flowlift.refine.settings import (
    HIRES_SCALE,
    REFINE_STRENGTH,
    STEPS,
    STRENGTH,
    STRENGTH_MAP,
    TRANSPLANT_STRENGTH,
    SamplingSettings,
)
from flowlift.refine.tiling import TileRequest

#: The modes a request names; ``inpaint`` is img2img with a mask, ``outpaint`` with borders.
MODES = ("txt2img", "img2img", "inpaint", "outpaint", "hires")
#: The txt2img (and hires base) size when none is given: FLUX.2's trained 1 MP.
DEFAULT_SIZE = (1024, 1024)


class LatentUpscaler(Protocol):
    """What the hires fix needs of an upscaler: normalized latents in, ``2**num_passes`` times larger out."""

    def upscale_latents(self, latents: Any, num_passes: int, *, seed: int, transplant_strength: float,
                        color_fix: bool) -> Any: ...  # fmt: skip


class LatentUpscalerSource(Protocol):
    """Where a hires fix's upscaler comes from: ``find`` its weights (checked with every other weight before
    any loads; returns the file), then ``load`` it on the refiner's VAE, device and dtype, within the memory
    the refiner's plan leaves (``budget_bytes``, None: no plan). ``name`` is what the metadata records."""

    name: str

    def find(self) -> Path: ...

    def load(self, vae: Any, *, device: Any, dtype: Any, budget_bytes: int | None) -> LatentUpscaler: ...


@dataclass(frozen=True)
class PromptRequest:
    """The prompt as ``text`` (embedded by the model's text encoder) or an ``embeds`` file (``prompt_embeds`` and
    optionally ``negative_prompt_embeds``), the negative prompt, true CFG (``cfg_scale`` 1 = off) and FLUX.2
    dev's embedded ``guidance``."""

    text: str | None = None
    embeds: str | Path | None = None
    negative: str | None = None
    cfg_scale: float = 1.0
    guidance: float | None = None

    def __post_init__(self) -> None:
        if self.text is None and self.embeds is None:
            raise FlowliftError("give --prompt TEXT or --prompt-embeds FILE")
        if self.cfg_scale <= 0:
            raise FlowliftError(f"--cfg-scale must be > 0, got {self.cfg_scale}")

    @property
    def needs_text_encoder(self) -> bool:
        """True when a text must be embedded here: no embeddings file, or CFG with a negative prompt as text."""
        return self.embeds is None or (self.cfg_scale != 1.0 and self.negative is not None)


@dataclass(frozen=True)
class RefinerSource:
    """The refiner's weights and how they run: ``model`` (a diffusers folder, hub id, transformer folder or single
    file), ``vae`` (a :func:`~flowlift.models.vae_loading.load_vae` spec; None: the model's), ``transformer`` from
    elsewhere (BFL/ComfyUI file, fp8, GGUF), ``loras`` (``FILE[:SCALE]`` texts), ``device``/``dtype`` as the
    options say them (``auto``), ``offload`` (auto/none/model/group) and ``max_memory`` (``12GB``; None: no plan)."""

    model: str
    vae: str | None = None
    transformer: str | None = None
    loras: tuple[str, ...] = ()
    device: str | None = "auto"
    dtype: str | None = "auto"
    offload: str = "auto"
    max_memory: str | None = None


@dataclass(frozen=True)
class HiresSettings:
    """The hires fix around the refine: the base (an input image, else a txt2img of ``base_size`` (width, height)
    at ``base_steps``, None: the model's), the upscale (``scale``, the upscaler, its stage-1 ``transplant_strength`` and
    ``color_fix``), and the refine pass's ``refine_strength``. Defaults are the knob tables'."""

    upscaler: LatentUpscalerSource | None = None
    scale: int = HIRES_SCALE.default
    refine_strength: float = REFINE_STRENGTH.default
    base_steps: int | None = None
    base_size: tuple[int, int] = DEFAULT_SIZE
    transplant_strength: float = TRANSPLANT_STRENGTH.default
    color_fix: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "scale", HIRES_SCALE.check(self.scale))
        object.__setattr__(self, "refine_strength", REFINE_STRENGTH.check(self.refine_strength))
        if self.base_steps is not None:  # None: the model's (4 for a step-distilled Klein)
            object.__setattr__(self, "base_steps", STEPS.check(self.base_steps))
        object.__setattr__(self, "transplant_strength", TRANSPLANT_STRENGTH.check(self.transplant_strength))
        object.__setattr__(self, "color_fix", COLOR_FIX.check(self.color_fix))

    @property
    def passes(self) -> int:
        """The upscaler's 2x passes: :func:`flowlift.limits.passes_for_scale` (the one rule)."""
        from flowlift.limits import passes_for_scale

        return passes_for_scale(self.scale)


@dataclass(frozen=True)
class RefineRequest:
    """One refine, whole: the ``mode`` (:data:`MODES`), its inputs (``image``; ``mask`` for inpaint, ``outpaint``
    borders L,T,R,B in px, ``references``), the ``output`` file (None: ``<stem>_<mode>.png`` beside the input) and
    whether a file flowlift did not write may be replaced (``overwrite``), the prompt, the weights, ``strength``
    (None: the mode's default, :data:`~flowlift.refine.settings.STRENGTH`; outpaint 1), the sampling and tiling
    settings, ``size`` (txt2img's width, height) and, for ``hires``, :class:`HiresSettings`. ``command`` is what
    the metadata and messages call the front-end; ``progress`` draws the refiner's bar."""

    mode: str
    prompt: PromptRequest
    source: RefinerSource
    image: str | Path | None = None
    mask: str | Path | None = None
    outpaint: tuple[int, int, int, int] | None = None
    references: tuple[str | Path, ...] = ()
    output: str | Path | None = None
    overwrite: bool = False
    strength: float | None = None
    strength_map: str = STRENGTH_MAP.default
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    tiles: TileRequest = field(default_factory=TileRequest)
    size: tuple[int, int] = DEFAULT_SIZE
    hires: HiresSettings | None = None
    command: str | None = None
    progress: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise FlowliftError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        object.__setattr__(self, "overwrite", OVERWRITE.check(self.overwrite))
        if self.mode == "hires" and self.hires is None:
            object.__setattr__(self, "hires", HiresSettings())
        if self.mode == "inpaint" and self.mask is None:
            raise FlowliftError("inpaint needs a mask")
        if self.mask is not None and self.outpaint is not None:
            raise FlowliftError("--mask and --outpaint are exclusive")
        if self.mode in ("img2img", "inpaint", "outpaint") and self.image is None:
            raise FlowliftError(f"{self.mode} needs an input image")
        object.__setattr__(self, "strength_map", STRENGTH_MAP.check(self.strength_map, "strength map"))
        if self.strength is not None:
            object.__setattr__(self, "strength", STRENGTH.check(self.strength))

    @property
    def mode_strength(self) -> float:
        """The strength this mode runs at: the request's, else the knob's default (outpaint: 1, a new border)."""
        if self.strength is not None:
            return self.strength
        return 1.0 if self.mode == "outpaint" else STRENGTH.default

    @property
    def name_suffix(self) -> str:
        """The default output's suffix: ``img2img``, ``outpaint``, ``hires<N>x`` (``<stem>_<suffix>.png``)."""
        if self.mode == "hires":
            return f"hires{self.hires.scale}x"
        return "img2img" if self.mode == "inpaint" else self.mode
