"""The three VAEs side by side: Mage-VAE, TAEF2 and the FLUX.2 VAE — time, peak memory, MACs per pixel.

One run measures every VAE of ``--vaes`` at every size of ``--megapixels`` (square images: 1 MP =
1024x1024, 4 MP = 2048x2048, 16 MP = 4096x4096), encode and decode, with **full-size random weights**
(the released architectures, default init, seed 0: time and memory do not depend on weight values).
Each measurement runs in a fresh subprocess, so its peak RSS belongs to that one
operation; it builds the model, its input (a seeded random image, or a random normalized latent),
runs the adapter's ``encode`` / ``decode`` as the pipelines call it (``tiled=None``: each VAE's own
rule by size) ``--repeat`` times and reports the best wall time, the best process CPU time (user +
system, all threads: it moves far less than the wall time when other jobs share the machine), the
peak RSS (``VmHWM``, reset after the model is built, so the random init does not hide the
operation's own peak) and the RSS before the operation (torch + weights). A measurement that runs past
``--budget-s`` is stopped and reported as such, one whose decode flowlift's memory model
(:func:`flowlift.limits.decode_peak_bytes`) puts above ``--max-memory-gb`` is not started
(the machine is shared), and a VAE and operation not measured at one size is not tried at the larger ones.

MACs per pixel are counted, not timed: ``torch.utils.flop_counter.FlopCounterMode`` over the same
forward pass with the model and input on the ``meta`` device (no memory, no arithmetic), halved (it
counts a multiply-add as 2 FLOPs). It counts matrix products, convolutions and attention only
(norms, activations and elementwise ops are left out, as MAC counts usually do), per *image* pixel,
at each size (the FLUX.2 VAE's mid-block attention grows with the frame).

    PYTHONPATH=src python benchmarks/bench_vae.py --megapixels 1 4 16 --budget-s 300
    PYTHONPATH=src python benchmarks/bench_vae.py --tiling --sizes 1024 2048 --repeat 1   # TAEF2 full vs tiled

``--tiling`` is the older table: TAEF2 whole frame against its exact tiles (``--weights``: the real
TAEF2, ``../shared/models/taef2``). GPU rows are printed as not measured when no CUDA device is present.
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
VAES = ("mage", "taef2", "flux2")
TITLES = {"mage": "Mage-VAE", "taef2": "TAEF2", "flux2": "FLUX.2 VAE"}


# -- models (full size, random weights) ----------------------------------------------------------------


def build_adapter(name: str, dtype):
    """flowlift's adapter over a full-size, randomly initialized ``name`` VAE (seed 0), on the CPU."""
    import torch

    torch.manual_seed(0)
    if name == "taef2":
        from flowlift.models.taef2 import TAEF2
        from flowlift.models.vae import TAEF2VAE

        return TAEF2VAE(TAEF2().to(dtype=dtype))
    if name == "flux2":
        from diffusers import AutoencoderKLFlux2

        from flowlift.models.vae import Flux2VAE

        return Flux2VAE(AutoencoderKLFlux2().to(dtype=dtype))  # diffusers' defaults are the FLUX.2 VAE's
    if name == "mage":
        from flowlift.models.mage_vae import MageVAEConfig, MageVAEModel
        from flowlift.models.vae import MageVAE

        model = MageVAEModel(MageVAEConfig()).fold_t0()  # the released widths; fold in float32, as loading does
        return MageVAE(model.to(dtype=dtype))
    raise SystemExit(f"unknown VAE {name!r}; one of {', '.join(VAES)}")


def raw_passes(name: str):
    """(encode, decode, latent shape of a side) on ``meta``: the networks alone, for counting MACs."""
    import torch

    from flowlift.flux2.latents import patchify

    with torch.device("meta"):
        if name == "taef2":
            from flowlift.models.taef2 import TAEF2

            model = TAEF2()
            return model.encode_full, model.decode_full, lambda side: (1, 32, side // 8, side // 8)
        if name == "flux2":
            from diffusers import AutoencoderKLFlux2

            model = AutoencoderKLFlux2()
            return (
                lambda x: model.encode(x).latent_dist.mode(),
                lambda z: model.decode(z).sample,
                lambda side: (1, 32, side // 8, side // 8),
            )
        from flowlift.models.mage_vae import MageVAEConfig, MageVAEModel

        model = MageVAEModel(MageVAEConfig()).fold_t0()
        return model.encoder, lambda z: model.decoder(patchify(z)), lambda side: (1, 32, side // 8, side // 8)


def counted_macs(name: str, side: int) -> tuple[float, float]:
    """(encode, decode) multiply-accumulates per image pixel of a ``side`` x ``side`` frame."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    encode, decode, latent_shape = raw_passes(name)
    counts = []
    for fn, x in (
        (encode, torch.empty(1, 3, side, side, device="meta")),
        (decode, torch.empty(latent_shape(side), device="meta")),
    ):
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            fn(x)
        counts.append(counter.get_total_flops() / 2 / side**2)
    return counts[0], counts[1]


# -- one measurement (a fresh process) --------------------------------------------------------------------


def _cpu_s() -> float:
    """CPU seconds (user + system, all threads) of this process: robust to other load on the box."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def worker(args: argparse.Namespace) -> None:
    import torch

    dtype = getattr(torch, args.dtype)
    if args.weights:
        from flowlift.models.vae_loading import load_vae

        vae = load_vae(args.weights, device="cpu", dtype=dtype)
    else:
        vae = build_adapter(args.vae, dtype)
    side = args.size
    torch.manual_seed(1)
    if args.op == "encode":
        x, fn = torch.rand(1, 3, side, side), vae.encode
    else:
        x, fn = torch.randn(1, 32, side // 8, side // 8), vae.decode
    tiled = {"auto": None, "full": False, "tiled": True}[args.mode]
    base_mb = reset_peak_mb()  # building the model must not hide the operation's own peak
    times, cpu_times = [], []
    for _ in range(args.repeat):
        cpu0, start = _cpu_s(), time.perf_counter()
        out = fn(x, tiled=tiled)
        times.append(time.perf_counter() - start)
        cpu_times.append(_cpu_s() - cpu0)
        del out
    peak_mb = _status_mb("VmHWM")
    print(json.dumps({"time_s": min(times), "cpu_s": min(cpu_times), "peak_mb": peak_mb, "base_mb": base_mb}))


def _status_mb(field: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise SystemExit(f"no {field} in /proc/self/status")


def reset_peak_mb() -> float:
    """Reset this process's peak RSS (Linux: ``5`` to /proc/self/clear_refs) and return the RSS now, in MB."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    return _status_mb("VmRSS")


def measure(vae: str, size: int, op: str, args: argparse.Namespace, *, mode: str = "auto", weights: str = "") -> dict:
    """One measurement in a fresh process: its JSON, or ``{"error": why}`` (over budget, failed)."""
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--vae",
        vae,
        "--size",
        str(size),
        "--op",
        op,
        "--mode",
        mode,
        "--repeat",
        str(args.repeat),
        "--dtype",
        args.dtype,
        "--weights",
        weights,
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, timeout=args.budget_s)
    except subprocess.TimeoutExpired:
        return {"error": f"over the {args.budget_s:g} s budget"}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return {"error": f"failed: {last[:160]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the side-by-side table -------------------------------------------------------------------------------


def cpu_name() -> str:
    """The CPU's model name and its bfloat16 features (``amx_bf16``, ``avx512_bf16``) from /proc/cpuinfo."""
    name, flags = platform.processor() or "unknown CPU", []
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = [f for f in ("amx_bf16", "avx512_bf16") if f in line.split()]
    return f"{name} ({', '.join(flags) or 'no native bf16'})"


def _cell(result: dict, key: str, fmt: str) -> str:
    return format(result[key], fmt) if key in result else "–"


def estimated_peak_gb(vae: str, side: int) -> float:
    """What a ``side`` x ``side`` decode costs by flowlift's own model (flowlift.limits), tiled as each
    adapter tiles by size (TAEF2 above 1 MP, the FLUX.2 VAE above 2048 px a side, Mage-VAE not yet):
    the guard that keeps this benchmark from exhausting a shared machine. Used for encode too (the encoders
    peak lower)."""
    from flowlift.limits import decode_peak_bytes

    tiled = {"taef2": side * side > 1024 * 1024, "flux2": side > 2048, "mage": False}[vae]
    return decode_peak_bytes(vae, side, side, tiled=tiled) / 1e9


def compare(args: argparse.Namespace) -> None:
    import torch

    sides = {mp: int(round((mp * 1024 * 1024) ** 0.5)) for mp in args.megapixels}
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(
        f"# {', '.join(TITLES[v] for v in args.vaes)}: full-size random weights, {args.dtype}, CPU: "
        f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, repeat={args.repeat}, "
        f"budget {args.budget_s:g} s per measurement, {when}"
    )
    print(f"# load average at start {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("\n## MACs per image pixel (counted on the meta device)\n")
    print("| size | VAE | encode MAC/px | decode MAC/px | FLUX.2 VAE / this, encode | decode |")
    print("|---|---|---|---|---|---|")
    for mp, side in sides.items():
        macs = {vae: counted_macs(vae, side) for vae in (*args.vaes, "flux2") if vae in VAES}
        for vae in args.vaes:
            enc, dec = macs[vae]
            print(
                f"| {mp:g} MP | {TITLES[vae]} | {enc / 1e3:,.0f} K | {dec / 1e3:,.0f} K | "
                f"{macs['flux2'][0] / enc:.1f}x | {macs['flux2'][1] / dec:.1f}x |",
                flush=True,
            )
    print("\n## CPU time and memory (each a fresh process; tiled=None: every VAE's own rule by size)\n")
    print("| size | op | VAE | wall s | CPU s | CPU vs FLUX.2 VAE | peak RSS MB | RSS before MB | load avg |")
    print("|---|---|---|---|---|---|---|---|---|")
    out_of_budget: set[tuple[str, str]] = set()
    for mp, side in sides.items():
        for op in args.ops:
            row: dict[str, dict] = {}
            for vae in args.vaes:
                need_gb = estimated_peak_gb(vae, side)
                if (vae, op) in out_of_budget:
                    row[vae] = {"error": "not tried (a smaller size was not measured)"}
                elif need_gb > args.max_memory_gb:
                    row[vae] = {
                        "error": f"needs ~{need_gb:.0f} GB (flowlift's decode cost model), over "
                        f"--max-memory-gb {args.max_memory_gb:g} on this shared machine"
                    }
                else:
                    row[vae] = measure(vae, side, op, args)
                if "error" in row[vae]:
                    out_of_budget.add((vae, op))
            for vae, result in row.items():
                flux = row.get("flux2", {})
                ratio = f"{result['cpu_s'] / flux['cpu_s']:.3f}x" if "cpu_s" in result and "cpu_s" in flux else "–"
                if "error" in result:
                    print(f"| {mp:g} MP | {op} | {TITLES[vae]} | not measured: {result['error']} | | | | | |")
                    continue
                print(
                    f"| {mp:g} MP | {op} | {TITLES[vae]} | {_cell(result, 'time_s', '.1f')} | "
                    f"{_cell(result, 'cpu_s', '.1f')} | {ratio} | {_cell(result, 'peak_mb', '.0f')} | "
                    f"{_cell(result, 'base_mb', '.0f')} | {os.getloadavg()[0]:.1f} |",
                    flush=True,
                )
    if not torch.cuda.is_available():
        for vae in args.vaes:
            print(
                f"| GPU | encode, decode | {TITLES[vae]} | not measured yet (no CUDA device on this machine) "
                "| | | | | |"
            )
    print(f"\n# load average at end {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


def tiling_table(args: argparse.Namespace) -> None:
    """The older table: TAEF2 (real weights) whole frame against its exact tiles."""
    import torch

    print(
        f"# TAEF2 {args.dtype} on CPU ({os.cpu_count()} cores, torch {torch.__version__}, {cpu_name()}), "
        f"repeat={args.repeat}, load average at start {os.getloadavg()[0]:.1f}"
    )
    print(
        "| size | op | full wall s | tiled wall s | full CPU s | tiled CPU s | tiled/full CPU "
        "| full peak MB | tiled peak MB | tiled/full peak |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes:
        for op in args.ops:
            full = measure("taef2", size, op, args, mode="full", weights=args.weights)
            tiled = measure("taef2", size, op, args, mode="tiled", weights=args.weights)
            if "error" in full or "error" in tiled:
                print(f"| {size} | {op} | {full.get('error', '')} {tiled.get('error', '')} |")
                continue
            print(
                f"| {size} | {op} | {full['time_s']:.1f} | {tiled['time_s']:.1f} | {full['cpu_s']:.1f} | "
                f"{tiled['cpu_s']:.1f} | {tiled['cpu_s'] / full['cpu_s']:.2f}x | {full['peak_mb']:.0f} | "
                f"{tiled['peak_mb']:.0f} | {tiled['peak_mb'] / full['peak_mb']:.2f}x |",
                flush=True,
            )
    print(f"# load average at end {os.getloadavg()[0]:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vaes", nargs="+", default=list(VAES), choices=VAES)
    parser.add_argument("--megapixels", type=float, nargs="+", default=[1, 4, 16])
    parser.add_argument("--ops", nargs="+", default=["encode", "decode"], choices=["encode", "decode"])
    parser.add_argument("--repeat", type=int, default=1, help="runs per measurement (best time is kept)")
    parser.add_argument("--budget-s", type=float, default=300.0, help="stop a measurement after this long")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--max-memory-gb", type=float, default=8.0, help="skip a measurement whose decode is estimated to need more"
    )
    parser.add_argument("--tiling", action="store_true", help="the TAEF2 full-vs-tiled table instead")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048], help="--tiling: image sides")
    parser.add_argument("--weights", default=str(DEFAULT_WEIGHTS), help="--tiling: TAEF2 weights")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--vae", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--op", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
    elif args.tiling:
        tiling_table(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
