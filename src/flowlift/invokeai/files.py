"""Weight files a node may load: checked before they are read, named by their content (no InvokeAI import here).

**Trust.** The nodes' path fields take a path on the *server*: anyone who can queue a workflow can name
any file the InvokeAI process can read. So a named file is checked cheaply before a byte of its data
is read (:func:`check_weight_file`: its suffix, that it is a regular file, its size against the
model's own bound, its header), the hash that then reads it stops within one chunk of a cancel
(:func:`file_digest`'s ``should_stop``), and every refusal is the same line whatever was wrong — no
such file, no permission, a folder, a FIFO, garbage, a 300 GB sparse file — saying what was expected
(:func:`refusal`), never what the file holds or whether it exists.

**Cache keys.** InvokeAI's model cache keys a model loaded from a local file by the path it is given.
A file replaced in place (a retrained checkpoint written to the same name) must not return the old
weights, so the nodes give the cache a key that names the files' SHA-256 (:func:`cache_key`); each
file is hashed once per process and per version on disk (remembered by path, size, mtime and inode),
so repeated runs cost a ``stat``, not a read.
"""

from __future__ import annotations

import hashlib
import os
import stat as stat_module
import threading
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from flowlift.errors import FlowliftError
from flowlift.files.json_input import parse_json

_DIGESTS: dict[tuple[str, int, int, int], str] = {}
_LOCK = threading.Lock()
_CHUNK = 1 << 20
#: A safetensors header longer than this is no weight file a node loads (the format's own limit is 100 MB).
_MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class WeightKind:
    """What a node accepts for one model: its name, the file suffixes, the largest file, and in words."""

    what: str
    suffixes: tuple[str, ...]
    max_bytes: int
    expected: str  # the one refusal text: what a usable source is


_LIMITS = "readable, at most {mib} MiB, with a valid header"
#: The Flow Upscaler is one safetensors file (the released model is well under 1 GiB; 4 GiB leaves room).
UPSCALER_FILE = WeightKind(
    "Flow Upscaler",
    (".safetensors",),
    4 << 30,
    f"expected the Flow Upscaler's weights: a .safetensors file (or a folder holding flow_upscaler.safetensors), "
    f"{_LIMITS.format(mib=4 << 10)}, or a Hugging Face repo id",
)
_TAEF2_EXPECTED = (
    f"expected TAEF2's weights: a folder holding taef2_encoder.pth and taef2_decoder.pth, or one "
    f".safetensors file, each {_LIMITS.format(mib=256)}, or a Hugging Face repo id"
)
#: TAEF2 as a folder: two small .pth files (2.7 MB each).
TAEF2_PTH = WeightKind("TAEF2", (".pth",), 256 << 20, _TAEF2_EXPECTED)
#: TAEF2 as one file.
TAEF2_SAFETENSORS = WeightKind("TAEF2", (".safetensors",), 256 << 20, _TAEF2_EXPECTED)
#: Mage-VAE as released: one .safetensors file (~140M float32 parameters, ~0.6 GB; 2 GiB leaves room).
MAGE_SAFETENSORS = WeightKind(
    "Mage-VAE",
    (".safetensors",),
    2 << 30,
    f"expected Mage-VAE's weights: one .safetensors file as released (student.dconv_encoder.* and pipeline.* "
    f"tensors), {_LIMITS.format(mib=2 << 10)}, 'mage' or a Hugging Face repo id",
)
#: SesquiLSR: one small .safetensors file (~3M float32 parameters, 12.5 MB; 256 MiB leaves room).
SESQUI_FILE = WeightKind(
    "SesquiLSR",
    (".safetensors",),
    256 << 20,
    f"expected SesquiLSR's weights: sesqui:PATH to its .safetensors file (upscaler_Flux2.safetensors as released), "
    f"{_LIMITS.format(mib=256)}, or an installed SesquiLSR model",
)
#: What a flowlift-run VAE source can be, by the declaration's name (flowlift.models.vae_names).
NATIVE_VAE_FILES = {"taef2": (TAEF2_PTH, TAEF2_SAFETENSORS), "mage": (MAGE_SAFETENSORS, MAGE_SAFETENSORS)}


def refusal(kind: WeightKind, shown: str) -> FlowliftError:
    """The one line for a source that cannot be ``kind``'s weights, whatever the reason."""
    return FlowliftError(f"{kind.what}: cannot use {shown}: {kind.expected}")


def is_local(source: str) -> bool:
    """A path on the server (not a hub repo id): path-looking, or an existing ``owner/name`` folder."""
    from flowlift.models.hub import looks_like_path

    return looks_like_path(source) or os.path.exists(source)


def local_upscaler_file(source: str) -> Path:
    """The Flow Upscaler file a local ``source`` names (a file, or a folder's flow_upscaler.safetensors), checked."""
    from flowlift.upscale.loading import UPSCALER_WEIGHTS_NAME

    path = Path(source).expanduser()
    try:
        candidate = path / UPSCALER_WEIGHTS_NAME if path.is_dir() else path
    except (OSError, ValueError):
        raise refusal(UPSCALER_FILE, source) from None
    return check_weight_file(candidate, UPSCALER_FILE, shown=source)


def local_taef2_files(source: str) -> list[Path]:
    """TAEF2's files a local ``source`` names (a folder's two .pth files, or one .safetensors file), checked."""
    from flowlift.models.vae_loading import TAEF2_FILES

    path = Path(source).expanduser()
    try:
        folder = path.is_dir()
    except (OSError, ValueError):
        raise refusal(TAEF2_PTH, source) from None
    if folder:
        return [check_weight_file(path / name, TAEF2_PTH, shown=source) for name in TAEF2_FILES]
    return [check_weight_file(path, TAEF2_SAFETENSORS, shown=source)]


def _safetensors_header_fits(handle, size: int) -> bool:
    """The header is a JSON object of tensors whose data offsets tile the rest of the file exactly."""
    prefix = handle.read(8)
    if len(prefix) != 8:
        return False
    length = int.from_bytes(prefix, "little")
    if not 2 <= length <= min(_MAX_HEADER_BYTES, size - 8):
        return False
    header = parse_json(handle.read(length))
    if not isinstance(header, dict):
        return False
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(v, int) for v in offsets)
            and 0 <= offsets[0] <= offsets[1]
            and isinstance(shape, list)
            and all(isinstance(v, int) and v >= 0 for v in shape)
        ):
            return False
        end = max(end, offsets[1])
    return 8 + length + end == size


def _header_fits(path: str, suffix: str, size: int) -> bool:
    """A cheap look at the format's header (never the data): safetensors' JSON, a .pth's zip directory."""
    try:
        if suffix == ".safetensors":
            with open(path, "rb") as handle:
                return _safetensors_header_fits(handle, size)
        with zipfile.ZipFile(path) as archive:  # torch.save's format; reads the central directory only
            return any(name.endswith("data.pkl") for name in archive.namelist())
    except (OSError, ValueError, zipfile.BadZipFile, UnicodeDecodeError, RecursionError):
        return False


def check_weight_file(path: str | os.PathLike, kind: WeightKind, shown: str | None = None) -> Path:
    """``path`` (a link is followed) if it can be ``kind``'s weights, else one line that says what was expected.

    Checked without reading the data: the suffix, a regular file, a size within ``kind.max_bytes``
    (so a huge or sparse file is refused at once), and the header. Every failure reads the same,
    ``shown`` (default: ``path``) and the expectation, so the line reveals nothing about the file.
    """
    shown = os.fspath(path) if shown is None else shown
    suffix = Path(os.fspath(path)).suffix.lower()  # the name given: a hub cache file links to a suffix-less blob
    if suffix not in kind.suffixes:
        raise refusal(kind, shown)
    real = os.path.realpath(path)
    try:
        info = os.stat(real)
    except (OSError, ValueError):
        raise refusal(kind, shown) from None
    if not stat_module.S_ISREG(info.st_mode) or not 0 < info.st_size <= kind.max_bytes:
        raise refusal(kind, shown)
    if not os.access(real, os.R_OK) or not _header_fits(real, suffix, info.st_size):
        raise refusal(kind, shown)
    return Path(real)


def checked_sesqui_spec(spec: str, shown: str) -> str:
    """``sesqui:PATH`` with PATH's file checked as a :data:`SESQUI_FILE` (:func:`check_weight_file`) and its tensors
    SesquiLSR's (:func:`flowlift.upscale.latent_fraction.find_sesqui`), as ``sesqui:REAL_PATH``; every failure is
    the one :func:`refusal` line naming ``shown`` (never the file's size, its tensors or whether it exists)."""
    from flowlift.upscale.latent_fraction import find_sesqui, sesqui_path

    try:
        path = check_weight_file(sesqui_path(spec), SESQUI_FILE, shown=shown)
        find_sesqui(f"sesqui:{path}")
    except (FlowliftError, OSError, ValueError):
        raise refusal(SESQUI_FILE, shown) from None
    return f"sesqui:{path}"


def file_digest(path: str | os.PathLike, should_stop: Callable[[], None] | None = None) -> str:
    """Hex SHA-256 of ``path``'s content, read once per (real path, size, mtime, inode).

    ``should_stop`` is called before every 1 MiB chunk; it raises to stop (InvokeAI's cancel), so a
    cancelled item never waits for a whole large file to be read.
    """
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
    digest = hashlib.sha256()
    try:
        with open(real, "rb") as handle:
            while True:
                if should_stop is not None:
                    should_stop()
                block = handle.read(_CHUNK)
                if not block:
                    break
                digest.update(block)
    except OSError as error:
        raise FlowliftError(f"cannot read {path}: {error.strerror or error}") from None
    with _LOCK:
        _DIGESTS[key] = digest.hexdigest()
    return digest.hexdigest()


def files_digest(paths: Sequence[str | os.PathLike], should_stop: Callable[[], None] | None = None) -> str:
    """One hex SHA-256 for a model made of several files (TAEF2's encoder and decoder), order-independent."""
    if not paths:
        raise FlowliftError("no weight files to load")
    digests = sorted(file_digest(path, should_stop) for path in paths)
    return digests[0] if len(digests) == 1 else hashlib.sha256("".join(digests).encode()).hexdigest()


def cache_key(kind: str, digest: str, variant: str, name: str) -> Path:
    """The model cache's key for a model of ``kind`` made from files with ``digest``, built as ``variant``
    (its dtype): ``flowlift/<kind>/<digest>-<variant>/<name>``. It is a name, not a file: the node's
    loader reads the real files. ``name`` is what InvokeAI shows while loading."""
    return Path("flowlift") / kind / f"{digest}-{variant}" / name
