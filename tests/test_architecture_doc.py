"""docs/architecture.md names only what exists: every module path, folder and symbol it puts in backticks.

The names are read with :mod:`ast` (nothing is imported): a path (``refine/jobs.py``, ``commands/``) must be a
file or folder of the package (or of the repository: ``tests/...``); a dotted or slashed reference
(``upscale.plan.UpscaleRequest``, ``files/own_files.check_replaceable``, ``TileRequest.parse``) must resolve
to a module and a name it defines (and a member of that class); a bare symbol (``hires_fix``, ``ITEM_ERRORS``,
``FlowliftWarning``) must be defined, assigned, a parameter or a knob's name somewhere in the package.
Command lines, options, file names of other kinds and plain words are not names and are passed over.
"""

from __future__ import annotations

import ast
import builtins
import re
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "src" / "flowlift"
DOC = REPO / "docs" / "architecture.md"
#: Names of other projects that the document names on purpose (InvokeAI's module, ComfyUI's latent type).
FOREIGN = {"invokeai.invocation_api", "LATENT"}
#: The first folders of a slashed name that is code (``refine/jobs.py``); any other (``checkpoints/latest``,
#: ``outputs/inputs/``) is a path flowlift writes, not a name.
CODE_FOLDERS = {p.name for p in PACKAGE.iterdir() if p.is_dir()} | {"tests", "docs", "benchmarks", "src", ".ci"}
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@cache
def package_index() -> tuple[dict[str, dict[str, set[str]]], frozenset[str]]:
    """``({module: {top-level name: its members}}, every name the package defines, assigns, takes as a
    parameter or spells as an identifier-like string)``; modules by dotted name without ``flowlift.``."""
    modules: dict[str, dict[str, set[str]]] = {}
    everywhere: set[str] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        tree = ast.parse(path.read_text(), str(path))
        top: dict[str, set[str]] = {}
        for node in tree.body:
            for bound in _bound_names(node):
                top[bound] = _members(node)
        modules[name] = top
        for node in ast.walk(tree):
            everywhere.update(_bound_names(node))
            if isinstance(node, ast.arg):
                everywhere.add(node.arg)
            elif isinstance(node, ast.keyword) and node.arg:
                everywhere.add(node.arg)
            elif isinstance(node, ast.Attribute):
                everywhere.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and IDENTIFIER.fullmatch(node.value):
                everywhere.add(node.value)
    return modules, frozenset(everywhere)


def _bound_names(node: ast.AST) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)] + [
            e.id for t in node.targets if isinstance(t, ast.Tuple) for e in t.elts if isinstance(e, ast.Name)
        ]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [(alias.asname or alias.name).split(".")[0] for alias in node.names]
    return []


def _members(node: ast.AST) -> set[str]:
    if not isinstance(node, ast.ClassDef):
        return set()
    return {name for child in node.body for name in _bound_names(child)}


def doc_names() -> list[str]:
    """The backticked words of the document's prose (code blocks left out), each once, in order."""
    text = re.sub(r"```.*?```", "", DOC.read_text(), flags=re.S)
    return list(dict.fromkeys(re.findall(r"`([^`\n]+)`", text)))


def _path_exists(token: str) -> bool:
    relative = token.rstrip("/")
    if "/" in relative:
        return (PACKAGE / relative).exists() or (REPO / relative).exists()
    return any(PACKAGE.rglob(relative)) or (REPO / relative).exists() or (REPO / "tests" / relative).exists()


def _module(prefix: list[str]) -> str | None:
    """The package module ``prefix`` names: its dotted path, or the one module whose path ends with it."""
    modules, _ = package_index()
    dotted = ".".join(prefix)
    if dotted in modules:
        return dotted
    ending = [name for name in modules if name.endswith("." + dotted)]
    return ending[0] if len(ending) == 1 else None


def _reference_problem(token: str) -> str | None:
    """Why the dotted/slashed reference ``token`` does not resolve (None: it does)."""
    modules, everywhere = package_index()
    parts = token.replace("/", ".").split(".")
    if parts[0] == "flowlift":
        parts = parts[1:]
    if not parts:
        return None
    for cut in range(len(parts), 0, -1):
        module = _module(parts[:cut])
        if module is None:
            continue
        rest = parts[cut:]
        if not rest:
            return None
        if rest[0] not in modules[module]:
            if "/" not in token and all(part in everywhere for part in rest):
                return None  # a variable's attribute (refiner.img2img), not a module's name
            return f"{module} defines no {rest[0]}"
        members = modules[module][rest[0]]
        if len(rest) > 1 and members and rest[1] not in members:
            return f"{module}.{rest[0]} has no member {rest[1]}"
        return None
    if "/" in token:
        return f"no module {token.split('.')[0]}"
    missing = [part for part in parts if part not in everywhere]
    return f"the package names no {', '.join(missing)}" if missing else None


def problem(token: str) -> str | None:
    """Why ``token`` names nothing that exists (None: it exists, or it is not a name)."""
    word = token.split("(")[0].strip()
    if not word or word in FOREIGN or any(c in word for c in " <>*{}=,:") or word.startswith("-"):
        return None
    if "/" in word.rstrip("/") and word.split("/")[0] not in CODE_FOLDERS:
        return None  # a path flowlift writes (checkpoints/latest, outputs/inputs/)
    if word.endswith("/") and word.rstrip("/") not in CODE_FOLDERS and "/" not in word.rstrip("/"):
        return None  # a folder flowlift writes (outputs/, cache/)
    if word.endswith((".py", "/")):
        return None if _path_exists(word) else f"no file or folder {word}"
    if "." in word or "/" in word:
        if not all(IDENTIFIER.fullmatch(part) for part in word.replace("/", ".").split(".")):
            return None  # a file name (bands.json, flow_upscaler.safetensors)
        if word.rsplit(".", 1)[-1] in {"json", "jsonl", "md", "png", "safetensors", "pth", "csv", "txt", "py"}:
            return None
        return _reference_problem(word)
    if not IDENTIFIER.fullmatch(word) or word.islower() and "_" not in word.strip("_"):
        return None  # a plain word (auto, none, mage) or not a name at all
    if hasattr(builtins, word) or word in package_index()[1]:
        return None
    return f"the package names no {word}"


def test_every_module_and_symbol_docs_architecture_names_exists():
    found = [f"`{token}`: {why}" for token in doc_names() if (why := problem(token))]
    assert not found, "docs/architecture.md names what does not exist:\n" + "\n".join(found)


def test_the_check_finds_a_vanished_name():
    """The check itself: a module, a symbol and a member that do not exist are each found."""
    assert problem("refine/no_such_module.py") is not None
    assert problem("files/own_files.no_such_function") is not None
    assert problem("upscale.plan.UpscaleRequest.no_such_field") is not None
    assert problem("add_deprecated_spelling") is not None
    assert problem("measure/no_such_folder/") is not None
    assert problem("upscale.plan.UpscaleRequest") is None and problem("refine/jobs.py") is None
