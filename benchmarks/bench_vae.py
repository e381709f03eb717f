"""TAEF2 encode/decode: full frame vs exact tiles, time and peak memory, side by side.

Every measurement runs in a fresh subprocess so its peak RSS (``ru_maxrss``) belongs to that one
operation: the process loads TAEF2, builds its input, runs ``vae.encode``/``vae.decode`` with
``tiled=False``/``True`` ``--repeat`` times and reports the best wall time, the best process CPU time
(user + system over all threads; unlike wall time it barely moves when other jobs share the
machine) and the peak RSS (which includes ~250 MB of torch + weights). Run from the repository root:

    PYTHONPATH=src python benchmarks/bench_vae.py --sizes 1024 2048 --repeat 1

Inputs are seeded random images / latents (speed does not depend on content). Weights come from
``--weights`` (default ``../shared/models/taef2``).
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
DEFAULT_WEIGHTS = REPO.parent / "shared" / "models" / "taef2"


def worker(args: argparse.Namespace) -> None:
    import torch

    from flowlift.models.vae_loading import load_vae

    torch.manual_seed(0)
    vae = load_vae(args.weights, device="cpu", dtype=torch.float32)
    size = args.size
    if args.op == "encode":
        x = torch.rand(1, 3, size, size)
        fn = vae.encode
    else:
        x = torch.randn(1, 32, size // 8, size // 8)
        fn = vae.decode
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    times, cpu_times = [], []
    for _ in range(args.repeat):
        cpu0, start = _cpu_s(), time.perf_counter()
        out = fn(x, tiled=args.mode == "tiled")
        times.append(time.perf_counter() - start)
        cpu_times.append(_cpu_s() - cpu0)
        del out
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"time_s": min(times), "cpu_s": min(cpu_times), "peak_mb": peak, "base_mb": base_rss}))


def _cpu_s() -> float:
    """CPU seconds (user + system, all threads) of this process: robust to other load on the box."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(size: int, op: str, mode: str, repeat: int, weights: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--size", str(size), "--op", op, "--mode", mode]
    cmd += ["--repeat", str(repeat), "--weights", weights]
    env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"worker failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--ops", nargs="+", default=["encode", "decode"], choices=["encode", "decode"])
    parser.add_argument("--repeat", type=int, default=1, help="runs per measurement (best time is kept)")
    parser.add_argument("--weights", default=str(DEFAULT_WEIGHTS))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--op", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    import torch

    print(
        f"# TAEF2 fp32 on CPU ({os.cpu_count()} cores, torch {torch.__version__}, "
        f"{platform.processor() or 'cpu'}), repeat={args.repeat}, "
        f"load average at start {os.getloadavg()[0]:.1f}"
    )
    print(
        "| size | op | full wall s | tiled wall s | full CPU s | tiled CPU s | tiled/full CPU "
        "| full peak MB | tiled peak MB | tiled/full peak |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes:
        for op in args.ops:
            full = measure(size, op, "full", args.repeat, args.weights)
            tiled = measure(size, op, "tiled", args.repeat, args.weights)
            print(
                f"| {size} | {op} | {full['time_s']:.1f} | {tiled['time_s']:.1f} | {full['cpu_s']:.1f} | "
                f"{tiled['cpu_s']:.1f} | {tiled['cpu_s'] / full['cpu_s']:.2f}x | {full['peak_mb']:.0f} | "
                f"{tiled['peak_mb']:.0f} | {tiled['peak_mb'] / full['peak_mb']:.2f}x |",
                flush=True,
            )
    print(f"# baseline RSS after loading torch + TAEF2: ~{full['base_mb']:.0f} MB (included in the peaks)")
    print(f"# load average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
