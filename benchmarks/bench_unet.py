"""Flow Upscaler UNet: plain forward vs the exact chunked executor — time, peak memory, FLOPs.

CPU (default), in one run, side by side:

* time of one pass at 1024 px output (latent 64x64 -> 128x128), plain vs executor, interleaved
  ``--repeats`` times (min and median of wall and CPU seconds);
* peak RSS of one pass at 1024 and 2048 px output, each measured in a fresh subprocess (``VmHWM``,
  the kernel's peak-RSS counter), with the RSS before the pass (interpreter, torch, weights, inputs);
* FLOPs per pass (``torch.utils.flop_counter.FlopCounterMode`` on meta tensors: convolutions and
  matmuls), plain and executor — they must be equal (no recomputation).

GPU (``--device cuda``, bf16 by default): ms per 64x64 -> 128x128 latent pass (CUDA events, plain
forward) and peak device memory (``torch.cuda.max_memory_allocated``) of the executor with
activations offloaded to host memory at 8K and 16K output.

Weights are random (default init, fixed seed): time and memory do not depend on their values.

    PYTHONPATH=src python benchmarks/bench_unet.py                 # CPU figures
    PYTHONPATH=src python benchmarks/bench_unet.py --device cuda   # GPU figures
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from flowlift.models.upscaler_unet import FlowUpscalerUNet
from flowlift.upscale.chunked.executor import ChunkedExecutor

SRC = Path(__file__).resolve().parents[1] / "src"


def build(device: str, dtype: torch.dtype) -> FlowUpscalerUNet:
    torch.manual_seed(0)
    return FlowUpscalerUNet().to(device=device, dtype=dtype).eval()


def inputs(pixels: int, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Latent inputs for a square ``pixels`` output: sample (1,32,p/8,p/8), small (1,32,p/16,p/16)."""
    n = pixels // 8
    gen = torch.Generator().manual_seed(1)
    sample = torch.randn(1, 32, n, n, generator=gen).to(device=device, dtype=dtype)
    small = torch.randn(1, 32, n // 2, n // 2, generator=gen).to(device=device, dtype=dtype)
    return sample, torch.full((1,), 1000.0, device=device), small


def runner(model: FlowUpscalerUNet, mode: str, chunk: int, offload: str | None = None):
    if mode == "plain":
        return model
    return ChunkedExecutor(model, chunk=chunk or None, offload_device=offload)


def rss_mib() -> float:
    """Peak resident set size of this process so far, MiB.

    ``VmHWM`` from ``/proc/self/status`` (reset by exec); ``ru_maxrss`` is only a fallback because Linux
    carries it over from the parent across fork + exec, so a large parent would hide the child's peak.
    """
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mib() -> float:
    with open("/proc/self/statm") as handle:
        pages = int(handle.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def worker(mode: str, pixels: int, chunk: int) -> None:
    """One pass in this (fresh) process; prints JSON with RSS before the pass and the peak."""
    torch.set_grad_enabled(False)
    model = build("cpu", torch.float32)
    sample, timestep, small = inputs(pixels, "cpu", torch.float32)
    before = current_rss_mib()
    start = time.perf_counter()
    runner(model, mode, chunk)(sample, timestep, small)
    seconds = time.perf_counter() - start
    print(json.dumps({"before_mib": before, "peak_mib": rss_mib(), "seconds": seconds}))


def measure_peak(mode: str, pixels: int, chunk: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", mode, str(pixels), "--chunk", str(chunk)]
    env = {"PYTHONPATH": str(SRC)}
    import os

    env = {**os.environ, **env}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def flops(mode: str, pixels: int, chunk: int) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = FlowUpscalerUNet().eval()
    sample, timestep, small = (t.to("meta") for t in inputs(pixels, "cpu", torch.float32))
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        runner(model, mode, chunk)(sample, timestep, small)
    return counter.get_total_flops()


def cpu_report(args: argparse.Namespace) -> None:
    torch.set_grad_enabled(False)
    chunk = args.chunk or "default"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, chunk={chunk}, fp32, CPU")
    parts = set(args.parts.split(","))
    for pixels in (1024, 2048) if "flops" in parts else ():
        plain, chunked = flops("plain", pixels, args.chunk), flops("executor", pixels, args.chunk)
        print(f"FLOPs per pass at {pixels} px: plain {plain / 1e9:.1f} G, executor {chunked / 1e9:.1f} G")

    for pixels in (1024, 2048) if "memory" in parts else ():
        peaks = {mode: measure_peak(mode, pixels, args.chunk) for mode in ("plain", "executor")}
        p, e = peaks["plain"], peaks["executor"]
        p_act, e_act = p["peak_mib"] - p["before_mib"], e["peak_mib"] - e["before_mib"]
        print(
            f"peak RSS at {pixels} px: plain {p['peak_mib']:.0f} MiB (+{p_act:.0f} over "
            f"{p['before_mib']:.0f} before the pass), executor {e['peak_mib']:.0f} MiB (+{e_act:.0f}); "
            f"executor / plain "
            f"{e['peak_mib'] / p['peak_mib']:.3f}x total, {e_act / max(1e-9, p_act):.3f}x over pre-pass"
        )

    if "time" not in parts:
        return
    model = build("cpu", torch.float32)
    sample, timestep, small = inputs(1024, "cpu", torch.float32)
    executor = runner(model, "executor", args.chunk)
    model(sample, timestep, small)  # warm-up
    times: dict[str, list[tuple[float, float]]] = {"plain": [], "executor": []}
    for _ in range(args.repeats):
        for name, fn in (("plain", model), ("executor", executor)):
            wall, cpu = time.perf_counter(), time.process_time()
            fn(sample, timestep, small)
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    row = {}
    for name, values in times.items():
        walls, cpus = [v[0] for v in values], [v[1] for v in values]
        row[name] = (min(walls), statistics.median(walls), min(cpus))
        print(
            f"1024 px, {name:8s}: wall min {min(walls):.2f} s, median {statistics.median(walls):.2f} s; "
            f"CPU min {min(cpus):.2f} s  (n={len(walls)})"
        )
    print(
        f"executor / plain: wall min {row['executor'][0] / row['plain'][0]:.3f}x, "
        f"median {row['executor'][1] / row['plain'][1]:.3f}x, CPU {row['executor'][2] / row['plain'][2]:.3f}x"
    )


def gpu_report(args: argparse.Namespace) -> None:
    torch.set_grad_enabled(False)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    device = args.device
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}, {args.dtype}, chunk={args.chunk}")
    model = build(device, dtype)
    sample, timestep, small = inputs(1024, device, dtype)
    for _ in range(10):
        model(sample, timestep, small)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = []
    for _ in range(args.repeats * 10):
        start.record()
        model(sample, timestep, small)
        end.record()
        torch.cuda.synchronize()
        ms.append(start.elapsed_time(end))
    print(f"64x64 -> 128x128 latent pass, plain: min {min(ms):.2f} ms, median {statistics.median(ms):.2f} ms")
    for pixels in (8192, 16384):
        sample, timestep, small = inputs(pixels, device, dtype)
        sample, small = sample.cpu(), small.cpu()  # inputs live in host memory too
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        wall = time.perf_counter()
        executor = runner(model, "executor", args.chunk, offload="cpu")
        executor(sample, timestep, small)  # inputs stay in host memory; the output lands on the GPU
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(device)
        print(
            f"{pixels} px executor (offload to host): peak device memory {peak / 2**30:.2f} GiB "
            f"(weights {base / 2**30:.2f} GiB), {time.perf_counter() - wall:.1f} s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bf16", help="GPU dtype: bf16, fp16 or fp32 (CPU runs fp32)")
    parser.add_argument("--chunk", type=int, default=0, help="rows per strip (0: the executor default)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", default="flops,memory,time", help="CPU report parts to run")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "PIXELS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.chunk)
    elif args.device == "cpu":
        cpu_report(args)
    else:
        gpu_report(args)


if __name__ == "__main__":
    main()
