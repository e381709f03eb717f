"""Start-up cost of ``import flowlift`` and of ``flowlift --help``, this checkout beside another revision.

Each measurement is a fresh interpreter (``python -X importtime`` would only add noise), repeated and
interleaved with the baseline's so machine load hits both alike; the table gives the median wall time
and the ratio. The baseline is a git revision of this repository, checked out into a temporary worktree.

    PYTHONPATH=src python benchmarks/bench_import.py --baseline 15ecdd1 --repeats 15
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STATEMENTS = {
    "import flowlift": "import flowlift",
    "flowlift --help": "import sys; sys.argv = ['flowlift', '--help']\ntry:\n from flowlift.cli import main\n"
    "except ImportError:\n from flowlift.commands.cli import main\ntry:\n main()\nexcept SystemExit:\n pass",
}


def once(src: Path, code: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(src)}
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="HEAD~1", help="git revision to compare with (default HEAD~1)")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        base = Path(folder) / "baseline"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(base), args.baseline], check=True
        )
        try:
            print(f"| statement | {args.baseline} median s | this checkout median s | ratio |")
            print("|---|---|---|---|")
            for name, code in STATEMENTS.items():
                once(REPO / "src", code), once(base / "src", code)  # warm the file cache for both
                ours, theirs = [], []
                for _ in range(args.repeats):
                    theirs.append(once(base / "src", code))
                    ours.append(once(REPO / "src", code))
                a, b = statistics.median(theirs), statistics.median(ours)
                print(f"| `{name}` | {a:.3f} | {b:.3f} | {b / a:.2f}x |")
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=True)


if __name__ == "__main__":
    main()
