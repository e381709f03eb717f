"""What the soak scripts measure of a process, and the rule they judge it by.

A soak run repeats one kind of work many times (upscales through the command line, requests to the web
app, prompts through ComfyUI) and samples the serving process's resident memory, open files and threads
from ``/proc``. Memory counts as flat when its level after the run is within :data:`FLAT_FRACTION` (or
:data:`FLAT_BYTES`, whichever is larger) of its level after the first 10% of the work: the first
requests fill caches and allocator pools, a leak keeps growing after them. Open files and threads must
not grow at all between those two points.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

FLAT_FRACTION = 0.10
FLAT_BYTES = 50 << 20
#: The warm-up share of the work after which the reference sample is taken.
WARM_FRACTION = 0.10


@dataclass(frozen=True)
class ProcessSample:
    """One look at a process: resident memory (bytes), open file descriptors and threads."""

    rss: int
    open_files: int
    threads: int

    @classmethod
    def of(cls, pid: int | None = None) -> ProcessSample:
        """Read ``/proc/PID`` (this process by default); Linux only, like the soak runs."""
        proc = Path("/proc") / str(pid or os.getpid())
        rss = threads = 0
        for line in (proc / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
        return cls(rss=rss, open_files=len(os.listdir(proc / "fd")), threads=threads)


def warm_index(total: int) -> int:
    """The 0-based index of the unit of work after which the warm reference is sampled (at least the first)."""
    return max(0, round(total * WARM_FRACTION) - 1)


def flat_verdict(warm: ProcessSample, end: ProcessSample) -> list[str]:
    """The reasons the run is not flat (empty when it is): memory beyond the allowance, files or threads grown."""
    allowance = max(FLAT_BYTES, int(warm.rss * FLAT_FRACTION))
    problems = []
    if end.rss - warm.rss > allowance:
        problems.append(
            f"resident memory grew {(end.rss - warm.rss) / 2**20:.0f} MiB after warm-up "
            f"(allowed {allowance / 2**20:.0f} MiB)"
        )
    if end.open_files > warm.open_files:
        problems.append(f"open files grew from {warm.open_files} to {end.open_files}")
    if end.threads > warm.threads:
        problems.append(f"threads grew from {warm.threads} to {end.threads}")
    return problems


def table_row(name: str, units: int, warm: ProcessSample, end: ProcessSample, extra: str = "") -> str:
    """One Markdown row: work done, memory after warm-up and at the end, files, threads, verdict."""
    verdict = "; ".join(flat_verdict(warm, end)) or "flat"
    return (
        f"| {name} | {units} | {warm.rss / 2**20:.0f} | {end.rss / 2**20:.0f} | "
        f"{(end.rss - warm.rss) / 2**20:+.0f} | {warm.open_files} -> {end.open_files} | "
        f"{warm.threads} -> {end.threads} | {extra} | {verdict} |"
    )


TABLE_HEADER = (
    "| run | units | RSS after warm-up MiB | RSS at end MiB | growth MiB | open files | threads | notes | verdict |\n"
    "|---|---|---|---|---|---|---|---|---|"
)
