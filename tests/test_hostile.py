"""Hostile inputs, generated: every class must fail loudly (one line, right exit code), never silently.

Each test builds its hostile files from a small valid one (a tiny random upscaler, the real TAEF2, a
tiny dataset, tiny images) and breaks it in every way of its class: NaN/Inf anywhere, non-float
dtypes, absurd configs, corrupt shards and manifests, bad devices, non-finite options, interrupted
runs. Exit codes: 0 ok, 1 some images failed, 2 user error, 130 interrupted.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import signal
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, PngImagePlugin
from safetensors.torch import load_file, save_file

from door_helpers import cpu_upscale_options, quiet_train_config
from flowlift.commands.cli import main
from flowlift.errors import FlowliftError

pytestmark = pytest.mark.usefixtures("single_thread_torch")  # tiny models: fastest single-threaded
TINY_UNET = {"base_channels": 32, "time_dim": 32, "cond_dim": 64}
NON_FINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def _one_error_line(err: str, command: str) -> str:
    """The stderr of a failed command: no traceback, exactly one ``flowlift CMD: error:`` line."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith(f"flowlift {command}: error:")]
    assert len(lines) == 1, err
    return lines[0]


# ------------------------------------------------------------------------------------------------
# weights: generated poisoned files


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory) -> Path:
    from flowlift.models.upscaler_unet import FlowUpscalerUNet
    from flowlift.models.upscaler_weights import save_upscaler

    torch.manual_seed(0)
    model = FlowUpscalerUNet(**TINY_UNET, dropout=0.0)
    return save_upscaler(model, tmp_path_factory.mktemp("weights") / "flow_upscaler.safetensors")


def _poisoned_names(path: Path) -> list[str]:
    names = sorted(load_file(str(path)))
    return [names[0], names[len(names) // 2], names[-1]]


def _rewrite(source: Path, target: Path, change) -> Path:
    from safetensors import safe_open

    with safe_open(str(source), framework="pt") as handle:
        metadata = handle.metadata()
    state = load_file(str(source))
    change(state)
    save_file(state, str(target), metadata=metadata)
    return target


@pytest.mark.parametrize("kind", sorted(NON_FINITE))
@pytest.mark.parametrize("which", [0, 1, 2])
def test_non_finite_upscaler_weights_are_refused_naming_the_tensor(tiny_weights, tmp_path, kind, which):
    from flowlift.models.upscaler_weights import load_upscaler

    name = _poisoned_names(tiny_weights)[which]

    def poison(state):
        state[name].view(-1)[state[name].numel() // 2] = NON_FINITE[kind]

    bad = _rewrite(tiny_weights, tmp_path / "flow_upscaler.safetensors", poison)
    expected = "NaN" if kind == "nan" else "Inf"
    with pytest.raises(FlowliftError, match=rf"contain {expected} in `{name}`"):
        load_upscaler(bad)


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, torch.int32, torch.uint8])
def test_non_float_weights_are_refused(tiny_weights, tmp_path, dtype):
    from flowlift.models.upscaler_weights import load_upscaler

    name = _poisoned_names(tiny_weights)[1]

    def cast(state):
        state[name] = state[name].to(dtype)

    bad = _rewrite(tiny_weights, tmp_path / "flow_upscaler.safetensors", cast)
    short = str(dtype).removeprefix("torch.")
    with pytest.raises(FlowliftError, match=rf"`{name}` has dtype {short}, expected floating point"):
        load_upscaler(bad)


def test_load_strict_refuses_non_float_and_non_finite_for_any_module():
    from flowlift.models.weights import load_strict

    module = torch.nn.Linear(3, 2)
    good = {k: v.clone() for k, v in module.state_dict().items()}
    load_strict(module, good, what="test weights")
    with pytest.raises(FlowliftError, match="`weight` has dtype int64, expected floating point"):
        load_strict(module, {**good, "weight": torch.ones(2, 3, dtype=torch.long)}, what="test weights")
    with pytest.raises(FlowliftError, match="test weights contain Inf in `bias`"):
        load_strict(module, {**good, "bias": torch.tensor([0.0, float("inf")])}, what="test weights")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("where", [0, 4097, 99_999])
def test_finite_check_finds_one_bad_value_anywhere_in_any_float_dtype(dtype, where):
    """The one-read check (aminmax, isfinite where aminmax is missing) sees a single NaN or Inf at the start, inside a
    vector block and at the end of a large tensor, in every float dtype a file may hold."""
    from flowlift.models.weights import first_non_finite

    for bad, kind in ((float("nan"), "NaN"), (float("inf"), "Inf"), (float("-inf"), "Inf")):
        tensor = torch.linspace(-1, 1, 100_000).to(dtype)
        assert first_non_finite({"a": torch.zeros(3), "w": tensor}) is None
        if dtype == torch.float8_e4m3fn and kind == "Inf":
            continue  # float8_e4m3fn has no infinity (it saturates to NaN)
        tensor[where] = bad
        assert first_non_finite({"a": torch.zeros(3), "w": tensor}) == f"{kind} in `w`"


@pytest.mark.parametrize(
    "metadata, drop",
    [
        ({"base_channels": "0"}, ["in_conv.weight"]),
        ({"base_channels": "1000000000"}, ["in_conv.weight"]),
        ({"cond_dim": "0", "time_dim": "0"}, ["conditioning.time_proj.0.weight"]),
        ({"time_dim": "999999999"}, ["conditioning.time_proj.0.weight"]),
        ({}, []),  # shapes say base_channels=0 (a zero-size in_conv)
    ],
)
def test_absurd_upscaler_config_is_refused_before_building(tiny_weights, tmp_path, metadata, drop):
    from flowlift.models.upscaler_weights import load_upscaler

    state = load_file(str(tiny_weights))
    for name in drop:
        state.pop(name)
    if not metadata and not drop:
        state["in_conv.weight"] = torch.zeros(0, 32, 1, 1)
    meta = {"format": "pt", **TINY_UNET_STR, **metadata}
    bad = tmp_path / "flow_upscaler.safetensors"
    save_file(state, str(bad), metadata=meta)
    with pytest.raises(FlowliftError, match="Flow Upscaler weights"):
        load_upscaler(bad)


TINY_UNET_STR = {k: str(v) for k, v in TINY_UNET.items()}


@pytest.mark.parametrize("kind", sorted(NON_FINITE))
def test_non_finite_vae_weights_are_refused(shared, tmp_path, kind):
    from flowlift.models.vae_loading import load_vae

    for part in ("encoder", "decoder"):
        state = torch.load(shared / "models" / "taef2" / f"taef2_{part}.pth", map_location="cpu", weights_only=True)
        if part == "decoder":
            name = sorted(k for k, v in state.items() if v.is_floating_point())[3]
            state[name] = state[name].clone()
            state[name].view(-1)[0] = NON_FINITE[kind]
        torch.save(state, tmp_path / f"taef2_{part}.pth")
    with pytest.raises(FlowliftError, match=r"TAEF2 weights .* contain (NaN|Inf) in `decoder\."):
        load_vae(str(tmp_path))


def test_pickled_code_is_refused_without_advising_weights_only_false(tmp_path):
    from flowlift.models.weights import read_state_dict

    class Payload:
        def __reduce__(self):
            return (os.getcwd, ())

    path = tmp_path / "evil.pt"
    with open(path, "wb") as handle:
        pickle.dump({"weight": Payload()}, handle)
    torch.save({"weight": Payload()}, tmp_path / "evil2.pt")
    for file in (path, tmp_path / "evil2.pt"):
        with pytest.raises(FlowliftError) as caught:
            read_state_dict(file, what="Flow Upscaler weights")
        text = str(caught.value)
        assert "weights_only=False" not in text and "\n" not in text
        assert f"holds code or objects other than tensors ({os.getcwd.__module__}.getcwd)" in text


@pytest.mark.parametrize("kind", sorted(NON_FINITE))
def test_non_finite_prompt_embeddings_are_refused_at_load(tmp_path, kind):
    from flowlift.models.prompt_embeds import load_prompt_embeds

    embeds = torch.zeros(1, 4, 8)
    embeds[0, 2, 3] = NON_FINITE[kind]
    save_file({"prompt_embeds": embeds}, str(tmp_path / "p.safetensors"))
    with pytest.raises(FlowliftError, match=r"prompt embeddings .* contain (NaN|Inf) in `prompt_embeds`"):
        load_prompt_embeds(tmp_path / "p.safetensors")
    save_file(
        {"prompt_embeds": torch.zeros(1, 4, 8), "negative_prompt_embeds": embeds}, str(tmp_path / "n.safetensors")
    )
    with pytest.raises(FlowliftError, match="negative_prompt_embeds"):
        load_prompt_embeds(tmp_path / "n.safetensors")
    save_file({"prompt_embeds": torch.zeros(1, 4, 8, dtype=torch.int32)}, str(tmp_path / "i.safetensors"))
    with pytest.raises(FlowliftError, match="dtype int32, expected floating point"):
        load_prompt_embeds(tmp_path / "i.safetensors")


def test_an_embeddings_file_without_prompt_embeds_names_the_field(tmp_path):
    """It said ``prompt embeddings: PATH has no 'prompt_embeds' tensor (keys: ...)``: now the field, which the
    command line says as ``--prompt-embeds``, a short list of keys and what the file must hold."""
    from flowlift.commands._options import FIELD_DESTS
    from flowlift.models.prompt_embeds import load_prompt_embeds

    path = tmp_path / "e.safetensors"
    save_file({f"t{index}": torch.zeros(1, 4, 8) for index in range(6)}, str(path))
    with pytest.raises(FlowliftError) as caught:
        load_prompt_embeds(path)
    assert caught.value.field == "prompt.embeds" and FIELD_DESTS["prompt.embeds"] == "prompt_embeds"
    assert caught.value.worded({"prompt.embeds": "--prompt-embeds"}) == (
        f"--prompt-embeds {path} has no 'prompt_embeds' tensor (keys: t0, t1, t2, t3, ... (+2 more)); give a file "
        "that holds prompt_embeds (and optionally negative_prompt_embeds)"
    )


def test_cli_upscale_with_poisoned_weights_writes_nothing(shared, tiny_weights, tmp_path, capsys):
    def poison(state):
        name = sorted(state)[5]
        state[name].view(-1)[0] = float("nan")

    bad = _rewrite(tiny_weights, tmp_path / "flow_upscaler.safetensors", poison)
    Image.new("RGB", (32, 32), (120, 80, 40)).save(tmp_path / "a.png")
    out = tmp_path / "out"
    rc = main(["upscale", str(tmp_path / "a.png"), "-o", str(out), *cpu_upscale_options(shared, bad)])
    assert rc == 2
    assert "contain NaN in `" in _one_error_line(capsys.readouterr().err, "upscale")
    assert not out.exists() or not any(out.iterdir())


# ------------------------------------------------------------------------------------------------
# pixels: generated hostile arrays and tensors


def _hostile_images():
    base = np.random.default_rng(0).random((8, 8, 3))
    yield "float 0..255", base * 255.0, "must lie in"
    yield "float negative", base - 0.5, "must lie in"
    for kind, value in NON_FINITE.items():
        poisoned = base.copy()
        poisoned[3, 4, 1] = value
        yield f"float with {kind}", poisoned, "NaN" if kind == "nan" else "Inf"
        yield (
            f"float32 tensor with {kind}",
            torch.from_numpy(poisoned).permute(2, 0, 1).float(),
            "NaN" if kind == "nan" else "Inf",
        )
    for dtype in (np.int32, np.int64, np.int8, np.bool_):
        yield f"array {np.dtype(dtype).name}", (base * 200).astype(dtype), "must be uint8, uint16 or float"
    for dtype in (torch.int32, torch.int64, torch.bool):
        yield f"tensor {dtype}", torch.ones(3, 8, 8, dtype=dtype), "must be uint8, uint16 or float"
    yield "float tensor 0..255", torch.full((1, 3, 8, 8), 200.0), "must lie in"


@pytest.mark.parametrize(
    "label, image, message", list(_hostile_images()), ids=lambda x: x if isinstance(x, str) else None
)
def test_to_tensor_refuses_images_outside_the_convention(label, image, message):
    from flowlift.files.images import to_tensor

    with pytest.raises(FlowliftError, match=message):
        to_tensor(image)


def test_to_tensor_scales_integers_by_their_range_and_keeps_rounding_noise():
    from flowlift.files.images import to_tensor

    u8 = np.full((4, 4, 3), 255, np.uint8)
    u16 = np.full((4, 4, 3), 65535, np.uint16)
    assert to_tensor(u8).max() == 1.0 and to_tensor(u16).max() == 1.0
    assert to_tensor(torch.full((3, 4, 4), 255, dtype=torch.uint8)).max() == 1.0
    noisy = np.full((4, 4, 3), 1.0 + 1e-4) - np.eye(4)[..., None] * (1.0 + 2e-4)
    out = to_tensor(noisy)
    assert out.min() == 0.0 and out.max() == 1.0


@pytest.mark.parametrize("kind", sorted(NON_FINITE))
def test_tensor_to_uint8_refuses_non_finite_pixels(kind):
    from flowlift.files.images import tensor_to_pil, tensor_to_uint8

    image = torch.rand(1, 3, 8, 8)
    image[0, 1, 2, 3] = NON_FINITE[kind]
    with pytest.raises(FlowliftError, match="nothing was written"):
        tensor_to_uint8(image)
    with pytest.raises(FlowliftError):
        tensor_to_pil(image)


def test_float_tiff_with_nan_is_one_line_without_numpy_warning(tmp_path):
    from flowlift.files.images import load_image

    values = np.full((8, 8), 0.5, np.float32)
    values[2, 2] = np.nan
    Image.fromarray(values, "F").save(tmp_path / "nan.tif")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(FlowliftError, match=r"nan\.tif: .*NaN or Inf"):
            load_image(tmp_path / "nan.tif")


def test_a_float_image_outside_0_to_1_is_refused_not_clipped_white(tmp_path):
    from flowlift.files.images import load_image

    Image.fromarray(np.full((8, 8), 0.25, np.float32), "F").save(tmp_path / "unit.tif")
    assert np.asarray(load_image(tmp_path / "unit.tif")[0])[0, 0].tolist() == [64, 64, 64]
    Image.fromarray(np.full((8, 8), 128.0, np.float32), "F").save(tmp_path / "levels.tif")  # 0..255: was all white
    with pytest.raises(
        FlowliftError, match=r"levels\.tif: .*values in \[128, 128\]; flowlift reads float pixels as 0..1"
    ):
        load_image(tmp_path / "levels.tif")


def test_decompression_bomb_in_dataset_folder_is_one_line(tmp_path, shared, monkeypatch, capsys):
    import flowlift.files.images as images

    for size in ((40, 40), (64, 64)):
        Image.new("RGB", size, (10, 20, 30)).save(tmp_path / f"img{size[0]}.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 64x64 > 2x the limit: Pillow's error
    monkeypatch.setattr(images, "MAX_INPUT_PIXELS", 1000)
    rc = main(
        [
            "dataset",
            "images",
            str(tmp_path),
            "--crop-px",
            "32",
            "--vae",
            str(shared / "models" / "taef2"),
            "--device",
            "cpu",
            "-o",
            str(tmp_path / "data"),
        ]
    )
    assert rc == 2
    line = _one_error_line(capsys.readouterr().err, "dataset")
    assert "img40.png" in line or "img64.png" in line
    assert "decompression" in line


# ------------------------------------------------------------------------------------------------
# options: bad devices, non-finite numbers


BAD_DEVICES = (
    ["bogus", "cuda:99", "meta"]
    + ([] if torch.cuda.is_available() else ["cuda"])
    + ([] if torch.backends.mps.is_available() else ["mps"])
)


@pytest.mark.parametrize("device", BAD_DEVICES)
def test_resolve_device_refuses_in_one_line(device):
    from flowlift.devices import resolve_device

    with pytest.raises(FlowliftError) as caught:
        resolve_device(device)
    assert "\n" not in str(caught.value) and device.split(":")[0] in str(caught.value)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(None).type in ("cpu", "cuda")


def _device_commands(tmp_path: Path, shared: Path, device: str) -> dict[str, list[str]]:
    image = tmp_path / "a.png"
    Image.new("RGB", (32, 32), (100, 110, 120)).save(image)
    taef2 = str(shared / "models" / "taef2")
    return {
        "upscale": ["upscale", str(image), "-o", str(tmp_path / "up"), "--vae", taef2, "--device", device],
        "eval": [
            "eval",
            "--run",
            "lanczos",
            "--dataset",
            str(tmp_path),
            "--scale",
            "2",
            "--device",
            device,
            "-o",
            str(tmp_path / "ev"),
        ],
        "bands": ["bands", str(image), "--vae", taef2, "--device", device, "-o", str(tmp_path / "bd")],
        "dataset": [
            "dataset",
            "images",
            str(tmp_path),
            "--crop-px",
            "16",
            "--vae",
            taef2,
            "--device",
            device,
            "-o",
            str(tmp_path / "ds"),
        ],
        "train": ["train", "--data", str(tmp_path / "nodata"), "--output", str(tmp_path / "run"), "--device", device],
    }


@pytest.mark.parametrize("device", ["bogus", "cuda:99"] + ([] if torch.cuda.is_available() else ["cuda"]))
def test_bad_device_is_one_line_in_every_command(tmp_path, shared, capsys, device):
    for command, argv in _device_commands(tmp_path, shared, device).items():
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 2, (command, err)
        assert "device" in _one_error_line(err, command), (command, err)
    assert not (tmp_path / "up").exists()


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "Infinity"])
def test_non_finite_numeric_options_are_refused(tmp_path, capsys, value):
    image = tmp_path / "a.png"
    Image.new("RGB", (32, 32)).save(image)
    cases = [
        (["bands", str(image), "--vae", "taef2", f"--amplitude={value}", "-o", str(tmp_path / "b")], "--amplitude"),
        (["img2img", str(image), "--model", "x/y", "--prompt", "p", f"--cfg-scale={value}"], "--cfg-scale"),
        (["img2img", str(image), "--model", "x/y", "--prompt", "p", f"--mu={value}"], "--mu"),
        (["train", "--data", "d", "--output", "o", f"--lr={value}"], "--lr"),
        (["dataset", "images", str(tmp_path), f"--noise-std={value}", "-o", str(tmp_path / "d")], "--noise-std"),
    ]
    for argv, option in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert "finite" in capsys.readouterr().err, option
    rc = main(["train", "--data", "d", "--output", "o", "--set", f"t_mean={value}"])
    assert rc == 2 and "finite" in _one_error_line(capsys.readouterr().err, "train")


def test_outpaint_canvas_is_capped_before_loading_anything(tmp_path, capsys):
    from flowlift.refine.canvas import outpaint_pads

    with pytest.raises(FlowliftError, match=r"^outpaint borders make a 1000000064x64 canvas, over the 16384 px cap"):
        outpaint_pads(64, 64, 0, 0, 10**9, 0)
    assert outpaint_pads(64, 64, 1, 0, 0, 17) == (16, 0, 0, 32)
    image = tmp_path / "a.png"
    Image.new("RGB", (64, 64)).save(image)
    save_file({"prompt_embeds": torch.zeros(1, 4, 8)}, str(tmp_path / "p.safetensors"))
    rc = main(
        [
            "img2img",
            str(image),
            "--model",
            str(tmp_path / "no-model"),
            "--prompt-embeds",
            str(tmp_path / "p.safetensors"),
            "--outpaint",
            "0,0,20000,0",
            "-o",
            str(tmp_path / "o.png"),
        ]
    )
    assert rc == 2
    line = _one_error_line(capsys.readouterr().err, "img2img")
    assert "--outpaint borders make a 20064x64 canvas, over the 16384 px cap a side; use smaller borders" in line
    assert "MAX_OUTPUT_SIDE" not in line


def test_cli_turns_warnings_into_one_flowlift_line_and_drops_third_party_ones(capsys):
    from flowlift.commands.cli import _one_line_warnings
    from flowlift.errors import FlowliftWarning

    show = _one_line_warnings("upscale")
    show(RuntimeWarning("invalid value encountered in cast"), RuntimeWarning, np.__file__, 1)
    show(UserWarning("Possibly corrupt EXIF data"), UserWarning, Image.__file__, 1)
    assert capsys.readouterr().err == ""
    show(FlowliftWarning("x.png: corrupt EXIF\nsecond line"), FlowliftWarning, Image.__file__, 1)
    assert capsys.readouterr().err == "flowlift upscale: warning: x.png: corrupt EXIF\n"


# ------------------------------------------------------------------------------------------------
# datasets: generated corrupt shards and manifests


def _tiny_dataset(root: Path, items: int = 5, shard_size: int = 2, noise: bool = True) -> Path:
    from flowlift.training.shards import prepare_dataset_dir, write_shard

    generator = torch.Generator().manual_seed(0)
    prepare_dataset_dir(
        root,
        {
            "kind": "test",
            "target_shape": [32, 8, 8],
            "cond_shape": [32, 4, 4],
            "shard_size": shard_size,
            "num_items": items,
            "has_noise": noise,
        },
    )
    for shard, first in enumerate(range(0, items, shard_size)):
        count = min(shard_size, items - first)
        tensors = {
            "target": torch.randn(count, 32, 8, 8, generator=generator),
            "cond": torch.randn(count, 32, 4, 4, generator=generator),
        }
        if noise:
            tensors["noise"] = torch.randn(count, 32, 8, 8, generator=generator)
        write_shard(root, shard, first, tensors, [{"i": first + i} for i in range(count)], torch.float32)
    return root


def _corrupt_shard(root: Path, how: str) -> None:
    shard = root / "shard-00001.safetensors"
    data = shard.read_bytes()
    manifest = json.loads((root / "dataset.json").read_text())
    if how == "truncated":
        shard.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        shard.write_bytes(b"")
    elif how == "garbage":
        shard.write_bytes(os.urandom(len(data)))
    elif how == "header only":
        shard.write_bytes(data[:8])
    elif how in ("mis-shaped", "count missing", "count absurd", "count zero", "non-float", "no cond"):
        from safetensors import safe_open

        with safe_open(str(shard), framework="pt") as handle:
            meta = dict(handle.metadata())
            tensors = {k: handle.get_tensor(k) for k in handle.keys()}
        if how == "mis-shaped":
            tensors["cond"] = torch.zeros(2, 32, 8, 8)
        elif how == "count missing":
            meta.pop("count")
        elif how == "count absurd":
            meta["count"] = "99999999999"
        elif how == "count zero":
            meta["count"] = "0"
        elif how == "non-float":
            tensors["target"] = tensors["target"].to(torch.int16)
        elif how == "no cond":
            tensors.pop("cond")
        save_file(tensors, str(shard), metadata=meta)
    elif how == "manifest is a list":
        (root / "dataset.json").write_text(json.dumps([manifest]))
    elif how == "manifest garbage":
        (root / "dataset.json").write_bytes(b"\xff\xfe{{{")
    elif how in ("shard_size 0", "shard_size string", "target_shape odd", "target_shape missing"):
        if how == "shard_size 0":
            manifest["shard_size"] = 0
        elif how == "shard_size string":
            manifest["shard_size"] = "two"
        elif how == "target_shape odd":
            manifest["target_shape"] = [32, 9, 8]
        else:
            manifest.pop("target_shape")
        (root / "dataset.json").write_text(json.dumps(manifest))
    else:
        raise AssertionError(how)


CORRUPTIONS = [
    "truncated",
    "empty",
    "garbage",
    "header only",
    "mis-shaped",
    "count missing",
    "count absurd",
    "count zero",
    "non-float",
    "no cond",
    "manifest is a list",
    "manifest garbage",
    "shard_size 0",
    "shard_size string",
    "target_shape odd",
    "target_shape missing",
]


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_corrupt_dataset_is_one_line_naming_the_file(tmp_path, capsys, how):
    from flowlift.training.shards import ShardReader

    root = _tiny_dataset(tmp_path / "data")
    _corrupt_shard(root, how)
    with pytest.raises(FlowliftError) as caught:
        ShardReader(root)
    text = str(caught.value)
    assert "\n" not in text
    assert ("shard-00001" in text) if "manifest" not in how and "_" not in how else ("dataset.json" in text)
    rc = main(
        [
            "train",
            "--data",
            str(root),
            "--output",
            str(tmp_path / "run"),
            "--steps",
            "1",
            "--crop-latent",
            "0",
            "--device",
            "cpu",
            "--set",
            "progress=false",
        ]
    )
    assert rc == 2
    _one_error_line(capsys.readouterr().err, "train")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("kind", sorted(NON_FINITE))
def test_non_finite_training_data_is_named_not_blamed_on_the_learning_rate(tmp_path, kind):
    from flowlift.training.config import build_config
    from flowlift.training.trainer import Trainer

    root = _tiny_dataset(tmp_path / "data", items=4, shard_size=2)
    shard = root / "shard-00001.safetensors"
    from safetensors import safe_open

    with safe_open(str(shard), framework="pt") as handle:
        meta = dict(handle.metadata())
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    tensors["cond"][1, 3, 2, 2] = NON_FINITE[kind]
    save_file(tensors, str(shard), metadata=meta)
    config = build_config(
        None,
        dict(
            data=str(root),
            output=str(tmp_path / "run"),
            crop=0,
            steps=2,
            batch_size=4,
            progress=False,
            **TINY_UNET,
            dropout=0.0,
        ),
    )
    with pytest.raises(FlowliftError) as caught:
        Trainer(config).run()
    text = str(caught.value)
    assert "shard-00001" in text and "item 3" in text and "'cond'" in text
    assert "learning rate" not in text


# ------------------------------------------------------------------------------------------------
# training runs: resume traps, interrupted runs, dropout layout


def _train_config(data: Path, output: Path, **overrides):
    steps = dict(crop=0, steps=4, batch_size=2, lr=1e-3, warmup_steps=1, log_every=1)
    checkpoints = dict(checkpoint_every=1, keep_checkpoints=2)
    return quiet_train_config(data, output, **{**steps, **checkpoints, **TINY_UNET, "dropout": 0.0, **overrides})


@pytest.fixture(scope="module")
def train_data(tmp_path_factory) -> Path:
    return _tiny_dataset(tmp_path_factory.mktemp("train") / "data", items=6, shard_size=3)


def _steps(output: Path) -> list[str]:
    return sorted(p.name for p in (output / "checkpoints").glob("step-*"))


def test_resume_none_into_a_run_folder_is_refused_unless_overwrite(train_data, tmp_path, capsys):
    from flowlift.training.trainer import Trainer

    run = tmp_path / "run"
    Trainer(_train_config(train_data, run, steps=3)).run()
    assert _steps(run) == ["step-00000002", "step-00000003"]
    with pytest.raises(FlowliftError, match="--overwrite"):
        Trainer(_train_config(train_data, run, steps=2, resume="none")).run()
    assert _steps(run) == ["step-00000002", "step-00000003"]
    rc = main(
        [
            "train",
            "--data",
            str(train_data),
            "--output",
            str(run),
            "--resume",
            "none",
            "--steps",
            "2",
            "--set",
            "progress=false",
            "--set",
            "crop=0",
        ]
        + [x for k, v in TINY_UNET.items() for x in ("--set", f"{k}={v}")]
    )
    assert rc == 2 and "--overwrite" in _one_error_line(capsys.readouterr().err, "train")
    summary = Trainer(_train_config(train_data, run, steps=2, resume="none", overwrite=True)).run()
    assert summary["start_step"] == 0 and _steps(run) == ["step-00000001", "step-00000002"]


@pytest.mark.parametrize("damage", ["pointer to missing", "pointer to partial", "empty pointer", "no pointer"])
def test_dangling_latest_is_an_error_not_a_silent_restart(train_data, tmp_path, damage):
    import shutil

    from flowlift.training.trainer import Trainer

    run = tmp_path / "run"
    Trainer(_train_config(train_data, run, steps=2)).run()
    latest = run / "checkpoints" / "latest"
    if damage == "pointer to missing":
        shutil.rmtree(run / "checkpoints" / "step-00000002")
    elif damage == "pointer to partial":
        (run / "checkpoints" / "step-00000002" / "train_state.pt").unlink()
    elif damage == "empty pointer":
        latest.write_text("")
    else:
        latest.unlink()
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    with pytest.raises(FlowliftError, match="--resume"):
        Trainer(_train_config(train_data, run, steps=4)).run()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


@pytest.mark.parametrize("damage", ["truncated", "empty", "foreign", "negative step"])
def test_a_damaged_training_state_is_one_line_naming_it(train_data, tmp_path, damage):
    """A truncated, empty or foreign train_state.pt was a traceback (PytorchStreamReader, EOFError, KeyError); a
    crafted step -5 trained "steps -5->5"."""
    import torch

    from flowlift.training.trainer import Trainer

    run = tmp_path / "run"
    Trainer(_train_config(train_data, run, steps=2)).run()
    state = run / "checkpoints" / "step-00000002" / "train_state.pt"
    if damage == "truncated":
        state.write_bytes(state.read_bytes()[:200])
    elif damage == "empty":
        state.write_bytes(b"")
    elif damage == "foreign":
        torch.save({"foo": 1}, state)
    else:
        saved = torch.load(state, weights_only=True)
        torch.save({**saved, "step": -5}, state)
    with pytest.raises(FlowliftError, match=r"train_state.pt: not a (complete|flowlift) training state.*--resume"):
        Trainer(_train_config(train_data, run, steps=4)).run()


def test_a_resume_keeps_the_runs_settings_and_says_when_there_is_nothing_left(train_data, tmp_path):
    """A changed lr (or weight decay, seed, ...) on resume was overridden by the saved optimizer while config.json
    recorded it; a run already at its last step trained nothing and said "last loss nan"."""
    import json

    from flowlift.training.trainer import Trainer

    run = tmp_path / "run"
    Trainer(_train_config(train_data, run, steps=4, stop_after=2)).run()
    assert "stop_after" not in json.loads((run / "config.json").read_text())  # the documented resume goes on
    for changed, words in (({"lr": 5e-3}, "lr 0.001 -> 0.005"), ({"seed": 7}, "seed 0 -> 7")):
        with pytest.raises(FlowliftError, match=f"other settings \\({words}\\).*--init"):
            Trainer(_train_config(train_data, run, steps=4, **changed)).run()
    assert json.loads((run / "config.json").read_text())["lr"] == 1e-3
    with pytest.raises(FlowliftError, match="already at step 2 .*stop_after=2"):
        Trainer(_train_config(train_data, run, steps=4, stop_after=2)).run()
    assert Trainer(_train_config(train_data, run, steps=4)).run()["step"] == 4
    with pytest.raises(FlowliftError, match="already at step 4 .* of --steps 4: nothing to train"):
        Trainer(_train_config(train_data, run, steps=4)).run()


def test_weight_decay_that_flips_the_weights_is_refused_and_a_failed_checkpoint_leaves_nothing(train_data, tmp_path):
    """weight_decay 1e30 trained to weights of 1e25 and saved them (a model that gives NaN); at 1e308 the save
    failed naming a hidden .partial folder, left behind for good."""
    import torch

    from flowlift.training import checkpoints
    from flowlift.training.trainer import Trainer

    with pytest.raises(FlowliftError, match=r"lr x weight_decay must be below 1 .* got 0.001 x 1e\+30"):
        Trainer(_train_config(train_data, tmp_path / "decay", weight_decay=1e30)).run()
    run = tmp_path / "run"
    Trainer(_train_config(train_data, run, steps=1)).run()
    from flowlift.models.upscaler_unet import FlowUpscalerUNet

    unet = FlowUpscalerUNet(**{k: v for k, v in TINY_UNET.items() if k != "dropout"})
    with torch.no_grad():
        next(unet.parameters()).view(-1)[0] = float("inf")
    with pytest.raises(FlowliftError, match=r"checkpoint .*step-00000005 not written: .*Inf.*lower --lr"):
        checkpoints.save_checkpoint(
            run, 5, unet, torch.optim.swa_utils.AveragedModel(unet), None, None, 1, 1,
            config=_train_config(train_data, run), run_id="r",
        )  # fmt: skip
    assert not list((run / "checkpoints").glob(".*partial"))


def test_a_second_run_into_a_folder_in_use_is_refused_before_it_writes(train_data, tmp_path):
    """Two runs into one folder interleaved their train_log.csv and left config.json naming the second's seed."""
    from flowlift.training.run_files import LOCK_NAME, hold_run_folder, release_run_folder
    from flowlift.training.trainer import Trainer

    run = tmp_path / "run"
    run.mkdir()
    held = hold_run_folder(run)  # the first run, as it holds the folder while it trains
    try:
        with pytest.raises(FlowliftError, match="is in use by another flowlift train run .* another --output"):
            Trainer(_train_config(train_data, run, steps=1)).run()
        assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]  # nothing of the second run's
    finally:
        release_run_folder(run, held)
    assert Trainer(_train_config(train_data, run, steps=1)).run()["step"] == 1
    assert LOCK_NAME not in {p.name for p in run.iterdir()}


def test_a_dead_runs_partial_checkpoint_is_removed_by_the_next_run_that_holds_the_folder(train_data, tmp_path):
    """A run stopped during its first checkpoint left ``.step-*.partial`` under a run id no later run has: the
    writer's own clean-up (this run's partials only) kept it forever. A run holding the folder removes flowlift's
    partials (a user's look-alike at such a name is refused before anything, as before)."""
    from flowlift.training.checkpoints import RUN_ID_NAME
    from flowlift.training.trainer import Trainer

    run = tmp_path / "run"
    dead = run / "checkpoints" / ".step-00000047.abc123.partial"
    dead.mkdir(parents=True)
    (dead / RUN_ID_NAME).write_text("a-run-that-died")
    assert Trainer(_train_config(train_data, run, steps=1)).run()["step"] == 1
    assert not dead.exists()


def test_a_crop_past_the_datasets_latents_names_its_option_and_the_largest(tmp_path, train_data, capsys):
    from flowlift.training.shards import ShardReader, ShardStream

    reader = ShardReader(train_data)
    _, height, width = reader.target_shape
    try:
        with pytest.raises(FlowliftError, match=r"crop .* larger than the dataset.s latents .*: give at most") as err:
            ShardStream(reader, micro_batch=1, crop=(min(height, width) // 4 + 1) * 4)
    finally:
        reader.close()
    assert err.value.field == "crop"  # said as --crop-latent by the command, as --set crop where given so


def test_the_data_folder_is_no_run_folder(train_data):
    from flowlift.training.trainer import Trainer

    before = sorted(p.name for p in train_data.iterdir())
    with pytest.raises(FlowliftError, match="is the data folder; give the run a folder of its own") as caught:
        Trainer(_train_config(train_data, train_data / ".", steps=1)).run()
    assert caught.value.fields == ("output", "data")  # the command line says --output and --data
    assert sorted(p.name for p in train_data.iterdir()) == before


def test_a_fifo_at_a_shard_name_is_refused_not_waited_on(tmp_path):
    """safetensors' open blocked on a FIFO inside Rust, where neither SIGINT nor SIGTERM reached Python."""
    import os

    from flowlift.training.shards import ShardReader

    root = _tiny_dataset(tmp_path / "data")
    shard = sorted(root.glob("shard-*.safetensors"))[-1]
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(FlowliftError, match="not a regular file"):
        ShardReader(root)


def test_logit_normal_time_sampling_takes_any_finite_mean():
    import torch

    from flowlift.training.objective import logistic
    from flowlift.training.shards import TimeSampling

    assert logistic(-710.0) == 0.0 or 0.0 < logistic(-710.0) < 1e-300
    assert logistic(800.0) == 1.0 and logistic(0.0) == 0.5
    for z in (-30.0, -1.5, 2.0):  # the first form's bits wherever it is finite
        assert logistic(z) == 1.0 / (1.0 + math.exp(-z))
    sampling = TimeSampling("logit_normal", 1.0, 0.0, 1.0, -710.0, 800.0)
    assert all(0.0 <= sampling.sample(torch.Generator().manual_seed(i)) <= 1.0 for i in range(20))


def test_pruning_touches_only_this_runs_checkpoints(train_data, tmp_path):
    import shutil

    from flowlift.training.trainer import Trainer

    first = tmp_path / "first"
    Trainer(_train_config(train_data, first, steps=4, stop_after=2)).run()
    other = tmp_path / "other"
    Trainer(_train_config(train_data, other, steps=1)).run()
    # another run's checkpoints with higher steps, one of them from before run ids existed
    shutil.copytree(other / "checkpoints" / "step-00000001", other / "checkpoints" / "step-00000100")
    shutil.copytree(other / "checkpoints" / "step-00000001", other / "checkpoints" / "step-00000200")
    (other / "checkpoints" / "step-00000200" / "run_id").unlink()
    summary = Trainer(
        _train_config(train_data, other, steps=4, resume=str(first / "checkpoints" / "step-00000002"))
    ).run()
    assert summary["start_step"] == 2 and summary["step"] == 4
    assert _steps(other) == ["step-00000001", "step-00000003", "step-00000004", "step-00000100", "step-00000200"]
    assert (other / "checkpoints" / "latest").read_text() == "step-00000004"


class _InterruptingUNet:
    """A FlowUpscalerUNet that sends itself SIGINT during its ``at``-th forward (a user's Ctrl-C)."""

    @staticmethod
    def build(at: int, signum: int = signal.SIGINT):
        from flowlift.models.upscaler_unet import FlowUpscalerUNet

        class Interrupting(FlowUpscalerUNet):
            calls = 0

            def forward(self, *args):
                type(self).calls += 1
                if type(self).calls == at:
                    os.kill(os.getpid(), signum)
                return super().forward(*args)

        torch.manual_seed(0)
        return Interrupting(**TINY_UNET, dropout=0.0)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_during_training_saves_a_checkpoint_then_resumes(train_data, tmp_path, signum):
    from flowlift.training.trainer import Trainer

    run = tmp_path / "run"
    config = _train_config(train_data, run, steps=6, checkpoint_every=100, keep_checkpoints=5)
    with pytest.raises(KeyboardInterrupt):
        Trainer(config, model=_InterruptingUNet.build(at=3, signum=signum)).run()
    assert _steps(run) == ["step-00000003"]
    assert (run / "checkpoints" / "latest").read_text() == "step-00000003"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    summary = Trainer(config).run()
    assert summary["start_step"] == 3 and summary["step"] == 6


def test_sample_dropout_masks_do_not_depend_on_the_batch_layout():
    from flowlift.models.upscaler_unet import SampleDropout

    layer = SampleDropout(0.5).train()
    x = torch.ones(4, 3, 5, 5)
    layer.sample_seeds = [11, 12, 13, 14]
    whole = layer(x)
    layer.sample_seeds = [13, 14]
    half = layer(x[:2])
    assert torch.equal(whole[2:], half)
    assert not torch.equal(whole[0], whole[1])
    assert set(whole.unique().tolist()) == {0.0, 2.0}
    layer.eval()
    assert torch.equal(layer(x[:2]), x[:2])


def test_dropout_does_not_break_accumulation_equivalence(train_data, tmp_path):
    """Batch 4 == 2 accumulated micro-batches of 2 with dropout on (the DDP test checks 2 ranks the same way)."""
    from flowlift.training.trainer import Trainer

    full = Trainer(_train_config(train_data, tmp_path / "full", steps=2, batch_size=4, dropout=0.3)).run()
    accum = Trainer(
        _train_config(train_data, tmp_path / "accum", steps=2, batch_size=2, grad_accum=2, dropout=0.3)
    ).run()
    for (_, a), (_, b) in zip(full["losses"], accum["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-5)


# ------------------------------------------------------------------------------------------------
# interrupted writes: temporary files never look like inputs, SIGTERM cleans up like Ctrl-C


_KILLED_WRITER = """
import os, signal, sys
sys.path.insert(0, sys.argv[2])
from flowlift.files.atomic import atomic_output
with atomic_output(sys.argv[1]) as tmp:
    tmp.write_bytes(open(sys.argv[3], "rb").read()[:100])
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _killed_mid_write(target: Path, source_image: Path) -> list[Path]:
    """Run a writer of ``target`` in a subprocess and SIGKILL it mid-write; returns the debris it left."""
    import subprocess
    import sys

    src = Path(__file__).resolve().parents[1] / "src"
    before = set(target.parent.iterdir()) if target.parent.is_dir() else set()
    result = subprocess.run(
        [sys.executable, "-c", _KILLED_WRITER, str(target), str(src), str(source_image)],
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == -signal.SIGKILL
    debris = sorted(set(target.parent.iterdir()) - before)
    assert debris and not target.exists()
    return debris


def test_dataset_and_eval_reruns_remove_a_killed_runs_temporaries(shared, tmp_path, capsys):
    """A dataset or eval rerun skips its finished work, so nothing it wrote swept the temporary folders a killed
    run left (a shard's, a saved output's, a cache entry's): the runs sweep their folders when they start."""
    from door_helpers import one_crop_dataset_args
    from flowlift.commands.cli import main

    images = tmp_path / "images"
    images.mkdir()
    source = shared / "images" / "kodak" / "kodim03.png"
    Image.open(source).crop((0, 0, 128, 96)).save(images / "a.png")
    data = tmp_path / "data"
    argv = [str(a) for a in one_crop_dataset_args(images, shared / "models" / "taef2")] + ["-o", str(data)]
    assert main(argv) == 0
    debris = _killed_mid_write(data / "shard-00001.safetensors", source)
    assert main(argv) == 0
    assert not any(path.exists() for path in debris)

    report = tmp_path / "report"
    argv = ["eval", "--run", "lanczos", "--dataset", str(images), "--scale", "2", "-o", str(report), "--save-outputs"]
    assert main(argv) == 0
    saved = report / "outputs" / "lanczos"
    debris = _killed_mid_write(saved / "b_x2.png", source) + _killed_mid_write(report / "cache" / "x.json", source)
    assert main(argv) == 0
    assert not any(path.exists() for path in debris)
    capsys.readouterr()


def test_temporary_names_are_not_image_names_and_fit_the_name_limit(tmp_path):
    from flowlift.files.atomic import TEMP_SUFFIX, atomic_output, is_temporary
    from flowlift.files.images import IMAGE_SUFFIXES

    longest = "x" * 251 + ".png"  # a legal 255-byte name
    with atomic_output(tmp_path / longest) as tmp:
        folder = tmp.parent
        assert folder.parent == tmp_path and len(folder.name.encode()) <= 255 and folder.name.endswith(TEMP_SUFFIX)
        assert tmp.suffix.lower() not in IMAGE_SUFFIXES and is_temporary(folder)
        tmp.write_bytes(b"data")
    assert (tmp_path / longest).read_bytes() == b"data"
    assert [p.name for p in tmp_path.iterdir()] == [longest]
    multibyte = "é" * 125 + ".png"  # 254 bytes
    with atomic_output(tmp_path / multibyte) as tmp:
        assert len(tmp.parent.name.encode()) <= 255
        tmp.write_bytes(b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([longest, multibyte])
    assert is_temporary(tmp_path / ".photo_x2.ab12cd_9.partial.png")  # the older naming
    assert not is_temporary(tmp_path / "photo_x2.png") and not is_temporary(tmp_path / ".hidden.png")


def test_atomic_output_fsyncs_file_then_folder(tmp_path, monkeypatch):
    from flowlift.files import atomic

    synced = []
    real_fsync = os.fsync

    def record(fd):
        synced.append(os.path.isdir(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else fd)
        return real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", record)
    atomic.atomic_write_bytes(tmp_path / "a.json", b"{}")
    assert len(synced) == 2
    if os.path.exists("/proc/self/fd"):
        assert synced == [False, True]  # the file, then its folder


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_clean_up_like_ctrl_c(tmp_path, signum):
    """SIGHUP (a closed terminal, a dropped ssh session) ended the process with no line and left its temporary."""
    from flowlift.commands import cli
    from flowlift.files.atomic import atomic_output

    with pytest.raises(KeyboardInterrupt):
        with cli._signals_interrupt():
            with atomic_output(tmp_path / "out.png") as tmp:
                tmp.write_bytes(b"partial")
                signal.raise_signal(signum)
    assert list(tmp_path.iterdir()) == [] and cli.stop_signal() == signum
    assert signal.getsignal(signum) is signal.SIG_DFL


def test_a_sighup_under_nohup_stays_ignored(tmp_path):
    """``nohup flowlift ...`` inherits SIGHUP ignored: the run goes on when the terminal closes."""
    from flowlift.commands import cli

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with cli._signals_interrupt():
            signal.raise_signal(signal.SIGHUP)  # no KeyboardInterrupt
            (tmp_path / "done").write_text("ran on")
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN and (tmp_path / "done").exists()
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_second_signal_during_the_clean_up_is_held_and_the_clean_up_finishes(tmp_path, monkeypatch):
    """A second Ctrl-C or SIGTERM a few ms after the first landed in the clean-up and left the temporary folder
    (7 of 9 runs under a burst), or a traceback from a finalizer: signals after the first are held for
    SIGNAL_HOLD_S, and the handlers are put back without a window for one to outlive the command."""
    from flowlift.commands import cli
    from flowlift.files import atomic

    real_remove = atomic._remove_folder

    def remove_under_fire(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)  # the scheduler's second SIGTERM, then the user's Ctrl-C
        signal.raise_signal(signal.SIGINT)
        return real_remove(*args, **kwargs)

    monkeypatch.setattr(atomic, "_remove_folder", remove_under_fire)
    with pytest.raises(KeyboardInterrupt):
        with cli._signals_interrupt():
            with atomic.atomic_output(tmp_path / "out.png") as tmp:
                tmp.write_bytes(b"partial")
                signal.raise_signal(signal.SIGINT)
    assert list(tmp_path.iterdir()) == []  # the clean-up finished
    assert cli.stop_signal() == signal.SIGINT  # the signal that stopped the run
    monkeypatch.setattr(cli, "SIGNAL_HOLD_S", 0.0)  # past the hold, a signal stops the clean-up too
    with pytest.raises(KeyboardInterrupt):
        with cli._signals_interrupt():
            with atomic.atomic_output(tmp_path / "again.png") as tmp:
                tmp.write_bytes(b"partial")
                signal.raise_signal(signal.SIGTERM)
    assert cli.stop_signal() == signal.SIGTERM


@pytest.mark.parametrize(
    ("environment", "has_news", "says"),
    [
        ({}, False, True),
        ({"FLOWLIFT_LAUNCH_WORKER": "1", "RANK": "0"}, False, False),  # the launcher's own line names the signal
        ({"FLOWLIFT_LAUNCH_WORKER": "1", "RANK": "0"}, True, True),  # where a training stop left the run
        ({"FLOWLIFT_LAUNCH_WORKER": "1", "RANK": "1"}, True, False),
    ],
)
def test_the_ranks_of_a_launch_leave_the_interrupted_line_to_the_launcher(monkeypatch, environment, has_news, says):
    from flowlift.commands import cli

    monkeypatch.delenv("FLOWLIFT_LAUNCH_WORKER", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    assert cli._says_interrupted(has_news) is says


@pytest.mark.parametrize("layout", ["next to inputs", "separate folder"])
def test_killed_mid_write_then_resume(shared, tiny_weights, tmp_path, capsys, layout):
    src = tmp_path / "in"
    src.mkdir()
    for name, colour in (("a", (200, 30, 30)), ("b", (30, 200, 30))):
        Image.new("RGB", (48, 32), colour).save(src / f"{name}.png")
    out = src if layout == "next to inputs" else tmp_path / "out"
    debris = _killed_mid_write(out / "a_x2.png", src / "a.png")
    # and the older naming (.name.XXXX.partial.png), which image listings used to pick up
    (out / ".b_x2.k3j4h5l6.partial.png").write_bytes((src / "b.png").read_bytes()[:50])
    argv = [
        "upscale",
        str(src),
        "--scale",
        "2",
        *cpu_upscale_options(shared, tiny_weights),
    ]
    if layout == "separate folder":
        argv += ["-o", str(out)]
    for _ in range(2):  # the run after the kill, and the resume after that
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 0, err
        assert "Traceback" not in err and "partial" not in err
        for name in ("a_x2.png", "b_x2.png"):
            with Image.open(out / name) as result:
                assert result.size == (96, 64)
        # issue 22.3: the killed run's hidden temporary is gone after the rerun; issue 32.E: a file that
        # merely has an older release's temporary name carries no proof flowlift made it, so it stays
        hidden = [p.name for p in out.iterdir() if p.name.startswith(".")]
        assert hidden == [".b_x2.k3j4h5l6.partial.png"], sorted(out.iterdir())
    assert debris and not any(p.exists() for p in debris)


_LIVE_WRITER = """
import sys, time
sys.path.insert(0, sys.argv[2])
from flowlift.files.atomic import atomic_output
with atomic_output(sys.argv[1]) as tmp:
    tmp.write_bytes(b"half an image")
    print(tmp, flush=True)
    time.sleep(120)
"""


def test_a_live_writers_temporary_is_left_alone_and_removed_once_it_is_killed(tmp_path, capsys):
    """Issue 22.3: a later run removes the temporaries of killed runs, never one a live process writes."""
    import subprocess
    import sys

    from flowlift.files.atomic import remove_stale_temporaries, temporary_in_use

    src = Path(__file__).resolve().parents[1] / "src"
    writer = subprocess.Popen(
        [sys.executable, "-c", _LIVE_WRITER, str(tmp_path / "a_x2.png"), str(src)], stdout=subprocess.PIPE, text=True
    )
    try:
        temporary = Path(writer.stdout.readline().strip())
        assert temporary.is_file() and temporary_in_use(temporary)
        assert remove_stale_temporaries(tmp_path, before=time.time() + 60) == []  # older than the run, but locked
        assert temporary.is_file()
        assert main(["status", str(tmp_path)]) == 1
        assert f"being written now: {temporary.parent.name}" in capsys.readouterr().out
    finally:
        writer.kill()
        writer.wait(timeout=30)
    assert writer.returncode == -signal.SIGKILL and temporary.is_file()
    assert not temporary_in_use(temporary)  # the kernel dropped the dead writer's lock
    assert remove_stale_temporaries(tmp_path, before=temporary.stat().st_mtime) == []  # not older than the run
    assert remove_stale_temporaries(tmp_path) == [temporary.parent] and list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------
# the pipeline: non-finite latents/pixels per stage, API types, the cap


class _AverageVAE:
    """A weightless VAE: encode = 8x8 average pool to 32 channels, decode = nearest upsample of 3."""

    spatial_factor = 8

    def __init__(self, poison: str = "") -> None:
        self.poison = poison

    def encode(self, images, tiled=None):
        z = torch.nn.functional.avg_pool2d(images, 8).repeat(1, 11, 1, 1)[:, :32]
        if self.poison == "encode":
            z[0, 0, 0, 0] = float("nan")
        return z

    def decode(self, latents, tiled=None):
        x = torch.nn.functional.interpolate(latents[:, :3], scale_factor=8, mode="nearest").clamp(0, 1)
        if self.poison == "decode":
            x[0, 1, 5, 5] = float("inf")
        return x


class _VelocityFrom:
    """v = 0 except on pass ``bad_pass`` (1-based), where one value is ``value``."""

    def __init__(self, bad_pass: int = 0, value: float = float("nan")) -> None:
        self.calls, self.bad_pass, self.value = 0, bad_pass, value

    def __call__(self, sample, timestep, latents_small):
        self.calls += 1
        velocity = torch.zeros_like(sample)
        if self.calls == self.bad_pass:
            velocity[0, 3, 1, 2] = self.value
        return velocity


@pytest.mark.parametrize("kind", sorted(NON_FINITE))
@pytest.mark.parametrize("bad_pass", [1, 2, 3])
def test_a_non_finite_pass_is_named_and_nothing_is_returned(kind, bad_pass):
    from flowlift.upscale.pipeline import FlowUpscalerPipeline

    pipe = FlowUpscalerPipeline(
        _VelocityFrom(bad_pass, NON_FINITE[kind]), _AverageVAE(), device="cpu", dtype=torch.float32
    )
    with pytest.raises(FlowliftError, match=rf"pass {bad_pass} produced non-finite latents"):
        pipe.upscale_image(Image.new("RGB", (32, 16), (90, 120, 30)), num_passes=3)


@pytest.mark.parametrize("stage", ["encode", "decode"])
def test_non_finite_vae_output_is_named(stage):
    from flowlift.upscale.pipeline import FlowUpscalerPipeline

    pipe = FlowUpscalerPipeline(_VelocityFrom(), _AverageVAE(stage), device="cpu", dtype=torch.float32)
    with pytest.raises(FlowliftError, match=f"VAE {stage}r produced non-finite"):
        pipe.upscale_image(Image.new("RGB", (32, 16)), num_passes=1)
    latents = torch.zeros(1, 32, 2, 4)
    latents[0, 5, 1, 1] = float("nan")
    with pytest.raises(FlowliftError, match="input latents contain non-finite"):
        pipe.upscale_latents(latents, 1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_passes": 1.5}, "num_passes must be a non-negative integer"),
        ({"num_passes": True}, "num_passes must be a non-negative integer"),
        ({"num_passes": -1}, "num_passes must be a non-negative integer"),
        ({"seed": 1.7}, "seed must be a non-negative integer"),
        ({"seed": -3}, "seed must be a non-negative integer"),
        ({"transplant_strength": float("nan")}, "transplant_strength"),
        ({"color_fix_strength": float("inf")}, "color_fix_strength"),
    ],
)
def test_upscale_image_validates_its_arguments(kwargs, message):
    from flowlift.upscale.pipeline import FlowUpscalerPipeline

    pipe = FlowUpscalerPipeline(_VelocityFrom(), _AverageVAE(), device="cpu", dtype=torch.float32)
    with pytest.raises(FlowliftError, match=message):
        pipe.upscale_image(Image.new("RGB", (32, 16)), **{"num_passes": 1, **kwargs})
    with pytest.raises(FlowliftError, match="must lie in"):
        pipe.upscale_image(np.full((16, 32, 3), 200.0), num_passes=1)
    out = pipe.upscale_image(Image.new("RGB", (32, 16)), num_passes=np.int64(1), seed=np.int32(2))
    assert out.size == (64, 32)


def test_the_cap_is_on_the_computed_canvas_and_the_warning_names_the_real_size():
    from flowlift.upscale.pipeline import FlowUpscalerPipeline
    from flowlift.upscale.sizes import planned_passes, upscaled_size

    assert planned_passes(1, 1, 20) == 10  # a 16x16 canvas: 10 passes reach 16384, not the 14 of 1 px
    assert planned_passes(1, 1, 20, "resample") == 10
    assert planned_passes(16, 16, 20) == 10 and planned_passes(17, 16, 20) == 9  # 32 px canvas
    assert planned_passes(4100, 30, 3) == 1 and upscaled_size(30, 4100, 1) == (60, 8200)
    assert upscaled_size(30, 4100, 1, "resample") == (64, 8192)
    pipe = FlowUpscalerPipeline(_VelocityFrom(), _AverageVAE(), device="cpu", dtype=torch.float32)
    with pytest.warns(UserWarning, match=r"on a 2100x9 image .* running 2 pass\(es\) .* output 8400x36, scale 4"):
        out = pipe.upscale_image(Image.new("RGB", (2100, 9)), num_passes=4)
    assert out.size == (8400, 36)


# ------------------------------------------------------------------------------------------------
# the upscale batch: names by the scale produced, broken outputs redone, bad paths and targets


def _upscale(shared, weights, *argv) -> list[str]:
    return ["upscale", *argv, *cpu_upscale_options(shared, weights)]


def test_cap_dropped_passes_name_the_output_by_the_scale_produced_and_resume(shared, tiny_weights, tmp_path, capsys):
    Image.new("RGB", (2100, 16), (100, 150, 200)).save(tmp_path / "wide.png")
    out = tmp_path / "out"
    argv = _upscale(shared, tiny_weights, str(tmp_path / "wide.png"), "-o", str(out), "--passes", "3")
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["wide_x4.png"]  # 2 of 3 passes fit: named x4, not x8
    assert "2100x16 image" in err and "scale 4" in err
    with Image.open(out / "wide_x4.png") as result:
        assert result.size == (8400, 64)
        assert json.loads(result.text["flowlift"])["scale"] == 4
    assert main(argv) == 0  # the rerun finds it: planned from the header, not after the compute
    assert "skipped" in capsys.readouterr().err


@pytest.mark.parametrize(
    "damage", ["empty", "garbage", "truncated", "cut mid-data", "another flowlift run", "not an image"]
)
def test_broken_existing_outputs_are_redone_not_skipped(shared, tiny_weights, tmp_path, capsys, damage):
    Image.new("RGB", (48, 32), (10, 200, 90)).save(tmp_path / "a.png")
    out = tmp_path / "out"
    argv = _upscale(shared, tiny_weights, str(tmp_path / "a.png"), "-o", str(out))
    assert main(argv) == 0
    good = (out / "a_x2.png").read_bytes()
    target = out / "a_x2.png"
    if damage == "empty":
        target.write_bytes(b"")
    elif damage == "garbage":
        target.write_bytes(os.urandom(500))
    elif damage == "truncated":
        target.write_bytes(good[:20])
    elif damage == "cut mid-data":  # the header (and size) intact: only a full read finds it
        target.write_bytes(good[: len(good) * 2 // 3])
    elif damage == "another flowlift run":  # flowlift's own result at another size (other settings)
        info = PngImagePlugin.PngInfo()
        info.add_text("Software", "flowlift 0.1.0 upscale")
        Image.new("RGB", (48, 32)).save(target, pnginfo=info)
    else:
        target.write_text("hello")
    capsys.readouterr()
    if damage in ("garbage", "truncated", "not an image"):  # issue 32.F: without flowlift's metadata, the user's
        kept = target.read_bytes()
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert "was not written by flowlift" in err and "use --overwrite" in err and "Traceback" not in err
        assert target.read_bytes() == kept
        argv = [*argv, "--overwrite"]
        assert main(argv) == 0
        capsys.readouterr()
    else:
        assert main(argv) == 0
        err = capsys.readouterr().err
        assert "redoing" in err and "96x64" in err
    with Image.open(target) as result:
        assert result.size == (96, 64)
    argv = [a for a in argv if a != "--overwrite"]
    assert main(argv) == 0 and "skipped" in capsys.readouterr().err


def _png_bytes(size: tuple[int, int], colour: tuple[int, int, int], fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format=fmt)
    return buffer.getvalue()


@pytest.mark.parametrize("theirs", ["png of another size", "jpeg of another size", "huge png"])
def test_a_users_image_at_an_output_name_is_never_overwritten(shared, tiny_weights, tmp_path, capsys, theirs):
    """Issue 22.1: any valid image flowlift did not write is the user's: one line for that input, exit 1,
    the batch goes on; only --overwrite replaces it."""
    for name, colour in (("a", (200, 40, 40)), ("b", (40, 200, 40))):
        Image.new("RGB", (48, 32), colour).save(tmp_path / f"{name}.png")
    out = tmp_path / "out"
    out.mkdir()
    suffix = ".jpg" if theirs.startswith("jpeg") else ".png"
    fmt = "jpg" if suffix == ".jpg" else "png"
    if theirs == "huge png":  # past Pillow's decompression-bomb limit: a picture all the same
        with Image.new("1", (14000, 14000)) as huge:
            buffer = io.BytesIO()
            huge.save(buffer, format="PNG")
        user = buffer.getvalue()
    else:
        user = _png_bytes((128, 96), (1, 2, 3), "JPEG" if suffix == ".jpg" else "PNG")
    (out / f"a_x2{suffix}").write_bytes(user)
    argv = _upscale(
        shared, tiny_weights, str(tmp_path / "a.png"), str(tmp_path / "b.png"), "-o", str(out), "--format", fmt
    )
    assert main(argv) == 1
    err = capsys.readouterr().err
    refused = [line for line in err.splitlines() if "was not written by flowlift" in line]
    assert len(refused) == 1 and "a.png" in refused[0] and "use --overwrite" in refused[0], err
    assert "Traceback" not in err and "redoing" not in err
    assert (out / f"a_x2{suffix}").read_bytes() == user  # kept, byte for byte
    assert (out / f"b_x2{suffix}").is_file()  # the batch went on
    assert main(argv) == 1 and (out / f"a_x2{suffix}").read_bytes() == user  # and stays refused
    capsys.readouterr()
    assert main([*argv, "--overwrite"]) == 0
    with Image.open(out / f"a_x2{suffix}") as replaced:
        assert replaced.size == (96, 64)


def test_a_users_image_of_the_right_size_is_skipped_not_replaced(shared, tiny_weights, tmp_path, capsys):
    Image.new("RGB", (48, 32), (200, 40, 40)).save(tmp_path / "a.png")
    user = _png_bytes((96, 64), (9, 9, 9))
    (tmp_path / "a_x2.png").write_bytes(user)
    assert main(_upscale(shared, tiny_weights, str(tmp_path / "a.png"))) == 0
    assert "skipped" in capsys.readouterr().err and (tmp_path / "a_x2.png").read_bytes() == user


def test_colorfix_and_a_continued_job_refuse_a_users_image_too(tmp_path, capsys):
    """The same rule where colorfix plans its outputs and where a job with a manifest (torchrun's path,
    here continued by one process) does: refused in one line, recorded as failed, the file kept."""
    from flowlift.jobs.batch import plan_jobs
    from flowlift.jobs.distributed import DistEnv
    from flowlift.jobs.manifest import Manifest, latest_by_output
    from flowlift.jobs.scaleout import run_batch

    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (10, 12, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(tmp_path / "a_x2.png")
    user = _png_bytes((5, 5), (1, 2, 3))
    (tmp_path / "a_x2_colorfix.png").write_bytes(user)
    code = main(["colorfix", str(tmp_path / "a_x2.png"), "--reference", str(tmp_path / "a.png")])
    err = capsys.readouterr().err
    assert code == 1 and "was not written by flowlift" in err and "Traceback" not in err
    assert (tmp_path / "a_x2_colorfix.png").read_bytes() == user

    out = tmp_path / "job"
    out.mkdir()
    (out / "a_x2.png").write_bytes(user)
    Manifest(out).write_record({"event": "job", "run": "earlier", "inputs": 1, "todo": 1, "world_size": 2})
    jobs = plan_jobs([tmp_path / "a.png"], str(out), lambda p: f"{p.stem}_x2.png", expected_size=lambda p: (20, 24))
    assert run_batch(jobs, lambda: None, command="upscale", folder=out, env=DistEnv()) == 1
    assert "was not written by flowlift" in capsys.readouterr().err
    assert (out / "a_x2.png").read_bytes() == user
    record = latest_by_output(Manifest(out).records())[os.path.abspath(out / "a_x2.png")]
    assert record["status"] == "failed" and "was not written by flowlift" in record["error"]


def test_bad_paths_cost_one_line_each_and_the_batch_goes_on(shared, tiny_weights, tmp_path, capsys):
    Image.new("RGB", (48, 32), (200, 100, 0)).save(tmp_path / "good.png")
    os.mkfifo(tmp_path / "pipe.png")
    (tmp_path / "folder.jpg").mkdir()
    argv = _upscale(
        shared,
        tiny_weights,
        str(tmp_path / "good.png"),
        str(tmp_path / "missing.png"),
        str(tmp_path / "pipe.png"),
        str(tmp_path / "*.jpg"),
        "-o",
        str(tmp_path / "out"),
    )
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    for name in ("missing.png", "pipe.png", "folder.jpg"):
        assert sum(name in line for line in err.splitlines() if line.startswith("flowlift upscale:")) == 1, err
    assert "3 of 4 image(s) failed" in err
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["good_x2.png"]


def test_output_targets_are_checked_before_any_compute(shared, tiny_weights, tmp_path, capsys, monkeypatch):
    import flowlift.upscale.pipeline as pipeline

    Image.new("RGB", (48, 32)).save(tmp_path / "a.png")
    Image.new("RGB", (8192, 16)).save(tmp_path / "wide.png")  # 2x: 16384 px, one over WebP's limit
    (tmp_path / "blocker").write_text("a file where the output folder should be")

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded although every target was refused")

    monkeypatch.setattr(pipeline.FlowUpscalerPipeline, "__init__", no_model)
    rc = main(_upscale(shared, tiny_weights, str(tmp_path / "a.png"), "-o", str(tmp_path / "x.gif")))
    assert rc == 2 and "unsupported output format .gif" in _one_error_line(capsys.readouterr().err, "upscale")
    rc = main(_upscale(shared, tiny_weights, str(tmp_path / "a.png"), "-o", str(tmp_path / "blocker" / "out")))
    err = capsys.readouterr().err
    assert rc == 2 and "blocker is not a folder; give a folder" in _one_error_line(err, "upscale")
    rc = main(_upscale(shared, tiny_weights, str(tmp_path / "wide.png"), "-o", str(tmp_path / "w"), "--format", "webp"))
    err = capsys.readouterr().err
    assert rc == 1 and "16383 px limit" in err and "16384x32" in err
    assert not (tmp_path / "x.gif").exists()
