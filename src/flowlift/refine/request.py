"""What one refine asks for, as data: a :class:`RefineRequest` and the settings objects it carries.

A front-end (``flowlift img2img`` / ``hires``, the web app's Refine tab, a script) builds one request from its
controls and the knob tables (:mod:`flowlift.refine.settings`), and :mod:`flowlift.refine.jobs` plans and runs it:

* :class:`PromptRequest` -- the prompt as text or an embeddings file, the negative prompt, CFG and guidance;
* :class:`RefinerSource` -- the weights (model, VAE, transformer, LoRAs) and where and how they run (device,
  dtype, offload, ``max_memory``);
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

from flowlift.devices import check_device_and_dtype
from flowlift.errors import FIELD_MARK, FlowliftError
from flowlift.knobs import (
    COLOR_FIX,
    OVERWRITE,
    check_cfg_scale,
    check_kind,
    check_path,
    check_paths,
    check_positive,
)
from flowlift.limits import whole_passes
from flowlift.refine.settings import (
    HIRES_SCALE,
    OUTPAINT_STRENGTH,
    REFINE_STRENGTH,
    STEPS,
    STRENGTH,
    STRENGTH_MAP,
    TRANSPLANT_STRENGTH,
    SamplingSettings,
    check_hires_size,
    check_offload_and_budget,
    check_txt2img_size,
)
from flowlift.refine.tiling import TileRequest

#: The modes a request names; ``inpaint`` is img2img with a mask, ``outpaint`` with borders.
MODES = ("txt2img", "img2img", "inpaint", "outpaint", "hires")
#: The txt2img (and hires base) size when none is given: FLUX.2's trained 1 MP.
DEFAULT_SIZE = (1024, 1024)


class LatentUpscaler(Protocol):
    """What the hires fix needs of an upscaler: normalized latents in, ``2**num_passes`` times larger out; for a
    scale that is not a power of two also ``to_size(latents, (h, w))``, the fraction in [1, 2] (SesquiLSR). One that
    plans its memory may also have ``check_memory(latent_size, num_passes, target, batch)``, which the hires fix calls
    before its base pass: a budget the upscaler would refuse is one line before any work."""

    def upscale_latents(
        self, latents: Any, num_passes: int, *, seed: int, transplant_strength: float, color_fix: bool
    ) -> Any: ...


class LatentUpscalerSource(Protocol):
    """Where a hires fix's upscaler comes from: ``find`` its weights (checked with every other weight before
    any loads; returns the file), then ``load`` it on the refiner's VAE, device and dtype, within the memory
    the refiner's plan leaves (``budget_bytes``, None: no plan). ``name`` is what the metadata records."""

    name: str
    #: ``"sesqui:PATH"`` when the source also does fractional factors in latent space (``to_size``), else None.
    latent_upscaler: str | None

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
        check_kind("prompt.text", self.text, str, "text", optional=True)
        check_path("prompt.embeds", self.embeds, optional=True)
        check_kind("prompt.negative", self.negative, str, "text", optional=True)
        if self.text is None and self.embeds is None:
            raise FlowliftError(
                f"{FIELD_MARK}: give a prompt or its embeddings ({FIELD_MARK})", field=("prompt.text", "prompt.embeds")
            )
        object.__setattr__(self, "cfg_scale", check_cfg_scale("prompt.cfg_scale", self.cfg_scale))
        if self.negative is not None and self.cfg_scale == 1.0:  # true CFG off: the negative would go unused
            raise FlowliftError(
                f"{FIELD_MARK} is used only by true CFG: give {FIELD_MARK} other than 1 (Klein base models use ~4), "
                "or drop the negative prompt",
                field=("prompt.negative", "prompt.cfg_scale"),
            )
        if self.guidance is not None:
            object.__setattr__(self, "guidance", check_positive("prompt.guidance", self.guidance))

    @property
    def needs_text_encoder(self) -> bool:
        """True when a text must be embedded here: no embeddings file, or CFG with a negative prompt as text."""
        return self.embeds is None or (self.cfg_scale != 1.0 and self.negative is not None)


@dataclass(frozen=True)
class RefinerSource:
    """The refiner's weights and how they run: ``model`` (a diffusers folder, hub id, transformer folder or single
    file), ``vae`` (a :func:`~flowlift.models.vae_loading.load_vae` spec; None: the model's), ``transformer`` from
    elsewhere (BFL/ComfyUI file, fp8, GGUF), ``loras`` (``FILE[:SCALE]`` texts), ``device``/``dtype`` as the
    options say them (``auto``), ``offload`` (auto/none/model/group) and ``max_memory`` (``12GB``; None: no plan).
    Every field is checked when the source is made; one ``loras`` string is one LoRA, never its characters."""

    model: str
    vae: str | None = None
    transformer: str | None = None
    loras: tuple[str, ...] = ()
    device: str | None = "auto"
    dtype: str | None = "auto"
    offload: str = "auto"
    max_memory: str | None = None

    def __post_init__(self) -> None:
        check_path("source.model", self.model)
        check_path("source.vae", self.vae, optional=True)
        check_path("source.transformer", self.transformer, optional=True)
        loras = check_paths("source.loras", self.loras)
        object.__setattr__(self, "loras", tuple(str(lora) for lora in loras))
        check_kind("source.device", self.device, str, "a device name such as auto, cpu or cuda:0", optional=True)
        check_device_and_dtype(self.device, self.dtype, ("source.device", "source.dtype"))
        check_offload_and_budget(self.offload, self.max_memory, "source.")


@dataclass(frozen=True)
class HiresSettings:
    """The hires fix around the refine: the base (an input image, else a txt2img of ``base_size`` (width, height)
    at ``base_steps``, None: the model's), the upscale (``scale``, the upscaler, its stage-1 ``transplant_strength`` and
    ``color_fix``), and the refine pass's ``refine_strength``. Defaults are the knob tables'."""

    upscaler: LatentUpscalerSource | None = None
    scale: float = HIRES_SCALE.default
    refine_strength: float = REFINE_STRENGTH.default
    base_steps: int | None = None
    base_size: tuple[int, int] = DEFAULT_SIZE
    transplant_strength: float = TRANSPLANT_STRENGTH.default
    color_fix: bool = COLOR_FIX.default

    def __post_init__(self) -> None:
        if self.upscaler is not None and not all(hasattr(self.upscaler, name) for name in ("find", "load", "name")):
            raise FlowliftError(
                f"upscaler must be a latent upscaler source (find, load, name: "
                f"flowlift.upscale.latent_source.FlowUpscalerSource) or None, got {self.upscaler!r}",
                field="upscaler",
            )
        object.__setattr__(self, "scale", HIRES_SCALE.check(self.scale, "scale"))
        if not whole_passes(self.scale) and getattr(self.upscaler, "latent_upscaler", None) is None:
            raise FlowliftError(
                f"{FIELD_MARK} {self.scale:g} is not a whole number of 2x passes (2, 4, 8): give {FIELD_MARK} "
                "sesqui:PATH (SesquiLSR's FLUX.2 weights, upscaler_Flux2.safetensors) for the fraction",
                field=("scale", "upscaler.latent_upscaler"),
            )
        refine_strength = REFINE_STRENGTH.check(self.refine_strength, "refine_strength")
        object.__setattr__(self, "refine_strength", refine_strength)
        if self.base_steps is not None:  # None: the model's (4 for a step-distilled Klein)
            object.__setattr__(self, "base_steps", STEPS.check(self.base_steps, "base_steps"))
        if not isinstance(self.base_size, (tuple, list)) or len(self.base_size) != 2:
            raise FlowliftError(f"base_size must be (width, height) in px, got {self.base_size!r}", field="base_size")
        object.__setattr__(self, "base_size", check_txt2img_size(*self.base_size, "base_size"))
        transplant = TRANSPLANT_STRENGTH.check(self.transplant_strength, "transplant_strength")
        object.__setattr__(self, "transplant_strength", transplant)
        object.__setattr__(self, "color_fix", COLOR_FIX.check(self.color_fix, "color_fix"))

    @property
    def passes(self) -> int:
        """The upscaler's 2x passes: :func:`flowlift.limits.passes_for_scale` (the one rule), the fraction last
        for a scale that is not a power of two (1.5 -> 0 passes, 3 -> 1, 6 -> 2, then ``to_size``)."""
        from flowlift.limits import passes_for_scale

        return passes_for_scale(self.scale, fraction_last=not whole_passes(self.scale))


def _borders(value: Any) -> tuple[int, int, int, int]:
    """Outpaint borders (left, top, right, bottom px): four non-negative integers, not all 0, else one line."""
    from flowlift.knobs import exact_int

    borders = tuple(exact_int(side) for side in value) if isinstance(value, (tuple, list)) else ()
    if len(borders) != 4 or any(side is None or side < 0 for side in borders):
        raise FlowliftError(
            f"outpaint must be four non-negative pixel borders (L, T, R, B), got {value!r}", field="outpaint"
        )
    if not any(borders):
        raise FlowliftError(f"outpaint borders {value!r} are all 0: nothing to paint (use img2img)", field="outpaint")
    return borders  # type: ignore[return-value]


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
        """Every field checked, then the rules between them, before anything is read or loaded (one line each,
        naming the field as the Python API spells it; a door says it in its own words)."""
        if self.mode not in MODES:
            raise FlowliftError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}", field="mode")
        check_kind("prompt", self.prompt, PromptRequest, "a PromptRequest")
        check_kind("source", self.source, RefinerSource, "a RefinerSource")
        check_kind("sampling", self.sampling, SamplingSettings, "a SamplingSettings")
        check_kind("tiles", self.tiles, TileRequest, "a TileRequest")
        check_kind("hires", self.hires, HiresSettings, "a HiresSettings", optional=True)
        check_path("image", self.image, optional=True)
        check_path("mask", self.mask, optional=True)
        check_path("output", self.output, optional=True)
        object.__setattr__(self, "references", check_paths("references", self.references))
        object.__setattr__(self, "overwrite", OVERWRITE.check(self.overwrite))
        object.__setattr__(self, "strength_map", STRENGTH_MAP.check(self.strength_map))
        if self.strength is not None:
            object.__setattr__(self, "strength", STRENGTH.check(self.strength))
        check_kind("command", self.command, str, "text", optional=True)
        check_kind("progress", self.progress, bool, "True, False", optional=True)
        if self.outpaint is not None:
            object.__setattr__(self, "outpaint", _borders(self.outpaint))
        self._check_mode()
        self._check_unused()

    def _check_mode(self) -> None:
        """What the mode needs: an image (img2img, inpaint, outpaint), a mask (inpaint), borders (outpaint), a size
        within the cap (txt2img; hires from a txt2img base, times its scale), an upscaler source (hires)."""
        if self.mode in ("img2img", "inpaint", "outpaint") and self.image is None:
            raise FlowliftError(f"image: {self.mode} needs an input image", field="image")
        if self.mode == "inpaint" and self.mask is None:
            raise FlowliftError("mask: inpaint needs a mask", field="mask")
        if self.mask is not None and self.mode not in ("inpaint", "img2img"):
            if self.mode == "outpaint":  # both given: either is the one to drop
                raise FlowliftError(
                    f"{FIELD_MARK} and {FIELD_MARK} are exclusive (inpaint or outpaint); drop one",
                    field=("mask", "outpaint"),
                )
            raise FlowliftError(f"mask: {self.mode} takes no mask; drop it", field="mask")
        if (self.outpaint is not None) != (self.mode == "outpaint"):
            what = "outpaint needs its borders (L, T, R, B px)" if self.outpaint is None else f"{self.mode} has none"
            raise FlowliftError(f"outpaint: {what}", field="outpaint")
        if self.mode == "outpaint" and self.strength is not None:
            from flowlift.refine.canvas import check_outpaint_strength  # the loop's strength map: torch, when needed

            check_outpaint_strength(self.strength, self.strength_map)
        if self.mode == "txt2img":
            if not isinstance(self.size, (tuple, list)) or len(self.size) != 2:
                raise FlowliftError(f"size must be (width, height) in px, got {self.size!r}", field="size")
            object.__setattr__(self, "size", check_txt2img_size(*self.size))
        if self.mode == "hires":
            hires = self.hires if self.hires is not None else HiresSettings()
            object.__setattr__(self, "hires", hires)
            if hires.upscaler is None:
                raise FlowliftError(
                    "hires.upscaler: the hires fix needs an upscaler source, e.g. "
                    "flowlift.upscale.latent_source.FlowUpscalerSource() (the released Flow Upscaler)",
                    field="hires.upscaler",
                )
            if self.image is None:
                check_hires_size(*hires.base_size, hires.scale)

    def _check_unused(self) -> None:
        """A field the mode does not use is one line naming it and what to do, never dropped without a word (the
        command line's options cannot combine so; a Python caller's fields can)."""
        unused: list[tuple[str, str]] = []
        if self.mode == "txt2img" and self.image is not None:
            unused.append(("image", "txt2img draws from the prompt alone; use img2img to start from an image"))
        if self.mode in ("txt2img", "hires") and self.references:
            unused.append(("references", f"{self.mode} takes no reference images; use img2img with them"))
        if self.mode in ("txt2img", "hires") and self.strength is not None:
            where = "hires.refine_strength" if self.mode == "hires" else "none: it starts from noise"
            unused.append(("strength", f"{self.mode} does not use it ({where})"))
        size = tuple(self.size) if isinstance(self.size, (tuple, list)) else self.size  # True: not the default either
        if self.mode != "txt2img" and size != DEFAULT_SIZE:
            unused.append(("size", f"{self.mode} does not use it (only txt2img draws at a size; hires: base_size)"))
        if self.mode != "hires" and self.hires is not None:
            unused.append(("hires", f"only the hires mode uses it, not {self.mode}"))
        base = self.hires if self.mode == "hires" and self.image is not None else None
        if base is not None and (base.base_steps is not None or tuple(base.base_size) != DEFAULT_SIZE):
            unused.append(("hires.base_size", "base_size and base_steps are for a txt2img base, which image replaces"))
        if unused:
            field, why = unused[0]
            raise FlowliftError(f"{field}: {why}; drop it", field=field)

    @property
    def mode_strength(self) -> float:
        """The strength this mode runs at: the request's, else the knob's default (outpaint: 1, a new border)."""
        if self.strength is not None:
            return self.strength
        return OUTPAINT_STRENGTH if self.mode == "outpaint" else STRENGTH.default

    @property
    def name_suffix(self) -> str:
        """The default output's suffix: ``img2img``, ``outpaint``, ``hires<N>x`` (``<stem>_<suffix>.png``)."""
        if self.mode == "hires":
            return f"hires{self.hires.scale:g}x"
        return "img2img" if self.mode == "inpaint" else self.mode
