"""Reading a ``.safetensors`` header strictly, before any tensor is read or allocated.

A safetensors file is an 8-byte little-endian header length, a JSON object ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}`` and the tensor bytes. The ``safetensors`` reader
checks this only when the tensors are read (after a model was built for them), and a file cut short by an
interrupted download or a hand-edited header then surfaces as a traceback from deep inside a loader.
:func:`read_header` checks every entry (a known dtype, a shape of non-negative integers, offsets that hold
exactly ``numel * itemsize`` bytes, packed one after the other) and the file's length against the header, and
says in one :class:`~flowlift.errors.FlowliftError` line what is wrong; a truncated file gets the command
that fetches it again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from flowlift.errors import FlowliftError
from flowlift.files.json_input import parse_json

#: Bytes per element of each safetensors dtype, and the torch name flowlift reports it by.
DTYPES = {
    "F64": (8, "float64"),
    "F32": (4, "float32"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E5M2": (1, "float8_e5m2"),
    "I64": (8, "int64"),
    "U64": (8, "uint64"),
    "I32": (4, "int32"),
    "U32": (4, "uint32"),
    "I16": (2, "int16"),
    "U16": (2, "uint16"),
    "I8": (1, "int8"),
    "U8": (1, "uint8"),
    "BOOL": (1, "bool"),
}
#: Headers larger than this are refused unread (safetensors' own limit is 100 MB).
MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class Header:
    """A checked header: each tensor's shape and torch dtype name, and the ``__metadata__`` strings."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    metadata: dict[str, str]


def refetch_hint(path: Path) -> str:
    """The command that downloads ``path`` again: exact for a file in the Hugging Face cache
    (``.../models--OWNER--NAME/snapshots/REV/FILE``), a template otherwise."""
    from flowlift.models.hub import cached_repo_path, download_command

    cached = cached_repo_path(path)
    if cached is not None and cached[1]:
        return f"fetch it again with `{download_command(cached[0], [cached[1]])} --force-download`"
    return f"fetch it again, e.g. `{download_command('OWNER/REPO', [path.name])} --local-dir {path.parent}`"


def _entry_problem(name: str, entry: object) -> str | None:
    """What is wrong with one header entry, or None."""
    if not isinstance(entry, dict):
        return f"the header entry of `{name}` is not an object"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPES:
        return f"`{name}` has an unknown dtype {dtype!r}"
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        return f"`{name}` has no valid shape (a list of non-negative integers), got {shape!r}"[:240]
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int and n >= 0 for n in offsets)):
        return f"`{name}` has no valid data_offsets (two non-negative integers), got {offsets!r}"[:240]
    if offsets[1] - offsets[0] != math.prod(shape) * DTYPES[dtype][0]:
        return (
            f"`{name}` declares shape {tuple(shape)} ({dtype}) but {offsets[1] - offsets[0]} bytes "
            f"(offsets {offsets[0]}..{offsets[1]})"
        )[:240]
    return None


def read_header(path: str | Path, *, what: str) -> Header:
    """The checked header of the safetensors file ``path`` (see the module docstring); ``what`` starts every
    error line (e.g. ``"--transformer FILE"``)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if size >= 8 and size - 8 < length <= MAX_HEADER_BYTES and handle.read(1) == b"{":
                raise FlowliftError(
                    f"{what}: truncated inside its header ({size} bytes; an interrupted download?); "
                    f"{refetch_hint(path)}"
                )
            handle.seek(8)
            if size < 8 or not 2 <= length <= min(size - 8, MAX_HEADER_BYTES):
                raise ValueError(f"a header length of {length} bytes in a file of {size}")
            header = parse_json(handle.read(length))
    except (OSError, ValueError, UnicodeDecodeError) as error:
        raise FlowliftError(f"{what}: not a readable safetensors file ({str(error)[:160]})") from None
    if not isinstance(header, dict):
        raise FlowliftError(
            f"{what}: not a readable safetensors file (its header is a {type(header).__name__}, not an object)"
        )
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FlowliftError(f"{what}: not a readable safetensors file (its __metadata__ is not a string map)")
    spans = []
    for name, entry in header.items():
        problem = _entry_problem(name, entry)
        if problem:
            raise FlowliftError(f"{what}: not a readable safetensors file ({problem})")
        spans.append((*entry["data_offsets"], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise FlowliftError(
                f"{what}: not a readable safetensors file (the data of `{name}` starts at byte "
                f"{begin}, not {end}: overlapping or missing tensor data)"
            )
        end = stop
    data = size - 8 - length
    if end > data:
        raise FlowliftError(
            f"{what}: truncated ({data} of the {end} bytes of tensor data its header declares; an interrupted "
            f"download?); {refetch_hint(path)}"
        )
    if end < data:
        raise FlowliftError(f"{what}: not a readable safetensors file ({data - end} bytes after its last tensor)")
    shapes = {name: tuple(entry["shape"]) for name, entry in header.items()}
    dtypes = {name: DTYPES[entry["dtype"]][1] for name, entry in header.items()}
    return Header(shapes, dtypes, metadata)
