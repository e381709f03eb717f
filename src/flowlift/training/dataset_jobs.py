"""``flowlift dataset``'s jobs: sharded training data for the Flow Upscaler.

The command line turns its options into one :class:`DatasetRequest` and calls :func:`run_dataset`: with a
:class:`TeacherSource`, a FLUX.2 teacher turns stored noise into target latents (flow distillation pairs:
noise, target, conditioning; :func:`flowlift.training.datasets.build_distill_dataset`); with
:class:`PhotoCrops`, the targets are VAE encodings of random crops of real photos
(:func:`~flowlift.training.datasets.build_images_dataset`). Both resume an existing folder.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flowlift.errors import FIELD_MARK, FlowliftError
from flowlift.limits import MAX_OUTPUT_SIDE
from flowlift.training.builder_checks import check_photo_crops
from flowlift.training.dataset_settings import STORAGE_DTYPE, TEACHER_DTYPE
from flowlift.training.datasets import (
    PipelineTeacher,
    ShardWriting,
    Teacher,
    TransformerTeacher,
    build_distill_dataset,
    build_images_dataset,
    plan_images_dataset,
)
from flowlift.training.degrade import Degradation
from flowlift.training.shards import STORAGE_DTYPES

__all__ = ["STORAGE_DTYPES", "DatasetRequest", "PhotoCrops", "TeacherSource", "load_teacher", "run_dataset"]

#: A teacher's weights' dtypes, by name (None: bfloat16 on CUDA, float32 on the CPU).
TEACHER_DTYPES = STORAGE_DTYPES


@dataclass(frozen=True)
class TeacherSource:
    """A distillation dataset's teacher: ``teacher`` a diffusers FLUX.2 pipeline (folder or hub id, with
    ``prompts``: a text file, one prompt per line) or a ``Flux2Transformer2DModel`` folder (with
    ``prompt_embeds``: a safetensors file holding ``prompt_embeds`` (L, D)); ``num`` items at ``width`` x
    ``height`` pixels (multiples of 32), ``steps`` sampling steps, ``guidance``, the weights' ``dtype`` by
    name (None: bfloat16 on CUDA, float32 on the CPU)."""

    teacher: str
    num: int
    prompts: str | None = None
    prompt_embeds: str | None = None
    width: int = 1024
    height: int = 1024
    steps: int = 4
    guidance: float | None = None
    teacher_dtype: str | None = None

    def __post_init__(self) -> None:
        """Every field checked when the source is made, one line naming it (before any teacher loads)."""
        from flowlift.knobs import check_path, check_positive

        check_path("teacher", self.teacher)
        for name in ("prompts", "prompt_embeds"):
            check_path(name, getattr(self, name), optional=True)
        for name in ("num", "steps", "width", "height"):
            check_positive(name, getattr(self, name), integer=True)
        if self.width % 32 or self.height % 32 or max(self.width, self.height) > MAX_OUTPUT_SIDE:
            raise FlowliftError(
                f"{FIELD_MARK}/{FIELD_MARK} must be positive multiples of 32 up to {MAX_OUTPUT_SIDE}, "
                f"got {self.width}x{self.height}",
                field=("width", "height"),
            )
        # the teacher's guidance scale, the same quantity as a refine's (PromptRequest.guidance): above 0
        object.__setattr__(self, "guidance", check_positive("guidance", self.guidance, optional=True))
        TEACHER_DTYPE.check(self.teacher_dtype)


@dataclass(frozen=True)
class PhotoCrops:
    """An images dataset's source: ``crops_per_image`` random crops of ``crop_px`` pixels (a multiple of 32)
    from each of ``inputs`` (files, folders, glob patterns), each flipped at random when ``flip``."""

    inputs: Sequence[str]
    crop_px: int = 512
    crops_per_image: int = 4
    flip: bool = True

    def __post_init__(self) -> None:
        """Every field checked when the source is made (one string of ``inputs`` is one input, not its characters)."""
        from flowlift.knobs import check_paths

        object.__setattr__(self, "inputs", tuple(map(str, check_paths("inputs", self.inputs))))
        # the builder's rules for the same quantities, when the request is made (before any VAE loads)
        check_photo_crops(self.crop_px, self.crops_per_image, self.flip, crop_field="crop_px")


@dataclass(frozen=True)
class DatasetRequest:
    """Everything one ``flowlift dataset`` run asks for: the folder (``output``), the VAE, exactly one of
    ``teacher`` and ``crops``, the conditioning's degradation (``filter``, ``jpeg_quality``, ``noise_std``:
    :class:`~flowlift.training.degrade.Degradation`) and how the shards are written (``part = (i, n)``: only
    shards ``k % n == i``; ``device`` already resolved)."""

    output: str | os.PathLike
    vae: str
    teacher: TeacherSource | None = None
    crops: PhotoCrops | None = None
    overwrite: bool = False
    seed: int = 0
    shard_size: int = 256
    batch_size: int = 4
    storage_dtype: str = "float16"
    device: Any = "cpu"
    filter: str = "area"
    jpeg_quality: int | None = None
    noise_std: float = 0.0
    part: tuple[int, int] = (0, 1)
    progress: bool | None = False  # flowlift.console.progress_bar's enabled
    #: the conditioning's degradation, made (and so checked) once from ``filter``, ``jpeg_quality``, ``noise_std``
    degradation: Degradation = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Every field checked when the request is made, one line naming it as Python spells it (the command line
        says its option): before any folder is touched or any model loads."""
        from flowlift.knobs import OVERWRITE, SEED, check_kind, check_path, check_positive

        if (self.teacher is None) == (self.crops is None):
            raise FlowliftError("a dataset request takes exactly one of teacher= and crops=")
        check_kind("teacher", self.teacher, TeacherSource, "a TeacherSource", optional=True)
        check_kind("crops", self.crops, PhotoCrops, "a PhotoCrops", optional=True)
        check_path("output", self.output)
        check_path("vae", self.vae)
        OVERWRITE.check(self.overwrite)
        SEED.check(self.seed)
        check_positive("batch_size", self.batch_size, integer=True)
        STORAGE_DTYPE.check(self.storage_dtype)
        degradation = Degradation(filter=self.filter, jpeg_quality=self.jpeg_quality, noise_std=self.noise_std)
        object.__setattr__(self, "degradation", degradation)
        writing = self.writing  # ShardWriting's rules: shard_size, device (resolved), progress, part
        if self.teacher is not None:  # more shards than their names can number: before any folder or model
            from flowlift.training.dataset_files import check_shard_total

            check_shard_total(self.teacher.num, writing.shard_size, "num")
        object.__setattr__(self, "device", writing.device)
        object.__setattr__(self, "part", writing.part)

    @property
    def writing(self) -> ShardWriting:
        """How the shards are written: :class:`~flowlift.training.datasets.ShardWriting` of the request's fields."""
        storage = STORAGE_DTYPES[self.storage_dtype]
        return ShardWriting(self.shard_size, storage, self.device, self.progress, self.part)


def run_dataset(request: DatasetRequest) -> dict[str, Any]:
    """Check the request and every name the dataset writes (the replace rule, before the teacher or the VAE
    loads), then build (or resume) it: :func:`~flowlift.training.datasets.build_distill_dataset` with
    ``request.teacher``, else :func:`~flowlift.training.datasets.build_images_dataset` with ``request.crops``.
    Returns the manifest."""
    from flowlift.models.vae_loading import ENCODE_DECODE, load_vae

    device = request.device
    degradation = request.degradation
    out = Path(request.output)
    if out.exists() and not out.is_dir():
        raise FlowliftError(f"{FIELD_MARK} {out} exists and is not a folder", field="output")
    from flowlift.files.output_paths import folder_problem

    if problem := folder_problem(out):  # before the teacher or the VAE loads
        raise FlowliftError(problem)
    from flowlift.files.atomic import remove_stale_temporaries
    from flowlift.training.shards import check_dataset_folder

    remove_stale_temporaries(out)  # a killed run's shard or manifest temporaries (a resume skips finished shards)

    if request.teacher is not None:
        source = request.teacher
        check_dataset_folder(out, request.overwrite)  # the replace rule at every name, before any model loads
        from flowlift.training.distill_checks import check_distill_inputs

        check_distill_inputs(source.teacher, source.prompts, source.prompt_embeds, request.vae)  # all missing at once
        teacher, described = load_teacher(source, device)
        vae = load_vae(request.vae, device=device, dtype=torch.float32, needs=ENCODE_DECODE)
        described["vae"] = request.vae
        manifest = build_distill_dataset(
            out,
            teacher,
            vae,
            num_items=source.num,
            latent_size=(source.height // 8, source.width // 8),
            seed=request.seed,
            batch_size=request.batch_size,
            degradation=degradation,
            source=described,
            writing=request.writing,
            overwrite=request.overwrite,
        )
    else:
        from flowlift.files.images import list_images

        crops = request.crops
        paths = list_images(crops.inputs)
        if not paths:  # named as the command takes them, before the VAE loads
            from flowlift.jobs.batch import no_images_in

            raise no_images_in(crops.inputs)
        _check_outputs_are_no_input(out, paths)  # first: an input is refused, --overwrite or not
        check_dataset_folder(out, request.overwrite)
        # the images' headers before the VAE loads: an unreadable one, none as large as the crop (one line)
        plan_images_dataset(paths, crops.crop_px, crops.crops_per_image, request.seed, crops.flip, request.vae, False)
        vae = load_vae(request.vae, device=device, dtype=torch.float32, needs=ENCODE_DECODE)
        manifest = build_images_dataset(
            out,
            paths,
            vae,
            crop=crops.crop_px,
            crops_per_image=crops.crops_per_image,
            seed=request.seed,
            batch_size=request.batch_size,
            flip=crops.flip,
            degradation=degradation,
            vae_name=request.vae,
            writing=request.writing,
            overwrite=request.overwrite,
        )
    return manifest


def load_teacher(source: TeacherSource, device: torch.device) -> tuple[Teacher, dict[str, Any]]:
    """A teacher callable from ``source.teacher``: a diffusers pipeline or a bare FLUX.2 transformer; with what
    describes it in the manifest."""
    from flowlift.models.weights import looks_like_repo_id

    dtype = _dtype(source.teacher_dtype, device)
    path = Path(source.teacher)
    is_pipeline = (path.is_dir() and (path / "model_index.json").is_file()) or looks_like_repo_id(source.teacher)
    is_transformer = path.is_dir() and (path / "config.json").is_file() and not is_pipeline
    if is_transformer:
        if not source.prompt_embeds:
            raise FlowliftError(
                f"a transformer teacher needs {FIELD_MARK} (a safetensors file with 'prompt_embeds')",
                field="prompt_embeds",
            )
        from diffusers import Flux2Transformer2DModel

        from flowlift.models.weights import read_state_dict

        embeds = read_state_dict(source.prompt_embeds, what="prompt embeddings")
        if "prompt_embeds" not in embeds:
            raise FlowliftError(f"{source.prompt_embeds} has no tensor named 'prompt_embeds'")
        from flowlift.models.prompt_embeds import check_prompt_embeds

        check_prompt_embeds(embeds, origin=str(source.prompt_embeds))
        from flowlift.models.flux2_transformer_folders import inspect_transformer_folder

        inspect_transformer_folder(path, option="--teacher")  # as strictly as refine's folders, before building
        try:
            transformer = Flux2Transformer2DModel.from_pretrained(str(path), torch_dtype=dtype)
        except Exception as error:  # noqa: BLE001 - diffusers raises many types for a bad folder
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise FlowliftError(f"cannot load the teacher transformer from {path}: {first}") from None
        return TransformerTeacher(
            transformer,
            embeds["prompt_embeds"],
            num_steps=source.steps,
            guidance=source.guidance,
            device=device,
            dtype=dtype,
        ), {"teacher": str(path), "type": "transformer", "steps": source.steps, "guidance": source.guidance}
    if is_pipeline:
        if not source.prompts:
            raise FlowliftError(
                f"a pipeline teacher needs {FIELD_MARK} (a text file, one prompt per line)", field="prompts"
            )
        prompts_path = Path(source.prompts)
        if not prompts_path.is_file():
            raise FlowliftError(f"prompts file not found: {prompts_path}")
        prompts = [line.strip() for line in prompts_path.read_text().splitlines() if line.strip()]
        from diffusers import DiffusionPipeline

        try:
            pipe = DiffusionPipeline.from_pretrained(source.teacher, torch_dtype=dtype).to(device)
        except Exception as error:  # noqa: BLE001
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise FlowliftError(f"cannot load the teacher pipeline {source.teacher}: {first}") from None
        pipe.set_progress_bar_config(disable=True)
        return PipelineTeacher(pipe, prompts, num_steps=source.steps, guidance_scale=source.guidance), {
            "teacher": source.teacher,
            "type": type(pipe).__name__,
            "steps": source.steps,
            "guidance": source.guidance,
            "prompts": str(prompts_path),
        }
    raise FlowliftError(
        f"--teacher {source.teacher}: not a diffusers pipeline (model_index.json), a transformer folder "
        "(config.json) or a hub repo id"
    )


def _dtype(name: str | None, device):

    if name is None:
        from flowlift.devices import auto_dtype

        return auto_dtype(device)
    return TEACHER_DTYPES[name]


def _check_outputs_are_no_input(out: Path, inputs: list[Path]) -> None:
    """No file the dataset writes (its manifest, its shards) is one of its input images (issue 36.2: by
    identity; only a hard link can make them one, as the names differ)."""
    from flowlift.files.output_paths import check_not_an_input

    if not out.is_dir():
        return
    for path in [out / "dataset.json", *sorted(out.glob("shard-*.safetensors"))]:
        check_not_an_input(path, {"crops.inputs": inputs})
