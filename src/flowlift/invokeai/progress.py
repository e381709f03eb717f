"""Progress and cancellation of a node's run, through InvokeAI's invocation context.

The pipeline reports every stage (encode, each pass, decode, colour fix) and, in chunked passes, every
row strip; :class:`NodeProgress` turns those into InvokeAI progress events (message, with the time left of
:mod:`flowlift.progress`, and percentage in the queue's progress bar) and is the cancel point: when the
queue item has been cancelled it raises InvokeAI's ``CanceledException``, the exception its own denoising
callbacks raise, which ends the node without an error and leaves the item "canceled".
"""

from __future__ import annotations

from collections.abc import Sequence

# invocation_api exports the cancel check (``context.util.is_canceled``) but not the exception that
# makes the session runner treat the stop as a cancel rather than a failure; this is where 6.x keeps it.
from invokeai.app.services.session_processor.session_processor_common import CanceledException
from invokeai.invocation_api import InvocationContext

from flowlift.console import format_seconds
from flowlift.progress import StageParts


class NodeProgress:
    """``stages`` parts of one progress bar titled ``title`` (``work``: their relative weights, default equal);
    strips move it within the current part. The parts are the stages of a :class:`flowlift.progress.StageParts`
    (the one progress model of every door): each event names the stage and, once this run measured its speed,
    the time left."""

    STEPS = 100  # at most this many progress events per stage

    def __init__(
        self, context: InvocationContext, title: str, stages: int, work: Sequence[float] | None = None
    ) -> None:
        self.context = context
        self.title = title
        self.parts = StageParts(stages, work)
        self.last_step = -1
        self.check_cancel()

    def check_cancel(self) -> None:
        """Stop here (InvokeAI's CanceledException) when the queue item was cancelled."""
        if self.context.util.is_canceled():
            raise CanceledException

    def _signal(self, message: str) -> None:
        state = self.parts.run.state()
        step = int(self.STEPS * self.parts.count * state.fraction)
        if step != self.last_step:
            self.last_step = step
            left = f", about {format_seconds(state.left)} left" if state.left is not None else ""
            self.context.util.signal_progress(f"{self.title}: {message}{left}", min(1.0, max(0.0, state.fraction)))

    def begin(self, message: str) -> None:
        """Announce the stage about to run."""
        self.check_cancel()
        self._signal(message)

    def strip(self, done: int, total: int) -> None:
        """After each row strip of a chunked pass (the executor's ``on_strip``)."""
        self.check_cancel()
        self.parts.strip(done, total)
        self._signal(f"{self.parts.name(self.parts.done)}, strip {done}/{total}")

    def tile(self, done: int, total: int) -> None:
        """After each tile of the VAE's decode (the pipeline's ``on_decode_tile``): a long decode moves the bar and
        its time left, where the estimate was the passes' rate. The last tile is said by the stage's "decode done"."""
        self.check_cancel()
        self.parts.strip(done, total)
        if done < total:
            self._signal(f"decode, tile {done}/{total}")

    def stage(self, finished: str = "") -> None:
        """After each stage (the pipeline's ``callback``)."""
        self.parts.finished()
        self.check_cancel()
        self._signal(f"{finished} done" if finished else "working")
