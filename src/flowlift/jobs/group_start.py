"""A bound on a rank's start under ``flowlift launch``: a rank that cannot join its process group is ended.

Why: ``init_process_group`` takes a timeout, and most of its waits keep it, but gloo's connection set-up
(``connectFullMesh``) can block for good after a group restart (``--max-restarts``, a rank killed by SIGKILL or
SIGSEGV: measured 2-3 runs in 6 on the 2-core AMD EPYC with torch 2.13, pytorch#167288 looks the same). The rank
sits in C++, where neither its timeout nor its Python SIGTERM handler can run, and torch's agent waits for it for
ever: a run that restarts can hang.

How: the launcher makes a directory and names it in the environment its ranks inherit
(:data:`GROUP_START_DIR_ENV`, :func:`watched_starts`). A rank about to join writes ``<pid>.joining`` there, holding
the moment (``time.monotonic()``, one clock for every process of a host) by which its own timeout should have
ended the wait, and removes it once the join returned or raised (:func:`joining`). The agent, each time it looks
at its ranks, ends with SIGKILL the ones whose deadline passed :data:`JOIN_GRACE_S` ago with the file still there
(:func:`overdue_joins`): the one signal a process blocked in C++ takes. Nothing is written outside ``flowlift
launch`` (plain ``torchrun`` ranks find no directory named) and a rank that cannot write its file runs unguarded.
"""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

#: The environment variable naming the directory of the ranks' ``<pid>.joining`` files.
GROUP_START_DIR_ENV = "FLOWLIFT_GROUP_START_DIR"
#: Seconds past a rank's own join deadline before the agent ends it: its timeout, which says what happened in
#: its own line, comes first whenever it works.
JOIN_GRACE_S = 10.0


@contextmanager
def watched_starts() -> Iterator[str]:
    """The launcher's side: a fresh directory named in :data:`GROUP_START_DIR_ENV` for the run (the ranks are
    started after, and inherit it), removed with the variable afterwards; its path."""
    previous = os.environ.get(GROUP_START_DIR_ENV)
    directory = tempfile.mkdtemp(prefix="flowlift-group-start-")
    os.environ[GROUP_START_DIR_ENV] = directory
    try:
        yield directory
    finally:
        if previous is None:
            os.environ.pop(GROUP_START_DIR_ENV, None)
        else:
            os.environ[GROUP_START_DIR_ENV] = previous
        shutil.rmtree(directory, ignore_errors=True)


def _marker(directory: str, pid: int) -> str:
    return os.path.join(directory, f"{pid}.joining")


@contextmanager
def joining(timeout_s: float) -> Iterator[None]:
    """A rank's side, around its ``init_process_group(timeout=timeout_s)``: ``<pid>.joining`` holds the
    deadline ``time.monotonic() + timeout_s`` and the timeout while the join runs (see the module)."""
    directory = os.environ.get(GROUP_START_DIR_ENV)
    marker = _marker(directory, os.getpid()) if directory else None
    if marker is not None:
        try:
            with open(marker + ".tmp", "w", encoding="ascii") as file:
                file.write(f"{time.monotonic() + timeout_s!r} {timeout_s!r}\n")
            os.replace(marker + ".tmp", marker)  # the agent never reads half a line
        except OSError:
            marker = None  # the directory is gone (the launcher ended): nothing left to guard against
    try:
        yield
    finally:
        if marker is not None:
            try:
                os.remove(marker)
            except OSError:
                pass


def overdue_joins(directory: str, pids: Iterable[int], now: float | None = None) -> dict[int, float]:
    """The agent's side: ``{pid: its timeout in seconds}`` for each of ``pids`` still joining its group
    :data:`JOIN_GRACE_S` after its deadline (``now``: ``time.monotonic()`` by default)."""
    now = time.monotonic() if now is None else now
    late: dict[int, float] = {}
    for pid in pids:
        try:
            with open(_marker(directory, pid), encoding="ascii") as file:
                deadline, timeout_s = (float(word) for word in file.read().split())
        except (OSError, ValueError):
            continue  # not joining (or done: the file is removed as the join returns)
        if now > deadline + JOIN_GRACE_S:
            late[pid] = timeout_s
    return late


def end_overdue_joins(workers: Iterable[Any], ended: dict[int, float]) -> bool:
    """The agent's side: SIGKILL, the one signal a process blocked in C++ takes, to each of its ``workers`` (torch's,
    with ``id``, the pid, and ``global_rank``) overdue in :func:`overdue_joins`; each recorded in ``ended``
    (``{global rank: its timeout}``). Whether any was ended; none outside ``flowlift launch``."""
    directory = os.environ.get(GROUP_START_DIR_ENV)
    by_pid = {w.id: w for w in workers if w.id is not None}
    late = overdue_joins(directory, by_pid) if directory else {}
    for pid, timeout_s in late.items():
        ended[by_pid[pid].global_rank] = timeout_s
        os.kill(pid, signal.SIGKILL)
    return bool(late)


def join_group(backend: str, timeout: datetime.timedelta | None = None) -> None:
    """``init_process_group(backend, timeout=timeout)`` from ``torchrun``'s environment (``env://``; ``None``: the
    backend's default timeout), the group's keys in the store under this start's own prefix,
    ``flowlift/start-<TORCHELASTIC_RESTART_COUNT>/``.

    Why: under an elastic agent the ranks of every start share one store (the agent's, which outlives a restart),
    and torch names a group's keys the same in each start. A restarted rank read a dead rank's address, left by
    the start before, and gloo's connection set-up failed on it or waited past its timeout (pytorch#167288): 2 of
    3 restarts after a SIGSEGV on the 2-core AMD EPYC, 0 of 12 with the prefix."""
    import torch.distributed as dist

    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout or dist.constants.default_pg_timeout))
    start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefixed = dist.PrefixStore(f"flowlift/start-{start}/default_pg", store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world_size, timeout=timeout)
