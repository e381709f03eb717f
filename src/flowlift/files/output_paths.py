"""Can an output be written here? Checked before any model loads, so a bad ``-o`` costs no work.

Every writer asks the same three questions of an output path: is its name within the file system's
limit (255 bytes on most), can a file be created in its folder (or in the nearest existing ancestor,
which ``mkdir`` will create the folder in: a plain file there, ``/proc``, a read-only mount or no
permission all fail), and is whatever is already there a regular file (never a FIFO, socket, device,
link or folder: :func:`flowlift.files.atomic.replace_refusal`). The answer is a probe, not the
permission bits, which say nothing reliable for root or on NFS. And no output is ever one of the run's
inputs (:func:`same_file_error`): asked by identity (device and inode), never by spelling, so a
symlinked folder, ``..``, a link or a hard link to the input are all the input. A full disk passes the probe (an
empty file needs no space); the write that then fails is one line too
(:class:`flowlift.files.atomic.OutputWriteError`) and leaves nothing under the output name.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from flowlift.errors import FIELD_MARK, FlowliftError
from flowlift.files.atomic import name_limit, replace_refusal
from flowlift.files.output_checks import OUTPUT_FORMAT_OF_SUFFIX, OUTPUT_SUFFIXES


def _nearest_existing(folder: Path) -> Path:
    existing = folder
    while not os.path.lexists(existing) and existing.parent != existing:
        existing = existing.parent
    return existing


def folder_problem(folder: str | os.PathLike) -> str | None:
    """Why outputs cannot be written into ``folder``, or None when they can (nothing is left behind).

    Probed by creating and removing a temporary file in ``folder`` or, when it does not exist yet, in
    its nearest existing ancestor (which the writer's ``mkdir`` will create it in): a permission
    check alone would pass for root on a read-only mount.
    """
    folder = Path(folder)
    existing = _nearest_existing(folder)
    if not existing.is_dir():
        return f"cannot write outputs into {folder}: {existing} is not a folder"
    try:
        descriptor, name = tempfile.mkstemp(prefix=".flowlift-probe.", dir=existing)
        os.close(descriptor)
        os.unlink(name)
    except OSError as error:
        reason = error.strerror or type(error).__name__
        return f"cannot write outputs into {folder}: {reason}"
    return None


def check_output_folder(folder: str | os.PathLike) -> None:
    """Refuse ``-o FOLDER`` for the whole run, in one line before any input (not one failure per input), when it, or
    the nearest part of it that exists, is not a folder (a file named without an image suffix), or when no file can
    be created there (:func:`folder_problem`: a read-only mount, no permission)."""
    folder = Path(folder)
    existing = _nearest_existing(folder)
    if existing.is_dir():
        if problem := folder_problem(folder):
            raise FlowliftError(problem, field="output")
        return
    hint = "give a folder, or an image file name (.png/.jpg/.webp...) for one input"
    if existing == folder:
        raise FlowliftError(f"{FIELD_MARK} {folder} exists and is not a folder: {hint}", field="output")
    raise FlowliftError(f"{FIELD_MARK} {folder}: {existing} is not a folder; {hint}", field="output")


def name_problem(path: str | os.PathLike) -> str | None:
    """Why ``path``'s file name is too long for its file system, or None."""
    path = Path(path)
    existing = _nearest_existing(path.parent)
    limit = name_limit(existing if existing.is_dir() else existing.parent)
    size = len(path.name.encode("utf-8", "surrogateescape"))
    if size > limit:
        return (
            f"cannot write {path}: its file name is {size} bytes, over the file system's limit of {limit}; "
            "choose a shorter -o"
        )
    return None


def output_file_problem(path: str | os.PathLike) -> str | None:
    """Why one output file cannot be written at ``path`` (see the module docstring), or None."""
    path = Path(path)
    return name_problem(path) or folder_problem(path.parent) or replace_refusal(path)


def check_output_file(path: str | os.PathLike) -> None:
    """:func:`output_file_problem` as one FlowliftError line."""
    if problem := output_file_problem(path):
        raise FlowliftError(problem)


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """True when ``a`` and ``b`` both exist and are one file: the same device and inode (links followed).

    Not the spelling: ``dir/r.png``, ``link-to-dir/r.png``, ``x/../dir/r.png`` and a hard link of it
    are all the same file.
    """
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


InputPaths = Mapping[str, "str | os.PathLike | Iterable[str | os.PathLike] | None"]


def same_file_error(output: str | os.PathLike, inputs: InputPaths) -> FlowliftError | None:
    """The one-line error when ``output`` is one of ``inputs`` (:func:`same_file`), else None.

    ``inputs`` maps the field that gave an input (``"image"``, ``"references"``: the Python API's word, which
    each door says in its own, ``--reference``) to a path, several paths or None. Writing an output replaces
    the file under its name, so an output that is an input would destroy the input (issue 36.2): refused,
    ``--overwrite`` or not, whatever the input's own origin.
    """
    if not os.path.lexists(output):
        return None
    for role, given in inputs.items():
        if given is None:
            continue
        paths = [given] if isinstance(given, (str, os.PathLike)) else list(given)
        for path in paths:
            if path is not None and same_file(output, path):
                same = "" if os.fspath(path) == os.fspath(output) else f" ({path})"
                return FlowliftError(
                    f"{output} is the input {FIELD_MARK}{same}; an output never replaces an input: "
                    "choose another output",
                    field=role,
                )
    return None


def check_not_an_input(output: str | os.PathLike, inputs: InputPaths) -> None:
    """Raise :func:`same_file_error`'s error, if any."""
    if error := same_file_error(output, inputs):
        raise error


def check_report_folder(folder: str | os.PathLike, inputs: Mapping[str, Iterable[str | os.PathLike]]) -> None:
    """One FlowliftError line when ``folder`` (a report's ``output``) is a folder the run reads its images from:
    one given as an input (its field -> the items as given: files, folders, glob patterns) or a glob's folder. The
    report's own images (``bands.png``, ``crops.png``) would be measured as photos by the next run on that folder.
    Compared by identity (a link or ``..`` to the folder is the folder)."""
    if not os.path.isdir(folder):
        return
    target = os.stat(folder)
    for role, items in inputs.items():
        for item in items:
            text = os.fspath(item)
            read = text if os.path.isdir(text) else os.path.dirname(text) or "." if "*" in text or "?" in text else None
            if read is not None and os.path.isdir(read) and os.path.samestat(os.stat(read), target):
                raise FlowliftError(
                    f"{FIELD_MARK} {os.fspath(folder)} is the {FIELD_MARK} folder {text}: the report's images would "
                    "be read back as inputs next time; write the report to another folder",
                    field=("output", role),
                )


def check_output_format(value: object, field: str = "output_format") -> None:
    """One FlowliftError line naming ``field`` unless ``value`` names a format flowlift writes (``png``, ``tif``:
    :data:`~flowlift.files.output_checks.OUTPUT_SUFFIXES`); a format it only reads (``gif``) failed every image."""
    if not isinstance(value, str) or f".{value.lower()}" not in OUTPUT_SUFFIXES:
        written = ", ".join(suffix[1:] for suffix in OUTPUT_SUFFIXES)
        raise FlowliftError(f"{field} must be a format flowlift writes ({written}), got {value!r}", field=field)


def names_output_file(output: str | os.PathLike | None) -> bool:
    """True when ``-o OUTPUT`` names one output file, not a folder: its last name has a suffix (``x.png``, and a new
    ``notes.txt`` too, which :func:`output_file_format` then refuses), it is no existing folder, and it does not end
    in a path separator (``out.v2/`` is a folder). An existing file in a format flowlift does not write is neither:
    :func:`check_output_folder` names it (a user's file, never replaced). The one rule of every
    command whose ``-o`` takes either."""
    if not output:
        return False
    text = os.fspath(output)
    if text.endswith((os.sep, os.altsep or os.sep)):
        return False
    target = Path(text).expanduser()
    if not target.suffix or target.is_dir():
        return False
    return target.suffix.lower() in OUTPUT_SUFFIXES or not os.path.lexists(target)


def output_file_format(path: str | os.PathLike) -> str:
    """The format name (``png``, ``jpg``, ``tif``...) of ``-o FILE``'s suffix, or one line naming ``output`` that
    lists the suffixes flowlift writes: a file name flowlift cannot write is refused, never made a folder."""
    suffix = Path(path).suffix.lower()
    if suffix not in OUTPUT_SUFFIXES:
        raise FlowliftError(
            f"{FIELD_MARK} {os.fspath(path)}: unsupported output format {suffix or '(none)'}; give a file name ending "
            f"{', '.join(OUTPUT_SUFFIXES)}, or a folder ({os.fspath(path)}{os.sep} names one)",
            field="output",
        )
    return OUTPUT_FORMAT_OF_SUFFIX[suffix]


def output_target(output: str | os.PathLike | None, count: int) -> tuple[Path | None, Path | None]:
    """Interpret ``-o`` for ``count`` inputs: ``(single output file, None)``, ``(None, output folder)`` or
    ``(None, None)`` (no ``-o``). A file name (:func:`names_output_file`) must end in a suffix flowlift writes
    (:func:`output_file_format`) and holds one output, so it takes one input, and its folder must take a file
    (:func:`folder_problem`: refused for the run, not failed as its input); anything else is a folder that must
    be one or be creatable (:func:`check_output_folder`)."""
    if not output:
        return None, None
    target = Path(output).expanduser()
    if names_output_file(output):
        output_file_format(target)
        if count != 1:
            raise FlowliftError(
                f"{FIELD_MARK} {target} names one file but {count} inputs were given; pass a folder", field="output"
            )
        if problem := folder_problem(target.parent):
            raise FlowliftError(problem, field="output")
        return target, None
    check_output_folder(target)
    return None, target
