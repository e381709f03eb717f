"""Mage-VAE encode/decode: whole frame vs the exact tiled executor, peak memory and time, side by side.

Full-size random weights (the released architecture, float32, t = 0 folded). Every measurement runs
in a fresh subprocess so that its peak RSS (``ru_maxrss``) belongs to that one operation; ``base``
is the RSS once the model and the input exist, ``over`` = peak - base is what the operation itself
added. For tiled runs the table also gives ``frame``: the bytes the executor must hold whatever the
tile (its three (384, h/16, w/16) stores, the output image and the patchified latent — for encode
the two stores beside the image's [-1, 1] copy), so ``over - frame`` is the tile working set, which
must not grow with the frame. Run from the repository root:

    PYTHONPATH=src python benchmarks/bench_mage_tiling.py --sizes 512 1024 --strips 16384x256 16384x512

``--sizes`` are square sides measured both ways; ``--strips WxH`` are tiled only (full-width strips of
a frame too large for this machine, to extrapolate it: see ``--extrapolate``). ``--check SIZE``
prints the relative difference tiled vs whole at one size (both in one process, 32-position tiles so
that a small frame spans several, e.g. ``--check 768``: 48 positions, not a multiple of the window).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
C = 384  # the released codec's width


def _model(op: str):
    import torch

    from flowlift.models.mage_vae import MageVAEModel
    from flowlift.models.vae import MageVAE

    torch.manual_seed(0)
    model = MageVAEModel(encoder=op == "encode", decoder=op == "decode")
    return MageVAE(model)


def _inputs(op: str, width: int, height: int):
    import torch

    torch.manual_seed(1)
    if op == "encode":
        return torch.rand(1, 3, height, width)
    return torch.randn(1, 32, height // 8, width // 8)


def frame_bytes(op: str, width: int, height: int) -> int:
    """Bytes a tiled run holds that scale with the frame (float32): stores and the in/out tensors it makes."""
    positions = (width // 16) * (height // 16)
    if op == "decode":  # 3 stores, patchified latent, output image
        return 4 * (3 * C * positions + 32 * positions * 4 + 3 * width * height)
    # the [-1, 1] image copy, a 768- and a 384-wide store, the 128-channel output, its unpatchified copy
    return 4 * (3 * width * height + (768 + C) * positions + 2 * 128 * positions)


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    vae = _model(args.op)
    x = _inputs(args.op, args.width, args.height)
    fn = vae.encode if args.op == "encode" else vae.decode
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    usage0, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    out = fn(x, tiled=args.mode == "tiled")
    wall = time.perf_counter() - start
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage1.ru_utime + usage1.ru_stime - usage0.ru_utime - usage0.ru_stime
    peak = usage1.ru_maxrss / 1024
    del out
    print(json.dumps({"time_s": wall, "cpu_s": cpu, "peak_mb": peak, "base_mb": base}))


def check(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    for op in args.ops:
        from flowlift.models.mage_tiling import MageTiling

        vae = _model(op)
        vae.tiling = MageTiling(tile=32, pixel_tile=16)  # several tiles even at small sizes
        x = _inputs(op, args.check, args.check)
        fn = vae.encode if op == "encode" else vae.decode
        whole, tiled = fn(x, tiled=False), fn(x, tiled=True)
        rel = float((tiled.double() - whole.double()).norm() / whole.double().norm())
        print(f"check {op} {args.check}x{args.check} (32-position tiles): relative difference tiled vs whole {rel:.2e}")


def run_one(op: str, mode: str, width: int, height: int, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--op", op, "--mode", mode, "--width", str(width)]
    cmd += ["--height", str(height), "--threads", str(threads)]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if result.returncode != 0:
        return {"error": (result.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def _row(op: str, mode: str, width: int, height: int, r: dict) -> str:
    if "error" in r:
        return f"| {op} | {width}x{height} | {mode} | error: {r['error']} |"
    over = r["peak_mb"] - r["base_mb"]
    frame = frame_bytes(op, width, height) / 2**20 if mode == "tiled" else float("nan")
    return (
        f"| {op} | {width}x{height} | {mode} | {r['time_s']:.1f} | {r['cpu_s']:.1f} | {r['peak_mb']:.0f} | "
        f"{over:.0f} | {frame:.0f} | {over - frame:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--op", default="decode")
    parser.add_argument("--mode", default="tiled")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--height", type=int, default=512)
    parser.add_argument("--sizes", type=int, nargs="*", default=[512, 1024])
    parser.add_argument("--strips", nargs="*", default=[], help="WxH, tiled only")
    parser.add_argument("--ops", nargs="*", default=["decode", "encode"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--check", type=int, default=0)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.check:
        check(args)
        return
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()}")
    print("| op | size | mode | wall s | cpu s | peak MB | over base MB | frame MB | over - frame MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes:
        for op in args.ops:
            runs = {mode: run_one(op, mode, size, size, args.threads) for mode in ("whole", "tiled")}
            for mode, r in runs.items():
                print(_row(op, mode, size, size, r), flush=True)
            if all("error" not in r for r in runs.values()):
                w, t = runs["whole"], runs["tiled"]
                ratio = (t["peak_mb"] - t["base_mb"]) / max(w["peak_mb"] - w["base_mb"], 1)
                print(
                    f"| {op} | {size}x{size} | tiled/whole | {t['time_s'] / w['time_s']:.2f}x | "
                    f"{t['cpu_s'] / w['cpu_s']:.2f}x | {t['peak_mb'] / w['peak_mb']:.2f}x | {ratio:.2f}x | | |",
                    flush=True,
                )
    for strip in args.strips:
        width, height = (int(v) for v in strip.lower().split("x"))
        for op in args.ops:
            print(_row(op, "tiled", width, height, run_one(op, "tiled", width, height, args.threads)), flush=True)
    print(f"# load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
