"""How long the README's first command takes: ``flowlift upscale kodim23.png --scale 4 --vae taef2``.

The released weights are not needed for a timing (time does not depend on weight values): a random
full-size Flow Upscaler checkpoint (the released architecture, default init, fixed seed) is written
once, and the command runs as a user runs it, in a fresh process, with the real TAEF2 from
``../shared/models/taef2``. Reports the wall time of the whole command (start-up, loading, two passes,
decode, both colour stages, writing the PNG), its CPU time (user + system, which a busy machine inflates
far less than the wall time) and the load average while it ran.

    PYTHONPATH=src python benchmarks/bench_first_run.py [--device cpu] [--repeats 1]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def random_checkpoint(folder: Path) -> Path:
    import torch

    from flowlift.models.upscaler_unet import FlowUpscalerUNet
    from flowlift.models.upscaler_weights import save_upscaler

    path = folder / "flow_upscaler.safetensors"
    if not path.is_file():
        torch.manual_seed(0)
        save_upscaler(FlowUpscalerUNet(), path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", default=os.environ.get("FLOWLIFT_SHARED", str(ROOT.parent / "shared")))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "flowlift-first-run"))
    args = parser.parse_args()
    shared = Path(args.shared)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    weights = random_checkpoint(work)
    image = shared / "images" / "kodak" / "kodim23.png"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    for repeat in range(args.repeats):
        out = work / f"out{repeat}"
        command = [sys.executable, "-m", "flowlift", "upscale", str(image), "--scale", "4", "--vae",
                   str(shared / "models" / "taef2"), "--upscaler", str(weights), "--device", args.device,
                   "-o", str(out), "--overwrite"]  # fmt: skip
        load_before = os.getloadavg()[0]
        cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        run = subprocess.run(command, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - start
        cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
        load_after = os.getloadavg()[0]
        if run.returncode != 0:
            sys.exit(f"failed ({run.returncode}): {run.stderr.strip()}")
        print(run.stdout.strip())
        print(
            f"first command, kodim23 768x512 -> 3072x2048, random full-size UNet + TAEF2, {args.device}, "
            f"{os.cpu_count()} CPUs: {wall:.1f} s wall, {cpu:.1f} s CPU time (user+sys; {cpu / wall:.2f} cores busy "
            f"on average), load average {load_before:.1f} -> {load_after:.1f}"
        )


if __name__ == "__main__":
    main()
