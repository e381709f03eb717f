"""One progress bar per request, read from :mod:`flowlift.progress`: the stage by name, its steps, the time left.

Every request (Upscale, Batch, Refine) makes one :class:`~flowlift.progress.RunProgress` the moment the handler
starts (:func:`request_progress`), before any model loads, and makes it the thread's active run: the pipelines'
reports (loading, encode, each pass or refine step, decode tiles, colour fix, writing) reach it, and every report
is handed to the page's bar as ``(fraction, description)``, e.g. ``photo.png: decode, tile 3/12, about 40 s left``.
The time left is this request's own (never learned from earlier requests under other loads). Pure Python, no
Gradio: :mod:`flowlift.app.page` hands the reports to ``gr.Progress``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from flowlift.console import format_seconds
from flowlift.progress import ProgressState, RunProgress

#: Progress reporter: ``progress(fraction_done, description)``.
ProgressFn = Callable[[float, str], None]
#: A request's stop check: returns while the request may go on, raises :class:`RequestStopped` once it was stopped.
StopCheck = Callable[[], None]


class RequestStopped(Exception):
    """A request stopped by its user (the page's Stop, a client's cancel) while its handler still ran: not an error
    of the image, so never one of :data:`flowlift.errors.ITEM_ERRORS` (a batch does not go on past it)."""


def describe(state: ProgressState) -> str:
    """The bar's words: what runs now and, once this request measured its speed, the time left."""
    left = f", about {format_seconds(state.left)} left" if state.left is not None else ""
    return state.what() + left


def request_progress(report: ProgressFn) -> RunProgress:
    """A run for one request whose every report goes to ``report(fraction, description)`` (the page's bar)."""
    run = RunProgress()
    run.subscribe(lambda state: report(state.fraction, describe(state)))
    return run


class OneRun:
    """The page's model requests one at a time, each stoppable: ``with one_run(stop):`` waits for the request before
    it to end (Gradio frees a cancelled request's queue slot while its handler's thread still runs, and the next
    must not run beside it: two runs on one GPU), then makes ``stop`` (raises :class:`RequestStopped` once the
    request was stopped) the one :meth:`check` answers: the upscale pipelines' ``check_interrupt``, asked before
    every layer. The handler also asks it at every progress report."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stop: StopCheck | None = None
        self._closing = False

    @contextmanager
    def __call__(self, stop: StopCheck | None = None) -> Iterator[None]:
        with self._lock:
            self._stop = stop
            try:
                self.check()  # stopped while it waited: nothing runs
                yield
            finally:
                self._stop = None

    def check(self) -> None:
        """The running request's stop check; nothing when none runs."""
        if self._closing:
            raise RequestStopped("the server is stopping")
        if self._stop is not None:
            self._stop()

    def close(self, timeout: float) -> bool:
        """Stop the running request (the server's Ctrl-C/SIGTERM) and wait up to ``timeout`` seconds for it to end;
        True when none runs any more. The process must not exit while a handler's thread is inside torch (the C++
        runtime aborts it: exit 134 instead of 130)."""
        self._closing = True
        if self._lock.acquire(timeout=timeout):
            self._lock.release()
            return True
        return False
