"""The job manifest of a batch run: JSON Lines in the output folder, one record per image.

Written by every rank of a ``torchrun`` job (and by a single process continuing such a job), read by
the next run's summary and by ``flowlift status OUT`` (:func:`job_status`). The manifest is
a record of what happened; whether an image still needs work is decided by its output file (the
batch resume rule), so a manifest line and an output can never disagree in a way that loses work.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowlift.errors import FlowliftError
from flowlift.files.atomic import open_for_append
from flowlift.files.json_input import parse_json
from flowlift.jobs.distributed import DistEnv

#: File name of the job manifest inside the output folder.
MANIFEST_NAME = "flowlift-manifest.jsonl"
#: Image record statuses: produced now, left alone (a valid output was there), or failed (``error`` says why).
STATUSES = ("done", "skipped", "failed")


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


class Manifest:
    """The job manifest: JSON Lines, one object per line, in the output folder.

    Records (``event`` says which):

    * ``image`` — ``input``, ``input_sha256``, ``output``, ``status`` (``done`` / ``skipped`` /
      ``failed``), ``seconds``, ``error`` (one line or null), ``rank``, ``world_size``, ``host``,
      ``pid``, ``run``, ``time``; ``plan: true`` on the records rank 0 writes while planning (refused
      inputs, finished outputs the manifest did not know), which the per-image loop did not produce;
    * ``job`` — written by rank 0 when a run starts: ``run``, ``inputs`` (planned outputs),
      ``todo``, ``skipped``, ``world_size``, ``time``;
    * ``summary`` — written by rank 0 after the end-of-job barrier: ``run`` and the counts.

    :meth:`write_record` writes one whole line with a single ``write`` on an ``O_APPEND`` descriptor under
    an exclusive ``fcntl`` lock, so lines from concurrent ranks never interleave, also on NFS (whose
    clients revalidate the file on lock) for ranks on several hosts. A process killed mid-write
    leaves at most a torn last line, which :meth:`records` skips.
    """

    def __init__(self, folder: str | os.PathLike):
        self.path = Path(folder) / MANIFEST_NAME

    def exists(self) -> bool:
        return self.path.is_file()

    def writable_problem(self) -> str | None:
        """Why this process cannot append to the manifest (a folder in its place, no permission, a
        read-only file system), as one line, or ``None``. Opening is the test (creating the file
        when it is missing): permission bits say nothing reliable for root or on NFS."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            os.close(open_for_append(self.path))  # never through a link, never blocking on a FIFO
        except FlowliftError as error:
            return str(error)
        except OSError as error:
            return _os_problem(self.path, error)
        return None

    def write_record(self, record: Mapping[str, Any]) -> None:
        """Add ``record`` as one JSON line at the end of the manifest, under an exclusive lock so that the
        lines of concurrent ranks never interleave; an OS failure (a full disk) is one FlowliftError line."""
        data = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            descriptor = open_for_append(self.path)  # a link or FIFO in its place: one line, not followed
            try:
                _lock(descriptor)
                view = memoryview(data)
                while view:
                    view = view[os.write(descriptor, view) :]
            finally:
                os.close(descriptor)  # releases the lock
        except OSError as error:  # e.g. the disk filled up mid-job: one line, not a traceback
            raise FlowliftError(_os_problem(self.path, error)) from None

    def records(self) -> list[dict[str, Any]]:
        """All well-formed records in file order (torn or foreign lines are skipped)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as error:
            raise FlowliftError(_os_problem(self.path, error)) from None
        out = []
        for line in raw.splitlines():
            try:
                record = parse_json(line)
            except ValueError:
                continue
            if isinstance(record, dict) and "event" in record:
                out.append(record)
        return out


def _os_problem(path: Path, error: OSError) -> str:
    return f"cannot use the job manifest {path}: {error.strerror or error}"


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
    """What ``flowlift status OUT`` prints: the latest run and the state of every output."""

    manifest: Path
    run: str | None = None
    world_size: int | None = None
    started: str | None = None
    planned: int | None = None
    todo: int | None = None
    run_counts: Counter = field(default_factory=Counter)  # this run's loop records (not plan records) by status
    finished: bool = False
    latest: Counter = field(default_factory=Counter)  # latest record per output, by status
    missing_outputs: list[str] = field(default_factory=list)  # latest says done/skipped, file absent
    failures: list[tuple[str, str]] = field(default_factory=list)  # (input, error) of latest failures
    seconds: float = 0.0  # this run's image seconds, summed over ranks

    @property
    def complete(self) -> bool:
        """Every planned image of the latest run is recorded, none failed, every output present."""
        recorded = self.run_counts["done"] + self.run_counts["failed"]
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
            if record.get("event") == "image" and not record.get("plan"):
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
        recorded = c["done"] + c["failed"]
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
