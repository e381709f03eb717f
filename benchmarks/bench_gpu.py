"""GPU speed of the Flow Upscaler (issue 13): one table, every row measured side by side in one run.

Rows (random weights, fixed seed: time and memory do not depend on their values):

* one UNet pass at 1024 and 2048 px output (latent 64 -> 128, 128 -> 256): eager per dtype (fp32,
  bf16, fp16, bf16 channels-last), eager under a CUDA graph, and ``torch.compile`` (the pipeline's
  :class:`flowlift.upscale.unet_runner.CompiledUNet`, ``reduce-overhead`` on CUDA) in bf16 channels-last;
* batch 1 vs 8 at 1024 px (per image);
* plain forward vs the budget-sized :class:`flowlift.upscale.chunked.executor.ChunkedExecutor` vs offloaded stores
  at 4K / 8K / 16K output, with peak device memory (``torch.cuda.max_memory_allocated``);
* the end-to-end pipeline (TAEF2 from ``../shared/models/taef2``) 2048x1366 -> x8 without a budget
  and with ``max_memory`` 6GB and 4GB (TAEF2's float32 16K frame puts 3GB out of reach), with peak memory;
* the FLUX.2 refine pass (issue 23): img2img at strength 0.5, 4 steps (Klein's), at 1024 and 2048 px with a
  random transformer of FLUX.2 Klein 4B's size (bf16, 7.75 GB) and the FLUX.2 VAE's architecture, for
  ``--offload none|model|group`` and for the plans ``--max-memory`` 24GB / 12GB / 8GB picks; peak memory here is
  absolute (weights included), not the growth over the resident weights.

Times are medians of ``--repeats`` runs after a warm-up (CUDA: synchronized wall time). Ratios are
against the row's reference (first row of its group). ``--device cpu --quick`` runs every row at
toy sizes with a small UNet in seconds (the test suite does that); on the CPU there is no CUDA graph,
peak device memory is not measured, and the inductor compile row runs only with ``--compile-on-cpu``
(minutes of C++ compilation on a small machine)::

    PYTHONPATH=src python benchmarks/bench_gpu.py --device cuda     # the README's GPU table
    PYTHONPATH=src python benchmarks/bench_gpu.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from flowlift.limits import format_bytes, parse_memory  # noqa: E402
from flowlift.models.upscaler_unet import FlowUpscalerUNet  # noqa: E402
from flowlift.upscale.chunked.executor import ChunkedExecutor  # noqa: E402
from flowlift.upscale.unet_runner import CompiledUNet  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Table:
    """Rows of (group, setting, seconds, peak bytes) printed as one markdown table."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, float | None, int | None, str]] = []

    def add(self, group: str, setting: str, seconds: float | None, peak: int | None = None, note: str = "") -> None:
        self.rows.append((group, setting, seconds, peak, note))
        print(f"  {group} | {setting}: {'-' if seconds is None else f'{seconds * 1e3:.2f} ms'} {note}", file=sys.stderr)

    def render(self) -> str:
        lines = ["| measure | setting | time | ratio | peak memory | note |", "|---|---|---|---|---|---|"]
        reference: dict[str, float] = {}
        for group, setting, seconds, peak, note in self.rows:
            if seconds is not None and group not in reference:
                reference[group] = seconds
            ratio = f"{seconds / reference[group]:.2f}x" if seconds is not None else "-"
            shown = "-" if seconds is None else (f"{seconds * 1e3:.2f} ms" if seconds < 10 else f"{seconds:.1f} s")
            lines.append(
                f"| {group} | {setting} | {shown} | {ratio} | {'-' if peak is None else format_bytes(peak)} | {note} |"
            )
        return "\n".join(lines)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(
    fn: Callable[[], object], device: torch.device, repeats: int, absolute: bool = False
) -> tuple[float, int | None]:
    """(median seconds of ``repeats`` calls after one warm-up, peak device bytes of one call or None).

    The peak is the growth over what was allocated before, or with ``absolute`` everything allocated."""
    fn()
    sync(device)
    peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = 0 if absolute else torch.cuda.memory_allocated(device)
    samples = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - start)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - base
    return statistics.median(samples), peak


def make_unet(base: int, device: torch.device, dtype: torch.dtype, channels_last: bool = False) -> FlowUpscalerUNet:
    torch.manual_seed(0)
    model = (
        FlowUpscalerUNet(base_channels=base).eval()
        if base == 384
        else FlowUpscalerUNet(base_channels=base, time_dim=32, cond_dim=64).eval()
    )
    model = model.to(device=device, dtype=dtype)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def unet_inputs(batch: int, latent: tuple[int, int], device: torch.device, dtype: torch.dtype, channels_last: bool):
    gen = torch.Generator().manual_seed(1)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    sample = torch.randn(batch, 32, latent[0], latent[1], generator=gen).to(device, dtype, memory_format=fmt)
    small = torch.randn(batch, 32, latent[0] // 2, latent[1] // 2, generator=gen).to(device, dtype, memory_format=fmt)
    return sample, torch.full((batch,), 1000.0, device=device), small


def cuda_graph(model: torch.nn.Module, args: tuple) -> Callable[[], torch.Tensor]:
    """Eager forward captured once into a CUDA graph; the callable replays it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            model(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(*args)

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


def unet_rows(table: Table, args: argparse.Namespace, device: torch.device, base: int, sides: list[int]) -> None:
    cuda = device.type == "cuda"
    dtypes = ["fp32", "bf16", "fp16"] if cuda else ["fp32"]
    for side in sides:  # output pixels
        latent = (side // 8, side // 8)
        group = f"UNet pass, {side} px output"
        with torch.inference_mode():
            for name in dtypes:
                model = make_unet(base, device, DTYPES[name])
                inputs = unet_inputs(1, latent, device, DTYPES[name], False)
                table.add(group, f"eager {name}", *timed(lambda m=model, i=inputs: m(*i), device, args.repeats))
            best = "bf16" if cuda else "fp32"
            model = make_unet(base, device, DTYPES[best], channels_last=True)
            inputs = unet_inputs(1, latent, device, DTYPES[best], True)
            table.add(
                group, f"eager {best} channels-last", *timed(lambda m=model, i=inputs: m(*i), device, args.repeats)
            )
        if cuda:
            with torch.no_grad():
                replay = cuda_graph(model, inputs)
                table.add(group, f"CUDA graph {best} channels-last", *timed(replay, device, args.repeats))
        if cuda or args.compile_on_cpu:
            compiled = CompiledUNet(model, channels_last=True)
            with torch.inference_mode():
                compiled(*inputs)
                seconds, peak = timed(lambda c=compiled, i=inputs: c(*i), device, args.repeats)
            compile_s = next(iter(compiled.compile_seconds.values()), float("nan"))
            note = f"compile {compile_s:.0f} s" if compiled.fallback_reason is None else "fell back to eager"
            table.add(group, f"torch.compile {compiled.mode or 'default'} {best} CL", seconds, peak, note)
        else:
            table.add(group, "torch.compile", None, None, "skipped on the CPU (--compile-on-cpu)")


def batch_rows(table: Table, args: argparse.Namespace, device: torch.device, base: int, side: int) -> None:
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    model = make_unet(base, device, dtype, channels_last=cuda)
    group = f"batch, {side} px output, per image"
    with torch.inference_mode():
        for batch in (1, 8):
            inputs = unet_inputs(batch, (side // 8, side // 8), device, dtype, cuda)
            seconds, peak = timed(lambda i=inputs: model(*i), device, args.repeats)
            table.add(group, f"batch {batch} eager", seconds / batch, peak)


def executor_rows(table: Table, args: argparse.Namespace, device: torch.device, base: int, sides: list[int]) -> None:
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    model = make_unet(base, device, dtype)
    budget = parse_memory(args.executor_budget)
    for side in sides:
        latent = (side // 8, side // 8)
        group = f"executor, {side} px output"
        inputs = unet_inputs(1, latent, device, dtype, False)
        with torch.inference_mode():
            try:
                table.add(group, "plain forward", *timed(lambda i=inputs: model(*i), device, 1))
            except torch.OutOfMemoryError:
                table.add(group, "plain forward", None, None, "out of memory")
            executor = ChunkedExecutor(model, budget_bytes=budget)
            seconds, peak = timed(lambda e=executor, i=inputs: e(*i), device, 1)
            table.add(
                group, f"executor, strips from {args.executor_budget}", seconds, peak, f"{executor.last_chunk} rows"
            )
            if cuda:
                offload = ChunkedExecutor(model, offload_device="cpu", budget_bytes=budget)
                seconds, peak = timed(lambda e=offload, i=inputs: e(*i), device, 1)
                table.add(group, "executor, offloaded stores", seconds, peak, f"{offload.last_chunk} rows")
            else:
                offload = ChunkedExecutor(model, budget_bytes=budget)
                offload.stage_on_same_device = True  # the offload path's copies and predictions, CPU to CPU
                seconds, peak = timed(lambda e=offload, i=inputs: e(*i), device, 1)
                table.add(group, "executor, staged stores (CPU twin of offload)", seconds, peak)
        del inputs
        if cuda:
            torch.cuda.empty_cache()


def pipeline_rows(
    table: Table, args: argparse.Namespace, device: torch.device, base: int, size: tuple[int, int]
) -> None:
    from flowlift.upscale.pipeline import FlowUpscalerPipeline
    from flowlift.upscale.settings import MemoryPolicy

    shared = Path(os.environ.get("FLOWLIFT_SHARED", ROOT.parent / "shared"))
    taef2 = shared / "models" / "taef2"
    group = f"pipeline {size[0]}x{size[1]} -> x{2**args.passes}"
    if not taef2.is_dir():
        table.add(group, "all", None, None, f"skipped: no TAEF2 at {taef2}")
        return
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = make_unet(base, device, dtype)
    gen = torch.Generator().manual_seed(2)
    image = torch.rand(1, 3, size[1], size[0], generator=gen)
    for budget in [None, *args.budgets]:
        memory = MemoryPolicy(max_memory=budget)
        pipe = FlowUpscalerPipeline(model, str(taef2), device=device, dtype=dtype, memory=memory)
        try:
            seconds, peak = timed(
                lambda p=pipe: p.upscale_image(image, num_passes=args.passes, output_type="pt"), device, 1
            )
        except torch.OutOfMemoryError:
            table.add(group, f"max_memory {budget or 'none (auto)'}", None, None, "out of memory")
            continue
        plan = pipe.last_plan.describe().split(": ", 1)[1] if pipe.last_plan is not None else "auto"
        table.add(group, f"max_memory {budget or 'none (auto)'}", seconds, peak, plan)
        del pipe
        if device.type == "cuda":
            torch.cuda.empty_cache()


#: FLUX.2 Klein 4B's transformer (width 3072, 5 double + 20 single blocks, Qwen3-4B's three stacked hidden states).
KLEIN_4B = {"num_layers": 5, "num_single_layers": 20, "num_attention_heads": 24, "joint_attention_dim": 7680}
TOY_TRANSFORMER = {"num_layers": 1, "num_single_layers": 1, "num_attention_heads": 2, "joint_attention_dim": 256}


def random_module(cls, config: dict, dtype: torch.dtype) -> torch.nn.Module:
    """``cls(**config)`` with random weights in ``dtype`` on the CPU, without a float32 copy first."""
    with torch.device("meta"):
        module = cls(**config)
    module = module.to_empty(device="cpu").to(dtype)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float32).mul_(0.02).to(dtype))
        for name, buffer in module.named_buffers():
            buffer.fill_(1.0 if name.endswith("running_var") else 0.0)
    return module.eval().requires_grad_(False)


def refine_rows(table: Table, args: argparse.Namespace, device: torch.device) -> None:
    """img2img (strength 0.5, 4 steps) per offload mode and per planned budget (module docstring)."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    from flowlift.limits import model_bytes
    from flowlift.models.vae_loading import load_vae
    from flowlift.refine.memory_plan import VAESizes, plan_refine, transformer_sizes

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = TOY_TRANSFORMER if args.quick else KLEIN_4B
    transformer = random_module(
        Flux2Transformer2DModel, {**config, "attention_head_dim": 128, "timestep_guidance_channels": 256}, dtype
    )
    vae_config = {"block_out_channels": (8, 8, 8, 8), "norm_num_groups": 4} if args.quick else {}
    vae = load_vae(random_module(AutoencoderKLFlux2, vae_config, dtype), device=device, dtype=dtype)
    text = torch.Generator().manual_seed(1)
    emb = torch.randn(1, 8 if args.quick else 512, config["joint_attention_dim"], generator=text)
    sizes = transformer_sizes(transformer)
    name = "toy transformer" if args.quick else "Klein 4B size"
    pixels = torch.Generator().manual_seed(2)
    images = {side: torch.rand(1, 3, side, side, generator=pixels) for side in args.refine_sides}
    runs = [(side, mode, None) for side in args.refine_sides for mode in ("none", "model")]
    largest = args.refine_sides[-1]
    for budget in args.refine_budgets:  # largest budget first: once a plan picks group, the leaner ones do too
        plan = plan_refine(
            largest,
            largest,
            parse_memory(budget),
            sizes,
            dtype=dtype,
            vae=VAESizes(bytes=model_bytes(vae), dtype=dtype),
            text_tokens=emb.shape[1],
        )
        runs.append((largest, plan, budget))
    runs += [(side, "group", None) for side in args.refine_sides]  # last: group offloading's hooks stay on the model
    for side, how, budget in runs:
        group = f"refine img2img 0.5 x4 steps, {side} px, {name}"
        _refine_row(table, group, transformer, vae, images[side], emb, device, dtype, how, budget)


def _refine_row(table, group, transformer, vae, image, emb, device, dtype, how, budget) -> None:
    """One row: ``how`` is an offload mode or a :class:`~flowlift.refine.memory_plan.RefinePlan`."""
    from flowlift.errors import FlowliftError
    from flowlift.refine.offload import Placement
    from flowlift.refine.refiner import Flux2Refiner

    plan = None if isinstance(how, str) else how
    offload = how if plan is None else plan.offload
    setting = f"offload {offload}" if plan is None else f"max_memory {budget}"
    try:
        placement = Placement(offload, None if plan is None else plan.vae_tiled)
        refiner = Flux2Refiner(transformer, vae, device=device, dtype=dtype, placement=placement)
    except FlowliftError as error:  # group offload without accelerate
        table.add(group, setting, None, None, f"skipped: {error}")
        return

    def run() -> object:
        from flowlift.refine.settings import SamplingSettings

        return refiner.img2img(image, strength=0.5, sampling=SamplingSettings(steps=4, seed=0), prompt_embeds=emb)

    try:
        seconds, peak = timed(run, device, 1, absolute=True)
    except torch.OutOfMemoryError:
        seconds = peak = None
    finally:
        if offload == "none":
            transformer.to("cpu")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    note = "out of memory" if seconds is None else (plan.describe().split(": ", 1)[1] if plan is not None else "")
    table.add(group, setting, seconds, peak, note)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="toy sizes and a small UNet (seconds)")
    parser.add_argument("--repeats", type=int, default=0, help="timed runs per row (default 20 GPU, 2 quick)")
    parser.add_argument("--compile-on-cpu", action="store_true", help="also run the inductor row on the CPU")
    parser.add_argument("--parts", default="unet,batch,executor,pipeline,refine")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.quick:
        base, unet_sides, batch_side, exec_sides, size = 32, [128], 128, [256], (48, 32)
        args.passes, args.budgets, args.executor_budget = 1, ["2GB"], "64MB"
        args.refine_sides, args.refine_budgets = [64], ["1GB"]
    else:
        base, unet_sides, batch_side, exec_sides, size = 384, [1024, 2048], 1024, [4096, 8192, 16384], (2048, 1366)
        args.passes, args.budgets, args.executor_budget = 3, ["6GB", "4GB"], "6GB"
        args.refine_sides, args.refine_budgets = [1024, 2048], ["24GB", "12GB", "8GB"]
    args.repeats = args.repeats or (1 if args.quick else 20)
    table = Table()
    parts = set(args.parts.split(","))
    torch.manual_seed(0)
    if "unet" in parts:
        unet_rows(table, args, device, base, unet_sides)
    if "batch" in parts:
        batch_rows(table, args, device, base, batch_side)
    if "executor" in parts:
        executor_rows(table, args, device, base, exec_sides)
    if "pipeline" in parts:
        pipeline_rows(table, args, device, base, size)
    if "refine" in parts:
        refine_rows(table, args, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"flowlift bench_gpu on {name}, torch {torch.__version__}{' (--quick)' if args.quick else ''}")
    print(table.render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
