"""Detail and posterization of FLUX.2 img2img at low to full strength: clipped vs respaced windows.

The founding document's measurement (``shared/seeds/000_*``), for any model: one base image (a txt2img
generation, or ``--image``) is re-run through img2img at strengths 0.2 / 0.3 / 0.5 / 0.75 / 1.0 under
``--schedule clipped`` (diffusers' img2img: only the full schedule's points below the strength) and
``respaced`` (flowlift's default: ``--steps`` steps in the window, evenly spaced before the shift). Per
run it prints the model steps, the last sigma before 0 (where the final Euler step jumps from), the HF
energy (variance of the luma Laplacian over the frame, :func:`flowlift.measure.metrics.hf_energy`) and
the distinct 8-bit grey levels and their sigma in a smooth patch (:func:`flowlift.measure.metrics.grey_levels`;
by default the smoothest quarter-by-quarter block of the base image). The base image is the reference row.

    # real weights (the figures that mean something; a GPU is advised)
    PYTHONPATH=src python benchmarks/bench_refine_windows.py --model black-forest-labs/FLUX.2-klein-4B \\
        --prompt-embeds prompt.safetensors --steps 4 --seed 424242 --width 1024 --height 1024
    # the tiny random model of tests/tiny_flux2.py: only the columns and the step counts mean anything
    PYTHONPATH=src python benchmarks/bench_refine_windows.py --tiny --steps 4
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

STRENGTHS = (0.2, 0.3, 0.5, 0.75, 1.0)
SCHEDULES = ("clipped", "respaced")


def smoothest_box(luma: np.ndarray, fraction: float = 0.25) -> tuple[int, int, int, int]:
    """``(x, y, w, h)`` of the ``fraction``-sized block (of each side) whose Laplacian variance is the lowest,
    searched on a grid of half-block strides: the image's "sky"."""
    from flowlift.measure.metrics import laplacian

    lap = laplacian(luma)
    height, width = luma.shape
    bw, bh = max(4, int(width * fraction)), max(4, int(height * fraction))
    candidates = [
        (float(lap[y : y + bh, x : x + bw].var()), (x, y, bw, bh))
        for y in range(0, height - bh + 1, max(1, bh // 2))
        for x in range(0, width - bw + 1, max(1, bw // 2))
    ]
    return min(candidates)[1]


def parse_box(text: str) -> tuple[int, int, int, int]:
    try:
        x, y, w, h = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--patch takes X,Y,W,H in pixels, got {text!r}") from None
    if w < 1 or h < 1 or x < 0 or y < 0:
        raise argparse.ArgumentTypeError(f"--patch needs x, y >= 0 and w, h >= 1, got {text!r}")
    return x, y, w, h


def build_refiner(args: argparse.Namespace):
    """(refiner, conditioning): real weights through ``load_refiner``, or the tests' tiny random model."""
    from flowlift.devices import resolve_device_dtype
    from flowlift.refine.refiner import Flux2Refiner

    device, dtype = resolve_device_dtype(args.device, args.dtype)
    if args.tiny:
        sys.path.insert(0, str(ROOT / "tests"))
        from flowlift.models.vae_loading import load_vae
        from tiny_flux2 import prompt_embeds, tiny_transformer, tiny_vae

        vae = load_vae(tiny_vae(), device=device, dtype=torch.float32)
        refiner = Flux2Refiner(tiny_transformer(), vae, device=device, dtype=dtype, model_name="tiny random FLUX.2")
        return refiner, {"prompt_embeds": prompt_embeds()}
    from flowlift.refine.loading import load_refiner
    from flowlift.refine.prompts import load_prompt_embeds

    embeds = negative = None
    if args.prompt_embeds:
        embeds, negative = load_prompt_embeds(args.prompt_embeds)
    refiner = load_refiner(args.model, vae=args.vae, device=device, dtype=dtype, text_encoder=embeds is None)
    conditioning = {"prompt": None if embeds is not None else args.prompt, "prompt_embeds": embeds}
    conditioning.update(negative_prompt_embeds=negative, cfg_scale=args.cfg_scale, guidance=args.guidance)
    return refiner, conditioning


def measure(image: torch.Tensor, box: tuple[int, int, int, int]) -> tuple[float, int, float]:
    """HF energy of the frame, grey levels and their sigma in ``box``, on the 8-bit image."""
    from flowlift.files.images import tensor_to_uint8
    from flowlift.measure.metrics import grey_levels, hf_energy

    u8 = tensor_to_uint8(image)[0]
    levels, sigma = grey_levels(u8, box)
    return hf_energy(u8), levels, sigma


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="FLUX.2 weights, as flowlift img2img --model")
    source.add_argument("--tiny", action="store_true", help="the tests' tiny random FLUX.2 (no weights)")
    parser.add_argument("--vae", help="VAE spec (default: the model's own)")
    parser.add_argument("--prompt", default="a photograph", help="prompt (needs flowlift[text])")
    parser.add_argument("--prompt-embeds", help="precomputed embeddings (.safetensors with 'prompt_embeds')")
    parser.add_argument("--cfg-scale", type=float, default=1.0)
    parser.add_argument("--guidance", type=float, help="dev's embedded guidance")
    parser.add_argument("--image", help="base image (default: a txt2img generation at --width x --height)")
    parser.add_argument("--width", type=int, help="txt2img base width (default 1024; --tiny 128)")
    parser.add_argument("--height", type=int, help="txt2img base height (default 1024; --tiny 128)")
    parser.add_argument("--steps", type=int, default=4, help="steps of the schedule (default 4: distilled Klein)")
    parser.add_argument("--seed", type=int, default=424242)
    parser.add_argument("--sampler", choices=("euler", "heun"), default="euler")
    parser.add_argument("--mu", default="2.02", help="2.02 (default), empirical, or a number")
    parser.add_argument("--strength-map", choices=("linear", "canvas"), default="linear")
    parser.add_argument("--strengths", type=float, nargs="+", default=list(STRENGTHS))
    parser.add_argument("--patch", type=parse_box, help="X,Y,W,H of the smooth patch (default: the smoothest block)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, help="also write every image here as PNG")
    args = parser.parse_args(argv)
    mu = args.mu if args.mu == "empirical" else float(args.mu)
    width = args.width or (128 if args.tiny else 1024)
    height = args.height or (128 if args.tiny else 1024)

    from flowlift.files.images import load_image, tensor_to_pil, to_tensor

    refiner, conditioning = build_refiner(args)
    from flowlift.refine.settings import SamplingSettings

    sampling = SamplingSettings(steps=args.steps, seed=args.seed, sampler=args.sampler, mu=mu)
    common = dict(sampling=sampling, **conditioning)
    if args.image:
        base = to_tensor(load_image(args.image)[0])
        base_name = Path(args.image).name
    else:
        base = refiner.txt2img(height=height, width=width, **common).images.cpu()
        base_name = f"txt2img {width}x{height}"
    from flowlift.measure.metrics import luma

    box = args.patch or smoothest_box(luma(tensor_to_pil(base[0])))
    given = argv if argv is not None else sys.argv[1:]
    print(f"command: PYTHONPATH=src python benchmarks/bench_refine_windows.py {shlex.join(given)}")
    print(
        f"model: {refiner.model_name or args.model}; steps {args.steps}, seed {args.seed}, mu {args.mu}, sampler "
        f"{args.sampler}, strength map {args.strength_map}; patch x,y,w,h = {','.join(map(str, box))}"
    )
    print()
    print("| run | schedule | model steps | last sigma before 0 | HF energy | patch grey levels | patch sigma |")
    print("|---|---|---|---|---|---|---|")
    energy, levels, sigma = measure(base[0], box)
    print(f"| {base_name} (reference) | | | | {energy:.1f} | {levels} | {sigma:.2f} |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        tensor_to_pil(base[0]).save(args.out / "base.png")
    for strength in args.strengths:
        for schedule in SCHEDULES:
            windowed = dict(common, sampling=replace(sampling, schedule=schedule))
            result = refiner.img2img(base, strength=strength, strength_map=args.strength_map, **windowed)
            sigmas = result.parameters.get("sigmas", [])
            last = f"{sigmas[-2]:.3f}" if len(sigmas) >= 2 else "-"
            energy, levels, sigma = measure(result.images[0].cpu(), box)
            print(
                f"| strength {strength:g} | {schedule} | {max(len(sigmas) - 1, 0)} | {last} | {energy:.1f} | "
                f"{levels} | {sigma:.2f} |"
            )
            if args.out:
                tensor_to_pil(result.images[0].cpu()).save(args.out / f"s{strength:g}_{schedule}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
