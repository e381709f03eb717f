"""A test InvokeAI 6.14.2 server and its HTTP client (used by tests/test_invokeai.py and docs/invokeai_screenshot.py).

:func:`start_server` runs ``invokeai-web`` from the venv of tests/invokeai_venv.py on a free 127.0.0.1
port with a fresh ``INVOKEAI_ROOT`` whose ``nodes/flowlift`` is a link to this repository (the pack as
docs/invokeai.md installs it: only the CPU shim on ``PYTHONPATH``, never this checkout's ``src``);
:func:`stop_server` ends its process group and checks that it exited. :class:`InvokeAIServer` speaks
the REST API the tests need: uploads, model installs, graphs on the queue, results, images, tensors.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from app_helpers import free_port
from door_helpers import LocalServer, stop_process_group
from invokeai_venv import invokeai_env, invokeai_python

REPO_ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 300  # a loaded 2-core CI machine
ITEM_TIMEOUT_S = 300
FINISHED = ("completed", "failed", "canceled")


class InvokeAIServer(LocalServer):
    """HTTP client of the test server, with the paths of its root folder."""

    TAIL_LINES = 60

    def log_lines(self, containing: str) -> list[str]:
        return [line for line in self.log.read_text(errors="replace").splitlines() if containing in line]

    def request(
        self,
        method: str,
        path: str,
        payload: Any = None,
        *,
        body: bytes | None = None,
        content_type: str = "application/json",
        timeout: float = 60,
    ) -> Any:
        data = body if body is not None else (None if payload is None else json.dumps(payload).encode())
        req = urllib.request.Request(self.url + path, data=data, method=method, headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as response:
                raw = response.read()
                kind = response.headers.get("Content-Type", "")
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:3000]
            raise AssertionError(f"{method} {path}: HTTP {error.code}: {detail}") from None
        if "json" in kind:
            return json.loads(raw) if raw.strip() else None
        return raw

    # -- files in ------------------------------------------------------------------------------------

    def upload_png(self, image: Image.Image, name: str) -> str:
        """Upload ``image`` as a PNG (multipart form, as the web page does); returns its image_name."""
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        boundary = uuid.uuid4().hex
        body = (
            (
                f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
                "Content-Type: image/png\r\n\r\n"
            ).encode()
            + buffer.getvalue()
            + f"\r\n--{boundary}--\r\n".encode()
        )
        query = urllib.parse.urlencode({"image_category": "user", "is_intermediate": "false"})
        form = f"multipart/form-data; boundary={boundary}"
        answer = self.request("POST", f"/api/v1/images/upload?{query}", body=body, content_type=form)
        return answer["image_name"]

    def install_model(self, path: Path, timeout: float = ITEM_TIMEOUT_S) -> dict:
        """Install a local model file in place through the model manager; returns its config."""
        query = urllib.parse.urlencode({"source": str(path), "inplace": "true"})
        job = self.request("POST", f"/api/v2/models/install?{query}", {})
        deadline = time.monotonic() + timeout
        while job["status"] not in ("completed", "error", "cancelled"):
            assert time.monotonic() < deadline, f"model install of {path} not done after {timeout} s"
            time.sleep(0.5)
            job = self.request("GET", f"/api/v2/models/install/{job['id']}")
        assert job["status"] == "completed", (job.get("error"), job.get("error_traceback"))
        return job["config_out"]

    def put_tensor(self, tensor: torch.Tensor, name: str) -> str:
        """Place ``tensor`` where the server keeps its tensors, as a latents input (``LatentsField``)."""
        (folder,) = (self.root / "outputs" / "tensors").glob("tmp*")
        torch.save(tensor, folder / name)
        return name

    # -- the queue ------------------------------------------------------------------------------------

    def enqueue(self, graph: dict) -> int:
        batch = {"batch": {"graph": graph, "runs": 1}, "prepend": False}
        answer = self.request("POST", "/api/v1/queue/default/enqueue_batch", batch)
        (item_id,) = answer["item_ids"]
        return item_id

    def item(self, item_id: int) -> dict:
        return self.request("GET", f"/api/v1/queue/default/i/{item_id}")

    def wait(self, item_id: int, timeout: float = ITEM_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            item = self.item(item_id)
            if item["status"] in FINISHED:
                return item
            if self.process.poll() is not None:
                raise AssertionError(f"InvokeAI exited with {self.process.returncode}:\n{self.log_tail()}")
            assert time.monotonic() < deadline, f"queue item {item_id} not finished after {timeout} s"
            time.sleep(0.2)

    def run(self, graph: dict, timeout: float = ITEM_TIMEOUT_S) -> dict:
        item = self.wait(self.enqueue(graph), timeout)
        assert item["status"] == "completed", (item["status"], item.get("error_type"), item.get("error_message"))
        return item

    def cancel(self, item_id: int) -> None:
        self.request("PUT", f"/api/v1/queue/default/i/{item_id}/cancel")

    # -- results out ----------------------------------------------------------------------------------

    @staticmethod
    def output(item: dict, node_id: str) -> dict:
        """The output of graph node ``node_id`` (its one prepared copy) in a finished queue item."""
        session = item["session"]
        (prepared,) = session["source_prepared_mapping"][node_id]
        return session["results"][prepared]

    def image(self, name: str) -> Image.Image:
        return Image.open(io.BytesIO(self.request("GET", f"/api/v1/images/i/{name}/full")))

    def image_tensor(self, name: str) -> torch.Tensor:
        """(1, 3, H, W) float32 in [0, 1] of a stored image (its alpha dropped)."""
        array = np.asarray(self.image(name).convert("RGB"), dtype=np.float32) / 255.0
        return torch.from_numpy(array).permute(2, 0, 1)[None]

    def tensor(self, name: str) -> torch.Tensor:
        """A latents tensor the server stored (read as InvokeAI reads it: weights only)."""
        (path,) = (self.root / "outputs" / "tensors").glob(f"tmp*/{name}")
        return torch.load(path, weights_only=True)


def graph(nodes: dict[str, dict], edges: list[tuple[str, str, str, str]]) -> dict:
    """A graph: ``nodes`` by id (``{"type": ..., field: value}``), edges as (from node, field, to node, field)."""
    return {
        "id": uuid.uuid4().hex,
        "nodes": {node_id: {"id": node_id, **node} for node_id, node in nodes.items()},
        "edges": [
            {"source": {"node_id": a, "field": fa}, "destination": {"node_id": b, "field": fb}}
            for a, fa, b, fb in edges
        ],
    }


def start_server(root: Path) -> InvokeAIServer:
    """``invokeai-web`` on a free loopback port with ``root`` as INVOKEAI_ROOT and this repository as
    ``nodes/flowlift``; returns once the process runs (see :func:`wait_until_serving`)."""
    python = invokeai_python()  # builds the venv if CI did not (minutes, once)
    (root / "nodes").mkdir(parents=True, exist_ok=True)
    link = root / "nodes" / "flowlift"
    if not link.exists():
        os.symlink(REPO_ROOT, link, target_is_directory=True)
    port = free_port()
    log = root / "server.log"
    env = invokeai_env(INVOKEAI_ROOT=str(root), INVOKEAI_HOST="127.0.0.1", INVOKEAI_PORT=str(port))
    command = [str(python.parent / "invokeai-web")]
    with open(log, "wb") as log_file:
        process = subprocess.Popen(
            command, cwd=root, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
    return InvokeAIServer(root, port, process, log)


def wait_until_serving(server: InvokeAIServer, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if server.process.poll() is not None:
            raise AssertionError(f"InvokeAI exited with {server.process.returncode} at start:\n{server.log_tail()}")
        try:
            server.request("GET", "/api/v1/app/version", timeout=10)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, AssertionError):
            if time.monotonic() > deadline:
                raise AssertionError(f"InvokeAI did not serve within {timeout} s:\n{server.log_tail()}") from None
            time.sleep(0.5)


def stop_server(process: subprocess.Popen) -> int:
    """SIGTERM to the server's process group, SIGKILL after 30 s; returns the exit status (it has exited)."""
    return stop_process_group(process, 30)
