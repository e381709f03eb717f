"""A real ComfyUI 0.33 server with this node pack, for the tests, the docs scripts and the soak benchmark.

:func:`comfy_server` copies ``../shared/comfyui-0.33`` into a temp folder, links this repository (and the
test-only nodes of ``tests/comfy_test_nodes``) into its ``custom_nodes/``, writes random small models, a tiny
FLUX.2 Klein single file, the real TAEF2 and the test inputs into its folders (:func:`write_models_and_inputs`),
starts it in the venv of ``tests/comfy_venv.py`` on a free 127.0.0.1 port and stops its whole process group on
the way out (bounded waits: nothing is left running). :class:`ComfyServer` is its HTTP client.

:func:`session_server` is the one server the test modules share (one start per pytest session: a start
costs a minute on a loaded 2-core machine); it is stopped when the session ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file

from app_helpers import free_port
from comfy_venv import comfy_env, comfy_python, comfyui_dir
from door_helpers import LocalServer, stop_process_group
from flowlift.models.upscaler_unet import FlowUpscalerUNet
from flowlift.models.upscaler_weights import save_upscaler
from sesqui_reference import save_random_sesqui

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = REPO_ROOT / "example_workflows"
#: The API-format copies of the shipped workflows (the UI-format ones are at the top of WORKFLOWS).
API_WORKFLOWS = WORKFLOWS / "api"
#: The name ComfyUI gives the pack (its folder in custom_nodes/): templates are served under it.
PACK_NAME = "flowlift"
START_TIMEOUT_S = 300  # a loaded 2-core CI machine: ComfyUI imports ~545 nodes first
PROMPT_TIMEOUT_S = 240
IMAGE_W, IMAGE_H = 48, 32
#: The input of the long runs that are interrupted (8x: 2048x1536 out; a plain last pass takes seconds).
BIG_W, BIG_H = 256, 192
#: The tiled refine tests' FLUX.2 latent: 128x192 px (ComfyUI's layout, 16 px per latent pixel).
REFINE_LATENT = (1, 128, 8, 12)
#: The Klein transformer the hires templates name: here a tiny random Klein (:func:`write_tiny_klein`) in
#: ComfyUI's single-file layout, which ComfyUI's own UNETLoader detects and loads.
KLEIN_UNET = "flux-2-klein-4b.safetensors"
#: The text encoder they name: an empty stand-in, listed but never loaded (ComfyUI's Qwen3-4B text encoder has a
#: fixed size, 36 layers of 2560, so no tiny one loads; the tests' conditioning comes from a test-only node).
KLEIN_TEXT_ENCODER = "qwen_3_4b.safetensors"
#: The tiny Klein: 2 heads of 128 (ComfyUI 0.33 takes heads = hidden // 128), one double and one single block, a
#: text context 32 wide (ComfyUI takes it from ``txt_in``); the test-only conditioning node makes contexts this wide.
TINY_KLEIN = {"hidden": 256, "double_blocks": 1, "single_blocks": 1, "context": 32}
#: Test-only nodes (text conditioning for the tiny Klein, the tiled refine's reference), linked in with the pack.
TEST_NODES = Path(__file__).resolve().parent / "comfy_test_nodes"


def random_upscaler(base: int, seed: int) -> FlowUpscalerUNet:
    """A Flow Upscaler of width ``base`` with random weights (norm affines and biases too)."""
    torch.manual_seed(seed)
    model = FlowUpscalerUNet(base_channels=base, time_dim=32, cond_dim=64).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:  # non-trivial norm affines and biases
                param.normal_(0.1, 0.5)
    return model


def write_random_flux2_vae(path: Path) -> None:
    """A randomly initialised full-size FLUX.2 VAE in the single-file layout ComfyUI's VAELoader reads.

    ComfyUI builds the FLUX.2 VAE with fixed widths (128-256-512-512, two blocks per level), so the
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


def write_random_mage_vae(path: Path, full_size: bool = False, decode_only: bool = False) -> None:
    """A random Mage-VAE in the released single-file layout (tests/mage_files.py): narrow, or ``full_size`` (the
    released architecture, the only one ComfyUI's own VAELoader builds), stored as float16; ``decode_only``: no
    encoder tensors (a narrow decoder file)."""
    from flowlift.models.mage_vae import MageVAEConfig
    from mage_files import released_state, save_released

    if full_size:
        save_released(path, released_state(MageVAEConfig(), seed=4), dtype=torch.float16)
    else:
        save_released(path, released_state(encoder=not decode_only))


def write_tiny_klein(path: Path, seed: int = 0) -> None:
    """A tiny random FLUX.2 Klein transformer (:data:`TINY_KLEIN`) as one file with Black Forest Labs' names, the
    single-file layout ComfyUI's UNETLoader reads (no guidance embedder: Klein is distilled without one)."""
    from diffusers import Flux2Transformer2DModel

    from flux2_files import write_single_file

    torch.manual_seed(seed)
    model = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=128,
        num_layers=TINY_KLEIN["double_blocks"],
        num_single_layers=TINY_KLEIN["single_blocks"],
        attention_head_dim=128,
        num_attention_heads=TINY_KLEIN["hidden"] // 128,
        joint_attention_dim=TINY_KLEIN["context"],
        timestep_guidance_channels=256,
        axes_dims_rope=(32, 32, 32, 32),
        guidance_embeds=False,
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # RMSNorm scales away from 1
                param.normal_(1.0, 0.1)
    write_single_file(model.eval(), path)


class ComfyServer(LocalServer):
    """HTTP client of a test server, with the paths of its temp install."""

    def __init__(self, root: Path, port: int, process: subprocess.Popen, log: Path) -> None:
        super().__init__(root, port, process, log)
        self.object_info: dict = {}

    def fetch(self, path: str, timeout: float = 30) -> tuple[bytes, str]:
        """GET ``path``: (body, content type)."""
        with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
            return response.read(), response.headers.get("Content-Type", "")

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
    """The first history status message of ``kind`` (e.g. ``execution_error``)."""
    found = [data for name, data in entry["status"]["messages"] if name == kind]
    assert found, entry["status"]
    return found[0]


def load_api_workflow(name: str) -> dict:
    """An API-format copy of a shipped workflow (``example_workflows/api/<name>``)."""
    return json.loads((API_WORKFLOWS / name).read_text())


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
    shutil.copy(
        models / "latent_upscale_models" / "flow_upscaler.safetensors",
        root.parent / "extra_models" / "latent_upscale_models" / "extra_upscaler.safetensors",
    )
    (models / "latent_upscale_models" / "corrupt.safetensors").write_bytes(b"\x17not a safetensors file" * 8)
    save_random_sesqui(models / "latent_upscale_models")  # upscaler_Flux2.safetensors, SesquiLSR's released name
    for name in ("taef2_encoder.pth", "taef2_decoder.pth"):
        shutil.copy(shared / "models" / "taef2" / name, models / "vae_approx" / name)
    write_random_mage_vae(models / "vae" / "mage_vae.safetensors", full_size=True)
    write_random_mage_vae(models / "vae" / "mage_decoder.safetensors", decode_only=True)
    write_tiny_klein(models / "diffusion_models" / KLEIN_UNET)
    (models / "text_encoders" / KLEIN_TEXT_ENCODER).write_bytes(b"")  # listed, never loaded
    source = Image.open(shared / "images" / "kodak" / "kodim23.png").convert("RGB")
    example = source.crop((300, 150, 300 + 4 * IMAGE_W, 150 + 4 * IMAGE_H)).resize((IMAGE_W, IMAGE_H), Image.LANCZOS)
    example.save(inputs / "example.png")
    # An image "from another upscaler" with a colour drift, for the colour fix.
    drifted = np.asarray(example.resize((2 * IMAGE_W, 2 * IMAGE_H), Image.LANCZOS), dtype=np.float32)
    drifted = np.clip(drifted * [1.08, 1.0, 0.9] + [6, 0, -4], 0, 255).round().astype(np.uint8)
    Image.fromarray(drifted).save(inputs / "upscaled.png")
    example.resize((IMAGE_W - 3, IMAGE_H)).save(inputs / "odd_size.png")
    source.resize((BIG_W, BIG_H), Image.LANCZOS).save(inputs / "big.png")
    source.resize((2064, 32), Image.LANCZOS).save(inputs / "wide.png")  # 8x would pass 16384 px; 4x fits
    gen = torch.Generator().manual_seed(5)
    shapes = (("big_flux2.latent", (1, 128, 48, 48)), ("sd15.latent", (1, 4, 8, 8)), ("refine.latent", REFINE_LATENT))
    for name, shape in shapes:
        latent = {"latent_tensor": torch.randn(shape, generator=gen), "latent_format_version_0": torch.tensor([])}
        save_file(latent, str(inputs / name))


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 20 s; nothing is left running."""
    stop_process_group(process, 20)


@contextlib.contextmanager
def comfy_server(
    base: Path,
    shared: Path,
    write_files: Callable[[Path, Path], None] = write_models_and_inputs,
    env: dict[str, str] | None = None,
    test_nodes: bool = True,
) -> Iterator[ComfyServer]:
    """ComfyUI 0.33 in ``base/ComfyUI`` with this pack in custom_nodes/, serving on 127.0.0.1.

    ``write_files(root, shared)`` fills its model and input folders while the server starts (ComfyUI lists
    folders when asked, not at start). ``test_nodes`` links the test-only nodes of :data:`TEST_NODES` in too.
    The server's process group is stopped on exit, whatever happens.
    """
    python = comfy_python()  # builds the venv if CI did not (minutes, once)
    root = base / "ComfyUI"
    shutil.copytree(comfyui_dir(), root, ignore=shutil.ignore_patterns("tests", "tests-unit", "__pycache__"))
    models, inputs = root / "models", root / "input"
    model_folders = [
        models / name for name in ("vae", "latent_upscale_models", "vae_approx", "diffusion_models", "text_encoders")
    ]
    for folder in (root / "custom_nodes", inputs, *model_folders):
        folder.mkdir(parents=True, exist_ok=True)
    os.symlink(REPO_ROOT, root / "custom_nodes" / PACK_NAME, target_is_directory=True)
    if test_nodes:
        os.symlink(TEST_NODES, root / "custom_nodes" / "flowlift_test_nodes", target_is_directory=True)
    # A user's extra model folder: the pack must add to ComfyUI's folder entries, never replace them.
    (base / "extra_models" / "latent_upscale_models").mkdir(parents=True)
    (root / "extra_model_paths.yaml").write_text(
        f"flowlift_test:\n    base_path: {base / 'extra_models'}\n    latent_upscale_models: latent_upscale_models\n"
    )

    port = free_port()
    log = root / "server.log"
    command = [str(python), "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port), "--disable-auto-launch"]
    with open(log, "wb") as log_file:
        process = subprocess.Popen(
            command,
            cwd=root,
            env=env or comfy_env(),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = ComfyServer(root, port, process, log)
    try:
        write_files(root, shared)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise AssertionError(f"ComfyUI exited with {process.returncode} during start-up:\n{server.log_tail()}")
            try:
                server.object_info = server.request("/object_info", timeout=60)
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"ComfyUI did not serve /object_info within {START_TIMEOUT_S} s:\n{server.log_tail()}"
                    ) from None
                time.sleep(0.5)
        yield server
    finally:
        stop(process)


_SESSION: dict[str, object] = {}


def session_server(config: object, tmp_path_factory: object, shared: Path) -> ComfyServer:
    """The ComfyUI server of this pytest session (started on first use, stopped when the session ends): every test
    module of the pack shares it. The browser tests mark the tutorial as seen (no template browser on first visit)."""
    if "server" not in _SESSION:
        context = comfy_server(tmp_path_factory.mktemp("comfy"), shared)
        server = context.__enter__()
        config.add_cleanup(lambda: context.__exit__(None, None, None))
        server.request("/settings/Comfy.TutorialCompleted", True)
        _SESSION["server"] = server
    return _SESSION["server"]
