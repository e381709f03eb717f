"""One progress bar per request, read from :mod:`flowlift.progress`: the stage by name, its steps, the time left.

Every request (Upscale, Batch, Refine) makes one :class:`~flowlift.progress.RunProgress` the moment the handler
starts (:func:`request_progress`), before any model loads, and makes it the thread's active run: the pipelines'
reports (loading, encode, each pass or refine step, decode tiles, colour fix, writing) reach it, and every report
is handed to the page's bar as ``(fraction, description)``, e.g. ``photo.png: decode, tile 3/12, about 40 s left``.
The time left is this request's own (never learned from earlier requests under other loads). Pure Python, no
Gradio: :mod:`flowlift.app.page` hands the reports to ``gr.Progress``.
"""

from __future__ import annotations

from collections.abc import Callable

from flowlift.progress import ProgressState, RunProgress, format_seconds

#: Progress reporter: ``progress(fraction_done, description)``.
ProgressFn = Callable[[float, str], None]

#: The stages of a refine and their planned seconds per megapixel (``steps``: per step; only the ratios matter,
#: the request measures its own speed): FLUX.2 VAE encode and decode, a transformer step, the hires fix's
#: Flow Upscaler passes (per megapixel of the upscaled latent's picture), writing the file.
REFINE_SECONDS_PER_MP = {"encode": 2.82, "upscale": 4.17, "steps": 10.0, "decode": 3.61, "writing": 0.14}


def describe(state: ProgressState) -> str:
    """The bar's words: what runs now and, once this request measured its speed, the time left."""
    left = f", about {format_seconds(state.left)} left" if state.left is not None else ""
    return state.what() + left


def request_progress(report: ProgressFn) -> RunProgress:
    """A run for one request whose every report goes to ``report(fraction, description)`` (the page's bar)."""
    run = RunProgress()
    run.subscribe(lambda state: report(state.fraction, describe(state)))
    return run


def refine_stages(name: str, input_mp: float, frame_mp: float, steps: int, upscale: bool) -> list[tuple[str, float]]:
    """The stages of one refine of ``name`` (an ``input_mp`` megapixel image refined at ``frame_mp``), in order::

        encode (input), [upscale (frame): the hires fix], steps (steps x frame), decode (frame), writing (frame)
    """
    cost = REFINE_SECONDS_PER_MP
    stages = [("encode", input_mp * cost["encode"])]
    stages += [("upscale", frame_mp * cost["upscale"])] if upscale else []
    stages += [("steps", max(1, steps) * frame_mp * cost["steps"]), ("decode", frame_mp * cost["decode"]),
               ("writing", frame_mp * cost["writing"])]  # fmt: skip
    return [(f"{name}: {stage}", work) for stage, work in stages]
