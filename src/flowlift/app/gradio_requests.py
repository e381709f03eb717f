"""What the page's handlers ask of Gradio about a request: the uploads' paths (only Gradio's own uploads) and
whether the request was stopped; the bar its reports go to. Gradio is imported only when a handler runs."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flowlift.app.progress import RequestStopped, StopCheck
from flowlift.errors import FlowliftError


def upload_path(payload: Any) -> str | None:
    """The server-side path of a raw upload payload (a FileData dict, or a path string), only ever a file under
    Gradio's upload folder: with ``preprocess=False`` nothing else checks an image payload's path, and a request
    naming ``/etc/passwd`` or another user's photo would have the server read it (an image: upscale it for them)."""
    path = payload.get("path") if isinstance(payload, dict) else payload
    if path is None:
        return None
    from gradio.utils import get_upload_folder

    if not isinstance(path, (str, os.PathLike)) or not Path(path).resolve().is_relative_to(
        Path(get_upload_folder()).resolve()
    ):
        name = Path(path).name if isinstance(path, (str, os.PathLike)) else repr(path)[:40]
        raise FlowliftError(f"{name}: not a file uploaded to this page; upload it again")
    return os.fspath(path)


def event_stop_check() -> StopCheck:
    """This request's stop check: raises :class:`RequestStopped` once its Gradio event has left the queue (the
    page's Stop, a client's cancel). Gradio cancels the event's task but cannot stop the thread that runs the
    handler; the handler asks this at every progress report and the pipelines before every layer."""
    from gradio.context import LocalContext

    blocks, event_id = LocalContext.blocks.get(None), LocalContext.event_id.get(None)
    events = getattr(getattr(blocks, "_queue", None), "event_ids_to_events", None)
    if event_id is None or not isinstance(events, dict):  # called outside a queued event (a test's direct call)
        return lambda: None

    def check() -> None:
        if event_id not in events:
            raise RequestStopped("stopped")

    return check


def progress_adapter(progress: Any, stop: StopCheck) -> Callable[[float, str], None]:
    """The service's reports on Gradio's bar, each a stop point (``stop``, :func:`event_stop_check`)."""

    def report(fraction: float, description: str) -> None:
        stop()
        progress(min(max(fraction, 0.0), 1.0), desc=description)

    return report


def run_stoppable(service: Any, call: Callable[..., Any], arguments: tuple, progress: Any) -> Any:
    """``call(*arguments, progress=...)`` (a service handler) as one of the page's requests: it waits for the
    request before it and stops when this one is stopped (:meth:`AppService.one_run`, :func:`event_stop_check`), its
    reports on Gradio's bar ``progress``."""
    stop = event_stop_check()
    with service.one_run(stop):
        return call(*arguments, progress=progress_adapter(progress, stop))
