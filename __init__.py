"""Node-pack entry point for ComfyUI and InvokeAI: the repository (or a link to it) is the pack.

* ComfyUI imports this file when the repository is in ``custom_nodes/``: the nodes live in
  ``src/flowlift/comfyui`` on ComfyUI's V3 schema, ``comfy_entrypoint`` below hands them over (the
  ``NODE_CLASS_MAPPINGS`` of the legacy API are None there, so ComfyUI takes the entry point) and
  ``WEB_DIRECTORY`` holds the pack's frontend extension (seeds start at "fixed").
* InvokeAI imports it when the repository is ``<INVOKEAI_ROOT>/nodes/flowlift`` (a link, a copy, or
  the Workflows tab's install from a git URL): importing ``src/flowlift/invokeai/nodes`` registers its
  invocations. InvokeAI registers this file under the folder's name, ``flowlift``, which is also the
  package's name, so the name is handed over to the real package before it is imported.

Either way the pack runs the flowlift next to it, so ``src`` goes first on ``sys.path`` (its runtime
dependencies: docs/comfyui.md, docs/invokeai.md). Imported anywhere else (pytest treats the
repository root as a package) it exports no nodes and imports no host module.

Imported under the name ``flowlift`` outside InvokeAI it is the package itself. That happens when the
checkout's folder is named ``flowlift`` and its parent is on ``sys.path`` first: ``python -c "import
flowlift"`` run from the folder above the checkout, where ``sys.path[0]`` is the current folder and a
folder with an ``__init__.py`` is a package that shadows the installed one. This file then hands over
to ``src/flowlift`` — its folder for every submodule, its ``__init__.py`` for the public names — so
``import flowlift`` means the same from any folder.
"""

import importlib.util
import os
import sys

_ROOT = os.path.dirname(os.path.realpath(__file__))
_IN_COMFYUI = importlib.util.find_spec("folder_paths") is not None
_IN_INVOKEAI = "invokeai.app.invocations.baseinvocation" in sys.modules
WEB_DIRECTORY = "./src/flowlift/comfyui/web"


def _src_first() -> None:
    src = os.path.join(_ROOT, "src")
    if src not in (os.path.realpath(p) for p in sys.path if p):
        sys.path.insert(0, src)


if __name__ == "flowlift" and _IN_INVOKEAI:
    _src_first()
    sys.modules.pop(__name__, None)  # this file, registered as "flowlift": let the package take its name
    import flowlift.invokeai.nodes  # noqa: F401  (registers the flowlift_* invocations)
elif __name__ == "flowlift":
    __path__ = [os.path.join(_ROOT, "src", "flowlift")]
    __file__ = os.path.join(__path__[0], "__init__.py")
    if __spec__ is not None:
        __spec__.submodule_search_locations = __path__
    with open(__file__, encoding="utf-8") as _package_init:
        exec(compile(_package_init.read(), __file__, "exec"))  # the package's own names, in this module
    del _package_init
    if _IN_COMFYUI:  # V3 nodes: ComfyUI takes comfy_entrypoint only where NODE_CLASS_MAPPINGS is None
        NODE_CLASS_MAPPINGS = NODE_DISPLAY_NAME_MAPPINGS = None
        from flowlift.comfyui.nodes import comfy_entrypoint  # noqa: F401
else:
    NODE_CLASS_MAPPINGS: dict = {}
    NODE_DISPLAY_NAME_MAPPINGS: dict = {}

    if _IN_COMFYUI:  # V3 nodes: ComfyUI takes comfy_entrypoint only where NODE_CLASS_MAPPINGS is None
        _src_first()
        NODE_CLASS_MAPPINGS = NODE_DISPLAY_NAME_MAPPINGS = None  # type: ignore[assignment]
        from flowlift.comfyui.nodes import comfy_entrypoint  # noqa: F401
    elif _IN_INVOKEAI:
        _src_first()
        import flowlift.invokeai.nodes  # noqa: F401  (registers the flowlift_* invocations)

    __all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
