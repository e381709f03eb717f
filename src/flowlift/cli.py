"""The ``flowlift`` command line: a thin shell over the pipelines.

Subcommands live in :mod:`flowlift.commands` (one module each) and are discovered at start-up.
User errors (:class:`flowlift.errors.FlowliftError`) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

from flowlift import __version__
from flowlift.commands._options import HelpFormatter
from flowlift.console import add_console_options, format_warnings, quiet_libraries
from flowlift.errors import FlowliftError


def _command_modules() -> list:
    import flowlift.commands as package

    names = sorted(m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_"))
    return [importlib.import_module(f"flowlift.commands.{name}") for name in names]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flowlift",
        description="FLUX.2 latent-space image work: upscale, refine, measure, train.",
        epilog="run `flowlift COMMAND --help` for a command's options and examples",
    )
    parser.add_argument("--version", action="version", version=f"flowlift {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _command_modules():
        sub = subparsers.add_parser(
            module.NAME,
            help=module.HELP,
            description=module.HELP,
            epilog=getattr(module, "EXAMPLES", None),
            formatter_class=HelpFormatter,
        )
        module.add_arguments(sub)
        if not getattr(module, "NESTED_COMMANDS", False):  # nested ones add them to each of their own
            add_console_options(sub)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 0
    quiet_libraries(bool(getattr(args, "verbose", False)))
    format_warnings(args.command)
    try:
        return int(args._run(args) or 0)
    except FlowliftError as error:
        print(f"flowlift {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"flowlift {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
