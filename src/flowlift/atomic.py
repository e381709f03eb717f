"""Atomic file output: write to a temporary file beside the target, then rename it into place.

A crash, an exception or Ctrl-C never leaves a truncated file under the final name: the rename is
atomic on POSIX file systems and on Windows (``os.replace``). Every writer in flowlift goes through
:func:`atomic_output` (images, reports, dataset shards, checkpoints).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _default_file_mode() -> int:
    """``0o666`` less the process umask: the mode ``open(path, "w")`` would have given."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path in ``path``'s folder; on success it replaces ``path``, on error it is removed.

    The temporary name ends with ``path``'s own suffix, so writers that infer the format from the
    extension (matplotlib, safetensors) work unchanged.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, name = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=f".partial{path.suffix}", dir=path.parent)
    os.close(descriptor)
    temporary = Path(name)
    try:
        yield temporary
        os.chmod(temporary, _default_file_mode())  # mkstemp creates 0600
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically."""
    with atomic_output(path) as temporary:
        temporary.write_bytes(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))
