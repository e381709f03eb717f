"""Atomic file output: write to a temporary file beside the target, then rename it into place.

A crash, an exception, Ctrl-C or SIGTERM never leaves a truncated file under the final name: the
rename is atomic on POSIX file systems and on Windows (``os.replace``), and the data is flushed to
disk (``fsync`` of the file before the rename, of the folder after it), so a power cut cannot leave
a renamed but empty file either. Every writer in flowlift goes through :func:`atomic_output`
(images, reports, dataset shards, checkpoints).

The temporary file lives in a temporary *folder* beside the target, ``.<stem>.<random>.flowlift-partial/``
(hidden, no image suffix, shortened to fit the folder's name limit), which holds exactly two files:
``data`` (what the writer writes) and ``origin``, flowlift's proof that it made the folder: a fixed
first line (:data:`ORIGIN_MAGIC`) written only after the writer holds an exclusive ``flock`` on it,
kept until the rename. A run killed with SIGKILL leaves that folder; a later run's
:func:`remove_stale_temporaries` deletes it only when its ``origin`` says flowlift made it, no live
process holds the lock (the kernel drops a killed process's locks), nothing else is inside, and it
was last written before the run began. Nothing else is ever removed: a user's file that happens to
look like a temporary name (``.notes.v2.partial.txt``, or a file called ``.x.abc.flowlift-partial``)
is a file, not such a folder, and stays. :func:`is_temporary` still lets folder listings skip those
names (including the ``.<stem>.<random>.partial<suffix>`` files of older releases), never to delete them.
"""

from __future__ import annotations

import os
import re
import stat as stat_module
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from flowlift.errors import FlowliftError

try:
    import fcntl
except ImportError:  # Windows: no flock; stale temporaries are told by their age alone
    fcntl = None  # type: ignore[assignment]

TEMP_SUFFIX = ".flowlift-partial"
#: The first line of a temporary folder's ``origin`` file: what makes it flowlift's to remove.
ORIGIN_MAGIC = b"flowlift atomic_output temporary v1\n"
DATA_NAME = "data"
ORIGIN_NAME = "origin"
_RANDOM_PART = 8  # characters mkdtemp adds
_TEMP_PATTERN = re.compile(r"^\..+\.[^.]+(\.flowlift-partial|\.partial\.[A-Za-z0-9]+)$")
#: Without advisory locks (Windows) a temporary folder must be this old to count as a killed run's.
UNLOCKED_STALE_AFTER_S = 3600.0
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def is_temporary(path: str | os.PathLike) -> bool:
    """True for names shaped like flowlift's temporaries (current and older releases): listings skip them.

    A name proves nothing: only :func:`remove_stale_temporaries`'s checks decide what may be deleted.
    """
    return bool(_TEMP_PATTERN.match(Path(path).name))


class OutputWriteError(FlowliftError, OSError):
    """A write that failed (a full disk, a read-only file system, a name too long): one line, and an
    :class:`OSError` still for the callers that catch those."""


_KINDS = (
    (stat_module.S_ISDIR, "a folder"),
    (stat_module.S_ISLNK, "a symbolic link"),
    (stat_module.S_ISFIFO, "a FIFO"),
    (stat_module.S_ISSOCK, "a socket"),
    (stat_module.S_ISCHR, "a character device"),
    (stat_module.S_ISBLK, "a block device"),
)


def replace_refusal(path: str | os.PathLike) -> str | None:
    """Why ``path`` must not be replaced by an output, or None: only a regular file (or nothing) may be.

    A FIFO, socket, device, link or folder at an output name is never flowlift's: ``os.replace`` would
    silently swap it for a file (``--overwrite`` or not), so it is refused, in the same words by every writer.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as error:
        return f"cannot inspect the existing {path}: {error.strerror or type(error).__name__}"
    if stat_module.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return f"{path} exists and is {kind}, not a file flowlift wrote; remove it or choose another output"


def _write_failure(error: BaseException) -> str | None:
    """The reason of a failed write (``No space left on device``), or None for errors that are no I/O failure.

    OSErrors give their ``strerror``; libraries that wrap the system error in their own type
    (safetensors' ``... (os error 28)``) give the same text through the error number they name.
    """
    if isinstance(error, OSError):
        text = str(error)
        return error.strerror or (text.splitlines()[0] if text else type(error).__name__)
    match = re.search(r"\(os error (\d+)\)", str(error))
    return os.strerror(int(match.group(1))) if match else None


def _default_file_mode() -> int:
    """``0o666`` less the process umask: the mode ``open(path, "w")`` would have given."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def name_limit(folder: Path) -> int:
    """The longest file name ``folder``'s file system takes, in bytes (255 where it cannot be asked)."""
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (AttributeError, OSError, ValueError):
        return 255


def _temp_prefix(path: Path) -> str:
    """``.<stem>.`` shortened (by bytes, on a character boundary) so the whole temporary name fits the limit."""
    room = name_limit(path.parent) - len(b".") - len(b".") - _RANDOM_PART - len(TEMP_SUFFIX.encode())
    stem = path.stem
    while len(stem.encode("utf-8", "surrogateescape")) > max(room, 1):
        stem = stem[:-1]
    return f".{stem}."


def fsync_directory(folder: Path) -> None:
    """Flush ``folder``'s entries (a rename in it) to disk; nothing where the system cannot (Windows)."""
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

    ``flock`` belongs to the open file description, so it is held until that descriptor is closed,
    whatever else opens the folder's files meanwhile.
    """
    if fcntl is None:
        return False
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def _claim_origin(folder: Path) -> int:
    """Create ``folder/origin``, lock it, then write :data:`ORIGIN_MAGIC`; the descriptor (-1 without flock).

    The magic is written only once the lock is held, so a sweep that reads it either finds the lock
    taken (a live writer) or the writer gone.
    """
    descriptor = os.open(folder / ORIGIN_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    locked = _lock_exclusive(descriptor)
    os.write(descriptor, ORIGIN_MAGIC + f"pid {os.getpid()}\n".encode())
    if not locked:
        os.close(descriptor)  # nothing to hold open (and Windows cannot remove an open file)
        return -1
    return descriptor


def open_temporary(path: Path) -> tuple[Path, int]:
    """A new temporary folder beside ``path`` with its ``origin`` claimed (the module docstring): ``(folder, the
    descriptor holding its lock, -1 without flock)``. A link, FIFO or folder at ``path`` is refused first; a failure
    of the system is one :class:`OutputWriteError` line, and no folder is left."""
    if refusal := replace_refusal(path):
        raise FlowliftError(refusal)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix=_temp_prefix(path), suffix=TEMP_SUFFIX, dir=path.parent))
    except OSError as error:
        raise OutputWriteError(f"cannot write {path}: {_write_failure(error)}") from error
    try:
        return folder, _claim_origin(folder)
    except BaseException as error:
        _remove_folder(folder)
        if isinstance(error, OSError):
            raise OutputWriteError(f"cannot write {path}: {_write_failure(error)}") from error
        raise


def seal_temporary(temporary: Path) -> None:
    """A written temporary file given the mode ``open`` would have given it and flushed to disk, before its rename
    (so a power cut cannot leave a renamed but empty file)."""
    os.chmod(temporary, _default_file_mode())
    with open(temporary, "rb") as handle:
        os.fsync(handle.fileno())


def close_temporary(folder: Path, descriptor: int) -> None:
    """Remove a temporary folder (emptied by its rename, or with its data) and let its lock go, in that order."""
    try:
        _remove_folder(folder)
    finally:
        if descriptor >= 0:
            os.close(descriptor)  # the lock goes with it, after the rename or the removal


def write_error(path: Path, error: Exception) -> Exception:
    """What a failed write of ``path`` raises: ``error`` itself when it is a FlowliftError or no I/O failure,
    else one :class:`OutputWriteError` line naming ``path`` and the reason (``No space left on device``)."""
    reason = None if isinstance(error, FlowliftError) else _write_failure(error)
    if reason is None:
        return error
    failure = OutputWriteError(f"cannot write {path}: {reason}")
    failure.__cause__ = error
    return failure


@contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path``, on error it is removed.

    The temporary name does not end with ``path``'s suffix: writers must be told the format
    (``image.save(tmp, format=...)``, ``fig.savefig(tmp, format=...)``); safetensors and torch.save
    ignore the name. The temporary folder stays locked until the rename or the removal, so no other
    run takes it for debris while it is written. Files that belong together are replaced as one by
    :func:`flowlift.files.atomic_set.atomic_write_set`.
    """
    path = Path(path)
    folder, descriptor = open_temporary(path)
    temporary = folder / DATA_NAME
    try:
        yield temporary
        seal_temporary(temporary)
        if refusal := replace_refusal(path):  # something took the name while the data was written
            raise FlowliftError(refusal)
        os.replace(temporary, path)
        fsync_directory(path.parent)
    except Exception as error:
        failure = write_error(path, error)
        if failure is error:
            raise
        raise failure from error
    finally:
        close_temporary(folder, descriptor)


def _remove_folder(folder: Path) -> None:
    """Remove a temporary folder's own two files and the folder; anything else inside keeps it there."""
    for name in (DATA_NAME, ORIGIN_NAME):
        try:
            (folder / name).unlink()
        except FileNotFoundError:
            pass
        except OSError:
            return
    try:
        folder.rmdir()
    except OSError:
        pass


def _temporary_folder(path: Path) -> Path:
    """The temporary folder ``path`` names: itself, or the folder of its ``data`` file."""
    return path.parent if path.name == DATA_NAME and path.parent.name.endswith(TEMP_SUFFIX) else path


def _last_written(folder: Path) -> float | None:
    """The newest modification time of a temporary folder's files, or None when it is not flowlift's.

    flowlift's: a real folder (no link) with the temporary name, holding ``origin`` (a regular file
    beginning with :data:`ORIGIN_MAGIC`) and at most ``data`` (a regular file), nothing else.
    """
    try:
        if not folder.name.endswith(TEMP_SUFFIX) or not is_temporary(folder):
            return None
        if not stat_module.S_ISDIR(os.lstat(folder).st_mode):
            return None
        names = set(os.listdir(folder))
        if ORIGIN_NAME not in names or not names <= {ORIGIN_NAME, DATA_NAME}:
            return None
        newest = 0.0
        for name in names:
            info = os.lstat(folder / name)
            if not stat_module.S_ISREG(info.st_mode):
                return None
            newest = max(newest, info.st_mtime)
        with open(folder / ORIGIN_NAME, "rb") as handle:
            if handle.read(len(ORIGIN_MAGIC)) != ORIGIN_MAGIC:
                return None
    except OSError:
        return None
    return newest


def _locked_by_another(folder: Path) -> tuple[bool, int]:
    """(True, -1) when a live process holds ``folder``'s lock; else (False, descriptor holding it now).

    Without ``flock`` (Windows) nothing is locked and the descriptor is -1.
    """
    if fcntl is None:
        return False, -1
    try:
        descriptor = os.open(folder / ORIGIN_NAME, os.O_RDWR | _NOFOLLOW)
    except OSError:
        return True, -1  # gone, or not ours to open: judge nothing
    if _lock_exclusive(descriptor):
        return False, descriptor
    os.close(descriptor)
    return True, -1


def temporary_in_use(path: str | os.PathLike) -> bool:
    """True when ``path`` (a temporary folder or its ``data`` file) is flowlift's and being written now.

    Without ``flock`` (Windows), a temporary folder written in the last :data:`UNLOCKED_STALE_AFTER_S`
    counts as in use.
    """
    folder = _temporary_folder(Path(path))
    written = _last_written(folder)
    if written is None:
        return False
    if fcntl is None:
        return time.time() - written < UNLOCKED_STALE_AFTER_S
    in_use, descriptor = _locked_by_another(folder)
    if descriptor >= 0:
        os.close(descriptor)
    return in_use


def is_stale_temporary(path: str | os.PathLike) -> bool:
    """True for a temporary folder flowlift made that no live process writes: a killed run's."""
    folder = _temporary_folder(Path(path))
    return _last_written(folder) is not None and not temporary_in_use(folder)


def remove_stale_temporaries(folder: str | os.PathLike, before: float | None = None) -> list[Path]:
    """Delete the temporary folders that killed runs (SIGKILL, power cut) left in ``folder``; returns them.

    A temporary folder is stale when flowlift made it (its ``origin``, see the module docstring), it
    was last written before ``before`` (the start of the run that cleans up; default: now), and no
    live process holds its lock. Without ``flock`` (Windows) it must also be
    :data:`UNLOCKED_STALE_AFTER_S` old. Nothing that fails any of these is touched.
    """
    folder = Path(folder)
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    cutoff = time.time() if before is None else before
    if fcntl is None:
        cutoff = min(cutoff, time.time() - UNLOCKED_STALE_AFTER_S)
    for entry in folder.iterdir():
        written = _last_written(entry)
        if written is None or written >= cutoff:
            continue  # not flowlift's, or written since this run began: someone else's work in progress
        in_use, descriptor = _locked_by_another(entry)
        if in_use:
            continue
        try:  # the lock is held across the removal, so no writer can take the folder over in between
            if _last_written(entry) is not None:
                _remove_folder(entry)
        finally:
            if descriptor >= 0:
                os.close(descriptor)
        if not entry.exists():
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


def open_for_append(path: str | os.PathLike) -> int:
    """A write descriptor at the end of the regular file ``path`` (created when missing), never through a link.

    The name is opened without following a link (``O_NOFOLLOW``) and without blocking (``O_NONBLOCK``:
    a FIFO without a reader fails at once instead of hanging the run), and whatever was opened must be
    a regular file: a link, FIFO, socket, device or folder at the name is one :func:`replace_refusal`
    line (:class:`FlowliftError`); a failure of the system is :class:`OutputWriteError`.
    """
    path = Path(path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0)
    try:
        descriptor = os.open(path, flags, 0o666)
    except OSError as error:
        if refusal := replace_refusal(path):  # ELOOP (a link), ENXIO (a FIFO), EISDIR (a folder)...
            raise FlowliftError(refusal) from error
        raise OutputWriteError(f"cannot write {path}: {_write_failure(error)}") from error
    try:
        is_regular = stat_module.S_ISREG(os.fstat(descriptor).st_mode)
    except OSError:
        is_regular = False
    if not is_regular:
        os.close(descriptor)
        raise FlowliftError(replace_refusal(path) or f"{path} is not a regular file; it is not written")
    return descriptor


def append_text(path: str | os.PathLike, text: str) -> None:
    """Append ``text`` (UTF-8) to the regular file ``path`` (:func:`open_for_append`: never through a
    link, never blocking on a FIFO). A log that grows line by line (``train_log.csv``) cannot be
    rewritten atomically at every line; this is its one safe append."""
    descriptor = open_for_append(path)
    try:
        data = text.encode("utf-8")
        while data:
            data = data[os.write(descriptor, data) :]
    except OSError as error:
        raise OutputWriteError(f"cannot write {path}: {_write_failure(error)}") from error
    finally:
        os.close(descriptor)
