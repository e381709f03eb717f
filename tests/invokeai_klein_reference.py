"""flowlift's own tiled refine on what the InvokeAI server held, for tests/test_invokeai.py (run in the InvokeAI venv).

``python tests/invokeai_klein_reference.py PIPELINE CONDITIONING LATENTS OUT TILE OVERLAP`` loads the tiny Klein
pipeline's transformer and VAE as InvokeAI's ``Flux2DiffusersModel`` does (bfloat16), the Qwen3 conditioning the
server's ``flux2_klein_text_encoder`` stored (read as InvokeAI reads it: ``weights_only`` with its conditioning
classes as the only allowed globals) and the raw latents of its ``flux2_vae_encode``, then runs
``flowlift.refine.loop.tiled_refine_raw_latents`` with the test's settings and saves the refined raw
latents to OUT (safetensors, key ``latents``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
from invokeai.backend.stable_diffusion.diffusion.conditioning_data import ConditioningFieldData, FLUXConditioningInfo
from safetensors.torch import save_file

from flowlift.models.vae import Flux2VAE
from flowlift.refine.loop import tiled_refine_raw_latents
from flowlift.refine.settings import SamplingSettings
from flowlift.refine.tiling import TileRequest

#: The Klein test's refine settings (test_invokeai.py's node fields).
STRENGTH, STEPS, SEED = 0.6, 2, 3


def main(pipeline: Path, conditioning: Path, latents: Path, out: Path, tile: str, overlap: int) -> None:
    transformer = Flux2Transformer2DModel.from_pretrained(pipeline / "transformer", torch_dtype=torch.bfloat16)
    vae = Flux2VAE(AutoencoderKLFlux2.from_pretrained(pipeline / "vae", torch_dtype=torch.bfloat16))
    with torch.serialization.safe_globals([ConditioningFieldData, FLUXConditioningInfo]):
        stored = torch.load(conditioning, weights_only=True)
    embeds = stored.conditionings[0].t5_embeds.to(dtype=transformer.dtype)
    raw = torch.load(latents, weights_only=True)
    with torch.no_grad():
        refined, _ = tiled_refine_raw_latents(
            transformer.eval(),
            raw,
            vae.bn_mean,
            vae.bn_std,
            embeds,
            strength=STRENGTH,
            sampling=SamplingSettings(steps=STEPS, seed=SEED),
            tiles=TileRequest.parse(tile, overlap),
            device="cpu",
        )
    save_file({"latents": refined.contiguous()}, str(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), sys.argv[5], int(sys.argv[6]))
