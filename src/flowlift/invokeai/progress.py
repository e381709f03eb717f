"""Progress and cancellation of a node's run, through InvokeAI's invocation context.

The pipeline reports every stage (encode, each pass, decode, colour fix) and, in chunked passes, every
row strip; :class:`NodeProgress` turns those into InvokeAI progress events (message and percentage in
the queue's progress bar) and is the cancel point: when the queue item has been cancelled it raises
InvokeAI's ``CanceledException``, the exception its own denoising callbacks raise, which ends the node
without an error and leaves the item "canceled".
"""

from __future__ import annotations

# invocation_api exports the cancel check (``context.util.is_canceled``) but not the exception that
# makes the session runner treat the stop as a cancel rather than a failure; this is where 6.x keeps it.
from invokeai.app.services.session_processor.session_processor_common import CanceledException
from invokeai.invocation_api import InvocationContext


class NodeProgress:
    """``stages`` equal parts of one progress bar titled ``title``; strips move it within the current part."""

    STEPS = 100  # at most this many progress events per stage

    def __init__(self, context: InvocationContext, title: str, stages: int) -> None:
        self.context = context
        self.title = title
        self.stages = max(1, stages)
        self.done = 0
        self.last_step = -1
        self.check_cancel()

    def check_cancel(self) -> None:
        """Stop here (InvokeAI's CanceledException) when the queue item was cancelled."""
        if self.context.util.is_canceled():
            raise CanceledException

    def _signal(self, message: str, fraction: float) -> None:
        step = int(self.STEPS * self.stages * fraction)
        if step != self.last_step:
            self.last_step = step
            self.context.util.signal_progress(f"{self.title}: {message}", min(1.0, max(0.0, fraction)))

    def begin(self, message: str) -> None:
        """Announce the stage about to run."""
        self.check_cancel()
        self._signal(message, self.done / self.stages)

    def strip(self, done: int, total: int) -> None:
        """After each row strip of a chunked pass (the executor's ``on_strip``)."""
        self.check_cancel()
        self._signal(f"stage {self.done + 1}/{self.stages}, strip {done}/{total}",
                     (self.done + done / max(1, total)) / self.stages)  # fmt: skip

    def stage(self, finished: str = "") -> None:
        """After each stage (the pipeline's ``callback``)."""
        self.done += 1
        self.check_cancel()
        self._signal(f"{finished} done" if finished else "working", self.done / self.stages)
