"""CPU peak RSS of one FLUX.2 transformer forward, in (tokens, width) float32 frames.

Calibrates ``flowlift.refine.memory_plan.TRANSFORMER_PEAK_FRAMES``: a random ``Flux2Transformer2DModel`` of FLUX.2's
head size (128) and MLP ratio (3) at a small width and one double plus one single block runs one forward on
``--image-tokens`` image and 512 text tokens; the peak resident-memory growth (Linux ``VmHWM`` after resetting it
through ``/proc/self/clear_refs``), weights excluded, is divided by ``tokens * width * 4`` bytes. Each size runs
in its own process so allocator reuse cannot hide a peak::

    PYTHONPATH=src python benchmarks/calibrate_refine_memory.py          # ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

TEXT_TOKENS = 512


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(width: int, image_tokens: int) -> float:
    """Peak RSS growth of one forward in (image_tokens + 512, width) float32 frames."""
    import torch
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    model = Flux2Transformer2DModel(
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=128,
        num_attention_heads=width // 128,
        joint_attention_dim=width,
        timestep_guidance_channels=256,
    ).eval()
    side = int(image_tokens**0.5)
    tokens = side * side

    def inputs(n_side: int, n_text: int):
        img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(n_side), torch.arange(n_side), torch.arange(1))
        txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(n_text))
        return {
            "hidden_states": torch.randn(1, n_side * n_side, 128),
            "encoder_hidden_states": torch.randn(1, n_text, width),
            "timestep": torch.tensor([0.5]),
            "img_ids": img_ids[None],
            "txt_ids": txt_ids[None],
            "return_dict": False,
        }

    with torch.no_grad():
        model(**inputs(4, 8))  # warm-up: lazy initializations, kernels
        args = inputs(side, TEXT_TOKENS)
        Path("/proc/self/clear_refs").write_text("5")
        start = _status("VmRSS")
        model(**args)
    return (_status("VmHWM") - start) / ((tokens + TEXT_TOKENS) * width * 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(measure(args.width, args.one))
        return
    print(f"| image tokens (+{TEXT_TOKENS} text), width {args.width}, fp32 | peak RSS growth (frames) |")
    print("|---|---|")
    for tokens in (1024, 4096, 9216):
        cmd = [sys.executable, __file__, "--width", str(args.width), "--one", str(tokens)]
        result = subprocess.run(cmd, capture_output=True, text=True, check=True)
        print(f"| {tokens} | {float(result.stdout.strip().splitlines()[-1]):.1f} |")


if __name__ == "__main__":
    main()
