"""How right "about N s left" is: every estimate of a real upscale against the time it really took.

Runs the per-image step every door runs (``upscale_file`` with the pipeline's stage and decode-tile callbacks
through :class:`~flowlift.upscale.stages.UpscaleStages` into a :class:`~flowlift.progress.RunProgress`, whose time
left is calibrated on that run alone) on one photo, with a random full-size Flow Upscaler checkpoint (time does not
depend on weight values) and the real TAEF2 from ``../shared/models/taef2``, planned as the command plans it
(``OutputSizes``: any ``--scale`` in [1, 8], e.g. 3 is two passes resampled down). The request runs twice (the first
also pays the one-off kernel set-up, as a first request does); a poller reads the estimate every 0.1 s. The table
gives the worst factor between the estimate and the truth (1.0 is exact) over the whole run once an estimate exists,
and over its last quarter, and the stage times. ``--json`` prints the measured seconds per megapixel (what
``flowlift.upscale.stages.SECONDS_PER_MP`` holds).

    PYTHONPATH=src python benchmarks/bench_app_eta.py [--image PATH] [--scale 2|3|4...] [--device cpu] [--dtype auto]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_first_run import random_checkpoint  # noqa: E402


def run_request(pipeline, settings, sizes, source, out, hashes):  # noqa: ANN001, ANN201
    """One upload as the doors run it (``sizes``: the plan's ``OutputSizes``); returns (polls [(seconds since start,
    time left or None)], total, stage seconds by kind)."""
    import threading

    from flowlift.progress import RunProgress
    from flowlift.upscale.outputs import upscale_file
    from flowlift.upscale.stages import UpscaleStages

    run = RunProgress()
    polls: list[tuple[float, float | None]] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(0.1):
            state = run.state()
            polls.append((state.elapsed, state.left))

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    stages = UpscaleStages(run)
    with stages.image(sizes.planned_image(source)):
        upscale_file(
            pipeline,
            settings,
            sizes.passes_for(source),
            source,
            out,
            hashes,
            stages.stage,
            stages.decode_tile,
            sizes.resample_to(source),
            sizes.asked,
        )
    stop.set()
    poller.join()
    total = run.state().elapsed
    seconds: dict[str, float] = {}
    for stage in run.stages:
        if stage.started is not None and stage.ended is not None:
            seconds[stage.kind] = seconds.get(stage.kind, 0.0) + stage.ended - stage.started
    return polls, total, seconds


def worst_factor(polls: list[tuple[float, float | None]], total: float, since: float = 0.0) -> float:
    """The largest max(estimate / truth, truth / estimate) over the polls from ``since`` of the run on that show a
    time left (the last half second, writing the file, left out: nothing is left to say)."""
    worst = 1.0
    for elapsed, estimate in polls:
        truth = total - elapsed
        if estimate is None or truth <= 0.5 or elapsed < since * total:
            continue
        worst = max(worst, estimate / truth, truth / max(estimate, 1e-9))
    return worst


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", default=os.environ.get("FLOWLIFT_SHARED", str(ROOT.parent / "shared")))
    parser.add_argument("--image", default=None, help="default: the 1024x693 photo Picture_0B")
    parser.add_argument("--scale", type=float, default=2.0, help="any factor in [1, 8] (3: two passes, resampled)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", action="store_true", help="print the measured seconds per megapixel")
    args = parser.parse_args()
    import torch

    from flowlift.devices import resolve_device_dtype
    from flowlift.upscale.asked_size import AskedSize
    from flowlift.upscale.output_sizes import OutputSizes
    from flowlift.upscale.outputs import UpscaleSettings, model_hashes
    from flowlift.upscale.pipeline import FlowUpscalerPipeline

    shared = Path(args.shared)
    source = Path(args.image or shared / "images" / "photos" / "Picture_0B_by_freespace.png")
    work = Path(tempfile.mkdtemp(prefix="flowlift-eta-"))
    weights = random_checkpoint(Path(tempfile.gettempdir()) / "flowlift-first-run")
    device, dtype = resolve_device_dtype(args.device, args.dtype, cpu_bf16=True)  # the app's rule for auto
    vae = str(shared / "models" / "taef2")
    pipeline = FlowUpscalerPipeline(str(weights), vae, device=device, dtype=dtype)
    settings = UpscaleSettings(seed=0, vae=vae, upscaler=str(weights))
    hashes = model_hashes(pipeline)
    sizes = OutputSizes(AskedSize(scale=args.scale), "pad")
    rows = []
    for label in ("first", "second"):
        polls, total, seconds = run_request(pipeline, settings, sizes, source, work / f"{label}.png", hashes)
        rows.append((label, worst_factor(polls, total), worst_factor(polls, total, 0.75), total, seconds))
        print(f"  {label} request: {total:.1f} s", file=sys.stderr, flush=True)  # how far, when stdout is a file
    cpu = cpu_model()
    print(
        f"{source.name} x{args.scale:g}, {device} {str(dtype).removeprefix('torch.')}, TAEF2, random full-size UNet, "
        f"{os.cpu_count()} CPUs ({cpu}), torch {torch.__version__}"
    )
    print(
        "| request | worst estimate / truth | in the last quarter | total | encode | passes | decode | colour fix "
        "| writing |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for label, worst, last, total, seconds in rows:
        cells = " | ".join(f"{seconds.get(k, 0.0):.1f} s" for k in ("encode", "pass", "decode", "color fix", "writing"))
        print(f"| {label} | {worst:.2f}x | {last:.2f}x | {total:.1f} s | {cells} |")
    if args.json:
        # the megapixels each stage kind makes (the colour fix's and the writing's: the result's; an asked size's
        # resample is timed within the colour fix, so its rate is SECONDS_PER_MP's only for a power of two)
        planned = sizes.planned_image(source)
        inputs, result = planned.input_megapixels, planned.output_megapixels
        produced = {
            "encode": inputs,
            "pass": sum(4.0**i * inputs for i in range(1, planned.passes + 1)),
            "decode": 4.0**planned.passes * inputs,
            "color fix": result,
            "writing": result,
        }
        print(json.dumps({kind: round(rows[-1][4].get(kind, 0.0) / mp, 4) for kind, mp in produced.items()}, indent=1))


if __name__ == "__main__":
    main()
