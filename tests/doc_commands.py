"""The shell commands of README.md and docs/*.md, for tests/test_doc_commands.py.

A command is a line (``\\`` continuations joined, ``# comments`` dropped, ``a && b`` split) of a fenced
``bash``/``sh``/``shell``/``console`` block (``console``: the ``$ `` lines), or an inline code span
``flowlift SUBCOMMAND ARGS`` in the prose. Unlabelled fences hold output, trees and tables: not commands.
``python tests/doc_commands.py .`` lists them with their keys.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.S | re.M)
SHELL_FENCES = {"bash", "sh", "shell", "console", "zsh"}
INLINE = re.compile(r"`(flowlift [a-z][\w-]* [^`]+)`")


@dataclass(frozen=True)
class DocCommand:
    where: str  # file:line
    text: str  # as written, continuation lines joined, comments dropped

    @property
    def key(self) -> str:
        return normalized(self.text)

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text)


def normalized(text: str) -> str:
    """The command's words with the output option's spellings folded (``--out``/``--output``/``-o``: a rename
    in progress must not turn a documented command into an unknown one)."""
    try:
        words = shlex.split(text)
    except ValueError:
        words = text.split()
    return " ".join(" ".join("-o" if w in ("--out", "--output") else w for w in words).split())


def _quotes_open(text: str) -> bool:
    try:
        shlex.split(text)
    except ValueError:
        return True
    return False


def _strip_comment(line: str) -> str:
    """``cmd  # note`` -> ``cmd`` (a ``#`` outside quotes after a blank)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def fenced_commands(path: Path, root: Path) -> list[DocCommand]:
    text = path.read_text()
    found = []
    for block in FENCE.finditer(text):
        if block.group(1) not in SHELL_FENCES:
            continue
        first_line = text[: block.start()].count("\n") + 2
        lines = block.group(2).splitlines()
        i = 0
        while i < len(lines):
            start = i
            raw = lines[i]
            if block.group(1) == "console":
                if not raw.startswith("$ "):
                    i += 1
                    continue
                raw = raw[2:]
            current = _strip_comment(raw) if not raw.lstrip().startswith("#") else ""
            i += 1
            while current.endswith("\\") or (current and _quotes_open(current)):
                if i >= len(lines):
                    break
                nxt = lines[i]
                i += 1
                if current.endswith("\\"):
                    current = current[:-1].rstrip() + " " + _strip_comment(nxt).strip()
                else:
                    current = current + "\n" + nxt  # a quoted multi-line argument (python -c "...")
            current = current.strip()
            if not current:
                continue
            for part in re.split(r"\s+&&\s+", current):
                found.append(DocCommand(f"{path.relative_to(root)}:{first_line + start}", part.strip()))
    return found


def inline_commands(path: Path, root: Path) -> list[DocCommand]:
    text = path.read_text()
    blanked = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    found = []
    for match in INLINE.finditer(blanked):
        line = blanked[: match.start()].count("\n") + 1
        found.append(DocCommand(f"{path.relative_to(root)}:{line}", " ".join(match.group(1).split())))
    return found


def doc_commands(root: Path) -> list[DocCommand]:
    files = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    return [c for f in files for c in (*fenced_commands(f, root), *inline_commands(f, root))]


if __name__ == "__main__":
    import sys

    for c in doc_commands(Path(sys.argv[1])):
        print(f"{c.where}\t{c.key}")
