"""A flowlift command on many processes and hosts through torch.distributed's elastic launch API
(the agent ``torchrun`` runs), with the job's outcome as the exit status: ``flowlift launch``.

Plain ``torchrun`` knows a worker only by its exit status. Any non-zero one is a crash to it: it
restarts the whole group for it (``--max-restarts``) and then prints a ``ChildFailedError``
traceback. So under plain ``torchrun`` a rank that carried the job to its end exits 0 also when
images failed (:mod:`flowlift.jobs.scaleout`), and the summary, the manifest and ``--status`` tell.
This launcher starts the same workers with a Python function as the entrypoint instead of a
command, so that each worker hands its command's exit status back as a *value*:

* a worker process succeeds whenever its command finished -- done, images failed, a user error;
  only a crash (an exception flowlift does not turn into one line, a fatal signal such as SIGSEGV)
  makes the agent restart the group, up to ``--max-restarts``;
* a rank stopped from outside (SIGINT, SIGTERM, SIGHUP, SIGKILL, SIGQUIT: :data:`RANK_STOP_SIGNALS`), or the
  launcher stopped by one of :data:`AGENT_STOP_SIGNALS`, ends the whole run without a restart: exit status 130 and one
  line naming the signal (torch's agent is run with that one change, :func:`_no_restart_after_a_stop`);
* the launcher exits with the highest value of its node's workers: 0 done, 1 an image failed (or
  the ranks' summary could not be made), 2 a user error, 130 interrupted -- the workers print the
  one line each, the launcher adds no traceback;
* a crash the restarts did not cure is one line per failed rank (what it raised, or its signal) and
  exit status :data:`CRASHED`; a worker's own traceback (a programming error) is printed above it.

The launcher's options are torchrun's, handed to torchrun's own parser and configuration
(``torch.distributed.run``), so they mean exactly what they mean there.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from flowlift.errors import FlowliftError
from flowlift.jobs.group_start import end_overdue_joins, watched_starts
from flowlift.jobs.launch_options import check_rendezvous_host, first_line, launch_config
from flowlift.stop_signals import STOP_SIGNALS

#: Exit status of ``flowlift launch`` when a rank crashed and the restarts (if any) did not cure it.
CRASHED = 3
#: Exit status of an interrupted command (a stop signal), a worker's and the launcher's.
INTERRUPTED = 130
#: Signals by which a user or a scheduler stops a run: a command's stop signals (Ctrl-C, kill, a closed terminal),
#: and kill -9 and SIGQUIT, which no rank catches: a rank that ended by one was stopped, not crashed, and the run ends
#: without a restart. A fatal signal of the program's own (SIGSEGV, SIGABRT, SIGBUS, ...) is a crash, restarted up
#: to ``--max-restarts``.
RANK_STOP_SIGNALS = (*STOP_SIGNALS, signal.SIGKILL, signal.SIGQUIT)
#: Seconds the agent waits for its ranks after passing on a stop signal before it kills them (torch waits 30):
#: a rank ends within a second of SIGTERM unless it is blocked inside a C++ collective, which takes the signal
#: only when the call returns; its outputs are written atomically, so a kill leaves nothing partial behind.
STOP_GRACE_S = 5
#: The signals torch's agent stops its ranks for (``TORCHELASTIC_SIGNALS_TO_HANDLE``'s default): the launcher takes the
#: first of them and ignores the rest (:class:`_FirstStop`).
AGENT_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
#: Seconds a rank may run on after another returned a failing outcome (2, 130) before the agent ends it: ranks stop
#: together, so one still running waits in a collective for the rank that left (gloo's timeout: 30 minutes).
LEFT_BEHIND_GRACE_S = 10


def stop_signal_name(exitcode: int | None) -> str | None:
    """The stop signal a worker process ended by, from its exit code, or ``None`` when it did not.

    A negative exit code -N is the signal N that killed the process (multiprocessing's convention); a
    flowlift rank that caught one of its stop signals (:data:`flowlift.stop_signals.STOP_SIGNALS`) and ran its
    clean-up exits with the shell's 128 + N (130, 143, 129: :func:`flowlift.commands.launch.run_worker`)."""
    if exitcode is None:
        return None
    if exitcode < 0:
        return next((s.name for s in RANK_STOP_SIGNALS if s == -exitcode), None)
    return next((s.name for s in STOP_SIGNALS if s == exitcode - 128), None)


def launch(
    worker: Callable[[list[str]], int],
    argv: Sequence[str],
    options: Sequence[str],
    command: str,
    quiet: bool = True,
) -> int:
    """Run ``worker(argv)`` on every local rank of the job ``options`` describe; the exit status.

    ``worker`` must be a module-level function (the workers are spawned) that returns its command's
    exit status. ``command`` names the launcher in its own lines (``flowlift launch``). ``quiet``:
    the agent's log records below ERROR (thread defaults, workers being closed) are dropped; a
    crash's record and traceback remain.
    """
    import torch.distributed.run  # noqa: F401 - its logger, like the agent's, exists once imported
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    if quiet:
        _quiet_agent_logs()
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # the ranks' c10d socket warnings on a timeout
    _drop_interrupted_worker_logs()
    config = launch_config(options)
    check_rendezvous_host(config.rdzv_endpoint)
    suspended: dict[int, int] = {}  # global rank -> pid of a suspended rank the agent ended
    left_behind: dict[int, int] = {}  # global rank -> the failing outcome it was ended after
    unjoined: dict[int, float] = {}  # global rank -> the timeout of the group's start it was ended past
    stops = _FirstStop(SignalException)
    try:
        with _no_restart_after_a_stop(suspended, left_behind, stops, unjoined), stops, watched_starts():
            values = elastic_launch(config, _quiet_start(worker))(list(argv))
    except ChildFailedError as error:
        if unjoined and set(error.failures) <= set(unjoined):
            ranks = ", ".join(f"rank {rank}" for rank in sorted(error.failures))
            print(
                f"{command}: {ranks} could not join the process group within its --barrier-timeout "
                f"({max(unjoined[rank] for rank in error.failures):.0f} s) and was ended; the job did not start "
                "(gloo's connection set-up can block after a restart: run the command again)",
                file=sys.stderr,
            )
            return 1
        if left_behind and set(error.failures) <= set(left_behind):
            ranks = ", ".join(f"rank {rank}" for rank in sorted(error.failures))
            outcome = max(left_behind[rank] for rank in error.failures)
            print(
                f"{command}: {ranks} ended {LEFT_BEHIND_GRACE_S} s after another rank stopped the job (exit status "
                f"{outcome}, its line above): it was waiting for that rank",
                file=sys.stderr,
            )
            return outcome
        if suspended and set(error.failures) <= set(suspended):
            ranks = ", ".join(f"rank {rank}" for rank in sorted(error.failures))
            print(
                f"{command}: {ranks} stayed suspended (SIGSTOP) after the other ranks ended, and was ended; "
                "the job did not finish (see their lines)",
                file=sys.stderr,
            )
            return 1
        stops = {rank: stop_signal_name(failure.exitcode) for rank, failure in sorted(error.failures.items())}
        if all(stops.values()):
            # a rank stopped from outside (a user's kill, Ctrl-C, a scheduler, the OOM killer): not a crash
            how = ", ".join(
                f"rank {rank} {'killed' if error.failures[rank].exitcode < 0 else 'stopped'} by {name}"
                for rank, name in stops.items()
            )
            print(f"{command}: interrupted ({how})", file=sys.stderr)
            return INTERRUPTED
        for rank, failure in sorted(error.failures.items()):
            print(
                f"{command}: rank {rank} crashed ({_cause(failure)}); {config.max_restarts} restart(s) did not help",
                file=sys.stderr,
            )
        return CRASHED
    except SignalException as stop:  # the launcher itself was stopped: the agent has stopped the ranks
        print(f"{command}: interrupted by {signal.Signals(stops.signum or stop.sigval).name}", file=sys.stderr)
        return INTERRUPTED
    except (RendezvousError, DistError) as error:  # the static rendezvous' store times out as a DistStoreError
        wait = config.rdzv_configs.get("join_timeout", config.rdzv_configs.get("timeout"))
        detail = first_line(error) if str(error).strip() else f"not all nodes joined within {wait} s"
        raise FlowliftError(f"the ranks could not meet: {detail}") from None
    return job_status(values)


class _FirstStop:
    """The launcher's handler of :data:`AGENT_STOP_SIGNALS`, in place of torch's: each raises torch's
    ``SignalException`` until the agent ends its ranks (``stopping``, set by :func:`_stop_aware_agent`'s
    ``_shutdown``), then they are ignored; the line names the first (``signum``). torch's raised again for each
    signal of a burst: out of the agent's shutdown (no SIGKILL after the grace: ranks left running), out of the
    launcher's clean-up or an exit callback (a traceback, 143). When the run is over (:meth:`__exit__`), without a
    stop the caller's handlers come back; after one the signals stay ignored to the process's end
    (:func:`flowlift.devices.end_before_native_teardown`: the interpreter's teardown would restore SIG_DFL)."""

    def __init__(self, raises: type[BaseException]) -> None:
        self.raises = raises  # torch's SignalException: the agent and torch's launcher handle it
        self.signum: int | None = None  # the first stop signal taken
        self.stopping = self.over = False
        self.previous: dict[int, Any] = {}

    def __call__(self, signum: int, frame: object) -> None:
        if self.stopping or self.over:
            return  # the agent is ending the ranks already (SIGKILL after STOP_GRACE_S), or the run is over
        self.signum = signum if self.signum is None else self.signum
        raise self.raises(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    def install(self) -> None:
        """Take the stop signals (again, after torch's ``PContext.start`` registered its handler for them)."""
        if threading.current_thread() is not threading.main_thread():
            return  # torch registers none off the main thread either
        for signum in AGENT_STOP_SIGNALS:
            self.previous.setdefault(signum, signal.signal(signum, self))

    def __enter__(self) -> None:
        self.install()

    def __exit__(self, *exc: object) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self.over = True
        if self.signum is not None:
            from flowlift.devices import end_before_native_teardown

            for signum in AGENT_STOP_SIGNALS:  # not in __call__: a signal pending then was "ignored due to race"
                signal.signal(signum, signal.SIG_IGN)
            end_before_native_teardown()
            return
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, AGENT_STOP_SIGNALS)  # one now waits for the caller's
        try:
            for signum, handler in self.previous.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


@contextmanager
def _no_restart_after_a_stop(
    suspended: dict[int, int],
    left_behind: dict[int, int],
    stops: _FirstStop | None = None,
    unjoined: dict[int, float] | None = None,
) -> Iterator[None]:
    """While torch's ``launch_agent`` runs, the agent it builds is :func:`_stop_aware_agent`'s: a rank that
    ended by a stop signal ends the run instead of restarting the group (``--max-restarts`` is for crashes).

    ``launch_agent`` offers no way to choose its agent class and builds it by its module's name
    ``LocalElasticAgent``; that name is swapped for the subclass here and put back after (the launcher's own
    process; tests/test_launch_options.py fails if a restart follows a stop, e.g. when torch changes this).
    """
    import torch.distributed.launcher.api as launcher_api

    original = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = _stop_aware_agent(original, suspended, left_behind, stops, unjoined)
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = original


def _stop_aware_agent(
    base: type,
    suspended: dict[int, int],
    left_behind: dict[int, int] | None = None,
    stops: _FirstStop | None = None,
    unjoined: dict[int, float] | None = None,
) -> type:
    left_behind = {} if left_behind is None else left_behind

    class StopAwareAgent(base):  # type: ignore[misc, valid-type]
        """torch's local agent, which gives up its remaining restarts when a rank was stopped by a signal (as
        torch's own agent does for a worker stuck in uninterruptible sleep), ends a rank suspended (SIGSTOP) once
        every other local rank has returned (``suspended``), the ranks still running
        :data:`LEFT_BEHIND_GRACE_S` after a rank returned a failing outcome (``left_behind``), and the ranks
        still joining their group past its timeout (``unjoined``, :mod:`flowlift.jobs.group_start`)."""

        _failed_since: float | None = None
        _restarting = False

        def _start_workers(self, worker_group: Any) -> Any:
            # A rank spends seconds in Python's start-up and torch's import before any code of flowlift's
            # runs, and SIGINT there printed a KeyboardInterrupt traceback (from inside `site`, a "Fatal
            # Python error": a crash to the agent). The ranks are started with SIGINT blocked (a spawned
            # process inherits the mask) and take it in _rank_entry. The resource tracker runs first:
            # starting it unblocks SIGINT in this process. torch's PContext.start registers its own handler of
            # the stop signals meanwhile: they stay blocked until the launcher's is back (_FirstStop).
            from multiprocessing import resource_tracker

            resource_tracker.ensure_running()
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, AGENT_STOP_SIGNALS)
            try:
                return super()._start_workers(worker_group)
            finally:
                if stops is not None:
                    stops.install()
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)

        def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30, **rest: Any) -> None:
            from torch.distributed.elastic.multiprocessing import SignalException

            if stops is not None:  # the run ends, unless a crash restarts the group: a stop then still stops it
                stops.stopping = not self._restarting
            try:
                super()._shutdown(death_sig, min(timeout, STOP_GRACE_S), **rest)  # a stop within seconds, not 30 s
            except SignalException as stop:  # the ranks are ended all the same, then the run
                if stops is not None:
                    stops.stopping = True
                super()._shutdown(stop.sigval, STOP_GRACE_S, **rest)
                raise

        def _stop_workers(self, worker_group: Any) -> None:  # before a restart (torch's calls _shutdown)
            self._restarting = True
            try:
                super()._stop_workers(worker_group)
            finally:
                self._restarting = False

        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            if result.is_failed() and any(stop_signal_name(f.exitcode) for f in result.failures.values()):
                self._remaining_restarts = 0  # a restart would undo the stop the user (or the system) asked for
            elif result.state.name == "HEALTHY":
                self._end_suspended_ranks(worker_group)
                self._end_ranks_left_behind(worker_group)
                if unjoined is not None and end_overdue_joins(worker_group.workers, unjoined):
                    self._remaining_restarts = 0  # ended blocked in gloo's set-up: a restart could block again
            return result

        def _end_ranks_left_behind(self, worker_group: Any) -> None:  # after a user error only one rank met
            returned = getattr(self._pcontext, "_return_values", None)
            failing = [v for v in (returned or {}).values() if isinstance(v, int) and not isinstance(v, bool) and v > 1]
            if not failing:
                return
            if self._failed_since is None:
                self._failed_since = time.monotonic()
            if time.monotonic() - self._failed_since < LEFT_BEHIND_GRACE_S:
                return
            for rank, w in enumerate(worker_group.workers):
                if rank not in returned and w.id is not None and w.global_rank not in left_behind:
                    left_behind[w.global_rank] = max(failing)
                    os.kill(w.id, signal.SIGKILL)  # blocked in a C++ collective, it would not take SIGTERM
            self._remaining_restarts = 0

        def _end_suspended_ranks(self, worker_group: Any) -> None:
            # The ranks that returned gave up on the suspended one (their barrier or plan exchange timed out):
            # it can never finish, and torch's agent would wait for it forever. SIGKILL is the one signal a
            # suspended process takes; the launcher then ends as a missed barrier does (exit 1).
            returned = getattr(self._pcontext, "_return_values", None)  # torch's ranks' values, as they arrive
            if not isinstance(returned, dict) or not returned:
                return
            waiting = [(rank, w) for rank, w in enumerate(worker_group.workers) if rank not in returned]
            if waiting and all(is_suspended(w.id) for _, w in waiting):
                for _, w in waiting:
                    suspended[w.global_rank] = w.id
                    os.kill(w.id, signal.SIGKILL)
                self._remaining_restarts = 0

    return StopAwareAgent


def is_suspended(pid: int | None) -> bool:
    """Whether process ``pid`` is stopped by a job-control signal (SIGSTOP, SIGTSTP; Linux ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError, TypeError):
        return False


def _rank_entry(worker: Callable[..., Any], *args: Any) -> Any:
    """Each rank's entry point: the stop signals, blocked while the rank started (:func:`_stop_aware_agent`), are
    taken from here on; SIGINT ends the rank quietly with the shell's 130 until the command installs its own
    handler (and after it puts this one back); once the worker has returned or raised, SIGINT is ignored, so one
    arriving while the rank exits cannot raise inside an exit callback (a traceback on a finished rank)."""
    signal.signal(signal.SIGINT, _end_quietly)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, AGENT_STOP_SIGNALS)  # a stop signal sent while starting arrives now
    try:
        return worker(*args)
    finally:  # the rank's outcome is decided: a SIGINT during the interpreter's exit changes nothing, says nothing
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _end_quietly(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _quiet_start(worker: Callable[..., Any]) -> Callable[..., Any]:
    """``worker`` behind :func:`_rank_entry`, picklable like ``worker`` (a spawned rank imports it by name)."""
    return functools.update_wrapper(functools.partial(_rank_entry, worker), worker)  # torch logs its name


_EXIT_CODE = re.compile(r"\(exitcode: (-?\d+)\)")


class _NotInterrupted(logging.Filter):
    """Drops the agent's "failed (exitcode: 130)" record and its traceback (also 143, -9, ...): that worker
    was stopped by a signal, which the launcher's own line names."""

    def filter(self, record: logging.LogRecord) -> bool:
        found = _EXIT_CODE.search(record.getMessage())
        return not (found and stop_signal_name(int(found.group(1))))


def _drop_interrupted_worker_logs() -> None:
    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if not any(isinstance(f, _NotInterrupted) for f in logger.filters):
        logger.addFilter(_NotInterrupted())


def _quiet_agent_logs() -> None:
    # torch's elastic loggers each set their own level (LOGLEVEL, default WARNING) when created, so
    # the parent "torch.distributed" logger's level would not reach them: set it on each
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith(("torch.distributed", "torch.multiprocessing")) and isinstance(logger, logging.Logger):
            logger.setLevel(logging.ERROR)


def job_status(values: Mapping[int, Any]) -> int:
    """The launcher's exit status from its workers' return values: the highest, so that a user
    error (2) or an interruption (130) is not hidden behind another rank's 1."""
    codes = [value if isinstance(value, int) else CRASHED for value in values.values()]
    return max(codes, default=0)


def _cause(failure: Any) -> str:
    """What a failed worker died of, in a few words: its exception (from the elastic error file), else
    its signal or exit code."""
    message = failure.message
    if isinstance(message, Mapping):
        message = message.get("message", "")
    if failure.exitcode < 0:
        return f"signal {failure.signal_name()}"
    text = first_line(message) if message and "pytorch.org/docs" not in str(message) else ""
    return f"exit code {failure.exitcode}" + (f": {text}" if text else "")
