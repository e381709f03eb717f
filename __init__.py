"""Node-pack entry point for ComfyUI and InvokeAI: the repository (or a link to it) is the pack.

* ComfyUI imports this file when the repository is in ``custom_nodes/``: the nodes live in
  ``src/flowlift/comfyui`` and the mappings below export them.
* InvokeAI imports it when the repository is ``<INVOKEAI_ROOT>/nodes/flowlift`` (a link, a copy, or
  the Workflows tab's install from a git URL): importing ``src/flowlift/invokeai/nodes`` registers its
  invocations. InvokeAI registers this file under the folder's name, ``flowlift``, which is also the
  package's name, so the name is handed over to the real package before it is imported.

Either way the pack runs the flowlift next to it, so ``src`` goes first on ``sys.path`` (its runtime
dependencies: docs/comfyui.md, docs/invokeai.md). Imported anywhere else (pytest treats the
repository root as a package) it exports no nodes and imports no host module.
"""

import importlib.util
import os
import sys

NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}


def _src_first() -> None:
    src = os.path.join(os.path.dirname(os.path.realpath(__file__)), "src")
    if src not in (os.path.realpath(p) for p in sys.path if p):
        sys.path.insert(0, src)


if importlib.util.find_spec("folder_paths") is not None:  # inside ComfyUI
    _src_first()
    from flowlift.comfyui.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: F811
elif "invokeai.app.invocations.baseinvocation" in sys.modules:  # inside InvokeAI
    _src_first()
    if __name__ == "flowlift":
        sys.modules.pop(__name__, None)  # this file, registered as "flowlift": let the package take its name
    import flowlift.invokeai.nodes  # noqa: F401  (registers the flowlift_* invocations)

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
