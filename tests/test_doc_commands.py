"""Every shell command of README.md and docs/*.md is either run here or listed with why not (issue 39 item 4).

* :data:`RUN`: commands a CPU machine can run without released weights. Each runs as written (``bash -c``,
  ``flowlift`` on ``PATH`` is this checkout) in a fresh folder beside a ``../shared`` (the real one, or a
  small stand-in with the same layout where the command reads whole folders), with the Hugging Face cache
  (``HF_HUB_CACHE``) holding stand-ins under the released names: a random full-size Flow Upscaler as
  ``TensorForger/FlowUpscaler``, the real TAEF2 as ``madebyollin/taef2``, a tiny random FLUX.2 VAE as
  ``black-forest-labs/FLUX.2-klein-4B``'s ``vae/``. Its documented output is checked.
* :data:`SKIP`: the others, each with its reason; the table is printed at the end of the pytest run.
* A command in neither table fails :func:`test_every_doc_command_is_run_or_skipped_with_a_reason`, and an
  entry no doc has any longer fails too, so neither list can rot.

Keys are the commands' words with the output option folded (``--out``, ``--output`` and ``-o`` read the
same), so a rename of that option in the docs keeps the tables valid.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from PIL import Image

from builders import fake_hub_cache
from conftest import shared_dir
from doc_commands import doc_commands

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"

NEEDS_WEIGHTS = "released weights (no small stand-in for them here)"
TEXT_ENCODER = "a text prompt: FLUX.2's Qwen3 text encoder and tokenizer (released weights)"
GPU = "a GPU (--device cuda)"
BENCHMARK = "a benchmark: minutes of machine time, run by hand (figures in the docs name the machine)"
INSTALLS = "installs packages (network, changes the environment)"
NETWORK = "downloads from the Hugging Face hub (network)"
SERVER = "starts the web app server (tests/test_app_*.py run it)"
HOST_APP = "needs a ComfyUI or InvokeAI installation (tests/test_comfyui.py and tests/test_invokeai.py build one)"
SYNOPSIS = "a synopsis with placeholders, not a command"
FRAGMENT = "options quoted in prose, not a whole command"
TEST_SUITE = "the test suite itself"
MANY_RANKS = "8 processes on one machine (tests/test_distributed.py runs the same paths with 2 ranks)"
CLUSTER = "two machines (--nnodes 2) or paths on a cluster's shared disk (/data/...)"

#: key -> why the command is not run here.
# A table, one documented command a row with its reason or scenario: kept as written.
# fmt: off
SKIP: dict[str, str] = {
    "pip install torch==2.13.0 -e .": INSTALLS,
    "pip install torch==2.13.0 -e .[test]": INSTALLS,
    "pip install -e .[app]": INSTALLS,
    "pip install -e .[gguf]": INSTALLS,
    "pip install -e .[gguf,lora]": INSTALLS,
    "pip install -e .[pixel]": INSTALLS,
    "pip install -e .[text]": INSTALLS,
    "/path/to/ComfyUI/venv/bin/python -m pip install -r requirements.txt": HOST_APP,
    "comfy node install flowlift": INSTALLS,
    "/path/to/invokeai/.venv/bin/python -m pip install kornia scikit-image numpy<2": HOST_APP,
    "ln -s $PWD /path/to/ComfyUI/custom_nodes/flowlift": HOST_APP,
    "ln -s $PWD $INVOKEAI_ROOT/nodes/flowlift": HOST_APP,
    "hf download black-forest-labs/FLUX.2-klein-4B": NETWORK,
    "python -m pytest -q": TEST_SUITE,
    "python -m pytest -q tests/test_denoiser.py tests/test_refine.py tests/test_cli_refine.py": TEST_SUITE,
    "python -m pytest -q tests/test_transformer_files.py tests/test_refine_memory.py tests/test_loras.py": TEST_SUITE,
    "python -m pytest -q tests/test_tiled_refine.py tests/test_cli_refine.py -k tile tests/test_refine_memory.py":
        TEST_SUITE,
    "PYTHONPATH=src python benchmarks/bench_first_run.py --baseline ade227f --repeats 2": BENCHMARK,
    "PYTHONPATH=src python benchmarks/bench_floor.py --repeats 1": BENCHMARK,
    "PYTHONPATH=src python benchmarks/bench_unet.py": BENCHMARK,
    "PYTHONPATH=src python benchmarks/bench_vae.py --tiling --sizes 1024 2048 --repeat 1": BENCHMARK,
    "PYTHONPATH=src python benchmarks/bench_vae.py --megapixels 1 4 16 --budget-s 480": BENCHMARK,
    "PYTHONPATH=src python benchmarks/bench_vae.py --vaes flux2 mage --ops decode --megapixels 1 --budget-s 2400":
        BENCHMARK,
    "PYTHONPATH=src python benchmarks/bench_vae.py --vaes mage taef2 --megapixels 1 --budget-s 900": BENCHMARK,
    "PYTHONPATH=src python benchmarks/bench_first_run.py --vae mage --baseline-vae taef2 --repeats 1": BENCHMARK,
    "PYTHONPATH=src python benchmarks/bench_mage_tiling.py --sizes 512 1024 --ops decode encode": BENCHMARK,
    "PYTHONPATH=src python benchmarks/bench_mage_tiling.py --sizes --strips 16384x128 16384x256 --ops decode":
        BENCHMARK,
    "PYTHONPATH=src python benchmarks/bench_mage_tiling.py --sizes --strips 2560x2560 --ops decode": BENCHMARK,
    "PYTHONPATH=src python benchmarks/bench_mage_tiling.py --check 768 --ops decode encode": BENCHMARK,
    "PYTHONPATH=src python benchmarks/bench_mage_decode.py --size 3072x2048": BENCHMARK,
    "flowlift upscale kodim23.png --scale 4 --vae mage": "the released Mage-VAE (a full-size random stand-in is "
        "0.3 GB; tests/test_vae_doors.py runs --vae mage through a hub cache with a small random file)",
    "flowlift upscale in4096.png --scale 4 --vae mage": "a 4096x4096 input to 16384x16384 with the released "
        "Mage-VAE; the memory line it prints is tests/test_upfront_plans.py's (the planner, before any encode)",
    "flowlift train --config OUT/config.json -o OUT": "resumes an earlier run's folder OUT (a placeholder); "
        "tests/test_train_outputs.py runs it on a run it made",
    "PYTHONPATH=src python benchmarks/bench_tiled_refine.py": BENCHMARK,
    "PYTHONPATH=src python benchmarks/soak_cli.py --images 300 --unet full --device cpu": BENCHMARK,
    "FLOWLIFT_SHARED=../shared PYTHONPATH=src python benchmarks/soak_app.py": BENCHMARK,
    "FLOWLIFT_SHARED=../shared PYTHONPATH=src python benchmarks/soak_app.py --full-size": BENCHMARK,
    "FLOWLIFT_SHARED=../shared PYTHONPATH=src python benchmarks/soak_app.py --full-size --requests 250": BENCHMARK,
    "PYTHONPATH=src python benchmarks/bench_gpu.py --device cuda": f"{BENCHMARK}; {GPU}",
    "PYTHONPATH=src python benchmarks/bench_gpu.py --device cuda --parts refine": f"{BENCHMARK}; {GPU}",
    "PYTHONPATH=src python benchmarks/bench_unet.py --device cuda --dtype bf16 --chunk 256 --repeats 3":
        f"{BENCHMARK}; {GPU}",
    "PYTHONPATH=src python benchmarks/bench_refine_windows.py --model black-forest-labs/FLUX.2-klein-4B "
    "--prompt-embeds prompt.safetensors --steps 9 --seed 424242 --width 1024 --height 1024 -o runs/windows":
        f"{BENCHMARK}; FLUX.2 Klein 4B {NEEDS_WEIGHTS}",
    "flowlift app --upscaler flow_upscaler.safetensors --vae taef2": SERVER,
    "flowlift app --vae taef2 --vae flux2 --device cuda --port 8080": f"{SERVER}; {GPU}",
    "flowlift app --vae taef2 --model black-forest-labs/FLUX.2-klein-4B": SERVER,
    "flowlift img2img photo.png --model black-forest-labs/FLUX.2-klein-4B --prompt a watercolour harbour "
    "--strength 0.6 --steps 4 --seed 1 -o harbour.png": TEXT_ENCODER,
    "flowlift img2img photo.png --mask mask.png --strength 1 --model /models/FLUX.2-klein-4B --prompt a red door "
    "--steps 4 --sampler heun": TEXT_ENCODER,
    "flowlift img2img photo.png --outpaint 0,0,256,0 --model /models/FLUX.2-klein-4B --prompt more beach --steps 4":
        TEXT_ENCODER,
    "flowlift img2img photo.png --model black-forest-labs/FLUX.2-dev --prompt ... --strength 0.5 --steps 28 "
    "--guidance 4": TEXT_ENCODER,
    "flowlift img2img photo.png --model /models/FLUX.2-klein-base-4B --prompt ... --negative-prompt --cfg-scale 4 "
    "--steps 50": TEXT_ENCODER,
    "flowlift img2img photo.png --model black-forest-labs/FLUX.2-klein-4B --lora watercolour.safetensors:0.8 "
    "--lora paper-texture.safetensors:0.4 --prompt a watercolour harbour --strength 0.6 --steps 8":
        f"{TEXT_ENCODER}; LoRA files",
    "flowlift img2img photo.png --model black-forest-labs/FLUX.2-klein-4B --transformer "
    "flux-2-klein-4b-fp8.safetensors --prompt ... --strength 0.5 --steps 8": f"{TEXT_ENCODER}; an fp8 file",
    "flowlift img2img photo.png --model black-forest-labs/FLUX.2-klein-9B --transformer flux-2-klein-9b-Q4_K_M.gguf "
    "--prompt-embeds harbour.safetensors --strength 0.5 --steps 8": f"the Klein 9B GGUF: {NEEDS_WEIGHTS}",
    "flowlift hires --image photo.png --prompt ... --model black-forest-labs/FLUX.2-klein-4B --scale 2 "
    "--refine-strength 0.3": TEXT_ENCODER,
    "flowlift hires --image photo.png --prompt ... --model black-forest-labs/FLUX.2-klein-4B --scale 4 "
    "--refine-strength 0.25": TEXT_ENCODER,
    "flowlift hires --prompt a lighthouse at dusk --model black-forest-labs/FLUX.2-klein-4B --width 1024 "
    "--height 1024 --base-steps 4 --scale 2 --refine-strength 0.3 --steps 28 -o lighthouse_2x.png": TEXT_ENCODER,
    "flowlift hires --prompt a lighthouse at dusk --model black-forest-labs/FLUX.2-klein-4B --max-memory 23GB "
    "--width 1024 --height 1024 --base-steps 4 --scale 4 --refine-strength 0.3 --steps 8 -o lighthouse_4x.png":
        TEXT_ENCODER,
    "flowlift hires --prompt-embeds lighthouse.safetensors --model black-forest-labs/FLUX.2-klein-9B --transformer "
    "flux-2-klein-9b-Q4_K_M.gguf --lora watercolour.safetensors:0.8 --max-memory 11GB --width 1024 --height 1024 "
    "--base-steps 4 --scale 2 --refine-strength 0.3 --steps 8": f"the Klein 9B GGUF and a LoRA: {NEEDS_WEIGHTS}",
    "flowlift hires --prompt-embeds lighthouse.safetensors --model black-forest-labs/FLUX.2-klein-9B --transformer "
    "flux-2-klein-9b-Q4_K_M.gguf --lora watercolour.safetensors:0.8 --max-memory 11GB --width 1024 --height 1024 "
    "--base-steps 4 --scale 2 --refine-strength 0.3 --steps 8 -o lighthouse_2x.png":
        f"the Klein 9B GGUF and a LoRA: {NEEDS_WEIGHTS}",
    "flowlift hires --prompt-embeds lighthouse.safetensors --model black-forest-labs/FLUX.2-klein-9B --transformer "
    "flux-2-klein-9b-Q4_K_M.gguf --max-memory 11GB --width 1024 --height 1024 --base-steps 4 --scale 4 "
    "--refine-strength 0.3 --steps 8 -o lighthouse_4x.png": f"the Klein 9B GGUF: {NEEDS_WEIGHTS}",
    "flowlift hires --prompt-embeds lighthouse.safetensors --model black-forest-labs/FLUX.2-klein-9B --max-memory "
    "23GB --width 1024 --height 1024 --base-steps 4 --scale 4 --refine-strength 0.3 --steps 8 -o lighthouse_4x.png":
        f"Klein 9B in bf16: {NEEDS_WEIGHTS}",
    "python -c import torch; from diffusers import Flux2KleinPipeline; from safetensors.torch import save_file "
    "pipe = Flux2KleinPipeline.from_pretrained('black-forest-labs/FLUX.2-klein-9B', transformer=None, vae=None, "
    "torch_dtype=torch.bfloat16) emb, _ = pipe.encode_prompt('a lighthouse at dusk, watercolour', device='cpu') "
    "save_file({'prompt_embeds': emb.float()}, 'lighthouse.safetensors')": f"Klein 9B's text encoder: {NEEDS_WEIGHTS}",
    "flowlift eval --run bicubic,flow,flow:transplant=0.5,flow:color=off --dataset photos/ --scale 4 --vae VAE "
    "--upscaler flow_upscaler.safetensors --device cuda --dtype bfloat16 -o report/": f"{GPU}; --vae VAE: {SYNOPSIS}",
    "flowlift eval --dataset my-photos/ --scale 4 -o compare/ --vae taef2 --upscaler TensorForger/FlowUpscaler "
    "--run lanczos,latent-bicubic,flow,flow:color=off --run spandrel:4x-UltraSharp.pth:ultrasharp "
    "--run spandrel:4x-UltraSharp.pth:ultrasharp+colorfix": f"the pixel extra and 4x-UltraSharp.pth: {NEEDS_WEIGHTS}",
    "flowlift eval --run lanczos,latent-bicubic,flow,sesqui:upscaler_Flux2.safetensors --dataset photos/ "
    "--scale 1.5 --vae flux2 -o report/": NEEDS_WEIGHTS,
    "flowlift eval OUTPUTS --reference INPUTS [--ground-truth GT] [--box x,y,w,h] -o report/": SYNOPSIS,
    "flowlift eval OUT_DIR --reference IN_DIR [--ground-truth GT_DIR] [--box x,y,w,h] -o report/": SYNOPSIS,
    "flowlift eval OUT/outputs/lanczos --reference OUT/outputs/inputs --ground-truth OUT/outputs/ground-truth "
    "-o report/": SYNOPSIS,
    "flowlift eval OUT --reference IN -o report/": SYNOPSIS,
    "flowlift status OUT": SYNOPSIS,
    "flowlift upscale --batch-size N": SYNOPSIS,
    "flowlift bands ../shared/images/kodak ../shared/images/photos --vae ../shared/models/taef2 -o bands/ [--full]":
        SYNOPSIS,
    "flowlift eval --run": FRAGMENT,
    "flowlift upscale --seed": FRAGMENT,
    "flowlift upscale --dtype auto": FRAGMENT,
    "flowlift upscale --compile": FRAGMENT,
    "flowlift upscale --vae mage_vae.safetensors": FRAGMENT,
    "flowlift upscale --latent-upscaler": FRAGMENT,
    "flowlift hires --latent-upscaler": FRAGMENT,
    "flowlift app --latent-upscaler sesqui:PATH": FRAGMENT,
    "flowlift img2img --tile-size/--tile-overlap/ --tile-batch": FRAGMENT,
    "flowlift img2img --reference": FRAGMENT,
    "flowlift upscale photo.png --scale 2 --vae mage -o out/":
        f"the Mage-VAE: {NEEDS_WEIGHTS}; tests/test_mage_vae.py runs random ones",
    "flowlift img2img --tile-size 32 --tile-overlap 16": FRAGMENT,
    "flowlift launch --nproc-per-node 8 -- upscale photos/ -o out/ --scale 4 --vae taef2": MANY_RANKS,
    "flowlift launch --nproc-per-node 8 -- eval --run lanczos,flow --dataset photos/ --scale 4 --vae taef2 "
    "--upscaler flow_upscaler.safetensors --device cuda -o eval-photos": f"{MANY_RANKS}; {GPU}",
    "python -m torch.distributed.run --standalone --nproc_per_node 8 -m flowlift train --config run.toml":
        f"{MANY_RANKS}; run.toml is the user's own file",
    "python -m torch.distributed.run --nnodes 2 --node_rank 0 --master_addr HOST --nproc_per_node 8 -m flowlift "
    "train --config run.toml": CLUSTER,
    "flowlift launch --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 --rdzv-id job1 "
    "--max-restarts 3 -- upscale /data/photos -o /data/out --scale 4 --vae taef2": CLUSTER,
    "flowlift launch --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 --rdzv-id "
    "upscale-photos --max-restarts 3 -- upscale /data/photos -o /data/out --scale 4 --vae taef2": CLUSTER,
    "flowlift status /data/out": CLUSTER,
    "flowlift train --config run.toml --set lr=5e-5": "run.toml is the user's own file (the docs show no content)",
}
# fmt: on

# ------------------------------------------------------------------------------------------------ stand-ins


def kodak_crop(name: str, size: tuple[int, int] = (256, 192)) -> Image.Image:
    """A crop of a real Kodak image (the inputs the commands get are made from these)."""
    with Image.open(shared_dir() / "images" / "kodak" / f"{name}.png") as im:
        left, top = min(200, im.width - size[0]), min(100, im.height - size[1])
        return im.convert("RGB").crop((left, top, left + size[0], top + size[1]))


def small_shared(real: Path, root: Path) -> Path:
    """A ``shared/`` with the real layout and TAEF2 but two small crops per image folder (whole-folder commands)."""
    folder = root / "shared"
    for sub, names in (("kodak", ("kodim03", "kodim23")), ("photos", ("kodim07", "kodim19"))):
        (folder / "images" / sub).mkdir(parents=True)
        for name in names:
            kodak_crop(name).save(folder / "images" / sub / f"{name}.png")  # small (bands needs a 32x24 latent)
    (folder / "models").mkdir()
    (folder / "models" / "taef2").symlink_to(real / "models" / "taef2")
    return folder


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory, shared) -> dict[str, Path]:
    """The weights every run command finds under the released names (built once)."""
    import torch

    from flowlift.models.upscaler_unet import FlowUpscalerUNet
    from flowlift.models.upscaler_weights import save_upscaler
    from tiny_flux2 import write_klein_pipeline_with_text_encoder

    root = tmp_path_factory.mktemp("stand-ins")
    torch.manual_seed(0)
    upscaler = save_upscaler(FlowUpscalerUNet(), root / "flow_upscaler.safetensors")  # the released size, random
    klein = write_klein_pipeline_with_text_encoder(root / "klein")  # its vae/ is also what `--vae flux2` finds
    cache = root / "hub"
    fake_hub_cache(cache, "TensorForger/FlowUpscaler", {"flow_upscaler.safetensors": upscaler})
    taef2 = shared / "models" / "taef2"
    fake_hub_cache(cache, "madebyollin/taef2", {n: taef2 / n for n in ("taef2_encoder.pth", "taef2_decoder.pth")})
    fake_hub_cache(
        cache,
        "black-forest-labs/FLUX.2-klein-4B",
        {str(p.relative_to(klein)): p for p in klein.rglob("*") if p.is_file()},
    )
    bin_dir = root / "bin"
    bin_dir.mkdir()
    launcher = bin_dir / "flowlift"  # `flowlift` is this checkout's, whatever is installed
    launcher.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m flowlift "$@"\n')
    launcher.chmod(launcher.stat().st_mode | stat.S_IXUSR)
    return {"upscaler": upscaler, "hub": cache, "bin": bin_dir}


# ------------------------------------------------------------------------------------------------ scenarios


@dataclass
class Scenario:
    """How one documented command is run here and what its documented output is."""

    prepare: Callable[[Path, Path, dict], None] = lambda work, shared, stand: None  # noqa: E731
    stdout: tuple[str, ...] = ()  # lines (regular expressions) the output must contain, in order
    files: tuple[str, ...] = ()  # files it must leave (relative to the working folder)
    real_shared: bool = False  # ../shared is the real one (else the small stand-in)
    interrupt_after: str = ""  # a progress line (regex) after which it is stopped with Ctrl-C, as a user would
    interrupts: int = 1  # Ctrl-C this many times, at that many such lines
    exit_code: int = 0
    env: dict[str, str] = field(default_factory=dict)


def images(folder: Path, names: tuple[str, ...], size=(64, 48), suffix=".png") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        kodak_crop(name, size).save(folder / f"{name}{suffix}")


def upscaled_pair(work: Path, shared: Path, _stand) -> None:
    """``out/kodim23_x4.png`` beside the stand-in ``../shared/images/kodak/kodim23.png``."""
    reference = shared / "images" / "kodak" / "kodim23.png"
    with Image.open(reference) as im:
        (work / "out").mkdir()
        im.resize((im.width * 4, im.height * 4), Image.Resampling.BICUBIC).save(work / "out" / "kodim23_x4.png")


def upscale_folders(work: Path, shared: Path, stand) -> None:
    images(work / "photos", ("kodim03", "kodim07"))
    images(work / "more", ("kodim19",), suffix=".jpg")
    shutil.copyfile(stand["upscaler"], work / "flow_upscaler.safetensors")


def upscale_folders_home(work: Path, shared: Path, stand) -> None:
    images(work / "photos", ("kodim03", "kodim07"))
    images(work / "more", ("kodim19",), suffix=".jpg")
    (work.parent / "home" / "models").mkdir(parents=True)
    (work.parent / "home" / "models" / "flow_upscaler.safetensors").symlink_to(stand["upscaler"])


def colorfix_folders(work: Path, shared: Path, _stand) -> None:
    images(work / "originals", ("kodim03", "kodim07"))
    (work / "upscaled").mkdir()
    for path in sorted((work / "originals").iterdir()):
        with Image.open(path) as im:
            im.resize((im.width * 2, im.height * 2)).save(work / "upscaled" / f"{path.stem}_x2.png")


def crops_of_512(work: Path, shared: Path, _stand, more: bool = False) -> None:
    """Photos for ``dataset images --crop 512``: one 512x512 image (8 crops), and one .jpg in more/."""
    images(work / "photos", ("kodim03",), size=(512, 512))
    if more:
        images(work / "more", ("kodim07",), size=(512, 512), suffix=".jpg")


def training_data(work: Path, shared: Path, stand) -> None:
    """``data/distill`` and ``data/photos`` as `flowlift dataset` writes them (a few small items, real TAEF2),
    and ``held_out/`` images for validation."""
    import torch

    from flowlift.models.vae_loading import load_vae
    from flowlift.training.datasets import ShardWriting, build_distill_dataset, build_images_dataset

    vae = load_vae(str(shared / "models" / "taef2"), device="cpu", dtype=torch.float32)
    images(work / "photos", ("kodim03",), size=(256, 256))
    # latents of 32x32: train's default crop (32 latent pixels) fits
    build_images_dataset(
        work / "data" / "photos",
        sorted((work / "photos").iterdir()),
        vae,
        crop=256,
        crops_per_image=2,
        writing=ShardWriting(progress=False),
    )
    build_distill_dataset(
        work / "data" / "distill",
        lambda noise: 0.5 * noise,
        vae,
        num_items=2,
        latent_size=(32, 32),
        writing=ShardWriting(progress=False),
    )
    images(work / "held_out", ("kodim23",), size=(256, 256))


def prompts_file(work: Path, _shared: Path, _stand) -> None:
    (work / "prompts.txt").write_text("a lighthouse at dusk\na watercolour harbour\n")


#: The first progress lines of the loops (the lines come every FLOWLIFT_PROGRESS_INTERVAL_S = 1 s).
STEP_LINE = r"^flowlift train: \d+/\d+ step"
DISTILL_LINE = r"^flowlift dataset: distill \d+/20000 item"


def training(output: str) -> Scenario:
    """A training line as written: the data, the validation images and the VAE are checked, the model built and
    the loop started; then Ctrl-C twice, at two progress lines (the first asks for a stop after the step with a
    checkpoint, the second stops at once: one step of the full-size UNet at batch 16 is minutes on 2 busy cores)."""
    return Scenario(
        prepare=training_data,
        interrupt_after=STEP_LINE,
        interrupts=2,
        exit_code=130,
        stdout=(r"flowlift train: \d+/\d+ step", r"flowlift train: interrupted"),
        files=(f"{output}/config.json",),
    )


#: key -> how it runs here.
# A table, one documented command a row with its reason or scenario: kept as written.
# fmt: off
RUN: dict[str, Scenario] = {
    # README, the first command: as written (a small kodim23 in the stand-in ../shared keeps it short)
    "flowlift upscale ../shared/images/kodak/kodim23.png --scale 4 --vae taef2 -o out/": Scenario(
        stdout=(r"wrote out/kodim23_x4\.png", r"flowlift upscale: 1 written, 0 skipped, 0 failed"),
        files=("out/kodim23_x4.png",)),
    "flowlift upscale kodim23.png --scale 4 --vae taef2": Scenario(
        prepare=lambda work, shared, _: kodak_crop("kodim23", (64, 48)).save(work / "kodim23.png"),
        stdout=(r"wrote kodim23_x4\.png",), files=("kodim23_x4.png",)),
    "flowlift upscale photo.png --scale 4": Scenario(  # the default VAE: the FLUX.2 VAE (a tiny random stand-in)
        prepare=lambda work, shared, _: kodak_crop("kodim23", (64, 48)).save(work / "photo.png"),
        stdout=(r"wrote photo_x4\.png",), files=("photo_x4.png",)),
    "flowlift upscale photos/ more/*.jpg -o out/ --scale 2 --upscaler flow_upscaler.safetensors --vae taef2":
        Scenario(prepare=upscale_folders, stdout=(r"flowlift upscale: 3 written, 0 skipped, 0 failed \(3 inputs\)",),
                 files=("out/kodim03_x2.png", "out/kodim07_x2.png", "out/kodim19_x2.png")),
    "flowlift upscale photos/ more/*.jpg -o out/ --scale 2 --upscaler ~/models/flow_upscaler.safetensors --vae taef2":
        Scenario(prepare=upscale_folders_home,
                 stdout=(r"flowlift upscale: 3 written, 0 skipped, 0 failed \(3 inputs\)",),
                 files=("out/kodim03_x2.png", "out/kodim07_x2.png", "out/kodim19_x2.png")),
    "flowlift colorfix upscaled/ --reference originals/ -o fixed/": Scenario(
        prepare=colorfix_folders, stdout=(r"wrote fixed/", r"flowlift colorfix: 2 written")),
    "flowlift eval --run lanczos,bicubic,latent-bicubic,vae-roundtrip --dataset ../shared/images/kodak --scale 4 "
    "--vae ../shared/models/taef2 -o eval-kodak4": Scenario(
        stdout=(r"\| method \|", r"\| vae-roundtrip \|", r"wrote .*eval-kodak4/results\.json"),
        files=("eval-kodak4/table.md", "eval-kodak4/results.json")),
    "flowlift eval --run lanczos,bicubic,latent-bicubic,vae-roundtrip --dataset ../shared/images/photos --scale 4 "
    "--vae ../shared/models/taef2 -o eval-photos4": Scenario(
        stdout=(r"\| method \|", r"\| vae-roundtrip \|"), files=("eval-photos4/table.md",)),
    "flowlift eval --run lanczos,bicubic,latent-bicubic,vae-roundtrip --dataset photos/ --scale 4 "
    "--vae ../shared/models/taef2 -o report/": Scenario(
        prepare=lambda work, shared, _: images(work / "photos", ("kodim03", "kodim07"), size=(128, 96)),
        stdout=(r"\| method \|", r"\| lanczos \|"), files=("report/table.md",)),
    "flowlift eval out/ --reference ../shared/images/kodak -o report/": Scenario(
        prepare=upscaled_pair, stdout=(r"\| outputs \| mean \|",), files=("report/results.json",)),
    "flowlift bands ../shared/images/kodak ../shared/images/photos --vae ../shared/models/taef2 --max-side 512 "
    "--full -o bands-taef2": Scenario(stdout=(r"wrote bands-taef2/bands\.json",), files=("bands-taef2/bands.md",)),
    "flowlift bands ../shared/images/kodak --limit 6 --vae ../shared/models/taef2 --full -o bands-kodak6": Scenario(
        stdout=(r"wrote bands-kodak6/bands\.json",), files=("bands-kodak6/bands.md",)),
    "flowlift dataset images photos/ --crop-px 512 --crops-per-image 8 --vae taef2 -o data/photos": Scenario(
        prepare=crops_of_512, stdout=(r"images dataset: 8 items of \[32, 64, 64\] in data/photos",)),
    "flowlift dataset images photos/ more/*.jpg --crop-px 512 --crops-per-image 8 --vae taef2 -o data/photos": Scenario(
        prepare=lambda work, shared, stand: crops_of_512(work, shared, stand, more=True),
        stdout=(r"images dataset: 16 items of \[32, 64, 64\] in data/photos",)),
    # the dataset and training lines: as written (20000 items, 20000 steps), with a tiny random Klein pipeline as
    # the teacher; stopped with Ctrl-C once the first items (steps) are done, as a user would (both resume)
    "flowlift dataset distill --teacher black-forest-labs/FLUX.2-klein-4B --prompts prompts.txt --num 20000 "
    "--vae taef2 -o data/distill": Scenario(prepare=prompts_file, interrupt_after=DISTILL_LINE, exit_code=130,
        stdout=(r"flowlift dataset: interrupted",), files=("data/distill/dataset.json",)),
    "flowlift dataset distill --teacher black-forest-labs/FLUX.2-klein-4B --prompts prompts.txt --num 20000 "
    "--width 1024 --height 1024 --steps 4 --vae taef2 -o data/distill": Scenario(prepare=prompts_file,
        interrupt_after=DISTILL_LINE, exit_code=130, stdout=(r"flowlift dataset: interrupted",),
        files=("data/distill/dataset.json",)),
    # the training lines: as written (20000 steps), see training()
    "flowlift train --data data/distill -o runs/a --steps 20000 --batch-size 16 --vae taef2 --val-images held_out/ "
    "--val-every 1000": training("runs/a"),
    "flowlift train --data data/distill -o runs/a --steps 20000 --batch-size 16 --lr 1e-4 --vae taef2 "
    "--val-images held_out/ --val-every 1000 --set ema_decay=0.9995": training("runs/a"),
    "flowlift train --data data/photos -o runs/ft --init TensorForger/FlowUpscaler": training("runs/ft"),
}
# fmt: on

# ------------------------------------------------------------------------------------------------ the tests

COMMANDS = doc_commands(REPO)
RUN_KEYS = sorted({c.key for c in COMMANDS if c.key in RUN})
#: What the terminal summary prints (tests/conftest.py): every skipped command, where, and why.
SKIPPED_REPORT: list[tuple[str, str, str]] = sorted(
    (c.where, c.text.splitlines()[0][:110], SKIP[c.key]) for c in COMMANDS if c.key in SKIP
)


def test_every_doc_command_is_run_or_skipped_with_a_reason():
    unknown = [f"{c.where}: {c.key}" for c in COMMANDS if c.key not in RUN and c.key not in SKIP]
    assert not unknown, (
        "commands in the docs that this test neither runs nor skips with a reason (add each to RUN or SKIP in "
        "tests/test_doc_commands.py):\n" + "\n".join(unknown)
    )
    keys = {c.key for c in COMMANDS}
    stale = sorted((set(RUN) | set(SKIP)) - keys)
    assert not stale, "entries for commands no doc has any longer (remove them):\n" + "\n".join(stale)
    assert not set(RUN) & set(SKIP)
    assert len(COMMANDS) > 50  # the extraction finds the docs' commands at all


def run_documented(command: str, scenario: Scenario, work: Path, env: dict[str, str]) -> tuple[int, str, str]:
    """``bash -c COMMAND`` in ``work``; with ``interrupt_after``, Ctrl-C (SIGINT) once that line shows."""
    process = subprocess.Popen(
        ["bash", "-c", command],
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    deadline = time.monotonic() + 600
    interrupts = scenario.interrupts if scenario.interrupt_after else 0
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line.rstrip("\n"))
        if interrupts and re.search(scenario.interrupt_after, line):
            os.killpg(process.pid, signal.SIGINT)
            interrupts -= 1
        if time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            break
    code = process.wait(timeout=120)
    return code, "\n".join(lines), ""


@pytest.mark.parametrize("key", RUN_KEYS)
def test_documented_command_runs_as_written(key, stand_ins, shared, tmp_path):
    scenario = RUN[key]
    command = next(c for c in COMMANDS if c.key == key)
    root = tmp_path
    if scenario.real_shared:
        (root / "shared").symlink_to(shared)
        used_shared = shared
    else:
        used_shared = small_shared(shared, root)
    work = root / "work"
    work.mkdir()
    scenario.prepare(work, used_shared, stand_ins)
    env = {
        **{k: v for k, v in os.environ.items() if k != "FLOWLIFT_CPU_BF16"},  # the CPU's own dtype, as for a user
        "PATH": f"{stand_ins['bin']}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(SRC),
        "HF_HUB_CACHE": str(stand_ins["hub"]),
        "HF_HUB_OFFLINE": "1",
        "HOME": str(root / "home"),
        "FLOWLIFT_PROGRESS_INTERVAL_S": "1",
        **scenario.env,
    }
    (root / "home").mkdir(exist_ok=True)
    code, output, _ = run_documented(command.text, scenario, work, env)
    assert code == scenario.exit_code, f"{command.where}: exit {code}\n{output[-4000:]}"
    position = 0
    for pattern in scenario.stdout:
        found = re.compile(pattern, re.M).search(output, position)
        assert found, f"{command.where}: no line matching {pattern!r} (in order) in:\n{output[-4000:]}"
        position = found.end()
    assert "Traceback" not in output, output[-4000:]
    for name in scenario.files:
        assert (work / name).exists(), f"{command.where}: {name} missing; output:\n{output[-4000:]}"
