"""``flowlift launch``: run a flowlift command under torch.distributed's elastic agent (what ``torchrun``
runs), with the job's outcome as the exit status and restarts only for crashes.

    flowlift launch [TORCHRUN OPTIONS] -- upscale photos/ -o out/ --scale 4

The options before ``--`` are torchrun's (a common subset, handed to torchrun's own parser); the
command after it is a flowlift command that runs under ``torchrun`` (``upscale``, ``eval --run``).
Exit status: 0 done, 1 an image failed on some rank, 2 a user error, 3 a rank crashed
and the restarts did not cure it, 130 interrupted (:mod:`flowlift.jobs.launch`).
"""

from __future__ import annotations

import argparse

#: It draws no progress: no ``--progress/--no-progress`` option (flowlift.console.add_console_options).
SHOWS_PROGRESS = False
NAME = "launch"
HELP = "run a flowlift command on many processes or machines (torchrun's agent); exit status is the job's"
EXAMPLES = (
    "examples:\n"
    "  flowlift launch --nproc-per-node 8 -- upscale photos/ -o out/ --scale 4 --vae taef2\n"
    "  flowlift launch --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 \\\n"
    "      --rdzv-id job1 --max-restarts 3 -- upscale /data/photos -o /data/out --scale 4\n"
    "exit status: 0 done, 1 an image failed, 2 a user error, 3 a rank crashed (after the restarts), "
    "130 interrupted"
)

#: torchrun options offered here ((flag, torchrun's other spelling...), value name or None for a
#: switch, help); forwarded to torchrun's parser as given.
TORCHRUN_OPTIONS = (
    (("--standalone",), None, "one machine, a local rendezvous on a free port (the default for one node)"),
    (("--nnodes",), "MIN[:MAX]", "number of machines (default 1)"),
    (("--nproc-per-node", "--nproc_per_node"), "N", "processes per machine: a number, gpu, cpu or auto (default 1)"),
    (("--rdzv-backend",), "NAME", "rendezvous backend: c10d for several machines (default: torchrun's)"),
    (("--rdzv-endpoint",), "HOST:PORT", "rendezvous address, reachable from every machine (default: local)"),
    (("--rdzv-id",), "ID", "job id, the same on every machine (default: a fresh one)"),
    (("--rdzv-conf",), "K=V,...", "rendezvous settings, e.g. join_timeout=600 (default: torchrun's)"),
    (
        ("--max-restarts", "--max_restarts"),
        "N",
        "restarts of the whole group after a crash (never for failed images or a stopped rank; default 0)",
    ),
    (("--node-rank",), "N", "this machine's rank, static rendezvous (default 0)"),
    (("--master-addr",), "HOST", "rank 0's machine, static rendezvous (default: torchrun's)"),
    (("--master-port",), "PORT", "rank 0's port, static rendezvous (default: torchrun's)"),
)
#: Exit status of an interrupted command (a stop signal: SIGINT, SIGTERM, SIGHUP).
INTERRUPTED = 130
#: Commands that are no distributed job (or would nest launchers).
NOT_LAUNCHED = ("launch", "app")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("launcher (torchrun's options)")
    for names, metavar, text in TORCHRUN_OPTIONS:
        if metavar is None:
            group.add_argument(*names, action="store_true", default=None, help=text)
        else:
            group.add_argument(*names, metavar=metavar, default=None, help=text)
    parser.add_argument(
        "launched",  # not "command": the command line keeps the subcommand's name there
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND ...",
        help="the flowlift command each rank runs, e.g. -- upscale photos/ -o out/",
    )


def _forwarded(args: argparse.Namespace) -> list[str]:
    """The torchrun options given, as torchrun's command line spells them."""
    options: list[str] = []
    for (flag, *_), metavar, _ in TORCHRUN_OPTIONS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is None:
            continue
        options += [flag] if metavar is None else [flag, str(value)]
    return options


def run(args: argparse.Namespace) -> int:
    from flowlift.commands.cli import build_parser
    from flowlift.errors import FlowliftError
    from flowlift.jobs.launch import launch

    command = list(args.launched)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise FlowliftError(
            "give the flowlift command after --, e.g. flowlift launch --nproc-per-node 2 -- upscale photos/ -o out/"
        )
    if command[0] in NOT_LAUNCHED:
        raise FlowliftError(f"`flowlift {command[0]}` does not run under a launcher")
    parsed = build_parser().parse_args(command)  # a mistyped option: one error line and exit 2 here, before any rank
    if parsed._check is not None:  # a refused setting too (flowlift train's)
        parsed._check(parsed)
    return launch(run_worker, command, _forwarded(args), command=f"flowlift {NAME}", quiet=not args.verbose)


def run_worker(argv: list[str]) -> int:
    """One rank of ``flowlift launch``: the command in this process, its exit status *returned*.

    The elastic agent then sees the process succeed whenever the command finished (done, images
    failed, a user error: each reported in its own lines) and restarts the group only for a crash --
    an exception that escapes the command line, a fatal signal such as SIGSEGV. A rank stopped by
    SIGINT, SIGTERM or SIGHUP ends with 128 + the signal (130, 143, 129), and the launcher ends the run for it
    (:func:`flowlift.jobs.launch.stop_signal_name`).
    """
    import os

    from flowlift.commands import cli
    from flowlift.jobs.distributed import LAUNCH_WORKER_ENV

    os.environ[LAUNCH_WORKER_ENV] = "1"  # the ranks return the job's outcome instead of exiting 0 for torchrun
    try:
        code = cli.main(argv)
    except SystemExit as stop:  # argparse inside the command: its message is printed already
        code = stop.code if isinstance(stop.code, int) else 2
    if code == INTERRUPTED:
        # a returned value waits until the agent reads it, which an agent shutting down for Ctrl-C never
        # does (it kills the worker after its 30 s grace): end the process now, as the signal meant, with
        # the shell's 128 + signal so that the launcher can name it and knows not to restart the group
        raise SystemExit(128 + cli.stop_signal())
    return code
