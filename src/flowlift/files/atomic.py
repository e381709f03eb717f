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

The writer holds an exclusive ``flock`` on its temporary file until the rename, so a later run can
tell a killed run's debris from work in progress: :func:`remove_stale_temporaries` deletes a
temporary file only when it is older than the run and no live process holds its lock (the kernel
drops the locks of a process killed with SIGKILL).
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock; stale temporaries are told by their age alone
    fcntl = None  # type: ignore[assignment]

TEMP_SUFFIX = ".flowlift-partial"
_RANDOM_PART = 8  # characters mkstemp adds
_TEMP_PATTERN = re.compile(r"^\..+\.[^.]+(\.flowlift-partial|\.partial\.[A-Za-z0-9]+)$")
#: Without advisory locks (Windows) a temporary file must be this old to count as a killed run's.
UNLOCKED_STALE_AFTER_S = 3600.0


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


def _lock_exclusive(descriptor: int) -> bool:
    """An exclusive ``flock`` on ``descriptor``, without waiting; False where none can be taken.

    ``flock`` belongs to the open file description, so the writer's own other opens and closes of
    the file (``image.save(path)``, the ``fsync``) keep it, unlike ``fcntl``/``lockf`` record locks.
    """
    if fcntl is None:
        return False
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


@contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path in ``path``'s folder; on success it replaces ``path``, on error it is removed.

    The temporary name does not end with ``path``'s suffix: writers must be told the format
    (``image.save(tmp, format=...)``, ``fig.savefig(tmp, format=...)``); safetensors and torch.save
    ignore the name. The temporary file stays locked until it is renamed or removed, so no other
    run takes it for debris while it is written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, name = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=TEMP_SUFFIX, dir=path.parent)
    if not _lock_exclusive(descriptor):
        os.close(descriptor)  # nothing to hold open (and Windows cannot rename an open file)
        descriptor = -1
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
    finally:
        if descriptor >= 0:
            os.close(descriptor)  # the lock goes with it, after the rename or the removal


def _remove_if_unlocked(entry: Path) -> bool:
    """Delete ``entry`` unless a process holds its lock; True when it was deleted.

    The lock is taken before the unlink and held across it, so no writer can take the file over
    in between.
    """
    try:
        descriptor = os.open(entry, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    except OSError:  # gone already, or another user's file: not ours to judge
        return False
    try:
        if not _lock_exclusive(descriptor):
            return False  # a live writer holds it
        entry.unlink()
        return True
    except OSError:
        return False
    finally:
        os.close(descriptor)


def temporary_in_use(path: str | os.PathLike) -> bool:
    """True when a live process holds ``path``'s lock: a temporary file being written now. Without
    ``flock`` (Windows), a temporary file younger than :data:`UNLOCKED_STALE_AFTER_S` counts as in use."""
    path = Path(path)
    if fcntl is None:
        try:
            return time.time() - path.stat().st_mtime < UNLOCKED_STALE_AFTER_S
        except OSError:
            return False
    try:
        descriptor = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        return not _lock_exclusive(descriptor)
    finally:
        os.close(descriptor)  # and the lock, if this took it


def remove_stale_temporaries(folder: str | os.PathLike, before: float | None = None) -> list[Path]:
    """Delete the temporary files that killed runs (SIGKILL, power cut) left in ``folder``; returns them.

    A temporary file is stale when it was last written before ``before`` (the start of the run that
    cleans up; default: now) and no live process holds its lock (:func:`atomic_output` keeps it
    locked until the rename; the kernel releases a killed process's locks). The age test covers the
    instant between a writer creating its file and locking it. Without ``flock`` (Windows) a
    temporary file must also be :data:`UNLOCKED_STALE_AFTER_S` old.
    """
    folder = Path(folder)
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    cutoff = time.time() if before is None else before
    if fcntl is None:
        cutoff = min(cutoff, time.time() - UNLOCKED_STALE_AFTER_S)
    for entry in folder.iterdir():
        try:
            if not is_temporary(entry) or entry.is_symlink() or not entry.is_file():
                continue
            if entry.stat().st_mtime >= cutoff:
                continue  # written since this run began: someone else's work in progress
            if fcntl is None:
                entry.unlink()
            elif not _remove_if_unlocked(entry):
                continue
        except OSError:
            continue
        removed.append(entry)
    return removed


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically."""
    with atomic_output(path) as temporary:
        temporary.write_bytes(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))
