"""``flowlift dataset``: build sharded training data for the Flow Upscaler.

* ``flowlift dataset distill``: a FLUX.2 teacher turns stored noise into target latents (flow
  distillation pairs: noise, target, conditioning).
* ``flowlift dataset images``: targets are VAE encodings of random crops of real photos.

Both are resumable (run the same command again) and show progress bars.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from flowlift.commands._options import (
    HelpFormatter,
    add_deprecated_spelling,
    add_output_option,
    add_vae_option,
    examples,
    finite_float,
    positive_int,
    quality,
    resolve_device_dtype,
    seed_value,
)
from flowlift.console import add_console_options, show_progress

NAME = "dataset"
NESTED_COMMANDS = True
HELP = "build training shards: teacher distillation pairs or encoded photo crops"
EXAMPLES = examples(
    "flowlift dataset images photos/ --crop-px 512 --crops-per-image 8 --vae taef2 -o data/photos",
    "flowlift dataset distill --teacher black-forest-labs/FLUX.2-klein-4B --prompts prompts.txt --num 20000 "
    "--vae flux2 -o data/distill",
)

STORAGE = ("float16", "bfloat16", "float32")


def _common(parser: argparse.ArgumentParser) -> None:
    add_output_option(parser, "dataset folder (created; an existing one is resumed)", required=True, old="--out")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace files at the dataset's names (dataset.json, shard-*.safetensors) that "
                        "flowlift did not write (without it, only flowlift's own and empty files are replaced)")
    add_vae_option(parser, "decodes the targets and encodes the degraded conditions", required=True)
    parser.add_argument("--seed", type=seed_value, default=0, help="seed of crops, flips and stored noise")
    parser.add_argument("--shard-size", type=positive_int, default=256, help="items per shard file (default 256)")
    parser.add_argument("--batch-size", type=positive_int, default=4, help="items processed together (default 4)")
    parser.add_argument("--storage-dtype", choices=STORAGE, default="float16", help="tensor dtype in shards")
    parser.add_argument("--device", default="auto", help="auto (default: CUDA if available, else cpu), cpu, cuda, ...")
    parser.add_argument("--filter", default="area", choices=("area", "bicubic", "bilinear", "lanczos"),
                        help="antialiased 2x pixel-space downscale for the conditioning (default area)")
    parser.add_argument("--jpeg-quality", type=quality, help="also JPEG-compress the downscaled image (1-100)")
    parser.add_argument("--noise-std", type=finite_float, default=0.0,
                        help="also add Gaussian pixel noise (0..1 units)")
    parser.add_argument("--part", default="0/1", metavar="I/N",
                        help="build only shards k with k %% N == I (run N processes or machines on one --output)")
    add_console_options(parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="dataset_kind", metavar="KIND", required=True)
    distill = sub.add_parser("distill", help="teacher-generated distillation pairs",
                             description="generate target latents with a FLUX.2 teacher from stored noise",
                             formatter_class=HelpFormatter, epilog=examples(
                                 "flowlift dataset distill --teacher black-forest-labs/FLUX.2-klein-4B "
                                 "--prompts prompts.txt --num 20000 --vae flux2 -o data/distill"))
    _common(distill)
    distill.add_argument("--teacher", required=True,
                         help="a FLUX.2 diffusers pipeline (folder or hub id) or a Flux2Transformer2DModel folder")
    distill.add_argument("--prompts", help="text file, one prompt per line (pipeline teachers); item i uses line i")
    distill.add_argument("--prompt-embeds", help="safetensors file with 'prompt_embeds' (L, D) (transformer teachers)")
    distill.add_argument("--num", type=positive_int, required=True, help="number of items")
    distill.add_argument("--width", type=positive_int, default=1024,
                         help="target image width in pixels (multiple of 32)")  # fmt: skip
    distill.add_argument("--height", type=positive_int, default=1024,
                         help="target image height in pixels (multiple of 32)")  # fmt: skip
    distill.add_argument("--steps", type=positive_int, default=4, help="teacher sampling steps (default 4)")
    distill.add_argument("--guidance", type=finite_float, help="teacher guidance scale")
    distill.add_argument("--teacher-dtype", choices=STORAGE, default=None,
                         help="teacher weights dtype (default bfloat16 on CUDA, float32 on CPU)")
    images = sub.add_parser("images", help="encoded crops of real photos",
                            description="encode random crops (and flips) of photos; noise is drawn at train time",
                            formatter_class=HelpFormatter, epilog=examples(
                                "flowlift dataset images photos/ --crop-px 512 --crops-per-image 8 --vae taef2 "
                                "-o data/photos"))
    _common(images)
    images.add_argument("inputs", nargs="+", help="image files, folders or glob patterns")
    crop = images.add_argument("--crop-px", type=positive_int, default=512,
                               help="crop side in image pixels (multiple of 32; default 512)")  # fmt: skip
    add_deprecated_spelling(images, "--crop", crop)
    images.add_argument("--crops-per-image", type=positive_int, default=4, help="random crops taken from each photo")
    images.add_argument("--no-flip", action="store_true", help="no random horizontal flips")


def _device(setting: str):
    return resolve_device_dtype(setting, "auto")[0]


def _dtype(name: str | None, device):
    import torch

    if name is None:
        from flowlift.devices import auto_dtype

        return auto_dtype(device)
    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def load_teacher(args: argparse.Namespace, device):
    """A teacher callable from ``--teacher``: a diffusers pipeline or a bare FLUX.2 transformer."""
    from flowlift.errors import FlowliftError
    from flowlift.models.weights import looks_like_repo_id
    from flowlift.training.datasets import PipelineTeacher, TransformerTeacher

    dtype = _dtype(args.teacher_dtype, device)
    path = Path(args.teacher)
    is_pipeline = (path.is_dir() and (path / "model_index.json").is_file()) or looks_like_repo_id(args.teacher)
    is_transformer = path.is_dir() and (path / "config.json").is_file() and not is_pipeline
    if is_transformer:
        if not args.prompt_embeds:
            raise FlowliftError("a transformer teacher needs --prompt-embeds (a safetensors file with 'prompt_embeds')")
        from diffusers import Flux2Transformer2DModel

        from flowlift.models.weights import read_state_dict

        embeds = read_state_dict(args.prompt_embeds, what="prompt embeddings")
        if "prompt_embeds" not in embeds:
            raise FlowliftError(f"{args.prompt_embeds} has no tensor named 'prompt_embeds'")
        from flowlift.refine.prompts import check_prompt_embeds

        check_prompt_embeds(embeds, origin=str(args.prompt_embeds))
        from flowlift.models.flux2_transformer_folders import inspect_transformer_folder

        inspect_transformer_folder(path, option="--teacher")  # as strictly as refine's folders, before building
        try:
            transformer = Flux2Transformer2DModel.from_pretrained(str(path), torch_dtype=dtype)
        except Exception as error:  # noqa: BLE001 - diffusers raises many types for a bad folder
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise FlowliftError(f"cannot load the teacher transformer from {path}: {first}") from None
        return TransformerTeacher(transformer, embeds["prompt_embeds"], num_steps=args.steps,
                                  guidance=args.guidance, device=device, dtype=dtype), {
            "teacher": str(path), "type": "transformer", "steps": args.steps, "guidance": args.guidance}
    if is_pipeline:
        if not args.prompts:
            raise FlowliftError("a pipeline teacher needs --prompts (a text file, one prompt per line)")
        prompts_path = Path(args.prompts)
        if not prompts_path.is_file():
            raise FlowliftError(f"prompts file not found: {prompts_path}")
        prompts = [line.strip() for line in prompts_path.read_text().splitlines() if line.strip()]
        from diffusers import DiffusionPipeline

        try:
            pipe = DiffusionPipeline.from_pretrained(args.teacher, torch_dtype=dtype).to(device)
        except Exception as error:  # noqa: BLE001
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise FlowliftError(f"cannot load the teacher pipeline {args.teacher}: {first}") from None
        pipe.set_progress_bar_config(disable=True)
        return PipelineTeacher(pipe, prompts, num_steps=args.steps, guidance_scale=args.guidance), {
            "teacher": args.teacher, "type": type(pipe).__name__, "steps": args.steps, "guidance": args.guidance,
            "prompts": str(prompts_path)}
    raise FlowliftError(
        f"--teacher {args.teacher}: not a diffusers pipeline (model_index.json), a transformer folder "
        "(config.json) or a hub repo id"
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from flowlift.errors import FlowliftError
    from flowlift.models.vae_loading import load_vae
    from flowlift.training.degrade import Degradation

    device = _device(args.device)
    try:
        part = tuple(int(x) for x in args.part.split("/"))
    except ValueError:
        part = ()
    if len(part) != 2:
        raise FlowliftError(f"--part must look like I/N (e.g. 0/4), got {args.part!r}")
    from flowlift.training.datasets import check_part

    check_part(part)
    degradation = Degradation(filter=args.filter, jpeg_quality=args.jpeg_quality, noise_std=args.noise_std)
    storage = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[args.storage_dtype]
    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise FlowliftError(f"--output {out} exists and is not a folder")
    from flowlift.files.output_paths import folder_problem

    if problem := folder_problem(out):  # before the teacher or the VAE loads
        raise FlowliftError(problem)
    from flowlift.training.shards import check_dataset_folder
    if args.dataset_kind == "distill":
        if args.width % 32 or args.height % 32 or args.width <= 0 or args.height <= 0:
            raise FlowliftError(f"--width/--height must be positive multiples of 32, got {args.width}x{args.height}")
        check_dataset_folder(out, args.overwrite)  # the replace rule at every name, before any model loads
        from flowlift.training.distill_checks import check_distill_inputs

        check_distill_inputs(args.teacher, args.prompts, args.prompt_embeds, args.vae)  # all missing pieces at once
        teacher, source = load_teacher(args, device)
        vae = load_vae(args.vae, device=device, dtype=torch.float32)
        source["vae"] = args.vae
        from flowlift.training.datasets import ShardWriting, build_distill_dataset

        writing = ShardWriting(args.shard_size, storage, device, show_progress(args), part)
        manifest = build_distill_dataset(
            out, teacher, vae, num_items=args.num, latent_size=(args.height // 8, args.width // 8),
            seed=args.seed, batch_size=args.batch_size, degradation=degradation, source=source, writing=writing,
            overwrite=args.overwrite,
        )
    else:
        from flowlift.files.images import list_images
        from flowlift.training.datasets import ShardWriting, build_images_dataset

        paths = list_images(args.inputs)
        _check_outputs_are_no_input(out, paths)  # first: an input is refused, --overwrite or not
        check_dataset_folder(out, args.overwrite)
        vae = load_vae(args.vae, device=device, dtype=torch.float32)
        manifest = build_images_dataset(
            out, paths, vae, crop=args.crop_px, crops_per_image=args.crops_per_image, seed=args.seed,
            batch_size=args.batch_size, flip=not args.no_flip, degradation=degradation, vae_name=args.vae,
            writing=ShardWriting(args.shard_size, storage, device, show_progress(args), part),
            overwrite=args.overwrite,
        )
    print(f"{args.dataset_kind} dataset: {manifest['num_items']} items of {manifest['target_shape']} in "
          f"{os.fspath(out)}")
    return 0


def _check_outputs_are_no_input(out: Path, inputs: list[Path]) -> None:
    """No file the dataset writes (its manifest, its shards) is one of its input images (issue 36.2: by
    identity; only a hard link can make them one, as the names differ)."""
    from flowlift.files.output_paths import check_not_an_input

    if not out.is_dir():
        return
    for path in [out / "dataset.json", *sorted(out.glob("shard-*.safetensors"))]:
        check_not_an_input(path, {"INPUT": inputs})
