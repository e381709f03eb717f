"""Output names and how outputs find the inputs they came from.

``flowlift upscale`` writes ``<stem>_x<N>.<format>`` for an input ``<stem>.<ext>``. The same naming rule
is read back by everything that pairs outputs with sources (``flowlift eval OUTPUTS --reference``, the
"it is the output of" guard in batches, ``flowlift colorfix``), so it lives here once:

* :func:`upscaled_name` / :func:`parse_upscaled_stem` write and read ``<stem>_x<N>``;
  :func:`refined_output` names the refine commands' results (``<stem>_img2img.png``, ...);
* :func:`pair_by_stem` pairs output files with reference files: the same stem first, else the stem
  with its ``_x<N>`` suffix removed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from flowlift.errors import FlowliftError

_UPSCALED = re.compile(r"^(?P<stem>.+)_x(?P<scale>[1-9][0-9]*)$")


def upscaled_name(stem: str, scale: int, fmt: str) -> str:
    """``<stem>_x<scale>.<fmt>``, the file name of ``stem``'s output at ``scale``."""
    return f"{stem}_x{int(scale)}.{fmt.lstrip('.')}"


def refined_output(image: str | None, suffix: str) -> Path:
    """Where a refine command writes by default: ``<stem>_<suffix>.png`` next to ``image``
    (``flowlift_<suffix>.png`` in the working folder for txt2img)."""
    if image:
        source = Path(image)
        return source.with_name(f"{source.stem}_{suffix}.png")
    return Path(f"flowlift_{suffix}.png")


def parse_upscaled_stem(stem: str) -> tuple[str, int] | None:
    """``("kodim01", 2)`` for ``"kodim01_x2"``; None when ``stem`` has no ``_x<N>`` suffix."""
    match = _UPSCALED.match(stem)
    if match is None:
        return None
    return match["stem"], int(match["scale"])


def index_by_stem(paths: Sequence[Path], what: str) -> dict[str, Path]:
    """``{stem: path}``; two files with one stem (``a.png``, ``a.jpg``) are an error naming both."""
    out: dict[str, Path] = {}
    for path in paths:
        if path.stem in out:
            raise FlowliftError(f"{what}: two files named {path.stem!r} ({out[path.stem].name}, {path.name})")
        out[path.stem] = path
    return out


def reference_stem(stem: str, references: set[str] | dict[str, Path]) -> str | None:
    """The reference stem an output stem pairs with: itself, else its ``_x<N>``-less stem, else None."""
    if stem in references:
        return stem
    parsed = parse_upscaled_stem(stem)
    if parsed is not None and parsed[0] in references:
        return parsed[0]
    return None


def pair_by_stem(outputs: Sequence[Path], references: Sequence[Path]) -> tuple[list[tuple[Path, Path]], list[Path]]:
    """Pair each output with its reference: ``(pairs sorted by output stem, unpaired outputs)``.

    ``kodim01.png`` and ``kodim01_x2.png`` both pair with the reference ``kodim01.png``; an exact stem
    match wins. Two outputs pairing with one reference (``a_x2`` and ``a_x4``) are an error: compare
    them in separate runs.
    """
    refs = index_by_stem(list(references), "reference")
    pairs: list[tuple[Path, Path]] = []
    unpaired: list[Path] = []
    claimed: dict[str, Path] = {}
    for output in sorted(outputs, key=lambda p: p.stem):
        stem = reference_stem(output.stem, refs)
        if stem is None:
            unpaired.append(output)
            continue
        if stem in claimed:
            raise FlowliftError(
                f"outputs {claimed[stem].name} and {output.name} both pair with the reference {refs[stem].name}; "
                "evaluate them separately"
            )
        claimed[stem] = output
        pairs.append((output, refs[stem]))
    return pairs, unpaired


def source_of(path: Path, inputs: Sequence[Path]) -> Path | None:
    """The input ``path`` is an earlier output of (``a_x2.png`` of ``a.png`` in the same folder), if any."""
    parsed = parse_upscaled_stem(path.stem)
    if parsed is None:
        return None
    for candidate in inputs:
        if candidate != path and candidate.parent.resolve() == path.parent.resolve() and candidate.stem == parsed[0]:
            return candidate
    return None
