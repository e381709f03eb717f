"""The job manifest of a batch run: JSON Lines in the output folder, one record per image.

Written by every rank of a ``torchrun`` job (and by a single process continuing such a job), read by
the next run's summary and by ``flowlift status OUT`` (:func:`job_status`). The manifest is
a record of what happened; whether an image still needs work is decided by its output file (the
batch resume rule), so a manifest line and an output can never disagree in a way that loses work.
"""

from __future__ import annotations

import datetime as _dt
import errno
import json
import os
import socket
import stat as stat_module
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
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
        """True when a manifest (a regular file) is there; a folder that cannot be searched is one line."""
        try:
            return stat_module.S_ISREG(os.stat(self.path).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as error:  # permission denied on the folder: one line, not a traceback
            raise FlowliftError(_os_problem(self.path, error)) from None

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
        """All well-formed records in file order (torn, over-long or foreign lines are skipped)."""
        return list(self.read().records)

    def read(self) -> RecordStream:
        """The records as a stream, read in bounded chunks (:class:`RecordStream`)."""
        return RecordStream(self.path)


#: The longest manifest line read as a record (bytes). A record is a few hundred bytes; a longer line
#: (a corrupt file, or one that is no manifest) is one bad line, skipped without being held whole.
MAX_LINE_BYTES = 1 << 20
#: The most bytes one ``read`` asks for: the manifest is never held whole, whatever its size.
READ_CHUNK_BYTES = 1 << 16


class RecordStream:
    """The records of a manifest file, one line at a time, never more than one bounded line in memory.

    ``records`` yields every well-formed record in file order; lines that are no record (torn by a
    kill, corrupt, not JSON, over :data:`MAX_LINE_BYTES`) are counted in ``bad_lines`` as they are
    passed. The file is opened without blocking (a FIFO in its place fails at once) and must be a
    regular file; an OS failure (permission denied) is one FlowliftError line.
    """

    def __init__(self, path: Path, max_line: int = MAX_LINE_BYTES, chunk: int = READ_CHUNK_BYTES):
        self.path, self.max_line, self.chunk = path, max_line, chunk
        self.bad_lines = 0

    @property
    def records(self) -> Iterator[dict[str, Any]]:
        for line in self._lines():
            if not line.strip():
                continue  # a blank line is no record and no damage
            record = _record(line)
            if record is None:
                self.bad_lines += 1
            else:
                yield record

    def _open(self) -> int | None:
        try:
            descriptor = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            return None
        except OSError as error:
            raise FlowliftError(_os_problem(self.path, error)) from None
        mode = os.fstat(descriptor).st_mode
        if not stat_module.S_ISREG(mode):
            os.close(descriptor)
            reason = os.strerror(errno.EISDIR) if stat_module.S_ISDIR(mode) else "not a regular file"
            raise FlowliftError(f"cannot use the job manifest {self.path}: {reason}")
        return descriptor

    def _lines(self) -> Iterator[bytes]:
        """Each line's bytes (without its newline); an over-long line as ``b""`` plus a bad line."""
        descriptor = self._open()
        if descriptor is None:
            return
        pending, overlong = bytearray(), False
        try:
            while True:
                try:
                    chunk = os.read(descriptor, self.chunk)
                except OSError as error:
                    raise FlowliftError(_os_problem(self.path, error)) from None
                if not chunk:
                    break
                start = 0
                while (end := chunk.find(b"\n", start)) >= 0:
                    if overlong or len(pending) + end - start > self.max_line:
                        self.bad_lines += 1
                    else:
                        pending += chunk[start:end]
                        yield bytes(pending)
                    pending.clear()
                    overlong, start = False, end + 1
                if not overlong:
                    pending += chunk[start:]
                    if len(pending) > self.max_line:  # dropped now: the rest of the line is skipped as read
                        pending.clear()
                        overlong = True
        finally:
            os.close(descriptor)
        if overlong:
            self.bad_lines += 1
        elif pending.strip():
            yield bytes(pending)  # a last line without its newline (a torn write): judged like any other


def _record(line: bytes) -> dict[str, Any] | None:
    """One line as a record, or None (not JSON, too deeply nested, no object with an ``event``)."""
    try:
        record = parse_json(line)
    except ValueError:  # not JSON, or nested past the bound (files/json_input.py)
        return None
    return record if isinstance(record, dict) and "event" in record else None


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
            remember_latest(latest, record)
    return latest


def remember_latest(latest: dict[str, Mapping[str, Any]], record: Mapping[str, Any]) -> None:
    """``record`` as the latest of its output (of its input when it has none). A record of an input with an output
    supersedes that input's output-less one: a plan's refusal (a duplicate stem) stayed "failed" in the status after
    the input was upscaled."""
    if record.get("output"):
        latest.pop(str(record.get("input")), None)
    latest[str(record.get("output") or record.get("input"))] = record


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
    broken_outputs: list[tuple[str, str]] = field(default_factory=list)  # (output, why) there but not a whole image
    failures: list[tuple[str, str]] = field(default_factory=list)  # (input, error) of latest failures
    gone_inputs: list[str] = field(default_factory=list)  # failed inputs since removed: nothing left to redo
    seconds: float = 0.0  # this run's image seconds, summed over ranks
    bad_lines: int = 0  # lines that are no record (torn, corrupt, over-long): skipped

    @property
    def complete(self) -> bool:
        """Every planned image of the latest run is recorded, none failed, every output present."""
        recorded = self.run_counts["done"] + self.run_counts["failed"]
        whole = not self.missing_outputs and not self.broken_outputs
        return self.todo is not None and recorded >= self.todo and not self.failures and whole


def job_status(folder: str | os.PathLike) -> JobStatus:
    """Read the manifest in ``folder``: counts of the latest run and of the latest record per output.

    One pass over the stream (:meth:`Manifest.read`): what is kept is one entry per run and the latest
    record per output, never the file nor the list of its lines.
    """
    manifest = Manifest(folder)
    if not manifest.exists():
        raise FlowliftError(f"{folder}: no job manifest ({MANIFEST_NAME}) here")
    stream = manifest.read()
    status = JobStatus(manifest=manifest.path)
    latest_job: Mapping[str, Any] | None = None
    per_run: dict[Any, tuple[Counter, list[float], list[bool]]] = {}
    latest: dict[str, Mapping[str, Any]] = {}
    folders: dict[Any, str] = {}  # run -> the output folder it wrote in (its job record's)
    for record in stream.records:
        event = record.get("event")
        if event == "job":
            latest_job = record
            if isinstance(record.get("folder"), str):
                folders[_hashable(record.get("run"))] = record["folder"]
        counts, seconds, finished = per_run.setdefault(_hashable(record.get("run")), (Counter(), [0.0], [False]))
        if event == "image":
            remember_latest(latest, record)
            if not record.get("plan"):
                counts[_hashable(record.get("status"))] += 1
                seconds[0] += _seconds(record.get("seconds"))
        elif event == "summary":
            finished[0] = True
    status.bad_lines = stream.bad_lines
    if latest_job is not None:
        job = latest_job
        status.run, status.world_size, status.started = job.get("run"), job.get("world_size"), job.get("time")
        status.planned, status.todo = job.get("inputs"), job.get("todo")
        counts, seconds, finished = per_run.get(_hashable(status.run), (Counter(), [0.0], [False]))
        status.run_counts, status.seconds, status.finished = counts, seconds[0], finished[0]
    for key, record in latest.items():
        state = _hashable(record.get("status"))
        status.latest[state] += 1
        if state == "failed" and _exists(record.get("input")):
            status.failures.append((str(record.get("input")), str(record.get("error"))))
        elif state == "failed":  # its input was removed since: no rerun can redo it, nor needs to
            status.gone_inputs.append(str(record.get("input")))
        elif record.get("output"):
            found = _found(record["output"], folders.get(_hashable(record.get("run"))), folder)
            why = None if found is None else broken_output_reason(found)
            if found is None:
                status.missing_outputs.append(key)
            elif why is not None:
                status.broken_outputs.append((key, why))
    return status


def broken_output_reason(path: str | os.PathLike) -> str | None:
    """Why the file at an output name is not a whole image, and what the next run does with it (the rule of
    :mod:`flowlift.jobs.batch`: it redoes an empty file or flowlift's own, refuses a user's); None when whole."""
    from flowlift.files.image_outputs import inspect_existing

    try:
        found = inspect_existing(path)
    except OSError as error:  # a file this user may not read
        return f"unreadable: {error.strerror or type(error).__name__}; the next run cannot read it either"
    if found.image and found.complete:
        return None
    reason = "empty" if found.empty else "truncated" if found.image else "unreadable"
    if found.empty or found.by_flowlift:
        return f"{reason}; the next run redoes it"
    return f"{reason}; not written by flowlift: the next run refuses it, --overwrite replaces it"


def _found(output: Any, written_in: str | None, folder: str | os.PathLike) -> str | None:
    """Where a recorded output is on disk: at its recorded path, or, when the output folder has moved (or is
    mounted elsewhere: ``flowlift status`` from another machine), at the same place under ``folder``; None when
    it is in neither."""
    if _exists(output):
        return str(output)
    if written_in is None:
        return None
    try:
        relative = os.path.relpath(str(output), written_in)
    except ValueError:  # another drive
        return None
    moved = os.path.join(folder, relative)
    return moved if not relative.startswith(os.pardir) and _exists(moved) else None


def _hashable(value: Any) -> Any:
    """A run id or status as a dict key (a corrupt record's list or object as its JSON text)."""
    return value if value is None or isinstance(value, (str, int, float, bool)) else json.dumps(value, sort_keys=True)


def _seconds(value: Any) -> float:
    try:
        return float(value or 0.0)
    except (TypeError, ValueError):
        return 0.0


def _exists(output: Any) -> bool:
    try:
        return os.path.exists(str(output))
    except (OSError, ValueError):
        return False


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
        + (f", {len(status.broken_outputs)} broken" if status.broken_outputs else "")
    )
    for source, error in status.failures:
        lines.append(f"  failed: {source}: {error}")
    for output in status.missing_outputs:
        lines.append(f"  missing: {output}")
    for output, why in status.broken_outputs:
        lines.append(f"  broken: {output} ({why})")
    for source in status.gone_inputs:
        lines.append(f"  failed, its input since removed (nothing to redo): {source}")
    if status.bad_lines:
        lines.append(
            f"  {status.bad_lines} line(s) of the manifest are no record (torn, corrupt or over-long): skipped"
        )
    lines.append("complete" if status.complete else "not complete: rerun the same command to finish")
    return "\n".join(lines)
