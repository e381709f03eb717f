"""Soak: many small images through ``flowlift upscale`` in one process; memory, files and threads stay flat.

Writes ``--images`` small photos-like PNGs (a few sizes, so several shapes are planned and run) and
upscales the folder 2x with one in-process ``flowlift upscale`` call (``flowlift.commands.cli.main``,
exactly the command line's path: planning, loading once, the per-image step, atomic writes, the
summary). The command's own ``wrote PATH`` line (stdout) is the per-image hook: after each one the
process's resident memory, open files and threads are read from ``/proc``
(:class:`soak_common.ProcessSample`). The run is flat when the level after the last image is within
10% (or 50 MiB) of the level after the first 10% of the images and files/threads did not grow
(:func:`soak_common.flat_verdict`); every output must open, decode fully and be 2x its input.

The weights need not be the released ones (memory does not depend on weight values): a random
Flow Upscaler (``--unet full``: the released architecture; ``tiny``: a narrow one for quick checks) and
the real TAEF2 from ``../shared/models/taef2``. Prints one Markdown row (docs/soak.md) and exits 1 when
the run is not flat or an output is bad.

    PYTHONPATH=src python benchmarks/soak_cli.py --images 300 [--unet full] [--device cpu]
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
from contextlib import redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # soak_common, next to this file

from soak_common import TABLE_HEADER, ProcessSample, flat_verdict, table_row, warm_index  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: (width, height) of the inputs, cycled: three shapes (one not a multiple of 16, so it is padded).
SIZES = ((64, 48), (48, 64), (72, 40))
TINY_UNET = {"base_channels": 32, "time_dim": 32, "cond_dim": 64}


@dataclass
class SoakResult:
    """What one soak run saw: a sample after every written image, one after the command returned."""

    images: int
    samples: list[ProcessSample] = field(default_factory=list)
    after_return: ProcessSample | None = None
    exit_code: int = -1
    seconds: float = 0.0
    bad_outputs: list[str] = field(default_factory=list)

    @property
    def warm(self) -> ProcessSample:
        return self.samples[warm_index(self.images)]

    @property
    def end(self) -> ProcessSample:
        return self.samples[-1]

    def problems(self) -> list[str]:
        found = list(self.bad_outputs)
        if self.exit_code != 0:
            found.append(f"flowlift upscale exited {self.exit_code}")
        if len(self.samples) != self.images:
            found.append(f"{len(self.samples)} of {self.images} images written")
            return found
        return found + flat_verdict(self.warm, self.end)


class _WroteHook(io.TextIOBase):
    """stdout that samples the process after every ``wrote PATH`` line (and passes everything through)."""

    def __init__(self, result: SoakResult, echo) -> None:
        self.result, self.echo, self.pending = result, echo, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.pending += text
        while "\n" in self.pending:
            line, self.pending = self.pending.split("\n", 1)
            if line.startswith("wrote "):
                self.result.samples.append(ProcessSample.of())
            elif self.echo is not None:
                print(line, file=self.echo)
        return len(text)


def make_inputs(folder: Path, count: int) -> list[Path]:
    """``count`` PNGs with smooth colour fields and noise (compressible like photos), sizes from :data:`SIZES`."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for index in range(count):
        width, height = SIZES[index % len(SIZES)]
        y, x = np.mgrid[0:height, 0:width] / max(width, height)
        base = np.stack([np.sin(6 * x + index), np.cos(5 * y - index), np.sin(4 * (x + y))], axis=-1)
        pixels = np.clip(127 + 80 * base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        path = folder / f"img{index:04d}.png"
        if not path.exists():
            Image.fromarray(pixels).save(path)
        paths.append(path)
    return paths


def random_weights(folder: Path, unet: str) -> Path:
    """A random Flow Upscaler checkpoint (fixed seed): the released architecture, or a narrow one."""
    import torch

    from flowlift.models.upscaler_unet import FlowUpscalerUNet
    from flowlift.models.upscaler_weights import save_upscaler

    path = folder / f"flow_upscaler_{unet}.safetensors"
    if not path.is_file():
        torch.manual_seed(0)
        model = FlowUpscalerUNet(**TINY_UNET) if unet == "tiny" else FlowUpscalerUNet()
        save_upscaler(model, path)
    return path


def check_outputs(inputs: list[Path], out: Path) -> list[str]:
    """One line per output that is missing, does not decode fully, or is not twice its input's size."""
    from PIL import Image

    bad = []
    for source in inputs:
        target = out / f"{source.stem}_x2.png"
        try:
            with Image.open(source) as image:
                expected = (image.width * 2, image.height * 2)
            with Image.open(target) as image:
                image.load()  # every byte decoded, not only the header
                if image.size != expected:
                    bad.append(f"{target.name}: {image.size[0]}x{image.size[1]}, expected {expected[0]}x{expected[1]}")
        except OSError as error:
            bad.append(f"{target.name}: {str(error).splitlines()[0]}")
    return bad


def soak(work: Path, images: int, *, vae: str, unet: str = "full", device: str = "cpu", echo=sys.stderr) -> SoakResult:
    """Upscale ``images`` generated inputs under ``work`` with one ``flowlift upscale`` call; see the module."""
    from flowlift.commands.cli import main

    inputs = make_inputs(work / f"in-{images}", images)
    weights = random_weights(work, unet)
    out = work / f"out-{images}-{unet}"
    if out.exists():
        for stale in out.iterdir():
            stale.unlink()
    result = SoakResult(images=images)
    argv = [
        "upscale",
        str(inputs[0].parent),
        "-o",
        str(out),
        "--upscaler",
        str(weights),
        "--vae",
        vae,
        "--device",
        device,
        "--no-progress",
    ]
    start = time.perf_counter()
    with redirect_stdout(_WroteHook(result, echo)):
        result.exit_code = main(argv)
    result.seconds = time.perf_counter() - start
    result.after_return = ProcessSample.of()
    result.bad_outputs = check_outputs(inputs, out)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--unet", choices=("full", "tiny"), default="full")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shared", default=os.environ.get("FLOWLIFT_SHARED", str(ROOT.parent / "shared")))
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "flowlift-soak-cli"))
    args = parser.parse_args()
    if args.images < 10:
        parser.error("--images must be at least 10 (the warm reference is taken after the first 10%)")
    vae = str(Path(args.shared) / "models" / "taef2")
    result = soak(Path(args.work), args.images, vae=vae, unet=args.unet, device=args.device)
    extra = (
        f"{args.unet} UNet, TAEF2, {args.device}, {result.seconds / max(1, len(result.samples)):.2f} s/image; "
        f"after return {result.after_return.rss / 2**20:.0f} MiB"
    )
    print(TABLE_HEADER)
    if len(result.samples) == args.images:
        print(table_row("flowlift upscale (one process)", args.images, result.warm, result.end, extra))
    problems = result.problems()
    print(
        f"outputs: {args.images - len(result.bad_outputs)} of {args.images} valid; "
        f"{'; '.join(problems) if problems else 'flat'}"
    )
    print(
        f"command: PYTHONPATH=src python benchmarks/soak_cli.py --images {args.images} --unet {args.unet} "
        f"--device {args.device}  ({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f})"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
