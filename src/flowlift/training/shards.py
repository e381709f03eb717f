"""The training data format: sharded safetensors files, and a streaming loader over them.

A dataset is a directory::

    dataset.json              {"format": "flowlift-latent-dataset", "version": 1, "kind": ...,
                               "target_shape": [32, H, W], "cond_shape": [32, H/2, W/2],
                               "shard_size": S, "num_items": N, "has_noise": bool,
                               "degradation": {...}, "vae": ..., "seed": ..., "source": {...}}
    shard-00000.safetensors   tensors  target [n, 32, H, W]   (normalized target latents)
                                       cond   [n, 32, H/2, W/2] (conditioning latents)
                                       noise  [n, 32, H, W]   (distill shards only: the teacher's noise)
                              metadata {"format": "flowlift-shard", "version": "1", "count": "n",
                                        "first_item": "k", "items": JSON list of per-item records}

Shard ``k`` holds items ``k*S .. k*S+n-1`` (every shard is full but the last), written to a
temporary name and renamed, so a file that exists is complete: builders resume by skipping them.
The reader takes exactly ``num_items`` items: a shard of them missing (a build not finished, a ``--part`` not run)
or holding another count is one line; a shard past them (left by a larger earlier build) is never opened.

The loader (:class:`ShardStream`) reads single items through safetensors' memory-mapped slices
(bounded memory), draws a global per-epoch permutation, and gives each (step, micro-batch, rank) a
slice of it. Every random choice of an item (crop offset, fresh noise, flow time t) is a pure
function of ``(seed, global position)``, so one process with batch 2B and two processes with
batch B see exactly the same samples, and a resumed run sees the same samples as an uninterrupted one.
Crops are aligned to the latent grid: offsets and sizes are multiples of 4 target-latent pixels,
so the half-size conditioning crop starts on its 2x2 patchify grid (normalization is per
patchified channel, i.e. per 2x2 phase).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flowlift.errors import FlowliftError
from flowlift.files.atomic import atomic_output, atomic_write_text
from flowlift.files.json_input import parse_json
from flowlift.knobs import wrap_seed
from flowlift.training.dataset_files import (  # noqa: F401 - the format's names live with the replace rule
    FORMAT,
    SHARD_FORMAT,
    check_dataset_folder,
    is_dataset_manifest,
    shard_count,
    shard_name,
    shards_of_items,
)
from flowlift.training.objective import logistic

VERSION = 1
CROP_ALIGN = 4
STORAGE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def read_manifest(root: str | os.PathLike) -> dict[str, Any]:
    path = Path(root) / "dataset.json"
    if not path.is_file():
        raise FlowliftError(f"{root} is not a flowlift dataset (no dataset.json); build one with `flowlift dataset`")
    try:
        manifest = parse_json(path.read_text())
    except (OSError, ValueError) as error:  # UnicodeDecodeError and too deep JSON are ValueErrors
        raise FlowliftError(f"cannot read {path}: {str(error).splitlines()[0]}") from None
    if not isinstance(manifest, dict):
        raise FlowliftError(f"{path}: the manifest must be a JSON object, got a {type(manifest).__name__}")
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise FlowliftError(f"{path}: not a {FORMAT} v{VERSION} manifest")
    return manifest


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """Refuse a manifest whose fields the reader relies on are missing or impossible (one line)."""
    if not _positive_int(manifest.get("shard_size")):
        raise FlowliftError(f"{path}: shard_size must be a positive integer, got {manifest.get('shard_size')!r}")
    shapes = {}
    for key in ("target_shape", "cond_shape"):
        shape = manifest.get(key)
        if not (isinstance(shape, list) and len(shape) == 3 and all(_positive_int(v) for v in shape)):
            raise FlowliftError(f"{path}: {key} must be [channels, height, width] of positive integers, got {shape!r}")
        shapes[key] = shape
    if not _positive_int(manifest.get("num_items")):
        raise FlowliftError(f"{path}: num_items must be a positive integer, got {manifest.get('num_items')!r}")
    target, cond = shapes["target_shape"], shapes["cond_shape"]
    if target[0] != cond[0] or target[1] != 2 * cond[1] or target[2] != 2 * cond[2]:
        raise FlowliftError(f"{path}: cond_shape {cond} must be target_shape {target} at half the size")


def write_manifest(root: str | os.PathLike, manifest: dict[str, Any]) -> None:
    path = Path(root) / "dataset.json"
    atomic_write_text(path, json.dumps(manifest, indent=2, sort_keys=True))  # unique temp per writer


def _flatten(manifest: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"source": {"crop": 512}}`` -> ``{"source.crop": 512}``, so a message can name the one setting that differs."""
    flat: dict[str, Any] = {}
    for key, value in manifest.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, sort_keys=True, default=str) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 3] + "..."


def prepare_dataset_dir(root: str | os.PathLike, manifest: dict[str, Any], overwrite: bool = False) -> None:
    """Create ``root`` with ``manifest``, or check that an existing dataset has the same settings.

    Only ``num_items`` may differ (a resumed build may ask for more items). A different setting
    raises one FlowliftError line instead of mixing two datasets. An empty ``dataset.json``, or one
    flowlift did not write where ``overwrite`` allows replacing it, is replaced (:func:`check_dataset_folder`).
    """
    if not str(os.fspath(root)).strip():  # Path("") is the working folder: an empty name names no dataset
        raise FlowliftError(f"the dataset folder is an empty name, got {os.fspath(root)!r}")
    root = Path(root)
    check_dataset_folder(root, overwrite)
    manifest = {"format": FORMAT, "version": VERSION, **manifest}
    if (root / "dataset.json").is_file() and is_dataset_manifest(root / "dataset.json"):
        existing = read_manifest(root)
        now, there = _flatten(manifest), _flatten(existing)
        differing = sorted(
            (k for k in set(now) | set(there) if k != "num_items" and now.get(k) != there.get(k)),
            key=lambda k: ("." not in k, k),  # the build settings (source.crop, ...) before derived shapes
        )
        if differing:
            shown = "; ".join(
                f"{key}: {_short(now.get(key))} now, {_short(there.get(key))} there" for key in differing[:3]
            )
            more = f"; and {len(differing) - 3} more" if len(differing) > 3 else ""
            raise FlowliftError(
                f"{root} already holds a dataset built with other settings ({shown}{more}); "
                "use a new output folder or the same settings"
            )
    root.mkdir(parents=True, exist_ok=True)
    write_manifest(root, manifest)


def completed_shards(root: str | os.PathLike) -> list[int]:
    """Indices of the shard files present in ``root`` (each is complete: written atomically). A file
    at a shard name that is none of flowlift's is listed too: the reader names it, the builder
    (:func:`shard_count`) rebuilds it where ``--overwrite`` allowed it."""
    out = []
    for path in Path(root).glob("shard-*.safetensors"):
        try:
            out.append(int(path.stem.split("-")[1]))
        except (IndexError, ValueError):
            continue
    return sorted(out)


def write_shard(
    root: str | os.PathLike,
    index: int,
    first_item: int,
    tensors: dict[str, torch.Tensor],
    items: Sequence[dict[str, Any]],
    dtype: torch.dtype = torch.float16,
) -> Path:
    """Write one shard atomically (temporary file + rename). ``tensors``: target, cond[, noise].

    A tensor holding NaN or Inf as stored (a VAE whose weights overflow, a value past float16's range) is
    refused in one line and nothing is written: a shard of NaN would train to NaN."""
    from safetensors.torch import save_file

    from flowlift.models.weights import first_non_finite

    count = len(items)
    for name, tensor in tensors.items():
        if tensor.shape[0] != count:
            raise ValueError(f"shard tensor {name} has {tensor.shape[0]} items, metadata has {count}")
    path = Path(root) / shard_name(index)
    metadata = {
        "format": SHARD_FORMAT,
        "version": str(VERSION),
        "count": str(count),
        "first_item": str(first_item),
        "items": json.dumps(list(items)),
    }
    data = {k: v.detach().to("cpu", dtype).contiguous() for k, v in tensors.items()}
    if bad := first_non_finite(data):
        raise FlowliftError(
            f"{path.name}: {bad} stored as {str(dtype).removeprefix('torch.')} (a VAE or teacher whose weights "
            "overflow, or values past the storage dtype's range); nothing was written"
        )
    with atomic_output(path) as tmp:
        save_file(data, str(tmp), metadata=metadata)
    return path


class ShardReader:
    """Random access to the items of a dataset directory through memory-mapped safetensors slices.

    At most ``max_open`` shard files are open at once (least recently used are closed).
    """

    def __init__(self, root: str | os.PathLike, max_open: int = 16) -> None:
        from safetensors import safe_open

        self._safe_open = safe_open
        self.root = Path(root)
        self.manifest = read_manifest(self.root)
        check_manifest(self.root / "dataset.json", self.manifest)
        self.shard_size = int(self.manifest["shard_size"])
        self.max_open = max_open
        self._open: OrderedDict[int, Any] = OrderedDict()
        self.counts: dict[int, int] = {}
        self.has_noise = bool(self.manifest.get("has_noise", False))
        self.target_shape = tuple(self.manifest["target_shape"])
        self.cond_shape = tuple(self.manifest["cond_shape"])
        self.num_items = int(self.manifest["num_items"])
        # the items are dataset.json's num_items, every shard that holds them there and whole (a --part build not
        # finished trained on part of them); a shard past them (a rebuild with fewer items) is never opened
        needed = shards_of_items(self.root, self.num_items, self.shard_size, completed_shards(self.root))
        for index in range(needed):
            path = self.root / shard_name(index)
            count = self._check_shard(path)
            expected = min(self.shard_size, self.num_items - index * self.shard_size)
            if count != expected:
                raise FlowliftError(
                    f"{path}: holds {count} items where dataset.json's {self.num_items} items put {expected}; "
                    "rerun the `flowlift dataset` command that made it"
                )
            self.counts[index] = count

    def _check_shard(self, path: Path) -> int:
        """Open ``path`` once and check its header against the manifest; returns its item count.

        Truncated, empty or garbage files, a missing or absurd ``count``, missing tensors, wrong shapes
        and non-float dtypes each raise one FlowliftError line naming the file; so does anything but a regular
        file (a FIFO would block safetensors' open, in Rust, where no signal reaches Python).
        """
        if path.exists() and not path.is_file():
            raise FlowliftError(f"{path}: not a regular file (a shard is a .safetensors file the dataset wrote)")
        try:
            with self._safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                names = set(f.keys())
                shapes = {name: list(f.get_slice(name).get_shape()) for name in names}
                dtypes = {name: str(f.get_slice(name).get_dtype()) for name in names}
        except Exception as error:  # noqa: BLE001 - safetensors raises its own types for any bad file
            text = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise FlowliftError(f"{path}: unreadable shard, truncated or not safetensors ({text})") from None
        if meta.get("format") != SHARD_FORMAT:
            raise FlowliftError(f"{path} is not a flowlift shard (metadata format {meta.get('format')!r})")
        count_text = meta.get("count")
        if count_text is None or not str(count_text).isdigit():
            raise FlowliftError(f"{path}: shard metadata 'count' is missing or not a number ({count_text!r})")
        count = int(count_text)
        if not 1 <= count <= self.shard_size:
            raise FlowliftError(f"{path}: shard count {count} is not in 1..shard_size ({self.shard_size})")
        expected = {"target": [count, *self.target_shape], "cond": [count, *self.cond_shape]}
        if self.has_noise:
            expected["noise"] = [count, *self.target_shape]
        for name, shape in expected.items():
            if name not in shapes:
                raise FlowliftError(f"{path}: shard has no '{name}' tensor")
            if shapes[name] != shape:
                raise FlowliftError(f"{path}: tensor '{name}' has shape {shapes[name]}, the manifest says {shape}")
            if dtypes[name] not in ("F16", "BF16", "F32", "F64"):
                raise FlowliftError(f"{path}: tensor '{name}' has dtype {dtypes[name]}, expected floating point")
        return count

    def __len__(self) -> int:
        return self.num_items

    def _handle(self, shard: int):
        handle = self._open.get(shard)
        if handle is None:
            handle = self._safe_open(str(self.root / shard_name(shard)), framework="pt")
            handle.__enter__()
            self._open[shard] = handle
            while len(self._open) > self.max_open:
                _, old = self._open.popitem(last=False)
                old.__exit__(None, None, None)
        else:
            self._open.move_to_end(shard)
        return handle

    def item(self, index: int, window: tuple[int, int, int, int] | None = None) -> dict[str, torch.Tensor]:
        """Item ``index`` as float32 tensors. ``window = (top, left, height, width)`` in target-latent
        pixels crops target/noise there and cond at half of it (all values multiples of 2)."""
        if not 0 <= index < self.num_items:
            raise IndexError(f"item {index} out of range 0..{self.num_items - 1}")
        shard, offset = divmod(index, self.shard_size)
        handle = self._handle(shard)
        names = ["target", "cond"] + (["noise"] if self.has_noise else [])
        out = {}
        for name in names:
            sl = handle.get_slice(name)
            if window is None:
                tensor = sl[offset : offset + 1]
            else:
                top, left, height, width = window
                scale = 1 if name != "cond" else 2
                t0, l0, hh, ww = top // scale, left // scale, height // scale, width // scale
                tensor = sl[offset : offset + 1, :, t0 : t0 + hh, l0 : l0 + ww]
            out[name] = tensor[0].to(torch.float32)
        return out

    def close(self) -> None:
        while self._open:
            _, handle = self._open.popitem()
            handle.__exit__(None, None, None)


@dataclass(frozen=True)
class TimeSampling:
    """How the flow time t in [0, 1] is drawn per sample.

    ``fixed``: t = ``value`` (1.0 = pure one-step distillation from noise);
    ``uniform``: t ~ U(``low``, ``high``);
    ``logit_normal``: t = sigmoid(m + s * n), n ~ N(0, 1) (SD3's logit-normal).
    """

    mode: str = "fixed"
    value: float = 1.0
    low: float = 0.0
    high: float = 1.0
    mean: float = 0.0
    std: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in ("fixed", "uniform", "logit_normal"):
            raise FlowliftError(f"t sampling must be fixed, uniform or logit_normal, got {self.mode!r}")
        if not 0.0 <= self.value <= 1.0 or not 0.0 <= self.low <= self.high <= 1.0:
            raise FlowliftError("t sampling values must lie in [0, 1] with low <= high")

    def sample(self, generator: torch.Generator) -> float:
        if self.mode == "fixed":
            return float(self.value)
        if self.mode == "uniform":
            u = torch.rand((), generator=generator).item()
            return float(self.low + (self.high - self.low) * u)
        n = torch.randn((), generator=generator).item()
        return logistic(self.mean + self.std * n)


def item_generator(seed: int, position: int) -> torch.Generator:
    """CPU generator for the sample at global stream ``position``: seeded by ``(seed, position)``."""
    mixed = (int(seed) * 0x9E3779B97F4A7C15 + int(position) * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)
    return torch.Generator(device="cpu").manual_seed(mixed)


class ShardStream:
    """Deterministic streaming batches over a :class:`ShardReader`.

    The stream is the concatenation of per-epoch permutations of all items (``randperm`` seeded by
    ``seed + epoch``). Optimizer step ``s`` consumes ``global_batch = world_size * micro_batch *
    grad_accum`` consecutive positions; micro-batch ``m`` on rank ``r`` takes the ``micro_batch``
    positions starting at ``s*global_batch + (m*world_size + r)*micro_batch`` — the DistributedSampler
    interleaving, made a pure function of (step, micro, rank) so that resume needs no loader state.
    """

    def __init__(
        self,
        reader: ShardReader,
        *,
        micro_batch: int,
        crop: int | None = None,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        grad_accum: int = 1,
        time_sampling: TimeSampling | None = None,
        use_stored_noise: bool = True,
        shuffle: bool = True,
    ) -> None:
        if micro_batch < 1 or grad_accum < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise FlowliftError("batch size, accumulation and world size must be >= 1, rank < world size")
        _, height, width = reader.target_shape
        if crop is not None and crop > 0:
            if crop % CROP_ALIGN:
                raise FlowliftError(f"crop must be a multiple of {CROP_ALIGN} latent pixels, got {crop}")
            if crop > min(height, width):
                most = min(height, width) // CROP_ALIGN * CROP_ALIGN
                raise FlowliftError(
                    f"crop {crop} is larger than the dataset's latents ({height}x{width}): give at most {most} "
                    "(0: whole items)",
                    field="crop",
                )
        self.reader = reader
        self.micro_batch = micro_batch
        self.crop = crop if crop else None
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.grad_accum = grad_accum
        self.time_sampling = time_sampling or TimeSampling()
        self.use_stored_noise = use_stored_noise and reader.has_noise
        self.shuffle = shuffle
        self._perm_cache: dict[int, torch.Tensor] = {}

    @property
    def global_batch(self) -> int:
        return self.world_size * self.micro_batch * self.grad_accum

    def _permutation(self, epoch: int) -> torch.Tensor:
        perm = self._perm_cache.get(epoch)
        if perm is None:
            n = len(self.reader)
            if self.shuffle:
                perm = torch.randperm(n, generator=torch.Generator().manual_seed(wrap_seed(self.seed * 1009 + epoch)))
            else:
                perm = torch.arange(n)
            self._perm_cache = {epoch: perm}
        return perm

    def item_at(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.reader))
        return int(self._permutation(epoch)[offset])

    def sample(self, position: int) -> dict[str, torch.Tensor]:
        """The training sample at global stream ``position`` (crop, noise and t from its own seed)."""
        generator = item_generator(self.seed, position)
        index = self.item_at(position)
        _, height, width = self.reader.target_shape
        window = None
        if self.crop is not None:
            top = int(torch.randint(0, (height - self.crop) // CROP_ALIGN + 1, (), generator=generator)) * CROP_ALIGN
            left = int(torch.randint(0, (width - self.crop) // CROP_ALIGN + 1, (), generator=generator)) * CROP_ALIGN
            window = (top, left, self.crop, self.crop)
        item = self.reader.item(index, window)
        t = self.time_sampling.sample(generator)
        if self.use_stored_noise:
            noise = item["noise"]
        else:
            noise = torch.randn(item["target"].shape, generator=generator, dtype=torch.float32)
        return {"target": item["target"], "cond": item["cond"], "noise": noise, "t": torch.tensor(t)}

    def positions(self, step: int, micro: int) -> range:
        start = step * self.global_batch + (micro * self.world_size + self.rank) * self.micro_batch
        return range(start, start + self.micro_batch)

    def batch(self, step: int, micro: int = 0) -> dict[str, torch.Tensor]:
        """This rank's micro-batch ``micro`` of optimizer step ``step`` (0-based), stacked."""
        samples = [self.sample(p) for p in self.positions(step, micro)]
        return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
