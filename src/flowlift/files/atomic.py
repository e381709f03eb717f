"""Atomic file output: write to a temporary file beside the target, then rename it into place.

A crash, an exception, Ctrl-C or SIGTERM never leaves a truncated file under the final name: the
rename is atomic on POSIX file systems and on Windows (``os.replace``), and the data is flushed to
disk (``fsync`` of the file before the rename, of the folder after it), so a power cut cannot leave
a renamed but empty file either. Every writer in flowlift goes through :func:`atomic_output`
(images, reports, dataset shards, checkpoints).

Temporary files are named ``.<stem>.<random>.flowlift-partial``: hidden, and with a suffix no image
reader lists, so a run killed with SIGKILL never leaves something the next run takes for an input
(:func:`is_temporary` lets folder listings skip them anyway, including the older
``.<stem>.<random>.partial<suffix>`` names). The name is shortened to fit the folder's name limit.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TEMP_SUFFIX = ".flowlift-partial"
_RANDOM_PART = 8  # characters mkstemp adds
_TEMP_PATTERN = re.compile(r"^\..+\.[^.]+(\.flowlift-partial|\.partial\.[A-Za-z0-9]+)$")


def is_temporary(path: str | os.PathLike) -> bool:
    """True for the temporary names :func:`atomic_output` uses (current and older releases)."""
    return bool(_TEMP_PATTERN.match(Path(path).name))


def _default_file_mode() -> int:
    """``0o666`` less the process umask: the mode ``open(path, "w")`` would have given."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _name_limit(folder: Path) -> int:
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (AttributeError, OSError, ValueError):
        return 255


def _temp_prefix(path: Path) -> str:
    """``.<stem>.`` shortened (by bytes, on a character boundary) so the whole temporary name fits the limit."""
    room = _name_limit(path.parent) - len(b".") - len(b".") - _RANDOM_PART - len(TEMP_SUFFIX.encode())
    stem = path.stem
    while len(stem.encode("utf-8", "surrogateescape")) > max(room, 1):
        stem = stem[:-1]
    return f".{stem}."


def _fsync_directory(folder: Path) -> None:
    try:
        descriptor = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # not supported here (Windows): the rename is still atomic
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


@contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path in ``path``'s folder; on success it replaces ``path``, on error it is removed.

    The temporary name does not end with ``path``'s suffix: writers must be told the format
    (``image.save(tmp, format=...)``, ``fig.savefig(tmp, format=...)``); safetensors and torch.save
    ignore the name.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, name = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=TEMP_SUFFIX, dir=path.parent)
    os.close(descriptor)
    temporary = Path(name)
    try:
        yield temporary
        os.chmod(temporary, _default_file_mode())  # mkstemp creates 0600
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, path)
        _fsync_directory(path.parent)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def remove_stale_temporaries(folder: str | os.PathLike, older_than_s: float = 3600.0) -> list[Path]:
    """Delete temporary files of killed runs (SIGKILL, power cut) in ``folder`` older than ``older_than_s``.

    Younger ones may belong to a run still writing; they are left alone (listings skip them anyway).
    """
    folder = Path(folder)
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    now = time.time()
    for entry in folder.iterdir():
        try:
            if is_temporary(entry) and entry.is_file() and now - entry.stat().st_mtime > older_than_s:
                entry.unlink()
                removed.append(entry)
        except OSError:
            continue
    return removed


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically."""
    with atomic_output(path) as temporary:
        temporary.write_bytes(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))
