"""An upscale's stages for :mod:`flowlift.progress`: what each stage weighs, what loads, and the pipeline's reports.

Every door of the upscaler (the command line, the web app, a node) plans the same stages per image
(:func:`upscale_stages`), names what it loads the same way (:func:`loading_description`) and turns the pipeline's
callbacks into the run's stages with :class:`UpscaleStages`. The work of a stage is the megapixels it produces
times a planned cost per megapixel (:data:`SECONDS_PER_MP`); only the ratios matter, the run measures its own speed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowlift.progress import RunProgress

#: Planned seconds per megapixel produced by each stage kind (the input's pixels for ``encode``, the pass's output
#: for ``pass``, the result's for the rest), measured with the released UNet architecture, TAEF2 and float32 on a
#: 2-core Intel Xeon (``benchmarks/bench_app_eta.py --dtype float32 --json``, 2x of a 1024x693 photo, 2026-12-06).
#: Only their ratios matter: :class:`~flowlift.progress.RunProgress` measures this run's own seconds per unit of
#: work, so a GPU, bf16 or a loaded machine change the time left, not the ratios.
SECONDS_PER_MP = {"encode": 3.07, "pass": 4.09, "decode": 3.42, "color fix": 0.14, "writing": 0.08}
#: The colour-fix stage's resample of a decoded frame to an asked size (antialiased bicubic), per megapixel of that
#: frame: its 3x run's colour-fix stage (2.0-2.1 s for a 6.39 MP result from an 11.35 MP frame) less the colour fix
#: at the 2x rate (0.9 s), over the frame (same bench, ``--scale 3``).
RESAMPLE_SECONDS_PER_MP = 0.10
#: SesquiLSR's CPU time per megapixel it makes, as a share of a Flow pass's: 0.31 at 1.5x, 0.22 at 2x (float32,
#: 512-px input, ``benchmarks/bench_latent_upscalers.py --pixels 512``, a 2-core Intel Xeon; docs/upscale.md).
LATENT_UPSCALER_PER_PASS = 0.3


@dataclass(frozen=True)
class PlannedImage:
    """One image's upscale as planned from its header: ``name``, the ``passes`` that run, the input's megapixels,
    the output's (the asked size; None: the passes' own output, ``4**passes`` times the input) and whether SesquiLSR
    sizes its latents to the output before the decode (``latent_fraction``)."""

    name: str
    passes: int
    input_megapixels: float
    output_megapixels: float | None = None
    latent_fraction: bool = False

    def stages(self) -> list[tuple[str, float]]:
        """:func:`upscale_stages` of this image."""
        return upscale_stages(
            self.passes, self.input_megapixels, self.output_megapixels, latent_fraction=self.latent_fraction
        )


def upscale_stages(
    passes: int, input_megapixels: float, output_megapixels: float | None = None, *, latent_fraction: bool = False
) -> list[tuple[str, float]]:
    """The stages of one upscale and their work: the megapixels each produces times :data:`SECONDS_PER_MP`.

    Pass ``i`` of ``n`` makes ``4**i`` input-sized pictures. The decode makes the passes' ``4**n``, or with
    ``latent_fraction`` the output's (SesquiLSR sized the latents to it) plus SesquiLSR's own work on as many
    megapixels (it runs after the last pass's report and before the decode's: within the decode stage). The colour
    fix and the writing make the output's megapixels (``output_megapixels``, the asked size; default the passes'
    ``4**n`` times the input: a power-of-two scale); without ``latent_fraction`` an asked size is a resample of the
    decoded frame first, in the colour-fix stage (:data:`RESAMPLE_SECONDS_PER_MP` of that frame).
    """
    passes_out = 4.0**passes * input_megapixels
    output = passes_out if output_megapixels is None else output_megapixels
    decode = SECONDS_PER_MP["decode"] * passes_out
    colour = SECONDS_PER_MP["color fix"] * output
    if latent_fraction:
        decode = (SECONDS_PER_MP["decode"] + SECONDS_PER_MP["pass"] * LATENT_UPSCALER_PER_PASS) * output
    elif output != passes_out:
        colour += RESAMPLE_SECONDS_PER_MP * passes_out
    stages = [("encode", SECONDS_PER_MP["encode"] * input_megapixels)]
    stages += [(f"pass {i}/{passes}", SECONDS_PER_MP["pass"] * 4.0**i * input_megapixels) for i in range(1, passes + 1)]
    return stages + [("decode", decode), ("color fix", colour), ("writing", SECONDS_PER_MP["writing"] * output)]


def node_stage_work(
    passes: int, input_megapixels: float, output_megapixels: float | None = None, *, latent_fraction: bool = False
) -> list[float]:
    """The work of an image node's stages (encode, the passes, decode, colour fix; the host writes the image), in
    :func:`upscale_stages`' units: the weights of ComfyUI's and InvokeAI's progress bars."""
    stages = upscale_stages(passes, input_megapixels, output_megapixels, latent_fraction=latent_fraction)
    return [work for name, work in stages if name != "writing"]


def latent_node_stage_work(passes: int, input_megapixels: float, fraction_megapixels: float | None) -> list[float]:
    """The work of a latent node's stages (each pass, then SesquiLSR when ``fraction_megapixels``, the megapixels
    its latents decode to, is not None), in :func:`upscale_stages`' units: pass ``i`` makes ``4**i`` times the
    input's (``input_megapixels``: the megapixels the input latents decode to)."""
    work = [SECONDS_PER_MP["pass"] * 4.0**i * input_megapixels for i in range(1, passes + 1)]
    if fraction_megapixels is not None:
        work.append(SECONDS_PER_MP["pass"] * LATENT_UPSCALER_PER_PASS * fraction_megapixels)
    return work


def _size(paths: Sequence[Path]) -> str:
    total = 0
    for path in paths:
        with contextlib.suppress(OSError):
            total += Path(path).stat().st_size
    if not total:
        return ""
    return f"{total / 1e9:.1f} GB" if total >= 1e8 else f"{total / 1e6:.0f} MB"


def _described(what: str, paths: Sequence[Path]) -> str:
    if not paths:
        return what
    names = ", ".join(dict.fromkeys(Path(p).name for p in paths[:2])) + (", ..." if len(paths) > 2 else "")
    size = _size(paths)
    return f"{what} ({names}{', ' + size if size else ''})"


def loading_description(upscaler: Any, vae: Any, latent_upscaler: str | None = None) -> str:
    """What an upscale loads, for the first progress line: ``the Flow Upscaler (flow_upscaler.safetensors, 1.2 GB)
    and VAE mage (mage_vae.safetensors, 1.3 GB)``, with ``latent_upscaler`` (``sesqui:PATH``) ``the Flow Upscaler
    (...), VAE mage (...) and SesquiLSR (sesqui.safetensors, 12 MB)``; objects (already loaded) and unresolvable
    specs are named only."""
    from flowlift.upscale.latent_fraction import sesqui_path
    from flowlift.upscale.loading import resolve_upscaler_file, vae_spec_files

    unet, vae_files, sesqui_files = [], [], []
    if isinstance(upscaler, (str, os.PathLike)):
        with contextlib.suppress(Exception):  # a description only: the loader names what is missing
            unet = [resolve_upscaler_file(upscaler)]
    if isinstance(vae, (str, os.PathLike)):
        with contextlib.suppress(Exception):
            vae_files = vae_spec_files(os.fspath(vae))
    if latent_upscaler is not None:
        with contextlib.suppress(Exception):
            sesqui_files = [path] if (path := sesqui_path(latent_upscaler)).is_file() else []
    vae_name = f"VAE {os.fspath(vae)}" if isinstance(vae, (str, os.PathLike)) else "the VAE"
    parts = [_described("the Flow Upscaler", unet), _described(vae_name, vae_files)]
    if latent_upscaler is not None:
        parts.append(_described("SesquiLSR", sesqui_files))
    return f"{', '.join(parts[:-1])} and {parts[-1]}"


class UpscaleStages:
    """The pipeline's callbacks as stages of ``run``: :meth:`image` plans (once) and opens one image's stages,
    :meth:`stage` is ``upscale_image``'s ``callback`` (after each stage), :meth:`decode_tile` its ``on_decode_tile``.
    An image that fails or is skipped is dropped from the plan, so the time left never counts it."""

    def __init__(self, run: RunProgress) -> None:
        self.run = run

    def expect(self, images: Sequence[PlannedImage]) -> None:
        """Plan ``images``, in the order they will run."""
        self.run.plan([(f"{image.name}: {stage}", work) for image in images for stage, work in image.stages()])

    @contextlib.contextmanager
    def image(self, planned: PlannedImage) -> Iterator[None]:
        """The block that upscales and writes image ``planned.name`` (planned here unless :meth:`expect` planned it)."""
        name = planned.name
        if not any(stage.name == f"{name}: encode" and stage.ended is None for stage in self.run.stages):
            self.expect([planned])
        self.run.group = name
        self.run.begin("encode")
        try:
            yield
        except BaseException:
            self.run.drop(name)
            raise
        self.run.finished("writing")

    def stage(self, finished: str) -> None:
        self.run.finished(finished)

    def decode_tile(self, done: int, total: int) -> None:
        if self.run.state().stage != f"{self.run.group}: decode":
            self.run.begin("decode")
        self.run.step(done, total)
