"""Soak: prompts through the flowlift nodes on one real ComfyUI server; its memory, files and threads stay flat.

    python benchmarks/soak_comfyui.py [--prompts 40]

Starts the server of tests/comfy_server.py (ComfyUI 0.33 with this pack, small random upscalers, the
real TAEF2, bound to 127.0.0.1, stopped at the end) and sends the prompts one after another in a cycle
over the three flowlift nodes: FlowliftUpscaleImage 4x with TAEF2 on a 192x128 Kodak crop,
FlowliftUpscaleLatent 2x between TAEF2's VAEEncode and VAEDecode, and FlowliftColorFix on a drifted 2x.
Each prompt has its own seed or strength, so ComfyUI's cache answers none of them. The server process
is sampled from /proc (benchmarks/soak_common.py) after the first 10% of the prompts and after the
last. Every prompt must succeed and every output must be a readable PNG of the expected size that is
not blank. Prints the table row and exits 1 when a prompt failed, an output was invalid or the run
was not flat.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO / "benchmarks", REPO / "tests", REPO / "src"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from comfy_server import ComfyServer, comfy_server  # noqa: E402
from comfy_venv import shared_dir  # noqa: E402
from soak_common import TABLE_HEADER, ProcessSample, flat_verdict, table_row, warm_index  # noqa: E402

SOAK_W, SOAK_H = 192, 128
UPSCALER = "flow_upscaler.safetensors"
TAEF2 = "taef2_encoder.pth"
KINDS = ("upscale image 4x", "upscale latent 2x", "colour fix")


@dataclasses.dataclass
class SoakResult:
    """What a soak run saw: prompts sent, answered (finished, any status), valid outputs, problems."""

    prompts: int
    answered: int
    valid: int
    failures: list[str]
    warm: ProcessSample
    end: ProcessSample
    seconds: float


def write_soak_inputs(root: Path, shared: Path, size: tuple[int, int]) -> None:
    """``soak.png`` (a Kodak crop of ``size``) and ``soak_2x.png`` (its Lanczos 2x with a colour cast) in input/."""
    width, height = size
    source = Image.open(shared / "images" / "kodak" / "kodim23.png").convert("RGB")
    crop = source.crop((200, 100, 200 + 2 * width, 100 + 2 * height)).resize(size, Image.LANCZOS)
    crop.save(root / "input" / "soak.png")
    drifted = np.asarray(crop.resize((2 * width, 2 * height), Image.LANCZOS), dtype=np.float32)
    drifted = np.clip(drifted * [1.06, 1.0, 0.92] + [5, 0, -3], 0, 255).round().astype(np.uint8)
    Image.fromarray(drifted).save(root / "input" / "soak_2x.png")


def soak_prompt(index: int, prompts: int, size: tuple[int, int]) -> tuple[dict, tuple[int, int]]:
    """Prompt ``index`` of the cycle (its own seed or strength) and the size its output must have."""
    width, height = size
    load = {"class_type": "LoadImage", "inputs": {"image": "soak.png"}}
    taef2 = {"class_type": "FlowliftTAEF2Loader", "inputs": {"taef2_name": TAEF2}}
    upscaler = {"class_type": "FlowliftUpscalerLoader", "inputs": {"upscaler_name": UPSCALER}}
    save = {"class_type": "SaveImage", "inputs": {"images": ["9", 0], "filename_prefix": f"soak/{index:04d}"}}
    kind = KINDS[index % len(KINDS)]
    if kind == "upscale image 4x":
        work = {
            "9": {
                "class_type": "FlowliftUpscaleImage",
                "inputs": {
                    "image": ["1", 0],
                    "upscaler": ["3", 0],
                    "vae": ["2", 0],
                    "scale": 4.0,
                    "seed": index,
                    "transplant_strength": 1.0,
                    "color_fix_strength": 1.0,
                    "chunked": "auto",
                },
            }
        }
        return {"1": load, "2": taef2, "3": upscaler, **work, "10": save}, (4 * width, 4 * height)
    if kind == "upscale latent 2x":
        work = {
            "7": {"class_type": "VAEEncode", "inputs": {"pixels": ["1", 0], "vae": ["2", 0]}},
            "8": {
                "class_type": "FlowliftUpscaleLatent",
                "inputs": {
                    "upscaler": ["3", 0],
                    "samples": ["7", 0],
                    "scale": 2.0,
                    "seed": index,
                    "transplant_strength": 1.0,
                    "chunked": "auto",
                },
            },
            "9": {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["2", 0]}},
        }
        return {"1": load, "2": taef2, "3": upscaler, **work, "10": save}, (2 * width, 2 * height)
    drifted = {"class_type": "LoadImage", "inputs": {"image": "soak_2x.png"}}
    strength = 0.5 + 0.5 * index / max(1, prompts)  # a new value each prompt: never answered from the cache
    work = {
        "9": {
            "class_type": "FlowliftColorFix",
            "inputs": {"image": ["4", 0], "reference": ["1", 0], "strength": strength},
        }
    }
    return {"1": load, "4": drifted, **work, "10": save}, (2 * width, 2 * height)


def output_problem(path: Path, size: tuple[int, int]) -> str | None:
    """Why an output image is not valid (unreadable, wrong size, blank), or None."""
    try:
        with Image.open(path) as image:
            image.load()
            if image.size != size:
                return f"{path.name} is {image.size[0]}x{image.size[1]}, expected {size[0]}x{size[1]}"
            array = np.asarray(image.convert("RGB"), dtype=np.float32)
    except OSError as error:
        return f"{path.name} is not a readable image: {error}"
    if array.std() < 2 or array.mean() < 5:
        return f"{path.name} is blank (mean {array.mean():.1f}, std {array.std():.1f})"
    return None


def run_prompt(server: ComfyServer, index: int, prompts: int, size: tuple[int, int]) -> tuple[bool, str | None]:
    """Prompt ``index``: (answered, the problem with it or None)."""
    workflow, size = soak_prompt(index, prompts, size)
    try:
        entry = server.wait(server.queue(workflow))
    except AssertionError as error:  # refused or never finished: reported, the run goes on
        return False, f"prompt {index}: {str(error).splitlines()[0][:200]}"
    if entry["status"]["status_str"] != "success":
        return True, f"prompt {index} ({KINDS[index % len(KINDS)]}): {entry['status']['status_str']}"
    problem = output_problem(server.output_file(entry, "10"), size)
    return True, None if problem is None else f"prompt {index}: {problem}"


def soak(server: ComfyServer, shared: Path, prompts: int, size: tuple[int, int] = (SOAK_W, SOAK_H)) -> SoakResult:
    """Send ``prompts`` prompts on an input of ``size`` one by one; sample the server after the warm-up
    share and at the end."""
    write_soak_inputs(server.root, shared, size)
    pid = server.process.pid
    answered = valid = 0
    failures: list[str] = []
    warm = ProcessSample.of(pid)
    started = time.monotonic()
    for index in range(prompts):
        was_answered, problem = run_prompt(server, index, prompts, size)
        answered += was_answered
        valid += was_answered and problem is None
        failures += [problem] if problem else []
        if index == warm_index(prompts):
            warm = ProcessSample.of(pid)
    end = ProcessSample.of(pid)
    return SoakResult(prompts, answered, valid, failures, warm, end, time.monotonic() - started)


def problems(result: SoakResult) -> list[str]:
    """Everything that makes the run fail: unanswered or failed prompts, invalid outputs, growth."""
    unanswered = result.prompts - result.answered
    return (
        ([f"{unanswered} prompts unanswered"] if unanswered else [])
        + result.failures
        + flat_verdict(result.warm, result.end)
    )


def report_row(result: SoakResult) -> str:
    extra = (
        f"{result.answered}/{result.prompts} answered, {result.valid} valid outputs, "
        f"{result.seconds / max(1, result.prompts):.1f} s/prompt"
    )
    return table_row("ComfyUI server, flowlift nodes", result.prompts, result.warm, result.end, extra)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=40)
    args = parser.parse_args()
    if args.prompts < 1:
        parser.error("--prompts must be at least 1")
    shared = shared_dir()
    with tempfile.TemporaryDirectory(prefix="flowlift-soak-comfyui-") as tmp, comfy_server(Path(tmp), shared) as server:
        result = soak(server, shared, args.prompts)
    print(TABLE_HEADER)
    print(report_row(result))
    for problem in problems(result):
        print(f"soak: {problem}", file=sys.stderr)
    return 1 if problems(result) else 0


if __name__ == "__main__":
    sys.exit(main())
