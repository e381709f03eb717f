"""CPU peak RSS of the plain UNet forward and the ChunkedExecutor, in (1, base, H, W) fp32 frames.

Calibrates ``flowlift.upscale.chunked.budget``'s frame counts (PLAIN_PEAK_FRAMES, CHUNKED_STORE_FRAMES,
STRIP_ROW_FRAMES). Each measurement runs in its own process (Linux: VmHWM reset through
/proc/self/clear_refs after a warm-up), so allocator reuse between runs cannot hide a peak::

    PYTHONPATH=src python benchmarks/calibrate_memory.py            # ~30 s on 2 cores
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(mode: str, base: int, height: int, width: int, chunk: int) -> float:
    """Peak RSS growth of one forward, in frames of (1, base, height, width) float32."""
    import torch

    from flowlift.models.upscaler_unet import FlowUpscalerUNet
    from flowlift.upscale.chunked.executor import ChunkedExecutor

    torch.manual_seed(0)
    model = FlowUpscalerUNet(base_channels=base, time_dim=32, cond_dim=64).eval()
    timestep = torch.tensor([1000.0])
    sample, small = torch.randn(1, 32, height, width), torch.randn(1, 32, height // 2, width // 2)
    with torch.no_grad():
        model(torch.randn(1, 32, 16, 16), timestep, torch.randn(1, 32, 8, 8))  # warm-up: lazy inits
        ChunkedExecutor(model, chunk=2)(torch.randn(1, 32, 16, 16), timestep, torch.randn(1, 32, 8, 8))
        Path("/proc/self/clear_refs").write_text("5")
        start = _status("VmRSS")
        if mode == "plain":
            model(sample, timestep, small)
        else:
            ChunkedExecutor(model, chunk=chunk)(sample, timestep, small)
    return (_status("VmHWM") - start) / (base * height * width * 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=int, default=64)
    parser.add_argument("--size", type=int, default=256, help="latent side of the sample")
    parser.add_argument("--one", nargs=2, metavar=("MODE", "CHUNK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(measure(args.one[0], args.base, args.size, args.size, int(args.one[1])))
        return
    print(f"| run ({args.size}x{args.size} latent, base {args.base}, fp32) | peak RSS growth (frames) |")
    print("|---|---|")
    for mode, chunk in (("plain", 0), ("chunked", 8), ("chunked", 32), ("chunked", 64)):
        cmd = [sys.executable, __file__, "--base", str(args.base), "--size", str(args.size), "--one", mode, str(chunk)]
        frames = float(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip())
        label = "plain forward" if mode == "plain" else f"ChunkedExecutor chunk={chunk}"
        print(f"| {label} | {frames:.2f} |")


if __name__ == "__main__":
    main()
