"""What the ``flowlift`` command prints, and when: progress bars, library noise, one-time warnings.

* :func:`add_console_options` gives every subcommand the same ``-v/--verbose`` and
  ``--progress/--no-progress`` options; :func:`show_progress` turns them into one bool: bars are drawn
  only on a terminal unless forced either way (a piped log gets no ``\\r`` bars).
* :func:`quiet_libraries` keeps third-party chatter (diffusers' "accelerate was not found" block,
  "kept in float32" lines, huggingface_hub deprecation warnings, transformers notices) off stderr, so
  a run prints flowlift's own lines only; ``-v`` leaves the libraries' warnings visible.
* :func:`warn_once` prints a ``flowlift CMD: warning: ...`` line at most once per process per key.
* :func:`install_command` is the pip command that adds an optional extra to the flowlift that is running
  (a source checkout or an installed package), for every "needs the X extra" message.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from pathlib import Path

#: Libraries whose log records and Python warnings are silenced unless ``-v`` is given.
NOISY_LIBRARIES = ("diffusers", "transformers", "huggingface_hub", "accelerate", "safetensors")

_warned: set[str] = set()


def add_console_options(parser: argparse.ArgumentParser) -> None:
    """``-v/--verbose`` and ``--progress/--no-progress``, identical on every subcommand: the one convention
    for progress bars. ``--quiet`` (which ``eval``, ``bands``, ``img2img`` and ``hires`` had, meaning "no
    progress bars") is still accepted as a hidden alias of ``--no-progress`` so old scripts keep working."""
    group = parser.add_argument_group("console")
    group.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also show the libraries' own warnings and log lines (diffusers, transformers, huggingface_hub)",
    )
    group.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="draw progress bars (default: only when stderr is a terminal)",
    )
    group.add_argument("--quiet", dest="progress", action="store_false", help=argparse.SUPPRESS)


def show_progress(args: argparse.Namespace) -> bool:
    """True when progress bars should be drawn: ``--progress`` forces, ``--no-progress`` (or its old
    spelling ``--quiet``) forbids, otherwise only when stderr is a terminal."""
    forced = getattr(args, "progress", None)
    if forced is not None:
        return bool(forced)
    return sys.stderr.isatty()


def quiet_libraries(verbose: bool) -> None:
    """Silence third-party log records below ERROR and their Python warnings, unless ``verbose``.

    Set before the libraries are imported (their verbosity environment variables) and again on their
    loggers, so both import-time and run-time chatter are covered.
    """
    if verbose:
        return
    for variable in ("DIFFUSERS_VERBOSITY", "TRANSFORMERS_VERBOSITY", "HF_HUB_VERBOSITY"):
        os.environ.setdefault(variable, "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    for name in NOISY_LIBRARIES:
        logging.getLogger(name).setLevel(logging.ERROR)
    pattern = r"(" + "|".join(NOISY_LIBRARIES) + r")(\..*)?$"
    warnings.filterwarnings("ignore", module=pattern)
    for name in ("diffusers", "transformers"):
        module = sys.modules.get(name)
        if module is not None:  # already imported: its own logging helper resets handlers' levels
            try:
                module.utils.logging.set_verbosity_error()
            except AttributeError:
                pass


def format_warnings(command: str) -> None:
    """Show Python warnings that reach the user as one ``flowlift COMMAND: warning: MESSAGE`` line each
    (no file name, line number or source line); repeated identical messages are shown once."""
    seen: set[str] = set()

    def show(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ARG001
        text = str(message).splitlines()[0] if str(message) else category.__name__
        if text in seen:
            return
        seen.add(text)
        print(f"flowlift {command}: warning: {text}", file=file or sys.stderr)

    warnings.showwarning = show


def warn_once(command: str, key: str, message: str) -> None:
    """Print ``flowlift COMMAND: warning: MESSAGE`` on stderr the first time ``key`` is seen."""
    if key in _warned:
        return
    _warned.add(key)
    print(f"flowlift {command}: warning: {message}", file=sys.stderr)


def install_command(extra: str) -> str:
    """The pip command that adds the optional ``extra`` to the flowlift that is running.

    From a source checkout (an editable install, or ``src`` on ``PYTHONPATH``; recognised by the
    ``pyproject.toml`` two folders above the package) ``pip install -e ".[extra]"``, with the checkout's
    path unless it is the current folder; from an installed package ``pip install "flowlift[extra]"``
    (a checkout's path is not a package name, and the package's name is no use to a checkout).
    """
    package = Path(__file__).resolve().parent
    root = package.parent.parent
    if package.parent.name == "src" and (root / "pyproject.toml").is_file():
        where = "." if root == Path.cwd().resolve() else str(root)
        return f'pip install -e "{where}[{extra}]"'
    return f'pip install "flowlift[{extra}]"'
