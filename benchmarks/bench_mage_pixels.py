"""Mage-VAE's per-pixel path on one tile: flowlift's eager path against the same blocks through ``torch.compile``.

Issue 47 asks whether a fused per-pixel kernel would bring Mage-VAE's decode under TAEF2's on the CPU. The
per-pixel path (:meth:`flowlift.models.mage_vae.PixelMLP.forward`: the conditioning layer, then three adaLN blocks
of 32-wide 1x1 layers and element-wise passes on every output pixel) is memory-bound in eager PyTorch, and torch's
own compiler (Inductor, C++ kernels built at run time) is the fusing tool a user already has. Each variant runs in
a fresh interpreter, alternating, on one 32x32-position tile (262,144 pixels, the decode's bf16 pixel tile) of a
random full-size ``PixelMLP`` (seed 0, folded, bf16) with random tokens and features (seeds 1, 2):

- ``eager``: ``PixelMLP.forward`` as the decode runs it (oneDNN 1x1 convolutions on channels-last rows, the SiLU
  in ``lin1``'s pass, the LayerNorm as a centring convolution and one norm);
- ``compiled``: the conditioning layer as in ``eager``, then the three blocks written plainly (``F.linear``, the
  LayerNorm as ``x - mean`` and a float32 mean of squares, the adds and products as expressions) through
  ``torch.compile(dynamic=False)``, which fuses every element-wise pass between the linear layers into one loop;
  ``freezing`` (torch's inference-only constant folding and oneDNN weight packing) with ``--freezing``.

Printed per run: CPU-ms per tile (median of ``--calls`` calls after the first), the first call's CPU-s (the
compile, its worker processes included) and the whole interpreter's CPU-s (the child's ``getrusage``, start-up
and every worker it waited for), and the largest difference from ``eager`` on the same input. The compiled
runs share one Inductor cache, made empty at the start: the first run compiles from nothing (what a user's first
command would pay), the later ones load the cache. Run from the repository root::

    PYTHONPATH=src python benchmarks/bench_mage_pixels.py --repeats 2
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

PIXEL_TILE = 32  # positions per side: MageTiling's bf16 pixel tile


def child(variant: str, calls: int, freezing: bool) -> None:
    """Time ``variant`` on one tile in this process; print one JSON line."""
    from flowlift.devices import passive_thread_wait, reuse_freed_memory

    passive_thread_wait()
    reuse_freed_memory()
    import torch
    import torch.nn.functional as F

    from flowlift.models.mage_vae import MageVAEConfig, PixelMLP

    torch.manual_seed(0)
    config = MageVAEConfig()
    mlp = PixelMLP(config)
    mlp.fold()
    mlp = mlp.to(torch.bfloat16).eval().requires_grad_(False)
    px, side = config.pixel_width, PIXEL_TILE
    tokens = torch.randn(1, config.hidden, side, side, generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    features = torch.randn(side * side * 256, px, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    weight, bias = mlp.modulation_ln.weight[:, :, 0, 0], mlp.modulation_ln.bias
    layers = [(b.lin1.weight[:, :, 0, 0], b.lin1.bias, b.lin2.weight[:, :, 0, 0], b.lin2.bias) for b in mlp.res_blocks]

    def plain_blocks(x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        for i, (w1, b1, w2, b2) in enumerate(layers):
            rows = [slice(k * px, (k + 1) * px) for k in range(3 * i, 3 * i + 3)]
            scale, shift, gate = (F.linear(cond, weight[r], bias[r]) for r in rows)
            y = x - x.mean(-1, keepdim=True)
            n = y * torch.rsqrt(y.float().square().mean(-1, keepdim=True) + 1e-6).to(y.dtype)
            x = x + gate * F.linear(F.silu(F.linear(n * scale + shift, w1, b1)), w2, b2)
        return x

    def conditioning(t: torch.Tensor) -> torch.Tensor:
        from flowlift.models.fused_conv import conv_act

        return conv_act(t, mlp.cond_conv, "swish").permute(0, 2, 3, 1).reshape(-1, px)

    run = mlp.forward
    if variant == "compiled":
        import torch._inductor.config as inductor_config

        inductor_config.freezing = freezing
        blocks = torch.compile(plain_blocks, dynamic=False)
        run = lambda x, t: blocks(x, conditioning(t))  # noqa: E731
    with torch.no_grad():
        reference = mlp.forward(features.clone(), tokens).float()
        start = time.process_time()
        first = run(features.clone(), tokens)
        first_cpu = time.process_time() - start
        times = []
        for _ in range(calls):
            x = features.clone()
            start = time.process_time()
            run(x, tokens)
            times.append(time.process_time() - start)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(
        json.dumps(
            {
                "tile_ms": 1000 * statistics.median(times),
                "first_s": first_cpu + usage.ru_utime + usage.ru_stime,
                "max_diff": float((first.float() - reference).abs().max()),
                "max_value": float(reference.abs().max()),
            }
        ),
        flush=True,
    )


def run_child(variant: str, args: argparse.Namespace, cache: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    command = [sys.executable, __file__, "--child", variant, "--calls", str(args.calls)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(command + (["--freezing"] if args.freezing else []), env=env, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode:
        raise SystemExit(f"{variant} failed:\n{out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["process_s"] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs of each variant, alternating")
    parser.add_argument("--calls", type=int, default=8, help="timed calls per run after the first")
    parser.add_argument("--freezing", action="store_true", help="compile with torch's inference freezing")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.calls, args.freezing)
        return
    with tempfile.TemporaryDirectory(prefix="flowlift-inductor-") as cache:
        for repeat in range(args.repeats):
            for variant in ("eager", "compiled"):
                r = run_child(variant, args, cache)
                print(
                    f"{variant:8s} run {repeat + 1}: {r['tile_ms']:6.1f} CPU-ms per tile, first call"
                    f" {r['first_s']:5.2f} CPU-s, whole process {r['process_s']:5.2f} CPU-s,"
                    f" max |diff| vs eager {r['max_diff']:.4f}"
                    f" (values up to {r['max_value']:.2f})",
                    flush=True,
                )


if __name__ == "__main__":
    main()
