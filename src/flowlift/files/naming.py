"""Output names and how outputs find the inputs they came from.

``flowlift upscale`` writes ``<stem>_x<N>.<format>`` for an input ``<stem>.<ext>``. The same naming rule
is read back by everything that pairs outputs with sources (``flowlift eval OUTPUTS --reference``, the
"it is the output of" guard in batches, ``flowlift colorfix``), so it lives here once:

* :func:`upscaled_name` / :func:`parse_upscaled_stem` write and read ``<stem>_x<N>``;
  :func:`colorfix_name` names ``flowlift colorfix``'s results (``<stem>_x4_colorfix.png``);
  :func:`refined_output` names the refine commands' results (``<stem>_img2img.png``, ...);
* :func:`reference_of` finds the source image of an output among references: the same stem first,
  else its source stem (:func:`source_stem`: ``_colorfix`` and then ``_x<N>`` removed);
  :func:`pair_by_stem` pairs output files with reference files by that rule, so ``flowlift eval``
  pairs both ``a_x4.png`` and ``a_x4_colorfix.png`` with ``a.png``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from flowlift.errors import FlowliftError

_UPSCALED = re.compile(r"^(?P<stem>.+)_(?:x(?P<scale>[1-9][0-9]*(?:\.[0-9]+)?)|(?P<w>[1-9][0-9]*)x(?P<h>[1-9][0-9]*))$")
#: What ``flowlift colorfix`` appends to the stem of the image it fixed.
COLORFIX_SUFFIX = "_colorfix"


def upscaled_name(stem: str, scale: float | tuple[int, int], fmt: str) -> str:
    """``<stem>_x<scale>.<fmt>``, the file name of ``stem``'s output at ``scale`` (``_x4``, ``_x1.5``), or
    ``<stem>_<W>x<H>.<fmt>`` for an output asked by its size (a (width, height) pair: ``--long-side``, ``--size``)."""
    if isinstance(scale, tuple):
        return f"{stem}_{scale[0]}x{scale[1]}.{fmt.lstrip('.')}"
    return f"{stem}_x{float(scale):g}.{fmt.lstrip('.')}"


def colorfix_name(stem: str, fmt: str) -> str:
    """``<stem>_colorfix.<fmt>``: ``flowlift colorfix``'s output for the upscaled image ``<stem>``."""
    return f"{stem}{COLORFIX_SUFFIX}.{fmt.lstrip('.')}"


def refined_output(image: str | None, suffix: str) -> Path:
    """Where a refine command writes by default: ``<stem>_<suffix>.png`` next to ``image``
    (``flowlift_<suffix>.png`` in the working folder for txt2img)."""
    if image:
        source = Path(image)
        return source.with_name(f"{source.stem}_{suffix}.png")
    return Path(f"flowlift_{suffix}.png")


def parse_upscaled_stem(stem: str) -> tuple[str, float | tuple[int, int]] | None:
    """``("kodim01", 2)`` for ``"kodim01_x2"``, ``("a", 1.5)`` for ``"a_x1.5"``, ``("a", (3840, 2560))`` for
    ``"a_3840x2560"``; None when ``stem`` has none of these suffixes."""
    match = _UPSCALED.match(stem)
    if match is None:
        return None
    if match["scale"] is None:
        return match["stem"], (int(match["w"]), int(match["h"]))
    scale = float(match["scale"])
    return match["stem"], int(scale) if scale.is_integer() else scale


def index_by_stem(paths: Sequence[Path], what: str) -> dict[str, Path]:
    """``{stem: path}``; two files with one stem (``a.png``, ``a.jpg``) are an error naming both."""
    out: dict[str, Path] = {}
    for path in paths:
        if path.stem in out:
            raise FlowliftError(f"{what}: two files named {path.stem!r} ({out[path.stem].name}, {path.name})")
        out[path.stem] = path
    return out


def source_stem(stem: str) -> str | None:
    """The stem of the image an output was made from: ``kodim01`` for ``kodim01_x2`` and for
    ``kodim01_x2_colorfix``, ``photo`` for ``photo_colorfix``; None when ``stem`` names no source."""
    base = stem.removesuffix(COLORFIX_SUFFIX) if stem != COLORFIX_SUFFIX else stem
    parsed = parse_upscaled_stem(base)
    if parsed is not None:
        base = parsed[0]
    return base if base != stem else None


def reference_of(path: Path, references: dict[str, Path], *, itself: bool = False) -> Path | None:
    """The reference ``path`` pairs with (``references`` by stem): the one with the same stem, else the
    one named by its :func:`source_stem`. ``path`` itself only with ``itself`` (``flowlift eval`` may
    measure a folder against itself; ``flowlift colorfix`` takes one folder holding both sides)."""
    for stem in (path.stem, source_stem(path.stem)):
        found = references.get(stem) if stem is not None else None
        if found is not None and (itself or not _same_file(found, path)):
            return found
    return None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def pair_by_stem(outputs: Sequence[Path], references: Sequence[Path]) -> tuple[list[tuple[Path, Path]], list[Path]]:
    """Pair each output with its reference (:func:`reference_of`): ``(pairs sorted by output stem,
    unpaired outputs)``.

    ``kodim01.png``, ``kodim01_x2.png`` and ``kodim01_x2_colorfix.png`` all pair with the reference
    ``kodim01.png``; an exact stem match wins. Two outputs pairing with one reference (``a_x2`` and
    ``a_x4``) are an error: compare them in separate runs.
    """
    refs = index_by_stem(list(references), "reference")
    pairs: list[tuple[Path, Path]] = []
    unpaired: list[Path] = []
    claimed: dict[Path, Path] = {}
    for output in sorted(outputs, key=lambda p: p.stem):
        reference = reference_of(output, refs, itself=True)
        if reference is None:
            unpaired.append(output)
            continue
        if reference in claimed:
            raise FlowliftError(
                f"outputs {claimed[reference].name} and {output.name} both pair with the reference "
                f"{reference.name}; evaluate them separately"
            )
        claimed[reference] = output
        pairs.append((output, reference))
    return pairs, unpaired


def explicit_pair(outputs: Sequence[str], references: Sequence[str]) -> tuple[Path, Path] | None:
    """``(output, reference)`` when exactly one file is given on each side: the user named the pair,
    so it holds whatever the two files are called. None otherwise (folders or several files)."""
    if len(outputs) != 1 or len(references) != 1:
        return None
    output, reference = Path(outputs[0]).expanduser(), Path(references[0]).expanduser()
    if not (output.is_file() and reference.is_file()):
        return None
    if _same_file(output, reference):
        raise FlowliftError(f"{output} is given as its own reference")
    return output, reference


def source_of(path: Path, inputs: Sequence[Path]) -> Path | None:
    """The input ``path`` is an earlier output of (``a_x2.png`` of ``a.png`` in the same folder), if any."""
    parsed = parse_upscaled_stem(path.stem)
    if parsed is None:
        return None
    for candidate in inputs:
        if candidate != path and candidate.parent.resolve() == path.parent.resolve() and candidate.stem == parsed[0]:
            return candidate
    return None
