"""``flowlift status OUT``: the state of the job whose outputs are in folder OUT.

With a job manifest there (a ``torchrun`` job, :mod:`flowlift.jobs.manifest`) it is the manifest's
account: the latest run and the latest record of every output; without one (a plain run) it is what
the files show: done, partial, broken, missing (:mod:`flowlift.jobs.folder_status`; colorfix's references
are not missing inputs). Exit status 0 when the job is complete, 1 when it is not, 2 when OUT is not there or
is a report folder (``flowlift bands``, ``flowlift eval``), which holds no job's outputs.
"""

from __future__ import annotations

import argparse

from flowlift.commands._options import examples, name_or_path

#: It draws no progress: no ``--progress/--no-progress`` option (flowlift.console.add_console_options).
SHOWS_PROGRESS = False
NAME = "status"
HELP = "print the state of a batch job from its output folder (exit 0 when complete, else 1)"
EXAMPLES = examples(
    "flowlift status out/            # after `flowlift upscale photos/ -o out/`",
    "flowlift status /data/out       # a torchrun job: its manifest, from anywhere, at any time",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "folder",
        type=name_or_path,
        metavar="OUT",
        help="the output folder of an upscale or colorfix run (or a torchrun job); not a bands or eval report",
    )


def run(args: argparse.Namespace) -> int:
    from flowlift.jobs.folder_status import print_job_status

    return print_job_status(args.folder)
