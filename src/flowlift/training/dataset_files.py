"""The files of a dataset folder at fixed names, and the replace rule for them (issue 36.4).

``dataset.json`` (format :data:`FORMAT`) and ``shard-NNNNN.safetensors`` (metadata format
:data:`SHARD_FORMAT`), see :mod:`flowlift.training.shards`. flowlift's own are told by their content,
never their name: the manifest's ``format``, the shard's safetensors metadata (read from its header
alone). A link, FIFO or folder at any of these names is one line before any model loads; a non-empty
file flowlift did not write needs ``--overwrite``; flowlift's own shards are kept, so an interrupted
build resumes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from pathlib import Path

from flowlift.errors import FIELD_MARK, FlowliftError
from flowlift.files.own_files import Recogniser, check_replaceable, json_object, safetensors_metadata

FORMAT = "flowlift-latent-dataset"
SHARD_FORMAT = "flowlift-shard"
_SHARD_NAME = re.compile(r"^shard-\d+\.safetensors$")


def is_dataset_manifest(path: Path) -> bool:
    """A JSON object of format :data:`FORMAT`: a ``dataset.json`` flowlift wrote (of any version)."""
    manifest = json_object(path)
    return manifest is not None and manifest.get("format") == FORMAT


#: How many shards a dataset may have: their names hold five digits (``shard-00000`` ... ``shard-99999``).
MAX_SHARDS = 100_000


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def check_shard_total(num_items: int, shard_size: int, field: str = "num_items") -> int:
    """How many shards ``num_items`` items of ``shard_size`` take, or one line naming ``field`` (the command line's
    ``--num``) where they are more than the shard names can number (:data:`MAX_SHARDS`): refused before a manifest
    is written or any model loads, never a dataset.json promising items no shard can hold."""
    shards = -(-num_items // shard_size)
    if shards > MAX_SHARDS:
        raise FlowliftError(
            f"{FIELD_MARK} {num_items} would take {shards} shards of {shard_size} items; the shard names hold at "
            f"most {MAX_SHARDS} (shard-{MAX_SHARDS - 1:05d}): at most {MAX_SHARDS * shard_size} items at this shard "
            "size",
            field=field,
        )
    return shards


def shards_of_items(root: Path, num_items: int, shard_size: int, present: Collection[int]) -> int:
    """How many shards ``num_items`` items take, every one of them among ``present`` (else one line naming the first
    missing: a build not finished, a ``--part`` not run); shards past them are no concern of the reader's."""
    needed = -(-num_items // shard_size)
    if not present:
        raise FlowliftError(f"{root}: dataset has no shards yet")
    missing = next((k for k in range(needed) if k not in present), None)
    if missing is not None:
        have = len([k for k in present if k < needed])
        raise FlowliftError(
            f"{root / shard_name(missing)} is missing: dataset.json's {num_items} items take {needed} shards, "
            f"{have} are there; finish the build (the same `flowlift dataset` command, every --part)"
        )
    return needed


def shard_count(path: Path) -> int | None:
    """The item count in the metadata of flowlift's shard at ``path``; None when it is none of flowlift's
    shards (empty, not safetensors, another format), without reading its tensors."""
    try:
        metadata = safetensors_metadata(path)
    except OSError:
        return None
    if not metadata or metadata.get("format") != SHARD_FORMAT:
        return None
    try:
        return int(metadata.get("count", ""))
    except ValueError:
        return None


def dataset_names(root: str | os.PathLike) -> dict[Path, Recogniser]:
    """``dataset.json`` and every shard name in ``root``, with how flowlift's own is told."""
    root = Path(root)
    names: dict[Path, Recogniser] = {root / "dataset.json": is_dataset_manifest}
    try:
        entries = sorted(os.listdir(root)) if root.is_dir() else []
    except OSError as error:
        raise FlowliftError(f"cannot read {root}: {error.strerror or type(error).__name__}") from None
    for name in entries:
        if _SHARD_NAME.match(name):
            names[root / name] = lambda path: shard_count(path) is not None
    return names


def check_dataset_folder(root: str | os.PathLike, overwrite: bool = False) -> None:
    """The replace rule (:mod:`flowlift.files.own_files`) for the manifest and every shard name in ``root``:
    a link, FIFO or folder there is one line; a non-empty file flowlift did not write needs ``overwrite``
    (then it is replaced: a foreign shard is rebuilt). flowlift's own shards stay: the build resumes."""
    check_replaceable(dataset_names(root), overwrite, "dataset")
