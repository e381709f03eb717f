"""The replace rule for report and data files at fixed names, and how flowlift knows its own by content.

The project's one rule (docs/architecture.md, "Every writer and the replace rule"): at a name a
command writes, only a regular file (or nothing) is ever replaced: a link (dangling or not), FIFO,
socket, device or folder is one line, ``--overwrite`` or not, and a FIFO is never opened. Without
``--overwrite`` only an empty file or one flowlift wrote is replaced; flowlift's own is told by its
content, never its name: a JSON report's ``flowlift`` version field (:func:`stamp`), a Markdown
report's first line (:func:`markdown_stamp`), a PNG's ``Software: flowlift ...`` text or flowlift
metadata, a safetensors file's metadata. Every command checks all its names with
:func:`check_replaceable` before any model loads or any work starts.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flowlift.errors import FIELD_MARK, FlowliftError
from flowlift.files.atomic import replace_refusal
from flowlift.files.json_input import parse_json
from flowlift.files.output_checks import NON_FINITE_TEXT
from flowlift.knobs import check_overwrite
from flowlift.version import __version__

Recogniser = Callable[[Path], bool]
_HEAD_BYTES = 1 << 20  # a recogniser reads at most this much of a file
_REPORT_BYTES = 256 << 20  # a JSON report of many images is large, but not this large: past it, not ours
_MARKDOWN_PREFIX = "<!-- written by flowlift "


def software(command: str) -> str:
    """The ``Software`` text of a file ``command`` writes: ``flowlift 0.1.0 eval``."""
    return f"flowlift {__version__} {command}"


def stamp(command: str) -> dict[str, str]:
    """The ``flowlift`` field of a JSON report: who wrote it (the mark :func:`json_report` looks for)."""
    return {"version": __version__, "command": command}


def markdown_stamp(command: str) -> str:
    """The first line of a Markdown report (an HTML comment: invisible where the Markdown is shown)."""
    return f"{_MARKDOWN_PREFIX}{__version__} {command} -->\n"


def head(path: Path, limit: int = _HEAD_BYTES) -> bytes:
    """The first ``limit`` bytes of the regular file ``path`` (a FIFO in its place fails, never blocks)."""
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
    try:
        chunks, left = [], limit
        while left > 0 and (chunk := os.read(descriptor, min(left, 1 << 16))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(descriptor)


def json_object(path: Path, limit: int = _HEAD_BYTES) -> dict[str, Any] | None:
    """``path`` as a JSON object when it is one within ``limit`` bytes, else None."""
    try:
        if os.stat(path).st_size > limit:
            return None
        value = parse_json(head(path, limit))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def report_json(value: Any) -> bytes:
    """``value`` as strict JSON (RFC 8259, which has no Infinity or NaN: Python's ``json.dumps`` would write
    them as bare words other parsers refuse), indented one space: a non-finite float becomes the string
    ``"inf"``, ``"-inf"`` or ``"nan"`` (``float()`` reads each back)."""

    def strict(item: Any) -> Any:
        if isinstance(item, float) and not math.isfinite(item):
            return NON_FINITE_TEXT.get(item, "nan")
        if isinstance(item, dict):
            return {key: strict(child) for key, child in item.items()}
        if isinstance(item, (list, tuple)):
            return [strict(child) for child in item]
        return item

    return json.dumps(strict(value), indent=1, allow_nan=False).encode()


def report_float(value: Any) -> float | None:
    """A number as :func:`report_json` wrote it back as a float: a JSON number, or the string ``"inf"``, ``"-inf"``
    or ``"nan"``; None for anything else (a bool, another string, a list...)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if value in (*NON_FINITE_TEXT.values(), "nan"):
        return float(value)
    return None


def json_report(command: str, keys: set[str]) -> Recogniser:
    """A JSON object with every one of ``keys`` and ``command``'s :func:`stamp` field."""

    def recognise(path: Path) -> bool:
        value = json_object(path, _REPORT_BYTES)
        mark = value.get("flowlift") if value is not None else None
        return isinstance(mark, dict) and mark.get("command") == command and keys <= set(value or {})

    return recognise


def markdown_report(command: str) -> Recogniser:
    """A text file whose first line is ``command``'s :func:`markdown_stamp`."""

    def recognise(path: Path) -> bool:
        first = head(path, 4096).split(b"\n", 1)[0].decode("utf-8", "replace")
        return first.startswith(_MARKDOWN_PREFIX) and first.rstrip().endswith(f" {command} -->")

    return recognise


def flowlift_image(path: Path) -> bool:
    """A whole image carrying flowlift's metadata (``Software: flowlift ...`` or a ``flowlift`` key)."""
    from flowlift.files.image_outputs import inspect_existing

    try:
        found = inspect_existing(path)
    except OSError:
        return False
    return found.image and found.complete and found.by_flowlift


def safetensors_metadata(path: Path) -> dict[str, str] | None:
    """The ``__metadata__`` of a safetensors file's header, or None when ``path`` is no safetensors file."""
    start = head(path, 8)
    if len(start) < 8:
        return None
    size = int.from_bytes(start, "little")
    if not 2 <= size <= 100 << 20:
        return None
    try:
        header = parse_json(head(path, 8 + size)[8:])
    except ValueError:
        return None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return metadata if isinstance(metadata, dict) else None


def replace_problem(
    path: str | os.PathLike, recognise: Recogniser, overwrite: bool, command: str, option: str = "-o/--output"
) -> str | None:
    """Why ``command`` must not replace ``path`` (see the module docstring), or None when it may.

    ``overwrite`` must be a bool (:func:`flowlift.knobs.check_overwrite`): ``"no"`` is refused, never read as yes.
    ``option`` :data:`~flowlift.errors.FIELD_MARK`: the line marks the overwrite flag and the output, for a door to
    word (:func:`replace_error`); else it spells the command line's ``--overwrite`` and ``option``."""
    overwrite = check_overwrite(overwrite)
    path = Path(path)
    if refusal := replace_refusal(path):
        return refusal
    if not os.path.lexists(path) or overwrite:
        return None
    try:
        if os.stat(path).st_size == 0 or recognise(path):
            return None
    except OSError as error:
        return f"cannot read the existing {path}: {error.strerror or type(error).__name__}"
    flag = FIELD_MARK if option == FIELD_MARK else "--overwrite"
    return f"{path} exists and was not written by flowlift {command}; use {flag} to replace it, or another {option}"


def replace_error(problem: str, field: str = "output") -> FlowliftError:
    """:func:`replace_problem`'s (or another refusal's) line as the error: a marked one names ``overwrite`` and
    ``field`` (the output, ``cache``) for each door to word (``--overwrite``, ``overwrite``)."""
    return FlowliftError(problem, field=("overwrite", field) if FIELD_MARK in problem else ())


def folder_refusal(folder: str | os.PathLike) -> str | None:
    """Why ``folder`` cannot hold outputs at fixed names: something other than a real folder is there."""
    folder = Path(folder)
    if not os.path.lexists(folder) or (folder.is_dir() and not folder.is_symlink()):
        return None
    return replace_refusal(folder) or f"{folder} exists and is not a folder; remove it or choose another output"


def check_replaceable(
    names: Mapping[Path, Recogniser], overwrite: bool, command: str, option: str = "-o/--output"
) -> None:
    """:func:`replace_problem` for every path of ``names`` (path -> recogniser): the first as one line (``option``
    :data:`~flowlift.errors.FIELD_MARK`: naming the ``overwrite`` and ``output`` fields, :func:`replace_error`)."""
    overwrite = check_overwrite(overwrite)
    for path, recognise in names.items():
        if problem := replace_problem(path, recognise, overwrite, command, option):
            raise replace_error(problem)
