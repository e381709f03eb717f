"""The app process's own knob, declared once: the upload limit (``flowlift app --max-upload-mb``, ``AppConfig``).

Its own module, free of the service's imports: the command line reads it for its help and parse when any
command starts, and :class:`~flowlift.app.service.AppConfig` checks a Python caller's value by the same rule.
"""

from __future__ import annotations

from flowlift.knobs import Knob

DEFAULT_MAX_UPLOAD_MB = 50.0
#: The largest upload limit: 1 TiB (an image past it is no upload; gradio keeps the byte count in 64 bits).
MAX_UPLOAD_MB = 1 << 20

MAX_UPLOAD = Knob(
    "max_upload_mb",
    float,
    DEFAULT_MAX_UPLOAD_MB,
    "largest accepted upload",
    low=0.0,
    high=MAX_UPLOAD_MB,
    low_open=True,
    unit="MB",
)
