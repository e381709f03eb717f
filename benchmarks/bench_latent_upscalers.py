"""FLUX.2 latent upscalers side by side: the Flow Upscaler, SesquiLSR and latent bicubic at 1.5x, 2x, 3x, 4x.

For one input latent (``--pixels`` px square image -> (1, 32, p/8, p/8)) and each scale, every method makes the
latents of the ``scale`` x output; measured, in one run:

* time per output megapixel (seconds of the whole latent step / output image megapixels; wall and process
  CPU time, each the min over ``--repeats`` runs, methods interleaved, after one warm-up), and the CPU time
  as a ratio to the Flow Upscaler's at the same scale (ratios survive a loaded machine better than seconds);
* peak memory: the process's peak RSS (``VmHWM``) in a fresh subprocess per (method, scale), minus its RSS
  just before the step (interpreter, torch, weights and input are already there);
* FLOPs: convolutions and matmuls (``torch.utils.flop_counter.FlopCounterMode`` on meta tensors); element-wise
  work (SesquiLSR's 4-tap resampling, activations, norms, latent bicubic itself) is not counted.

How each row is composed (the fewest passes that reach the scale, as ``flowlift upscale`` plans):

* Flow Upscaler: one UNet forward per 2x pass (59M parameters, one Euler step), so 2x = 1 pass, 4x = 2;
  1.5x = 1 pass then a resample down, 3x = 2 passes (4x) then a resample down. The resample here is
  latent-space bicubic to the target grid (its cost is negligible next to a pass; ``flowlift upscale``
  resamples the decoded image instead).
* SesquiLSR: one forward per factor in [1, 2]: 1.5x and 2x = 1 forward, 3x = 2x then 1.5x, 4x = 2x then 2x.
* latent bicubic: one ``F.interpolate(mode="bicubic")`` on the raw latents.

Weights are random at full size (default init / the released layout): time and memory do not depend on them.

    PYTHONPATH=src python benchmarks/bench_latent_upscalers.py                 # CPU table (~8 min, 2 cores)
    PYTHONPATH=src python benchmarks/bench_latent_upscalers.py --pixels 256    # larger input (~4x longer)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SRC = Path(__file__).resolve().parents[1] / "src"
METHODS = ("flow", "sesqui", "latent-bicubic")
SCALES = (1.5, 2.0, 3.0, 4.0)


def build(method: str, device: str | torch.device = "cpu"):
    """A full-size model with random weights (None for latent bicubic)."""
    torch.manual_seed(0)
    if method == "flow":
        from flowlift.models.upscaler_unet import FlowUpscalerUNet

        with torch.device(device):
            return FlowUpscalerUNet().eval()
    if method == "sesqui":
        from flowlift.models.sesqui_lsr import SesquiLSR

        with torch.device(device):
            return SesquiLSR().eval()
    return None


def plan(scale: float) -> list[float]:
    """Per-forward factors of SesquiLSR (each in [1, 2]) whose product is ``scale``."""
    factors = []
    while scale > 2 + 1e-9:
        factors.append(2.0)
        scale /= 2
    return factors + [scale]


def flow_passes(scale: float) -> int:
    """2x passes the Flow Upscaler needs to reach at least ``scale``."""
    passes = 0
    while 2**passes < scale - 1e-9:
        passes += 1
    return passes


def step(method: str, model, latents: torch.Tensor, scale: float) -> torch.Tensor:
    """Latents (1, 32, h, w) -> latents of the ``scale`` x output, as the row's composition says."""
    h, w = latents.shape[-2:]
    target = (round(h * scale), round(w * scale))
    if method == "latent-bicubic":
        return F.interpolate(latents, size=target, mode="bicubic", align_corners=False)
    if method == "sesqui":
        z = latents
        for factor in plan(scale):
            z = model(z, (round(z.shape[-2] * factor), round(z.shape[-1] * factor)))
        return z
    z = latents
    timestep = torch.full((1,), 1000.0, device=latents.device)
    for _ in range(flow_passes(scale)):
        sample = torch.randn(1, 32, z.shape[-2] * 2, z.shape[-1] * 2, device=z.device, dtype=z.dtype)
        velocity = model(sample, timestep, z)
        z = sample - velocity  # one Euler step from t=1 to t=0
    if tuple(z.shape[-2:]) != target:
        z = F.interpolate(z, size=target, mode="bicubic", align_corners=False)
    return z


def latent_input(pixels: int, device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.randn(1, 32, pixels // 8, pixels // 8, generator=torch.Generator().manual_seed(1)).to(device)


def rss_mib(field: str) -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def worker(method: str, scale: float, pixels: int) -> None:
    """One step in this fresh process; prints JSON with the RSS before it and the peak."""
    torch.set_grad_enabled(False)
    model = build(method)
    latents = latent_input(pixels)
    before = rss_mib("VmRSS")
    step(method, model, latents, scale)
    print(json.dumps({"before_mib": before, "peak_mib": rss_mib("VmHWM")}))


def peak_memory(method: str, scale: float, pixels: int) -> float:
    cmd = [sys.executable, __file__, "--worker", method, str(scale), "--pixels", str(pixels)]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    row = json.loads(done.stdout.strip().splitlines()[-1])
    return row["peak_mib"] - row["before_mib"]


def flops(method: str, scale: float, pixels: int) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    model = build(method, "meta")
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        step(method, model, latent_input(pixels, "meta"), scale)
    return counter.get_total_flops()


def cpu_table(args: argparse.Namespace) -> None:
    torch.set_grad_enabled(False)
    models = {m: build(m) for m in METHODS}
    latents = latent_input(args.pixels)
    times: dict[tuple[str, float], tuple[float, float]] = {}
    for scale in SCALES:
        for method in METHODS:
            step(method, models[method], latents, scale)  # warm-up
        for _ in range(args.repeats):
            for method in METHODS:
                start, cpu = time.perf_counter(), time.process_time()
                step(method, models[method], latents, scale)
                wall, cpu = time.perf_counter() - start, time.process_time() - cpu
                best = times.get((method, scale), (float("inf"), float("inf")))
                times[(method, scale)] = (min(best[0], wall), min(best[1], cpu))
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, CPU; input {args.pixels} px "
        f"(latent {args.pixels // 8}x{args.pixels // 8}); min of {args.repeats} runs"
    )
    print()
    print(
        "| scale | method | forwards | wall ms / output MP | CPU ms / output MP | CPU time / Flow's | "
        "peak RSS over pre-step (MiB) | GFLOPs (conv+matmul) |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for scale in SCALES:
        out_mp = (args.pixels * scale) ** 2 / 1e6
        for method in METHODS:
            if method == "flow":
                passes = flow_passes(scale)
                composed = (
                    f"{passes} pass"
                    + ("es" if passes > 1 else "")
                    + ("" if 2**passes == scale else f" ({2**passes:g}x) + bicubic down")
                )
            elif method == "sesqui":
                composed = " + ".join(f"{f:g}x" for f in plan(scale))
            else:
                composed = "1 interpolate"
            wall, cpu = (1000 * t / out_mp for t in times[(method, scale)])
            ratio = times[(method, scale)][1] / times[("flow", scale)][1]
            memory = peak_memory(method, scale, args.pixels) if args.memory else float("nan")
            gflops = flops(method, scale, args.pixels) / 1e9
            print(
                f"| {scale:g}x | {method} | {composed} | {wall:.0f} | {cpu:.0f} | {ratio:.4f} | {memory:.0f} | "
                f"{gflops:.2f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pixels", type=int, default=128, help="input image side (default 128: latent 16x16)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="skip the subprocess RSS runs")
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "SCALE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], float(args.worker[1]), args.pixels)
        return
    cpu_table(args)


if __name__ == "__main__":
    main()
