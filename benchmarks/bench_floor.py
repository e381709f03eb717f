"""The first command against its FLOP floor: counted FLOPs, CPU time and the share of the measured peak, per stage.

Issue 47. Each variant runs ``flowlift upscale IMAGE --scale 4`` as the command line does, in a fresh interpreter,
with timers and FLOP counters wrapped around its stages from outside (the command's own code runs unchanged):

- **FLOPs** counted at every ``F.conv2d``, ``F.linear``, ``F.scaled_dot_product_attention`` and ``torch.bmm``
  call and every fused convolution (``torch.ops.mkldnn._convolution_pointwise`` and its in-place form, as
  ``F.conv2d``) (a convolution is ``2 * output elements * in-channels-per-group * kh * kw``; a linear layer
  ``2 * output elements * in-features``; attention ``2 * B * heads * L * S * (E + Ev)``; a batched product
  ``2 * b * n * m * k``): the models' multiply-adds, what the matrix units do; element-wise work (norms,
  activations, the colour fix) counts zero.
- **CPU time** of each stage (``time.process_time``: user + system of every thread of the process, which a
  loaded machine inflates far less than the wall time), exclusive of the stages called inside it; the whole
  command's is the child's ``getrusage`` (interpreter start-up included).
- **The peak**: a calibration kernel in the same run, alternating with the commands: the UNet's main convolution
  (384 -> 384 channels, 3x3, on a 64x96 map, channels-last) in bfloat16 and in float32, timed the same way.
  The floor is the counted FLOPs at the peak of the dtype the command runs in (``--dtype auto``: bfloat16 on a CPU
  with native bf16, else float32), in CPU-seconds; a stage's "% of peak" is its GFLOP per
  CPU-second over the peak's. Where the machine's speed drifts between commands (a shared host), each run's
  own ratio is also given: its CPU time over the floor at the mean of the two calibrations either side of it;
  and Mage-VAE's CPU time over TAEF2's repeat by repeat, the two commands running next to each other.

Variants: ``--vae taef2`` (the real TAEF2 of ``../shared/models/taef2``) and ``--vae mage`` (a random full-size
Mage-VAE in the released layout), on the whole kodim23 768x512 at 4x (the README's first command) and a 256x256
crop of it at 2x (256² -> 512²), with a random full-size Flow Upscaler UNet (seed 0); the command names the VAE
and takes the default upscaler, all three from a private hub cache laid out as huggingface_hub leaves a download
(``bench_first_run.hub_cache``; ``--weights paths`` gives the same files as local paths instead).
A peer row: Real-ESRGAN's RRDBNet x4 (23 RRDB blocks, 64 features, growth 32: 16.7M parameters, the released x4plus
size, random weights), written here from its published description, on the same 768x512 image (channels-last, whole
frame, in the commands' dtype), its FLOPs counted the same way. Every child runs with torch's threads waiting
passively, as the command line sets it (:func:`flowlift.devices.passive_thread_wait`); ``--env
OMP_WAIT_POLICY=ACTIVE`` adds libgomp's spinning.

    PYTHONPATH=src python benchmarks/bench_floor.py --repeats 1
    PYTHONPATH=src python benchmarks/bench_floor.py --vaes taef2 --sizes 768x512 --no-peer --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_first_run import ROOT, SRC, add_weights_argument, cpu_name, model_arguments  # noqa: E402

# -- counters (in the child) ------------------------------------------------------------------------------

STATE: dict = {"stage": "start-up and imports", "since": 0.0, "cpu": {}, "flop": {}, "calls": {}}


def _count(flop: float) -> None:
    STATE["flop"][STATE["stage"]] = STATE["flop"].get(STATE["stage"], 0.0) + flop


def install_flop_counters() -> None:
    """Wrap ``F.conv2d``, ``F.linear``, ``F.scaled_dot_product_attention``, oneDNN's fused convolutions and
    ``torch.bmm`` (looked up at call time by torch's modules and flowlift's) to add each call's FLOPs to the
    current stage."""
    import torch.nn.functional as F

    conv2d, linear, sdpa = F.conv2d, F.linear, F.scaled_dot_product_attention

    def counted_conv2d(input, weight, *args, **kwargs):
        out = conv2d(input, weight, *args, **kwargs)
        _count(2.0 * out.numel() * weight.shape[1] * weight.shape[2] * weight.shape[3])
        return out

    def counted_linear(input, weight, *args, **kwargs):
        out = linear(input, weight, *args, **kwargs)
        _count(2.0 * out.numel() * weight.shape[1])
        return out

    def counted_sdpa(q, k, v, *args, **kwargs):
        out = sdpa(q, k, v, *args, **kwargs)
        batch = q.numel() // (q.shape[-2] * q.shape[-1])
        _count(2.0 * batch * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1]))
        return out

    F.conv2d, F.linear, F.scaled_dot_product_attention = counted_conv2d, counted_linear, counted_sdpa
    _count_fused_convs()
    _count_bmm()


def _count_bmm() -> None:
    """``torch.bmm`` (Mage-VAE's bf16 window attention computes its scores and weighted sums with it): ``2 * b *
    n * m * k`` for (b, n, k) @ (b, k, m)."""
    import torch

    bmm = torch.bmm

    def counted_bmm(a, b, *args, **kwargs):
        out = bmm(a, b, *args, **kwargs)
        _count(2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2])
        return out

    torch.bmm = counted_bmm


class _CountedPointwise:
    """``torch.ops.mkldnn._convolution_pointwise`` (and its ``.binary``: flowlift.models.fused_conv's convs
    with their activation and add) with each call's FLOPs added to the current stage, as ``F.conv2d``'s."""

    def __init__(self, packet) -> None:
        self.packet = packet

    @staticmethod
    def _counted(out, weight):
        _count(2.0 * out.numel() * weight.shape[1] * weight.shape[2] * weight.shape[3])
        return out

    def __call__(self, input, weight, *args):
        return self._counted(self.packet(input, weight, *args), weight)

    def binary(self, input, other, weight, *args):
        return self._counted(self.packet.binary(input, other, weight, *args), weight)

    def __getattr__(self, name):
        return getattr(self.packet, name)


class _CountedPointwiseInPlace(_CountedPointwise):
    """``torch.ops.mkldnn._convolution_pointwise_`` (``.binary(other, input, weight, ...)``: the add written over
    ``other``, flowlift.models.taef2_layers.conv_add_relu_into) counted alike."""

    def binary(self, other, input, weight, *args):
        return self._counted(self.packet.binary(other, input, weight, *args), weight)


def _count_fused_convs() -> None:
    import torch

    for name, counted in (
        ("_convolution_pointwise", _CountedPointwise),
        ("_convolution_pointwise_", _CountedPointwiseInPlace),
    ):
        op = getattr(torch.ops.mkldnn, name, None)
        if op is not None and not isinstance(op, _CountedPointwise):
            setattr(torch.ops.mkldnn, name, counted(op))


def _switch(stage: str) -> str:
    """Book the CPU time since the last switch to the current stage; make ``stage`` current; return the old one."""
    now = time.process_time()
    old = STATE["stage"]
    STATE["cpu"][old] = STATE["cpu"].get(old, 0.0) + now - STATE["since"]
    STATE["since"] = now
    STATE["stage"] = stage
    return old


def staged(name, fn, numbered: bool = False):
    """``fn`` with its CPU time and FLOPs booked to ``name`` (``name N`` for the N-th call when ``numbered``)."""

    def wrapper(*args, **kwargs):
        STATE["calls"][name] = STATE["calls"].get(name, 0) + 1
        outer = _switch(f"{name} {STATE['calls'][name]}" if numbered else name)
        try:
            return fn(*args, **kwargs)
        finally:
            _switch(outer)

    return wrapper


def command_child(argv: list[str]) -> None:
    """Run ``flowlift`` with ``argv`` in this process, its stages booked; print the table as JSON."""
    import gc

    from flowlift.devices import passive_thread_wait

    passive_thread_wait()  # as cli.main() does when it is the process, before torch is imported below
    gc.disable()  # as cli.main() does until torch is imported (then it freezes what was imported, and turns it on)
    import flowlift.commands.cli as cli
    import flowlift.files.image_outputs as image_outputs
    import flowlift.files.images as images
    import flowlift.models.upscaler_unet as unet
    import flowlift.models.vae as vae
    import flowlift.upscale.chunked.executor as executor
    import flowlift.upscale.image_steps as image_steps
    import flowlift.upscale.outputs as outputs
    import flowlift.upscale.pipeline as pipeline

    install_flop_counters()
    unet.FlowUpscalerUNet.forward = staged("UNet pass", unet.FlowUpscalerUNet.forward, numbered=True)
    # A pass too large for one forward (float32's second pass) runs strip by strip, never calling ``forward``.
    executor.ChunkedExecutor.__call__ = staged("UNet pass", executor.ChunkedExecutor.__call__, numbered=True)
    for cls in (vae.TAEF2VAE, vae.MageVAE):
        cls.encode = staged("encode", cls.encode)
        cls.decode = staged("decode", cls.decode)
    pipeline.latent_lowband_transplant = staged("stage 1 colour fix", pipeline.latent_lowband_transplant)
    image_steps.lab_lowband_transplant = staged("stage 2 colour fix", image_steps.lab_lowband_transplant)
    pipeline.FlowUpscalerPipeline.__init__ = staged("loading weights", pipeline.FlowUpscalerPipeline.__init__)
    outputs.model_hashes = staged("weight hashes", outputs.model_hashes)
    outputs.read_source = staged("reading the input", outputs.read_source)
    images.tensor_to_pil = staged("to 8-bit image", images.tensor_to_pil)
    image_outputs.save_image_atomic = staged("PNG writing", image_outputs.save_image_atomic)
    _switch("the command's other work")
    sys.argv = ["flowlift", *argv]
    code = cli.main()  # as the command line calls it: the process is the command's own
    _switch("the command's other work")
    print("FLOOR " + json.dumps({"cpu": STATE["cpu"], "flop": STATE["flop"]}))
    sys.exit(code)


# -- the peak and the peer (in children) ------------------------------------------------------------------


def calibration_child(seconds: float) -> None:
    """GFLOP per CPU-second of the UNet's main convolution (384 -> 384, 3x3, 64x96), bfloat16 and float32."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    rates = {}
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(1, 384, 64, 96, dtype=dtype).contiguous(memory_format=torch.channels_last)
        w = (torch.randn(384, 384, 3, 3) * 0.02).to(dtype).contiguous(memory_format=torch.channels_last)
        flop = 2.0 * x.numel() * 384 * 9
        with torch.no_grad():
            F.conv2d(x, w, padding=1)  # first call: oneDNN's primitive is made
            calls, start = 0, time.process_time()
            while time.process_time() - start < seconds:
                F.conv2d(x, w, padding=1)
                calls += 1
            rates[str(dtype).removeprefix("torch.")] = calls * flop / (time.process_time() - start) / 1e9
    print("PEAK " + json.dumps(rates))


def rrdbnet_x4():
    """Real-ESRGAN's RRDBNet x4 generator (ESRGAN, Wang et al. 2018): 23 residual-in-residual dense blocks of three
    5-convolution dense blocks (64 features, growth 32, residual scale 0.2), two nearest-2x + conv upsamples,
    a 3x3 conv and the output conv, LeakyReLU(0.2). 16.7M parameters."""
    import torch
    from torch import nn

    act = nn.LeakyReLU(0.2, inplace=True)

    class Dense(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.convs = nn.ModuleList(nn.Conv2d(64 + 32 * i, 32 if i < 4 else 64, 3, padding=1) for i in range(5))

        def forward(self, x):
            features = [x]
            for i, conv in enumerate(self.convs):
                y = conv(torch.cat(features, 1))
                if i < 4:
                    features.append(act(y))
            return x + 0.2 * y

    class RRDB(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense = nn.Sequential(Dense(), Dense(), Dense())

        def forward(self, x):
            return x + 0.2 * self.dense(x)

    class RRDBNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv_first = nn.Conv2d(3, 64, 3, padding=1)
            self.body = nn.Sequential(*(RRDB() for _ in range(23)))
            self.conv_body = nn.Conv2d(64, 64, 3, padding=1)
            self.conv_up1 = nn.Conv2d(64, 64, 3, padding=1)
            self.conv_up2 = nn.Conv2d(64, 64, 3, padding=1)
            self.conv_hr = nn.Conv2d(64, 64, 3, padding=1)
            self.conv_last = nn.Conv2d(64, 3, 3, padding=1)

        def forward(self, x):
            feat = self.conv_first(x)
            feat = feat + self.conv_body(self.body(feat))
            for conv in (self.conv_up1, self.conv_up2):
                feat = act(conv(nn.functional.interpolate(feat, scale_factor=2, mode="nearest")))
            return self.conv_last(act(self.conv_hr(feat)))

    return RRDBNet()


def peer_child(image: str, dtype_name: str) -> None:
    """RRDBNet x4 on ``image`` (``dtype_name``, channels-last, whole frame), FLOPs counted; print JSON."""
    import numpy as np
    import torch
    from PIL import Image

    install_flop_counters()
    _switch("peer: building the model")
    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    model = rrdbnet_x4().eval().to(dtype, memory_format=torch.channels_last)
    _switch("peer: RRDBNet x4 forward")
    pixels = torch.from_numpy(np.asarray(Image.open(image).convert("RGB"))).permute(2, 0, 1)[None]
    x = (pixels.float() / 255).to(dtype).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        y = model(x).float().clamp(0, 1)
    _switch("peer: other")
    print("FLOOR " + json.dumps({"cpu": STATE["cpu"], "flop": STATE["flop"], "shape": list(y.shape)}))


# -- the parent -------------------------------------------------------------------------------------------


def run_child(argv: list[str], env: dict, tag: str) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    run = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *argv], capture_output=True, text=True, env=env
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if run.returncode != 0:
        sys.exit(f"{tag} failed ({run.returncode}): {run.stderr.strip()[-2000:]}")
    line = next(x for x in run.stdout.splitlines() if x.startswith(("FLOOR ", "PEAK ")))
    result = json.loads(line.split(" ", 1)[1])
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"  {tag}: {wall:.1f} s wall, {cpu:.1f} s CPU, load {load:.1f} -> {os.getloadavg()[0]:.1f}", flush=True)
    return {"result": result, "cpu": cpu, "wall": wall, "load": (load, os.getloadavg()[0])}


def crop_256(source: Path, work: Path) -> Path:
    from PIL import Image

    path = work / "kodim23-256.png"
    if not path.is_file():
        image = Image.open(source).convert("RGB")
        left, top = (image.width - 256) // 2, (image.height - 256) // 2
        image.crop((left, top, left + 256, top + 256)).save(path)
    return path


def summarize(runs: list[dict], peaks: list[dict], dtype: str) -> dict:
    """Median CPU time per stage, the FLOPs (the same every run), the whole process's CPU time and the floor; and
    each run's own ratio to the floor at the mean of the two calibrations around it (``run["between"]``: their
    indices in ``peaks``), which follows the machine's drift from one command to the next."""
    stages: list[str] = []
    for run in runs:
        stages += [s for s in run["result"]["cpu"] if s not in stages]
    cpu = {s: statistics.median(r["result"]["cpu"].get(s, 0.0) for r in runs) for s in stages}
    flop = runs[0]["result"]["flop"]
    total_cpu = statistics.median(r["cpu"] for r in runs)
    total_flop = sum(flop.values())
    floor = total_flop / statistics.median(p[dtype] for p in peaks) / 1e9
    ratios = []
    for run in runs:
        local_peak = statistics.mean(peaks[i][dtype] for i in run["between"])
        ratios.append(run["cpu"] / (total_flop / local_peak / 1e9))
    return {
        "cpu": cpu,
        "flop": flop,
        "total_cpu": total_cpu,
        "total_flop": total_flop,
        "floor": floor,
        "local_ratios": ratios,
    }


def paired_ratios(results: dict[str, list[dict]]) -> list[str]:
    """Mage-VAE's CPU time over TAEF2's, repeat by repeat, for each size that ran both: the two commands run next to
    each other in every repeat (the order mirrors), so each ratio sees one state of the machine."""
    lines = []
    for name, runs in results.items():
        if not name.startswith("--vae taef2, "):
            continue
        mage = results.get(name.replace("--vae taef2, ", "--vae mage, ", 1))
        if not mage:
            continue
        ratios = [m["cpu"] / t["cpu"] for m, t in zip(mage, runs, strict=True)]
        cells = ", ".join(f"{r:.2f}" for r in ratios)
        size = name.removeprefix("--vae taef2, ")
        lines.append(f"- {size}: Mage-VAE / TAEF2 CPU time {cells} (median {statistics.median(ratios):.2f})")
    return lines


def print_tables(summaries: dict[str, dict], peaks: list[dict], dtype: str) -> None:
    names = list(summaries)
    medians = {name: statistics.median(p[name] for p in peaks) for name in ("bfloat16", "float32")}
    peak = medians[dtype]
    print(
        f"\npeak (calibration, median): bfloat16 {medians['bfloat16']:.0f}, float32 {medians['float32']:.0f} "
        f"GFLOP per CPU-second; the commands run in {dtype}, their floor is at its peak\n"
    )
    print("| variant | TFLOP | CPU-s (process) | floor CPU-s | CPU / floor | CPU - floor | each run / its own floor |")
    print("|---|---|---|---|---|---|---|")
    for name, s in summaries.items():
        local = ", ".join(f"{r:.2f}x" for r in s["local_ratios"])
        print(
            f"| {name} | {s['total_flop'] / 1e12:.3f} | {s['total_cpu']:.1f} | {s['floor']:.1f} | "
            f"{s['total_cpu'] / s['floor']:.2f}x | {s['total_cpu'] - s['floor']:+.1f} | {local} |"
        )
    rows: list[str] = []
    for s in summaries.values():
        rows += [r for r in s["cpu"] if r not in rows]
    print(f"\nstage: CPU-s (GFLOP per CPU-s, % of the {dtype} peak)\n")
    print("| stage | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for row in rows:
        cells = []
        for s in summaries.values():
            cpu, flop = s["cpu"].get(row), s["flop"].get(row, 0.0)
            if cpu is None:
                cells.append("")
            elif flop:
                rate = flop / max(cpu, 1e-9) / 1e9
                cells.append(f"{cpu:.2f} ({flop / 1e12:.2f} TFLOP, {rate:.0f}, {100 * rate / peak:.0f}%)")
            else:
                cells.append(f"{cpu:.2f}")
        print(f"| {row} | " + " | ".join(cells) + " |")


def main() -> None:
    from flowlift.devices import passive_thread_wait

    passive_thread_wait()  # every child (the calibration and the peer too) runs as the command does
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return command_child(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "--calibrate":
        return calibration_child(float(sys.argv[2]))
    if len(sys.argv) > 1 and sys.argv[1] == "--peer":
        return peer_child(sys.argv[2], sys.argv[3])
    import torch

    from flowlift.devices import auto_dtype

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", default=os.environ.get("FLOWLIFT_SHARED", str(ROOT.parent / "shared")))
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / f"flowlift-first-run-{os.getuid()}"))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--vaes", default="taef2,mage", help="comma-separated: taef2, mage")
    parser.add_argument("--sizes", default="768x512,256x256", help="comma-separated: 768x512, 256x256")
    parser.add_argument("--no-peer", action="store_true", help="skip the RRDBNet x4 row")
    parser.add_argument("--calibrate-seconds", type=float, default=2.0)
    parser.add_argument("--env", metavar="VAR=VALUE", help="also run every command variant with VAR=VALUE set")
    add_weights_argument(parser)
    args = parser.parse_args()
    args.device = "cpu"
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    full = Path(args.shared) / "images" / "kodak" / "kodim23.png"
    images = {"768x512": (full, "4"), "256x256": (crop_256(full, work), "2")}  # the first command; 256² -> 512²
    base_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    # The dtype ``--dtype auto`` gives the command on this CPU (float32 without native bf16): its floor is at that
    # dtype's peak, and the peer runs in it as a user of this CPU would run it.
    dtype = str(auto_dtype(torch.device("cpu"), cpu_bf16=True)).removeprefix("torch.")
    variants: dict[str, tuple[list[str], dict]] = {}
    for size in args.sizes.split(","):
        for vae in args.vaes.split(","):
            model_args, model_env = model_arguments(vae, args)
            out = work / f"floor-{vae}-{size}.png"
            image, scale = images[size]
            argv = [
                "--child",
                "upscale",
                str(image),
                "--scale",
                scale,
                *model_args,
                "--device",
                "cpu",
                "-o",
                str(out),
                "--overwrite",
            ]
            variants[f"--vae {vae}, {size} x{scale}"] = (argv, {**base_env, **model_env})
    if args.env:
        var, _, value = args.env.partition("=")
        for name, (argv, env) in list(variants.items()):
            variants[f"{name}, {var}={value}"] = (
                [*argv[:-2], str(Path(argv[-2]).with_suffix(".env.png")), argv[-1]],
                {**env, var: value},
            )
    if not args.no_peer:
        variants[f"peer: RRDBNet x4, 768x512 ({dtype})"] = (["--peer", str(full), dtype], base_env)
    cpu_model = cpu_name()
    print(
        f"bench_floor: {os.cpu_count()} CPUs ({cpu_model}), torch threads default, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        flush=True,
    )
    results: dict[str, list[dict]] = {name: [] for name in variants}
    peaks: list[dict] = []
    loads: list[float] = []
    for repeat in range(args.repeats):
        order = list(variants) if repeat % 2 == 0 else list(reversed(variants))
        for name in order:
            peaks.append(run_child(["--calibrate", str(args.calibrate_seconds)], base_env, "calibration")["result"])
            run = run_child(variants[name][0], variants[name][1], name)
            run["between"] = (len(peaks) - 1, len(peaks))  # the calibrations just before and just after it
            loads += list(run["load"])
            results[name].append(run)
    peaks.append(run_child(["--calibrate", str(args.calibrate_seconds)], base_env, "calibration")["result"])
    rates = ", ".join(f"{p[dtype]:.0f}" for p in peaks)
    print(f"calibrations ({dtype} GFLOP per CPU-s): {rates}; load average {min(loads):.1f}-{max(loads):.1f}")
    print_tables({name: summarize(runs, peaks, dtype) for name, runs in results.items()}, peaks, dtype)
    print("\n" + "\n".join(paired_ratios(results)))


if __name__ == "__main__":
    main()
