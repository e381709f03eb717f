"""Peak memory of a FLUX.2 refine in ComfyUI 0.33, untiled vs through Tiled FLUX.2 Refine, side by side.

    python benchmarks/bench_comfyui_tiled_refine.py            # 4096x4096 px (a 256x256 ComfyUI latent)
    python benchmarks/bench_comfyui_tiled_refine.py --size 2048 --steps 2

Each variant runs in its own fresh process of the ComfyUI test venv (tests/comfy_venv.py; ComfyUI imported from
``../shared/comfyui-0.33``, ``--cpu``): the tiny FLUX.2 of the tests (ComfyUI's own FLUX.2 classes at width 64,
tests/comfy_test_nodes) and ComfyUI's own sampler (``comfy.sample.sample``: euler, simple, cfg 1, denoise 0.3)
on a random latent, once with the model as loaded and once patched by the node (``tile_size auto``, 128 px
overlap: a frame above 4 MP runs in 1024 px tiles). Reported per variant: the process's peak resident memory
(``ru_maxrss``), its resident memory just before sampling (model and latent made, ComfyUI imported) and the
difference (what the sampling itself added), the wall time, and the ratios. The result latents of both runs
are compared too (they differ: tiles are not the whole frame; the number shows the outputs are real).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT / "tests"), str(REPO_ROOT / "src")]

from comfy_venv import comfy_env, comfy_python, comfyui_dir  # noqa: E402


def rss_mib() -> float:
    """The current resident set size of this process (MiB), from /proc."""
    with open("/proc/self/statm") as handle:
        pages = int(handle.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def child(variant: str, size: int, steps: int, out: Path) -> None:
    """One variant in this (fresh) process: build, sample, report JSON on stdout."""
    sys.argv = [sys.argv[0], "--cpu"]
    sys.path.insert(0, str(comfyui_dir()))
    import comfy.options

    comfy.options.enable_args_parsing()
    import comfy.sample
    import torch

    from comfy_test_nodes import FlowliftTestTinyFlux2
    from flowlift.comfyui.refine_nodes import FlowliftTiledFlux2Refine

    model, conditioning = FlowliftTestTinyFlux2().build(3)
    if variant == "tiled":
        model = FlowliftTiledFlux2Refine.execute(model, "auto", 128, "auto").result[0]
    side = size // 16
    latent = torch.randn((1, 128, side, side), generator=torch.Generator().manual_seed(1))
    noise = torch.randn((1, 128, side, side), generator=torch.Generator().manual_seed(2))
    before = rss_mib()
    started = time.perf_counter()
    result = comfy.sample.sample(
        model,
        noise,
        steps,
        1.0,
        "euler",
        "simple",
        conditioning,
        conditioning,
        latent,
        denoise=0.3,
        disable_pbar=True,
        seed=2,
    )
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    torch.save(result.contiguous(), out)
    print(json.dumps({"variant": variant, "before": before, "peak": peak, "seconds": seconds}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="frame side in px (multiple of 16)")
    parser.add_argument("--steps", type=int, default=1, help="sampler steps (one model call each)")
    parser.add_argument("--child", choices=("plain", "tiled"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.size, args.steps, args.out)
        return 0

    import tempfile

    import torch

    python, env = comfy_python(), comfy_env(PYTHONDONTWRITEBYTECODE="1")  # the shared ComfyUI stays untouched
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("plain", "tiled"):
            out = Path(tmp) / f"{variant}.pt"
            command = [
                str(python),
                __file__,
                "--child",
                variant,
                "--size",
                str(args.size),
                "--steps",
                str(args.steps),
                "--out",
                str(out),
            ]
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
            if done.returncode != 0:
                print(done.stdout[-2000:], done.stderr[-4000:], file=sys.stderr)
                return 1
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            results[variant] = torch.load(out, weights_only=True)
    plain, tiled = rows
    difference = (results["plain"] - results["tiled"]).abs().max().item()
    print(
        f"ComfyUI 0.33 --cpu, tiny FLUX.2 (width 64), {args.size}x{args.size} px, {args.steps} step(s), "
        f"torch threads {torch.get_num_threads()}"
    )
    print("| run | peak RSS MiB | RSS before sampling MiB | added by sampling MiB | time s |")
    print("|---|---|---|---|---|")
    for row, name in ((plain, "untiled (model as loaded)"), (tiled, "Tiled FLUX.2 Refine, tile_size auto")):
        added = row["peak"] - row["before"]
        print(f"| {name} | {row['peak']:.0f} | {row['before']:.0f} | {added:.0f} | {row['seconds']:.1f} |")
    added = (tiled["peak"] - tiled["before"]) / max(1e-9, plain["peak"] - plain["before"])
    print(
        f"tiled / untiled: peak {tiled['peak'] / plain['peak']:.3f}x, added by sampling {added:.3f}x, "
        f"time {tiled['seconds'] / plain['seconds']:.2f}x; max |difference| of the latents {difference:.3g}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
