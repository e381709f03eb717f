"""Weight files named by their content, for InvokeAI's model cache (no InvokeAI import here).

InvokeAI's model cache keys a model loaded from a local file by the path it is given. A file replaced
in place (a retrained checkpoint written to the same name) must not return the old weights, so the
nodes give the cache a key that names the files' SHA-256 (:func:`cache_key`); each file is hashed once
per process and per version on disk (:func:`file_digest` remembers the digest by path, size, mtime and
inode), so repeated runs cost a ``stat``, not a read.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from flowlift.errors import FlowliftError
from flowlift.files.image_outputs import file_sha256

_DIGESTS: dict[tuple[str, int, int, int], str] = {}
_LOCK = threading.Lock()


def file_digest(path: str | os.PathLike) -> str:
    """Hex SHA-256 of ``path``'s content, read once per (real path, size, mtime, inode)."""
    real = os.path.realpath(path)
    try:
        stat = os.stat(real)
    except OSError as error:
        raise FlowliftError(f"cannot read {path}: {error.strerror or error}") from None
    key = (real, stat.st_size, stat.st_mtime_ns, stat.st_ino)
    with _LOCK:
        known = _DIGESTS.get(key)
    if known is not None:
        return known
    try:
        digest = file_sha256(real)
    except OSError as error:
        raise FlowliftError(f"cannot read {path}: {error.strerror or error}") from None
    with _LOCK:
        _DIGESTS[key] = digest
    return digest


def files_digest(paths: Sequence[str | os.PathLike]) -> str:
    """One hex SHA-256 for a model made of several files (TAEF2's encoder and decoder), order-independent."""
    if not paths:
        raise FlowliftError("no weight files to load")
    digests = sorted(file_digest(path) for path in paths)
    return digests[0] if len(digests) == 1 else hashlib.sha256("".join(digests).encode()).hexdigest()


def cache_key(kind: str, digest: str, variant: str, name: str) -> Path:
    """The model cache's key for a model of ``kind`` made from files with ``digest``, built as ``variant``
    (its dtype): ``flowlift/<kind>/<digest>-<variant>/<name>``. It is a name, not a file: the node's
    loader reads the real files. ``name`` is what InvokeAI shows while loading."""
    return Path("flowlift") / kind / f"{digest}-{variant}" / name
