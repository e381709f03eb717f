"""The Tiled FLUX.2 Denoise invocation inside InvokeAI's own Python (run by tests/test_invokeai.py in the InvokeAI
venv: ``python -m pytest tests/invokeai_denoise_node_checks.py``; the name keeps the project's pytest from
collecting it, since it imports InvokeAI).

The node runs on a stand-in invocation context (the model cache, tensors and conditioning as dicts) with a tiny
random FLUX.2 transformer, so that what InvokeAI's graph cannot show is measured: the transformer's LoRAs patched by
InvokeAI's ``LayerPatcher`` equal the same LoRA merged into the weights by hand (and the weights are restored
after, a cancel included), a cancel stops before the transformer's next call (within a tile, not a step), and a
regional mask or a FLUX.1 transformer is one error line.
"""

from __future__ import annotations

import copy
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from invokeai.app.invocations.fields import TensorField
from invokeai.app.invocations.model import LoRAField
from invokeai.app.services.session_processor.session_processor_common import CanceledException
from invokeai.backend.model_manager.load.model_cache.torch_module_autocast.torch_module_autocast import (
    apply_custom_layers_to_model,
)
from invokeai.backend.patches.layers.lora_layer import LoRALayer
from invokeai.backend.patches.lora_conversions.flux_lora_constants import FLUX_LORA_TRANSFORMER_PREFIX
from invokeai.backend.patches.model_patch_raw import ModelPatchRaw
from invokeai.backend.stable_diffusion.diffusion.conditioning_data import ConditioningFieldData, FLUXConditioningInfo
from invokeai.invocation_api import (
    BaseModelType,
    FluxConditioningField,
    LatentsField,
    ModelFormat,
    ModelIdentifierField,
    ModelType,
    TransformerField,
    VAEField,
)

sys.path.insert(0, str(Path(__file__).parent))
from flowlift.errors import FlowliftError  # noqa: E402
from flowlift.invokeai.nodes import TiledFlux2DenoiseInvocation  # noqa: E402
from tiny_flux2 import TEXT_DIM, tiny_transformer, tiny_vae  # noqa: E402

#: The LoRA's target: the double block's query projection (diffusers names, as InvokeAI's FLUX.2 keys are).
TARGET = "transformer_blocks.0.attn.to_q"


def identifier(key: str, base: BaseModelType = BaseModelType.Flux2, kind: ModelType = ModelType.Main):
    return ModelIdentifierField(key=key, hash="blake3:" + key, name=key, base=base, type=kind)


class Loaded:
    """What ``context.models.load`` hands back, over one module (or LoRA patch)."""

    def __init__(self, model) -> None:
        self.model = model

    @contextmanager
    def model_in_ram(self):
        yield self.model

    @contextmanager
    def model_on_device(self):
        yield None, self.model


class Context:
    """A stand-in ``InvocationContext``: models by key, tensors and conditionings by name, a cancel flag."""

    def __init__(self, models: dict, tensors: dict, bases: dict) -> None:
        self.canceled = False
        self.saved: dict = {}
        configs = {
            key: types.SimpleNamespace(base=base, type=kind, name=key, format=ModelFormat.Diffusers)
            for key, (base, kind) in bases.items()
        }
        self.models = types.SimpleNamespace(
            load=lambda field: Loaded(models[field.key]), get_config=lambda field: configs[field.key]
        )
        self.tensors = types.SimpleNamespace(load=lambda name: tensors[name], save=self._save)
        self.conditioning = types.SimpleNamespace(load=lambda name: tensors[name])
        self.util = types.SimpleNamespace(is_canceled=lambda: self.canceled, signal_progress=lambda *a, **k: None)
        self.logger = types.SimpleNamespace(info=lambda *_: None, warning=lambda *_: None)

    def _save(self, tensor: torch.Tensor) -> str:
        self.saved[f"out{len(self.saved)}"] = tensor
        return f"out{len(self.saved) - 1}"


def cached_transformer() -> torch.nn.Module:
    """A tiny FLUX.2 transformer as InvokeAI's model cache holds one: its layers swapped for the cache's custom
    layers (the ones its ``LayerPatcher`` patches)."""
    transformer = tiny_transformer()
    apply_custom_layers_to_model(transformer)
    return transformer


def lora_patch(transformer: torch.nn.Module, rank: int = 2) -> tuple[ModelPatchRaw, torch.Tensor]:
    """A rank-``rank`` LoRA on :data:`TARGET` (InvokeAI's own layer class) and its weight delta ``up @ down``."""
    weight = transformer.get_submodule(TARGET).weight
    generator = torch.Generator().manual_seed(7)
    up = torch.randn(weight.shape[0], rank, generator=generator) * 0.5
    down = torch.randn(rank, weight.shape[1], generator=generator) * 0.5
    layer = LoRALayer(up=up, mid=None, down=down, alpha=None, bias=None)
    return ModelPatchRaw({FLUX_LORA_TRANSFORMER_PREFIX + TARGET: layer}), up @ down


def scene(transformer: torch.nn.Module, loras: list | None = None, **models) -> tuple[Context, dict]:
    """A context holding the transformer ``tr``, a tiny FLUX.2 VAE, 64x48 px of raw latents and a prompt, and the
    node's fields (``loras``: (key, weight) pairs of LoRAs among ``models``)."""
    raw = torch.randn(1, 32, 6, 8, generator=torch.Generator().manual_seed(1)) * 1.5
    embeds = torch.randn(1, 6, TEXT_DIM, generator=torch.Generator().manual_seed(2))
    prompt = ConditioningFieldData(
        conditionings=[FLUXConditioningInfo(clip_embeds=torch.zeros(1, 8), t5_embeds=embeds)]
    )
    bases = {"tr": (BaseModelType.Flux2, ModelType.Main), "vae": (BaseModelType.Flux2, ModelType.VAE)}
    bases.update({key: (BaseModelType.Flux2, ModelType.LoRA) for key in models})
    context = Context({"tr": transformer, "vae": tiny_vae(), **models}, {"raw": raw, "prompt": prompt}, bases)
    fields = {
        "id": "tiled",
        "latents": LatentsField(latents_name="raw"),
        "transformer": TransformerField(
            transformer=identifier("tr"),
            loras=[LoRAField(lora=identifier(key, kind=ModelType.LoRA), weight=w) for key, w in loras or []],
        ),
        "positive_text_conditioning": FluxConditioningField(conditioning_name="prompt"),
        "vae": VAEField(vae=identifier("vae", kind=ModelType.VAE)),
        "strength": 0.7,
        "num_steps": 2,
        "seed": 3,
        "tile_size": "32",
        "tile_overlap": 16,
    }
    return context, fields


def run(context: Context, fields: dict) -> torch.Tensor:
    output = TiledFlux2DenoiseInvocation(**fields).invoke(context)
    return context.saved[output.latents.latents_name]


def test_the_transformers_loras_are_applied_and_taken_off_again():
    transformer = cached_transformer()
    before = {name: value.clone() for name, value in transformer.state_dict().items()}
    patch, delta = lora_patch(transformer)
    context, fields = scene(transformer, [("lora", 0.7)], lora=patch)
    with_lora = run(context, fields)
    for name, value in transformer.state_dict().items():  # InvokeAI's cached model is unpatched after the node
        assert torch.equal(value, before[name]), name

    merged = copy.deepcopy(transformer)
    merged.get_submodule(TARGET).weight.add_(0.7 * delta)
    context, fields = scene(merged)
    expected = run(context, fields)
    context, fields = scene(transformer)
    plain = run(context, fields)
    print(f"LoRA node vs merged weights: {(with_lora - expected).abs().max():.2e}")
    torch.testing.assert_close(with_lora, expected, rtol=0, atol=1e-5)
    assert (with_lora - plain).abs().max() > 1e-2  # the LoRA changed the result: it was not dropped


def test_a_cancel_stops_before_the_transformers_next_call_and_unpatches():
    transformer = cached_transformer()
    before = {name: value.clone() for name, value in transformer.state_dict().items()}
    patch, _ = lora_patch(transformer)
    context, fields = scene(transformer, [("lora", 1.0)], lora=patch)
    calls = []

    def count(*_):
        calls.append(1)
        if len(calls) == 2:  # the user cancels during the second tile of the first step
            context.canceled = True

    handle = transformer.register_forward_hook(count)
    try:
        with pytest.raises(CanceledException):
            run(context, fields)
    finally:
        handle.remove()
    assert len(calls) == 2  # a 64x48 frame in 32 px tiles is 6 calls a step: none ran after the cancel
    for name, value in transformer.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_a_regional_mask_or_a_flux1_transformer_is_one_line():
    context, fields = scene(cached_transformer())
    masked = FluxConditioningField(conditioning_name="prompt", mask=TensorField(tensor_name="mask"))
    with pytest.raises(FlowliftError, match="carries a regional mask, which the tiled denoise does not apply"):
        run(context, {**fields, "positive_text_conditioning": masked})
    config = context.models.get_config(identifier("tr"))
    config.base = BaseModelType.Flux
    with pytest.raises(FlowliftError, match=r"needs a FLUX\.2 \(Klein\) transformer, got 'tr', a flux main"):
        run(context, fields)
