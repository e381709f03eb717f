"""What flowlift tells a user about the Hugging Face hub: download advice and path-versus-repo-id.

* :func:`download_command` names the command that exists for the installed huggingface_hub
  (``hf download`` from 0.34 on, ``huggingface-cli download`` before), with plain file names.
* :func:`download_hint` is the one sentence every "not in the cache" error ends with: that command and
  where the file goes (the hub cache folder), so a user can act on it without reading docs.
* :func:`looks_like_path` tells a mistyped local path (``models/fu.safetensors``) from a hub id
  (``owner/name``), so a missing file is reported as "no such file" instead of a hub lookup.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

#: Suffixes of files flowlift reads; a hub *repository* id never ends in one of them.
FILE_SUFFIXES = (
    ".safetensors", ".pth", ".pt", ".bin", ".ckpt", ".json", ".toml", ".txt",
    ".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".gif", ".avif",
)  # fmt: skip
#: huggingface_hub release that ships the ``hf`` command (``huggingface-cli`` was removed in 1.0).
HF_CLI_VERSION = (0, 34)


def _hub_version() -> tuple[int, ...]:
    from huggingface_hub import __version__

    numbers = []
    for part in __version__.split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        numbers.append(int(digits or 0))
    return tuple(numbers)


def download_command(repo_id: str, filenames: Sequence[str] = (), *, include: str | None = None) -> str:
    """The shell command that downloads ``filenames`` (or the whole repo) of ``repo_id`` into the cache."""
    tool = "hf download" if _hub_version() >= HF_CLI_VERSION else "huggingface-cli download"
    parts = [tool, repo_id, *filenames]
    if include:
        parts.append(f"--include '{include}'")
    return " ".join(parts)


def cache_folder() -> str:
    """The hub cache folder downloads go to (``HF_HUB_CACHE`` / ``HF_HOME`` honoured)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def download_hint(repo_id: str, filenames: Sequence[str] = (), *, include: str | None = None) -> str:
    """``download it once with `CMD` (it goes to CACHE)``: the tail of every missing-weights error."""
    return f"download it once with `{download_command(repo_id, filenames, include=include)}` (into {cache_folder()})"


def looks_like_path(source: str) -> bool:
    """True when ``source`` reads as a local path rather than a hub id ``owner/name``.

    Path-looking: absolute, starting with ``.`` or ``~``, with a backslash, with more or fewer than one
    ``/``, or ending in a file suffix flowlift reads (``models/fu.safetensors``).
    """
    text = os.fspath(source)
    if os.path.isabs(text) or text.startswith((".", "~")) or "\\" in text:
        return True
    if text.count("/") != 1:
        return True
    return text.lower().endswith(FILE_SUFFIXES)
