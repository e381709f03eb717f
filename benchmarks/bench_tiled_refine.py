"""Peak memory and time of the refine's transformer stage, untiled vs in tiles, as the frame grows.

One sampler step's velocity (:class:`flowlift.flux2.denoiser.Flux2Denoiser`, whole frame, or wrapped in
:class:`flowlift.refine.tiled_velocity.TiledVelocity`) on a random ``Flux2Transformer2DModel``, at each frame size,
each in its own process so allocator reuse cannot hide a peak:

* ``--device cpu`` (default): a wide-but-shallow model (1 double + 1 single block, heads of 128, ``--width``),
  float32; the peak is the resident-memory growth of the call (Linux ``VmHWM`` after resetting it through
  ``/proc/self/clear_refs``), weights and the input latents (made before) excluded, the output frame included;
* ``--device cuda``: a random transformer of FLUX.2 Klein 4B's size (width 3072, 5 + 20 blocks) in bfloat16; the peak
  is ``torch.cuda.max_memory_allocated`` above what was allocated before the call (weights excluded). Without a
  CUDA device its rows say "not measured yet".

The time is the wall time of the call (one step; a refine runs ``--steps`` of them). What the table should show:
the tiled peak flat in the frame size apart from the latent buffers, the tiled time linear in the tile count, the
untiled peak and time growing with the tokens (time with their square, from attention)::

    PYTHONPATH=src python benchmarks/bench_tiled_refine.py         # 1024-4096 px, 8192 tiled; tiles 1024/128 px
    PYTHONPATH=src python benchmarks/bench_tiled_refine.py --sizes 512,1024,2048 --tiled-sizes 4096 \\
        --tile-size 512 --tile-overlap 64 --text-tokens 64                        # minutes on 2 loaded cores
    PYTHONPATH=src python benchmarks/bench_tiled_refine.py --device cuda          # the GPU rows
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from flowlift.refine.settings import DEFAULT_TILE_SIZE, TILE_OVERLAP

#: The FLUX.2 pipelines pad prompts to 512 tokens; smaller runs may pass fewer (``--text-tokens``).
TEXT_TOKENS = 512


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def build_model(device: str, width: int):
    """The benchmark's random transformer: wide and shallow on the CPU, Klein 4B's size on CUDA."""
    import torch
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    if device == "cpu":
        config = dict(
            num_layers=1,
            num_single_layers=1,
            num_attention_heads=width // 128,
            joint_attention_dim=width,
            guidance_embeds=False,
        )
        dtype = torch.float32
    else:
        config = dict(
            num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680, guidance_embeds=False
        )
        dtype = torch.bfloat16
    model = Flux2Transformer2DModel(attention_head_dim=128, timestep_guidance_channels=256, **config)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False), config["joint_attention_dim"]


def measure(device: str, width: int, side: int, tile: int | None, overlap: int, batch: int, text: int) -> dict:
    """One velocity call at ``side`` px: seconds, peak bytes above the start, tiles and tokens per tile."""
    import torch

    from flowlift.flux2.denoiser import Flux2Denoiser
    from flowlift.refine.tiled_velocity import TiledVelocity
    from flowlift.refine.tiling import tile_layout

    model, text_dim = build_model(device, width)
    embeds = torch.randn(1, text, text_dim, device=device)
    den = Flux2Denoiser(model, embeds)
    x = torch.randn(1, 32, side // 8, side // 8, device=device)
    layout = tile_layout(side, side, tile, overlap, batch) if tile is not None else None
    fn = TiledVelocity(den, layout) if layout is not None else den
    with torch.inference_mode():
        den(torch.randn(1, 32, 8, 8, device=device), 0.5)  # warm-up: lazy initializations, kernels
        if device == "cpu":
            Path("/proc/self/clear_refs").write_text("5")
            start = _status("VmRSS")
        else:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
        began = time.perf_counter()
        fn(x, 0.5)
        if device != "cpu":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - began
        peak = (_status("VmHWM") if device == "cpu" else torch.cuda.max_memory_allocated()) - start
    tokens = (layout.tile_height // 16) * (layout.tile_width // 16) if layout else (side // 16) ** 2
    return {"seconds": seconds, "peak": peak, "tiles": layout.count if layout else 1, "tokens": tokens}


def rows(args: argparse.Namespace) -> list[tuple[int, int | None]]:
    """(side, tile) of each row: untiled and tiled at ``--sizes``, tiled only at ``--tiled-sizes``."""
    out: list[tuple[int, int | None]] = []
    for side in args.sizes:
        out += [(side, None), (side, args.tile_size)]
    out += [(side, args.tile_size) for side in args.tiled_sizes]
    return out


def _sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--width", type=int, default=256, help="CPU model width (heads of 128; default 256)")
    parser.add_argument("--sizes", type=_sizes, default=[1024, 2048, 4096], help="untiled and tiled rows (px)")
    parser.add_argument("--tiled-sizes", type=_sizes, default=[8192], help="tiled-only rows (px)")
    parser.add_argument("--tile-size", type=int, default=DEFAULT_TILE_SIZE, help=f"default {DEFAULT_TILE_SIZE}")
    overlap = TILE_OVERLAP.default
    parser.add_argument("--tile-overlap", type=int, default=overlap, help=f"default {overlap}")
    parser.add_argument("--tile-batch", type=int, default=1, help="default 1 (the CLI's auto without a budget)")
    parser.add_argument("--text-tokens", type=int, default=TEXT_TOKENS, help=f"default {TEXT_TOKENS}")
    parser.add_argument("--one", nargs=2, type=int, metavar=("SIDE", "TILE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        side, tile = args.one
        result = measure(
            args.device, args.width, side, tile or None, args.tile_overlap, args.tile_batch, args.text_tokens
        )
        print(json.dumps(result))
        return
    import torch

    model = f"width {args.width}, 1+1 blocks, fp32" if args.device == "cpu" else "Klein 4B size, 5+20 blocks, bf16"
    print(f"| frame | transformer ({model}) | tiles | tokens per call | time (s) | s per tile | peak (MiB) |")
    print("|---|---|---|---|---|---|---|")
    for side, tile in rows(args):
        how = "untiled" if tile is None else f"{tile} px tiles, overlap {args.tile_overlap}, {args.tile_batch}/call"
        if args.device == "cuda" and not torch.cuda.is_available():
            print(f"| {side}² | {how} | | | not measured yet | | not measured yet |")
            continue
        cmd = [
            sys.executable,
            __file__,
            "--device",
            args.device,
            "--width",
            str(args.width),
            "--tile-overlap",
            str(args.tile_overlap),
            "--tile-batch",
            str(args.tile_batch),
            "--text-tokens",
            str(args.text_tokens),
            "--one",
            str(side),
            str(tile or 0),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"| {side}² | {how} | | | failed: {done.stderr.strip().splitlines()[-1][:80]} | | |")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        print(
            f"| {side}² | {how} | {r['tiles']} | {r['tokens']} + {args.text_tokens} | {r['seconds']:.2f} | "
            f"{r['seconds'] / r['tiles']:.2f} | {r['peak'] / 2**20:.0f} |",
            flush=True,
        )
    if args.device == "cpu":
        print("load average after the run (1, 5, 15 min): " + ", ".join(f"{v:.2f}" for v in os.getloadavg()))


if __name__ == "__main__":
    main()
