"""The ``flowlift eval`` result cache: one entry per (method, image), so a rerun (or a sharded run's merge)
reuses what is done. The key hashes the method and its options, the scale, the box, the input and ground-truth
pixels, and -- for methods that use them -- the VAE / upscaler identity (SHA-256 of their local weight files, or
the hub id) and device/dtype.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from flowlift.errors import FIELD_MARK
from flowlift.files.atomic import atomic_write_bytes
from flowlift.files.own_files import (
    flowlift_image,
    folder_refusal,
    json_object,
    replace_problem,
    report_float,
    report_json,
    software,
    stamp,
)

#: Bumped when the metrics change (2: psnr_y / ssim_y; 3: the drift's downsample in float64), so older entries
#: are recomputed, not reported short or from other arithmetic.
CACHE_VERSION = 3


def array_digest(*arrays: np.ndarray | None) -> str:
    """SHA-256 over shapes, dtypes and bytes of ``arrays`` (``None`` hashes as absent)."""
    digest = hashlib.sha256()
    for a in arrays:
        if a is None:
            digest.update(b"none")
            continue
        a = np.ascontiguousarray(a)
        digest.update(f"{a.shape}|{a.dtype}|".encode())
        digest.update(a.tobytes())
    return digest.hexdigest()


def model_identity(spec: str | os.PathLike | None) -> str | None:
    """Identity of weights given as a local file/folder (SHA-256 over their weight/config files,
    names included) or a hub id (the id itself). ``None`` stays ``None``."""
    from flowlift.files.image_outputs import file_sha256
    from flowlift.models.weights import WEIGHT_SUFFIXES

    if spec is None:
        return None
    path = Path(spec).expanduser()
    if not path.exists():
        return f"hub:{spec}"
    files = (
        [path]
        if path.is_file()
        else sorted(p for p in path.rglob("*") if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.suffix == ".json"))
    )
    digest = hashlib.sha256()
    for p in files:
        digest.update(f"{p.relative_to(path) if p != path else p.name}|{file_sha256(p)}|".encode())
    return f"sha256:{digest.hexdigest()}"


def cache_key(fields: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of ``fields`` (sorted keys)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


class ResultCache:
    """Per-(method, image) results in ``root/<method label>/<image>.<key[:16]>.{json,png}``.

    A ``.json`` entry holds the key and the metrics; the ``.png`` next to it the figure crop. A
    missing root or ``root=None`` disables caching.
    """

    def __init__(self, root: Path | None):
        self.root = root

    def _base(self, label: str, name: str, key: str) -> Path:
        return self.folder(label) / f"{name}.{key[:16]}"

    def load(self, label: str, name: str, key: str) -> tuple[dict[str, float], np.ndarray] | None:
        if self.root is None:
            return None
        base = self._base(label, name, key)
        try:
            entry = json_object(Path(f"{base}.json"))  # never through a link, never blocking on a FIFO
            metrics = entry_metrics(entry) if entry is not None and entry.get("key") == key else None
            if metrics is None:
                return None
            from PIL import Image

            with Image.open(Path(f"{base}.png")) as im:
                crop = np.asarray(im.convert("RGB"))
        except (OSError, ValueError):
            return None
        return metrics, crop

    def store(self, label: str, name: str, key: str, metrics: dict[str, float], crop: np.ndarray) -> None:
        if self.root is None:
            return
        import io

        from PIL import Image, PngImagePlugin

        base = self._base(label, name, key)
        buffer = io.BytesIO()
        info = PngImagePlugin.PngInfo()
        info.add_text("Software", software("eval cache"))
        Image.fromarray(crop).save(buffer, format="PNG", pnginfo=info)
        atomic_write_bytes(Path(f"{base}.png"), buffer.getvalue())  # crop first: json marks done
        entry = {"flowlift": stamp("eval cache"), "key": key, "metrics": metrics}
        atomic_write_bytes(Path(f"{base}.json"), report_json(entry))  # strict: an identical image's PSNR is "inf"

    def folder(self, label: str) -> Path:
        """The folder of ``label``'s entries."""
        assert self.root is not None
        return self.root / re.sub(r"[^A-Za-z0-9_.=+-]", "_", label)

    def problems(self, labels: Sequence[str], overwrite: bool) -> str | None:
        """The replace rule (:mod:`flowlift.files.own_files`) for every entry name the run may write.

        Entry names come from keys only known once each image is read, so every entry name already
        in the methods' folders is checked instead: a link, FIFO or folder there is refused, and a
        non-empty file that is no cache entry of flowlift's needs ``overwrite``. Other files stay.
        """
        if self.root is None:
            return None
        if refusal := folder_refusal(self.root):
            return refusal
        for label in labels:
            folder = self.folder(label)
            if refusal := folder_refusal(folder):
                return refusal
            try:
                names = sorted(os.listdir(folder)) if folder.is_dir() else []
            except OSError as error:
                return f"cannot read the cache folder {folder}: {error.strerror or type(error).__name__}"
            for name in names:
                if match := _ENTRY_NAME.match(name):
                    recognise = _own_entry_json if match.group(2) == "json" else _own_entry_png
                    if problem := replace_problem(folder / name, recognise, overwrite, "eval", FIELD_MARK):
                        return problem
        return None


def entry_metrics(entry: dict[str, Any]) -> dict[str, float] | None:
    """A cache entry's metrics as floats, read back as :meth:`ResultCache.store` wrote them (strict JSON: ``"inf"``
    for an identical image's PSNR; entries of older releases hold a bare ``Infinity``, which reads as well); None,
    a miss, when any value is no number."""
    metrics = entry.get("metrics")
    if not isinstance(metrics, dict):
        return None
    values = {name: report_float(value) for name, value in metrics.items()}
    return None if None in values.values() else values  # type: ignore[return-value]


_ENTRY_NAME = re.compile(r"^.+\.([0-9a-f]{16})\.(json|png)$")


def _own_entry_json(path: Path) -> bool:
    """A cache entry: a JSON object whose ``key`` begins with the 16 hex digits of its name, with metrics."""
    entry = json_object(path)
    match = _ENTRY_NAME.match(path.name)
    return (
        entry is not None
        and match is not None
        and isinstance(entry.get("key"), str)
        and entry["key"][:16] == match.group(1)
        and isinstance(entry.get("metrics"), dict)
    )


def _own_entry_png(path: Path) -> bool:
    """A cache crop: flowlift's PNG, or (written before crops carried a mark) beside its own entry."""
    return flowlift_image(path) or _own_entry_json(path.with_suffix(".json"))
