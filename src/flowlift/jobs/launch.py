"""A flowlift command on many processes and hosts through torch.distributed's elastic launch API
(the agent ``torchrun`` runs), with the job's outcome as the exit status: ``flowlift launch``.

Plain ``torchrun`` knows a worker only by its exit status. Any non-zero one is a crash to it: it
restarts the whole group for it (``--max-restarts``) and then prints a ``ChildFailedError``
traceback. So under plain ``torchrun`` a rank that carried the job to its end exits 0 also when
images failed (:mod:`flowlift.jobs.scaleout`), and the summary, the manifest and ``--status`` tell.
This launcher starts the same workers with a Python function as the entrypoint instead of a
command, so that each worker hands its command's exit status back as a *value*:

* a worker process succeeds whenever its command finished -- done, images failed, a user error,
  interrupted; only a crash (an exception flowlift does not turn into one line, a signal, a kill)
  fails the process, and only that makes the agent restart the group, up to ``--max-restarts``;
* the launcher exits with the highest value of its node's workers: 0 done, 1 an image failed (or
  the ranks' summary could not be made), 2 a user error, 130 interrupted -- the workers print the
  one line each, the launcher adds no traceback;
* a crash the restarts did not cure is one line per failed rank (what it raised, or its signal) and
  exit status :data:`CRASHED`; a worker's own traceback (a programming error) is printed above it.

The launcher's options are torchrun's, handed to torchrun's own parser and configuration
(``torch.distributed.run``), so they mean exactly what they mean there.
"""

from __future__ import annotations

import logging
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flowlift.errors import FlowliftError

#: Exit status of ``flowlift launch`` when a rank crashed and the restarts (if any) did not cure it.
CRASHED = 3


def launch_config(options: Sequence[str]) -> Any:
    """The ``LaunchConfig`` that ``torchrun OPTIONS`` would run with, built by torchrun's own parser and
    ``config_from_args``, including its rule that a single node without a rendezvous endpoint gets a
    local c10d rendezvous on a free port (``--standalone``). Bad options: one :class:`FlowliftError` line."""
    import torch.distributed.run as torchrun

    parser = torchrun.get_args_parser()
    parser.prog = "flowlift launch"

    def refuse(message: str) -> None:
        raise FlowliftError(f"launcher options: {message}")

    parser.error = refuse  # type: ignore[method-assign]  # one line, not argparse's usage and exit
    args = parser.parse_args([*options, "flowlift"])  # the script argument is unused: workers run a function
    try:
        _, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
        local = args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None
        if args.standalone or (local and max_nodes == 1):
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
        if args.master_port is None:
            args.master_port = 29500
        config, _command, _arguments = torchrun.config_from_args(args)
    except (AssertionError, ValueError, RuntimeError) as error:
        raise FlowliftError(f"launcher options: {_first_line(error)}") from None
    return config


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
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    if quiet:
        _quiet_agent_logs()
    config = launch_config(options)
    try:
        values = elastic_launch(config, worker)(list(argv))
    except ChildFailedError as error:
        for rank, failure in sorted(error.failures.items()):
            print(f"{command}: rank {rank} crashed ({_cause(failure)}); "
                  f"{config.max_restarts} restart(s) did not help", file=sys.stderr)  # fmt: skip
        return CRASHED
    except SignalException:
        print(f"{command}: interrupted", file=sys.stderr)
        return 130
    except RendezvousError as error:
        raise FlowliftError(f"the ranks could not meet: {_first_line(error)}") from None
    return job_status(values)


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
    text = _first_line(message) if message and "pytorch.org/docs" not in str(message) else ""
    return f"exit code {failure.exitcode}" + (f": {text}" if text else "")


def _first_line(error: object) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(error).__name__
