"""Images in, images out, many at a time: the batch semantics every such front-end shares.

``flowlift upscale``, ``flowlift colorfix``, the web app's batch tab and a torchrun shard all turn a
list of input files into one output file each, and promise the same things:

* **Planning** (:func:`plan_jobs`): every input gets one output path, in ``-o``'s folder or next to
  the input (or ``-o`` names the single output file). An input that is the planned output of another
  input is a previous result, not a source; an output that would overwrite an input, or that two
  inputs would share, is refused for that input alone.
* **Resume** (:func:`run_jobs`): an existing output is skipped unless ``overwrite``, so rerunning an
  interrupted command continues where it stopped.
* **One line per failure**: a user-facing error while processing one input (:data:`ITEM_ERRORS`)
  costs that input one line on stderr; the batch goes on and the exit status is 1 at the end.
* **Atomic outputs**: the ``process`` callback writes through :mod:`flowlift.atomic`, so an output
  name never holds a partial file.

The callbacks do the actual work, so the front-ends stay thin and this module knows nothing about
models.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from flowlift.errors import FlowliftError

__all__ = [
    "ITEM_ERRORS",
    "BatchResult",
    "Job",
    "error_line",
    "output_target",
    "pending",
    "plan_jobs",
    "report",
    "run_jobs",
]

#: Exceptions that fail one input of a batch (reported in one line) instead of the whole run.
ITEM_ERRORS: tuple[type[BaseException], ...] = (FlowliftError, OSError, RuntimeError, MemoryError, ValueError)


@dataclass(frozen=True)
class Job:
    """One input of a batch: its output path, or ``None`` and a note saying why it has none."""

    source: Path
    output: Path | None
    note: str = ""

    @property
    def refused(self) -> bool:
        """True when the input has no output for a reason that counts as a failure (not a skip)."""
        return self.output is None and not self.note.startswith("skipped")


@dataclass
class BatchResult:
    """Counts of a finished batch; ``exit_code`` is 1 when anything failed, else 0."""

    total: int = 0
    done: int = 0
    skipped: int = 0
    failed: int = 0

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0


def output_target(output: str | None, count: int, image_suffixes: Sequence[str]) -> tuple[Path | None, Path | None]:
    """Interpret ``-o``: ``(single output file, None)``, ``(None, output folder)`` or ``(None, None)``.

    A path with an image suffix that is not an existing folder names one output file, which is only
    valid for a single input.
    """
    if not output:
        return None, None
    target = Path(output).expanduser()
    if target.suffix.lower() in image_suffixes and not target.is_dir():
        if count != 1:
            raise FlowliftError(f"-o {target} names one file but {count} inputs were given; pass a folder")
        return target, None
    return None, target


def plan_jobs(
    inputs: Sequence[Path],
    output: str | None,
    output_name: Callable[[Path], str],
    image_suffixes: Sequence[str],
) -> list[Job]:
    """One :class:`Job` per input; ``output_name(source)`` gives the output's file name.

    Outputs go to ``-o``'s folder, or next to each input without ``-o``; ``-o FILE`` names the single
    output. An input that is another input's planned output (``a_x2.png`` beside ``a.png``) is
    skipped with a note, so rerunning a command over a folder resumes instead of processing its own
    results; an output that would replace its input, or that two inputs would share, is refused.
    """
    single_file, out_dir = output_target(output, len(inputs), image_suffixes)

    def output_of(path: Path) -> Path:
        if single_file is not None:
            return single_file
        folder = out_dir if out_dir is not None else path.parent
        return folder / output_name(path)

    outputs = {path: output_of(path) for path in inputs}
    producers = {outputs[p].resolve(): p for p in inputs if outputs[p].resolve() != p.resolve()}
    taken: dict[Path, Path] = {}
    jobs: list[Job] = []
    for path in inputs:
        out = outputs[path]
        key = out.resolve()
        if path.resolve() in producers:
            jobs.append(Job(path, None, f"skipped, it is the output of {producers[path.resolve()]}"))
        elif key == path.resolve():
            jobs.append(Job(path, None, f"output {out} would overwrite the input; choose another -o"))
        elif key in taken:
            jobs.append(Job(path, None, f"output {out} is also the output of {taken[key]}; use separate folders"))
        else:
            taken[key] = path
            jobs.append(Job(path, out))
    return jobs


def pending(jobs: Iterable[Job], overwrite: bool = False) -> list[Job]:
    """The jobs :func:`run_jobs` would process: those with an output that is missing (or ``overwrite``)."""
    return [job for job in jobs if job.output is not None and (overwrite or not job.output.exists())]


def error_line(error: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none)."""
    text = str(error)
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
) -> BatchResult:
    """Run ``process(source, output)`` for every job with an output; returns the counts.

    Jobs without an output print their note (a refusal counts as failed, a "skipped" note does not);
    an existing output is skipped unless ``overwrite``; an :data:`ITEM_ERRORS` exception from
    ``process`` prints one line and the batch goes on. ``progress``: a tqdm bar over the jobs
    (``None``: only on a terminal).
    """
    from tqdm import tqdm

    jobs = list(jobs)
    result = BatchResult(total=len(jobs))
    todo: list[Job] = []
    for job in jobs:
        if job.output is None:
            report(command, job.source, job.note)
            if job.refused:
                result.failed += 1
            else:
                result.skipped += 1
        elif job.output.exists() and not overwrite:
            report(command, job.source, f"skipped, {job.output} exists (--overwrite to replace)")
            result.skipped += 1
        else:
            todo.append(job)
    disable = None if progress is None else not progress
    bar = tqdm(todo, desc="images", unit="img", disable=disable, file=sys.stderr)
    for job in bar:
        bar.set_postfix_str(job.source.name)
        try:
            process(job.source, job.output)
        except ITEM_ERRORS as error:
            result.failed += 1
            report(command, job.source, error_line(error), write=lambda line: tqdm.write(line, file=sys.stderr))
        else:
            result.done += 1
    if result.failed:
        report(command, None, f"{result.failed} of {result.total} image(s) failed")
    return result
