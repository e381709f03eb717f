"""How long the README's first command takes: ``flowlift upscale kodim23.png --scale 4 --vae taef2``.

The released weights are not needed for a timing (time does not depend on weight values): a random
full-size Flow Upscaler checkpoint (the released architecture, default init, fixed seed) is written
once, and the command runs as a user runs it, in a fresh process, with the real TAEF2 from
``../shared/models/taef2``, both in a private Hugging Face cache under ``--work`` laid out as a download leaves
them (:func:`hub_cache`, ``HF_HUB_OFFLINE=1``; ``--weights paths`` passes the files as local paths instead).
Reports the wall time of the whole command (start-up, loading, two passes, decode, both colour stages, writing
the PNG), its CPU time (user + system, which a busy machine inflates far less than the wall time) and the load
average while it ran.

``--vae mage`` runs ``--vae mage`` (a random full-size Mage-VAE in the released single-file layout, in the same
cache); ``--vae taef2`` is the default. ``--baseline-vae VAE`` also runs this tree with the other VAE,
alternating, so the two VAEs' first commands are measured side by side.

``--baseline REV`` runs the same command from revision REV (its ``src/`` exported with ``git archive``),
``--baseline-dtype DTYPE`` this tree with ``--dtype DTYPE`` and ``--baseline-env VAR=VALUE`` this tree with
one more environment variable (e.g. ``FLOWLIFT_REUSE_FREED_MEMORY=0``: glibc's own allocation policy),
alternating with this tree's default, so a loaded machine slows every variant alike; the ratios of the
medians are the result, and every output is compared with the first variant's pixels (max difference in
1/255 steps). ``--breakdown`` runs each command in-process in a fresh interpreter with timers around each
stage (imports, loading, encode, each UNet pass, stage 1, decode, stage 2, the PNG) and prints where the
time goes.

    PYTHONPATH=src python benchmarks/bench_first_run.py [--device cpu] [--repeats 1]
    PYTHONPATH=src python benchmarks/bench_first_run.py --baseline ade227f --baseline-dtype float32 \
        --repeats 3 --breakdown
    PYTHONPATH=src python benchmarks/bench_first_run.py --baseline-env FLOWLIFT_REUSE_FREED_MEMORY=0 --repeats 2
    PYTHONPATH=src python benchmarks/bench_first_run.py --vae mage --baseline-vae taef2 --repeats 1

The system time (the kernel's share of the CPU time: page faults, zeroing fresh pages) is printed beside it.
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


def random_mage_file(folder: Path) -> Path:
    """A random full-size Mage-VAE in the released layout and size, ``folder/mage_vae.safetensors``: its encoder and
    decoder, and the FLUX.2-VAE encoder side the released file also holds and flowlift skips
    (``pipeline.y_embedder.encoder.*``: the FLUX.2 VAE's encoder, ``quant_conv`` and ``bn``, 111 tensors of
    34.4M parameters, as diffusers' ``AutoencoderKLFlux2`` makes them), so that reading it costs what the released
    file's does (688 MB in float32)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from flowlift.models.mage_vae import MageVAEConfig, MageVAEModel
    from flowlift.models.mage_vae_files import MAGE_DECODER_PREFIX, MAGE_ENCODER_PREFIX, MAGE_SKIPPED_PREFIXES

    target = folder / "mage_vae.safetensors"
    if target.is_file():
        with safe_open(str(target), "pt") as handle:
            if any(k.startswith(MAGE_SKIPPED_PREFIXES[0]) for k in handle.keys()):
                return target
    torch.manual_seed(0)
    state = MageVAEModel(MageVAEConfig()).state_dict()  # unfolded, as released
    prefixes = {"encoder": MAGE_ENCODER_PREFIX, "decoder": MAGE_DECODER_PREFIX}
    released = {prefixes[k.split(".", 1)[0]] + k.split(".", 1)[1]: v.contiguous() for k, v in state.items()}
    released.update(_flux2_encoder_side(MAGE_SKIPPED_PREFIXES[0]))
    save_file(released, str(target.with_suffix(".partial")))
    target.with_suffix(".partial").rename(target)
    return target


def hub_cache(folder: Path, shared: Path) -> Path:
    """A private Hugging Face cache, ``folder/hub``, holding the first command's three models where a user's
    downloads put them: the random Flow Upscaler (:func:`random_checkpoint`) as ``TensorForger/FlowUpscaler``,
    the real TAEF2 as ``madebyollin/taef2`` and the random Mage-VAE (:func:`random_mage_file`) under Mage-VAE's
    first repository. Laid out as huggingface_hub writes a download: each file a blob named by its SHA-256 (the
    etag of an LFS file), hard-linked to the file here, and a snapshot entry linking to it."""
    import hashlib

    from flowlift.models.vae_names import NAMED_MAGE, NAMED_TAEF2
    from flowlift.upscale.loading import DEFAULT_UPSCALER, UPSCALER_WEIGHTS_NAME

    cache = folder / "hub"
    taef2 = shared / "models" / "taef2"
    files = {
        (DEFAULT_UPSCALER, UPSCALER_WEIGHTS_NAME): random_checkpoint(folder),
        (NAMED_TAEF2.repos[0], "taef2_encoder.pth"): taef2 / "taef2_encoder.pth",
        (NAMED_TAEF2.repos[0], "taef2_decoder.pth"): taef2 / "taef2_decoder.pth",
        (NAMED_MAGE.repos[0], "vae/mage_vae.safetensors"): random_mage_file(folder),
    }
    commit = "0" * 40
    for (repo_id, name), source in files.items():
        repo = cache / f"models--{repo_id.replace('/', '--')}"
        entry = repo / "snapshots" / commit / name
        if entry.is_symlink() and entry.resolve().is_file() and entry.resolve().stat().st_ino == source.stat().st_ino:
            continue
        with open(source, "rb") as handle:
            blob = repo / "blobs" / hashlib.file_digest(handle, "sha256").hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.unlink(missing_ok=True)
        try:
            os.link(source, blob)
        except OSError:  # another file system (the shared folder): a copy
            blob.write_bytes(source.read_bytes())
        entry.parent.mkdir(parents=True, exist_ok=True)
        entry.unlink(missing_ok=True)
        entry.symlink_to(os.path.relpath(blob, entry.parent))
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
    return cache


def _flux2_encoder_side(prefix: str) -> dict:
    """Random float32 tensors shaped as the FLUX.2 VAE's encoder, ``quant_conv`` and ``bn`` (diffusers' names)."""
    import torch
    from diffusers import AutoencoderKLFlux2

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoencoderKLFlux2().state_dict().items() if not k.startswith("decoder.")}
    shapes = {k: v for k, v in shapes.items() if not k.startswith("post_quant_conv.")}
    return {prefix + k: torch.randn(shape) * 0.02 for k, shape in shapes.items()}


def add_weights_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--weights",
        choices=["hub", "paths"],
        default="hub",
        help="the models from a private hub cache as downloads leave them (default), or as local paths",
    )


def model_arguments(vae: str, args) -> tuple[list[str], dict[str, str]]:
    """The command's model arguments and the environment they need. ``--weights hub`` (the default): ``--vae
    taef2`` or ``--vae mage`` and the default upscaler, all three from :func:`hub_cache` (``HF_HUB_OFFLINE=1``), as
    a user's first command finds them after downloading; ``--weights paths``: the same files as local paths (the
    real TAEF2 folder, the Mage-VAE and UNet files under ``--work``), which flowlift reads and hashes itself."""
    work, shared = Path(args.work), Path(args.shared)
    if args.weights == "hub":
        return ["--vae", vae], {"HF_HUB_CACHE": str(hub_cache(work, shared)), "HF_HUB_OFFLINE": "1"}
    spec = shared / "models" / "taef2" if vae == "taef2" else random_mage_file(work)
    return ["--vae", str(spec), "--upscaler", str(random_checkpoint(work))], {}


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (every CPU figure names its CPU), else ``unknown CPU``."""
    try:
        with open("/proc/cpuinfo") as handle:
            return next(
                (line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), "unknown CPU"
            )
    except OSError:
        return "unknown CPU"


def exported_source(revision: str, work: Path) -> Path:
    """``src/`` of ``revision`` (``git archive``), extracted once under ``work``."""
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", revision], capture_output=True, text=True, check=True
    ).stdout.strip()
    folder = work / f"rev-{commit[:12]}"
    if not (folder / "src" / "flowlift").is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "src"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder / "src"


# -- the in-process breakdown (runs in the child interpreter) ---------------------------------------------


def _timed(table: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            table.setdefault(name, []).append(time.perf_counter() - start)

    return wrapper


def breakdown_child(argv: list[str]) -> None:
    """Run ``flowlift`` with ``argv`` in this process, timers around each stage; print them as JSON."""
    started = time.perf_counter()
    import torch

    import flowlift.commands.cli as cli
    import flowlift.files.image_outputs as image_outputs
    import flowlift.files.images as images
    import flowlift.models.upscaler_unet as unet
    import flowlift.models.vae as vae
    import flowlift.upscale.chunked.executor as executor
    import flowlift.upscale.image_steps as image_steps
    import flowlift.upscale.outputs as outputs
    import flowlift.upscale.pipeline as pipeline

    table: dict[str, list[float]] = {"start-up and imports": [time.perf_counter() - started]}
    unet.FlowUpscalerUNet.forward = _timed(table, "UNet pass", unet.FlowUpscalerUNet.forward)
    executor.ChunkedExecutor.__call__ = _timed(table, "UNet pass (chunked)", executor.ChunkedExecutor.__call__)
    vae.TAEF2VAE.encode = _timed(table, "encode (TAEF2)", vae.TAEF2VAE.encode)
    vae.TAEF2VAE.decode = _timed(table, "decode (TAEF2)", vae.TAEF2VAE.decode)
    pipeline.latent_lowband_transplant = _timed(table, "stage 1", pipeline.latent_lowband_transplant)
    image_steps.lab_lowband_transplant = _timed(table, "stage 2", image_steps.lab_lowband_transplant)
    pipeline.FlowUpscalerPipeline.__init__ = _timed(table, "loading weights", pipeline.FlowUpscalerPipeline.__init__)
    outputs.model_hashes = _timed(table, "weight hashes", outputs.model_hashes)
    images.tensor_to_pil = _timed(table, "to 8-bit image", images.tensor_to_pil)
    image_outputs.save_image_atomic = _timed(table, "PNG writing", image_outputs.save_image_atomic)
    outputs.read_source = _timed(table, "reading the input", outputs.read_source)
    start = time.perf_counter()
    sys.argv = ["flowlift", *argv]
    code = cli.main()  # as the command line calls it: the process is the command's own
    table["command total"] = [time.perf_counter() - start]
    table["threads"] = [float(torch.get_num_threads())]
    print("BREAKDOWN " + json.dumps(table))
    sys.exit(code)


# -- the parent -----------------------------------------------------------------------------------------


def run_variant(name: str, src: Path, extra: list[str], env_extra: dict, args, image: Path, out: Path) -> dict:
    env_extra = dict(env_extra)  # the variant's own dict stays whole for the next repeat
    model_args, model_env = model_arguments(env_extra.pop("FLOWLIFT_BENCH_VAE", args.vae), args)
    command = [
        "upscale",
        str(image),
        "--scale",
        "4",
        *model_args,
        "--device",
        args.device,
        "-o",
        str(out),
        "--overwrite",
        *extra,
    ]
    env = {
        **os.environ,
        **model_env,
        **env_extra,
        "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]),
    }
    if args.breakdown:
        argv = [sys.executable, str(Path(__file__).resolve()), "--child", *command]
    else:
        argv = [sys.executable, "-m", "flowlift", *command]
    load_before = os.getloadavg()[0]
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    run = subprocess.run(argv, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    system = cpu_after.ru_stime - cpu_before.ru_stime
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + system
    if run.returncode != 0:
        sys.exit(f"{name} failed ({run.returncode}): {run.stderr.strip()}")
    stages = {}
    for line in run.stdout.splitlines():
        if line.startswith("BREAKDOWN "):
            stages = json.loads(line.removeprefix("BREAKDOWN "))
    print(
        f"  {name}: {wall:.1f} s wall, {cpu:.1f} s CPU (of which system {system:.1f} s), "
        f"load {load_before:.1f} -> {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    return {"wall": wall, "cpu": cpu, "system": system, "stages": stages}


def pixel_difference(a: Path, b: Path) -> int:
    import numpy as np
    from PIL import Image

    x = np.asarray(Image.open(a).convert("RGB"), dtype=np.int16)
    y = np.asarray(Image.open(b).convert("RGB"), dtype=np.int16)
    return int(np.abs(x - y).max())


def print_breakdown(results: dict[str, list[dict]]) -> None:
    names = list(results)
    rows: list[str] = []
    for runs in results.values():
        for key in runs[0]["stages"]:
            if key not in rows:
                rows.append(key)
    print("\nstage (median of runs, seconds; several calls summed)  " + "  ".join(f"{n:>18}" for n in names))
    for row in rows:
        cells = []
        for name in names:
            values = [sum(r["stages"].get(row, [0.0])) for r in results[name]]
            calls = len(results[name][0]["stages"].get(row, []))
            if row == "threads":
                cells.append(f"{statistics.median(values):>18.0f}")
            else:
                label = f"{statistics.median(values):.2f}" + (f" ({calls}x)" if calls > 1 else "")
                cells.append(f"{label:>18}")
        print(f"{row:<55}" + "  ".join(cells))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return breakdown_child(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", default=os.environ.get("FLOWLIFT_SHARED", str(ROOT.parent / "shared")))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / f"flowlift-first-run-{os.getuid()}"))
    parser.add_argument("--baseline", help="also run this git revision (e.g. ade227f), alternating")
    parser.add_argument("--baseline-dtype", help="also run this tree with --dtype DTYPE (e.g. float32), alternating")
    parser.add_argument("--baseline-env", metavar="VAR=VALUE", help="also run this tree with VAR=VALUE, alternating")
    parser.add_argument("--dtype", help="this tree's --dtype (default: the command's own default)")
    parser.add_argument("--vae", default="taef2", choices=["taef2", "mage"], help="the command's VAE")
    parser.add_argument("--baseline-vae", choices=["taef2", "mage"], help="also run this tree with this VAE")
    parser.add_argument("--breakdown", action="store_true", help="time each stage in-process")
    add_weights_argument(parser)
    args = parser.parse_args()
    shared = Path(args.shared)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    image = shared / "images" / "kodak" / "kodim23.png"
    variants = {
        f"this tree --vae {args.vae}" + (f" --dtype {args.dtype}" if args.dtype else ""): (
            SRC,
            ["--dtype", args.dtype] if args.dtype else [],
            {},
        )
    }
    if args.baseline_dtype:
        variants[f"this tree --dtype {args.baseline_dtype}"] = (SRC, ["--dtype", args.baseline_dtype], {})
    if args.baseline_env:
        var, _, value = args.baseline_env.partition("=")
        variants[f"this tree with {var}={value}"] = (SRC, [], {var: value})
    if args.baseline_vae:
        variants[f"this tree --vae {args.baseline_vae}"] = (SRC, [], {"FLOWLIFT_BENCH_VAE": args.baseline_vae})
    if args.baseline:
        variants[f"revision {args.baseline}"] = (exported_source(args.baseline, work), [], {})
    cpu_model = cpu_name()
    print(
        f"first command, kodim23 768x512 -> 3072x2048, random full-size UNet, --vae {args.vae}, {args.device}, "
        f"{os.cpu_count()} CPUs ({cpu_model}), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for repeat in range(args.repeats):
        order = list(variants) if repeat % 2 == 0 else list(reversed(variants))  # alternate who goes first
        for name in order:
            src, extra, env_extra = variants[name]
            out = work / f"out-{list(variants).index(name)}.png"
            results[name].append(run_variant(name, src, extra, env_extra, args, image, out))
    first = list(variants)[0]
    for index, name in enumerate(variants):
        walls = [r["wall"] for r in results[name]]
        cpus = [r["cpu"] for r in results[name]]
        system = statistics.median(r["system"] for r in results[name])
        line = (
            f"{name}: median {statistics.median(walls):.1f} s wall, {statistics.median(cpus):.1f} s CPU "
            f"({system:.1f} s system)"
        )
        if index:
            ratio = statistics.median(walls) / statistics.median([r["wall"] for r in results[first]])
            cpu_ratio = statistics.median(cpus) / statistics.median([r["cpu"] for r in results[first]])
            paired = statistics.median(
                r["wall"] / f["wall"] for r, f in zip(results[name], results[first], strict=True)
            )
            diff = pixel_difference(work / "out-0.png", work / f"out-{index}.png")
            line += (
                f"; {ratio:.2f}x the wall time of '{first}' (paired runs: {paired:.2f}x), {cpu_ratio:.2f}x its "
                f"CPU time; pixels differ from it by at most {diff}/255"
            )
        print(line)
    if args.breakdown:
        print_breakdown(results)


if __name__ == "__main__":
    main()
