"""LoRAs that do not fit the transformer are one line naming the LoRA, the first tensor that does not fit and the
model it seems made for, before any adapter touches the model (issue 32, class C), in img2img and hires alike.

The cases: a LoRA made on another width, another rank than its metadata's, wrong in or out features, a down
matrix without its up matrix (kohya, ComfyUI, peft names), malformed ``lora_adapter_metadata`` (a list, no rank,
a rank that is no integer, an alpha NaN or 1e30), ComfyUI rank 0, a vector alpha, alphas NaN or 1e30.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from builders import command_line, save_tiny_unet
from flowlift.errors import FlowliftError  # noqa: E402
from flowlift.refine.loras import apply_loras  # noqa: E402
from flux2_files import LORA_TARGETS, bfl_lora_layers, write_comfyui_lora, write_kohya_lora, write_peft_lora  # noqa: E402
from tiny_flux2 import prompt_embeds, tiny_transformer, write_model_dir  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


#: (case, peft setting, value, piece of the message): each names the setting.
ADAPTER_CONFIG_CASES = [
    ("targets-empty", "target_modules", [], "has target_modules an empty list"),
    ("targets-string", "target_modules", "to_q", "has target_modules str 'to_q'"),
    ("targets-regex", "target_modules", "(a+)+$", "has target_modules str '(a+)+$'"),
    ("targets-int", "target_modules", 5, "has target_modules int 5"),
    ("targets-null", "target_modules", None, "has target_modules NoneType None"),
    ("targets-entry", "target_modules", ["to_q", 3], "has target_modules entry 3"),
    ("targets-miss", "target_modules", ["to_q", "to_k"], "target_modules that miss the layer"),
    ("targets-extra", "target_modules", [*LORA_TARGETS, "ff.linear_out"], "also reach transformer_blocks.0.ff"),
    ("targets-huge", "target_modules", [*LORA_TARGETS, *(f"m{i}" for i in range(200_000))], "characters"),
    ("dora", "use_dora", True, "has use_dora true: a DoRA"),
    ("dora-text", "use_dora", "yes", "has use_dora 'yes'; expected true or false"),
    ("dora-int", "use_dora", 1, "has use_dora 1; expected true or false"),
    ("rslora-text", "use_rslora", "x", "has use_rslora 'x'"),
    ("alpha-zero", "lora_alpha", 0, "has lora_alpha 0; expected a positive"),
    ("alpha-negative", "lora_alpha", -8, "has lora_alpha -8"),
    ("alpha-tiny-negative", "lora_alpha", -1e-9, "has lora_alpha -1e-09"),
    ("alpha-text", "lora_alpha", "8", "has lora_alpha '8'"),
    ("alpha-bool", "lora_alpha", True, "has lora_alpha True"),
    ("alpha-pattern-zero", "alpha_pattern", {"proj_out": 0}, "has alpha_pattern proj_out 0"),
    ("alpha-pattern-regex", "alpha_pattern", {"(a+)+$": 4}, "has alpha_pattern key '(a+)+$'"),
    ("rank-pattern-zero", "rank_pattern", {"proj_out": 0}, "has rank_pattern proj_out 0"),
    ("rank-pattern-list", "rank_pattern", [4], "rank_pattern or alpha_pattern that is not an object"),
    ("unknown-setting", "frobnicate", 1, "has the setting 'frobnicate', which is no field"),
    ("pissa", "init_lora_weights", "pissa", "has init_lora_weights 'pissa', which rewrites the base weights"),
    ("init-number", "init_lora_weights", 2, "has init_lora_weights 2"),
    ("layer-replication", "layer_replication", [[0, 1]], "has layer_replication [[0, 1]]"),
    ("modules-to-save", "modules_to_save", ["proj_out"], "has modules_to_save ['proj_out']"),
    ("exclude", "exclude_modules", ["proj_out"], "has exclude_modules ['proj_out']"),
    ("lora-bias", "lora_bias", True, "has lora_bias true but the file holds no lora_B bias"),
    ("fan-in-fan-out", "fan_in_fan_out", True, "has fan_in_fan_out true"),
    ("bias-text", "bias", "bogus", "has bias 'bogus'"),
    ("lokr", "peft_type", "LOKR", "has peft_type 'LOKR'"),
]


def _write_cases(root: Path) -> dict[str, tuple[Path, str]]:
    """Each LoRA that does not fit, with a piece of its expected message."""
    model = tiny_transformer()
    peft = root / "peft.safetensors"
    write_peft_lora(model, peft)
    good = load_file(str(peft))
    with safe_open(str(peft), "pt") as handle:
        metadata = handle.metadata()
    config = json.loads(metadata["lora_adapter_metadata"])
    layers = bfl_lora_layers(model)
    write_comfyui_lora(layers, root / "comfy.safetensors")
    comfy = load_file(str(root / "comfy.safetensors"))
    write_kohya_lora(layers, root / "kohya.safetensors")
    kohya = load_file(str(root / "kohya.safetensors"))
    # the tiny transformer with 3 heads instead of 2: width 48, like a Klein 4B LoRA met by a Klein 9B
    write_peft_lora(tiny_transformer(seed=1, num_attention_heads=3, guidance_embeds=True), root / "width48.safetensors")

    a = "transformer.proj_out.lora_A.weight"
    b = a.replace("lora_A", "lora_B")
    ca = "diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight"
    cb, alpha = ca.replace("lora_A", "lora_B"), ca.replace("lora_A.weight", "alpha")
    kd = "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"
    mod = "diffusion_model.double_blocks.0.img_mod.lin"  # FLUX.1's per-block modulation: no FLUX.2 layer
    with_config = lambda **change: {"lora_adapter_metadata": json.dumps({**config, **change})}  # noqa: E731
    states = {
        "rank8": (
            {**good, a: torch.randn(8, 32) * 0.1, b: torch.randn(128, 8) * 0.1},
            metadata,
            f"`{a}` is (8, 32), which does not fit the layer (32 in, 128 out, rank 4)",
        ),
        "in-features": ({**good, a: torch.randn(4, 33)}, metadata, f"`{a}` is (4, 33), which does not fit"),
        "out-features": ({**good, b: torch.randn(130, 4)}, metadata, f"`{b}` is (130, 4), which does not fit"),
        "peft-no-B": ({k: v for k, v in good.items() if k != b}, metadata, f"`{a}` has no lora_B.weight beside it"),
        "comfy-no-B": ({k: v for k, v in comfy.items() if k != cb}, None, f"`{ca}` has no lora_B.weight beside it"),
        "kohya-no-up": (
            {k: v for k, v in kohya.items() if k != kd.replace("down", "up")},
            None,
            f"`{kd}` has no lora_up.weight beside it",
        ),
        "metadata-list": (good, {"lora_adapter_metadata": "[1]"}, "lora_adapter_metadata header is a JSON list"),
        "metadata-empty": (good, {"lora_adapter_metadata": "{}"}, "lora_adapter_metadata header has r None"),
        "metadata-rank": (good, with_config(**{"transformer.r": "x"}), "has r 'x'"),
        "metadata-alpha-nan": (good, with_config(**{"transformer.lora_alpha": float("nan")}), "lora_alpha nan"),
        "metadata-alpha-huge": (good, with_config(**{"transformer.lora_alpha": 1e30}), "lora_alpha 1e+30"),
        # issue 36 class 8: settings the fit check let through to peft (KeyError, TypeError, warnings, a hang)
        **{
            f"metadata-{name}": (good, with_config(**{f"transformer.{key}": value}), message)
            for name, key, value, message in ADAPTER_CONFIG_CASES
        },
        "metadata-deep": (good, {"lora_adapter_metadata": "[" * 100_000}, "is not JSON (JSON nested"),
        "metadata-deep-value": (
            good,
            with_config(**{"transformer.rank_pattern": json.loads("[" * 70 + "]" * 70)}),
            "is not JSON (JSON nested more than 64",
        ),
        "metadata-blob": (good, with_config(junk="x" * 20_000_000), "holds 2000"),
        "metadata-no-transformer-keys": (
            good,
            {"lora_adapter_metadata": json.dumps({k.removeprefix("transformer."): v for k, v in config.items()})},
            "has no transformer.* settings",
        ),
        "comfy-rank0": (
            {**comfy, ca: torch.zeros(0, 32), cb: torch.zeros(96, 0)},
            None,
            "has down (0, 32) and up (96, 0) matrices",
        ),
        "comfy-vector-alpha": ({**comfy, alpha: torch.ones(4)}, None, f"`{alpha}` holds 4 values"),
        "comfy-alpha-nan": ({**comfy, alpha: torch.tensor(float("nan"))}, None, f"contain NaN in `{alpha}`"),
        "comfy-alpha-huge": ({**comfy, alpha: torch.tensor(1e30)}, None, f"`{alpha}` is 1e+30 for rank 4"),
        "kohya-alpha-huge": (
            {**kohya, kd.replace("lora_down.weight", "alpha"): torch.tensor(1e30)},
            None,
            "is 1e+30 for rank 4",
        ),
        "comfy-unknown-layer": (
            {**comfy, f"{mod}.lora_A.weight": torch.randn(4, 32), f"{mod}.lora_B.weight": torch.randn(192, 4)},
            None,
            "2 tensors: double_blocks.0.img_mod.lin.lora_A.weight, double_blocks.0.img_mod",
        ),
    }
    cases = {
        name: (save(root / f"{name}.safetensors", state, meta), message)
        for name, (state, meta, message) in states.items()
    }
    cases["other-width"] = (root / "width48.safetensors", "the LoRA seems made for a FLUX.2 of width 48")
    return cases


def save(path: Path, state: dict, metadata: dict | None) -> Path:
    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata=metadata)
    return path


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    return _write_cases(tmp_path_factory.mktemp("loras"))


def test_loras_that_do_not_fit_are_one_line_and_touch_nothing(cases):
    for name, (path, message) in cases.items():
        model = tiny_transformer()
        with pytest.raises(FlowliftError) as caught:
            apply_loras(model, [(str(path), 1.0)])
        text = str(caught.value)
        assert message in text and str(path) in text and "\n" not in text, (name, text)
        assert "original_state_dict" not in text and "dict_keys" not in text, text
        assert not getattr(model, "peft_config", None), name


def test_a_lora_of_another_width_names_the_released_model_it_was_made_for(tmp_path):
    """A LoRA whose attention layers take 3072 features (FLUX.2 Klein 4B) on the tiny model of width 32."""
    state = {}
    for name in ("to_q", "to_k", "to_v"):
        state[f"transformer.transformer_blocks.0.attn.{name}.lora_A.weight"] = torch.randn(4, 3072)
        state[f"transformer.transformer_blocks.0.attn.{name}.lora_B.weight"] = torch.randn(3072, 4)
    path = save(tmp_path / "klein4b.safetensors", state, None)
    with pytest.raises(FlowliftError, match=r"seems made for FLUX.2 Klein 4B \(width 3072\)"):
        apply_loras(tiny_transformer(), [(str(path), 1.0)])


# Every refusal is one FlowliftError from apply_loras (all cases, in-process, above); the command line's part is to
# print it as one line with exit 2 before any output, which one case per command shows (each run is an interpreter).
@pytest.mark.parametrize(("command", "case"), [("img2img", "comfy-rank0"), ("hires", "other-width")])
def test_cli_refuses_a_lora_that_does_not_fit_in_one_line(cases, tmp_path, command, case):
    from PIL import Image

    model_dir = write_model_dir(tmp_path / "model")
    embeds = save(tmp_path / "emb.safetensors", {"prompt_embeds": prompt_embeds()}, None)
    out = tmp_path / "out.png"
    if command == "img2img":
        Image.new("RGB", (64, 48), (90, 100, 110)).save(tmp_path / "in.png")
        args = ["img2img", str(tmp_path / "in.png"), "--steps", "1"]
    else:
        upscaler = save_tiny_unet(tmp_path / "up.safetensors", seed=0, cond_dim=32)
        args = command_line("hires", width="64", height="64", base_steps="1", steps="1", upscaler=upscaler)
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    path, message = cases[case]
    options = command_line(model=model_dir, prompt_embeds=embeds, lora=path, no_progress=True, o=out)
    argv = [sys.executable, "-m", "flowlift", *args, *options]
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    lines = run.stderr.splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert lines[0].startswith(f"flowlift {command}: error: LoRA {path}: ") and message in lines[0], lines[0]
    assert not out.exists()
