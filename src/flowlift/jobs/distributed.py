"""Scale-out of per-image jobs (``flowlift upscale``, ``flowlift eval --run``) under ``torchrun``: the parts.

Every rank runs the same command on the same input list; the process group (from ``torchrun``'s
environment: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``, one host or
many) is used only *before* the per-image loop (to agree on the work) and *after* it (a barrier with
a timeout and the summary) — never inside it, so a failing image on one rank cannot hang the others.

* :class:`DistEnv` — rank, world size and local rank from the environment; world size 1 is a plain
  single process and touches no process group.
* :func:`shard_by_pixels` — the deterministic, pixel-balanced split of the work (a pure function).
* :func:`process_group`, :func:`probe_and_gather`, :func:`finish` — the collectives.

The job manifest is :mod:`flowlift.jobs.manifest`; the sharded batch runner :mod:`flowlift.jobs.scaleout`.

The process group is always gloo, also on GPUs: the ranks exchange only small Python objects (plans
and counts), never tensors, and gloo's ``monitored_barrier`` gives the end-of-job barrier a timeout
that names the ranks that did not arrive.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import math
import os
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from flowlift.errors import FlowliftError
from flowlift.jobs.group_start import join_group, joining

#: Default seconds the end-of-job barrier waits for the slowest rank before giving up on the summary.
DEFAULT_BARRIER_TIMEOUT_S = 1800.0
#: Set in the workers ``flowlift launch`` starts: there a rank's return value (not its exit status)
#: carries the job's outcome back to the launcher (:mod:`flowlift.jobs.launch`).
LAUNCH_WORKER_ENV = "FLOWLIFT_LAUNCH_WORKER"


def outcome_is_returned() -> bool:
    """True in a worker of ``flowlift launch``; False under plain ``torchrun`` or in one process.

    Under plain ``torchrun`` a rank's exit status is all its agent sees, and any non-zero one is a
    crash to it (restarted under ``--max-restarts``, then reported with a ``ChildFailedError``
    traceback), so ranks that reached the end of the job exit 0 also when images failed.
    """
    return os.environ.get(LAUNCH_WORKER_ENV) == "1"


# --------------------------------------------------------------------------------------------------
# environment


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in a ``torchrun`` job; ``DistEnv()`` is a single process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        """Read ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` (set by ``torchrun``); absent means one process."""
        env = os.environ if environ is None else environ
        try:
            world_size = int(env.get("WORLD_SIZE", "1"))
            rank = int(env.get("RANK", "0"))
            local_rank = int(env.get("LOCAL_RANK", str(rank)))
        except ValueError as error:
            raise FlowliftError(f"bad torchrun environment: {error}") from None
        if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
            raise FlowliftError(
                f"bad torchrun environment: RANK={rank} WORLD_SIZE={world_size} LOCAL_RANK={local_rank}"
            )
        return cls(rank=rank, world_size=world_size, local_rank=local_rank)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def rank_device(setting: str | None, env: DistEnv, cuda_available: bool | None = None, bind: bool = True) -> str:
    """The torch device string of this rank.

    ``None`` / ``"auto"``: ``cuda`` when available, else ``cpu``. Under ``torchrun`` a CUDA setting
    becomes ``cuda:LOCAL_RANK`` (one GPU per local rank, whatever index was given) and, with ``bind``,
    the current CUDA device, so that nothing that uses "the current device" lands every rank on GPU 0.
    A single process keeps the setting as given. Other devices (``cpu``, ``mps``) are returned unchanged.
    """
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    if setting in (None, "auto"):
        setting = "cuda" if cuda_available else "cpu"
    if not setting.startswith("cuda"):
        return setting
    if not cuda_available:
        raise FlowliftError(f"device {setting} requested but no CUDA device is available")
    if not env.distributed:
        return setting
    if bind:
        import torch

        if env.local_rank >= torch.cuda.device_count():
            raise FlowliftError(
                f"local rank {env.local_rank} has no GPU: this host has {torch.cuda.device_count()}; "
                "give torchrun --nproc_per_node <= the number of GPUs"
            )
        torch.cuda.set_device(env.local_rank)
    return f"cuda:{env.local_rank}"


# --------------------------------------------------------------------------------------------------
# sharding (pure)


def shard_by_pixels(pixels: Sequence[int], world_size: int) -> list[list[int]]:
    """Split items with costs ``pixels`` into ``world_size`` shards of near-equal total pixels.

    Longest-processing-time greedy: items in order of decreasing pixels (ties: lower index first)
    each go to the shard with the smallest total so far (ties: lower rank). Every index lands in
    exactly one shard; each shard lists its indices in increasing order. The largest shard exceeds
    the ideal ``sum / world_size`` by at most the largest single item (Graham's bound
    ``max <= sum / m + p_max``). Deterministic: the same inputs give the same shards on every rank.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if any(p < 0 for p in pixels):
        raise ValueError("pixel counts must be >= 0")
    loads = [0] * world_size
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(pixels)), key=lambda i: (-pixels[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        loads[rank] += pixels[index]
        shards[rank].append(index)
    return [sorted(s) for s in shards]


def image_pixels(path: str | os.PathLike) -> int:
    """Width x height from the image header (nothing decoded); 0 when it cannot be read (such an
    input costs nothing to fail, and its rank reports it in the loop)."""
    import warnings

    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(path) as image:
                width, height = image.size
    except Exception:  # noqa: BLE001 - any unreadable header is a zero-cost item; the loop names the error
        return 0
    return int(width) * int(height)


def plan_fingerprint(items: Sequence[Any]) -> str:
    """SHA-256 over the ``repr`` of the planned items, compared across ranks before sharding."""
    digest = hashlib.sha256()
    for item in items:
        digest.update(repr(item).encode())
        digest.update(b"\n")
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------------
# collectives (world size 1: none)


def new_run_id() -> str:
    """A fresh run id (UTC time and random bits); rank 0's is the job's."""
    return f"{_dt.datetime.now(_dt.timezone.utc).strftime('%Y%m%dT%H%M%SZ')}-{os.urandom(3).hex()}"


class RanksDidNotMeet(FlowliftError):
    """Not every rank arrived at a collective within its timeout (crashed, hung, stopped by SIGSTOP): the
    job's state is unknown, exit status 1 as for a missed end barrier (docs/distributed.md), one line."""

    exit_status = 1


@contextmanager
def _met(what: str, timeout_s: float | None = None) -> Iterator[None]:
    """A collective's timeout (torch's ``DistStoreError``, gloo's ``RuntimeError``) as :class:`RanksDidNotMeet`."""
    try:
        yield
    except RuntimeError as error:  # DistError and DistBackendError are RuntimeErrors too
        text = str(error).strip()
        reason = text.splitlines()[0][:300] if text else type(error).__name__
        waited = "" if timeout_s is None else f"waited up to {timeout_s:.0f} s: "
        raise RanksDidNotMeet(f"no summary: not every rank reached {what} ({waited}{reason})") from None


@contextmanager
def process_group(env: DistEnv, timeout_s: float = DEFAULT_BARRIER_TIMEOUT_S) -> Iterator[DistEnv]:
    """Join ``torchrun``'s process group (gloo, ``env://``) for the body; nothing for one process.

    ``timeout_s`` bounds every collective (the plan exchange waits for the slowest rank's start-up).
    """
    if not env.distributed:
        yield env
        return
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        with _met("the start", timeout_s), joining(timeout_s):
            join_group("gloo", _dt.timedelta(seconds=timeout_s))
    try:
        yield env
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def all_gather(env: DistEnv, value: Any) -> list[Any]:
    """``value`` of every rank, in rank order (``[value]`` for one process)."""
    if not env.distributed:
        return [value]
    import torch.distributed as dist

    gathered: list[Any] = [None] * env.world_size
    with _met("an exchange of the plan"):
        dist.all_gather_object(gathered, value)
    return gathered


def broadcast(env: DistEnv, value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    if not env.distributed:
        return value
    import torch.distributed as dist

    box = [value]
    with _met("an exchange of the plan"):
        dist.broadcast_object_list(box, src=0)
    return box[0]


def agree(env: DistEnv, problem: str | None) -> None:
    """Raise :class:`FlowliftError` on every rank when any rank has a ``problem`` (one line each).

    For checks before the work (can the manifest be written?): a rank that stopped alone would
    leave the others in the next collective until its timeout, or -- on a file system whose state
    differs between hosts -- run a job with a rank missing.
    """
    problems = [p for p in all_gather(env, problem) if p]
    if problems:
        raise FlowliftError(problems[0])


def probe_and_gather(env: DistEnv, items: Sequence[Any], probe: Callable[[Any], Any]) -> list[Any]:
    """``[probe(item) for item in items]``, the probing spread over the ranks.

    Rank ``r`` probes items ``r, r + W, r + 2W, ...`` (reading image headers, checking outputs);
    one ``all_gather`` gives every rank all results in item order. Every rank must pass the same
    ``items``: a fingerprint of them is exchanged too, and differing lists raise
    :class:`FlowliftError` (ranks that see different folders would otherwise skip or repeat images).
    """
    mine = {i: probe(items[i]) for i in range(env.rank, len(items), env.world_size)}
    gathered = all_gather(env, (plan_fingerprint(items), mine))
    prints = {fp for fp, _ in gathered}
    if len(prints) > 1:
        raise FlowliftError(
            f"the {env.world_size} ranks see different input lists (same command, same folders and "
            "the same files on every host are needed)"
        )
    merged: dict[int, Any] = {}
    for _, part in gathered:
        merged.update(part)
    return [merged[i] for i in range(len(items))]


def finish(env: DistEnv, counts: Mapping[str, int], timeout_s: float) -> tuple[list[dict[str, int]] | None, str]:
    """The end-of-job barrier with a timeout, then every rank's ``counts``.

    Returns ``(per-rank counts, "")``, or ``(None, reason)`` when some rank did not reach the
    barrier within ``timeout_s`` (crashed, hung, or far slower): the caller then reports what the
    manifest holds instead of hanging.
    """
    if not env.distributed:
        return [dict(counts)], ""
    import torch.distributed as dist

    try:
        dist.monitored_barrier(timeout=_dt.timedelta(seconds=timeout_s), wait_all_ranks=True)
        return all_gather(env, dict(counts)), ""
    except RuntimeError as error:
        text = str(error)
        return None, text.splitlines()[0] if text.strip() else type(error).__name__


def total_counts(per_rank: Sequence[Mapping[str, int]]) -> Counter:
    """Sum of the ranks' counts."""
    total: Counter = Counter()
    for counts in per_rank:
        total.update(counts)
    return total


def add_barrier_timeout_argument(parser) -> None:
    """``--barrier-timeout SECONDS`` for commands that run under ``torchrun``."""

    def seconds(text: str) -> float:
        import argparse

        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
        if not (value > 0 and math.isfinite(value)):  # inf would wait forever for a dead rank
            raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
        return value

    parser.add_argument(
        "--barrier-timeout",
        type=seconds,
        default=DEFAULT_BARRIER_TIMEOUT_S,
        metavar="SECONDS",
        help="under torchrun: how long ranks wait for the slowest one at the start and at the end "
        f"(default {DEFAULT_BARRIER_TIMEOUT_S:.0f})",
    )
