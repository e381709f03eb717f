"""A batch (:mod:`flowlift.jobs.batch`) run as one rank of a ``torchrun`` job, with its job manifest.

:func:`batch_share` (then :meth:`BatchShare.run`) is what an image-to-image command calls instead of
:func:`flowlift.jobs.batch.run_jobs`, and :func:`run_batch` the two in one for a caller with a model factory:

* one process and no manifest in the output folder: exactly ``run_jobs`` (nothing new is written);
* under ``torchrun`` (or one process continuing a job whose folder holds a manifest):

  1. every rank plans the same jobs; the ranks split the probing (image headers, the resume rule
     :func:`flowlift.jobs.batch.pending`) and exchange the results once (:func:`probe_and_gather`, which
     also checks that all ranks planned the same list);
  2. the jobs that need work are split by pixel count (:func:`shard_by_pixels`); the caller builds its
     models only when this rank's share has work (:attr:`BatchShare.has_work`) and runs ``run_jobs``
     over it (:meth:`BatchShare.run`) — no collective inside the loop, so a failing image costs one
     line on its own rank and nothing else;
  3. each processed image appends one record to the manifest (done with its seconds, or failed with
     its error line); rank 0 also records the plan (a ``job`` record), the inputs it refuses and the
     finished outputs the manifest did not know yet;
  4. a monitored barrier with a timeout, the ranks' counts gathered, and rank 0's summary line (and
     ``summary`` record).

Exit status: "some images failed" is the job's outcome, "a rank could not finish" is a failure of
the run, and only the second is a non-zero exit status of a rank. Under plain ``torchrun`` every rank
that passed the barrier exits 0, also when images failed (the summary line, the manifest and
``flowlift status`` say so, the last with exit 1): ``torchrun`` treats any non-zero rank
as a crash, restarts the whole group for it under ``--max-restarts`` and prints its
``ChildFailedError`` traceback. Under ``flowlift launch`` (:mod:`flowlift.jobs.launch`) every rank
returns the job's outcome (1 when any image failed on any rank) as a value, which becomes the
launcher's exit status. A user error is exit 2 on the ranks that meet it (checks that can differ
between ranks, such as whether the manifest can be written, are agreed first, so that all ranks
stop together); a barrier timeout is 1 on every rank.

A rank killed mid-run loses only its image in flight (outputs are written atomically and recorded
after they exist); rerunning the same command with any world size redoes exactly the images whose
output is missing — the ones that failed or were never reached.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from flowlift.errors import FlowliftError
from flowlift.jobs.batch import (
    BatchResult,
    Job,
    error_line,
    existing_output,
    pending,
    report,
    run_jobs,
    summary_line,
)
from flowlift.jobs.distributed import (
    DEFAULT_BARRIER_TIMEOUT_S,
    DistEnv,
    agree,
    broadcast,
    finish,
    image_pixels,
    new_run_id,
    outcome_is_returned,
    probe_and_gather,
    process_group,
    shard_by_pixels,
    total_counts,
)
from flowlift.jobs.manifest import Manifest, image_record, latest_by_output, now_iso

Process = Callable[[Path, Path], None]


def _nothing_to_do(source: Path, output: Path) -> None:
    raise AssertionError(f"no job was pending, yet {source} -> {output} was run")


def run_batch(
    jobs: Sequence[Job],
    make_process: Callable[[], Process],
    *,
    command: str,
    folder: Path | None,
    overwrite: bool = False,
    barrier_timeout: float = DEFAULT_BARRIER_TIMEOUT_S,
    env: DistEnv | None = None,
    progress: bool | None = None,
) -> int:
    """Run ``jobs`` on this rank's share; returns the exit status (see the module docstring).

    ``make_process()`` builds the per-image callback (loading the models); it is called at most
    once, and only when this rank has work. A caller that builds its models itself uses
    :func:`batch_share` and :meth:`BatchShare.run` instead.
    """
    with batch_share(
        jobs,
        command=command,
        folder=folder,
        overwrite=overwrite,
        barrier_timeout=barrier_timeout,
        env=env,
        progress=progress,
    ) as share:
        return share.run(make_process() if share.has_work else None)


@contextmanager
def batch_share(
    jobs: Sequence[Job],
    *,
    command: str,
    folder: Path | None,
    overwrite: bool = False,
    barrier_timeout: float = DEFAULT_BARRIER_TIMEOUT_S,
    env: DistEnv | None = None,
    progress: bool | None = None,
) -> Iterator[BatchShare]:
    """This rank's share of ``jobs``, planned and agreed with the other ranks (steps 1 and 2 of the
    module docstring), inside the process group when there is one. ``folder``: the output folder that
    ``-o`` names (the manifest's home; ``None`` without ``-o`` or for ``-o FILE``,
    :func:`flowlift.files.output_paths.output_target`). The caller builds its models only when
    :attr:`BatchShare.has_work`, then runs the share with :meth:`BatchShare.run`."""
    started = time.perf_counter()  # the summary's total time includes loading the models
    opened = time.time()  # before any rank of this run writes (they first agree on the plan): the debris cutoff
    env = DistEnv.from_environ() if env is None else env
    jobs = list(jobs)
    if env.distributed and folder is None:
        raise FlowliftError("under torchrun, -o must name an output folder: the job manifest is kept there")
    manifest = None if folder is None else Manifest(folder)
    if manifest is None or not (env.distributed or manifest.exists()):  # exactly run_jobs: nothing new is written
        todo = pending(jobs, overwrite)
        yield BatchShare(
            jobs, command, overwrite, barrier_timeout, env, progress, started, opened, has_work=bool(todo), todo=todo
        )
        return
    with process_group(env, barrier_timeout):
        yield _agreed_share(jobs, command, manifest, overwrite, barrier_timeout, env, progress, started, opened)


@dataclass
class BatchShare:
    """What this rank runs of a batch: ``jobs`` (its share, and on rank 0 the ones nobody processes, to
    report them once), whether any of them needs work, the job manifest when the run keeps one, and
    ``todo``: the jobs of the whole batch (every rank's) that need work, in order."""

    jobs: list[Job]
    command: str
    overwrite: bool
    barrier_timeout: float
    env: DistEnv
    progress: bool | None
    started: float
    opened: float
    has_work: bool
    manifest: Manifest | None = None
    run_id: str = ""
    todo: list[Job] = field(default_factory=list)

    def run(self, process: Process | None) -> int:
        """Run ``process(source, output)`` over the share (steps 3 and 4); returns the exit status.
        ``process`` may be None only when the share has no work."""
        process = process if self.has_work and process is not None else _nothing_to_do
        if self.manifest is None:
            result = run_jobs(
                self.jobs,
                process,
                command=self.command,
                overwrite=self.overwrite,
                progress=self.progress,
                started=self.started,
                debris_before=self.opened,
            )
            return result.exit_code
        process = _recording(process, self.manifest, self.run_id, self.env) if self.has_work else process
        progress = self.progress if self.env.is_main else False  # one batch bar on a shared terminal: rank 0's
        # a launched job's one summary line is rank 0's, over every rank's counts (see _finish)
        result = run_jobs(
            self.jobs,
            process,
            command=self.command,
            overwrite=self.overwrite,
            progress=progress,
            started=self.started,
            debris_before=self.opened,
            summary=not self.env.distributed,
        )
        return _finish(self, result)


def _agreed_share(
    jobs: list[Job],
    command: str,
    manifest: Manifest,
    overwrite: bool,
    barrier_timeout: float,
    env: DistEnv,
    progress: bool | None,
    started: float,
    opened: float,
) -> BatchShare:
    agree(env, manifest.writable_problem())  # e.g. a folder in its place: every rank stops, with one line
    run = broadcast(env, new_run_id())

    def probe(job: Job) -> tuple[int, bool]:
        needed = bool(pending([job], overwrite))
        return (image_pixels(job.source) if needed else 0), needed

    probes = probe_and_gather(env, jobs, probe)
    todo = [i for i, (_, needed) in enumerate(probes) if needed]
    share = {todo[k] for k in shard_by_pixels([probes[i][0] for i in todo], env.world_size)[env.rank]}
    if env.is_main:
        _record_plan(manifest, jobs, todo, run, env)
        # rank 0 also reports the jobs nobody processes (refusals, skips), once
        mine = [job for i, job in enumerate(jobs) if i in share or not probes[i][1]]
    else:
        mine = [jobs[i] for i in sorted(share)]
    return BatchShare(
        mine,
        command,
        overwrite,
        barrier_timeout,
        env,
        progress,
        started,
        opened,
        has_work=bool(share),
        manifest=manifest,
        run_id=run,
        todo=[jobs[i] for i in todo],
    )


def _finish(share: BatchShare, result: BatchResult) -> int:
    """The end-of-job barrier, the ranks' counts, rank 0's summary line and record; the exit status."""
    command, env, manifest, barrier_timeout = share.command, share.env, share.manifest, share.barrier_timeout
    assert manifest is not None
    counts = {
        "total": result.total,
        "done": result.done,
        "skipped": result.skipped,
        "failed": result.failed,
        "image_seconds": result.image_seconds,
    }
    per_rank, reason = finish(env, counts, barrier_timeout)
    if per_rank is None:
        # a rank that stopped early (a user error on it alone) ends the wait at once; a slow or hung one, the timeout
        report(
            command,
            None,
            f"no summary: not every rank reached the end (waited up to {barrier_timeout:.0f} s: {reason})",
        )
        return 1  # on every rank: the job's state is unknown
    totals = total_counts(per_rank)
    failed = int(totals["failed"])
    if env.is_main:
        if env.distributed:
            job = BatchResult(
                **{k: int(totals[k]) for k in ("total", "done", "skipped", "failed")},
                seconds=time.perf_counter() - share.started,
                image_seconds=totals["image_seconds"],
            )
            print(summary_line(command, job), file=sys.stdout)
            report(
                command,
                None,
                f"{env.world_size} ranks: {totals['done']} done, {totals['skipped']} skipped, "
                f"{failed} failed of {totals['total']} image(s)",
            )
        manifest.write_record(
            {
                "event": "summary",
                "run": share.run_id,
                "time": now_iso(),
                "world_size": env.world_size,
                **{k: int(totals[k]) for k in ("total", "done", "skipped", "failed")},
            }
        )
    if failed and env.distributed and not outcome_is_returned():
        if env.is_main:
            report(
                command,
                None,
                f"the ranks exit 0 so that torchrun does not restart the job for image failures; "
                f"`flowlift status {manifest.path.parent}` exits 1 until they "
                "are redone",
            )
        return 0
    return 1 if failed else 0


def _record_plan(manifest: Manifest, jobs: list[Job], todo: list[int], run: str, env: DistEnv) -> None:
    """The ``job`` record, a failed record per refused input (and per output path that holds somebody
    else's image), and a ``skipped`` record for each finished output the manifest does not record as
    done (e.g. written just before a kill); the image records carry ``plan: true`` (the loop did not
    produce them). The facts are gathered first (what the manifest knows, the outputs' states), then
    the records are written."""
    waiting = set(todo)
    latest = latest_by_output(manifest.records())
    states = {i: existing_output(job) for i, job in enumerate(jobs) if i not in waiting and job.output is not None}
    refused = sum(job.refused for job in jobs) + sum(state.action == "refuse" for state in states.values())
    records: list[dict] = [
        {
            "event": "job",
            "run": run,
            "folder": _absolute(manifest.path.parent),  # where the outputs were: status finds them if it moves
            "time": now_iso(),
            "world_size": env.world_size,
            "inputs": len(jobs),
            "todo": len(todo),
            "refused": refused,
            "skipped": len(jobs) - len(todo) - refused,
        }
    ]
    for i, job in enumerate(jobs):
        if i in waiting or (job.output is None and not job.refused):
            continue
        if job.output is None or states[i].action == "refuse":
            records.append(
                {
                    **image_record(
                        input_path=_absolute(job.source),
                        input_sha256=None,
                        output=None if job.output is None else _absolute(job.output),
                        status="failed",
                        seconds=0.0,
                        error=job.note if job.output is None else states[i].note,
                        env=env,
                        run=run,
                    ),
                    "plan": True,
                }
            )
        elif latest.get(_absolute(job.output), {}).get("status") not in ("done", "skipped"):
            records.append(
                {
                    **image_record(
                        input_path=_absolute(job.source),
                        input_sha256=_sha256(job.source),
                        output=_absolute(job.output),
                        status="skipped",
                        seconds=0.0,
                        error=None,
                        env=env,
                        run=run,
                    ),
                    "plan": True,
                }
            )
    for record in records:
        manifest.write_record(record)


def _recording(process: Process, manifest: Manifest, run: str, env: DistEnv) -> Process:
    """``process`` that appends the image's manifest record once its output exists (or it failed)."""

    def recorded(source: Path, output: Path) -> None:
        start = time.perf_counter()

        def record(status: str, error: str | None) -> None:
            manifest.write_record(
                image_record(
                    input_path=_absolute(source),
                    input_sha256=_sha256(source),
                    output=_absolute(output),
                    status=status,
                    seconds=time.perf_counter() - start,
                    error=error,
                    env=env,
                    run=run,
                )
            )

        try:
            process(source, output)
        except Exception as error:  # recorded, then handled by run_jobs (one line) or propagated
            record("failed", error_line(error))
            raise
        record("done", None)

    return recorded


def _absolute(path: Path) -> str:
    return os.path.abspath(path)


def _sha256(path: Path) -> str | None:
    from flowlift.files.image_outputs import file_sha256

    try:
        return file_sha256(path)
    except OSError:
        return None
