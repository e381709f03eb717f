"""The ``flowlift`` command line: a thin shell over the pipelines.

Subcommands live beside this module in :mod:`flowlift.commands` (one module each) and are discovered
at start-up.
User errors (:class:`flowlift.errors.FlowliftError`) print one line and exit with status 2; the stop signals
(:data:`flowlift.stop_signals.STOP_SIGNALS`: SIGINT, SIGTERM, SIGHUP) stop any command with status 130, from
flowlift's first line on: ``flowlift/__init__.py`` holds a signal that comes before :func:`main` (while the
modules import), and :func:`main` takes them over before it builds the parser. Run as the process's own command
line (``argv`` not given), a one-shot command without ``--max-memory`` keeps freed memory for reuse
(:func:`flowlift.devices.reuse_freed_memory`); an in-process caller's allocator is left alone.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import pkgutil
import signal
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from contextlib import contextmanager

from flowlift.commands._options import HelpFormatter, OneLineParser, option_words
from flowlift.console import (
    add_console_options,
    format_warnings,
    guard_standard_streams,
    quiet_libraries,
    set_command,
    stdout_failure,
)
from flowlift.devices import end_before_native_teardown, end_process, passive_thread_wait, reuse_freed_memory
from flowlift.errors import FlowliftError, door_words
from flowlift.stop_signals import STOP_SIGNALS, taken_stop_signals
from flowlift.version import __version__


def _command_modules() -> list:
    import flowlift.commands as package

    names = sorted(
        m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_") and m.name != "cli"
    )
    return [importlib.import_module(f"flowlift.commands.{name}") for name in names]


def build_parser() -> OneLineParser:
    """The root parser and one subparser per command, all :class:`OneLineParser`: a bad argument is one
    line and exit status 2 like any user error, without argparse's usage block."""
    parser = OneLineParser(
        prog="flowlift",
        description="FLUX.2 latent-space image work: upscale, refine, measure, train.",
        epilog="run `flowlift COMMAND --help` for a command's options and examples",
    )
    parser.add_argument("--version", action="version", version=f"flowlift {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
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
            add_console_options(sub, progress=getattr(module, "SHOWS_PROGRESS", True))
        sub.set_defaults(
            _run=module.run,
            _check=getattr(module, "check", None),  # settings a launcher checks before its ranks start
            _long_running=getattr(module, "LONG_RUNNING", False),
        )
    return parser


#: The exit status after stdout's reader went away (``| head -1``): 128 + SIGPIPE, as a shell reports it.
BROKEN_PIPE_STATUS = 141
#: The exit status of a command stopped by SIGINT, SIGTERM or SIGHUP (128 + SIGINT, as shells report Ctrl-C).
INTERRUPTED = 130

#: The signal that interrupted the last command run in this process (None: a KeyboardInterrupt of its own, SIGINT).
_stop_signal: int | None = None
#: After the signal that stops a command, further stop signals are held this long, so that its clean-ups (temporary
#: files removed, a checkpoint saved, a server's request waited for) are not cut short by a second Ctrl-C or a
#: scheduler's repeated SIGTERM; one after it stops the clean-up too (the user insists).
SIGNAL_HOLD_S = 5.0


def stop_signal() -> int:
    """The signal that interrupted the last command run in this process (SIGINT for Ctrl-C and when none did). A rank
    of ``flowlift launch`` exits with 128 + the signal, so that the launcher can name the signal that stopped it."""
    return signal.SIGINT if _stop_signal is None else _stop_signal


@contextmanager
def _signals_interrupt():
    """The stop signals (:func:`flowlift.stop_signals.taken_stop_signals`: SIGINT, SIGTERM, and SIGHUP unless
    ``nohup`` ignores it) raise KeyboardInterrupt in the main thread for the whole command, then the previous
    handlers come back (an in-process caller such as a test keeps its own). Once one has come, whatever the command
    raises after it is that stop too (KeyboardInterrupt): C code that imports or calls back into Python turns the
    KeyboardInterrupt it met into an error of its own (numpy's ``ImportError: PyCapsule_Import could not import
    module "datetime"``), which printed a traceback and exit status 1. An error before any signal is left as it is.

    SIGINT is installed explicitly because Python leaves an *inherited* ``SIG_IGN`` in place: a command
    started in the background by a non-interactive shell (``flowlift upscale ... &`` in a script) or by a
    job runner that ignores SIGINT would otherwise never see Ctrl-C or ``kill -INT`` and run to the end.
    SIGTERM (``kill``, a scheduler's stop) gets the same treatment, so every ``finally`` clean-up runs
    (temporary files removed, training checkpoint saved) and the exit status is 130 instead of an
    abrupt death leaving debris. Signals after the first are held for :data:`SIGNAL_HOLD_S` (a second one
    landing in a clean-up left a temporary folder behind, or a traceback); the handlers are put back with the
    signals blocked, so that none lands between the two and outlives the command.
    """
    global _stop_signal
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _stop_signal = None
    first: list[float] = []  # when the signal that stopped the command came

    def interrupt(signum, frame):
        global _stop_signal
        now = time.monotonic()
        if first and now - first[0] < SIGNAL_HOLD_S:
            return  # the command is stopping already: its clean-ups finish
        if not first:
            _stop_signal = signum
        first[:] = [now]
        raise KeyboardInterrupt

    previous = {signum: signal.signal(signum, interrupt) for signum in taken_stop_signals()}
    try:
        held = [getattr(handler, "held", None) for handler in previous.values()]  # flowlift/__init__.py's
        if any(held):  # a signal since flowlift's first line, before this: the run ends before it begins
            for handler in previous.values():
                if hasattr(handler, "held"):
                    del handler.held
            _stop_signal = next(signum for signum in held if signum)
            raise KeyboardInterrupt
        yield
    except Exception as error:
        if first:  # the stop's KeyboardInterrupt, turned into another error on its way up
            raise KeyboardInterrupt from error
        raise
    finally:
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # delivered after, to the restored handlers
        try:
            for signum, handler in previous.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _one_line_warnings(command: str):
    """A ``warnings.showwarning`` that prints flowlift's own warnings as one line and drops third-party ones.

    Third-party warnings (numpy casts, torch's pickle notes, libraries' FutureWarnings) tell the user
    nothing actionable; the ones flowlift raises (or re-raises as ``FlowliftWarning``) are about their
    data or settings and get ``flowlift CMD: warning: ...`` without a source line.
    """
    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # src/flowlift, not commands/

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        from flowlift.errors import FlowliftWarning

        ours = issubclass(category, FlowliftWarning) or os.path.abspath(filename).startswith(package_dir)
        if not ours:
            return
        text = str(message).splitlines()[0] if str(message) else category.__name__
        print(f"flowlift {command}: warning: {text}", file=file or sys.stderr)

    return show


def _command_word(argv: Sequence[str]) -> str:
    """The subcommand as typed (the first word that is no option), for a line printed before parsing."""
    word = next((a for a in argv if not a.startswith("-")), "")
    return word if word.isidentifier() else ""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: this process's own) and return its exit status.

    As the process's own command line, the standard streams are guarded first
    (:func:`flowlift.console.guard_standard_streams`): a closed stderr or stdout writes nowhere, and a stdout
    that breaks while the command runs does not stop it (no output is lost for a message that could not be
    shown); the command then ends with 141 (128 + SIGPIPE) for a reader that went away (``| head -1``),
    quietly, or one line and 1 for another failure (``> /dev/full``), unless it failed itself.
    """
    if argv is not None:
        return _main(argv)
    guard_standard_streams()
    status = _main(None)
    if status == INTERRUPTED:
        # Stopped: the process ends now, skipping the interpreter's teardown, which gives SIGTERM its default
        # action back; a later signal of a burst (Ctrl-C, then a scheduler's SIGTERM) killed the process there
        # after its "interrupted" line, with 143 in place of 130. Until the end it is held (flowlift/__init__.py).
        end_before_native_teardown()
    failure = stdout_failure()
    if failure is None or status:
        return end_process(status)
    if isinstance(failure, BrokenPipeError):
        return end_process(BROKEN_PIPE_STATUS)
    command = _command_word(sys.argv[1:])
    reason = getattr(failure, "strerror", None) or str(failure) or type(failure).__name__
    print(
        f"flowlift{' ' + command if command else ''}: error: cannot write to standard output: {reason}", file=sys.stderr
    )
    return end_process(1)


def _main(argv: Sequence[str] | None) -> int:
    owns_process = argv is None
    command = _command_word(sys.argv[1:] if argv is None else argv)
    parser = args = None
    if owns_process:
        passive_thread_wait()  # before anything imports torch
        gc.disable()  # until the imports are done (_import_torch_frozen)
    try:
        # signals first, the parser (every command module) after: a signal during the imports stops the run too
        with _signals_interrupt():  # restored when an in-process caller returns
            parser = build_parser()
            args = parser.parse_args(argv)
            if getattr(args, "_run", None) is None:
                parser.print_help()
                return 0
            command = args.command
            if owns_process and not args._long_running and getattr(args, "max_memory", None) is None:
                reuse_freed_memory()
            if owns_process:
                _import_torch_frozen()
            quiet_libraries(bool(getattr(args, "verbose", False)))
            format_warnings(args.command)
            set_command(args.command)  # progress lines off a terminal start `flowlift COMMAND:`
            # both restored when an in-process caller returns; the words also name the fields of the errors a
            # batch reports input by input (flowlift.jobs.batch.error_line), not only the one that ends the run
            with warnings.catch_warnings(), door_words(_command_words(parser, args)):
                warnings.showwarning = _one_line_warnings(args.command)
                return int(args._run(args) or 0)
    except FlowliftError as error:  # a knob or field the capability named as Python does, said as this command does
        words = _command_words(parser, args) if error.fields and args is not None else {}
        print(f"flowlift {command}: error: {error.worded(words)}", file=sys.stderr)
        return error.exit_status
    except KeyboardInterrupt as stop:  # a command that stopped cleanly says where it stopped (train: how it resumes)
        said = f": {stop}" if str(stop) else ""
        if _says_interrupted(bool(said)):
            print(f"flowlift {command}: interrupted{said}" if command else "flowlift: interrupted", file=sys.stderr)
        return INTERRUPTED
    finally:
        if owns_process:
            _skip_final_collection()
            gc.enable()  # also where the run ended before torch's import (--help, a parse error)


def _command_words(parser: OneLineParser, args: argparse.Namespace) -> dict[str, str]:
    """How the chosen command names each field in its errors (its options: ``--max-memory``, ``--no-vae-tiling``)."""
    return option_words(parser._chosen_command(args))


def _says_interrupted(has_news: bool) -> bool:
    """Whether this process prints its ``interrupted`` line: always, but for a rank of ``flowlift launch``, whose
    launcher prints the one line naming the signal; there rank 0 alone says where a stop left the run (a training
    checkpoint), and the others nothing."""
    from flowlift.jobs.distributed import LAUNCH_WORKER_ENV

    if os.environ.get(LAUNCH_WORKER_ENV) != "1":
        return True
    return has_news and os.environ.get("RANK", "0") == "0"


def _import_torch_frozen() -> None:
    """Import torch (every command computes with it) with the garbage collector off, then move everything imported
    so far out of its reach (``gc.freeze``) and turn it back on. Importing torch makes ~170,000 objects and none of
    them is garbage: with the collector on, its passes over them cost ~0.1 CPU-second of the import, and every full
    collection while the command runs walks them again (issue 47, docs/cpu.md). Only where the process is the
    command's own, after :func:`flowlift.devices.reuse_freed_memory`."""
    try:
        import torch  # noqa: F401

        gc.freeze()
    finally:
        gc.enable()


def _skip_final_collection() -> None:
    """Let the command's process end without the interpreter's last garbage collections walking every object it
    loaded: ``flowlift app`` (models, Gradio and the web server) took 20-60 s after ``interrupted`` (issue 48); a
    one-shot command spent 0.3-0.4 CPU-seconds on torch's objects alone (issue 47, docs/cpu.md). The command has
    closed its files and servers; what is left is freed by the exit."""
    gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
