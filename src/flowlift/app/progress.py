"""One progress bar per request: how far an upscale is (stages and decode tiles) and how long is left.

The pipeline reports each finished stage (``encode``, ``pass i/n``, ``decode``, ``color fix``) and each
finished tile of the VAE decode; :class:`UpscaleProgress` turns those into one fraction of the
request's work and a line saying what runs now, and :class:`EtaProgress` adds the time left. Pure
Python, no Gradio: :mod:`flowlift.app.page` hands the result to ``gr.Progress``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: Progress reporter: ``progress(fraction_done, description)``.
ProgressFn = Callable[[float, str], None]

#: Work per pixel a stage produces, relative to a UNet pass (see :func:`stage_weights`).
ENCODE_COST = 4.0
PASS_COST = 1.0
DECODE_COST = 1.0
COLOR_FIX_COST = 0.1
SAVE_COST = 0.1
#: No time left is shown before this share of the work is done or this many seconds have passed.
ETA_MIN_FRACTION = 0.02
ETA_MIN_SECONDS = 1.0


def stage_weights(passes: int) -> list[tuple[str, float]]:
    """The stages of one upscale (the pipeline's names, then ``saving``) with their share of the work.

    With the input's pixel count as 1, a stage's weight is the pixels it produces times its cost per
    pixel, normalized to sum to 1::

        encode       ENCODE_COST * 1          (reads the full-resolution input)
        pass i/n     PASS_COST * 4**i         (i = 1..n; each pass doubles both sides)
        decode       DECODE_COST * 4**n
        color fix    COLOR_FIX_COST * 4**n
        saving       SAVE_COST * 4**n

    A model, not a measurement: it only has to make the bar and the time left move evenly.
    """
    out = 4.0**passes
    stages = [("encode", ENCODE_COST)]
    stages += [(f"pass {i}/{passes}", PASS_COST * 4.0**i) for i in range(1, passes + 1)]
    stages += [("decode", DECODE_COST * out), ("color fix", COLOR_FIX_COST * out), ("saving", SAVE_COST * out)]
    total = sum(weight for _, weight in stages)
    return [(name, weight / total) for name, weight in stages]


def remaining_seconds(fraction: float, elapsed: float) -> float | None:
    """Time left if the rest runs at the rate so far: ``elapsed * (1 - f) / f``.

    None while too little is done to say (``f < ETA_MIN_FRACTION`` or ``elapsed < ETA_MIN_SECONDS``)
    and once the work is done (``f >= 1``).
    """
    if fraction < ETA_MIN_FRACTION or elapsed < ETA_MIN_SECONDS or fraction >= 1.0:
        return None
    return elapsed * (1.0 - fraction) / fraction


def format_duration(seconds: float) -> str:
    """``"4 s"``, ``"2 min 05 s"``, ``"1 h 02 min"`` (whole seconds, rounded up)."""
    whole = max(1, int(-(-seconds // 1)))
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"


class EtaProgress:
    """A :data:`ProgressFn` that appends ``about N s left`` (:func:`remaining_seconds`) to each line.

    The clock starts when this object is made, so model loading before it does not count.
    """

    def __init__(self, report: ProgressFn, clock: Callable[[], float] = time.monotonic) -> None:
        self._report = report
        self._clock = clock
        self._started = clock()

    def __call__(self, fraction: float, description: str) -> None:
        left = remaining_seconds(fraction, self._clock() - self._started)
        if left is not None:
            description = f"{description}, about {format_duration(left)} left"
        self._report(fraction, description)


class UpscaleProgress:
    """The pipeline's stage and decode-tile callbacks as one fraction in ``[base, base + span)``.

    ``stage(name)`` is the pipeline's ``callback`` (called after a stage), ``decode_tile(done, total)``
    its ``on_decode_tile``; each report says what runs now, e.g. ``photo.png: decode, tile 3/12``.
    """

    def __init__(self, report: ProgressFn, name: str, passes: int, base: float = 0.0, span: float = 1.0) -> None:
        self._report = report
        self._name = name
        self._stages = stage_weights(passes)
        self._base, self._span = base, span
        self._index = 0  # the stage running now
        self._done = 0.0  # share of the work in finished stages

    def _send(self, within: float, what: str) -> None:
        fraction = self._done + within * self._stages[min(self._index, len(self._stages) - 1)][1]
        self._report(self._base + self._span * min(fraction, 1.0), f"{self._name}: {what}")

    def start(self) -> None:
        self._send(0.0, self._stages[0][0])

    def _running(self, name: str) -> None:
        """Make ``name`` the running stage (the stages before it finished). A pass count other than the
        planned one (the 16K cap dropped passes) re-plans the stages."""
        names = [stage for stage, _ in self._stages]
        if name not in names and name.startswith("pass "):
            self._stages = stage_weights(int(name.rsplit("/", 1)[1]))
            names = [stage for stage, _ in self._stages]
        if name in names:
            self._index = names.index(name)
            self._done = sum(weight for _, weight in self._stages[: self._index])

    def stage(self, finished: str) -> None:
        """A stage finished (the pipeline's names); the report names the next one."""
        self._running(finished)
        self._done += self._stages[self._index][1]
        self._index += 1
        following = self._stages[self._index][0] if self._index < len(self._stages) else "saving"
        self._send(0.0, f"{finished} done, {following}")

    def decode_tile(self, done: int, total: int) -> None:
        """Tile ``done`` of ``total`` of the VAE decode finished."""
        self._running("decode")
        self._send(done / max(total, 1), f"decode, tile {done}/{total}")
