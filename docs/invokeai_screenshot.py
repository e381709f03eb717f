"""Regenerate docs/invokeai_hires_workflow.png: InvokeAI 6.14.2's node editor with the FLUX.2 Klein hires-fix
workflow (example_workflows/invokeai/flux2_klein_hires_fix.json) loaded.

Runs the test set-up of tests/test_invokeai.py (the venv of tests/invokeai_venv.py, a fresh
INVOKEAI_ROOT with this repository as ``nodes/flowlift``, a loopback server), loads every InvokeAI
example workflow through the page's own "Load workflow from file", prints what the page said about
each (it must be "Workflow Loaded", never "... with Warnings"), and saves the editor with the chosen
one. Usage::

    FLOWLIFT_SHARED=../shared python docs/invokeai_screenshot.py [--workflow flux2_klein_hires_fix.json] [--out PNG]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT / "tests"), str(REPO_ROOT / "src")]

from invokeai_browser import chrome, editor_screenshot, load_workflow  # noqa: E402
from invokeai_client import start_server, stop_server, wait_until_serving  # noqa: E402

WORKFLOWS = REPO_ROOT / "example_workflows" / "invokeai"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workflow", default="flux2_klein_hires_fix.json")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "invokeai_hires_workflow.png")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(Path(tmp) / "root")
        driver = None
        try:
            wait_until_serving(server)
            driver = chrome()
            for path in sorted(WORKFLOWS.glob("*.json")):
                said, nodes, edges = load_workflow(driver, server.url, path)
                print(f"{path.name}: {nodes} nodes, {edges} edges; the page said {said}")
                if any("Warning" in text or "rror" in text for text in said):
                    raise SystemExit(f"{path.name} did not load cleanly: {said}")
            load_workflow(driver, server.url, WORKFLOWS / args.workflow)
            editor_screenshot(driver, args.out)
            print(f"wrote {args.out}")
        finally:
            if driver is not None:
                driver.quit()
            stop_server(server.process)


if __name__ == "__main__":
    main()
