"""Tracked tensor peak of a VAE encode, whole frame and tiled, against ``flowlift.limits.encode_peak_bytes``.

Calibrates the encode's cost model (``ENCODE_PLAIN_CHANNELS``, ``ENCODE_TILED_CHANNELS``, ``ENCODE_TILE_VALUES``),
which ``--max-memory`` plans the upscaler's encode with. The peak is the bytes of live tensor storages the encode
creates (``flowlift.measure.tiled_inference``'s tracker, any device), the image itself not counted. ``--vae``
``taef2`` takes a weights folder (``--weights``); ``flux2`` and ``mage`` are built with random weights (the
released architectures: the peak depends on the shapes, not the values)::

    PYTHONPATH=src python benchmarks/measure_encode_memory.py --vae taef2 --weights ../shared/models/taef2 \\
        --dtype float32 --sizes 1024x1024 2048x2048
"""

from __future__ import annotations

import argparse
import time


def build_vae(kind: str, weights: str | None, dtype):
    import torch

    torch.manual_seed(0)
    if kind == "taef2":
        from flowlift.models.vae_loading import load_vae

        return load_vae(weights or "taef2", device="cpu", dtype=dtype)
    if kind == "flux2":
        from diffusers import AutoencoderKLFlux2

        from flowlift.models.vae import Flux2VAE

        return Flux2VAE(AutoencoderKLFlux2().to(dtype))
    from flowlift.models.mage_vae import MageVAEConfig, MageVAEModel
    from flowlift.models.vae import MageVAE

    return MageVAE(MageVAEModel(MageVAEConfig(), encoder=True).to(dtype))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vae", choices=("taef2", "flux2", "mage"), default="taef2")
    parser.add_argument("--weights", help="TAEF2's weights (a folder or file; default: the hub's)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--sizes", nargs="+", default=["1024x1024"], help="HEIGHTxWIDTH images")
    parser.add_argument("--modes", nargs="+", choices=("whole", "tiled"), default=["whole", "tiled"])
    args = parser.parse_args()

    import torch

    from flowlift.limits import encode_peak_bytes
    from flowlift.measure.tiled_inference import _PeakTensorMemory

    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    vae = build_vae(args.vae, args.weights, dtype)
    print("| image | mode | tracked peak | per pixel | estimate | CPU s |")
    print("|---|---|---|---|---|---|")
    for size in args.sizes:
        height, width = (int(side) for side in size.split("x"))
        image = torch.rand(1, 3, height, width)
        for mode in args.modes:
            tracker, start = _PeakTensorMemory(), time.process_time()
            with torch.inference_mode(), tracker:
                latents = vae.encode(image, tiled=mode == "tiled")
            seconds = time.process_time() - start
            del latents
            estimate = encode_peak_bytes(args.vae, height, width, dtype=dtype, tiled=mode == "tiled")
            print(
                f"| {width}x{height} | {mode} | {tracker.peak / 2**20:.1f} MiB "
                f"| {tracker.peak / (height * width):.1f} B | {estimate / 2**20:.1f} MiB | {seconds:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
