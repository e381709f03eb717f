"""What tells one training dataset from another, so that a resumed run refuses to go on with other data.

A checkpoint's training state records the identity of the dataset it was trained on (:func:`dataset_identity`:
the ``num_items`` of its ``dataset.json`` and a hash of everything else that file holds); a resume compares it with
the dataset the run opened (:func:`check_same_data`). Training reads only folders built by ``flowlift dataset``
(:class:`~flowlift.training.shards.ShardReader` refuses a folder without ``dataset.json``), so every dataset has one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowlift.errors import FlowliftError

if TYPE_CHECKING:
    from flowlift.training.distributed import DistContext


def dataset_identity(manifest: dict[str, Any], data: str) -> dict[str, Any]:
    """What tells a dataset folder's data (``manifest``: its ``dataset.json``, read from ``data``): its ``num_items``
    and a hash of everything else the manifest holds (its kind, shapes, degradation, seed, VAE, the teacher or the
    photos and crops), as canonical JSON so that the file's layout does not count. The shards' bytes are not
    hashed (gigabytes, read at every resume); ``path`` is only for messages: a dataset moved is the same data."""
    settings = {key: value for key, value in manifest.items() if key != "num_items"}
    text = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    return {
        "path": str(data),
        "num_items": manifest.get("num_items"),
        "settings_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
    }


def _described(identity: dict[str, Any]) -> str:
    return f"{identity.get('path')} ({identity.get('num_items')} items)"


def _differs(saved: dict[str, Any], data: dict[str, Any]) -> str | None:
    """How ``data`` differs from ``saved`` (two :func:`dataset_identity`), or None when it is the same data."""
    if saved.get("settings_sha256") != data["settings_sha256"]:
        return f"{_described(data)[:-1]}, its dataset.json built with other settings)"
    if saved.get("num_items") != data["num_items"]:
        return _described(data)
    return None


def check_same_data(path: Path, saved: object, data: dict[str, Any] | None) -> None:
    """One line when checkpoint ``path`` was trained on other data than ``data`` (:func:`dataset_identity`;
    ``saved``: the checkpoint's record, None in a checkpoint written before it was recorded: not compared). A
    resumed run must keep its data: other items, or more of them (a grown ``--num``), change every epoch's order,
    and the run would no longer be the one its checkpoints and ``config.json`` describe."""
    if not isinstance(saved, dict) or data is None:
        return
    if (now := _differs(saved, data)) is not None:
        raise FlowliftError(
            f"checkpoint {path} was trained on {_described(saved)}, this run's --data is {now}: a resumed run keeps "
            f"its data; to continue on new data, train into a new --output with --init {path}"
        )


def agreed_identity(dist: DistContext, mine: dict[str, Any]) -> dict[str, Any]:
    """The run's dataset identity, the same on every rank (each compares it with a resumed checkpoint's, so each
    must reach the same verdict): every rank's is gathered, and one that differs from rank 0's (each machine
    reading its own copy of the data, one of them another build) is the same line on every rank."""
    identities = dist.gather(mine)
    first = identities[0]
    for rank, other in enumerate(identities):
        if (now := _differs(first, other)) is not None:
            raise FlowliftError(
                f"rank {rank} reads {now}, rank 0 reads {_described(first)}: give every rank the same dataset"
            )
    return first
