"""Tiny random FLUX.2 components for the refine tests (diffusers classes, seconds on a CPU)."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import torch

TEXT_DIM = 32


def tiny_transformer(*, guidance_embeds: bool = False, seed: int = 0, text_dim: int = TEXT_DIM, **config):
    """A 1+1-layer ``Flux2Transformer2DModel`` (2 heads of 16, rope axes 4x4; ``config`` on top) with random
    weights."""
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(seed)
    model = Flux2Transformer2DModel(
        **{
            "patch_size": 1,
            "in_channels": 128,
            "num_layers": 1,
            "num_single_layers": 1,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": text_dim,
            "timestep_guidance_channels": 32,
            "axes_dims_rope": (4, 4, 4, 4),
            "guidance_embeds": guidance_embeds,
            **config,
        }
    )
    return model.eval().requires_grad_(False)


def tiny_vae(*, seed: int = 0, bn_var: float = 3.13, bn_mean_scale: float = 0.3):
    """A small random ``AutoencoderKLFlux2`` (8x down, 32 latent channels) with FLUX.2-like BN stats.

    ``bn.running_var`` is set near the real VAE's ~3.1 (bn_std ~1.77) so that dividing the noise by
    bn_std is a large, visible error.
    """
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        norm_num_groups=4,
        latent_channels=32,
        mid_block_add_attention=False,
    )
    with torch.no_grad():
        vae.bn.running_var.copy_(bn_var + 0.3 * torch.rand(128))
        vae.bn.running_mean.copy_(bn_mean_scale * torch.randn(128))
    return vae.eval().requires_grad_(False)


def prompt_embeds(tokens: int = 5, *, seed: int = 1, batch: int = 1) -> torch.Tensor:
    return torch.randn(batch, tokens, TEXT_DIM, generator=torch.Generator().manual_seed(seed))


class DiffusersHelpers:
    """diffusers 0.42.1 ``Flux2Pipeline`` static helpers, transcribed line for line."""

    @staticmethod
    def _prepare_text_ids(x):
        B, L, _ = x.shape
        return torch.stack(
            [torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(L)) for _ in range(B)]
        )

    @staticmethod
    def _prepare_latent_ids(latents):
        batch_size, _, height, width = latents.shape
        ids = torch.cartesian_prod(torch.arange(1), torch.arange(height), torch.arange(width), torch.arange(1))
        return ids.unsqueeze(0).expand(batch_size, -1, -1)

    @staticmethod
    def _prepare_image_ids(image_latents, scale=10):
        t_coords = [(scale + scale * t).view(-1) for t in torch.arange(0, len(image_latents))]
        out = []
        for x, t in zip(image_latents, t_coords, strict=True):
            _, height, width = x.squeeze(0).shape
            out.append(torch.cartesian_prod(t, torch.arange(height), torch.arange(width), torch.arange(1)))
        return torch.cat(out, dim=0).unsqueeze(0)

    @staticmethod
    def _patchify_latents(latents):
        b, c, h, w = latents.shape
        latents = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
        return latents.reshape(b, c * 4, h // 2, w // 2)

    @staticmethod
    def _unpatchify_latents(latents):
        b, c, h, w = latents.shape
        latents = latents.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
        return latents.reshape(b, c // 4, h * 2, w * 2)

    @staticmethod
    def _pack_latents(latents):
        b, c, h, w = latents.shape
        return latents.reshape(b, c, h * w).permute(0, 2, 1)


class Spy(torch.nn.Module):
    """Wraps a transformer: records the keyword arguments of each call, then runs the real model."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config, self.seen = inner, inner.config, []

    def forward(self, **kwargs):
        self.seen.append({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()})
        return self.inner(**kwargs)


def write_model_dir(root: Path) -> Path:
    """A diffusers-layout FLUX.2 Klein model folder at ``root``: transformer/ and vae/ with the tiny random
    weights above, and the pipeline's model_index.json."""
    tiny_transformer().save_pretrained(root / "transformer")
    tiny_vae().save_pretrained(root / "vae")
    (root / "model_index.json").write_text(json.dumps({"_class_name": "Flux2KleinPipeline"}))
    return root


#: The tiny Qwen3 encoder's width: the Klein text encoder node stacks three of its hidden states, so the
#: transformer's context is 3x this wide.
QWEN3_WIDTH = 16
QWEN3_VOCAB = 151936  # Qwen3's vocabulary: the real tokenizer's ids (chat-template tokens near 151 650) index it


def _write_klein_parts(root: Path, *, vocab_size: int, encoder_layers: int) -> None:
    """A Klein pipeline's transformer/ (context 3 x :data:`QWEN3_WIDTH`), vae/, text_encoder/ (a random
    ``Qwen3ForCausalLM`` of width :data:`QWEN3_WIDTH`, ``encoder_layers`` deep, over ``vocab_size`` tokens) and
    scheduler/ under ``root``."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tiny_transformer(text_dim=3 * QWEN3_WIDTH, seed=4).save_pretrained(root / "transformer")
    tiny_vae(seed=5).save_pretrained(root / "vae")
    torch.manual_seed(6)
    encoder = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=vocab_size,
            hidden_size=QWEN3_WIDTH,
            intermediate_size=32,
            num_hidden_layers=encoder_layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
        )
    )
    encoder.save_pretrained(root / "text_encoder")
    FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True).save_pretrained(root / "scheduler")


def _write_klein_index(root: Path) -> None:
    """The Klein pipeline's model_index.json under ``root``, naming each part's class."""
    index = {
        "_class_name": "Flux2KleinPipeline",
        "_diffusers_version": "0.40.0",
        "is_distilled": True,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen3ForCausalLM"],
        "tokenizer": ["transformers", "Qwen2TokenizerFast"],
        "transformer": ["diffusers", "Flux2Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLFlux2"],
    }
    (root / "model_index.json").write_text(json.dumps(index, indent=2))


def write_invokeai_klein_pipeline(root: Path, qwen3_tokenizer: Path) -> Path:
    """A complete FLUX.2 Klein diffusers pipeline at ``root``, small and random, as InvokeAI 6.14.2 installs one
    (``Main_Diffusers_Flux2_Config``: model_index.json naming ``Flux2KleinPipeline``) and its Klein model loader
    splits it: transformer/ (context 3 x :data:`QWEN3_WIDTH`), text_encoder/ (a 2-layer ``Qwen3ForCausalLM``;
    the Klein text encoder node's layers 9, 18, 27 clamp to its last), tokenizer/ (the real Qwen3 tokenizer:
    ``qwen3_tokenizer`` is InvokeAI's vendored copy, tokenizer.json gzipped), vae/ and scheduler/."""

    _write_klein_parts(root, vocab_size=QWEN3_VOCAB, encoder_layers=2)
    (root / "tokenizer").mkdir()
    with gzip.open(qwen3_tokenizer / "tokenizer.json.gz", "rb") as packed:
        (root / "tokenizer" / "tokenizer.json").write_bytes(packed.read())
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(qwen3_tokenizer / name, root / "tokenizer" / name)
    _write_klein_index(root)
    return root


#: A chat template of Qwen3's form (the Klein pipeline formats every prompt as one user turn).
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_tokenizer(folder: Path) -> Path:
    """A byte-level BPE tokenizer with no merges (one token per byte) and Qwen's special tokens, made offline,
    saved as ``Qwen2TokenizerFast`` with a chat template: what the Klein pipeline's prompt encoding calls."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "Qwen2TokenizerFast"
    config_path.write_text(json.dumps(config, indent=2))
    return folder


def write_klein_pipeline_with_text_encoder(root: Path) -> Path:
    """A complete, tiny, random FLUX.2 Klein diffusers pipeline (``DiffusionPipeline.from_pretrained`` loads it,
    text prompts included): transformer/ (context 3 x :data:`QWEN3_WIDTH`), text_encoder/ (a 27-layer
    ``Qwen3ForCausalLM`` of width 16: the pipeline stacks hidden states 9, 18 and 27), tokenizer/
    (:func:`write_tiny_tokenizer`), vae/ and scheduler/."""
    tokenizer = write_tiny_tokenizer(root / "tokenizer")
    from transformers import AutoTokenizer

    vocab_size = len(AutoTokenizer.from_pretrained(tokenizer))
    _write_klein_parts(root, vocab_size=vocab_size, encoder_layers=27)
    _write_klein_index(root)
    return root


class AsUpscaler:
    """A latent function ``fn(latents)`` as the hires fix's upscaler (``upscale_latents``; its passes, seed and
    colour knobs are recorded in ``seen``)."""

    def __init__(self, fn):
        self.fn, self.seen = fn, []

    def upscale_latents(self, latents, num_passes, **knobs):
        self.seen.append((num_passes, knobs))
        return self.fn(latents)
