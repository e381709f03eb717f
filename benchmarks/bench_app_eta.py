"""How right the web app's "about N s left" is: every estimate of a real upscale against the time it really took.

Runs the app's own per-upload step (the pipeline's stage and decode-tile callbacks through
:class:`~flowlift.app.progress.UpscaleProgress` and :class:`~flowlift.app.progress.EtaProgress`, then
``upscale_file``) on one photo, with a random full-size Flow Upscaler checkpoint (time does not depend on
weight values) and the real TAEF2 from ``../shared/models/taef2``. Each request is run three times, weighed
three ways, side by side:

- ``fixed``: the stage model the app had before the measured costs (encode 4, pass 1, decode 1, colour fix
  and saving 0.1 per pixel);
- ``measured``: :data:`~flowlift.app.progress.DEFAULT_SECONDS_PER_MP`, the measured table the app starts from;
- ``learned``: the costs after the app has seen one request of its own (:meth:`StageCosts.learn`).

For every report from 2% of the work on, the estimate ``elapsed * (1 - f) / f`` is compared with the time
that was really left; the table gives the worst factor between the two (1.0 is exact) and the stage times.
``--json`` prints the measured seconds per megapixel (what DEFAULT_SECONDS_PER_MP holds).

    PYTHONPATH=src python benchmarks/bench_app_eta.py [--image PATH] [--scale 2] [--device cpu] [--dtype auto]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_first_run import random_checkpoint  # noqa: E402

#: The app's stage model before this table (relative cost per pixel).
FIXED_MODEL = {"encode": 4.0, "pass": 1.0, "decode": 1.0, "color fix": 0.1, "saving": 0.1}


def run_request(pipeline, settings, passes, source, out, hashes, costs):  # noqa: ANN001, ANN201
    """One upload as the app runs it; returns (reports [(seconds since start, time left shown or None)], total,
    stage seconds)."""
    from flowlift.app.progress import EtaProgress, UpscaleProgress
    from flowlift.files.images import image_size
    from flowlift.upscale.outputs import upscale_file

    reports: list[tuple[float, float | None]] = []
    started = time.monotonic()
    eta = EtaProgress(lambda _fraction, _text: reports.append((time.monotonic() - started, eta.left)))
    width, height = image_size(source)
    stages = UpscaleProgress(eta, source.name, passes, costs=costs, input_megapixels=width * height / 1e6)
    stages.start()
    upscale_file(pipeline, settings, passes, source, out, hashes, stages.stage, stages.decode_tile)
    stages.finish()
    return reports, time.monotonic() - started, stages.seconds


def worst_factor(reports: list[tuple[float, float | None]], total: float) -> float:
    """The largest max(estimate / truth, truth / estimate) over the reports that show a time left."""
    worst = 1.0
    for elapsed, estimate in reports:
        truth = total - elapsed
        if estimate is None or truth <= 0.5:  # the last half second is saving the file: nothing left to say
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
    parser.add_argument("--scale", type=int, default=2, choices=(2, 4, 8))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", action="store_true", help="print the measured seconds per megapixel")
    args = parser.parse_args()
    import torch
    from PIL import Image

    from flowlift.app.progress import StageCosts, produced_megapixels
    from flowlift.devices import resolve_device_dtype
    from flowlift.limits import passes_for_scale
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
    passes = passes_for_scale(args.scale)
    width, height = Image.open(source).size
    megapixels = width * height / 1e6
    learned = StageCosts()  # what the app knows after its first request (that of the "measured" row)
    rows = []
    # The measured table goes first: its request also pays the first call's one-off costs, as an app's first does.
    for label, costs in (("measured", StageCosts()), ("fixed", StageCosts(FIXED_MODEL)), ("learned", learned)):
        reports, total, seconds = run_request(pipeline, settings, passes, source, work / f"{label}.png", hashes,
                                              costs)  # fmt: skip
        if label == "measured":  # the app learns from its first request; the third row uses what it learned
            learned.learn(seconds, produced_megapixels(passes, megapixels))
        rows.append((label, worst_factor(reports, total), total, seconds))
    cpu = cpu_model()
    print(f"{source.name} x{args.scale}, {device} {str(dtype).removeprefix('torch.')}, TAEF2, random full-size UNet, "
          f"{os.cpu_count()} CPUs ({cpu}), torch {torch.__version__}")  # fmt: skip
    print("| weights | worst estimate / truth, from 2% | request | encode | passes | decode | colour fix | saving |")
    print("|---|---|---|---|---|---|---|---|")
    for label, worst, total, seconds in rows:
        cells = " | ".join(f"{seconds.get(k, 0.0):.1f} s" for k in ("encode", "pass", "decode", "color fix", "saving"))
        print(f"| {label} | {worst:.2f}x | {total:.1f} s | {cells} |")
    if args.json:
        produced = produced_megapixels(passes, megapixels)
        print(json.dumps({kind: round(rows[0][3][kind] / produced[kind], 4) for kind in produced}, indent=1))


if __name__ == "__main__":
    main()
