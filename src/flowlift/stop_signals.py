"""Which signals stop a flowlift run: the one list that everything taking signals over reads.

The command line turns each into exit status 130 (``commands/cli.py``), ``flowlift/__init__.py`` holds them from
flowlift's first line, a report's files are renamed with them held (``files/atomic_set.py``), training turns the
first into a stop after the current step (``training/loop_support.py``) and ``flowlift launch`` knows a rank that
exited by one as stopped, not crashed (``jobs/launch.py``). A list kept in each of those places drifted: SIGHUP
stopped a command but was not held while a report's files were renamed, and it left old and new files side by side.

Imports nothing of flowlift's: ``flowlift/__init__.py`` reads it before anything else imports.
"""

from __future__ import annotations

import signal

__all__ = ["STOP_SIGNALS", "taken_stop_signals"]

#: Ctrl-C (SIGINT), a scheduler's or ``kill``'s stop (SIGTERM), and a closed terminal or dropped ssh session
#: (SIGHUP, which Windows does not have).
STOP_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGINT,
    signal.SIGTERM,
    *((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ()),
)


def taken_stop_signals() -> tuple[signal.Signals, ...]:
    """The :data:`STOP_SIGNALS` a run takes over now: all of them but a SIGHUP that is ignored, as ``nohup`` starts
    a process (the run is to outlive its terminal). An ignored SIGINT is taken all the same: a background job of a
    non-interactive shell inherits it ignored, and Ctrl-C or ``kill -INT`` must still stop it."""
    hangup = getattr(signal, "SIGHUP", None)
    return tuple(s for s in STOP_SIGNALS if s != hangup or signal.getsignal(s) is not signal.SIG_IGN)
