"""ComfyUI entry point: ComfyUI imports this file when the repository (or a link to it) is in custom_nodes/.

The nodes live in ``src/flowlift/comfyui``; this pack runs the flowlift next to it, so ``src`` goes
first on ``sys.path`` (flowlift's runtime dependencies come from ``requirements.txt``). Imported
anywhere else (pytest treats the repository root as a package) it exports no nodes and imports no
ComfyUI module. ``WEB_DIRECTORY`` holds the pack's frontend extension (seeds start at "fixed").

Imported under the name ``flowlift`` it is the package itself. That happens when the checkout's folder
is named ``flowlift`` and its parent is on ``sys.path`` first: ``python -c "import flowlift"`` run from
the folder above the checkout, where ``sys.path[0]`` is the current folder and a folder with an
``__init__.py`` is a package that shadows the installed one (or a ComfyUI that names a node pack by its
folder). This file then hands over to ``src/flowlift`` — its folder for every submodule, its
``__init__.py`` for the public names — so ``import flowlift`` means the same from any folder.
"""

import importlib.util
import os
import sys

_ROOT = os.path.dirname(os.path.realpath(__file__))
_IN_COMFYUI = importlib.util.find_spec("folder_paths") is not None
WEB_DIRECTORY = "./src/flowlift/comfyui/web"

if __name__ == "flowlift":
    __path__ = [os.path.join(_ROOT, "src", "flowlift")]
    __file__ = os.path.join(__path__[0], "__init__.py")
    if __spec__ is not None:
        __spec__.submodule_search_locations = __path__
    with open(__file__, encoding="utf-8") as _package_init:
        exec(compile(_package_init.read(), __file__, "exec"))  # the package's own names, in this module
    del _package_init
    if _IN_COMFYUI:
        from flowlift.comfyui.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: F401
else:
    NODE_CLASS_MAPPINGS: dict = {}
    NODE_DISPLAY_NAME_MAPPINGS: dict = {}

    if _IN_COMFYUI:
        _SRC = os.path.join(_ROOT, "src")
        if _SRC not in (os.path.realpath(p) for p in sys.path if p):
            sys.path.insert(0, _SRC)
        from flowlift.comfyui.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: F811

    __all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
