"""``--dtype auto`` on the CPU (issue 31): bfloat16 for the Flow Upscaler and TAEF2 only where the CPU
computes bf16 natively (the detection monkeypatched both ways, so the tests hold on any machine), float32
elsewhere; channels-last equals the contiguous layout to float rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import flowlift.devices as devices
from builders import save_tiny_unet
from flowlift.commands.cli import main
from flowlift.devices import auto_dtype, cpu_has_native_bf16, cpu_subnormals_at_full_speed, resolve_device_dtype
from flowlift.files.image_outputs import read_metadata

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return save_tiny_unet(tmp_path_factory.mktemp("weights") / "flow_upscaler.safetensors")


@pytest.fixture
def native_bf16(monkeypatch):
    """Set what the CPU detection answers: ``native_bf16(True)`` / ``native_bf16(False)``."""

    def answer(value: bool) -> None:
        monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: value)

    return answer


def test_auto_is_bfloat16_on_the_cpu_only_with_native_bf16_and_only_where_asked(native_bf16):
    native_bf16(False)
    assert resolve_device_dtype("cpu", "auto", cpu_bf16=True) == (CPU, torch.float32)
    assert auto_dtype(CPU, cpu_bf16=True) == torch.float32
    native_bf16(True)
    assert resolve_device_dtype("cpu", "auto", cpu_bf16=True) == (CPU, torch.bfloat16)
    assert resolve_device_dtype("cpu", None, cpu_bf16=True) == (CPU, torch.bfloat16)
    assert resolve_device_dtype("cpu", "auto") == (CPU, torch.float32)  # other commands: float32 on the CPU
    assert resolve_device_dtype("cpu", "float32", cpu_bf16=True) == (CPU, torch.float32)  # an explicit dtype wins
    assert auto_dtype(torch.device("meta"), cpu_bf16=True) == torch.float32
    assert auto_dtype(torch.device("cuda"), cpu_bf16=False) == torch.bfloat16


def test_detection_reads_torchs_cpu_features_and_falls_back_to_cpuinfo(monkeypatch, tmp_path):
    monkeypatch.delenv("FLOWLIFT_CPU_BF16")  # conftest's pin to float32, tested last
    features = {"avx512_bf16": False, "amx_bf16": False, "avx512_f": True}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: dict(features), raising=False)
    assert cpu_has_native_bf16() is False  # AVX512 alone converts bf16 around every kernel: slower than fp32
    features["avx512_bf16"] = True
    assert cpu_has_native_bf16() is True
    features.update(avx512_bf16=False, amx_bf16=True)
    assert cpu_has_native_bf16() is True
    monkeypatch.delattr(torch.cpu, "get_capabilities")
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n")
    assert cpu_has_native_bf16(str(info)) is False
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n")
    assert cpu_has_native_bf16(str(info)) is True
    assert cpu_has_native_bf16(str(tmp_path / "missing")) is False
    monkeypatch.setenv("FLOWLIFT_CPU_BF16", "0")
    assert cpu_has_native_bf16(str(info)) is False


def test_subnormal_speed_is_read_from_the_cpu_vendor(tmp_path, monkeypatch):
    """AMD's CPUs count as producing subnormals at full speed, Intel's and unknown ones as slow."""
    import platform

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx512_bf16\n")
    assert cpu_subnormals_at_full_speed(str(info)) is True
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu amx_bf16\n")
    assert cpu_subnormals_at_full_speed(str(info)) is False
    monkeypatch.setattr(platform, "processor", lambda: "AMD64 Family 25 Model 17 Stepping 1, AuthenticAMD")
    assert cpu_subnormals_at_full_speed(str(tmp_path / "missing")) is True  # Windows: no cpuinfo
    monkeypatch.setattr(platform, "processor", lambda: "")
    assert cpu_subnormals_at_full_speed(str(tmp_path / "missing")) is False


@pytest.mark.parametrize("native", [False, True])
def test_upscale_command_runs_what_auto_picks(native, native_bf16, tmp_path, shared, weights, single_thread_torch):
    native_bf16(native)
    photo = Image.open(shared / "images" / "photos" / "Wine_by_Jakkub_Mede.png").convert("RGB")
    photo.resize((48, 32), Image.Resampling.BOX).save(tmp_path / "in.png")
    common = ["--upscaler", str(weights), "--vae", str(shared / "models" / "taef2"), "--device", "cpu"]
    outputs = {}
    for dtype in ("auto", "float32"):
        out = tmp_path / f"{dtype}.png"
        assert main(["upscale", str(tmp_path / "in.png"), "-o", str(out), "--dtype", dtype, *common]) == 0
        outputs[dtype] = out
    ran = {name: read_metadata(path)["flowlift"]["dtype"] for name, path in outputs.items()}
    assert ran == {"auto": "bfloat16" if native else "float32", "float32": "float32"}
    auto = torch.tensor(list(Image.open(outputs["auto"]).getdata()), dtype=torch.float32)
    fp32 = torch.tensor(list(Image.open(outputs["float32"]).getdata()), dtype=torch.float32)
    if native:  # bf16 rounding through a random UNet and TAEF2; stage 2 pins the colour to the input
        assert 0 < (auto - fp32).abs().mean() < 3 and (auto.mean(0) - fp32.mean(0)).abs().max() < 0.5
    else:
        assert torch.equal(auto, fp32)


def test_pipeline_default_follows_the_rule_with_channels_last_in_bf16(native_bf16, weights, single_thread_torch):
    from flowlift.upscale.pipeline import FlowUpscalerPipeline

    native_bf16(False)
    pipe = FlowUpscalerPipeline(str(weights), None, device="cpu")
    assert (pipe.dtype, pipe.channels_last) == (torch.float32, False)
    assert next(pipe.upscaler.parameters()).is_contiguous()
    native_bf16(True)
    pipe = FlowUpscalerPipeline(str(weights), None, device="cpu")
    assert (pipe.dtype, pipe.channels_last) == (torch.bfloat16, True)
    conv = next(m for m in pipe.upscaler.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (3, 3))
    assert conv.weight.dtype == torch.bfloat16 and conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert FlowUpscalerPipeline(str(weights), None, device="cpu", dtype=torch.float32).channels_last is False


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 0.1)])
def test_channels_last_equals_contiguous(dtype, tolerance, weights, single_thread_torch):
    """The same passes with channels-last and contiguous weights and inputs: equal to float rounding
    (fp32: summation order only, 1e-5 on latents of unit scale; bf16: one bf16 rounding step of the
    activations, ~2^-8 relative, through the UNet)."""
    from flowlift.upscale.pipeline import FlowUpscalerPipeline

    latents = torch.randn(1, 32, 6, 8, generator=torch.Generator().manual_seed(3))
    results = {}
    for layout in (False, True):
        pipe = FlowUpscalerPipeline(str(weights), None, device="cpu", dtype=dtype, channels_last=layout)
        results[layout] = pipe.upscale_latents(latents, num_passes=2, seed=5)
    difference = (results[True] - results[False]).abs().max().item()
    assert difference <= tolerance, difference


def test_taef2_channels_last_equals_contiguous(shared, single_thread_torch):
    """TAEF2VAE always runs channels-last; its decode equals the contiguous module's to float rounding."""
    from flowlift.models.vae_loading import load_vae

    vae = load_vae(str(shared / "models" / "taef2"), device="cpu", dtype=torch.float32)
    latents = torch.randn(1, 32, 8, 12, generator=torch.Generator().manual_seed(4))
    channels_last = vae.decode(latents)
    vae.model.to(memory_format=torch.contiguous_format)
    with torch.inference_mode():
        contiguous = vae.model.decode_full(latents.contiguous())
    assert (channels_last - contiguous).abs().max().item() < 1e-5


def test_png_outputs_are_written_at_the_chosen_zlib_level_strategy_and_filter(tmp_path, shared, monkeypatch):
    """The first command's 6 MP PNG spent a third of the time at level 3 (docs/cpu.md), and less again with zlib's
    RLE strategy, for a smaller file; since issue 47 OpenCV's encoder writes it with the Paeth filter on every row
    (Pillow tried all five per row: 0.6x its CPU time for a file within 0.5% of its size). The writer asks for all
    three, every row is Paeth-filtered, and the pixels read back are the picture's own."""
    import io
    import struct
    import zlib

    import cv2

    from flowlift.files.image_outputs import PNG_COMPRESS_LEVEL, PNG_ZLIB_STRATEGY, save_image_atomic

    calls = []
    real = cv2.imencode
    monkeypatch.setattr(
        cv2, "imencode", lambda ext, array, params=(): calls.append(list(params)) or real(ext, array, params)
    )
    image = Image.open(shared / "images" / "kodak" / "kodim23.png").convert("RGB").crop((0, 0, 96, 64))
    written = save_image_atomic(image, tmp_path / "out.png").read_bytes()
    assert (PNG_COMPRESS_LEVEL, PNG_ZLIB_STRATEGY) == (3, 3) and len(calls) == 1
    params = dict(zip(calls[0][::2], calls[0][1::2], strict=True))
    assert params[cv2.IMWRITE_PNG_COMPRESSION] == 3 and params[cv2.IMWRITE_PNG_STRATEGY] == cv2.IMWRITE_PNG_STRATEGY_RLE
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(written))), np.asarray(image))
    if hasattr(cv2, "IMWRITE_PNG_FILTER"):  # OpenCV 4.11 on
        assert params[cv2.IMWRITE_PNG_FILTER] == cv2.IMWRITE_PNG_FILTER_PAETH
        idat, at = b"", 8
        while at < len(written):
            (length,), kind = struct.unpack(">I", written[at : at + 4]), written[at + 4 : at + 8]
            idat += written[at + 8 : at + 8 + length] if kind == b"IDAT" else b""
            at += 12 + length
        raw = zlib.decompress(idat)
        assert {raw[row * (1 + 96 * 3)] for row in range(64)} == {4}  # every row's filter byte: Paeth


# ------------------------------------------------ issue 36, class 11: narrow images in bfloat16 on the CPU


@pytest.mark.parametrize("shape", [(1, 32, 64, 2), (1, 32, 64, 1), (2, 32, 16, 2), (1, 32, 1024, 1), (1, 96, 33, 2)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_strided_convolution_one_column_wide_is_right_in_bf16(shape, channels_last):
    """torch's CPU bf16 kernel returns garbage for a stride-2 convolution one output column wide (the
    downsample of a 16 px wide image's latents); StridedConv2d equals the float32 convolution to bf16 rounding,
    on every call."""
    from flowlift.models.upscaler_unet import StridedConv2d

    torch.manual_seed(0)
    conv = StridedConv2d(shape[1], shape[1], 3, stride=2, padding=1)
    x = torch.randn(shape)
    with torch.no_grad():
        reference = torch.nn.functional.conv2d(x, conv.weight, conv.bias, 2, 1)
        fast = conv.to(torch.bfloat16)
        xb = x.bfloat16()
        if channels_last:
            fast, xb = fast.to(memory_format=torch.channels_last), xb.contiguous(memory_format=torch.channels_last)
        for _ in range(3):
            out = fast(xb)
            assert out.dtype == torch.bfloat16 and out.shape == reference.shape
            assert (out.float() - reference).abs().max() <= 0.02 * reference.abs().max() + 0.02


def test_the_strided_conv_keeps_nn_conv2ds_state_dict():
    from flowlift.models.upscaler_unet import FlowUpscalerUNet

    model = FlowUpscalerUNet(base_channels=32, time_dim=32, cond_dim=64)
    assert "down_stages.0.downsample.weight" in model.state_dict()
    assert isinstance(model.down_stages[0].downsample, torch.nn.Conv2d)


@pytest.mark.parametrize("size", [(16, 512), (16, 160), (1, 96), (3, 300), (32, 512)])
def test_narrow_images_upscale_in_bf16_like_float32(native_bf16, tmp_path, shared, weights, size, single_thread_torch):
    """`--dtype auto` (bf16 on a CPU with native bf16, forced here) on strips 1-32 px wide: written, and close to
    float32 (was: "pass 1 produced non-finite latents", or finite garbage)."""
    native_bf16(True)
    Image.new("RGB", size, (120, 70, 30)).save(tmp_path / "in.png")
    noise = torch.rand(size[1], size[0], 3) * 60
    Image.fromarray((torch.tensor([120, 70, 30]) + noise).clamp(0, 255).byte().numpy()).save(tmp_path / "in.png")
    common = ["--upscaler", str(weights), "--vae", str(shared / "models" / "taef2"), "--device", "cpu"]
    pixels = {}
    for dtype in ("auto", "float32"):
        out = tmp_path / f"{dtype}.png"
        assert main(["upscale", str(tmp_path / "in.png"), "-o", str(out), "--dtype", dtype, *common]) == 0
        pixels[dtype] = torch.tensor(list(Image.open(out).getdata()), dtype=torch.float32)
    assert read_metadata(tmp_path / "auto.png")["flowlift"]["dtype"] == "bfloat16"
    assert (pixels["auto"] - pixels["float32"]).abs().mean() < 4


@pytest.mark.parametrize(
    "code, preset, expected",
    [
        # the command line as its own process: set before torch is imported
        ("import flowlift.commands.cli as c; sys.argv = ['flowlift']; c.main()", None, "PASSIVE"),
        # an in-process caller of main(argv) keeps its own environment
        ("import flowlift.commands.cli as c; c.main([])", None, None),
        # a user's own setting wins
        ("import flowlift.commands.cli as c; sys.argv = ['flowlift']; c.main()", "ACTIVE", "ACTIVE"),
        # too late once torch (and libgomp) is loaded: nothing is set
        ("import torch, flowlift.devices as d; assert not d.passive_thread_wait()", None, None),
    ],
)
def test_command_line_makes_torch_threads_wait_passively(code, preset, expected):
    """Issue 47: libgomp's spinning at barriers doubled a command's CPU time on a loaded machine; a command that is
    its own process sets OMP_WAIT_POLICY=PASSIVE before torch loads, and nothing else changes the environment."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if preset:
        env["OMP_WAIT_POLICY"] = preset
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1] / "src")
    probe = f"import os, sys\n{code}\nprint('POLICY', os.environ.get('OMP_WAIT_POLICY'))"
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"POLICY {expected}" in run.stdout.splitlines()
