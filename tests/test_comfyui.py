"""The node pack inside a real ComfyUI v0.8.0 server (../shared/comfyui), driven over its HTTP API.

One server per module: a temp copy of ComfyUI with this repository linked into custom_nodes/, random
small models in its models/ folders, bound to 127.0.0.1 on a free port and stopped at the end. The
example workflows in example_workflows/ are what the tests post to /prompt; the results are read
from ComfyUI's output folder and compared with flowlift's Python API on the same inputs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from comfy_venv import comfy_env, comfy_python, comfyui_dir
from flowlift.flux2.latents import from_comfyui_latent, patchify
from flowlift.models.upscaler_unet import FlowUpscalerUNet
from flowlift.models.upscaler_weights import load_upscaler, save_upscaler
from flowlift.models.vae_loading import load_vae
from flowlift.upscale.colorfix import lab_lowband_transplant
from flowlift.upscale.pipeline import FlowUpscalerPipeline

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = REPO_ROOT / "example_workflows"
NODE_IDS = (
    "FlowliftUpscalerLoader",
    "FlowliftUpscaleLatent",
    "FlowliftUpscaleImage",
    "FlowliftColorFix",
    "FlowliftTAEF2Loader",
)
#: Saved workflows depend on these: a change here is a breaking change for users.
WIDGET_ORDER = {
    "FlowliftUpscalerLoader": ["upscaler_name"],
    "FlowliftUpscaleLatent": ["upscaler", "samples", "scale", "seed", "transplant_strength", "chunked"],
    "FlowliftUpscaleImage": [
        "image", "upscaler", "vae", "scale", "seed", "transplant_strength", "color_fix_strength", "chunked"
    ],
    "FlowliftColorFix": ["image", "reference", "strength"],
    "FlowliftTAEF2Loader": ["taef2_name"],
}
START_TIMEOUT_S = 300  # a loaded 2-core CI machine: ComfyUI imports ~545 nodes first
PROMPT_TIMEOUT_S = 240
IMAGE_W, IMAGE_H = 48, 32


# --------------------------------------------------------------------------------------------------
# models and inputs


def random_upscaler(base: int, seed: int) -> FlowUpscalerUNet:
    torch.manual_seed(seed)
    model = FlowUpscalerUNet(base_channels=base, time_dim=32, cond_dim=64).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:  # non-trivial norm affines and biases
                param.normal_(0.1, 0.5)
    return model


def write_random_flux2_vae(path: Path) -> None:
    """A randomly initialised full-size FLUX.2 VAE in the single-file layout ComfyUI's VAELoader reads.

    ComfyUI v0.8.0 builds the FLUX.2 VAE with fixed widths (128-256-512-512, two blocks per level), so the
    released architecture is also the smallest it loads.
    """
    from diffusers import AutoencoderKLFlux2

    from test_vae import to_original_keys

    torch.manual_seed(11)
    model = AutoencoderKLFlux2()
    with torch.no_grad():
        model.bn.running_mean.copy_(torch.randn(128) * 0.3)
        model.bn.running_var.copy_(torch.rand(128) + 0.5)
    state = to_original_keys(model.state_dict(), num_up_blocks=len(model.config.block_out_channels))
    save_file({k: v.to(torch.float16).contiguous() for k, v in state.items()}, str(path))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ComfyServer:
    """HTTP client of the test server, with the paths of its temp install."""

    def __init__(self, root: Path, port: int, process: subprocess.Popen, log: Path) -> None:
        self.root, self.port, self.process, self.log = root, port, process, log
        self.url = f"http://127.0.0.1:{port}"

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def request(self, path: str, payload: dict | None = None, timeout: float = 30) -> dict:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as response:
                body = response.read()
        except urllib.error.HTTPError as error:
            raise AssertionError(f"{path}: HTTP {error.code}: {error.read().decode(errors='replace')[:2000]}") from None
        return json.loads(body) if body.strip() else {}

    def queue(self, workflow: dict) -> str:
        answer = self.request("/prompt", {"prompt": workflow, "client_id": uuid.uuid4().hex})
        assert not answer.get("node_errors"), answer
        return answer["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = PROMPT_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            entry = self.request(f"/history/{prompt_id}").get(prompt_id)
            if entry and entry.get("status", {}).get("completed") is not None:
                return entry
            if self.process.poll() is not None:
                raise AssertionError(f"ComfyUI exited with {self.process.returncode}:\n{self.log_tail()}")
            time.sleep(0.2)
        raise AssertionError(f"prompt {prompt_id} not finished after {timeout} s:\n{self.log_tail()}")

    def run(self, workflow: dict) -> dict:
        entry = self.wait(self.queue(workflow))
        assert entry["status"]["status_str"] == "success", (entry["status"], self.log_tail())
        return entry

    def output_file(self, entry: dict, node: str, kind: str = "images") -> Path:
        (item,) = entry["outputs"][node][kind]
        return self.root / "output" / item["subfolder"] / item["filename"]


def message(entry: dict, kind: str) -> dict:
    found = [data for name, data in entry["status"]["messages"] if name == kind]
    assert found, entry["status"]
    return found[0]


def load_workflow(name: str) -> dict:
    return json.loads((WORKFLOWS / name).read_text())


def png_tensor(path: Path) -> torch.Tensor:
    """(1, 3, H, W) float32 in [0, 1] — the same pixels ComfyUI's LoadImage gives."""
    array = np.asarray(Image.open(path).convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy(array).permute(2, 0, 1)[None]


def write_models_and_inputs(root: Path, shared: Path) -> None:
    """Random models in ComfyUI's model folders, the real TAEF2, and the test images and latents."""
    models, inputs = root / "models", root / "input"
    write_random_flux2_vae(models / "vae" / "flux2-vae.safetensors")
    save_upscaler(random_upscaler(16, seed=1), models / "latent_upscale_models" / "flow_upscaler.safetensors")
    save_upscaler(random_upscaler(64, seed=2), models / "latent_upscale_models" / "flow_upscaler_b64.safetensors")
    shutil.copy(models / "latent_upscale_models" / "flow_upscaler.safetensors",
                root.parent / "extra_models" / "latent_upscale_models" / "extra_upscaler.safetensors")
    (models / "latent_upscale_models" / "corrupt.safetensors").write_bytes(b"\x17not a safetensors file" * 8)
    for name in ("taef2_encoder.pth", "taef2_decoder.pth"):
        shutil.copy(shared / "models" / "taef2" / name, models / "vae_approx" / name)
    source = Image.open(shared / "images" / "kodak" / "kodim23.png").convert("RGB")
    example = source.crop((300, 150, 300 + 4 * IMAGE_W, 150 + 4 * IMAGE_H)).resize((IMAGE_W, IMAGE_H), Image.LANCZOS)
    example.save(inputs / "example.png")
    # An image "from another upscaler" with a colour drift, for the colour fix.
    drifted = np.asarray(example.resize((2 * IMAGE_W, 2 * IMAGE_H), Image.LANCZOS), dtype=np.float32)
    drifted = np.clip(drifted * [1.08, 1.0, 0.9] + [6, 0, -4], 0, 255).round().astype(np.uint8)
    Image.fromarray(drifted).save(inputs / "upscaled.png")
    example.resize((IMAGE_W - 3, IMAGE_H)).save(inputs / "odd_size.png")
    gen = torch.Generator().manual_seed(5)
    for name, shape in (("big_flux2.latent", (1, 128, 48, 48)), ("sd15.latent", (1, 4, 8, 8))):
        latent = {"latent_tensor": torch.randn(shape, generator=gen), "latent_format_version_0": torch.tensor([])}
        save_file(latent, str(inputs / name))


@pytest.fixture(scope="module")
def server(tmp_path_factory, shared):
    """ComfyUI v0.8.0 with this pack in custom_nodes/, serving on 127.0.0.1; stopped after the module."""
    python = comfy_python()  # builds the venv if CI did not (minutes, once)
    root = tmp_path_factory.mktemp("comfy") / "ComfyUI"
    shutil.copytree(comfyui_dir(), root, ignore=shutil.ignore_patterns("tests", "tests-unit", "__pycache__"))
    models, inputs = root / "models", root / "input"
    model_folders = [models / name for name in ("vae", "latent_upscale_models", "vae_approx")]
    for folder in (root / "custom_nodes", inputs, *model_folders):
        folder.mkdir(parents=True, exist_ok=True)
    os.symlink(REPO_ROOT, root / "custom_nodes" / "flowlift", target_is_directory=True)
    # A user's extra model folder: the pack must add to ComfyUI's folder entries, never replace them.
    (root.parent / "extra_models" / "latent_upscale_models").mkdir(parents=True)
    (root / "extra_model_paths.yaml").write_text(
        f"flowlift_test:\n    base_path: {root.parent / 'extra_models'}\n"
        "    latent_upscale_models: latent_upscale_models\n"
    )

    port = free_port()
    log = root / "server.log"
    command = [str(python), "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port), "--disable-auto-launch"]
    with open(log, "wb") as log_file:
        process = subprocess.Popen(
            command, cwd=root, env=comfy_env(), stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        # Models and inputs are written while ComfyUI starts (it lists folders when asked, not at start).
        write_models_and_inputs(root, shared)
    except BaseException:
        stop(process)
        raise
    comfy = ComfyServer(root, port, process, log)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"ComfyUI exited with {process.returncode} during start-up:\n{comfy.log_tail()}")
            try:
                info = comfy.request("/object_info", timeout=60)
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                if time.monotonic() > deadline:
                    pytest.fail(f"ComfyUI did not serve /object_info within {START_TIMEOUT_S} s:\n{comfy.log_tail()}")
                time.sleep(0.5)
        comfy.object_info = info
        yield comfy
    finally:
        stop(process)


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 20 s; nothing is left running."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=20)


# --------------------------------------------------------------------------------------------------
# tests


def test_the_five_nodes_load_with_stable_ids_and_widget_order(server):
    info = server.object_info
    missing = [n for n in NODE_IDS if n not in info]
    assert not missing, f"nodes missing from /object_info: {missing}\n{server.log_tail()}"
    for node, order in WIDGET_ORDER.items():
        assert info[node]["input_order"]["required"] == order, node
    # our files are listed through ComfyUI's own folders, extra_model_paths.yaml folders included
    names = info["FlowliftUpscalerLoader"]["input"]["required"]["upscaler_name"][0]
    assert {"flow_upscaler.safetensors", "corrupt.safetensors", "extra_upscaler.safetensors"} <= set(names)
    taef2_names = info["FlowliftTAEF2Loader"]["input"]["required"]["taef2_name"][0]
    assert taef2_names == ["taef2_decoder.pth", "taef2_encoder.pth"]
    failed = [ln for ln in server.log.read_text(errors="replace").splitlines() if "IMPORT FAILED" in ln]
    assert not any("flowlift" in ln for ln in failed), failed


def test_flux2_latent_workflow_equals_the_python_api(server):
    workflow = load_workflow("flux2_latent_upscale_4x.json")
    # 2x: the random full-size FLUX.2 VAE dominates this test's time on a CPU (4x chaining is checked with TAEF2)
    workflow["5"]["inputs"] |= {"seed": 7, "scale": "2x"}
    chunked = dict(workflow["5"], inputs=dict(workflow["5"]["inputs"], chunked="always"))
    workflow |= {
        "90": {"class_type": "SaveLatent", "inputs": {"samples": ["3", 0], "filename_prefix": "test/encoded"}},
        "91": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": "test/upscaled"}},
        "92": chunked,
        "93": {"class_type": "SaveLatent", "inputs": {"samples": ["92", 0], "filename_prefix": "test/chunked"}},
    }
    entry = server.run(workflow)

    with Image.open(server.output_file(entry, "7")) as image:
        assert image.size == (2 * IMAGE_W, 2 * IMAGE_H)
    encoded = load_file(str(server.output_file(entry, "90", "latents")))["latent_tensor"]
    assert encoded.shape == (1, 128, IMAGE_H // 16, IMAGE_W // 16)
    upscaler = load_upscaler(server.root / "models" / "latent_upscale_models" / "flow_upscaler.safetensors")
    pipeline = FlowUpscalerPipeline(upscaler, vae=None, chunked=False)
    expected = patchify(pipeline.upscale_latents(from_comfyui_latent({"samples": encoded}), 1, seed=7))
    for node, atol in (("91", 1e-5), ("93", 1e-4)):  # the chunked executor equals the plain pass to ~1e-5
        got = load_file(str(server.output_file(entry, node, "latents")))["latent_tensor"]
        assert got.shape == (1, 128, IMAGE_H // 8, IMAGE_W // 8)
        torch.testing.assert_close(got, expected, rtol=0, atol=atol)


def test_taef2_workflows_equal_the_python_api(server, shared):
    workflow = load_workflow("image_upscale_4x_taef2.json")
    workflow["4"]["inputs"]["seed"] = 3
    workflow |= {
        "80": {"class_type": "VAEEncode", "inputs": {"pixels": ["1", 0], "vae": ["2", 0]}},
        "81": {"class_type": "VAEDecode", "inputs": {"samples": ["80", 0], "vae": ["2", 0]}},
        "82": {"class_type": "SaveImage", "inputs": {"images": ["81", 0], "filename_prefix": "test/taef2_round"}},
        "83": {
            "class_type": "VAEDecodeTiled",
            "inputs": {
                "samples": ["80", 0], "vae": ["2", 0], "tile_size": 512, "overlap": 64,
                "temporal_size": 64, "temporal_overlap": 8,
            },
        },
        "84": {"class_type": "SaveImage", "inputs": {"images": ["83", 0], "filename_prefix": "test/taef2_tiled"}},
    }
    entry = server.run(workflow)

    pixels = png_tensor(server.root / "input" / "example.png")
    taef2 = load_vae(shared / "models" / "taef2")
    upscaler = load_upscaler(server.root / "models" / "latent_upscale_models" / "flow_upscaler.safetensors")
    expected = FlowUpscalerPipeline(upscaler, taef2).upscale_image(pixels, 2, seed=3, output_type="pt")
    got = png_tensor(server.output_file(entry, "5"))
    assert got.shape == (1, 3, 4 * IMAGE_H, 4 * IMAGE_W)
    assert (got - expected).abs().max().item() <= 1 / 255 + 1e-6
    round_trip = taef2.decode(taef2.encode(pixels)).clamp(0, 1)
    assert (png_tensor(server.output_file(entry, "82")) - round_trip).abs().max().item() <= 1 / 255 + 1e-6
    assert png_tensor(server.output_file(entry, "84")).shape == pixels.shape


def test_color_fix_equals_stage_2(server):
    entry = server.run(load_workflow("color_fix.json"))
    upscaled = png_tensor(server.root / "input" / "upscaled.png")
    reference = png_tensor(server.root / "input" / "example.png")
    expected = lab_lowband_transplant(upscaled, reference, 1.0)
    got = png_tensor(server.output_file(entry, "4"))
    assert (got - expected).abs().max().item() <= 1 / 255 + 1e-6
    assert (upscaled - expected).abs().max().item() > 4 / 255  # the fix did change the drifted image


def test_bad_inputs_fail_with_one_line_and_the_server_keeps_serving(server):
    corrupt = {
        "1": {"class_type": "FlowliftUpscalerLoader", "inputs": {"upscaler_name": "corrupt.safetensors"}},
        "2": {"class_type": "LoadLatent", "inputs": {"latent": "big_flux2.latent"}},
        "3": {
            "class_type": "FlowliftUpscaleLatent",
            "inputs": {"upscaler": ["1", 0], "samples": ["2", 0], "scale": "2x", "seed": 0,
                       "transplant_strength": 1.0, "chunked": "auto"},
        },
        "4": {"class_type": "SaveLatent", "inputs": {"samples": ["3", 0], "filename_prefix": "test/never"}},
    }
    entry = server.wait(server.queue(corrupt))
    error = message(entry, "execution_error")
    assert entry["status"]["status_str"] == "error" and error["node_type"] == "FlowliftUpscalerLoader"
    assert error["exception_type"].endswith("FlowliftError")
    text = error["exception_message"].strip()
    assert "\n" not in text and "cannot read" in text and "corrupt.safetensors" in text, text

    not_flux2 = json.loads(json.dumps(corrupt))
    not_flux2["1"]["inputs"]["upscaler_name"] = "flow_upscaler.safetensors"
    not_flux2["2"]["inputs"]["latent"] = "sd15.latent"
    error = message(server.wait(server.queue(not_flux2)), "execution_error")
    assert error["node_type"] == "FlowliftUpscaleLatent"
    assert "needs a FLUX.2 LATENT (batch, 128, h, w)" in error["exception_message"]
    assert "(1, 4, 8, 8)" in error["exception_message"]

    odd = load_workflow("color_fix.json")
    odd["2"]["inputs"]["image"] = "odd_size.png"
    error = message(server.wait(server.queue(odd)), "execution_error")
    assert "integer multiple of the reference" in error["exception_message"]
    assert "\n" not in error["exception_message"].strip()

    server.run(load_workflow("color_fix.json"))  # still serving


def test_interrupt_stops_a_long_chunked_run_within_seconds(server):
    workflow = {
        "1": {"class_type": "FlowliftUpscalerLoader", "inputs": {"upscaler_name": "flow_upscaler_b64.safetensors"}},
        "2": {"class_type": "LoadLatent", "inputs": {"latent": "big_flux2.latent"}},
        "3": {
            "class_type": "FlowliftUpscaleLatent",
            "inputs": {"upscaler": ["1", 0], "samples": ["2", 0], "scale": "8x", "seed": 0,
                       "transplant_strength": 1.0, "chunked": "always"},
        },
        "4": {"class_type": "SaveLatent", "inputs": {"samples": ["3", 0], "filename_prefix": "test/interrupted"}},
    }
    prompt_id = server.queue(workflow)
    deadline = time.monotonic() + 60
    while not any(item[1] == prompt_id for item in server.request("/queue")["queue_running"]):
        assert time.monotonic() < deadline, "the prompt never started"
        time.sleep(0.1)
    time.sleep(3.0)  # well inside the first passes (the whole run takes far longer)
    assert not server.request(f"/history/{prompt_id}"), "the run finished before the interrupt: make it longer"
    started = time.monotonic()
    server.request("/interrupt", {})
    entry = server.wait(prompt_id, timeout=60)
    took = time.monotonic() - started
    print(f"interrupt honoured after {took:.2f} s")
    interrupted = message(entry, "execution_interrupted")
    assert interrupted["node_type"] == "FlowliftUpscaleLatent"
    assert "4" not in entry["outputs"]
    assert took <= 5.0, f"interrupt took {took:.1f} s"
