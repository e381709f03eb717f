"""What bfloat16 and channels-last cost and buy on the CPU: speed and error of the UNet, TAEF2 and Mage-VAE.

* TAEF2 (the real weights, ``../shared/models/taef2``): kodim23 encoded, and the decode of its latents
  upsampled 4x (the first command's 3072x2048 decode), in float32 and in bfloat16 (both channels-last,
  as :class:`flowlift.models.vae.TAEF2VAE` runs): seconds, and bf16 vs fp32 PSNR and max difference of
  the 8-bit pixels; the decode's tile sizes (whole frame, 64 and 128 latent px) in bf16.
* A random full-size Flow Upscaler UNet (the released architecture, seed 0), one pass on a sample of
  ``--unet-size`` latent px (default 128x192: the first command's pass 1): float32 contiguous, float32
  channels-last, bfloat16 channels-last: seconds (alternating, ``--repeats``, medians), channels-last's
  difference from contiguous in fp32, and bf16's error vs fp32 (relative RMS, max abs difference, PSNR
  over the fp32 output's range).

* A random full-size Mage-VAE (the released widths, seed 0, t = 0 folded): kodim23 encoded and its latents
  decoded, float32 and bfloat16, each contiguous and channels-last (warm-up first, then alternating,
  ``--repeats``, medians of the process CPU time, which a busy machine inflates far less than the wall
  time), and each variant's error against float32 contiguous (latents: relative RMS; decode: 8-bit PSNR).

    PYTHONPATH=src python benchmarks/bench_cpu_bf16.py [--repeats 3] [--unet-size 128x192]
    PYTHONPATH=src python benchmarks/bench_cpu_bf16.py --skip-unet --skip-taef2 --repeats 3   # Mage-VAE only
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def seconds(fn, repeats: int) -> tuple[float, torch.Tensor]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def pixel_error(reference: torch.Tensor, other: torch.Tensor) -> str:
    """PSNR and max difference of the 8-bit images ``round(255 * clamp(x, 0, 1))``."""
    a = (reference.float().clamp(0, 1) * 255).round()
    b = (other.float().clamp(0, 1) * 255).round()
    mse = float(((a - b) ** 2).mean())
    psnr = math.inf if mse == 0 else 10 * math.log10(255**2 / mse)
    return f"PSNR {psnr:.1f} dB, max diff {int((a - b).abs().max())}/255"


def tensor_error(reference: torch.Tensor, other: torch.Tensor) -> str:
    ref, oth = reference.float(), other.float()
    rms = float((ref - oth).pow(2).mean().sqrt())
    span = float(ref.max() - ref.min())
    psnr = 20 * math.log10(span / rms) if rms > 0 else math.inf
    rel = rms / float(ref.pow(2).mean().sqrt())
    peak = float((ref - oth).abs().max())
    return f"relative RMS {rel:.2e}, max abs diff {peak:.3g}, PSNR {psnr:.1f} dB (over the range)"


def taef2_report(shared: Path, repeats: int) -> None:
    from flowlift.files.images import load_image, to_tensor
    from flowlift.models.vae_loading import load_vae

    image, _ = load_image(shared / "images" / "kodak" / "kodim23.png")
    x = to_tensor(image, dtype=torch.float32)
    vaes = {
        dt: load_vae(str(shared / "models" / "taef2"), device="cpu", dtype=dt) for dt in (torch.float32, torch.bfloat16)
    }
    with torch.inference_mode():
        z32 = vaes[torch.float32].encode(x)
        z_big = torch.nn.functional.interpolate(z32, scale_factor=4, mode="bicubic")
        out = {}
        for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            vae = vaes[dt]
            t_enc, z = seconds(lambda vae=vae: vae.encode(x), repeats)
            t_dec, y = seconds(lambda vae=vae: vae.decode(z_big), repeats)
            out[name] = (z, y, vae.decode(z32))
            print(f"TAEF2 {name}: encode 768x512 {t_enc:.2f} s, decode 3072x2048 (tiled, 64 px tiles) {t_dec:.2f} s")
        print(f"TAEF2 bf16 vs fp32: encoder latents {tensor_error(out['fp32'][0], out['bf16'][0])}")
        print(f"TAEF2 bf16 vs fp32: 3072x2048 decode, {pixel_error(out['fp32'][1], out['bf16'][1])}")
        print(f"TAEF2 bf16 vs fp32: kodim23 round trip, {pixel_error(out['fp32'][2], out['bf16'][2])}")
        print(
            f"TAEF2 fp32 round trip vs the original: {pixel_error(x, out['fp32'][2])}; "
            f"bf16: {pixel_error(x, out['bf16'][2])}"
        )
        vae = vaes[torch.bfloat16]
        zb = z_big.to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
        for tile in (64, 128):
            t, _ = seconds(lambda tile=tile: vae.model.decode_tiled(zb, tile=tile), repeats)
            print(f"TAEF2 bf16 decode 3072x2048, tile {tile}: {t:.2f} s")
        t, _ = seconds(lambda: vae.model.decode_full(zb), repeats)
        print(f"TAEF2 bf16 decode 3072x2048, whole frame: {t:.2f} s")


def mage_report(shared: Path, repeats: int) -> None:
    from flowlift.files.images import load_image, to_tensor
    from flowlift.models.mage_vae import MageVAEConfig, MageVAEModel
    from flowlift.models.vae import MageVAE

    image, _ = load_image(shared / "images" / "kodak" / "kodim23.png")
    x = to_tensor(image, dtype=torch.float32)
    torch.manual_seed(0)
    state = MageVAEModel(MageVAEConfig()).fold_t0().state_dict()
    cl = torch.channels_last
    variants = {}
    for name, dtype, layout in (
        ("fp32 contiguous", torch.float32, torch.contiguous_format),
        ("fp32 channels-last", torch.float32, cl),
        ("bf16 contiguous", torch.bfloat16, torch.contiguous_format),
        ("bf16 channels-last", torch.bfloat16, cl),
    ):
        model = MageVAEModel(MageVAEConfig()).fold_t0()
        model.load_state_dict(state)
        variants[name] = (MageVAE(model.to(dtype=dtype, memory_format=layout)), dtype, layout)
    with torch.inference_mode():
        z32 = variants["fp32 contiguous"][0].encode(x)
        inputs = {
            name: (x.to(dtype).contiguous(memory_format=layout), z32.to(dtype).contiguous(memory_format=layout))
            for name, (_, dtype, layout) in variants.items()
        }
        outs = {
            name: (vae.encode(inputs[name][0]).float(), vae.decode(inputs[name][1]).float())
            for name, (vae, _, _) in variants.items()
        }  # warm-up (oneDNN primitives) and the results
        times: dict[str, dict[str, list[float]]] = {name: {"encode": [], "decode": []} for name in variants}
        for _ in range(repeats):
            for name, (vae, _, _) in variants.items():
                for op, arg in (("encode", inputs[name][0]), ("decode", inputs[name][1])):
                    start = time.process_time()
                    getattr(vae, op)(arg)
                    times[name][op].append(time.process_time() - start)
    base = {op: statistics.median(times["fp32 contiguous"][op]) for op in ("encode", "decode")}
    ref_z, ref_y = outs["fp32 contiguous"]
    for name in variants:
        enc, dec = (statistics.median(times[name][op]) for op in ("encode", "decode"))
        print(
            f"Mage-VAE {name}: encode 768x512 {enc:.2f} CPU s ({base['encode'] / enc:.2f}x fp32 contiguous), "
            f"decode {dec:.2f} CPU s ({base['decode'] / dec:.2f}x); latents {tensor_error(ref_z, outs[name][0])}; "
            f"decode {pixel_error(ref_y, outs[name][1])}"
        )


def unet_report(size: tuple[int, int], repeats: int) -> None:
    from flowlift.models.upscaler_unet import FlowUpscalerUNet

    torch.manual_seed(0)
    model32 = FlowUpscalerUNet().eval()
    h, w = size
    generator = torch.Generator().manual_seed(1)
    noise = torch.randn(1, 32, h, w, generator=generator)
    cond = torch.randn(1, 32, h // 2, w // 2, generator=generator)
    t = torch.full((1,), 1000.0)
    model_cl = FlowUpscalerUNet().eval()
    model_cl.load_state_dict(model32.state_dict())
    model_cl.to(memory_format=torch.channels_last)
    model_bf = FlowUpscalerUNet().eval()
    model_bf.load_state_dict(model32.state_dict())
    model_bf.to(dtype=torch.bfloat16, memory_format=torch.channels_last)
    cl = torch.channels_last
    runs = {
        "fp32 contiguous": lambda: model32(noise, t, cond),
        "fp32 channels-last": lambda: model_cl(
            noise.contiguous(memory_format=cl), t, cond.contiguous(memory_format=cl)
        ),
        "bf16 channels-last": lambda: model_bf(
            noise.to(torch.bfloat16, memory_format=cl), t, cond.to(torch.bfloat16, memory_format=cl)
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    outs = {}
    with torch.inference_mode():
        for name, fn in runs.items():  # warm-up (oneDNN primitive creation) and the outputs
            outs[name] = fn().float()
        for _ in range(repeats):
            for name, fn in runs.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["fp32 contiguous"])
    for name in runs:
        med = statistics.median(times[name])
        print(
            f"UNet pass, sample {h}x{w} latent px, {name}: {med:.2f} s "
            f"(median of {repeats}; {base / med:.2f}x fp32 contiguous)"
        )
    ref = outs["fp32 contiguous"]
    print(
        "UNet fp32 channels-last vs contiguous: max abs diff "
        f"{float((outs['fp32 channels-last'] - ref).abs().max()):.2e}"
    )
    print(f"UNet bf16 channels-last vs fp32: velocity {tensor_error(ref, outs['bf16 channels-last'])}")
    x32 = noise - ref
    xbf = noise - outs["bf16 channels-last"]
    print(f"UNet bf16 vs fp32: x0 = noise - v, {tensor_error(x32, xbf)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", default=os.environ.get("FLOWLIFT_SHARED", str(ROOT.parent / "shared")))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--unet-size", default="128x192", help="sample HxW in latent px (pass 2: 256x384)")
    parser.add_argument("--skip-unet", action="store_true")
    parser.add_argument("--skip-taef2", action="store_true")
    parser.add_argument("--skip-mage", action="store_true")
    args = parser.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    from flowlift.devices import cpu_has_native_bf16

    print(
        f"{cpu}, {torch.get_num_threads()} threads, native bf16: {cpu_has_native_bf16()}, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    if not args.skip_taef2:
        taef2_report(Path(args.shared), args.repeats)
    if not args.skip_mage:
        mage_report(Path(args.shared), args.repeats)
    if not args.skip_unet:
        h, w = (int(v) for v in args.unet_size.split("x"))
        unet_report((h, w), args.repeats)


if __name__ == "__main__":
    main()
