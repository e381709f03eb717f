"""Flow Upscaler UNet: released layout, golden vectors, loading/saving, one-step sampling."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from flowlift.errors import FlowliftError
from flowlift.models import upscaler_unet as U
from flowlift.models import upscaler_weights as W

SMALL = {"sample_channels": 32, "base_channels": 16, "time_dim": 32, "cond_dim": 64}


@pytest.fixture(scope="module")
def golden(shared):
    path = shared / "golden" / "flow_upscaler_base64.safetensors"
    with safe_open(str(path), framework="pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
        metadata = handle.metadata()
    weights = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
    cases = [
        {name: tensors[f"case{i}.{name}"] for name in ("sample", "latents_small", "timestep", "velocity")}
        for i in range(int(metadata["cases"]))
    ]
    return weights, cases, metadata


def small_model(seed: int = 0) -> U.FlowUpscalerUNet:
    torch.manual_seed(seed)
    model = U.FlowUpscalerUNet(**SMALL).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:  # non-trivial norm affines and biases
                param.normal_(0.1, 0.5)
    return model


def test_default_model_matches_released_manifest(shared):
    manifest = json.loads((shared / "golden" / "flow_upscaler_state_dict_manifest.json").read_text())
    with torch.device("meta"):
        model = U.FlowUpscalerUNet()
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert len(shapes) == 166
    assert shapes == manifest["tensors"]
    assert sum(p.numel() for p in model.parameters()) == manifest["total_parameters"] == 59_267_104


def test_golden_vectors_reproduced(golden):
    weights, cases, metadata = golden
    config = {k: int(metadata[k]) for k in W.CONFIG_KEYS}
    assert config["base_channels"] == 64
    model = U.FlowUpscalerUNet(**config).eval()
    model.load_state_dict(weights, strict=True)
    with torch.no_grad():
        for case in cases:
            velocity = model(case["sample"], case["timestep"], case["latents_small"])
            assert velocity.shape == case["velocity"].shape
            assert (velocity - case["velocity"]).abs().max().item() <= 1e-4


def test_load_upscaler_infers_config_from_shapes(golden, tmp_path):
    weights, cases, _ = golden
    path = tmp_path / "bare.safetensors"
    save_file(weights, str(path))  # no metadata: the config must come from the tensor shapes
    model = W.load_upscaler(path)
    assert not model.training
    assert model.config == {"sample_channels": 32, "base_channels": 64, "time_dim": 512, "cond_dim": 1024}
    case = cases[1]
    with torch.no_grad():
        velocity = model(case["sample"], case["timestep"], case["latents_small"])
    assert (velocity - case["velocity"]).abs().max().item() <= 1e-4


def test_save_load_roundtrip_directory_and_metadata(tmp_path):
    model = small_model()
    path = W.save_upscaler(model, tmp_path / W.WEIGHTS_NAME)
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
        keys = set(handle.keys())
    assert {k: int(metadata[k]) for k in W.CONFIG_KEYS} == SMALL
    assert keys == set(model.state_dict())
    assert not list(tmp_path.glob("*.partial"))
    loaded = W.load_upscaler(tmp_path)  # a directory holding flow_upscaler.safetensors
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)
    sample, small = torch.randn(1, 32, 8, 12), torch.randn(1, 32, 4, 6)
    with torch.no_grad():
        assert torch.equal(loaded(sample, 500.0, small), model(sample, 500.0, small))


@pytest.mark.parametrize("file_dtype", [torch.float16, torch.bfloat16])
def test_half_precision_files_load(tmp_path, file_dtype):
    model = small_model()
    state = {k: v.to(file_dtype) for k, v in model.state_dict().items()}
    save_file(state, str(tmp_path / "w.safetensors"))
    loaded = W.load_upscaler(tmp_path / "w.safetensors", dtype=torch.float32)
    assert loaded.in_conv.weight.dtype == torch.float32
    assert torch.equal(loaded.in_conv.weight, state["in_conv.weight"].float())
    as_bf16 = W.load_upscaler(tmp_path / "w.safetensors", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in as_bf16.parameters())
    out = as_bf16(
        torch.randn(1, 32, 16, 16, dtype=torch.bfloat16),
        1000.0,
        torch.randn(1, 32, 8, 8, dtype=torch.bfloat16),
    )
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_pth_file_loads_with_weights_only(tmp_path):
    model = small_model()
    torch.save(model.state_dict(), tmp_path / "w.pth")
    loaded = W.load_upscaler(tmp_path / "w.pth")
    assert torch.equal(loaded.out_conv.weight, model.out_conv.weight)


def test_wrong_file_names_missing_unexpected_and_misshaped(tmp_path):
    state = small_model().state_dict()
    del state["out_conv.bias"]
    state["extra.weight"] = torch.zeros(3)
    state["mid_stages.0.conv1.weight"] = torch.zeros(16, 16, 1, 1)
    save_file(state, str(tmp_path / "bad.safetensors"))
    with pytest.raises(FlowliftError) as info:
        W.load_upscaler(tmp_path / "bad.safetensors")
    message = str(info.value)
    assert "\n" not in message
    assert "missing 1: out_conv.bias" in message
    assert "unexpected 1: extra.weight" in message
    assert "mis-shaped 1: mid_stages.0.conv1.weight (16, 16, 1, 1) != (16, 16, 3, 3)" in message


def test_bad_sources_give_one_line_errors(tmp_path):
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    for source in (
        tmp_path / "missing.safetensors",
        tmp_path,
        tmp_path / "junk.safetensors",
        "nobody/not-cached",
    ):
        with pytest.raises(FlowliftError) as info:
            W.load_upscaler(source)
        assert "\n" not in str(info.value) and "Flow Upscaler" in str(info.value)


def test_group_count_and_timestep_embedding():
    assert [U.group_count(c) for c in (384, 768, 64, 16, 48, 7)] == [32, 32, 32, 16, 24, 7]
    t = torch.tensor([1000.0, 3.0])
    emb = U.timestep_embedding(t, 8)
    freqs = [math.exp(-math.log(10000.0) * k / 4) for k in range(4)]
    expected = [[math.sin(v * f) for f in freqs] + [math.cos(v * f) for f in freqs] for v in (1000.0, 3.0)]
    assert torch.allclose(emb, torch.tensor(expected), atol=1e-4)
    assert U.timestep_embedding(t.double(), 8).dtype == torch.float64


def test_up_stage_resize_and_film_formulas():
    x = torch.randn(1, 3, 3, 5)
    assert torch.equal(U.upsample2x_to(x, (6, 10)), F.interpolate(x, scale_factor=2, mode="bilinear"))
    resized = U.upsample2x_to(x, (7, 9))
    assert resized.shape[-2:] == (7, 9)
    scale, shift = torch.randn(1, 3, 1, 1), torch.randn(1, 3, 1, 1)
    assert torch.allclose(U.film(x, scale, shift), x + x * scale + shift, atol=1e-6)


def test_one_step_upscale_is_noise_minus_velocity_at_t1000():
    seen = {}

    def fake(sample, timestep, small):
        seen["timestep"] = timestep
        return sample * 0.25 + small.mean()

    noise, small = torch.randn(2, 32, 8, 8), torch.randn(2, 32, 4, 4)
    x0 = U.one_step_upscale(fake, noise, small)
    assert torch.equal(seen["timestep"], torch.full((2,), 1000.0))
    assert torch.allclose(x0, noise - (noise * 0.25 + small.mean()))
    model = small_model()
    with torch.no_grad():
        assert torch.equal(
            U.one_step_upscale(model, noise, small), noise - model(noise, torch.full((2,), 1000.0), small)
        )


@pytest.mark.parametrize(
    ("sample", "small", "timestep"),
    [
        ((1, 32, 8, 10), (1, 32, 4, 5), 1000.0),  # W not a multiple of 4
        ((1, 32, 8, 8), (1, 32, 8, 8), 1000.0),  # small latent not half size
        ((1, 16, 8, 8), (1, 16, 4, 4), 1000.0),  # wrong channels
        ((2, 32, 8, 8), (2, 32, 4, 4), torch.ones(3)),  # timestep count
        ((32, 8, 8), (32, 4, 4), 1000.0),  # not 4-D
    ],
)
def test_bad_inputs_raise_one_line(sample, small, timestep):
    model = small_model()
    with pytest.raises(FlowliftError) as info:
        model(torch.randn(sample), timestep, torch.randn(small))
    assert "\n" not in str(info.value)


def test_too_small_input_for_a_narrow_model_is_one_clear_error():
    # 32 channels in 32 groups: at a 1x1 deepest level GroupNorm would see one value per group.
    model = U.FlowUpscalerUNet(base_channels=32, time_dim=64, cond_dim=64).eval()
    with pytest.raises(FlowliftError, match="too small"):
        model(torch.randn(1, 32, 4, 4), torch.tensor([1000.0]), torch.randn(1, 32, 2, 2))
    # The released width (12 channels per group) runs at the same size.
    wide = U.FlowUpscalerUNet(base_channels=384).eval()
    with torch.no_grad():
        assert wide(torch.randn(1, 32, 4, 4), torch.tensor([1000.0]), torch.randn(1, 32, 2, 2)).shape == (1, 32, 4, 4)


# ------------------------------------------------ issue 47: the residual block's element-wise steps in place


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 2])
def test_resblock_inference_path_keeps_its_input_and_the_autograd_paths_values(dtype, batch):
    """Without autograd the block works in place on its own intermediates (and, in a half dtype with one FiLM row,
    folds the FiLM into norm2's affine map): its input is untouched, float32 (and a batch's unfolded path) is bit
    for bit the autograd path's, and the fold stays within bfloat16 rounding of float32."""
    torch.manual_seed(0)
    block = U.ResBlock(64, 96, 32).eval()
    with torch.no_grad():
        for norm in (block.norm1, block.norm2):
            norm.weight.normal_(1.0, 0.3)
            norm.bias.normal_(0.0, 0.3)
    x32 = torch.randn(batch, 64, 12, 20)
    cond = torch.randn(batch if batch == 1 else 1, 32).expand(batch, 32) * 3
    reference = block(x32, cond)  # grad enabled: the autograd path in float32, which still differentiates
    reference.square().mean().backward()
    assert block.conv1.weight.grad is not None and torch.isfinite(block.conv1.weight.grad).all()
    model = block.to(dtype).to(memory_format=torch.channels_last)
    x = x32.to(dtype).contiguous(memory_format=torch.channels_last)
    kept = x.clone()
    with torch.inference_mode():
        fast = model(x, cond.to(dtype))
    plain = model(x, cond.to(dtype))  # the autograd path in this dtype
    assert torch.equal(x, kept)
    if dtype == torch.float32 or batch > 1:
        assert torch.equal(fast, plain)
    else:
        scale = reference.abs().max().item()
        assert (fast.float() - reference).abs().max().item() <= (
            plain.float() - reference
        ).abs().max().item() + 0.02 * scale
    assert (fast.float() - reference.detach()).abs().max().item() < 0.05 * reference.abs().max().item()


def test_unet_inference_equals_its_autograd_path_in_float32_and_keeps_its_inputs():
    """The whole UNet without autograd (residual blocks and FiLMs in place) is its autograd path bit for bit in
    float32, and its inputs are untouched."""
    torch.manual_seed(0)
    model = U.FlowUpscalerUNet(base_channels=32, time_dim=16, cond_dim=32).eval().requires_grad_(False)
    sample, small = torch.randn(1, 32, 16, 24), torch.randn(1, 32, 8, 12)
    kept = sample.clone(), small.clone()
    with torch.inference_mode():
        fast = model(sample, 1000.0, small)
    assert torch.equal(sample, kept[0]) and torch.equal(small, kept[1])
    assert torch.equal(fast, model(sample, 1000.0, small))  # grad enabled: the out-of-place path
