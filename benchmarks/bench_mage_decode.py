"""Mage-VAE's decode as the upscale command runs it (the exact tiled executor, channels-last, one process, the
image in [0, 1] float32 as ``MageVAE.decode`` asks it): CPU time per dtype and the bf16 image's distance from
float32's.

A random full-size decoder (seed 0, t = 0 folded; no released weights here) decodes a random latent (seed 1)
of the output size / 16, in bfloat16 then float32. Printed: CPU seconds of each decode (``time.process_time``
of the whole process, so both cores count), and bf16 against float32 on the image clamped to [0, 1]: PSNR, max
and RMS difference. ``--save DIR`` keeps the float32 image (``mage_decode_float32.pt``) and ``--against FILE``
compares this tree's float32 image with one another tree saved (max difference, 8-bit values that differ).
Run from the repository root (docs/cpu.md, issue 47)::

    PYTHONPATH=src python benchmarks/bench_mage_decode.py --size 3072x2048
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def _psnr(a, b) -> float:
    import torch

    return float(10 * torch.log10(1 / (a - b).square().mean()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="3072x2048", help="output WxH, multiples of 16")
    parser.add_argument("--save", default="", help="a folder to keep the float32 image in")
    parser.add_argument("--against", default="", help="a float32 image another tree saved with --save")
    args = parser.parse_args()
    from flowlift.devices import passive_thread_wait, reuse_freed_memory

    passive_thread_wait()
    reuse_freed_memory()
    import torch

    from flowlift.models.mage_tiling import decode_tiled
    from flowlift.models.mage_vae import MageVAEConfig, MageVAEModel

    width, height = (int(v) for v in args.size.lower().split("x"))
    torch.manual_seed(0)
    model = MageVAEModel(MageVAEConfig(), encoder=False).fold_t0().eval().requires_grad_(False)
    z = torch.randn(1, 128, height // 16, width // 16, generator=torch.Generator().manual_seed(1))
    images = {}
    for dtype in (torch.bfloat16, torch.float32):
        decoder = model.to(dtype=dtype, memory_format=torch.channels_last).decoder
        with torch.no_grad():
            start = time.process_time()
            out = decode_tiled(decoder, z.to(dtype).contiguous(memory_format=torch.channels_last), unit_range=True)
            seconds = time.process_time() - start
        images[dtype] = out.clamp(0, 1)
        print(f"decode {width}x{height} {str(dtype)[6:]}: {seconds:.2f} CPU-s", flush=True)
    bf16, fp32 = images[torch.bfloat16], images[torch.float32]
    diff = bf16 - fp32
    print(
        f"bf16 vs float32: PSNR {_psnr(bf16, fp32):.2f} dB, max {float(diff.abs().max()):.4f}, "
        f"RMS {float(diff.square().mean().sqrt()):.3e}"
    )
    if args.save:
        torch.save(fp32, Path(args.save) / "mage_decode_float32.pt")
    if args.against:
        other = torch.load(args.against, weights_only=True)
        moved = int(((other * 255).round() != (fp32 * 255).round()).sum())
        print(f"float32 vs {args.against}: max {float((other - fp32).abs().max()):.3e}, 8-bit values moved {moved}")


if __name__ == "__main__":
    main()
