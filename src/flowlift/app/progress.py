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

#: Seconds per megapixel of what each stage produces (the input's pixels for ``encode``, the pass's output
#: for ``pass``, the result's for the rest), measured with the released architecture (random full-size UNet),
#: TAEF2 and float32 on the CPU: ``PYTHONPATH=src python benchmarks/bench_app_eta.py --dtype float32 --json``
#: (1024x693 photo, x2; 2-core AMD EPYC, 2026-12-01; docs/app.md has the table). Only their ratios matter;
#: :class:`StageCosts` replaces them with a machine's own measured times after its first request.
DEFAULT_SECONDS_PER_MP = {"encode": 2.82, "pass": 4.17, "decode": 3.61, "color fix": 0.57, "saving": 0.14}
#: Weight of the newest request's measured cost against what was learned before (an exponential average;
#: the first measurement replaces the table, which came from another machine).
LEARNING_RATE = 0.5
#: No time left is shown before this share of the work is done or this many seconds have passed.
ETA_MIN_FRACTION = 0.02
ETA_MIN_SECONDS = 1.0


def stage_kind(name: str) -> str:
    """The cost table's key of a stage: ``"pass 2/3"`` -> ``"pass"``, other names as they are."""
    return "pass" if name.startswith("pass ") else name


def stage_pixels(passes: int) -> list[tuple[str, float]]:
    """The stages of one upscale and the pixels each produces, with the input's pixel count as 1::

        encode 1,  pass i/n 4**i (i = 1..n: each pass doubles both sides),  decode, color fix, saving 4**n
    """
    out = 4.0**passes
    stages = [("encode", 1.0)] + [(f"pass {i}/{passes}", 4.0**i) for i in range(1, passes + 1)]
    return stages + [("decode", out), ("color fix", out), ("saving", out)]


def produced_megapixels(passes: int, input_megapixels: float) -> dict[str, float]:
    """Megapixels each stage kind produces in one upscale of an ``input_megapixels`` image (passes summed)."""
    produced: dict[str, float] = {}
    for name, count in stage_pixels(passes):
        produced[stage_kind(name)] = produced.get(stage_kind(name), 0.0) + count * input_megapixels
    return produced


class StageCosts:
    """Seconds per megapixel of each stage kind, learned from finished requests.

    Starts from :data:`DEFAULT_SECONDS_PER_MP`; :meth:`learn` takes one finished request's stage times (the
    first replaces the table, later ones are averaged in at :data:`LEARNING_RATE`), so from the second request
    on a machine its stages are weighed by that machine's own speeds (a GPU, bf16, another VAE all shift them).
    The table is replaced as a whole on each update, so a request reading it never sees half an update.
    """

    def __init__(self, seconds_per_mp: dict[str, float] | None = None) -> None:
        self._seconds_per_mp = dict(seconds_per_mp or DEFAULT_SECONDS_PER_MP)
        self._measured: set[str] = set()  # the kinds this machine has timed itself

    def per_mp(self, kind: str) -> float:
        return self._seconds_per_mp[kind]

    def table(self) -> dict[str, float]:
        """The seconds per megapixel now, per stage kind."""
        return dict(self._seconds_per_mp)

    def learn(self, seconds: dict[str, float], megapixels: dict[str, float]) -> None:
        """Fold in measured ``seconds`` per stage kind for ``megapixels`` produced by that kind."""
        updated = dict(self._seconds_per_mp)
        for kind, spent in seconds.items():
            if kind in updated and megapixels.get(kind, 0.0) > 0 and spent >= 0:
                measured = spent / megapixels[kind]
                rate = LEARNING_RATE if kind in self._measured else 1.0
                updated[kind] = (1 - rate) * updated[kind] + rate * measured
                self._measured.add(kind)
        self._seconds_per_mp = updated


def stage_weights(passes: int, costs: StageCosts | None = None) -> list[tuple[str, float]]:
    """The stages of one upscale (the pipeline's names, then ``saving``) with their share of the time.

    A stage's weight is the pixels it produces (:func:`stage_pixels`) times its seconds per pixel
    (:class:`StageCosts`, measured), normalized to sum to 1: ``w_s = p_s c_s / sum_t p_t c_t``.
    """
    costs = costs or StageCosts()
    stages = [(name, pixels * costs.per_mp(stage_kind(name))) for name, pixels in stage_pixels(passes)]
    total = sum(weight for _, weight in stages)
    return [(name, weight / total) for name, weight in stages]


def remaining_seconds(fraction: float, elapsed: float, start_fraction: float = 0.0) -> float | None:
    """Time left if the rest runs at the rate since ``start_fraction`` was reached ``elapsed`` seconds ago:
    ``elapsed * (1 - f) / (f - f0)``.

    None while too little is done to say (``f - f0 < ETA_MIN_FRACTION`` or ``elapsed < ETA_MIN_SECONDS``)
    and once the work is done (``f >= 1``).
    """
    done = fraction - start_fraction
    if done < ETA_MIN_FRACTION or elapsed < ETA_MIN_SECONDS or fraction >= 1.0:
        return None
    return elapsed * (1.0 - fraction) / done


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

    Made when the request starts, before any model loads. The rate is measured from the first report past 0
    (the first stage done) on, so what comes before it is never extrapolated to the rest of the work: loading
    the models on a server's first request (reported at 0) and the first stage's one-off kernel set-up, which
    made a first estimate of "about 1 min 13 s left" with 15 s to go. :attr:`left` is the last estimate shown
    (None: none yet), :attr:`elapsed` the request's time so far, loading included.
    """

    def __init__(self, report: ProgressFn, clock: Callable[[], float] = time.monotonic) -> None:
        self._report = report
        self._clock = clock
        self._started = clock()
        self._anchor: tuple[float, float] | None = None  # (time, fraction) of the first report past 0
        self.left: float | None = None

    @property
    def elapsed(self) -> float:
        return self._clock() - self._started

    def __call__(self, fraction: float, description: str) -> None:
        now = self._clock()
        self.left = None
        if self._anchor is None:
            if fraction > 0:
                self._anchor = (now, fraction)
        else:
            since, start_fraction = self._anchor
            self.left = remaining_seconds(fraction, now - since, start_fraction)
        if self.left is not None:
            description = f"{description}, about {format_duration(self.left)} left"
        self._report(fraction, description)


class UpscaleProgress:
    """The pipeline's stage and decode-tile callbacks as one fraction in ``[base, base + span)``.

    ``stage(name)`` is the pipeline's ``callback`` (called after a stage), ``decode_tile(done, total)``
    its ``on_decode_tile``, ``finish()`` is called once the file is written; each report says what runs
    now, e.g. ``photo.png: decode, tile 3/12``. The stages are weighed by ``costs``; given the input's
    ``input_megapixels``, ``finish()`` teaches ``costs`` this request's own stage times.
    """

    def __init__(
        self,
        report: ProgressFn,
        name: str,
        passes: int,
        base: float = 0.0,
        span: float = 1.0,
        costs: StageCosts | None = None,
        input_megapixels: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._report = report
        self._name = name
        self._costs = costs or StageCosts()
        self._passes = passes
        self._stages = stage_weights(passes, self._costs)
        self._base, self._span = base, span
        self._index = 0  # the stage running now
        self._done = 0.0  # share of the work in finished stages
        self._input_megapixels = input_megapixels
        self._clock = clock
        self._mark = clock()  # when the running stage started
        self._seconds: dict[str, float] = {}  # measured time per stage kind

    def _send(self, within: float, what: str) -> None:
        fraction = self._done + within * self._stages[min(self._index, len(self._stages) - 1)][1]
        self._report(self._base + self._span * min(fraction, 1.0), f"{self._name}: {what}")

    def start(self) -> None:
        self._mark = self._clock()
        self._send(0.0, self._stages[0][0])

    def _running(self, name: str) -> None:
        """Make ``name`` the running stage (the stages before it finished). A pass count other than the
        planned one (the 16K cap dropped passes) re-plans the stages."""
        names = [stage for stage, _ in self._stages]
        if name not in names and name.startswith("pass "):
            self._passes = int(name.rsplit("/", 1)[1])
            self._stages = stage_weights(self._passes, self._costs)
            names = [stage for stage, _ in self._stages]
        if name in names:
            self._index = names.index(name)
            self._done = sum(weight for _, weight in self._stages[: self._index])

    def _clock_stage(self, name: str) -> None:
        now = self._clock()
        kind = stage_kind(name)
        self._seconds[kind] = self._seconds.get(kind, 0.0) + now - self._mark
        self._mark = now

    def stage(self, finished: str) -> None:
        """A stage finished (the pipeline's names); the report names the next one."""
        self._running(finished)
        self._clock_stage(finished)
        self._done += self._stages[self._index][1]
        self._index += 1
        following = self._stages[self._index][0] if self._index < len(self._stages) else "saving"
        self._send(0.0, f"{finished} done, {following}")

    def decode_tile(self, done: int, total: int) -> None:
        """Tile ``done`` of ``total`` of the VAE decode finished."""
        self._running("decode")
        self._send(done / max(total, 1), f"decode, tile {done}/{total}")

    @property
    def seconds(self) -> dict[str, float]:
        """Measured seconds per stage kind so far (``pass`` summed over the passes)."""
        return dict(self._seconds)

    def finish(self) -> None:
        """The output is written: the ``saving`` time is taken and the costs learn this request's times."""
        self._clock_stage("saving")
        if self._input_megapixels is None or self._input_megapixels <= 0:
            return
        self._costs.learn(self._seconds, produced_megapixels(self._passes, self._input_megapixels))
