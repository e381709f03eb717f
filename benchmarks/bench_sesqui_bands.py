"""SesquiLSR whole frame against its row bands (flowlift/models/sesqui_bands.py): CPU time and tracked peak memory.

A random SesquiLSR (seed 0) resizes random raw latents (seed 1) of ``--size`` HxW by ``--factor``, float32, whole
frame and in bands of each ``--rows``, alternating call by call ``--repeats`` times (this machine's speed drifts:
each band height is given as its CPU time over the whole frame's in the same repeat, then the median of those
ratios). Peak memory: the live tensors the forward makes (a dispatch mode tracking storages; kernels' scratch
memory left out), in float32 values per position of the 2x grid, beside the memory plan's estimate.
Also the largest difference from the whole frame. Run from the repository root::

    PYTHONPATH=src python benchmarks/bench_sesqui_bands.py --size 128x96 --factor 1.5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="128x96", help="input latent HxW")
    parser.add_argument("--factor", type=float, default=1.5, help="in [1, 2]")
    parser.add_argument("--rows", default="4,16,64", help="band heights, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from flowlift.devices import passive_thread_wait, reuse_freed_memory

    passive_thread_wait()
    reuse_freed_memory()
    import torch

    from flowlift.measure.tiled_inference import _PeakTensorMemory
    from flowlift.models.sesqui_bands import banded_peak_bytes, sesqui_banded, whole_peak_bytes
    from flowlift.models.sesqui_lsr import SesquiLSR

    h, w = (int(v) for v in args.size.lower().split("x"))
    target = (round(h * args.factor), round(w * args.factor))
    torch.manual_seed(0)
    model = SesquiLSR().eval().requires_grad_(False)
    raw = torch.randn(1, 32, h, w, generator=torch.Generator().manual_seed(1))
    runs = {"whole": lambda: model(raw, target)}
    for rows in map(int, args.rows.split(",")):
        runs[f"{rows} rows"] = lambda rows=rows: sesqui_banded(model, raw, target, rows)
    grid = 4 * h * w
    with torch.no_grad():
        expected = runs["whole"]()
        print(f"SesquiLSR {h}x{w} -> {target[0]}x{target[1]} latents, float32, {torch.get_num_threads()} threads")
        print("| run | CPU-s per repeat | / whole (median) | tracked peak | estimate | max diff |")
        print("|---|---|---|---|---|---|")
        seconds = {name: [] for name in runs}
        for repeat in range(args.repeats):
            for name, run in runs.items():
                start = time.process_time()
                run()
                seconds[name].append(time.process_time() - start)
            print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)  # how far, on stderr
        for name, run in runs.items():
            tracker = _PeakTensorMemory()
            with tracker:
                out = run()
            rows = None if name == "whole" else int(name.split()[0])
            estimate = whole_peak_bytes(1, h, w) if rows is None else banded_peak_bytes(1, h, w, target, rows)
            ratio = statistics.median(a / b for a, b in zip(seconds[name], seconds["whole"], strict=True))
            difference = float((out - expected).abs().max())
            times = ", ".join(f"{s:.2f}" for s in seconds[name])
            print(
                f"| {name} | {times} | {ratio:.2f} | {tracker.peak / 4 / grid:.0f} | {estimate / 4 / grid:.0f} | "
                f"{difference:.1e} |"
            )


if __name__ == "__main__":
    main()
