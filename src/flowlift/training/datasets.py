"""The two dataset builders and the teachers for flow distillation.

* :func:`build_distill_dataset` — a *teacher* (any callable ``noise -> latent``; wrappers below for
  a FLUX.2 diffusers pipeline or a bare ``Flux2Transformer2DModel``) turns stored seeded noise into
  target latents; each item stores (noise, target, cond). These are the distillation pairs of the
  released model (FLUX.2-klein-4B as teacher).
* :func:`build_images_dataset` — targets are VAE encodings of random crops (and flips) of real
  photos; noise is drawn fresh at train time.

Both write :mod:`flowlift.training.shards` files, resume by skipping complete shards, and make the
conditioning with :func:`flowlift.training.degrade.conditioning_latents` (decode -> pixel-space
antialiased downscale -> encode). Every item's randomness is seeded by ``(seed, item index)``, so
a resumed build writes the same bytes as an uninterrupted one.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flowlift.errors import FIELD_MARK, FlowliftError
from flowlift.flux2.latents import LATENT_CHANNELS, VAE_SCALE_FACTOR, image_seq_len, normalize, patchify
from flowlift.knobs import check_callable, check_kind, check_positive
from flowlift.training.builder_checks import (
    check_build,
    check_image_paths,
    check_latent_size,
    check_photo_crops,
    check_source,
    check_writing,
)
from flowlift.training.dataset_files import check_shard_total
from flowlift.training.degrade import Degradation, LatentCodec, conditioning_latents
from flowlift.training.shards import (
    completed_shards,
    item_generator,
    prepare_dataset_dir,
    shard_count,
    shard_name,
    write_shard,
)

Teacher = Callable[[torch.Tensor], torch.Tensor]


def item_seed(seed: int, index: int) -> int:
    """The seed of item ``index`` of a build seeded with ``seed`` (noise, crops, flips)."""
    return int(item_generator(seed, index).initial_seed())


def _shard_plan(root: Path, num_items: int, shard_size: int, part: tuple[int, int]) -> tuple[list[int], int, int]:
    """(pending shards of this part, items of this part, items of this part already done): only this part's shards
    are looked at (``range(i, shards, n)``), never a list of every shard of the dataset."""
    index_of_part, parts = part
    mine = range(index_of_part, check_shard_total(num_items, shard_size), parts)
    pending = _pending_shards(root, num_items, shard_size, mine)

    def count(k: int) -> int:
        return min(shard_size, num_items - k * shard_size)

    total = sum(count(k) for k in mine)
    return pending, total, total - sum(count(k) for k in pending)


def _pending_shards(root: Path, num_items: int, shard_size: int, indices: range) -> list[int]:
    done = set(completed_shards(root))
    pending = []
    for index in indices:
        count = min(shard_size, num_items - index * shard_size)
        if index in done and shard_count(root / shard_name(index)) == count:
            continue  # a short last shard from a smaller earlier build is rebuilt with the new count
        pending.append(index)
    return pending


def _progress(total: int, initial: int, desc: str, enabled: bool | None):
    from flowlift.console import progress_bar

    return progress_bar(total=total, initial=initial, desc=desc, unit="item", enabled=enabled)


# ----------------------------------------------------------------------------------------------
# Teachers


class TransformerTeacher:
    """A bare FLUX.2 transformer as teacher: Euler steps of its velocity on the shifted schedule.

    ``noise`` (B, 32, H, W, normalized) is integrated with ``x <- x + (sigma' - sigma) * v`` over
    :func:`flowlift.flux2.schedule.flux2_sigmas` (diffusers' empirical ``mu``), the velocity being the
    transformer behind :class:`flowlift.flux2.denoiser.Flux2Denoiser` (the same token layout, ids and sigma
    timestep as the refine pipelines) with fixed prompt embeddings ``prompt_embeds`` (L, D). ``guidance`` is the
    embedded guidance of guidance-distilled (dev) transformers (None: the denoiser's default);
    Klein transformers take none.
    """

    def __init__(
        self,
        transformer: torch.nn.Module,
        prompt_embeds: torch.Tensor,
        *,
        num_steps: int = 4,
        guidance: float | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if prompt_embeds.ndim == 3:
            prompt_embeds = prompt_embeds[0]
        if prompt_embeds.ndim != 2:
            raise FlowliftError(f"prompt embeddings must be (L, D), got shape {tuple(prompt_embeds.shape)}")
        if next(transformer.parameters()).dtype != dtype:
            transformer = transformer.to(dtype=dtype)
        self.transformer = transformer.to(device=device).eval()
        self.prompt_embeds = prompt_embeds.to(device=device, dtype=dtype)
        self.num_steps = num_steps
        self.guidance = guidance
        self.device = torch.device(device)
        self.dtype = dtype

    @torch.no_grad()
    def __call__(self, noise: torch.Tensor) -> torch.Tensor:
        from flowlift.flux2.denoiser import Flux2Denoiser
        from flowlift.flux2.sampling import denoise
        from flowlift.flux2.schedule import flux2_sigmas

        _, _, height, width = noise.shape
        velocity = Flux2Denoiser(self.transformer, self.prompt_embeds.unsqueeze(0), guidance=self.guidance)
        # diffusers' mu, as the pipeline teacher's: the two teachers give the same targets
        sigmas = flux2_sigmas(self.num_steps, image_seq_len(height, width), mu="empirical")
        return denoise(velocity, noise.to(self.device, torch.float32), sigmas)


class PipelineTeacher:
    """A FLUX.2 diffusers pipeline (``Flux2Pipeline`` / ``Flux2KleinPipeline``) as teacher.

    The pipeline gets the patchified noise as ``latents`` and returns raw latents
    (``output_type="latent"``), which are normalized with the pipeline VAE's BatchNorm statistics.
    Item ``i`` of a batch uses ``prompts[i % len(prompts)]`` offset by the batch's first item index.
    """

    def __init__(
        self,
        pipeline: Any,
        prompts: Sequence[str],
        *,
        num_steps: int = 4,
        guidance_scale: float | None = None,
    ) -> None:
        if not prompts:
            raise FlowliftError("a pipeline teacher needs at least one prompt")
        self.pipeline = pipeline
        self.prompts = list(prompts)
        self.num_steps = num_steps
        self.guidance_scale = guidance_scale
        self.next_item = 0

    @torch.no_grad()
    def __call__(self, noise: torch.Tensor) -> torch.Tensor:
        batch, _, height, width = noise.shape
        prompts = [self.prompts[(self.next_item + i) % len(self.prompts)] for i in range(batch)]
        self.next_item += batch
        pipe = self.pipeline
        kwargs: dict[str, Any] = {}
        if self.guidance_scale is not None:
            kwargs["guidance_scale"] = self.guidance_scale
        raw = pipe(
            prompt=prompts,
            height=height * VAE_SCALE_FACTOR,
            width=width * VAE_SCALE_FACTOR,
            num_inference_steps=self.num_steps,
            latents=patchify(noise).to(pipe.device, pipe.transformer.dtype),
            output_type="latent",
            return_dict=False,
            **kwargs,
        )[0]
        bn = pipe.vae.bn
        std = torch.sqrt(bn.running_var + pipe.vae.config.batch_norm_eps)
        return normalize(raw.float(), bn.running_mean.float(), std.float())


# ----------------------------------------------------------------------------------------------
# Builders


@dataclass(frozen=True)
class ShardWriting:
    """How a dataset's shards are written, whichever kind: ``shard_size`` items per shard, ``storage_dtype`` of the
    latents on disk, the ``device`` the VAE and teacher run on, ``progress`` bars, and ``part = (i, n)``: only
    shards ``k % n == i`` (n processes or machines on one folder). Every field is checked when it is made
    (:func:`~flowlift.training.builder_checks.check_writing`); ``device`` is kept resolved, ``part`` as a tuple."""

    shard_size: int = 256
    storage_dtype: Any = torch.float16
    device: Any = "cpu"
    progress: bool | None = True  # flowlift.console.progress_bar's enabled
    part: tuple[int, int] = (0, 1)

    def __post_init__(self) -> None:
        checked = check_writing(self.shard_size, self.storage_dtype, self.device, self.progress, self.part)
        for name, value in zip(("shard_size", "device", "part"), checked, strict=True):
            object.__setattr__(self, name, value)


def _writing(writing: ShardWriting | None) -> tuple:
    """``writing``'s fields (:class:`ShardWriting`'s defaults when None; anything else is one line)."""
    chosen = check_kind("writing", writing, ShardWriting, "a ShardWriting", optional=True) or ShardWriting()
    return chosen.shard_size, chosen.storage_dtype, chosen.device, chosen.progress, chosen.part


def _manifest(
    kind: str,
    latent_size: tuple[int, int],
    num_items: int,
    has_noise: bool,
    degradation: Degradation,
    seed: int,
    shard_size: int,
    storage_dtype: Any,
    source: dict[str, Any],
) -> dict[str, Any]:
    """A dataset folder's manifest (``dataset.json``): its items' target latents (32, H, W) at ``latent_size``, their
    conditions at ``1 / degradation.factor`` of it, how they are stored and where they come from."""
    height, width = latent_size
    factor = degradation.factor
    return {
        "kind": kind,
        "target_shape": [LATENT_CHANNELS, height, width],
        "cond_shape": [LATENT_CHANNELS, height // factor, width // factor],
        "shard_size": shard_size,
        "num_items": num_items,
        "has_noise": has_noise,
        "degradation": degradation.to_dict(),
        "seed": seed,
        "storage_dtype": str(storage_dtype).removeprefix("torch."),
        "source": source,
    }


def build_distill_dataset(
    root: str | os.PathLike,
    teacher: Teacher,
    vae: LatentCodec,
    *,
    num_items: int,
    latent_size: tuple[int, int],
    seed: int = 0,
    batch_size: int = 4,
    degradation: Degradation | None = None,
    source: dict[str, Any] | None = None,
    writing: ShardWriting | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Build (or resume) a distillation dataset of ``num_items`` items at ``latent_size`` (target).

    Item ``i``: ``noise = seeded_noise((32, H, W), item_seed(seed, i))``, ``target = teacher(noise)``,
    ``cond = encode(degrade(decode(target)))``. ``source`` describes the teacher in the manifest (a dict of JSON
    values; None: the teacher's type name). Every argument is checked before anything is written
    (:mod:`flowlift.training.builder_checks`): a wrong one is one line naming it.
    ``part = (i, n)`` builds only shards ``k % n == i`` (run n processes/machines on one folder).
    ``writing`` (:class:`ShardWriting`: shard size, storage dtype, device, progress, part); ``overwrite`` lets
    files at its names that flowlift did not write be replaced. Returns the manifest.
    """
    from flowlift.flux2.latents import seeded_noise

    shard_size, storage_dtype, device, progress, part = _writing(writing)
    root, seed, batch_size, degradation = check_build(root, vae, seed, batch_size, degradation, overwrite)
    check_callable("teacher", teacher, optional=False)
    num_items = check_positive("num_items", num_items, integer=True)
    check_shard_total(num_items, shard_size)  # before the manifest: its shard names cannot number more
    height, width = latent_size = check_latent_size(latent_size, degradation.factor)
    source = {"teacher": type(teacher).__name__} if source is None else check_source(source)
    manifest = _manifest("distill", latent_size, num_items, True, degradation, seed, shard_size, storage_dtype, source)
    prepare_dataset_dir(root, manifest, overwrite)
    pending, part_items, done_items = _shard_plan(root, num_items, shard_size, part)
    with _progress(part_items, done_items, "distill", progress) as bar:
        for shard in pending:
            first = shard * shard_size
            count = min(shard_size, num_items - first)
            noises, targets, conds, items = [], [], [], []
            for start in range(first, first + count, batch_size):
                indices = list(range(start, min(start + batch_size, first + count)))
                if hasattr(teacher, "next_item"):
                    teacher.next_item = indices[0]
                noise = torch.stack(
                    [seeded_noise((LATENT_CHANNELS, height, width), item_seed(seed, i)) for i in indices]
                )
                target = teacher(noise.to(device)).float()
                if target.shape != noise.shape:
                    raise FlowliftError(
                        f"teacher returned a latent of shape {tuple(target.shape)} for noise {tuple(noise.shape)}"
                    )
                generators = [item_generator(seed + 1, i) for i in indices]  # item i's noise: (seed, i) alone
                cond = conditioning_latents(vae, target, degradation, generators).float()
                noises.append(noise.cpu())
                targets.append(target.cpu())
                conds.append(cond.cpu())
                prompts = getattr(teacher, "prompts", None)
                for i in indices:
                    record: dict[str, Any] = {"index": i, "seed": item_seed(seed, i)}
                    if prompts:
                        record["prompt"] = prompts[i % len(prompts)]
                    items.append(record)
                bar.update(len(indices))
            tensors = {"target": torch.cat(targets), "cond": torch.cat(conds), "noise": torch.cat(noises)}
            write_shard(root, shard, first, tensors, items, storage_dtype)
    return manifest


def _image_sizes(paths: Sequence[Path]) -> list[tuple[int, int]]:
    """(height, width) per image, EXIF-oriented, from the headers (bombs and unreadable files: one line)."""
    from flowlift.files.images import image_size

    return [image_size(path)[::-1] for path in paths]


def plan_image_crops(
    paths: Sequence[Path], crop: int, crops_per_image: int, seed: int, flip: bool = True
) -> tuple[list[dict[str, Any]], list[str]]:
    """The items of an images dataset: for image ``j`` and crop ``c`` (item ``j*crops_per_image + c``),
    a uniformly random ``crop x crop`` window and, if ``flip``, a fair-coin horizontal flip, drawn
    from ``item_seed(seed, item)``. Images smaller than the crop are skipped (returned second)."""
    items: list[dict[str, Any]] = []
    skipped: list[str] = []
    usable = []
    for path, (height, width) in zip(paths, _image_sizes(paths), strict=True):
        if min(height, width) < crop:
            skipped.append(str(path))
        else:
            usable.append((path, height, width))
    for path, height, width in usable:
        for _ in range(crops_per_image):
            index = len(items)
            generator = item_generator(seed, index)
            top = int(torch.randint(0, height - crop + 1, (), generator=generator))
            left = int(torch.randint(0, width - crop + 1, (), generator=generator))
            flipped = bool(torch.rand((), generator=generator) < 0.5) if flip else False
            items.append({"index": index, "source": str(path), "top": top, "left": left, "flip": flipped})
    return items, skipped


def plan_images_dataset(
    image_paths: Any, crop: int, crops_per_image: int, seed: int, flip: bool, vae_name: Any, warn: bool = True
) -> tuple[list[Path], list[dict[str, Any]], list[str]]:
    """The photos, items and skipped photos of an images dataset (:func:`plan_image_crops`), from the images' headers
    alone, so that a refusal comes before a model loads: no photo, an unreadable one, none as large as ``crop``.
    Each photo smaller than the crop is a warning naming it (``warn`` False: only when none is left)."""
    paths = check_image_paths(image_paths, vae_name)
    items, skipped = plan_image_crops(paths, crop, crops_per_image, seed, flip)
    for name in skipped if warn or not items else ():  # one line per image (the CLI shows each as a warning line)
        warnings.warn(f"{name}: smaller than the {crop}x{crop} crop, skipped", UserWarning, stacklevel=3)
    if not items:
        raise FlowliftError(
            f"no image is at least {crop}x{crop} px, the {FIELD_MARK} {crop} crop ({len(skipped)} skipped); lower "
            f"{FIELD_MARK} or add larger images",
            field=("crop", "crop"),
        )
    return paths, items, skipped


def build_images_dataset(
    root: str | os.PathLike,
    image_paths: Sequence[str | os.PathLike],
    vae: LatentCodec,
    *,
    crop: int = 512,
    crops_per_image: int = 4,
    seed: int = 0,
    batch_size: int = 8,
    flip: bool = True,
    degradation: Degradation | None = None,
    vae_name: str = "",
    writing: ShardWriting | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Build (or resume) an images dataset: ``target = encode(crop)``, ``cond = encode(degrade(decode(target)))``.

    ``crop`` (pixels) must be a multiple of 32 (the target latent side a multiple of 4; for another degradation
    factor, :func:`~flowlift.training.builder_checks.latent_align`), at most 16384.
    ``part = (i, n)`` builds only shards ``k % n == i``; ``writing`` and ``overwrite`` as
    :func:`build_distill_dataset` takes them. Returns the manifest.
    """
    from flowlift.files.images import load_image, to_tensor
    from flowlift.models.weights import finite_result

    shard_size, storage_dtype, device, progress, part = _writing(writing)
    root, seed, batch_size, degradation = check_build(root, vae, seed, batch_size, degradation, overwrite)
    crop, crops_per_image, flip = check_photo_crops(crop, crops_per_image, flip, factor=degradation.factor)
    paths, items, skipped = plan_images_dataset(image_paths, crop, crops_per_image, seed, flip, vae_name)
    side = crop // VAE_SCALE_FACTOR
    source = {
        "images": [str(p) for p in paths],
        "crop": crop,
        "crops_per_image": crops_per_image,
        "flip": flip,
        "vae": vae_name,
        "skipped": skipped,
    }
    manifest = _manifest(
        "images", (side, side), len(items), False, degradation, seed, shard_size, storage_dtype, source
    )
    prepare_dataset_dir(root, manifest, overwrite)
    pending, part_items, done_items = _shard_plan(root, len(items), shard_size, part)
    cache: dict[str, torch.Tensor] = {}
    with _progress(part_items, done_items, "images", progress) as bar:
        for shard in pending:
            first = shard * shard_size
            shard_items = items[first : first + shard_size]
            targets, conds = [], []
            for start in range(0, len(shard_items), batch_size):
                chunk = shard_items[start : start + batch_size]
                crops = []
                for item in chunk:
                    if item["source"] not in cache:
                        cache.clear()  # items are grouped by image: keep one decoded image
                        cache[item["source"]] = to_tensor(load_image(item["source"])[0])[0]
                    image = cache[item["source"]]
                    window = image[:, item["top"] : item["top"] + crop, item["left"] : item["left"] + crop]
                    crops.append(window.flip(-1) if item["flip"] else window)
                pixels = torch.stack(crops).to(device)
                # named by its shard before the degradation decodes it (the VAE refuses NaN latents in one line)
                with torch.no_grad():
                    target = finite_result(f"{shard_name(shard)}: the VAE's encode", vae.encode, pixels).float()
                generators = [item_generator(seed + 1, item["index"]) for item in chunk]  # (seed, i) alone
                cond = conditioning_latents(vae, target, degradation, generators).float()
                targets.append(target.cpu())
                conds.append(cond.cpu())
                bar.update(len(chunk))
            tensors = {"target": torch.cat(targets), "cond": torch.cat(conds)}
            write_shard(root, shard, first, tensors, shard_items, storage_dtype)
    return manifest
