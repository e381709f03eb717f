"""Time (and on CUDA, peak extra memory) of the two colour-drift stages at several output sizes.

    python benchmarks/bench_colorfix.py --device cpu --sides 1024 2048 --repeats 3
    python benchmarks/bench_colorfix.py --drift ../shared/images/photos/Wine_by_Jakkub_Mede.png

``--drift PHOTO`` instead prints protocol A (flowlift.measure.metrics.drift_at_input_scale) for the synthetic
drift of tests/test_colorfix.py: the photo at 192 px wide, Lanczos-upscaled 4x, given a cast
(+1.5 a*, -2 b*), +15 % chroma and a tone stretch (L* x1.1 around 50, +2), then stage 2 at
strengths 0 / 0.5 / 1 against the 192 px photo.

Stage 1 runs on a (1, 32, S/8, S/8) output latent with its (S/16) conditioning; stage 2 on a
(1, 3, S, S) decoded image against a 4x smaller reference (a 2-pass chain), with the default two
iterations. Inputs are random (cost does not depend on content). Prints one table row per size.

``--cast-vs REV`` instead runs stage 2 of revision REV (its ``colorfix.py``, loaded from git) and of this tree on
every image under ``--images`` (the Kodak and CC photos of ``../shared/images``): each image at ``--width`` px
wide as the reference, its synthetic 4x drifted upscale (as ``--drift``) as the output, both at strength 1;
prints each side's residual RGB cast (protocol A's ``cast_r/g/b``, /255, on the 8-bit results), the largest
difference between the two casts, and the 8-bit pixels that differ (issue 47: within 0.01/255).

    python benchmarks/bench_colorfix.py --cast-vs 20ba227 --images ../shared/images
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flowlift.upscale.colorfix import lab_lowband_transplant, latent_lowband_transplant


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(fn, device: torch.device, repeats: int) -> tuple[float, float | None]:
    """Median seconds over ``repeats`` runs (after one warm-up) and CUDA peak extra MiB (else None)."""
    fn()
    _sync(device)
    times = []
    peak = None
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        result = fn()
        _sync(device)
        times.append(time.perf_counter() - start)
        if device.type == "cuda":
            peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
        del result
    return statistics.median(times), peak


def drifted_upscale(photo_path: str, width: int = 192) -> tuple[torch.Tensor, torch.Tensor]:
    """The photo at ``width`` px wide (the reference) and its synthetic drifted 4x upscale (Lanczos, then a cast of
    +1.5 a* / -2 b*, +15 % chroma, L* x1.1 around 50 + 2), both float [0, 1] (1, 3, H, W)."""
    from kornia.color import lab_to_rgb, rgb_to_lab
    from PIL import Image

    from flowlift.files.images import to_tensor

    photo = Image.open(photo_path).convert("RGB")
    small = photo.resize((width, round(width * photo.height / photo.width)), Image.Resampling.BOX)
    big = to_tensor(small.resize((small.width * 4, small.height * 4), Image.Resampling.LANCZOS))
    lab = rgb_to_lab(big)
    light = (lab[:, :1] - 50.0) * 1.1 + 52.0
    colour = lab[:, 1:] * 1.15 + torch.tensor([1.5, -2.0]).view(1, 2, 1, 1)
    return to_tensor(small), lab_to_rgb(torch.cat([light, colour], 1))


def cast_table(revision: str, images: str, width: int) -> None:
    """Stage 2 of ``revision`` and of this tree on every image: residual casts and 8-bit differences."""
    import importlib.util
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from flowlift.files.images import IMAGE_SUFFIXES, tensor_to_uint8
    from flowlift.measure.metrics import drift_at_input_scale

    root = Path(__file__).resolve().parents[1]

    def show(name: str) -> str | None:
        shown = subprocess.run(
            ["git", "-C", str(root), "show", f"{revision}:src/flowlift/upscale/{name}.py"],
            capture_output=True,
            text=True,
        )
        return shown.stdout if shown.returncode == 0 else None

    # the revision's colorfix.py with its own colorfix_lab.py (where it had one), not this tree's
    folder = Path(tempfile.mkdtemp())
    source, lab = show("colorfix"), show("colorfix_lab")
    if source is None:
        raise SystemExit(f"{revision} has no src/flowlift/upscale/colorfix.py")
    if lab is not None:
        (folder / "colorfix_lab_old.py").write_text(lab)
        source = source.replace("from flowlift.upscale.colorfix_lab import", "from colorfix_lab_old import")
        sys.path.insert(0, str(folder))
    path = folder / "colorfix_old.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("colorfix_old", path)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    files = sorted(p for p in Path(images).rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    print(f"stage 2 of {revision} vs this tree, {len(files)} images at {width} px wide, 4x drifted, strength 1")
    print("| image | cast R/G/B (/255), " + revision + " | this tree | largest cast change | 8-bit pixels changed |")
    print("|---|---|---|---|---|")
    worst = 0.0
    cpu = {"old": 0.0, "new": 0.0}
    for file in files:
        small, drifted = drifted_upscale(str(file), width)
        reference = tensor_to_uint8(small)[0]
        results = {}
        for name, fn in (("old", old.lab_lowband_transplant), ("new", lab_lowband_transplant)):
            start = time.process_time()
            results[name] = tensor_to_uint8(fn(drifted, small, 1.0))[0]
            cpu[name] += time.process_time() - start
        casts = {k: drift_at_input_scale(v, reference) for k, v in results.items()}
        change = max(abs(casts["new"][c] - casts["old"][c]) for c in ("cast_r", "cast_g", "cast_b"))
        worst = max(worst, change)
        changed = int((results["new"] != results["old"]).any(axis=-1).sum())
        cells = ["/".join(f"{casts[k][c]:+.4f}" for c in ("cast_r", "cast_g", "cast_b")) for k in ("old", "new")]
        pixels = results["new"].shape[0] * results["new"].shape[1]
        print(f"| {file.name} | {cells[0]} | {cells[1]} | {change:.5f} | {changed} of {pixels} |", flush=True)
    print(
        f"largest cast change over all images and channels: {worst:.5f}/255; "
        f"stage 2 CPU time {cpu['old']:.1f} s ({revision}) vs {cpu['new']:.1f} s (this tree)"
    )


def drift_table(photo_path: str) -> None:
    from flowlift.files.images import tensor_to_uint8
    from flowlift.measure.metrics import drift_at_input_scale

    small, drifted = drifted_upscale(photo_path)
    reference = tensor_to_uint8(small)[0]
    keys = ["cast_r", "cast_g", "cast_b", "c_mean_change_pct", "c_p99_change", "l_std_change", "l_p5_change"]
    keys.append("l_p95_change")
    print("| stage 2 strength | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for strength in (0.0, 0.5, 1.0):
        fixed = lab_lowband_transplant(drifted, small, strength)
        metrics = drift_at_input_scale(tensor_to_uint8(fixed)[0], reference)
        print(f"| {strength} | " + " | ".join(f"{metrics[k]:+.3f}" for k in keys) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sides", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--drift", metavar="PHOTO", help="print the synthetic-drift table for PHOTO instead")
    parser.add_argument("--cast-vs", metavar="REV", help="compare stage 2 with revision REV's on --images")
    parser.add_argument("--images", default="../shared/images")
    parser.add_argument("--width", type=int, default=384, help="--cast-vs: the reference's width")
    args = parser.parse_args()
    if args.cast_vs:
        cast_table(args.cast_vs, args.images, args.width)
        return
    if args.drift:
        drift_table(args.drift)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    print(f"device={device} threads={torch.get_num_threads()} repeats={args.repeats}")
    print("| output side | stage 1 (latent) ms | stage 2 (pixel, 2 iterations) ms | stage 2 peak extra MiB |")
    print("|---|---|---|---|")
    for side in args.sides:
        out_latent = torch.randn(1, 32, side // 8, side // 8, generator=gen).to(device)
        cond = torch.randn(1, 32, side // 16, side // 16, generator=gen).to(device)
        s1, _ = _measure(lambda o=out_latent, c=cond: latent_lowband_transplant(o, c, 1.0), device, args.repeats)
        del out_latent, cond
        image = torch.rand(1, 3, side, side, generator=gen).to(device)
        reference = torch.rand(1, 3, side // 4, side // 4, generator=gen).to(device)
        # in place, as the pipeline runs it: the result overwrites the decoded image
        s2, peak = _measure(
            lambda i=image, r=reference: lab_lowband_transplant(i, r, 1.0, inplace=True), device, args.repeats
        )
        del image, reference
        peak_text = f"{peak:.0f}" if peak is not None else "n/a (CPU)"
        print(f"| {side} | {s1 * 1e3:.1f} | {s2 * 1e3:.0f} | {peak_text} |")


if __name__ == "__main__":
    main()
