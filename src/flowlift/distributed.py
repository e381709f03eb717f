"""Scale-out of per-image jobs (``flowlift upscale``, ``flowlift eval --run``) under ``torchrun``.

Every rank runs the same command on the same input list; the process group (from ``torchrun``'s
environment: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``, one host or
many) is used only *before* the per-image loop (to agree on the work) and *after* it (a barrier with
a timeout and the summary) — never inside it, so a failing image on one rank cannot hang the others.

* :class:`DistEnv` — rank, world size and local rank from the environment; world size 1 is a plain
  single process and touches no process group.
* :func:`shard_by_pixels` — the deterministic, pixel-balanced split of the work (a pure function).
* :class:`Manifest` — the job manifest, JSON Lines in the output folder, one record appended
  atomically per image by the rank that did it; :func:`job_status` reads it back.
* :func:`process_group`, :func:`probe_and_gather`, :func:`finish` — the collectives.

The process group is always gloo, also on GPUs: the ranks exchange only small Python objects (plans
and counts), never tensors, and gloo's ``monitored_barrier`` gives the end-of-job barrier a timeout
that names the ranks that did not arrive.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import socket
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowlift.errors import FlowliftError

#: File name of the job manifest inside the output folder.
MANIFEST_NAME = "flowlift-manifest.jsonl"
#: Image record statuses: produced now, left alone (a valid output was there), or failed (``error`` says why).
STATUSES = ("done", "skipped", "failed")
#: Default seconds the end-of-job barrier waits for the slowest rank before giving up on the summary.
DEFAULT_BARRIER_TIMEOUT_S = 1800.0


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


def rank_device(setting: str | None, env: DistEnv, cuda_available: bool | None = None) -> str:
    """The torch device string of this rank.

    ``None`` / ``"auto"``: ``cuda`` when available, else ``cpu``. Under ``torchrun`` a CUDA setting
    becomes ``cuda:LOCAL_RANK`` (one GPU per local rank, whatever index was given); a single process
    keeps the setting as given. Other devices (``cpu``, ``mps``) are returned unchanged.
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
    if env.distributed:
        return f"cuda:{env.local_rank}"
    return setting


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
# the manifest


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def error_line(error: BaseException | str) -> str:
    """The first line of an error's text (its type name when empty)."""
    text = str(error)
    return text.splitlines()[0] if text.strip() else type(error).__name__


class Manifest:
    """The job manifest: JSON Lines, one object per line, in the output folder.

    Records (``event`` says which):

    * ``image`` — ``input``, ``input_sha256``, ``output``, ``status`` (``done`` / ``skipped`` /
      ``failed``), ``seconds``, ``error`` (one line or null), ``rank``, ``world_size``, ``host``,
      ``pid``, ``run``, ``time``;
    * ``job`` — written by rank 0 when a run starts: ``run``, ``inputs`` (planned outputs),
      ``todo``, ``skipped``, ``world_size``, ``time``;
    * ``summary`` — written by rank 0 after the end-of-job barrier: ``run`` and the counts.

    :meth:`append` writes one whole line with a single ``write`` on an ``O_APPEND`` descriptor under
    an exclusive ``fcntl`` lock, so lines from concurrent ranks never interleave, also on NFS (whose
    clients revalidate the file on lock) for ranks on several hosts. A process killed mid-write
    leaves at most a torn last line, which :meth:`records` skips.
    """

    def __init__(self, folder: str | os.PathLike):
        self.path = Path(folder) / MANIFEST_NAME

    def exists(self) -> bool:
        return self.path.is_file()

    def append(self, record: Mapping[str, Any]) -> None:
        data = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            _lock(descriptor)
            view = memoryview(data)
            while view:
                view = view[os.write(descriptor, view) :]
        finally:
            os.close(descriptor)  # releases the lock

    def records(self) -> list[dict[str, Any]]:
        """All well-formed records in file order (torn or foreign lines are skipped)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        out = []
        for line in raw.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and "event" in record:
                out.append(record)
        return out


def _lock(descriptor: int) -> None:
    try:
        import fcntl
    except ImportError:  # Windows: O_APPEND alone
        return
    fcntl.lockf(descriptor, fcntl.LOCK_EX)


def image_record(
    *,
    input_path: str | os.PathLike,
    input_sha256: str | None,
    output: str | os.PathLike | None,
    status: str,
    seconds: float,
    error: str | None,
    env: DistEnv,
    run: str,
) -> dict[str, Any]:
    """One ``image`` record of the manifest (see :class:`Manifest`)."""
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    return {
        "event": "image",
        "input": str(input_path),
        "input_sha256": input_sha256,
        "output": None if output is None else str(output),
        "status": status,
        "seconds": round(float(seconds), 4),
        "error": error,
        "rank": env.rank,
        "world_size": env.world_size,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "run": run,
        "time": now_iso(),
    }


def latest_by_output(records: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """The last ``image`` record per output (per input when the output is null), in file order."""
    latest: dict[str, Mapping[str, Any]] = {}
    for record in records:
        if record.get("event") == "image":
            latest[str(record.get("output") or record.get("input"))] = record
    return latest


@dataclass
class JobStatus:
    """What ``flowlift upscale --status OUT`` prints: the latest run and the state of every output."""

    manifest: Path
    run: str | None = None
    world_size: int | None = None
    started: str | None = None
    planned: int | None = None
    todo: int | None = None
    run_counts: Counter = field(default_factory=Counter)  # this run's image records by status
    finished: bool = False
    latest: Counter = field(default_factory=Counter)  # latest record per output, by status
    missing_outputs: list[str] = field(default_factory=list)  # latest says done/skipped, file absent
    failures: list[tuple[str, str]] = field(default_factory=list)  # (input, error) of latest failures
    seconds: float = 0.0  # this run's image seconds, summed over ranks

    @property
    def complete(self) -> bool:
        """Every planned image of the latest run is recorded, none failed, every output present."""
        recorded = self.run_counts["done"] + self.run_counts["failed"] + self.run_counts["skipped"]
        return (
            self.todo is not None
            and recorded >= self.todo
            and not self.latest["failed"]
            and not self.missing_outputs
        )


def job_status(folder: str | os.PathLike) -> JobStatus:
    """Read the manifest in ``folder``: counts of the latest run and of the latest record per output."""
    manifest = Manifest(folder)
    if not manifest.exists():
        raise FlowliftError(f"{folder}: no job manifest ({MANIFEST_NAME}) here")
    records = manifest.records()
    status = JobStatus(manifest=manifest.path)
    jobs = [r for r in records if r.get("event") == "job"]
    if jobs:
        job = jobs[-1]
        status.run, status.world_size, status.started = job.get("run"), job.get("world_size"), job.get("time")
        status.planned, status.todo = job.get("inputs"), job.get("todo")
        for record in records:
            if record.get("run") != status.run:
                continue
            if record.get("event") == "image":
                status.run_counts[record.get("status")] += 1
                status.seconds += float(record.get("seconds") or 0.0)
            elif record.get("event") == "summary":
                status.finished = True
    for key, record in latest_by_output(records).items():
        state = record.get("status")
        status.latest[state] += 1
        if state == "failed":
            status.failures.append((str(record.get("input")), str(record.get("error"))))
        elif record.get("output") and not Path(record["output"]).exists():
            status.missing_outputs.append(key)
    return status


def format_status(status: JobStatus) -> str:
    """Human-readable lines for :func:`job_status`."""
    lines = [f"manifest: {status.manifest}"]
    if status.run is not None:
        c = status.run_counts
        recorded = c["done"] + c["skipped"] + c["failed"]
        state = "finished" if status.finished else "running or interrupted"
        lines.append(
            f"latest run {status.run} ({state}), started {status.started}, world size {status.world_size}: "
            f"{status.planned} image(s) planned, {status.todo} to do; "
            f"{c['done']} done, {c['failed']} failed, {max(0, (status.todo or 0) - recorded)} not recorded yet"
        )
        if c["done"] and status.seconds > 0:
            lines.append(f"  {status.seconds:.1f} s of image work, {status.seconds / c['done']:.2f} s per done image")
    latest = status.latest
    lines.append(
        f"all outputs (latest record each): {latest['done']} done, {latest['skipped']} skipped, "
        f"{latest['failed']} failed, {len(status.missing_outputs)} recorded but missing on disk"
    )
    for source, error in status.failures:
        lines.append(f"  failed: {source}: {error}")
    for output in status.missing_outputs:
        lines.append(f"  missing: {output}")
    lines.append("complete" if status.complete else "not complete: rerun the same command to finish")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# collectives (world size 1: none)


def new_run_id() -> str:
    """A fresh run id (UTC time and random bits); rank 0's is the job's."""
    return f"{_dt.datetime.now(_dt.timezone.utc).strftime('%Y%m%dT%H%M%SZ')}-{os.urandom(3).hex()}"


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
        dist.init_process_group(backend="gloo", timeout=_dt.timedelta(seconds=timeout_s))
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
    dist.all_gather_object(gathered, value)
    return gathered


def broadcast(env: DistEnv, value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    if not env.distributed:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
        return None, error_line(error)


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

        value = float(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parser.add_argument(
        "--barrier-timeout",
        type=seconds,
        default=DEFAULT_BARRIER_TIMEOUT_S,
        metavar="SECONDS",
        help="under torchrun: how long ranks wait for the slowest one at the start and at the end "
        f"(default {DEFAULT_BARRIER_TIMEOUT_S:.0f})",
    )
