"""One progress model for every door: a run's stages by name, done/total, and the time left from this run's own speed.

A :class:`RunProgress` is made when a command (or an app request, or a node) starts, before any model loads. It
knows the stages still to come and the *work* of each (a planned cost in any unit: pixels times a per-stage cost,
FLOPs), and is told what happens as it happens:

* :meth:`RunProgress.loading` names a model being loaded (and its size) from the first second; loading is not work
  (a disk's speed says nothing about the compute), so it never enters the estimate;
* :meth:`RunProgress.begin` / :meth:`RunProgress.finished` move through the planned stages (``encode``,
  ``pass 1/2``, ``decode``, ``color fix``, ``writing``, ``step``...), :meth:`RunProgress.step` reports the steps or
  tiles within the running stage.

:meth:`RunProgress.state` is what every door shows (:class:`ProgressState`: the stage, its steps, the share of the
work done, the time since the run started and the time left). The time left is calibrated on *this* run only
(never on earlier requests under other loads): with ``s_k`` the seconds per unit of work measured so far for stages
of kind ``k`` (``s`` for all kinds together), the running stage's rest is ``max((n - d) q - (t - t_d), (n - d - 1) q)``
once ``d`` of its ``n`` steps are done (``q`` its own seconds per step, ``t_d`` the time of its last step), else
``max(w s_k - (t - t_0), 0)`` (one that overran that estimate counts in ``s_k`` and ``s`` as if it ended now: the
machine is slower than measured), and each stage to come adds ``w_j s_{k_j}`` (``s`` for a kind not run yet). The doors
read the active run of their thread through :func:`active` (set by :func:`running`); code deep in a pipeline reports
through :func:`report_stage` / :func:`report_step`, which do nothing when no run is active. Pure Python, no torch.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from flowlift.console import format_seconds

#: The kind of a loading stage: never counted as work.
LOAD = "load"
#: A new estimate up to this factor above the last one shown is held at the last (the time left only falls).
RISE_SHOWN = 1.25


def stage_kind(name: str) -> str:
    """The kind of a stage by its name: ``"pass 2/3"`` -> ``"pass"``, ``"kodim23.png: decode"`` -> ``"decode"``."""
    name = name.rsplit(": ", 1)[-1]
    return name.split(" ", 1)[0] if name.startswith("pass ") else name


@dataclass
class Stage:
    """One stage of a run: its ``name`` as shown, its planned ``work`` and its ``kind`` (the speed it shares)."""

    name: str
    work: float
    kind: str = ""
    started: float | None = None
    ended: float | None = None
    done: int = 0  # steps done within the stage
    steps: int = 0  # steps of the stage (0: not reported in steps)
    last_step: float | None = None  # when the last step finished

    def __post_init__(self) -> None:
        self.kind = self.kind or stage_kind(self.name)
        if not self.work >= 0:
            raise ValueError(f"stage {self.name!r}: work must be >= 0, got {self.work}")


@dataclass(frozen=True)
class ProgressState:
    """What a door shows: the ``stage`` running (None: none yet), its ``done``/``steps`` (0 steps: none reported),
    ``fraction`` of the planned work done, ``elapsed`` seconds since the run started, ``left`` seconds (None: not
    known yet) and what is ``loading`` (the model's name and size, while it loads)."""

    stage: str | None
    done: int
    steps: int
    fraction: float
    elapsed: float
    left: float | None
    loading: str | None = None

    def what(self) -> str:
        """The running stage in words: ``loading the Flow Upscaler (1.2 GB)``, ``kodim23.png: decode, tile 3/12``."""
        if self.loading:
            return f"loading {self.loading}"
        if self.stage is None:
            return "starting"
        if self.steps:
            unit = "tile" if stage_kind(self.stage) in ("decode", "encode") else "step"
            return f"{self.stage}, {unit} {self.done}/{self.steps}"
        return self.stage

    def line(self) -> str:
        """One progress line: ``kodim23.png: decode, tile 3/12 (62%) in 2 min 20 s, about 40 s left``; while models
        load (or before the first stage): ``loading the Flow Upscaler (1.2 GB), 4.1 s so far``."""
        if self.loading or self.stage is None:
            return f"{self.what()}, {format_seconds(self.elapsed)} so far"
        line = f"{self.what()} ({100 * self.fraction:.0f}%) in {format_seconds(self.elapsed)}"
        left = f"about {format_seconds(self.left)} left" if self.left is not None else "time left: measuring"
        return f"{line}, {left}"


@dataclass
class RunProgress:
    """The stages of one run and the time left (the module docstring has the estimate). Thread-safe: the pipeline's
    thread reports, a ticker or a web page reads. ``clock``: seconds (monotonic); ``started``: when the run began
    (default: now), so a command's estimate counts from its own start, not from a loop's."""

    clock: Callable[[], float] = time.monotonic
    started: float | None = None
    stages: list[Stage] = field(default_factory=list)
    listeners: list[Callable[[ProgressState], None]] = field(default_factory=list)
    group: str = ""  # a prefix of the stages reported now (the image's name in a batch)

    def __post_init__(self) -> None:
        self.started = self.clock() if self.started is None else self.started
        self._lock = threading.RLock()
        self._running: Stage | None = None
        self._loading: str | None = None
        self._shown: tuple[float, float] | None = None  # (time, seconds left) of the last estimate given

    # -- what the run reports ---------------------------------------------------------------------------------

    def plan(self, stages: Sequence[tuple[str, float] | Stage]) -> None:
        """Add stages to come, in order: ``(name, work)`` pairs or :class:`Stage`."""
        with self._lock:
            self.stages += [item if isinstance(item, Stage) else Stage(*item) for item in stages]
        self._tell()

    def loading(self, what: str | None) -> None:
        """``what`` is loading now (a model and its size); None: loading is over."""
        with self._lock:
            self._loading = what
        self._tell()

    def _name(self, name: str) -> str:
        return f"{self.group}: {name}" if self.group and ": " not in name else name

    def _find(self, name: str) -> Stage:
        name = self._name(name)
        for stage in self.stages:
            if stage.name == name and stage.ended is None:
                return stage
        stage = Stage(name, 0.0)  # not planned: shown, but no work of its own
        after = self.stages.index(self._running) + 1 if self._running in self.stages else len(self.stages)
        self.stages.insert(after, stage)
        return stage

    def begin(self, name: str) -> None:
        """Stage ``name`` starts now (the running one, if another, is finished)."""
        with self._lock:
            now = self.clock()
            stage = self._find(name)
            if self._running is not None and self._running is not stage:
                self._end(self._running, now)
            if stage.started is None:
                stage.started = now
            self._running, self._loading = stage, None
        self._tell()

    def _end(self, stage: Stage, now: float) -> None:
        stage.started = now if stage.started is None else stage.started
        stage.ended = now
        stage.done = stage.steps
        if self._running is stage:
            self._running = None

    def finished(self, name: str) -> None:
        """Stage ``name`` is done (a pipeline's "after each stage" callback); the next planned stage starts."""
        with self._lock:
            now = self.clock()
            stage = self._find(name)
            if stage.started is None:  # nobody said it began: it ran since the previous stage ended
                ends = [s.ended for s in self.stages if s.ended is not None]
                stage.started = max(ends) if ends else now
            self._end(stage, now)
            following = next((s for s in self.stages if s.ended is None and s.kind != LOAD), None)
            if following is not None:
                following.started = now
                self._running = following
        self._tell()

    def drop(self, group: str) -> None:
        """The stages of ``group`` not run yet are not going to run (an image failed or was skipped)."""
        with self._lock:
            prefix = f"{group}: "
            self.stages = [s for s in self.stages if s.ended is not None or not s.name.startswith(prefix)]
            if self._running is not None and self._running.name.startswith(prefix):
                self._running = None
        self._tell()

    def step(self, done: int, total: int) -> None:
        """``done`` of ``total`` steps (sampling steps, decode tiles) of the running stage are finished."""
        with self._lock:
            stage = self._running
            if stage is None:
                return
            stage.done, stage.steps, stage.last_step = max(0, min(done, total)), max(0, total), self.clock()
        self._tell()

    def subscribe(self, listener: Callable[[ProgressState], None]) -> None:
        """Call ``listener(state)`` after every report (the app's bar, a node's events)."""
        self.listeners.append(listener)

    def _tell(self) -> None:
        if self.listeners:
            state = self.state()
            for listener in list(self.listeners):
                listener(state)

    # -- what a door reads ------------------------------------------------------------------------------------

    def state(self, now: float | None = None) -> ProgressState:
        """The run at ``now`` (default: the clock's now)."""
        with self._lock:
            now = self.clock() if now is None else now
            stage = self._running or next((s for s in self.stages if s.ended is None and s.kind != LOAD), None)
            if stage is None and self.stages:  # every planned stage ran
                stage = Stage(f"{self.group}: done" if self.group else "done", 0.0)
            total = sum(s.work for s in self.stages)
            done = sum(self._work_done(s) for s in self.stages)
            return ProgressState(
                stage=stage.name if stage is not None else None,
                done=stage.done if stage is not None else 0,
                steps=stage.steps if stage is not None else 0,
                fraction=min(1.0, done / total) if total > 0 else 0.0,
                elapsed=now - self.started,
                left=self._steady(now, self._left(now)),
                loading=self._loading,
            )

    def _steady(self, now: float, left: float | None) -> float | None:
        """The estimate as shown: it never rises by a little (a step a bit slower than the ones before, a new stage's
        first moments) but holds, so it falls monotonically toward the end; a rise past :data:`RISE_SHOWN` times the
        last shown (a real surprise, a stage far slower than planned) is shown as it is."""
        if left is None:
            return None
        if self._shown is not None and self._shown[1] < left <= RISE_SHOWN * self._shown[1]:
            left = self._shown[1]
        self._shown = (now, left)
        return left

    @staticmethod
    def _work_done(stage: Stage) -> float:
        if stage.ended is not None:
            return stage.work
        return stage.work * stage.done / stage.steps if stage.steps else 0.0

    def _measured(self) -> tuple[dict[str, tuple[float, float]], tuple[float, float]]:
        """(seconds, work) measured per kind and in all, over finished stages and the running one's steps."""
        kinds: dict[str, tuple[float, float]] = {}
        for stage in self.stages:
            if stage.kind == LOAD or stage.started is None or stage.work <= 0:
                continue
            end = stage.ended if stage.ended is not None else stage.last_step if stage.done else None
            if end is None:
                continue
            seconds, work = kinds.get(stage.kind, (0.0, 0.0))
            kinds[stage.kind] = (seconds + end - stage.started, work + self._work_done(stage))
        seconds = sum(s for s, _ in kinds.values())
        work = sum(w for _, w in kinds.values())
        return kinds, (seconds, work)

    def _left(self, now: float) -> float | None:
        kinds, (seconds, work) = self._measured()
        if work <= 0 or seconds <= 0:
            return None  # nothing measured on this run yet: no guess from elsewhere
        running = self._running
        if running is not None and running.started is not None and not running.done and running.work > 0:
            spent = now - running.started  # a stage without steps that overran its estimate: the machine is slower
            if spent > running.work * seconds / work:  # than measured so far, so count it as if it ended now
                kind_seconds, kind_work = kinds.get(running.kind, (0.0, 0.0))
                kinds[running.kind] = (kind_seconds + spent, kind_work + running.work)
                seconds, work = seconds + spent, work + running.work

        def rate(kind: str) -> float:
            kind_seconds, kind_work = kinds.get(kind, (0.0, 0.0))
            return kind_seconds / kind_work if kind_work > 0 else seconds / work

        left = 0.0
        for stage in self.stages:
            if stage.ended is not None or stage.kind == LOAD:
                continue
            if stage is self._running and stage.started is not None:
                if stage.done and stage.last_step is not None:  # its own speed so far
                    per_step = (stage.last_step - stage.started) / stage.done
                    rest = (stage.steps - stage.done) * per_step  # at least the steps after the one running
                    left += max(rest - per_step, rest - (now - stage.last_step), 0.0)
                else:
                    left += max(0.0, stage.work * rate(stage.kind) - (now - stage.started))
            else:
                left += stage.work * rate(stage.kind)
        return left


class StageParts:
    """A node's run as ``count`` parts (its stages: encode, each pass, decode, colour fix) weighted by ``work``
    (planned costs, e.g. :func:`flowlift.upscale.stages.upscale_stages`; default: equal), kept in a
    :class:`RunProgress` as ``stage i/n``; the first part runs from the start. A node pack's bar shows
    :attr:`fraction` (its share of the work, not of the parts: a 4x upscale's second pass is 4x the first's)."""

    def __init__(self, count: int, work: Sequence[float] | None = None) -> None:
        self.count = max(1, count)
        self.done = 0
        weights = list(work) if work is not None and len(work) == self.count else [1.0] * self.count
        self.run = RunProgress()
        self.run.plan([(self.name(i), weight) for i, weight in enumerate(weights)])
        self.run.begin(self.name(0))

    def name(self, index: int) -> str:
        return f"stage {index + 1}/{self.count}"

    def strip(self, done: int, total: int) -> None:
        """``done`` of ``total`` strips (or tiles) of the running part are finished."""
        self.run.step(done, max(1, total))

    def finished(self) -> None:
        """The running part is done (a pipeline's "after each stage" callback); the next one starts."""
        self.run.finished(self.name(min(self.done, self.count - 1)))
        self.done += 1

    @property
    def fraction(self) -> float:
        return self.run.state().fraction


_active: contextvars.ContextVar[RunProgress | None] = contextvars.ContextVar("flowlift_progress", default=None)


def active() -> RunProgress | None:
    """The run this thread reports to (None: none)."""
    return _active.get()


@contextlib.contextmanager
def running(run: RunProgress) -> Iterator[RunProgress]:
    """Make ``run`` the active run of this thread (and of threads started from its context) for the block."""
    token = _active.set(run)
    try:
        yield run
    finally:
        _active.reset(token)


def report_stage(name: str) -> None:
    """Stage ``name`` of the active run begins (nothing without an active run)."""
    run = _active.get()
    if run is not None:
        run.begin(name)


def report_finished(name: str) -> None:
    """Stage ``name`` of the active run is done (nothing without an active run)."""
    run = _active.get()
    if run is not None:
        run.finished(name)


def report_step(done: int, total: int) -> None:
    """``done`` of ``total`` steps of the active run's stage are finished (nothing without an active run)."""
    run = _active.get()
    if run is not None:
        run.step(done, total)


def report_loading(what: str | None) -> None:
    """``what`` loads now in the active run (nothing without an active run)."""
    run = _active.get()
    if run is not None:
        run.loading(what)
