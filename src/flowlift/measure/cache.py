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
from pathlib import Path
from typing import Any

import numpy as np

from flowlift.files.atomic import atomic_write_bytes
from flowlift.files.json_input import parse_json

CACHE_VERSION = 1


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
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*") if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.suffix == ".json")
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
        assert self.root is not None
        safe = re.sub(r"[^A-Za-z0-9_.=+-]", "_", label)
        return self.root / safe / f"{name}.{key[:16]}"

    def load(self, label: str, name: str, key: str) -> tuple[dict[str, float], np.ndarray] | None:
        if self.root is None:
            return None
        base = self._base(label, name, key)
        try:
            entry = parse_json(Path(f"{base}.json").read_text())
            if entry.get("key") != key:
                return None
            from PIL import Image

            with Image.open(Path(f"{base}.png")) as im:
                crop = np.asarray(im.convert("RGB"))
        except (OSError, ValueError):
            return None
        return entry["metrics"], crop

    def store(self, label: str, name: str, key: str, metrics: dict[str, float], crop: np.ndarray) -> None:
        if self.root is None:
            return
        import io

        from PIL import Image

        base = self._base(label, name, key)
        buffer = io.BytesIO()
        Image.fromarray(crop).save(buffer, format="PNG")
        atomic_write_bytes(Path(f"{base}.png"), buffer.getvalue())  # crop first: json marks done
        atomic_write_bytes(Path(f"{base}.json"), json.dumps({"key": key, "metrics": metrics}).encode())
