"""The exact chunked executor against the plain forward on the CPU, in the dtype and layout the CPU runs it.

Each run is a fresh interpreter that builds the full-size Flow Upscaler UNet (random weights, fixed seed), warms
both paths up, then times ``--passes`` plain forwards and as many chunked ones alternating (CPU seconds of
this process, ``time.process_time``), and reports the chunked pass over the plain one *within that run*: a
ratio that this machine's drift between runs does not move much. With ``--baseline REV`` every repeat runs
the same worker on ``REV``'s ``src/`` (``git archive``) right after this tree's, so the two trees' ratios are
paired too. The chunked result's largest difference from the plain one is printed as a check.

    PYTHONPATH=src python benchmarks/bench_chunked_cpu.py --size 256x384 --baseline main --repeats 3

``--size HxW`` is the pass's output latent (256x384: the first command's second pass; 384x512: a 1024x768
photo at 4x), ``--dtype bfloat16`` (channels-last, the CPU's auto dtype with native bf16) or ``float32``
(contiguous), ``--chunk`` rows per strip (default: the executor's own, ``default_chunk``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def worker(size: tuple[int, int], dtype_name: str, chunk: int, passes: int) -> None:
    """One run in this interpreter: plain and chunked passes alternating; prints JSON."""
    import torch

    from flowlift.models.upscaler_unet import FlowUpscalerUNet
    from flowlift.upscale.chunked.executor import ChunkedExecutor

    torch.set_grad_enabled(False)
    dtype = getattr(torch, dtype_name)
    layout = torch.channels_last if dtype == torch.bfloat16 else torch.contiguous_format
    torch.manual_seed(0)
    model = FlowUpscalerUNet().to(dtype=dtype, memory_format=layout).eval()
    h, w = size
    generator = torch.Generator().manual_seed(1)
    sample = torch.randn(1, 32, h, w, generator=generator).to(dtype).contiguous(memory_format=layout)
    small = torch.randn(1, 32, h // 2, w // 2, generator=generator).to(dtype).contiguous(memory_format=layout)
    timestep = torch.tensor([1.0])
    executor = ChunkedExecutor(model, chunk=chunk or None)
    plain_out, chunked_out = model(sample, timestep, small), executor(sample, timestep, small)  # warm-up
    seconds: dict[str, list[float]] = {"plain": [], "chunked": []}
    for _ in range(passes):
        for name, fn in (("plain", model), ("chunked", executor)):
            start = time.process_time()
            fn(sample, timestep, small)
            seconds[name].append(time.process_time() - start)
    difference = float((plain_out.float() - chunked_out.float()).abs().max())
    print("RUN " + json.dumps({"seconds": seconds, "rows": executor.last_chunk, "max_difference": difference}))


def run(src: Path, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    argv = [sys.executable, __file__, "--worker", "--size", args.size, "--dtype", args.dtype]
    argv += ["--chunk", str(args.chunk), "--passes", str(args.passes)]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=True)
    return json.loads(next(line[4:] for line in done.stdout.splitlines() if line.startswith("RUN ")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="256x384", help="the pass's output latent, HxW")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--chunk", type=int, default=0, help="rows per strip (0: the executor's default)")
    parser.add_argument("--passes", type=int, default=2, help="plain and chunked passes per run")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--baseline", help="a git revision whose executor runs beside this tree's")
    parser.add_argument("--work", default=str(Path("/tmp") / f"flowlift-bench-chunked-{os.getuid()}"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = tuple(int(v) for v in args.size.lower().split("x"))
    if args.worker:
        return worker(size, args.dtype, args.chunk, args.passes)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_first_run import cpu_name, exported_source

    trees = {"this tree": SRC}
    if args.baseline:
        trees[args.baseline] = exported_source(args.baseline, Path(args.work))
    print(
        f"bench_chunked_cpu: {os.cpu_count()} CPUs ({cpu_name()}), {args.dtype}, sample {args.size}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        flush=True,
    )
    ratios: dict[str, list[float]] = {name: [] for name in trees}
    fastest: dict[str, dict[str, float]] = {name: {"plain": float("inf"), "chunked": float("inf")} for name in trees}
    for repeat in range(args.repeats):
        for name, src in trees.items():
            result = run(src, args)
            plain, chunked = (statistics.median(result["seconds"][k]) for k in ("plain", "chunked"))
            for kind in ("plain", "chunked"):
                fastest[name][kind] = min(fastest[name][kind], *result["seconds"][kind])
            ratios[name].append(chunked / plain)
            print(
                f"  repeat {repeat + 1}, {name}: plain {plain:.2f} CPU-s, chunked {chunked:.2f} CPU-s "
                f"({result['rows']} rows a strip): {chunked / plain:.2f}x; max difference "
                f"{result['max_difference']:.3g}; load {os.getloadavg()[0]:.1f}",
                file=sys.stderr,
                flush=True,
            )
    # The fastest pass of each kind over all runs: a shared host's interference only ever adds time.
    for name, values in ratios.items():
        best = fastest[name]
        print(
            f"{name}: chunked / plain CPU time {statistics.median(values):.2f}x, median of the runs "
            f"({', '.join(f'{v:.2f}' for v in values)}); fastest passes {best['chunked']:.2f} / "
            f"{best['plain']:.2f} CPU-s = {best['chunked'] / best['plain']:.2f}x"
        )


if __name__ == "__main__":
    main()
