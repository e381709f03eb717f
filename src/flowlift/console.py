"""What the ``flowlift`` command prints, and when: progress bars, library noise, one-time warnings.

* :func:`add_console_options` gives every subcommand the same ``-v/--verbose`` and
  ``--progress/--no-progress`` options; :func:`show_progress` turns them into the one ``enabled`` value
  :func:`progress_bar` takes (True: a bar, False: nothing, None: decided by the stream).
* :func:`progress_bar` is the progress of every long command: a tqdm bar on a terminal and, off a
  terminal (a log, a scheduler, CI), one plain line every :func:`progress_interval` seconds (done/total,
  rate, time left) so a long job never looks hung; a piped log gets no ``\\r`` bars.
* :func:`quiet_libraries` keeps third-party chatter (diffusers' "accelerate was not found" block,
  "kept in float32" lines, huggingface_hub FutureWarnings, transformers notices) off stderr, so
  a run prints flowlift's own lines only; ``-v`` leaves the libraries' warnings visible.
* :func:`warn_once` prints a ``flowlift CMD: warning: ...`` line at most once per process per key.
* :func:`install_command` is the pip command that adds an optional extra to the flowlift that is running
  (a source checkout or an installed package), for every "needs the X extra" message.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

from flowlift.errors import FlowliftError

#: Libraries whose log records and Python warnings are silenced unless ``-v`` is given.
NOISY_LIBRARIES = ("diffusers", "transformers", "huggingface_hub", "accelerate", "safetensors")

#: Seconds between two progress lines off a terminal, unless :data:`PROGRESS_INTERVAL_VARIABLE` says.
DEFAULT_PROGRESS_INTERVAL_S = 20.0
PROGRESS_INTERVAL_VARIABLE = "FLOWLIFT_PROGRESS_INTERVAL_S"

_warned: set[str] = set()
_command = {"name": ""}  # the subcommand running, for the ``flowlift CMD:`` of progress lines
_command_started: list[float] = []  # when it started (time.monotonic)
_run_lines: list[Any] = []  # the runs whose lines :func:`run_lines` writes now (the loops' lines stay quiet)


def add_console_options(parser: argparse.ArgumentParser, progress: bool = True) -> None:
    """``-v/--verbose`` and ``--progress/--no-progress``, identical on every subcommand: the one convention
    for progress bars (``progress`` False: ``-v`` only, for a command that draws none)."""
    group = parser.add_argument_group("console")
    group.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also show the libraries' own warnings and log lines (diffusers, transformers, huggingface_hub)",
    )
    if not progress:  # a command that draws no progress (status, launch) offers no option for it
        return
    group.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="draw progress bars (default: bars on a terminal; elsewhere one progress line every "
        f"{DEFAULT_PROGRESS_INTERVAL_S:.0f} s, or ${PROGRESS_INTERVAL_VARIABLE} seconds)",
    )


def show_progress(args: argparse.Namespace) -> bool | None:
    """The ``enabled`` of :func:`progress_bar`: True with ``--progress`` (a bar even off a terminal),
    False with ``--no-progress``, None otherwise (a bar on a terminal,
    plain lines elsewhere)."""
    forced = getattr(args, "progress", None)
    return None if forced is None else bool(forced)


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


class GuardedStream:
    """A standard stream whose failure cannot fail the run: the first write or flush that raises (EPIPE when
    the reader went away, ``| head -1``; ENOSPC, ``> /dev/full``; a closed stream) is kept in ``failure``, the
    file descriptor is pointed at the null device (so the interpreter's own flush at exit fails no more:
    Python's documented answer to SIGPIPE) and every later write goes nowhere. Everything else is the
    stream's own."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.failure: OSError | ValueError | None = None

    def write(self, text: str) -> int:
        if self.failure is None:
            try:
                return self.stream.write(text)
            except (OSError, ValueError) as error:
                self._fail(error)
        return len(text)

    def flush(self) -> None:
        if self.failure is None:
            try:
                self.stream.flush()
            except (OSError, ValueError) as error:
                self._fail(error)

    def _fail(self, error: OSError | ValueError) -> None:
        self.failure = error
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, self.stream.fileno())
            finally:
                os.close(null)
        except (OSError, ValueError, AttributeError):  # no descriptor of its own (a test's stream): nothing to do
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def guard_standard_streams() -> None:
    """For the process's own command line: a stdout or stderr closed when flowlift started (``>&-``, ``2>&-``:
    Python makes them None) writes to the null device, and each is a :class:`GuardedStream`, so that no
    message, progress line or warning that cannot be shown stops a run or loses its outputs."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None:
            stream = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - the process's stream until it exits
        if not isinstance(stream, GuardedStream):
            setattr(sys, name, GuardedStream(stream))


def stdout_failure() -> OSError | ValueError | None:
    """Why stdout stopped taking output during this run (flushed first), if it did; None when it never broke
    or is not guarded (:func:`guard_standard_streams`)."""
    stream = sys.stdout
    if not isinstance(stream, GuardedStream):
        return None
    stream.flush()
    return stream.failure


def set_command(name: str) -> None:
    """Name the subcommand this process runs: progress lines start ``flowlift NAME:``; its time counts from now."""
    _command["name"] = name
    _command_started[:] = [time.monotonic()]


def command_started() -> float | None:
    """When the running subcommand started (:func:`time.monotonic`; None: no command named): a
    :class:`flowlift.progress.RunProgress` made later still counts the command's whole time."""
    return _command_started[0] if _command_started else None


@contextlib.contextmanager
def run_lines(run: Any, enabled: bool | None, file: TextIO | None = None) -> Iterator[None]:
    """Off a terminal (``enabled`` None, ``file`` not a terminal), the lines of a
    :class:`flowlift.progress.RunProgress`: one at once whenever a model starts loading, then one per
    :func:`progress_interval` naming the stage, the share done, the time since the command started and the time
    left; the loops' own progress lines stay quiet meanwhile (one line per interval). On a terminal the bars show
    the run (nothing here); ``enabled`` False: nothing."""
    file = sys.stderr if file is None else file
    if enabled is not None or _is_terminal(file):
        yield
        return
    interval = progress_interval()
    stop = threading.Event()
    prefix = f"flowlift {_command['name']}: " if _command["name"] else "flowlift: "
    said = {"loading": None}

    def write() -> None:
        try:
            print(prefix + run.state().line(), file=file, flush=True)
        except (OSError, ValueError):  # a closed log: progress is not worth failing the run for
            stop.set()

    def on_report(state: Any) -> None:
        if state.loading and state.loading != said["loading"]:
            said["loading"] = state.loading
            write()

    def tick() -> None:
        while not stop.wait(interval):
            write()

    run.subscribe(on_report)
    ticker = threading.Thread(target=tick, name="flowlift-run-progress", daemon=True)
    _run_lines.append(run)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        _run_lines.remove(run)
        if ticker is not threading.current_thread():
            ticker.join(timeout=1.0)


def format_seconds(seconds: float) -> str:
    """A duration for people: ``0.42 s``, ``12.3 s``, ``4 min 05 s``, ``2 h 03 min``."""
    if seconds < 1:
        return f"{seconds:.2f} s"
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = int(round(seconds))
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"


def progress_interval() -> float:
    """Seconds between two progress lines off a terminal: ``$FLOWLIFT_PROGRESS_INTERVAL_S`` (a positive
    number) or :data:`DEFAULT_PROGRESS_INTERVAL_S`."""
    text = os.environ.get(PROGRESS_INTERVAL_VARIABLE, "").strip()
    if not text:
        return DEFAULT_PROGRESS_INTERVAL_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise FlowliftError(f"{PROGRESS_INTERVAL_VARIABLE}={text!r}: expected a positive number of seconds")
    return value


def progress_line(
    desc: str, n: float, total: float | None, elapsed: float, unit: str, postfix: str = "", initial: float = 0
) -> str:
    """One plain progress line: done/total, the share done, this run's time so far, its mean rate
    (``rate = (n - initial) / elapsed``; ``initial``: where a resumed loop began) and the time left
    (``left = (total - n) / rate``), e.g. ``eval 3/12 img (25%) in 1 min 02 s, 20.7 s/img, about
    3 min 06 s left``; without a total, the count, the time and the rate."""
    done = f"{n:g}/{total:g} {unit} ({100 * n / total:.0f}%)" if total else f"{n:g} {unit}"
    line = f"{desc} {done} in {format_seconds(elapsed)}".lstrip()
    rate = (n - initial) / elapsed if elapsed > 0 else 0.0
    if rate > 0:
        line += f", {rate:.3g} {unit}/s" if rate >= 1 else f", {format_seconds(1 / rate)}/{unit}"
        if total and n < total:
            line += f", about {format_seconds((total - n) / rate)} left"
    return line + (f" [{postfix}]" if postfix else "")


def progress_bar(
    iterable: Iterable | None = None,
    *,
    desc: str,
    total: float | None = None,
    unit: str = "it",
    enabled: bool | None = None,
    initial: float = 0,
    leave: bool = True,
    file: TextIO | None = None,
) -> Any:
    """The progress of a long loop, a ``tqdm`` in every case (``update``, ``set_postfix``, iteration,
    ``with``): ``enabled`` True draws a bar, False nothing, None a bar when ``file`` (default stderr) is a
    terminal and otherwise :class:`_ProgressLines`: one plain :func:`progress_line` per
    :func:`progress_interval` seconds, also while one step takes longer than that."""
    from tqdm.auto import tqdm

    file = sys.stderr if file is None else file
    if file is None or getattr(file, "closed", False):  # stderr closed at start (`2>&-`): progress goes nowhere
        file, enabled = _Discard(), False
    options = {"desc": desc, "total": total, "unit": unit, "initial": initial, "leave": leave}
    if enabled is None and not _is_terminal(file):
        return _progress_lines_class()(iterable, out=file, interval=progress_interval(), **options)
    return tqdm(iterable, disable=enabled is False, file=file, dynamic_ncols=True, **options)


def _is_terminal(file: TextIO) -> bool:
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class _Discard:
    """The stream a :class:`_ProgressLines` gives tqdm: tqdm's own drawing goes nowhere."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


_lines_class: list[type] = []
#: The open :class:`_ProgressLines`, outermost first: only the outermost writes lines (one line per interval).
_open_lines: list[Any] = []
_open_lines_lock = threading.Lock()


def _progress_lines_class() -> type:
    """:class:`_ProgressLines`, made on first use so that importing this module does not import tqdm."""
    if not _lines_class:
        from tqdm.std import tqdm

        class _ProgressLines(tqdm):
            """A tqdm that draws nothing itself; a ticker thread writes one :func:`progress_line` to
            ``out`` every ``interval`` seconds while the loop runs (the counts and the mean rate from
            tqdm), so a step slower than the interval still gets its lines. Lines only: the command's
            own summary line says how it ended."""

            def __init__(self, iterable=None, *, out: TextIO, interval: float, **options: Any) -> None:
                self._out, self._interval = out, interval
                self._stop = threading.Event()
                # mininterval 0: tqdm keeps its count current at every item (its own drawing is discarded)
                super().__init__(iterable, file=_Discard(), mininterval=0, miniters=1, smoothing=0, **options)
                self._last_line = time.monotonic()
                with _open_lines_lock:
                    _open_lines.append(self)
                self._ticker = threading.Thread(target=self._tick, name="flowlift-progress", daemon=True)
                self._ticker.start()

            def line(self) -> str:
                d = self.format_dict
                prefix = f"flowlift {_command['name']}: " if _command["name"] else "flowlift: "
                desc = "" if self.desc == _command["name"] else self.desc
                line = progress_line(
                    desc, d["n"], d["total"], d["elapsed"], d["unit"], d.get("postfix") or "", d.get("initial") or 0
                )
                with _open_lines_lock:
                    inner = [bar for bar in _open_lines if bar is not self]
                for bar in inner:  # e.g. the steps of the image being done: a short note on the outer line
                    n, total = bar.format_dict["n"], bar.format_dict["total"]
                    line += f"; {bar.desc} {n:g}/{total:g}" if total else f"; {bar.desc} {n:g}"
                return prefix + line

            def display(self, msg: str | None = None, pos: int | None = None) -> bool:
                return True  # tqdm's own drawing: nothing (the ticker writes the lines)

            def write_line(self, now: float) -> bool:
                """Write a line when ``interval`` passed since the last one (at ``now``, monotonic)."""
                with _open_lines_lock:
                    outer = bool(_open_lines) and _open_lines[0] is self
                if not outer or _run_lines or now - self._last_line < self._interval:
                    return False  # an inner bar's state is part of the outermost bar's line
                self._last_line = now
                try:
                    print(self.line(), file=self._out, flush=True)
                except (OSError, ValueError):  # a closed log: progress is not worth failing the run for
                    self._stop.set()
                return True

            def _tick(self) -> None:
                while not self._stop.wait(max(0.01, self._interval - (time.monotonic() - self._last_line))):
                    self.write_line(time.monotonic())

            def close(self) -> None:
                stop = getattr(self, "_stop", None)
                if stop is not None:
                    stop.set()
                    with _open_lines_lock:  # by identity: tqdm's == compares screen positions
                        _open_lines[:] = [bar for bar in _open_lines if bar is not self]
                    ticker = getattr(self, "_ticker", None)
                    if ticker is not None and ticker is not threading.current_thread():
                        ticker.join(timeout=1.0)
                super().close()

        _lines_class.append(_ProgressLines)
    return _lines_class[0]
