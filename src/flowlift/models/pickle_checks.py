"""Why ``torch.load(weights_only=True)`` refused a pickle-based weight file: code in it, or a cut file.

torch's refusal reads the same for both (an ``UnpicklingError``; a truncated pickle can even name a global cut
mid-word, ``torch._utils._rebuild_tens``), and the two need opposite fixes: a file that holds code must not be
loaded at all, a cut file downloaded again. :func:`pickle_refusal` tells them apart by reading the pickle's
opcodes with :mod:`pickletools` (a parser: it imports nothing and runs nothing) and names the global that would
have run.
"""

from __future__ import annotations

import io
import pickletools
import re
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from flowlift.errors import FlowliftError

#: The first pickle of torch's legacy (pre-zip) format holds this number; the object is its fourth pickle.
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
#: Opcodes that push one string (a STACK_GLOBAL's module and name are the two strings pushed before it).
_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING", "SHORT_BINSTRING"}


class _Truncated(Exception):
    """The pickle stream ends (or breaks) before its STOP: a cut or corrupt file, not a refused global."""


def _scan_one(stream: IO[bytes]) -> tuple[list[str], list[object]]:
    """(``module.name`` of each global, the integers it pushes) of the next pickle of ``stream``, read up to its
    STOP; :class:`_Truncated` when it ends or breaks before one."""
    names: list[str] = []
    numbers: list[object] = []
    pushed: list[object] = []  # the values of the last two pushes, which a STACK_GLOBAL takes (None: no string)
    memo: dict[int, object] = {}
    try:
        for opcode, arg, _ in pickletools.genops(stream):
            name = opcode.name
            if name in ("GLOBAL", "INST"):
                names.append(str(arg).replace(" ", ".", 1))
            elif name == "STACK_GLOBAL":
                module, attribute = ([None, None] + pushed)[-2:]
                names.append(f"{module}.{attribute}" if isinstance(module, str) and isinstance(attribute, str) else "?")
            elif name == "MEMOIZE":
                memo[len(memo)] = pushed[-1] if pushed else None
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[int(arg)] = pushed[-1] if pushed else None  # type: ignore[call-overload]
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                pushed.append(memo.get(int(arg)))  # type: ignore[call-overload]
            elif name in _STRING_OPS:
                pushed.append(arg if isinstance(arg, str) else None)
            elif opcode.stack_after:
                numbers += [arg] if name in ("LONG", "LONG1", "LONG4") else []
                pushed.append(None)
            del pushed[:-2]
            if name == "STOP":
                return names, numbers
    except ValueError:  # genops: "pickle exhausted before seeing STOP", a bad opcode, an argument cut short
        raise _Truncated from None
    raise _Truncated


def _scan(path: Path) -> list[str]:
    """The globals referenced by a weight file's pickles: a zip checkpoint's ``data.pkl``; a legacy checkpoint's
    protocol, system-info, object and storage-key pickles after its magic number; or a plain pickle.
    :class:`_Truncated` for a cut or corrupt one, or a zip without a readable ``data.pkl``."""
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as archive:
                member = next((n for n in archive.namelist() if n.rsplit("/", 1)[-1] == "data.pkl"), None)
                if member is None:
                    raise _Truncated
                return _scan_one(io.BytesIO(archive.read(member)))[0]
        except (zipfile.BadZipFile, OSError, EOFError) as error:  # a member cut short or failing its CRC
            raise _Truncated from error
    with path.open("rb") as handle:
        names, numbers = _scan_one(handle)
        if not names and numbers == [_LEGACY_MAGIC]:
            for _ in range(4):
                names += _scan_one(handle)[0]
    return names


def _unsafe(names: Iterable[str]) -> list[str]:
    """``names`` that weights_only does not allow (torch's allowlist and any the caller added), without repeats."""
    try:
        from torch import _weights_only_unpickler as unpickler

        allowed = set(unpickler._get_allowed_globals()) | set(unpickler._get_user_allowed_globals())
    except (ImportError, AttributeError):  # torch's private allowlist moved: its rebuild helpers are the safe ones
        allowed = {n for n in names if n.startswith("torch.") or n == "collections.OrderedDict"}
    return [n for n in dict.fromkeys(names) if n not in allowed]


def unsafe_globals(path: str | Path) -> list[str] | None:
    """The globals a pickle-based weight file references that weights_only does not allow (in the order they
    appear), or None when its pickle is cut or corrupt (ends before its STOP)."""
    try:
        return _unsafe(_scan(Path(path)))
    except _Truncated:
        return None


def pickle_refusal(path: str | Path, error: BaseException, *, what: str) -> FlowliftError:
    """The one line for a pickle-based weight file ``torch.load(weights_only=True)`` refused with ``error``: a file
    that references a global weights_only does not allow (named: torch's own word when it named one) is not loaded
    because unpickling it would run that code; a cut or corrupt pickle is not complete. torch's message advises
    ``weights_only=False``, i.e. running the file's code: never passed on."""
    unsafe = unsafe_globals(path)
    if not unsafe:  # cut, corrupt, or refused for an opcode torch's reader lacks (nothing to run in it)
        return FlowliftError(
            f"{what}: cannot read {path}: not a complete PyTorch tensor checkpoint (truncated, corrupt, or another "
            "format)"
        )
    named = re.search(r"GLOBAL ([\w.]+)", str(error))
    culprit = named.group(1) if named and named.group(1) in unsafe else unsafe[0]
    more = f" and {len(unsafe) - 1} more" if len(unsafe) > 1 else ""
    return FlowliftError(
        f"{what}: {path} is not loaded: its pickle holds code or objects other than tensors ({culprit}{more}), "
        "which unpickling would run; get a .safetensors copy of these weights from their publisher, or convert "
        "this file to safetensors yourself only if you trust where it came from"
    )
