"""Files that belong together (a report's table, data and figures) replaced as one set.

:func:`flowlift.files.atomic.atomic_output` keeps each file whole, but a report written file by file and stopped
between two of them (Ctrl-C, a scheduler's SIGTERM) left the first new file alone, or beside the previous run's
others: a figure that disagrees with the table next to it. :func:`atomic_write_set` writes every file to its own
temporary first (the same locked temporary folders, so a killed run's are swept the same way), then renames them
all in one short section during which the stop signals (:data:`flowlift.stop_signals.STOP_SIGNALS`) wait
(:func:`deferred_stop_signals`) and are delivered the moment it ends: a stop leaves the previous set or the new one,
never a mix, and no temporary behind.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from flowlift.errors import FlowliftError
from flowlift.files.atomic import (
    DATA_NAME,
    close_temporary,
    fsync_directory,
    open_temporary,
    replace_refusal,
    seal_temporary,
    write_error,
)
from flowlift.stop_signals import STOP_SIGNALS, taken_stop_signals

__all__ = ["atomic_write_set", "deferred_stop_signals"]


@contextmanager
def deferred_stop_signals() -> Iterator[None]:
    """The stop signals (:func:`flowlift.stop_signals.taken_stop_signals`: SIGINT, SIGTERM, and SIGHUP unless
    ``nohup`` ignores it) held while the block runs and delivered, to the handlers they would have met, right after.

    The main thread's handlers are swapped for one that only notes the signal: blocking the signals with
    ``pthread_sigmask`` alone would not hold them, since the kernel hands a process's signal to any thread that does
    not block it (torch's worker threads) and Python then runs the handler in the main thread all the same. Putting
    the handlers back happens with the signals blocked in this thread (``commands/cli.py`` does the same), so none
    lands between the two. Off the main thread no Python handler runs where the block runs: it runs as it is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []

    def note(signum, frame) -> None:
        if len(noted) < 2:  # a second one is kept too: a handler that stops gracefully on the first (training's)
            noted.append(signum)  # takes the second as the user insisting

    previous = {}
    try:
        for signum in taken_stop_signals():
            previous[signum] = signal.signal(signum, note)
        yield
    finally:
        can_block = hasattr(signal, "pthread_sigmask")  # not on Windows
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS) if can_block else None
        try:
            for signum, handler in previous.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        finally:
            if can_block:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        for signum in noted:  # the stop the block held, now that it is over (KeyboardInterrupt, or the default action)
            signal.raise_signal(signum)


def _staged(path: Path, data: bytes) -> tuple[Path, int]:
    """``data`` written and flushed to a new temporary beside ``path``: ``(its folder, its lock's descriptor)``."""
    folder, descriptor = open_temporary(path)
    try:
        (folder / DATA_NAME).write_bytes(data)
        seal_temporary(folder / DATA_NAME)
    except BaseException as error:
        close_temporary(folder, descriptor)
        if isinstance(error, Exception) and (failure := write_error(path, error)) is not error:
            raise failure from error
        raise
    return folder, descriptor


def _put_in_place(staged: dict[Path, tuple[Path, int]], removed: list[Path]) -> None:
    """Every staged temporary renamed to its name and every name of ``removed`` deleted, each checked first (a link,
    FIFO or folder that took a name meanwhile refuses the whole set before anything moves)."""
    for path in [*staged, *removed]:
        if refusal := replace_refusal(path):
            raise FlowliftError(refusal)
    for path, (folder, _) in staged.items():
        try:
            os.replace(folder / DATA_NAME, path)
        except OSError as error:
            failure = write_error(path, error)  # one line naming the file and the reason
            if failure is error:
                raise
            raise failure from error
    for path in removed:
        path.unlink(missing_ok=True)
    for parent in dict.fromkeys(path.parent for path in [*staged, *removed]):
        fsync_directory(parent)


def atomic_write_set(files: Mapping[str | os.PathLike, bytes | None]) -> list[Path]:
    """Replace every name of ``files`` (name -> its new bytes) together; a name given ``None`` is no longer part of the
    set and is removed with the rest (an earlier run's file there would sit beside the new set).

    Every file is written and flushed to its temporary first: an error or a stop there leaves every name as it was
    and removes the temporaries. Then the renames run with the stop signals held (:func:`deferred_stop_signals`),
    so a stop is delivered only once the whole new set is in place (the names are checked before the first rename;
    a failure of the file system between two renames in one folder is the one way left to a mix). Returns the paths
    written.
    """
    named = {Path(name): data for name, data in files.items()}
    staged: dict[Path, tuple[Path, int]] = {}
    try:
        for path, data in named.items():
            if data is not None:
                staged[path] = _staged(path, data)
        with deferred_stop_signals():
            try:
                _put_in_place(staged, [path for path, data in named.items() if data is None])
            finally:
                while staged:  # inside the held section: the stop comes after the clean-up too
                    close_temporary(*staged.popitem()[1])
    finally:
        while staged:
            close_temporary(*staged.popitem()[1])
    return [path for path, data in named.items() if data is not None]
