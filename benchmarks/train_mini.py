"""Mini training benchmark: build an images dataset with TAEF2, train a small Flow Upscaler for a fixed
budget, and compare it with lanczos and latent-bicubic at 2x on held-out images.

CPU default (about 5-10 minutes on 2 cores)::

    python benchmarks/train_mini.py --out /tmp/train_mini

GPU (full-size architecture for about 8 minutes, reports samples/s)::

    python benchmarks/train_mini.py --out /tmp/train_full --device cuda --full --steps 100000 \
        --train-seconds 480 --crop-px 512 --crops-per-image 16 --batch-size 16 --threads 16

Data: ../shared/images (Kodak24 + photos); the held-out images (default kodim01, kodim05, kodim13,
kodim23) are excluded from training and evaluated as centre crops of ``--eval-size`` pixels:
``lr = area_downscale_2x(hr)``, each method upscales ``lr`` 2x and is scored against ``hr``
(PSNR, SSIM), by sharpness (mean |Laplacian| of the luma, ground truth's in the last column) and by
protocol-A drift against ``lr`` (max RGB cast /255, chroma change dC). ``vae-roundtrip`` =
decode(encode(hr)) is the ceiling any latent method can reach with this VAE.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

HELD_OUT = ("kodim01.png", "kodim05.png", "kodim13.png", "kodim23.png")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", default=os.environ.get("FLOWLIFT_SHARED", str(REPO.parent / "shared")))
    parser.add_argument("--out", default="/tmp/flowlift_train_mini")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a busy 2-core box)")
    parser.add_argument("--crop-px", type=int, default=128, help="dataset crop side in pixels")
    parser.add_argument("--crops-per-image", type=int, default=6)
    parser.add_argument("--crop", type=int, default=16, help="training crop side in target-latent pixels")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=600, help="schedule length (cosine to 10%% at the end)")
    parser.add_argument("--train-seconds", type=float, default=0, help="stop at this wall time (0 = all steps)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--base-channels", type=int, default=64)
    parser.add_argument("--time-dim", type=int, default=128)
    parser.add_argument("--cond-dim", type=int, default=256)
    parser.add_argument("--full", action="store_true", help="the released architecture (384/512/1024)")
    parser.add_argument("--eval-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-train", action="store_true", help="evaluate the existing run in --out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.full:
        args.base_channels, args.time_dim, args.cond_dim = 384, 512, 1024

    from flowlift.files.images import list_images
    from flowlift.models.vae_loading import load_vae
    from flowlift.training.config import build_config
    from flowlift.training.datasets import ShardWriting, build_images_dataset
    from flowlift.training.trainer import Trainer
    from flowlift.training.validation import evaluate_methods, load_validation_images, make_model_upscaler

    shared = Path(args.shared)
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    vae = load_vae(str(shared / "models" / "taef2"), device=device, dtype=torch.float32)
    held = [shared / "images" / "kodak" / name for name in HELD_OUT]
    train_images = [
        p
        for p in list_images([str(shared / "images" / "kodak"), str(shared / "images" / "photos")])
        if p.name not in HELD_OUT
    ]

    t0 = time.perf_counter()
    data = out / f"data-{args.crop_px}px-{args.crops_per_image}"
    manifest = build_images_dataset(
        data,
        train_images,
        vae,
        crop=args.crop_px,
        crops_per_image=args.crops_per_image,
        seed=args.seed,
        batch_size=8,
        writing=ShardWriting(shard_size=64, device=device, progress=True),
    )
    t_data = time.perf_counter() - t0
    print(
        f"dataset: {manifest['num_items']} items of {manifest['target_shape']} from {len(train_images)} images "
        f"in {t_data:.0f}s (resumed builds skip finished shards)"
    )

    run = out / f"run-{args.base_channels}"
    config = build_config(
        None,
        dict(
            data=str(data),
            output=str(run),
            crop=args.crop,
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            warmup_steps=min(50, args.steps // 10),
            min_lr_ratio=0.1,
            weight_decay=0.0,
            ema_decay=0.995,
            base_channels=args.base_channels,
            time_dim=args.time_dim,
            cond_dim=args.cond_dim,
            dropout=0.0,
            t_sampling="fixed",
            checkpoint_every=max(1, args.steps),
            log_every=25,
            seed=args.seed,
            device=args.device,
            resume="none",
            progress=True,
        ),
    )
    if args.skip_train:
        pass
    elif args.train_seconds > 0:
        config.time_limit_s = args.train_seconds  # stops (with a checkpoint) once the budget is spent
        Trainer(config).run()
    else:
        Trainer(config).run()
    t_train = time.perf_counter() - t0 - t_data
    import csv

    with open(run / "train_log.csv", newline="") as f:
        log = list(csv.DictReader(f))
    last_step = int(log[-1]["step"])
    samples = last_step * args.batch_size
    speed = "existing run" if args.skip_train else f"{samples / t_train:.1f} samples/s incl. start-up, {t_train:.0f}s"
    print(
        f"trained {last_step} steps x {args.batch_size} samples ({speed}); "
        f"loss {float(log[0]['loss']):.4f} -> {float(log[-1]['loss']):.4f}"
    )

    from flowlift.models.upscaler_weights import load_upscaler

    latest = sorted((run / "checkpoints").glob("step-*"))[-1]
    model = load_upscaler(latest / "flow_upscaler.safetensors", device=device, dtype=torch.float32)
    images = load_validation_images([str(p) for p in held], len(held), args.eval_size)

    @torch.no_grad()
    def roundtrip(hr: torch.Tensor) -> torch.Tensor:
        return vae.decode(vae.encode(hr.to(device))).clamp(0, 1)

    methods = {
        "model (color fix)": make_model_upscaler(model, vae, device, seed=args.seed, color_fix=True),
        "model (raw)": make_model_upscaler(model, vae, device, seed=args.seed, color_fix=False),
    }
    results = evaluate_methods(images, vae, methods, include_baselines=True, references={"vae-roundtrip": roundtrip})
    t_total = time.perf_counter() - t0
    header = (
        f"| method | PSNR dB | SSIM | sharpness (gt {results['lanczos']['sharpness_gt']:.2f}) | "
        "drift cast_max /255 | drift dC |"
    )
    print()
    print(
        f"2x on {len(images)} held-out Kodak crops ({args.eval_size}px), model {args.base_channels}/"
        f"{args.time_dim}/{args.cond_dim} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params), "
        f"{last_step} steps, total {t_total:.0f}s"
    )
    print(header)
    print("|---|---|---|---|---|---|")
    for name in ("model (color fix)", "model (raw)", "latent-bicubic", "lanczos", "vae-roundtrip"):
        r = results[name]
        print(
            f"| {name} | {r['psnr']:.2f} | {r['ssim']:.4f} | {r['sharpness']:.2f} | {r['cast_max']:.2f} | "
            f"{r['dC']:+.2f} |"
        )
    best = results["model (color fix)"]
    bic = results["latent-bicubic"]
    print()
    print(
        f"beats latent-bicubic on PSNR: {best['psnr'] > bic['psnr']} ({best['psnr']:.2f} vs {bic['psnr']:.2f}); "
        f"on sharpness: {best['sharpness'] > bic['sharpness']} ({best['sharpness']:.2f} vs {bic['sharpness']:.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
