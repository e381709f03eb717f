"""``flowlift status OUT``: the state of a job's output folder, from its manifest or from its files.

:func:`print_job_status` reads the job manifest when the folder has one (a ``torchrun`` job,
:func:`flowlift.jobs.manifest.job_status`), else the files themselves (:func:`folder_status`).

A plain (one-process) run writes no manifest (:mod:`flowlift.jobs.scaleout`): its record is the outputs
themselves, and they say enough. Every output flowlift writes carries its metadata (the command and
the source's name), a killed write leaves a ``.flowlift-partial`` temporary folder whose lock tells a
live writer from debris (:mod:`flowlift.files.atomic`), and a damaged output fails the same check the
resume rule applies (:func:`flowlift.files.image_outputs.inspect_existing`). So the folder's state is:

* **done** — whole images with flowlift's metadata;
* **partial** — flowlift's temporary folders: being written now (locked) or left by a killed run;
* **broken** — empty, unreadable or truncated images at output names (``<stem>_x2.png``...: the next run
  redoes them); one at any other name is an input the run cannot read (**unreadable input**: it fails
  every run until it is replaced or removed);
* **changed** — flowlift's outputs whose input, in this folder, is no longer the file they were made
  from (its SHA-256 differs from the recorded one: the next run redoes them);
* **missing** — images in the folder that flowlift did not write (sources, when outputs are written
  next to their inputs, whatever their names) and that no output here was made from. Inputs kept in
  another folder cannot be seen from here: rerunning the command is what finishes those (finished
  outputs are skipped). ``flowlift colorfix``'s references are no inputs: an image an output here
  records as its reference, or (where colorfix outputs are) the ``<stem>`` another image here pairs
  with as ``<stem>_x<N>``, is not missing.

A report folder (``flowlift bands``, ``flowlift eval``: figures with flowlift's ``Software`` text and no
per-image record) holds no job's outputs: :func:`print_job_status` says so in one line.

Writing a manifest in plain runs too was the other way; it would add a file to every output folder
and send every later run through the torchrun code path, to record what the outputs already say.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from flowlift.errors import FlowliftError


@dataclass
class FolderStatus:
    """What the files in one output folder say about the runs that wrote it."""

    folder: Path
    done: list[Path] = field(default_factory=list)
    writing: list[Path] = field(default_factory=list)  # temporary files a live process holds
    stale: list[Path] = field(default_factory=list)  # temporary files of killed runs
    broken: list[tuple[Path, str]] = field(default_factory=list)
    bad_inputs: list[tuple[Path, str]] = field(default_factory=list)  # incomplete images at no output's name
    changed: list[Path] = field(default_factory=list)  # outputs whose input here is another file now
    missing: list[Path] = field(default_factory=list)
    reports: list[tuple[Path, str]] = field(default_factory=list)  # report figures and the command that drew them

    @property
    def complete(self) -> bool:
        """Outputs are there and nothing is partial, broken, unreadable, changed or missing."""
        pending = self.writing or self.stale or self.broken or self.bad_inputs or self.changed or self.missing
        return bool(self.done) and not pending


def _recorded_name(metadata: dict, role: str) -> str | None:
    """The file name an output records as its ``input`` or (colorfix) its ``reference``."""
    record = metadata.get("flowlift")  # read_metadata gives every layout as schema 1
    name = record.get(role) if isinstance(record, dict) else None
    return Path(name).name if isinstance(name, str) else None


def _report_command(metadata: dict) -> str | None:
    """The command that drew a report figure: ``Software: flowlift <version> <command>`` without the per-image
    ``flowlift`` record every output carries (``bands``, ``eval``), else None."""
    software = metadata.get("Software")
    words = software.split() if isinstance(software, str) else []
    if isinstance(metadata.get("flowlift"), dict) or len(words) < 3 or words[0] != "flowlift":
        return None
    return " ".join(words[2:])


def folder_status(folder: str | os.PathLike) -> FolderStatus:
    """Read the state of ``folder`` from its files (see the module docstring).

    A folder that cannot be read is one FlowliftError line; a file in it that cannot be read is
    listed as broken (``unreadable: Permission denied``), never a traceback.
    """
    from flowlift.files.naming import source_stem

    folder = Path(folder)
    try:
        with os.scandir(folder) as listing:
            names = sorted(entry.name for entry in listing)
    except NotADirectoryError:
        raise FlowliftError(f"{folder} is a file: give the output folder it is in") from None
    except FileNotFoundError:
        raise FlowliftError(f"{folder}: no such folder") from None
    except OSError as error:  # permission denied: one line, not a traceback
        raise FlowliftError(f"cannot read the folder {folder}: {error.strerror or type(error).__name__}") from None
    status = FolderStatus(folder)
    others: list[Path] = []  # whole images flowlift did not write
    made_from: set[str] = set()  # stems of the images the outputs here were made from
    references: set[str] = set()  # stems of the images colorfix outputs here were fixed against
    for name in names:
        entry = folder / name
        try:
            _sort_entry(entry, status, others, made_from, references)
        except OSError as error:  # a file this user may not read
            why = error.strerror or type(error).__name__
            status.broken.append((entry, f"unreadable: {why}; the next run cannot read it either and refuses it"))
            made_from.add(source_stem(entry.stem) or entry.stem)
    if references:  # colorfix ran here: a <stem> beside a <stem>_x<N> is that one's reference, not an input
        references |= {stem for p in others if (stem := source_stem(p.stem))}
    status.missing = [p for p in others if p.stem not in made_from | references]
    return status


def _sort_entry(
    entry: Path, status: FolderStatus, others: list[Path], made_from: set[str], references: set[str]
) -> None:
    """File one folder entry under ``status`` (or ``others``: a whole image flowlift did not write; a report figure
    under ``status.reports``), the stems its metadata names as input into ``made_from``, as reference into
    ``references``."""
    from flowlift.files.atomic import is_stale_temporary, is_temporary, temporary_in_use
    from flowlift.files.image_outputs import inspect_existing, is_flowlift_metadata, read_metadata
    from flowlift.files.images import IMAGE_SUFFIXES
    from flowlift.files.naming import source_stem
    from flowlift.jobs.batch import made_from_another_input
    from flowlift.jobs.manifest import broken_output_reason

    if temporary_in_use(entry):
        status.writing.append(entry)
        return
    if is_stale_temporary(entry):
        status.stale.append(entry)
        return
    if not entry.is_file() or is_temporary(entry):
        return  # a name shaped like a temporary without flowlift's proof is nobody's business here
    if entry.suffix.lower() not in IMAGE_SUFFIXES:
        return
    found = inspect_existing(entry)
    if not (found.image and found.complete):
        if source_stem(entry.stem) is None:  # no output's name: a user's image the run cannot read
            status.bad_inputs.append((entry, "empty" if found.empty else "truncated" if found.image else "unreadable"))
            made_from.add(entry.stem)  # not "missing" as well
            return
        status.broken.append((entry, broken_output_reason(entry) or "changed while read"))
        made_from.add(source_stem(entry.stem) or entry.stem)  # its source is not missing: it is broken
        return
    try:
        metadata = read_metadata(entry) if found.size is not None else {}
    except Exception:  # noqa: BLE001 - a picture whose metadata Pillow cannot read claims nothing
        metadata = {}
    if not is_flowlift_metadata(metadata):
        others.append(entry)
        return
    if command := _report_command(metadata):  # a report's figure (bands.png, crops.png): no job's output
        status.reports.append((entry, command))
        return
    if reference := _recorded_name(metadata, "reference"):
        references.add(Path(reference).stem)
    name = _recorded_name(metadata, "input")
    source = entry.parent / name if name else None
    if source is not None and source.is_file() and made_from_another_input(entry, source):
        status.changed.append(entry)  # the input beside it changed since: the next run redoes it
    else:
        status.done.append(entry)
    made_from.add(Path(name).stem if name else (source_stem(entry.stem) or entry.stem))


def format_folder_status(status: FolderStatus) -> str:
    """Human-readable lines for :func:`folder_status`."""
    lines = [
        f"{status.folder}: no job manifest (a run without torchrun keeps none); from the files: "
        f"{len(status.done)} done, {len(status.writing) + len(status.stale)} partial, "
        f"{len(status.broken)} broken, {len(status.missing)} missing"
        + (f", {len(status.changed)} changed" if status.changed else "")
        + (f", {len(status.bad_inputs)} unreadable input(s)" if status.bad_inputs else "")
    ]
    lines += [f"  being written now: {p.name}" for p in status.writing]
    lines += [f"  partial: {p.name} (a killed run's; the next run removes it)" for p in status.stale]
    lines += [f"  broken: {p.name} ({reason})" for p, reason in status.broken]
    lines += [f"  changed: {p.name} (its input here changed since; the next run redoes it)" for p in status.changed]
    lines += [
        f"  unreadable input: {p.name} ({reason}; every run fails on it: replace or remove it)"
        for p, reason in status.bad_inputs
    ]
    lines += [f"  missing: {p.name} has no output here" for p in status.missing]
    if status.complete:
        lines.append("complete (outputs of inputs kept in other folders are not listed: rerun to be sure)")
    elif status.writing:
        lines.append("a run is writing here now")
    else:
        lines.append(
            "not complete: rerun the same command to finish"
            if status.done or status.missing or status.changed
            else "no flowlift outputs here"
        )
    return "\n".join(lines)


def check_job_folder(status: FolderStatus) -> None:
    """One FlowliftError line when the folder holds a report (``flowlift bands``, ``flowlift eval``) and no job's
    outputs: its figures are no outputs of inputs, so "complete" or "missing" would say nothing true of it."""
    if not status.reports or status.done or status.broken or status.changed or status.writing or status.stale:
        return
    commands = ", ".join(dict.fromkeys(command for _, command in status.reports))
    figures = ", ".join(path.name for path, _ in status.reports)
    raise FlowliftError(
        f"{status.folder} is a flowlift {commands} report ({figures}), not a job's output folder: status reads the "
        "folders upscale and colorfix (img2img, hires) write images into, and a torchrun job's manifest"
    )


def print_job_status(folder: str | os.PathLike) -> int:
    """Print the account of the job in ``folder`` (its manifest's, else its files'); 0 when the job is
    complete, else 1. A folder that is not there is one FlowliftError line."""
    from flowlift.jobs.manifest import Manifest, format_status, job_status

    if not Manifest(folder).exists():
        found = folder_status(folder)
        check_job_folder(found)
        print(format_folder_status(found))
        return 0 if found.complete else 1
    status = job_status(folder)
    print(format_status(status))
    return 0 if status.complete else 1
