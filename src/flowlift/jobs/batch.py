"""Images in, images out, many at a time: the batch semantics every such front-end shares.

``flowlift upscale``, ``flowlift colorfix``, the web app's batch tab and a torchrun shard all turn a
list of input files into one output file each, and promise the same things:

* **Planning** (:func:`plan_targets`, or :func:`plan_jobs` for a caller that names outputs by a
  function): every input gets one output path, in ``-o``'s folder or next to
  the input (or ``-o`` names the single output file). An input that is the planned output of another
  input is a previous result, not a source; an output that would overwrite an input, or that two
  inputs would share, is refused for that input alone.
* **Resume** (:func:`run_jobs`): an existing output is skipped unless ``overwrite``, so rerunning an
  interrupted command continues where it stopped — but only when it is a whole image of the
  expected size (:func:`existing_output`). An empty file is redone with a note, and so is one that
  flowlift wrote (its metadata says so) that is truncated, at another size (another run's
  settings) or made from another input (its recorded ``input_sha256``). **Anything else is the user's**
  — their image, a file that is no image, a truncated picture without flowlift's metadata, a FIFO or
  a link: it is never replaced without ``overwrite`` (not a regular file: never), and that input costs
  one line.
* **Debris**: when a run starts, the temporary files of runs killed mid-write in its output folders are
  removed (:func:`remove_debris`; only flowlift's own, never one a live run still writes). Planning writes
  and removes nothing.
* **Bad inputs and targets cost one line, up front**: an input that cannot be planned (missing,
  not a regular file, unreadable header, too large) or whose output cannot be written (folder not
  writable, format limit) is refused before any model is loaded; the batch goes on.
* **One line per written file** (``wrote PATH`` on stdout) and a summary line at the end with the
  counts, the total time and the time per written image, also when stderr is not a terminal
  (a progress bar on a terminal, one plain progress line per interval elsewhere:
  :func:`flowlift.console.progress_bar`).
* **One line per failure**: a user-facing error while processing one input (:data:`ITEM_ERRORS`)
  costs that input one line on stderr; the batch goes on and the exit status is 1 at the end.
* **Atomic outputs**: the ``process`` callback writes through :mod:`flowlift.files.atomic`, so an output
  name never holds a partial file.

The callbacks do the actual work, so the front-ends stay thin and this module knows nothing about
models.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from flowlift.console import format_seconds
from flowlift.errors import ITEM_ERRORS as _ITEM_ERRORS
from flowlift.errors import FlowliftError, said
from flowlift.files.atomic import remove_stale_temporaries, replace_refusal
from flowlift.files.output_paths import folder_problem, same_file
from flowlift.knobs import check_overwrite

__all__ = [
    "ITEM_ERRORS",
    "BatchResult",
    "ExistingOutput",
    "Job",
    "Target",
    "error_line",
    "existing_output",
    "folder_problem",
    "format_seconds",
    "pending",
    "plan_jobs",
    "plan_targets",
    "remove_debris",
    "report",
    "run_jobs",
    "summary_line",
]

#: Exceptions that fail one input of a batch (reported in one line) instead of the whole run (their home is
#: :data:`flowlift.errors.ITEM_ERRORS`, which the front-ends import).
ITEM_ERRORS = _ITEM_ERRORS


@dataclass(frozen=True)
class Job:
    """One input of a batch: its output path, or ``None`` and a note saying why it has none.

    ``refused``: an input without an output for a reason that counts as a failure (a missing file, an
    output that would replace its input); without it, an input with no output is skipped (a previous
    result, a reference). ``warning``: what the planner has to say about a job that runs (said once, before
    any work, by the command; e.g. passes that a size cap drops).
    """

    source: Path
    output: Path | None
    note: str = ""
    expected_size: tuple[int, int] | None = None  # (width, height) of a complete output, when known
    refused: bool = False
    warning: str = ""

    @classmethod
    def refusal(cls, source: Path, note: str) -> Job:
        """An input that gets no output and counts as failed; ``note`` is its one line."""
        return cls(source, None, note, refused=True)

    @classmethod
    def skip(cls, source: Path, note: str) -> Job:
        """An input that gets no output and is not a failure (``note`` says why, e.g. "skipped, ...")."""
        return cls(source, None, note)


@dataclass(frozen=True)
class Target:
    """One input with the output its caller planned for it, handed to :func:`plan_targets`.

    ``output`` is None when the caller could not plan one (``problem`` says why: the input is refused).
    A ``problem`` beside an output refuses that output too, but only after the planner's own rules
    (a previous result is still skipped, an unwritable folder is still named first).
    ``expected_size``: the (width, height) of a complete output (for :func:`existing_output`); ``warning``:
    the job's :attr:`Job.warning`.
    """

    source: Path
    output: Path | None
    problem: str = ""
    expected_size: tuple[int, int] | None = None
    warning: str = ""


@dataclass
class BatchResult:
    """Counts of a finished batch; ``exit_code`` is 1 when anything failed, else 0.

    ``seconds``: the whole run's wall time (from the ``started`` given to :func:`run_jobs`, e.g. before
    the models loaded); ``image_seconds``: the time spent on the written images themselves.
    """

    total: int = 0
    done: int = 0
    skipped: int = 0
    failed: int = 0
    seconds: float = 0.0
    image_seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0


def plan_jobs(
    inputs: Sequence[Path],
    output: str | None,
    output_name: Callable[[Path], str],
    *,
    expected_size: Callable[[Path], tuple[int, int]] | None = None,
    check_output: Callable[[Path, Path], None] | None = None,
) -> list[Job]:
    """One :class:`Job` per input; ``output_name(source)`` gives the output's file name.

    Outputs go to ``-o``'s folder, or next to each input without ``-o``; ``-o FILE`` names the single
    output (:func:`flowlift.files.output_paths.output_target`: a file name in a format flowlift does not write is
    refused for the whole run). ``expected_size(source)`` is the (width, height) of a complete output (for
    :func:`existing_output`); ``check_output(source, output)`` may refuse a target up front. An
    :data:`ITEM_ERRORS` exception from any of the three refuses that input alone, with its message as
    the note. The rules that follow are :func:`plan_targets`'.
    """
    from flowlift.files.output_paths import output_target

    single_file, out_dir = output_target(output, len(inputs))
    targets = []
    for path in inputs:
        try:
            out = single_file if single_file is not None else (out_dir or path.parent) / output_name(path)
        except ITEM_ERRORS as error:
            targets.append(Target(path, None, error_line(error)))
            continue
        try:
            if check_output is not None:
                check_output(path, out)
            size = expected_size(path) if expected_size is not None else None
        except ITEM_ERRORS as error:
            targets.append(Target(path, out, error_line(error)))
            continue
        targets.append(Target(path, out, expected_size=size))
    return plan_targets(targets)


def plan_targets(targets: Sequence[Target]) -> list[Job]:
    """One :class:`Job` per target, in order; nothing is written or removed.

    An input that is another input's planned output, or that is named ``<stem>_x<N>`` beside an input
    ``<stem>`` (:func:`flowlift.files.naming.source_of`, for any output folder), is skipped with a
    note, so rerunning a command over a folder resumes instead of processing its own results; an output
    that would replace its input, that two inputs would share, or whose folder cannot be written
    (:func:`folder_problem`) is refused, and so is a target with a ``problem``.
    """
    from flowlift.files.naming import source_of

    inputs = [target.source for target in targets]
    outputs = {t.source: t.output.resolve() for t in targets if t.output is not None}
    producers = {out: source for source, out in outputs.items() if out != source.resolve()}
    taken: dict[Path, Path] = {}
    writable: dict[Path, str | None] = {}
    jobs: list[Job] = []
    for target in targets:
        path, out = target.source, target.output
        if out is None:
            jobs.append(Job.refusal(path, target.problem))
            continue
        key = out.resolve()
        # an earlier result: planned from another input here, or named <stem>_x<N> beside its <stem> input
        # (whatever the output folder is, so `upscale "dir/*.png" -o out/` never upscales dir's old outputs)
        producer = producers.get(path.resolve()) or source_of(path, inputs)
        if producer is not None:
            jobs.append(Job.skip(path, f"skipped, it is the output of {producer}"))
        elif key == path.resolve() or same_file(out, path):  # by identity too: a hard link, a linked folder
            jobs.append(Job.refusal(path, f"output {out} would overwrite the input; choose another -o"))
        elif key in taken:
            jobs.append(
                Job.refusal(
                    path, f"output {out} is also the output of {taken[key]}; rename one, or use separate folders"
                )
            )
        else:
            if out.parent not in writable:
                writable[out.parent] = folder_problem(out.parent)
            problem = writable[out.parent] or target.problem
            if problem:
                jobs.append(Job.refusal(path, problem))
                continue
            taken[key] = path
            jobs.append(Job(path, out, expected_size=target.expected_size, warning=target.warning))
    return jobs


def remove_debris(jobs: Iterable[Job], before: float | None = None) -> None:
    """Remove the temporary files that killed runs left in the jobs' output folders
    (:func:`flowlift.files.atomic.remove_stale_temporaries`: never one that a live run still writes, nor one
    last written at or after ``before``, the start of this run; default: now)."""
    for folder in dict.fromkeys(job.output.parent for job in jobs if job.output is not None):
        remove_stale_temporaries(folder, before=before)


@dataclass(frozen=True)
class ExistingOutput:
    """What a run does about a job's output path: ``new`` (nothing there, or ``overwrite``), ``done``
    (a finished output: skip), ``redo`` (debris or flowlift's own older result: replace, ``note`` says
    why) or ``refuse`` (somebody else's image: leave it, ``note`` is the input's error line)."""

    action: str
    note: str = ""


def existing_output(job: Job, overwrite: bool = False) -> ExistingOutput:
    """The resume rule for one job's output path (see the module docstring).

    Only files that are empty, unreadable, truncated, or carry flowlift's own metadata at another
    size are redone: whatever else is there, flowlift did not write, and it is never destroyed
    without ``overwrite``.
    """
    from flowlift.files.image_outputs import inspect_existing

    overwrite = check_overwrite(overwrite)
    path = job.output
    if path is None or not os.path.lexists(path):
        return ExistingOutput("new")
    if refusal := replace_refusal(path):  # a FIFO, link, folder...: never replaced, --overwrite or not
        return ExistingOutput("refuse", refusal)
    if overwrite:
        return ExistingOutput("new")
    expected = job.expected_size
    due = f"a finished {expected[0]}x{expected[1]} image" if expected else "a finished image"
    try:
        found = inspect_existing(path, expected)
    except OSError as error:
        return ExistingOutput("refuse", f"cannot read the existing output {path}: {error_line(error)}")
    if found.empty:
        return ExistingOutput("redo", f"the existing file is empty, not {due}")
    if not found.by_flowlift and not (found.image and found.complete):  # issue 32.F: never flowlift's
        what = "a truncated image" if found.image else "no image"
        return ExistingOutput(
            "refuse", f"{path} exists and was not written by flowlift ({what}); use --overwrite to replace it"
        )
    if not found.complete:
        return ExistingOutput("redo", f"the existing file is a truncated flowlift output, not {due}")
    if expected is None or found.size == tuple(expected):
        if found.by_flowlift and (other := made_from_another_input(path, job.source)):
            return ExistingOutput("redo", other)
        return ExistingOutput("done")
    what = f"a {found.size[0]}x{found.size[1]} image" if found.size else "an image too large to open"
    if found.by_flowlift:
        return ExistingOutput("redo", f"the existing file is {what} from another flowlift run, not {due}")
    return ExistingOutput(
        "refuse",
        f"{path} exists and was not written by flowlift ({what} where this run writes "
        f"{expected[0]}x{expected[1]}); use --overwrite to replace it",
    )


def made_from_another_input(path: Path, source: Path) -> str | None:
    """Why flowlift's output at ``path`` is not ``source``'s result: its metadata's ``input_sha256`` is another
    file's (the same output name reused for another input, e.g. a second folder of the same stems); None when it
    names ``source``, names nothing, or cannot be read (unreadable metadata claims nothing)."""
    from flowlift.files.image_outputs import file_sha256, read_metadata

    try:
        record = read_metadata(path).get("flowlift")
        recorded = record.get("input_sha256") if isinstance(record, dict) else None
        if not isinstance(recorded, str) or recorded == file_sha256(source):
            return None
    except Exception:  # noqa: BLE001 - a damaged file or a missing source: nothing to compare
        return None
    return f"the existing file was made from another input than {source.name} (its recorded SHA-256 differs)"


def pending(jobs: Iterable[Job], overwrite: bool = False) -> list[Job]:
    """The jobs :func:`run_jobs` would process: new outputs and outputs to redo (all, ``overwrite``)."""
    return [job for job in jobs if job.output is not None and existing_output(job, overwrite).action in ("new", "redo")]


def error_line(error: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none), a FlowliftError's fields named
    as the running door says them (:func:`flowlift.errors.door_words`: the command line's options)."""
    text = said(error)
    return text.splitlines()[0] if text else type(error).__name__


def report(command: str, source: Path | None, text: str, write: Callable[[str], None] | None = None) -> None:
    """Print ``flowlift COMMAND: SOURCE: TEXT`` on stderr (the source left out when the text names it)."""
    prefix = "" if source is None or str(source) in text else f"{source}: "
    line = f"flowlift {command}: {prefix}{text}"
    if write is not None:
        write(line)
    else:
        print(line, file=sys.stderr)


def run_jobs(
    jobs: Iterable[Job],
    process: Callable[[Path, Path], None],
    *,
    command: str,
    overwrite: bool = False,
    progress: bool | None = None,
    started: float | None = None,
    debris_before: float | None = None,
    summary: bool = True,
) -> BatchResult:
    """Run ``process(source, output)`` for every job with an output; returns the counts and times.

    Jobs without an output print their note (a refusal counts as failed, a "skipped" note does not);
    an existing output follows :func:`existing_output` (skipped, redone with a note, or refused as
    somebody else's file: one line, counted as failed); an :data:`ITEM_ERRORS` exception from
    ``process`` prints one line and the batch goes on. ``progress``: the ``enabled`` of
    :func:`flowlift.console.progress_bar` over the jobs (``None``: a bar on a terminal, plain lines
    elsewhere); a ``process`` with an ``expect(sources)`` method is told the sources it will get, in order,
    before the first. ``summary``: print the summary line (a rank of a launched job leaves it to rank 0).
    ``started``: the :func:`time.perf_counter` the summary's total
    time counts from (default: now). ``debris_before``: the :func:`time.time` before which a temporary
    file in an output folder can be a killed run's (default: now; a job of several ranks passes a time
    from before any rank began to write, see :func:`remove_debris`).
    """
    from tqdm import tqdm

    from flowlift.console import progress_bar

    started = time.perf_counter() if started is None else started
    jobs = list(jobs)
    remove_debris(jobs, before=debris_before)  # debris of killed runs, before this run writes anything
    result = BatchResult(total=len(jobs))
    todo: list[Job] = []
    absent: set[Path] = set()  # outputs no file held when the run was planned
    for job in jobs:
        if job.output is None:
            report(command, job.source, job.note)
            if job.refused:
                result.failed += 1
            else:
                result.skipped += 1
        else:
            state = existing_output(job, overwrite)
            if state.action == "done":
                report(command, job.source, f"skipped, {job.output} exists (--overwrite to replace)")
                result.skipped += 1
            elif state.action == "refuse":
                report(command, job.source, state.note)
                result.failed += 1
            else:
                if state.action == "redo":
                    report(command, job.source, f"redoing {job.output}: {state.note}")
                if not os.path.lexists(job.output):
                    absent.add(job.output)
                todo.append(job)
    expect = getattr(process, "expect", None)
    if callable(expect):  # the step plans its progress stages for exactly the images that will run
        expect([job.source for job in todo])
    bar = progress_bar(todo, desc="images", unit="img", enabled=progress, file=sys.stderr)
    try:
        for job in bar:
            bar.set_postfix_str(job.source.name)
            if job.output in absent and (state := _appeared(job, overwrite)) is not None:
                result.skipped += state.action == "done"
                result.failed += state.action == "refuse"
                report(command, job.source, state.note, write=lambda line: tqdm.write(line, file=sys.stderr))
                continue
            begun = time.perf_counter()
            try:
                process(job.source, job.output)
            except ITEM_ERRORS as error:
                result.failed += 1
                write = lambda line: tqdm.write(line, file=sys.stderr)  # noqa: E731 (above the bar, if one is drawn)
                report(command, job.source, error_line(error), write=write)
            else:
                result.done += 1
                result.image_seconds += time.perf_counter() - begun
                tqdm.write(f"wrote {job.output}", file=sys.stdout)
    finally:
        bar.close()  # its progress lines stop with the loop, also on Ctrl-C
    if result.failed:
        report(command, None, f"{result.failed} of {result.total} image(s) failed")
    result.seconds = time.perf_counter() - started
    if summary:
        print(summary_line(command, result), file=sys.stdout)
    return result


def _appeared(job: Job, overwrite: bool) -> ExistingOutput | None:
    """The resume rule again for an output absent at planning and there now (a user's file, a concurrent run's), else
    None: a user's file saved there meanwhile was replaced without ``--overwrite``."""
    if job.output is None or not os.path.lexists(job.output):
        return None
    state = existing_output(job, overwrite)
    if state.action == "done":
        return ExistingOutput("done", f"skipped, {job.output} appeared during the run (--overwrite to replace)")
    if state.action == "refuse":
        return ExistingOutput("refuse", f"{state.note} (it appeared during the run)")
    return None


def summary_line(command: str, result: BatchResult) -> str:
    """The last line of every batch: counts, the total time and the time per written image, e.g.
    ``flowlift upscale: 3 written, 1 skipped, 0 failed (4 inputs) in 41.0 s, 12.1 s per image``."""
    line = (
        f"flowlift {command}: {result.done} written, {result.skipped} skipped, {result.failed} failed "
        f"({result.total} input{'s' if result.total != 1 else ''}) in {format_seconds(result.seconds)}"
    )
    if result.done:
        line += f", {format_seconds(result.image_seconds / result.done)} per image"
    return line


def no_images_in(inputs: Sequence[str | os.PathLike[str]]) -> FlowliftError:
    """The one line for inputs that list no image (an empty folder, a folder of other files): it names them."""
    shown = [str(item) for item in inputs]
    given = ", ".join(shown[:3]) + (f" and {len(shown) - 3} more" if len(shown) > 3 else "")
    return FlowliftError(f"no input images in {given}: give image files, or folders holding them (not searched below)")
