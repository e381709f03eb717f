"""ComfyUI entry point: ComfyUI imports this file when the repository (or a link to it) is in custom_nodes/.

The nodes live in ``src/flowlift/comfyui``; this pack runs the flowlift next to it, so ``src`` goes
first on ``sys.path`` (flowlift's runtime dependencies come from ``requirements.txt``). Imported
anywhere else (pytest treats the repository root as a package) it exports no nodes and imports no
ComfyUI module. ``WEB_DIRECTORY`` holds the pack's frontend extension (seeds start at "fixed").
"""

import importlib.util
import os
import sys

NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}
WEB_DIRECTORY = "./src/flowlift/comfyui/web"

if importlib.util.find_spec("folder_paths") is not None:  # inside ComfyUI
    _SRC = os.path.join(os.path.dirname(os.path.realpath(__file__)), "src")
    if _SRC not in (os.path.realpath(p) for p in sys.path if p):
        sys.path.insert(0, _SRC)
    from flowlift.comfyui.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: F811

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
