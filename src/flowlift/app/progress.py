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

from flowlift.console import format_seconds
from flowlift.progress import ProgressState, RunProgress

#: Progress reporter: ``progress(fraction_done, description)``.
ProgressFn = Callable[[float, str], None]


def describe(state: ProgressState) -> str:
    """The bar's words: what runs now and, once this request measured its speed, the time left."""
    left = f", about {format_seconds(state.left)} left" if state.left is not None else ""
    return state.what() + left


def request_progress(report: ProgressFn) -> RunProgress:
    """A run for one request whose every report goes to ``report(fraction, description)`` (the page's bar)."""
    run = RunProgress()
    run.subscribe(lambda state: report(state.fraction, describe(state)))
    return run
