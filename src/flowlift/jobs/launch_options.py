"""The checks of ``flowlift launch``'s torchrun options that flowlift makes itself, before torch sees them
(:func:`launch_config`): torch refuses a few of them late or in its own words
(``int()``'s ValueError for ``--nnodes abc``, ``min_nodes``/``max_restarts`` in its Python names), and
accepts others that then fail deep in the agent or wait forever (a rendezvous on several machines with no
address). Each refusal here is a ValueError whose one line names the option and the fix; the launcher puts
it behind ``launcher options:``.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from typing import Any

from flowlift.errors import FlowliftError
from flowlift.knobs import Knob, table

_NNODES = re.compile(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?")


def check_nnodes(nnodes: str) -> tuple[int, int]:
    """``(min_nodes, max_nodes)`` of an ``--nnodes`` value, ``N`` or ``MIN:MAX``: positive whole numbers, the
    minimum no larger than the maximum."""
    found = _NNODES.fullmatch(str(nnodes))
    if not found:
        raise ValueError(f"--nnodes must be a number of machines N or a range MIN:MAX (e.g. 2 or 1:4), got {nnodes!r}")
    low = int(found.group(1))
    high = int(found.group(2)) if found.group(2) is not None else low
    if low < 1:
        raise ValueError(f"--nnodes must be at least 1 machine, got {nnodes}")
    if low > high:
        raise ValueError(f"--nnodes MIN:MAX must have MIN at most MAX, got {nnodes} (e.g. {high}:{low})")
    return low, high


def check_max_restarts(count: int) -> None:
    """``--max-restarts`` counts restarts after a crash: 0 (none) or more."""
    if count < 0:
        raise ValueError(f"--max-restarts must be 0 (no restart) or more, got {count}")


def check_node_rank(rank: int, max_nodes: int, nnodes: str) -> None:
    """``--node-rank`` is one of the ``max_nodes`` machines' ranks."""
    if not 0 <= rank < max_nodes:
        raise ValueError(f"--node-rank must be from 0 to {max_nodes - 1} (--nnodes {nnodes}), got {rank}")


def check_several_machines_meet(args: Any, options: Sequence[str], max_nodes: int) -> None:
    """A run on several machines names where they meet: ``--rdzv-endpoint`` (the static rendezvous may use
    ``--master-addr`` instead). Without one, torchrun's default is this machine's own address, which the other
    machines never reach: the run would wait for them until the rendezvous times out."""
    if max_nodes < 2 or args.rdzv_endpoint:
        return
    if args.rdzv_backend == "static" and any(o.split("=", 1)[0] in ("--master-addr", "--master_addr") for o in options):
        return
    raise ValueError(
        f"--nnodes {args.nnodes} runs on several machines: give --rdzv-endpoint HOST:PORT, an address every "
        "machine reaches (e.g. --rdzv-backend c10d --rdzv-endpoint HOST0:29400)"
    )


#: The longest rendezvous wait taken (30 days): a longer one is a hang by another name.
LONGEST_WAIT_S = 30 * 24 * 3600


def _wait(name: str, help: str) -> Knob:
    return Knob(name, int, 1, help, low=1, high=LONGEST_WAIT_S, unit="s")


#: The ``--rdzv-conf`` settings torch's rendezvous reads as numbers or switches, with their domains: torch
#: parses them only when the rendezvous starts, deep in the agent (``int("1e12")`` is a traceback there, a
#: wait of 0 or less one of its own). Other keys are passed on as given.
RDZV_KNOBS = table(
    _wait("join_timeout", "how long the nodes wait for each other to join"),
    _wait("last_call_timeout", "extra wait for more nodes once the minimum has joined"),
    _wait("close_timeout", "wait for the rendezvous to close"),
    _wait("heartbeat_timeout", "a node missing its heartbeat this long is dead"),
    _wait("timeout", "the static rendezvous' wait for the other nodes"),
    _wait("read_timeout", "the c10d store's read timeout"),
    _wait("keep_alive_interval", "seconds between keep-alive heartbeats"),
    Knob("keep_alive_max_attempt", int, 3, "missed heartbeats before a node counts as dead", low=1, high=1000),
    Knob(
        "is_host",
        str,
        "true",
        "whether this node hosts the c10d store",
        choices=("1", "true", "t", "yes", "y", "0", "false", "f", "no", "n"),
    ),
)


def check_rendezvous_settings(settings: dict[str, Any]) -> None:
    """Each ``--rdzv-conf`` setting of :data:`RDZV_KNOBS` checked against its domain (normalised in place:
    ``join_timeout=+600`` becomes ``600``); a bad one is a ValueError line naming it."""
    for key, knob in RDZV_KNOBS.items():
        if key in settings:
            value = settings[key].strip().lower() if isinstance(settings[key], str) else settings[key]
            try:
                settings[key] = str(knob.check(value, label=f"--rdzv-conf {key}", loose=True))
            except FlowliftError as error:
                raise ValueError(str(error)) from None


#: Open files the agent holds per local worker (pipes, semaphores, log files; a margin over what it opens).
FILES_PER_WORKER = 16


def check_processes(count: int) -> None:
    """Refuse a local worker count the agent cannot start: below 1, or more processes than the open-file
    limit allows (:data:`FILES_PER_WORKER` each) or than 8 per CPU core."""
    import os
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    cores = os.cpu_count() or 1
    most = min(soft // FILES_PER_WORKER if soft != resource.RLIM_INFINITY else 1 << 20, 8 * cores)
    if count < 1:
        raise ValueError(f"--nproc-per-node must be at least 1, got {count}")
    if count > most:
        raise ValueError(
            f"--nproc-per-node {count} is more processes than this machine can start (at most {most}: "
            f"{cores} CPU cores, an open-file limit of {soft})"
        )


def check_port(port: object, option: str) -> None:
    if type(port) is not int or not 0 < port < 65536:
        raise ValueError(f"{option} must be a port number from 1 to 65535, got {port}")


def check_endpoint_port(endpoint: str, backend: str) -> None:
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    _, port = parse_rendezvous_endpoint(endpoint, default_port=29400 if backend == "c10d" else 29500)
    if port:
        check_port(port, "the rendezvous endpoint's port")


def check_rendezvous_host(endpoint: str) -> None:
    """The rendezvous endpoint's host resolves: an unknown one is retried in C++ until the rendezvous times out,
    deaf to Ctrl-C and SIGTERM."""
    import socket

    host = endpoint.rsplit(":", 1)[0].strip("[]") if ":" in endpoint else endpoint
    try:
        socket.getaddrinfo(host, None)
    except OSError as error:
        raise FlowliftError(
            f"launcher options: the rendezvous host {host} does not resolve ({error.strerror or error})"
        ) from None


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
        _, max_nodes = check_nnodes(args.nnodes)
        check_max_restarts(args.max_restarts)
        check_several_machines_meet(args, options, max_nodes)
        local = args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None
        if args.standalone or (local and max_nodes == 1):
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
        if args.master_port is None:
            args.master_port = 29500
        check_node_rank(args.node_rank, max_nodes, args.nnodes)
        config, _command, _arguments = torchrun.config_from_args(args)
        check_rendezvous_settings(config.rdzv_configs)
        check_processes(config.nproc_per_node)
        if args.rdzv_backend == "static":
            check_port(args.master_port, "--master-port")
        check_endpoint_port(config.rdzv_endpoint, args.rdzv_backend)
    except (AssertionError, ValueError, RuntimeError) as error:
        raise FlowliftError(f"launcher options: {first_line(error)}") from None
    wait = config.rdzv_configs.get("join_timeout")
    given = {item.split("=", 1)[0].strip() for item in (args.rdzv_conf or "").split(",")}
    if wait is not None and "timeout" not in given:
        # torchrun's static rendezvous knows no join_timeout and waits its own 900 s for the other nodes; c10d
        # connects to its store for read_timeout (60 s): the wait the user set bounds both
        config.rdzv_configs["timeout"] = int(wait)
        if args.rdzv_backend == "c10d":
            config.rdzv_configs["read_timeout"] = min(int(wait), int(config.rdzv_configs.get("read_timeout", 60)))
    return config


def first_line(error: object) -> str:
    """The first non-blank line of ``error``'s text (300 characters at most), else its type's name."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(error).__name__
