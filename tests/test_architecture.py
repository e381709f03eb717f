"""The house rules of docs/architecture.md, checked on the sources (imports read with ``ast``, nothing run).

- Layers: a module imports only from its own folder or from folders below it (lazy imports inside
  functions count too), so no arrow runs back up and front-ends sit on top of the capability packages.
- No import cycle between modules; no command module imports another command.
- Units stay readable: no module of ``src/flowlift`` past :data:`MAX_MODULE_LINES`, except those
  docs/architecture.md names with the reason, and no function past :data:`MAX_FUNCTION_LINES`; the top
  level holds only the few modules every folder uses.
- ``import flowlift`` stays cheap: it imports no torch (the public names are resolved lazily), and each
  public name is the object its capability package defines.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "src" / "flowlift"

#: Lowest first. A module may import its own layer and any layer below it, never one above.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "console", "devices", "knobs", "limits", "progress", "stop_signals", "version"),
    ("files",),
    ("flux2",),
    ("models",),
    ("jobs",),
    ("upscale.chunked",),
    ("upscale", "refine"),  # siblings: neither imports the other (test_refine_and_upscale_are_siblings)
    ("measure",),
    ("training",),
    ("comfyui", "app", "invokeai"),
    ("commands",),
    ("",),  # the package's face: the version and the public names of every layer, resolved lazily
    ("__main__",),
)
#: Front-ends of one layer must not import one another (``commands`` sits above: ``flowlift app`` starts the app).
FRONT_ENDS = ("comfyui", "app", "invokeai", "commands")
TOP_LEVEL_MODULES = {"__init__", "__main__", *LAYERS[0]}
MAX_MODULE_LINES = 450
#: Lines of one function or method, from its ``def`` line to its last line (decorators not counted).
MAX_FUNCTION_LINES = 100


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("flowlift", *parts)) if parts else "flowlift"


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """Every flowlift module ``path`` imports, at the top or inside a function (``from x import y`` where
    ``x.y`` is a module counts as importing ``x.y``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            if name in known:
                found.add(name)
    return found


def layer_of(module: str) -> tuple[int, str]:
    """(layer index, folder key) of a flowlift module; the longest matching folder key wins."""
    rest = "" if module == "flowlift" else module.removeprefix("flowlift.")
    best: tuple[int, str] | None = None
    for index, keys in enumerate(LAYERS):
        for key in keys:
            if (rest == key or rest.startswith(key + ".")) and (best is None or len(key) > len(best[1])):
                best = (index, key)
    if best is None:
        raise AssertionError(f"{module} is in no layer of LAYERS: add its folder (and say why in docs/architecture.md)")
    return best


def import_graph() -> dict[str, set[str]]:
    """Module -> the flowlift modules it imports. The package's face (``flowlift``: the lazily resolved public
    names) sits above every capability, so no module below it imports it: ``__version__`` is read from
    ``flowlift.version``, at the bottom."""
    found = modules()
    known = set(found)
    return {name: imported_modules(path, known) - {name} for name, path in found.items()}


def test_no_import_runs_back_up_a_layer():
    upward = []
    for module, targets in import_graph().items():
        own_layer, own_key = layer_of(module)
        for target in targets:
            layer, key = layer_of(target)
            sideways = layer == own_layer and key != own_key and {key, own_key} <= set(FRONT_ENDS)
            if layer > own_layer or sideways:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that run back up (see docs/architecture.md):\n" + "\n".join(sorted(upward))


def test_no_command_imports_another_command():
    """What two subcommands share lives in an underscore module of ``commands/`` (or below): a command
    module imports no other command (``cli`` is the dispatcher, not a command)."""

    def is_command(module: str) -> bool:
        parts = module.split(".")
        return len(parts) == 3 and parts[1] == "commands" and not parts[2].startswith("_") and parts[2] != "cli"

    crossing = [
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        if is_command(module)
        for target in targets
        if is_command(target) and target != module
    ]
    assert not crossing, "commands importing other commands:\n" + "\n".join(sorted(crossing))


def test_no_import_cycle():
    graph = import_graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*stack[stack.index(target) :], target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def documented_long_modules() -> set[str]:
    """Modules docs/architecture.md allows past the limit: the ``- `src/flowlift/...py` ...`` items of its
    "Modules past" section, each of which must give its reason."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## Modules past", 1)[1].split("\n## ", 1)[0] if "## Modules past" in text else ""
    return set(re.findall(r"^- `src/flowlift/([\w/]+\.py)` \S", section, re.M))


def test_modules_stay_readable_and_the_top_level_small():
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    allowed = documented_long_modules()
    unexplained = {path: n for path, n in long.items() if path not in allowed}
    assert not unexplained, (
        f"modules past {MAX_MODULE_LINES} lines: split them along a seam, or say why in docs/architecture.md: "
        f"{unexplained}"
    )
    assert allowed <= set(long), f"docs/architecture.md excuses modules that are short now: {allowed - set(long)}"
    top = {path.stem for path in PACKAGE.glob("*.py")}
    assert top <= TOP_LEVEL_MODULES, f"new top-level modules belong in a folder: {sorted(top - TOP_LEVEL_MODULES)}"


def long_functions(path: Path) -> dict[str, int]:
    """``{qualified name: lines}`` of the functions and methods in ``path`` past :data:`MAX_FUNCTION_LINES`
    (nested functions count inside their parent and on their own)."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                lines = child.end_lineno - child.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found[name] = lines
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(path.read_text(), str(path)), "")
    return found


def in_every_module(find: Callable[[Path], dict[str, int]]) -> dict[str, int]:
    """``{"module path:name": count}``: what ``find`` reports in each module of the package."""
    return {
        f"{path.relative_to(PACKAGE)}:{name}": count
        for path in sorted(PACKAGE.rglob("*.py"))
        for name, count in find(path).items()
    }


def test_functions_stay_readable():
    long = in_every_module(long_functions)
    assert not long, f"functions past {MAX_FUNCTION_LINES} lines: split them into named steps: {long}"


def test_the_function_limit_sees_methods_and_nested_functions(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    source = tmp_path / "sample.py"
    source.write_text(
        f"class A:\n  def long(self):\n{body}\ndef outer():\n  def inner():\n{body}\n  return inner\n"
        "def short():\n    return 1\n"
    )
    assert long_functions(source) == {
        "A.long": MAX_FUNCTION_LINES + 1,
        "outer": MAX_FUNCTION_LINES + 4,
        "outer.inner": MAX_FUNCTION_LINES + 1,
    }


@pytest.mark.parametrize("statement", ["import flowlift", "import flowlift.commands.cli"])
def test_importing_the_package_or_the_command_line_loads_no_torch(statement):
    code = f"import sys; {statement}; print(sorted(m for m in ('torch', 'diffusers', 'gradio') if m in sys.modules))"
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}  # this checkout's sources, whatever is installed
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"{statement} imported {result.stdout.strip()}"


def test_the_public_names_are_their_packages_objects():
    import flowlift

    assert set(flowlift.__all__) == {"FlowliftError", "__version__", *flowlift._PUBLIC}
    for name, module in flowlift._PUBLIC.items():
        assert getattr(flowlift, name) is getattr(importlib.import_module(module), name), name
    from flowlift import FlowUpscalerPipeline, Flux2Refiner, load_upscaler, load_vae  # noqa: F401  (the issue's line)

    with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
        flowlift.nonesuch  # noqa: B018


#: The most named parameters a public function or method takes (``self``/``cls`` and ``*args``/``**kwargs`` not
#: counted); past it, the settings belong in one object (``SamplingSettings``, ``TileRequest``, ``MemoryPolicy``).
MAX_PUBLIC_PARAMETERS = 12


def wide_public_functions(path: Path) -> dict[str, int]:
    """``{qualified name: parameters}`` of the public functions, methods and constructors of public classes in
    ``path`` with more than :data:`MAX_PUBLIC_PARAMETERS` named parameters (nested functions are private)."""
    found: dict[str, int] = {}

    def count(function: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> int:
        arguments = function.args
        names = [a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]
        return len(names) - (1 if method and names and names[0] in ("self", "cls") else 0)

    def public(name: str) -> bool:
        return not name.startswith("_") or name == "__init__"

    tree = ast.parse(path.read_text(), str(path))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and public(node.name):
            if (n := count(node, False)) > MAX_PUBLIC_PARAMETERS:
                found[node.name] = n
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and public(item.name):
                    if (n := count(item, True)) > MAX_PUBLIC_PARAMETERS:
                        found[f"{node.name}.{item.name}"] = n
    return found


def test_no_public_function_takes_more_than_twelve_parameters():
    wide = in_every_module(wide_public_functions)
    assert not wide, f"public functions past {MAX_PUBLIC_PARAMETERS} parameters: pass a settings object: {wide}"


def test_the_parameter_limit_counts_methods_and_keyword_only_parameters(tmp_path):
    source = tmp_path / "sample.py"
    many = ", ".join(f"p{i}" for i in range(MAX_PUBLIC_PARAMETERS))
    source.write_text(
        f"def wide(a, {many}): pass\ndef fits({many}, *args, **kwargs): pass\n"
        f"def _private(a, {many}): pass\nclass A:\n  def __init__(self, {many}): pass\n"
        f"  def m(self, *, a, {many}): pass\n"
    )
    assert wide_public_functions(source) == {"wide": MAX_PUBLIC_PARAMETERS + 1, "A.m": MAX_PUBLIC_PARAMETERS + 1}


def test_refine_and_upscale_are_siblings():
    """The hires fix takes the upscaler as an object (``refine.request.LatentUpscalerSource``): nothing in
    ``refine/`` imports ``flowlift.upscale``, nor the other way round (what both use lives below them:
    ``flowlift.limits``, ``flowlift.knobs``, ``flux2/``; what composes both lives in a front-end)."""
    graph = import_graph()
    pairs = (("flowlift.refine", "flowlift.upscale"), ("flowlift.upscale", "flowlift.refine"))
    crossing = [
        f"{module} -> {target}"
        for source, sink in pairs
        for module, targets in graph.items()
        if module.startswith(source)
        for target in targets
        if target.startswith(sink)
    ]
    assert not crossing, "refine/ and upscale/ importing each other:\n" + "\n".join(sorted(crossing))


def test_no_front_end_plans_jobs_itself():
    """Jobs are planned by the capability that owns them (``upscale/plan.py``, ``refine/jobs.py``): no front-end
    imports ``flowlift.jobs.batch``."""
    graph = import_graph()
    direct = [
        f"{module} -> flowlift.jobs.batch"
        for module, targets in graph.items()
        if layer_of(module)[1] in FRONT_ENDS and "flowlift.jobs.batch" in targets
    ]
    assert not direct, "front-ends importing flowlift.jobs.batch:\n" + "\n".join(sorted(direct))
