"""What the training loop runs beside its steps: batches read ahead on a thread, and the stop a signal asks for.

:func:`prefetched_batches` yields exactly what reading :class:`~flowlift.training.shards.ShardStream` in the loop
would (the stream is a pure function of its arguments); :class:`StopRequest` turns the first stop signal (SIGINT,
SIGTERM or SIGHUP: :data:`flowlift.stop_signals.STOP_SIGNALS`) into a stop after the current step (with a
checkpoint) and a second one into an interrupt at once.
"""

from __future__ import annotations

from typing import Any

from flowlift.training.shards import ShardStream


def prefetched_batches(stream: ShardStream, start_step: int, end_step: int, micro_batches: int, depth: int = 2):
    """Yield ``(step, micro, batch)`` in order, reading up to ``depth`` batches ahead on one
    background thread (the stream is a pure function of its arguments, so order and content are
    exactly those of reading in the loop)."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    keys = ((step, micro) for step in range(start_step, end_step) for micro in range(micro_batches))
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="flowlift-data") as pool:
        pending: deque = deque()
        for key in keys:
            pending.append((key, pool.submit(stream.batch, *key)))
            if len(pending) > depth:
                (step, micro), future = pending.popleft()
                yield step, micro, future.result()
        while pending:
            (step, micro), future = pending.popleft()
            yield step, micro, future.result()


class StopRequest:
    """SIGINT/SIGTERM/SIGHUP (a closed terminal) during training: the first one asks the loop to stop after the
    current step (with a checkpoint); a second one interrupts at once. A SIGHUP inherited as ignored (``nohup``) stays
    ignored. Handlers are restored on exit."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> StopRequest:
        import signal
        import threading

        from flowlift.stop_signals import taken_stop_signals

        if threading.current_thread() is threading.main_thread():
            for signum in taken_stop_signals():  # not a SIGHUP nohup ignores: the run outlives its terminal, as asked
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        import signal

        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
