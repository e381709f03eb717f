"""JSON from files flowlift did not write (safetensors headers, manifest lines, image and adapter
metadata, model configs), parsed with a bound on how deeply it nests.

``json.loads`` recurses once per nested ``[`` or ``{``, so a header of a million brackets raises
``RecursionError`` (not ``ValueError``) and a thousand of them parse into a value that later recursive
code (``copy.deepcopy``, a config library's validation) cannot take. No file flowlift reads nests
deeper than a handful of levels, so :func:`parse_json` refuses anything past :data:`MAX_JSON_DEPTH` with
the ``ValueError`` every caller already turns into its one-line error.
"""

from __future__ import annotations

import json
from itertools import repeat
from typing import Any

#: Deepest nesting accepted (a safetensors header is 3 levels, a model config or manifest line < 10).
MAX_JSON_DEPTH = 64
_CONTAINERS = (list, dict)


def nesting_depth(value: object) -> int:
    """Levels of list/dict nesting in ``value`` (a scalar is 0, ``[]`` and ``{}`` are 1), counted without
    recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, depth)
        if any(map(isinstance, item, repeat(_CONTAINERS))):  # at C speed: most lists hold numbers only
            stack.extend((child, depth + 1) for child in item if isinstance(child, _CONTAINERS))
    return deepest


def parse_json(text: str | bytes | bytearray, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads(text)``, with ``ValueError`` (never ``RecursionError``) for JSON nested deeper than
    ``max_depth`` levels, as for any malformed JSON."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"JSON nested more than {max_depth} levels deep") from None
    if isinstance(value, (list, dict)) and nesting_depth(value) > max_depth:
        raise ValueError(f"JSON nested more than {max_depth} levels deep")
    return value
