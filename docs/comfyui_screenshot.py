"""Regenerate docs/comfyui_workflow.png (the ComfyUI page with example workflow (a) loaded) and the
UI-format copies of the example workflows in example_workflows/ui/.

Runs the same set-up as tests/test_comfyui.py (temp ComfyUI v0.8.0 copy, this repository in
custom_nodes/, random models, loopback server in the venv of tests/comfy_venv.py), opens the page in
headless Chromium (selenium + chromedriver), loads the workflow through the frontend's own
API-format loader and saves a screenshot; then loads every example workflow the same way and writes
the graph the frontend made of it (``app.graph.serialize()``, the UI format). Usage::

    python docs/comfyui_screenshot.py [--workflow flux2_latent_upscale_4x.json] [--out docs/comfyui_workflow.png]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT / "tests"), str(REPO_ROOT / "src")]

from comfy_venv import comfy_env, comfy_python, comfyui_dir, shared_dir  # noqa: E402
from test_comfyui import ComfyServer, free_port, stop, write_models_and_inputs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workflow", default="flux2_latent_upscale_4x.json")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "comfyui_workflow.png")
    args = parser.parse_args()
    workflow = json.loads((REPO_ROOT / "example_workflows" / args.workflow).read_text())

    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    python = comfy_python()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ComfyUI"
        shutil.copytree(comfyui_dir(), root, ignore=shutil.ignore_patterns("tests", "tests-unit", "__pycache__"))
        for folder in ("custom_nodes", "input", "models/vae", "models/latent_upscale_models", "models/vae_approx"):
            (root / folder).mkdir(parents=True, exist_ok=True)
        (Path(tmp) / "extra_models" / "latent_upscale_models").mkdir(parents=True)
        os.symlink(REPO_ROOT, root / "custom_nodes" / "flowlift", target_is_directory=True)
        write_models_and_inputs(root, shared_dir())
        port = free_port()
        command = [str(python), "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
                   "--disable-auto-launch"]
        log = root / "server.log"
        with open(log, "wb") as log_file:
            process = subprocess.Popen(command, cwd=root, env=comfy_env(), stdout=log_file,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        server = ComfyServer(root, port, process, log)
        driver = None
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    server.request("/system_stats", timeout=10)
                    break
                except OSError:
                    if time.monotonic() > deadline or process.poll() is not None:
                        raise SystemExit(f"ComfyUI did not start:\n{server.log_tail()}") from None
                    time.sleep(0.5)
            server.request("/settings/Comfy.TutorialCompleted", True)  # no template browser on first visit
            options = Options()
            options.binary_location = shutil.which("chromium") or shutil.which("google-chrome") or ""
            for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1600,1000"):
                options.add_argument(flag)
            driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
            driver.get(server.url)
            deadline = time.monotonic() + 120
            while not driver.execute_script("return !!(window.app && window.app.graph)"):
                if time.monotonic() > deadline:
                    raise SystemExit("the ComfyUI page did not load")
                time.sleep(0.5)
            time.sleep(3)
            driver.execute_script("window.app.loadApiJson(arguments[0], arguments[1])", workflow, args.workflow)
            time.sleep(3)
            driver.save_screenshot(str(args.out))
            print(f"wrote {args.out}")
            ui_dir = REPO_ROOT / "example_workflows" / "ui"
            ui_dir.mkdir(exist_ok=True)
            for path in sorted((REPO_ROOT / "example_workflows").glob("*.json")):
                driver.execute_script(
                    "window.app.loadApiJson(arguments[0], arguments[1])", json.loads(path.read_text()), path.name
                )
                time.sleep(2)
                graph = driver.execute_script("return window.app.graph.serialize()")
                (ui_dir / path.name).write_text(json.dumps(graph, indent=1) + "\n")
                print(f"wrote {ui_dir / path.name}")
        finally:
            if driver is not None:
                driver.quit()
            stop(process)


if __name__ == "__main__":
    main()
