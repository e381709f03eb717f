"""What one ``flowlift app`` request takes in and gives back, apart from the models.

The upload checks, the user's error lines (first line only, the server's folders cut off), the results
with their summaries (plain-text marks, so no emoji font is needed), the before/after preview, the
server's one log line per request, and the names the page shows for the configured VAEs (never a
server path). :mod:`flowlift.app.service` runs the requests.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowlift.errors import FlowliftError
from flowlift.knobs import LATENT_UPSCALER, labels

#: Longest side of the before/after preview sent to the browser (the download is full resolution).
PREVIEW_MAX_SIDE = 2048


def log_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def request_log_line(kind: str, name: str, request: str, seconds: float, outcome: str) -> str:
    """The server's one line per request: ``<time> flowlift app: <kind> <name> <request> <seconds> s <outcome>``,
    e.g. ``... upscale photo.png 640x480 x4 -> 2560x1920 12.3 s ok``. Whitespace (newlines in an uploaded
    file's name or an API caller's values included) is collapsed, so a request is always one line."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return " ".join(f"{stamp} flowlift app: {kind} {name} {request} {seconds:.1f} s {outcome}".split())


@dataclass
class RequestLog:
    """The parts of a request's log line a handler can refine while it runs (see :func:`logged_request`)."""

    request: str
    outcome: str = "ok"


@contextmanager
def logged_request(log: Callable[[str], None], kind: str, name: str, request: str) -> Iterator[RequestLog]:
    """Log one :func:`request_log_line` when the ``with`` body ends, whatever the outcome (an exception's first
    line is the outcome, and it propagates); the request is over then, so its freed memory goes back to the
    system (:func:`flowlift.app.memory.release_freed_memory`)."""
    from flowlift.app.memory import release_freed_memory

    entry = RequestLog(request)
    started = time.perf_counter()
    try:
        yield entry
    except BaseException as error:
        entry.outcome = f"error: {first_line(error)}"
        raise
    finally:
        release_freed_memory()
        log(request_log_line(kind, name, entry.request, time.perf_counter() - started, entry.outcome))


def model_name(spec: str) -> str:
    """What the page calls a model spec: a local file or folder by its name, a hub id or keyword as given."""
    path = Path(spec)
    return (path.name or str(spec)) if path.exists() else spec


def vae_labels(specs: Sequence[str]) -> dict[str, str]:
    """What the page calls each configured VAE (label -> spec): names, never server paths.

    The names of ``vae_names.VAE_NAMES`` (``flux2``, ``taef2``, ``mage``) and hub ids as given; a local file
    or folder by its name, with its parent folder's name when two would read the same (and a number when
    even that does not tell them apart).
    """
    labels: dict[str, str] = {}
    for spec in specs:
        path, label = Path(spec), model_name(spec)
        if path.exists() and any(model_name(other) == label for other in specs if other != spec):
            label = f"{path.parent.name}/{path.name}" if path.parent.name else label
        base, number = label, 2
        while label in labels:
            label, number = f"{base} ({number})", number + 1
        labels[label] = spec
    return labels


@dataclass
class UpscaleResult:
    """One upscaled file: the full-resolution PNG, the preview pair, and what to show under it."""

    output: Path
    before: Any
    after: Any
    input_size: tuple[int, int]
    output_size: tuple[int, int]
    seconds: float
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One Markdown paragraph: sizes, time, warnings (plain text marks: no emoji font needed)."""
        (w0, h0), (w1, h1) = self.input_size, self.output_size
        text = f"**{self.output.name}**: {w0}x{h0} to **{w1}x{h1}** px in {self.seconds:.1f} s"
        for warning in self.warnings:
            text += f"\n\n**Warning:** {warning}"
        return text

    def log_request(self) -> str:
        """The request part of the server's log line: sizes and scale."""
        (w0, h0), (w1, h1) = self.input_size, self.output_size
        return f"{w0}x{h0} x{w1 // max(w0, 1)} -> {w1}x{h1}"


@dataclass
class BatchResult:
    """A batch: the zip of every output written (None when nothing succeeded) and one line per failure."""

    zip_path: Path | None
    written: list[str]
    errors: list[str]
    seconds: float
    warnings: list[str] = field(default_factory=list)  # "name: what", e.g. passes the 16K cap dropped

    def summary(self) -> str:
        total = len(self.written) + len(self.errors)
        lines = [f"{len(self.written)} of {total} file(s) upscaled in {self.seconds:.1f} s"]
        lines += [f"- done: {name}" for name in self.written]
        lines += [f"- **warning:** {warning}" for warning in self.warnings]
        lines += [f"- **failed:** {error}" for error in self.errors]
        return "\n".join(lines)


def check_upload(path: str | Path, max_upload_mb: float) -> Path:
    """The uploaded file as a Path, or one error line when it is missing or over ``max_upload_mb``."""
    path = Path(path)
    if not path.is_file():
        raise FlowliftError(f"{path.name}: the upload is missing on the server; upload it again")
    size_mb = path.stat().st_size / 2**20
    if size_mb > max_upload_mb:
        raise FlowliftError(
            f"{path.name}: {size_mb:.1f} MB is over the {max_upload_mb:g} MB upload limit (--max-upload-mb)"
        )
    return path


def public_message(error: BaseException, path: Path) -> str:
    """An error's first line with the server-side folder of ``path`` cut off (only the file name stays)."""
    text = first_line(error).replace(str(path), path.name)
    return text if text.startswith(path.name) else f"{path.name}: {text}"


#: How the page names the fields an upscale's error line is about (a capability names them as Python does):
#: the knobs as the app's value checks say them, the VAE by its dropdown's label.
APP_WORDS = {**labels([LATENT_UPSCALER]), "vae": "VAE"}


def first_line(error: BaseException) -> str:
    """An error's first line as the page shows it (fields in :data:`APP_WORDS`), else the exception's type."""
    text = error.worded(APP_WORDS) if isinstance(error, FlowliftError) else str(error)
    return text.splitlines()[0] if text else type(error).__name__


def strip_folders(text: str, folders: Sequence[Path]) -> str:
    """``text`` with the server-side ``folders`` cut from any path in it (users see file names only)."""
    for folder in sorted({str(f) for f in folders}, key=len, reverse=True):
        text = text.replace(folder + "/", "")
    return text


def preview_pair(image: Any, result: Any, max_side: int = PREVIEW_MAX_SIDE) -> tuple[Any, Any]:
    """(input Lanczos-resized, output) at the output's size, both shrunk to fit ``max_side``."""
    from PIL import Image

    width, height = result.size
    shrink = min(1.0, max_side / max(width, height))
    size = (max(1, round(width * shrink)), max(1, round(height * shrink)))
    before = image.convert("RGB").resize(size, Image.Resampling.LANCZOS)
    after = result.convert("RGB")
    if after.size != size:
        after = after.resize(size, Image.Resampling.LANCZOS)
    return before, after
