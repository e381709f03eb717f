"""Random Mage-VAE checkpoints in the released layout, for the tests (narrow or full size)."""

from __future__ import annotations

from pathlib import Path

import torch

from flowlift.models.mage_vae import MageVAEConfig, MageVAEModel

#: A narrow codec with every part of the released one (widths divisible by the 32 GroupNorm groups).
NARROW = MageVAEConfig(hidden=64, encoder_head=96, encoder_blocks=2, decoder_blocks=2, pixel_width=8)

#: Tensors of the FLUX.2-VAE encoder side stored with the released decoder; loaders skip them.
SKIPPED = {
    "pipeline.y_embedder.encoder.conv_in.weight": (128, 3, 3, 3),
    "pipeline.y_embedder.encoder.conv_in.bias": (128,),
    "pipeline.y_embedder.bottleneck.weight": (128, 64, 1, 1),
}


def released_state(config: MageVAEConfig = NARROW, *, seed: int = 0, encoder: bool = True) -> dict[str, torch.Tensor]:
    """A random, unfolded state dict with the released key names (norm affines randomized too)."""
    torch.manual_seed(seed)
    model = MageVAEModel(config, encoder=encoder)
    state = {}
    for key, value in model.state_dict().items():
        value = value.clone()
        if ".norm" in key or "in_ln" in key:  # GroupNorm / LayerNorm / RMSNorm affines: away from 1 and 0
            value = (1.0 if key.endswith("weight") else 0.0) + 0.1 * torch.randn_like(value)
        prefix = "student.dconv_encoder." if key.startswith("encoder.") else "pipeline."
        state[prefix + key.split(".", 1)[1]] = value
    for key, shape in SKIPPED.items():
        state[key] = torch.randn(shape)
    return state


def save_released(path: Path, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> Path:
    from safetensors.torch import save_file

    save_file({k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in state.items()}, str(path))
    return path
