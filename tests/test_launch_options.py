"""``flowlift launch`` with options torchrun cannot run and ranks stopped from outside (issue 32, class H).

Worker counts below 1 or past what the machine can start, port numbers past 65535 and rendezvous hosts that do
not resolve are one line and exit 2 before anything starts; a rendezvous the other nodes never join ends within
its join timeout (static and c10d backends; loopback only); a rank stopped by SIGTERM makes the job
"interrupted", exit 130, not a crash with a traceback. Under --max-restarts a rank stopped by SIGTERM,
SIGINT or SIGKILL, or the launcher stopped by SIGTERM or SIGINT, ends the whole run without a restart
(issue 29's "no restart or retry can hang"), with one line naming the signal, and every rank exits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from builders import save_tiny_unet
from conftest import shared_dir
from door_helpers import cpu_upscale_options
from flowlift.commands.cli import main

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ("--nproc-per-node 0", "--nproc-per-node must be at least 1, got 0"),
        ("--nproc-per-node -1", "--nproc-per-node must be at least 1, got -1"),
        ("--nproc-per-node 100000", "--nproc-per-node 100000 is more processes than this machine can start"),
        ("--master-port 99999", "--master-port must be a port number from 1 to 65535, got 99999"),
        ("--nnodes 2 --rdzv-endpoint 127.0.0.1:99999", "port number of the rendezvous endpoint"),
        (
            "--nnodes 2 --rdzv-endpoint nonexistent.invalid:29400",
            "the rendezvous host nonexistent.invalid does not resolve",
        ),
    ],
)
def test_options_torchrun_cannot_run_are_one_line(capsys, options, message):
    assert main(["launch", *options.split(), "--", "upscale", "a.png"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("flowlift launch: error: launcher options: ") and message in err[0], err


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (["--set", "lr=5"], "--set lr=5: lr must be in (0, 1], got '5'"),
        (["--set", "weight_decay=100", "--lr", "0.5"], "lr x weight_decay must be below 1"),
        (["--config", "{file}"], "{file}: lr must be in (0, 1], got -1"),
    ],
)
def test_a_refused_training_setting_is_one_line_before_any_rank_starts(
    tmp_path, capsys, monkeypatch, settings, message
):
    import flowlift.jobs.launch

    config = tmp_path / "run.json"
    config.write_text('{"lr": -1}')
    monkeypatch.setattr(flowlift.jobs.launch, "launch", lambda *a, **k: pytest.fail("a rank was started"))
    settings = [item.format(file=config) for item in settings]
    command = ["train", "--data", str(tmp_path / "d"), "--output", str(tmp_path / "o"), *settings]
    assert main(["launch", "--nproc-per-node", "2", "--", *command]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("flowlift launch: error: ") and message.format(file=config) in err[0]
    assert not (tmp_path / "o").exists()


def _launch_that_nobody_joins(join_timeout: int, *options: str) -> list[str]:
    """``flowlift launch`` of ``upscale a.png`` as one of 2 nodes at a rendezvous on a free loopback port, with
    ``join_timeout`` and ``options``: the other node never comes."""
    rendezvous = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", *options]
    rendezvous += ["--rdzv-conf", f"join_timeout={join_timeout}"]
    return [sys.executable, "-m", "flowlift", "launch", *rendezvous, "--", "upscale", "a.png"]


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_a_rendezvous_nobody_joins_ends_within_its_join_timeout(tmp_path, backend):
    join_timeout = 3
    argv = _launch_that_nobody_joins(join_timeout, "--rdzv-backend", backend, "--rdzv-id", uuid.uuid4().hex)
    process = subprocess.Popen(argv, env=_env(), cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    _, err = process.communicate(timeout=120)
    lines = err.splitlines()
    assert process.returncode == 2 and len(lines) == 1, err
    assert lines[0].startswith("flowlift launch: error: the ranks could not meet: "), err


def _launch_time(tmp_path: Path) -> float:
    """Seconds from start to the refusal of a launch that imports torch and refuses at once (the baseline)."""
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "flowlift", "launch", "--nproc-per-node", "0", "--", "upscale", "a"],
        env=_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    return time.monotonic() - start


def test_the_join_timeout_bounds_the_wait(tmp_path):
    """The wait past the start-up a refused launch costs too follows the join timeout (4 s plus the static
    store's own poll), not torchrun's 900 s. The bound is generous on purpose: a loaded machine stretches
    the start-up of both runs unevenly, and only the order of magnitude tells the two behaviours apart."""
    baseline = _launch_time(tmp_path)
    start = time.monotonic()
    run = subprocess.run(
        _launch_that_nobody_joins(4),
        env=_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    waited = time.monotonic() - start - baseline
    assert run.returncode == 2 and "the ranks could not meet" in run.stderr, run.stderr
    assert waited < 4 + 90, (waited, baseline)


def _started_ranks(process: subprocess.Popen, first: list[Path]) -> list[int]:
    """The pids the two ranks wrote to ``first`` once both started (the launcher still running meanwhile)."""
    deadline = time.monotonic() + 120
    while not all(path.is_file() and path.read_text() for path in first):
        assert process.poll() is None and time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.2)
    return [int(path.read_text()) for path in first]


def _start_script_on_two_ranks(
    script: Path, folder: Path, tmp_path: Path, *options: str, stderr: Any = subprocess.PIPE
) -> subprocess.Popen:
    """``python SCRIPT FOLDER`` (a launcher) started in ``tmp_path`` on one node of 2 ranks meeting at a c10d
    rendezvous on a free loopback port under a fresh id, then ``options``; its stderr piped (or to ``stderr``)."""
    rendezvous = ["--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d"]
    rendezvous += ["--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", uuid.uuid4().hex]
    return subprocess.Popen(
        [sys.executable, str(script), str(folder), *rendezvous, *options],
        env=_env(),
        cwd=tmp_path,
        stderr=stderr,
        text=True,
    )


def _run_script_on_two_ranks(
    script: Path, folder: Path, tmp_path: Path, *options: str, timeout: float
) -> tuple[int, str]:
    """:func:`_start_script_on_two_ranks` run to its end (killed past ``timeout``): its exit status and stderr."""
    process = _start_script_on_two_ranks(script, folder, tmp_path, *options)
    try:
        _, err = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
    return process.returncode, err


def test_sigterm_to_one_rank_is_an_interrupted_job_not_a_crash(tmp_path):
    script = tmp_path / "stoppable.py"
    script.write_text(STOPPABLE)
    pids = tmp_path / "pids"
    pids.mkdir()
    process = _start_script_on_two_ranks(script, pids, tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not all((pids / f"{rank}.0").is_file() and (pids / f"{rank}.0").read_text() for rank in "01"):
            assert process.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        os.kill(int((pids / "0.0").read_text()), signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, err
    assert "Traceback" not in err and "crashed" not in err and "exitcode" not in err, err
    assert [line for line in err.splitlines() if line.startswith("flowlift launch")] == [
        "flowlift launch: interrupted (rank 0 stopped by SIGTERM)"
    ] or "flowlift launch: interrupted (rank 0 stopped by SIGTERM, rank 1 stopped by SIGTERM)" in err, err


STOPPABLE = """
import os
import sys
import time
from pathlib import Path

from flowlift.jobs.launch import launch


def worker(argv):
    # flowlift's own rank (commands.launch.run_worker) running a command that works until it is stopped,
    # under the command line's signal handling (SIGTERM -> KeyboardInterrupt -> "interrupted", 130); each
    # start of a rank leaves RANK.RESTART (its pid): a restart would show
    import flowlift.commands.cli as cli
    from flowlift.commands.launch import run_worker

    def command(args):
        with cli._signals_interrupt():
            try:
                start = Path(args[0], f"{os.environ['RANK']}.{os.environ['TORCHELASTIC_RESTART_COUNT']}")
                start.write_text(str(os.getpid()))
                time.sleep(300)
                return 0
            except KeyboardInterrupt:
                print("flowlift test: interrupted", file=sys.stderr)
                return 130

    cli.main = command
    return run_worker(argv)


if __name__ == "__main__":
    sys.exit(launch(worker, [sys.argv[1]], sys.argv[2:], command="flowlift launch"))
"""


def _gone(pids: list[int], grace_s: float = 15.0) -> list[int]:
    """The pids among ``pids`` still running (not a zombie) after up to ``grace_s``."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state != "Z":
                alive.append(pid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


@pytest.mark.parametrize(
    ("target", "signum", "line"),
    [
        ("rank 0", signal.SIGTERM, "flowlift launch: interrupted (rank 0 stopped by SIGTERM)"),
        ("rank 1", signal.SIGINT, "flowlift launch: interrupted (rank 1 stopped by SIGINT)"),
        # a rank's command stops for SIGHUP too and exits 129: that was a crash to the launcher, restarted
        ("rank 1", signal.SIGHUP, "flowlift launch: interrupted (rank 1 stopped by SIGHUP)"),
        ("rank 1", signal.SIGKILL, "flowlift launch: interrupted (rank 1 killed by SIGKILL)"),
        ("launcher", signal.SIGTERM, "flowlift launch: interrupted by SIGTERM"),
        ("launcher", signal.SIGINT, "flowlift launch: interrupted by SIGINT"),
    ],
)
def test_a_signal_stops_the_whole_run_and_is_never_restarted(tmp_path, target, signum, line):
    """`--max-restarts` is for crashes: a rank stopped by SIGTERM/SIGINT/SIGHUP/SIGKILL from outside, or the launcher
    stopped by a user, ends the run (exit 130, one line naming the signal), and every process exits."""
    script = tmp_path / "stoppable.py"
    script.write_text(STOPPABLE)
    starts = tmp_path / "starts"
    starts.mkdir()
    process = _start_script_on_two_ranks(script, starts, tmp_path, "--max-restarts", "2")
    first = [starts / "0.0", starts / "1.0"]
    try:
        ranks = _started_ranks(process, first)
        victim = process.pid if target == "launcher" else ranks[int(target.split()[1])]
        os.kill(victim, signum)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, err
    assert sorted(path.name for path in starts.iterdir()) == ["0.0", "1.0"], err  # no rank started again
    ours = [text for text in err.splitlines() if text.startswith("flowlift launch")]
    assert ours == [line], err
    assert "Traceback" not in err and "crashed" not in err, err
    assert _gone(ranks) == [], err


# ---------------------------------------------------- issue 36, class 9: checked up front, ended as documented


@pytest.mark.parametrize("key", ["join_timeout", "last_call_timeout", "close_timeout", "timeout", "read_timeout"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "x", "1e12", "5.5", str(10**12), "inf", "2592001"])
def test_rdzv_conf_waits_outside_their_domain_are_one_line(capsys, key, value):
    assert main(["launch", "--rdzv-conf", f"{key}={value}", "--", "upscale", "a.png"]) == 2
    err = capsys.readouterr().err.splitlines()
    expected = f"flowlift launch: error: launcher options: --rdzv-conf {key} must be"
    assert len(err) == 1 and err[0].startswith(expected), err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--rdzv-conf", "keep_alive_max_attempt=0"], "--rdzv-conf keep_alive_max_attempt must be"),
        (["--rdzv-conf", "is_host=maybe"], "--rdzv-conf is_host must be one of"),
        (["--node-rank", "-1"], "--node-rank must be from 0 to 0"),
        (
            ["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:29400"],
            "--node-rank must be from 0 to 1",
        ),
        (
            ["--nnodes", "1:3", "--node-rank", "-5", "--rdzv-endpoint", "127.0.0.1:29400"],
            "--node-rank must be from 0 to 2",
        ),
    ],
)
def test_other_launcher_values_torch_would_fail_on_late_are_one_line(capsys, options, message):
    assert main(["launch", *options, "--", "upscale", "a.png"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and message in err[0], err


ENDPOINT_NEEDED = "runs on several machines: give --rdzv-endpoint HOST:PORT"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ("--nnodes abc", "--nnodes must be a number of machines N or a range MIN:MAX (e.g. 2 or 1:4), got 'abc'"),
        ("--nnodes 1:2:3", "--nnodes must be a number of machines N or a range MIN:MAX"),
        ("--nnodes -1", "--nnodes must be a number of machines N or a range MIN:MAX"),
        ("--nnodes 0", "--nnodes must be at least 1 machine, got 0"),  # not a --node-rank range of 0 to -1
        ("--nnodes 0:2", "--nnodes must be at least 1 machine, got 0:2"),
        ("--nnodes 2:1", "--nnodes MIN:MAX must have MIN at most MAX, got 2:1 (e.g. 1:2)"),
        ("--max-restarts -1", "--max-restarts must be 0 (no restart) or more, got -1"),
        # several machines and no address to meet at: torchrun's default is this machine's own, and it waits
        ("--nnodes 2", f"--nnodes 2 {ENDPOINT_NEEDED}"),
        ("--nnodes 1:2 --rdzv-backend c10d", f"--nnodes 1:2 {ENDPOINT_NEEDED}"),
        ("--rdzv-backend bogus --nnodes 2", f"--nnodes 2 {ENDPOINT_NEEDED}"),  # not "the rendezvous host  does not"
        ("--nnodes 2 --master-port 29511", f"--nnodes 2 {ENDPOINT_NEEDED}"),
    ],
)
def test_launcher_counts_and_a_missing_endpoint_are_checked_by_flowlift(capsys, options, message):
    """issue: torch's words came through (int()'s ValueError, min_nodes/max_restarts), and a run on several
    machines without --rdzv-endpoint waited for them (or named an empty host)."""
    assert main(["launch", *options.split(), "--", "upscale", "a.png"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("flowlift launch: error: launcher options: ") and message in err[0], err
    assert not any(word in err[0] for word in ("int()", "min_nodes", "max_restarts", "host  ")), err


def test_several_machines_may_meet_at_the_static_master_address():
    from flowlift.jobs.launch_options import launch_config

    config = launch_config(["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "29511"])
    assert (config.min_nodes, config.max_nodes, config.rdzv_backend) == (2, 2, "static")


def test_good_rdzv_conf_values_are_normalised_and_kept():
    from flowlift.jobs.launch_options import launch_config

    config = launch_config(
        [
            "--nnodes",
            "2",
            "--rdzv-endpoint",
            "127.0.0.1:29400",
            "--rdzv-conf",
            "join_timeout=+7,is_host=YES,store_type=tcp",
            "--node-rank",
            "1",
        ]
    )
    assert config.rdzv_configs["join_timeout"] == "7" and config.rdzv_configs["is_host"] == "yes"
    assert config.rdzv_configs["store_type"] == "tcp"  # a key flowlift knows nothing of is passed on


def _ranks_of(launcher: int) -> list[int]:
    """The pids of the launcher's spawned ranks (not multiprocessing's resource tracker)."""
    found = []
    for task in Path(f"/proc/{launcher}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                line = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "spawn_main" in line and "resource_tracker" not in line:
                found.append(int(child))
    return sorted(found)


@pytest.fixture(scope="module")
def tiny_upscale(tmp_path_factory):
    """An upscale command line with a tiny random Flow Upscaler and one small image (output folder last)."""
    import torch
    from PIL import Image

    folder = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    weights = save_tiny_unet(folder / "w.safetensors", seed=None)
    Image.new("RGB", (64, 48), (90, 40, 20)).save(folder / "a.png")
    return [
        "upscale",
        str(folder / "a.png"),
        *cpu_upscale_options(shared_dir(), weights),  # shared_dir(): $FLOWLIFT_SHARED, else ../shared
        "--barrier-timeout",
        "4",
        "-o",
    ]


def _launch_and_signal(tmp_path, command, signum, delay_s, rank=0):
    """``flowlift launch --nproc-per-node 2 -- COMMAND``; ``signum`` to one rank ``delay_s`` after it appeared.

    Returns (exit status, stderr, the ranks' pids)."""
    argv = [sys.executable, "-m", "flowlift", "launch", "--nproc-per-node", "2", "--", *command, str(tmp_path / "o")]
    process = subprocess.Popen(argv, env=_env(), cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        ranks: list[int] = []
        while len(ranks) < 2:
            assert process.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            try:
                ranks = _ranks_of(process.pid)
            except OSError:
                ranks = []
            time.sleep(0.01)
        time.sleep(delay_s)
        os.kill(ranks[rank], signum)
        _, err = process.communicate(timeout=150)
    finally:
        if process.poll() is None:
            process.kill()
    return process.returncode, err, ranks


@pytest.mark.parametrize("delay_s", [0.0, 0.5, 1.5])
def test_sigint_to_a_rank_still_starting_is_interrupted_without_a_traceback(tmp_path, tiny_upscale, delay_s):
    """Ranks start with SIGINT blocked and take it once flowlift's entry runs: no KeyboardInterrupt traceback
    from inside Python's start-up or torch's import (or a "Fatal Python error", a crash to the agent)."""
    code, err, ranks = _launch_and_signal(tmp_path, tiny_upscale, signal.SIGINT, delay_s)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "crashed" not in err, err
    assert _gone(ranks) == [], err
    launch_lines = [line for line in err.splitlines() if line.startswith("flowlift launch")]
    if "ranks: 1 done, 0 skipped, 0 failed" in err:  # the tiny job had ended before the signal came: its
        # image stands whole; the late SIGINT is either ignored (the worker had returned: 0, nothing said) or
        # stops the rank's teardown (130, said in one line) - never a traceback, never a status its lines deny
        with Image.open(tmp_path / "o" / "a_x2.png") as written:
            written.load()
        assert code in (0, 130), err
        interrupted = [line for line in launch_lines if "interrupted" in line]
        assert interrupted == ([] if code == 0 else ["flowlift launch: interrupted (rank 0 stopped by SIGINT)"]), err
        return
    assert code == 130, err
    assert launch_lines == ["flowlift launch: interrupted (rank 0 stopped by SIGINT)"], err


def test_a_rank_suspended_by_sigstop_ends_as_a_missed_barrier(tmp_path, tiny_upscale):
    """The ranks that waited say "no summary" (their --barrier-timeout) and the launcher ends the suspended one:
    exit 1 as docs/distributed.md says, not "rank 0 crashed (DistStoreError ...)" exit 3, and no hang."""
    code, err, ranks = _launch_and_signal(tmp_path, tiny_upscale, signal.SIGSTOP, 0.5, rank=1)
    try:
        assert code == 1, err
        assert "Traceback" not in err and "crashed" not in err and "DistStoreError" not in err.split("(waited")[0], err
        ours = [line for line in err.splitlines() if line.startswith("flowlift")]
        assert any(line.startswith("flowlift upscale: error: no summary: not every rank reached") for line in ours), err
        assert ours[-1].startswith("flowlift launch: rank 1 stayed suspended (SIGSTOP)"), err
        assert _gone(ranks) == [], err
    finally:
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


AT_THE_BARRIER = """
import os
import sys
import time
from pathlib import Path

from flowlift.jobs.launch import launch


def worker(argv):
    # both ranks join the group; rank 1 then says it is ready and idles (the test suspends it), rank 0 goes
    # to the end barrier, whose timeout it reports as the job's outcome (what scaleout._finish does)
    from flowlift.jobs.distributed import DistEnv, finish, process_group

    env = DistEnv.from_environ()
    with process_group(env, 60):
        if env.rank == 1:
            Path(argv[0], "ready").write_text(str(os.getpid()))
            time.sleep(120)
        while not Path(argv[0], "suspended").exists():
            time.sleep(0.1)
        per_rank, reason = finish(env, {"done": 1}, 3)
        print(f"rank {env.rank}: {per_rank} | {reason}", file=sys.stderr)
        return 1 if per_rank is None else 0


if __name__ == "__main__":
    sys.exit(launch(worker, [sys.argv[1]], sys.argv[2:], command="flowlift launch"))
"""


def test_a_rank_suspended_before_the_end_barrier_ends_the_run_with_exit_1(tmp_path):
    script = tmp_path / "barrier.py"
    script.write_text(AT_THE_BARRIER)
    process = _start_script_on_two_ranks(script, tmp_path, tmp_path, "--max-restarts", "2")
    ready, victim = tmp_path / "ready", None
    try:
        deadline = time.monotonic() + 120
        while not (ready.is_file() and ready.read_text()):
            assert process.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.1)
        victim = int(ready.read_text())
        os.kill(victim, signal.SIGSTOP)
        (tmp_path / "suspended").write_text("")
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
        if victim is not None and _gone([victim], 0):
            os.kill(victim, signal.SIGKILL)
    assert process.returncode == 1, err
    assert any(line.startswith("rank 0: None | ") for line in err.splitlines()), err
    assert "flowlift launch: rank 1 stayed suspended (SIGSTOP) after the other ranks ended" in err, err
    assert "Traceback" not in err and "crashed" not in err, err
    assert _gone([victim]) == [], err


def test_the_agent_kills_ranks_that_ignore_a_stop_within_its_grace_not_torchs_30_s():
    """A rank blocked inside a C++ collective takes SIGTERM only when the call returns: torch's agent then waits
    30 s before its SIGKILL. flowlift's agent waits STOP_GRACE_S, whatever timeout torch passes."""
    import signal as signals

    from flowlift.jobs.launch import STOP_GRACE_S, _stop_aware_agent

    closed = []

    class Base:
        _worker_watchdog = _health_check_server = None

        def _shutdown(self, death_sig=signals.SIGTERM, timeout=30):
            closed.append((death_sig, timeout))

    agent = _stop_aware_agent(Base, {})()
    agent._shutdown()
    agent._shutdown(signals.SIGKILL, 300)
    agent._shutdown(signals.SIGTERM, 2)
    assert closed == [(signals.SIGTERM, STOP_GRACE_S), (signals.SIGKILL, STOP_GRACE_S), (signals.SIGTERM, 2)]
    assert STOP_GRACE_S <= 10


ONE_RANK_REFUSES = """
import os
import sys
from pathlib import Path

from flowlift.jobs.launch import launch


def worker(argv):
    # rank 0 meets a user error only it can see and returns 2 with its group still open (torch's worker wrapper
    # then keeps its process, and so its connections, alive); rank 1 goes on to its next collective, where it
    # would wait for rank 0 for the barrier's whole timeout
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    Path(argv[0], f"rank{rank}").write_text(str(os.getpid()))
    if rank == 0:
        print("flowlift train: error: only rank 0 met this", file=sys.stderr)
        return 2
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(launch(worker, [sys.argv[1]], sys.argv[2:], command="flowlift launch"))
"""


def test_ranks_left_waiting_for_a_rank_that_stopped_the_job_are_ended():
    """Under flowlift launch a rank returning a user error alone left the others in their barrier for gloo's 30
    minutes (its process waits in torch's worker wrapper, so their collective never fails): they are ended
    LEFT_BEHIND_GRACE_S later, and the launcher exits with the error's status."""
    import tempfile

    from flowlift.jobs.launch import LEFT_BEHIND_GRACE_S

    with tempfile.TemporaryDirectory() as folder:
        tmp_path = Path(folder)
        script = tmp_path / "refuses.py"
        script.write_text(ONE_RANK_REFUSES)
        code, err = _run_script_on_two_ranks(script, tmp_path, tmp_path, timeout=LEFT_BEHIND_GRACE_S + 110)
        pids = [int((tmp_path / f"rank{rank}").read_text()) for rank in (0, 1) if (tmp_path / f"rank{rank}").exists()]
    assert code == 2, err
    assert "only rank 0 met this" in err and "flowlift launch: rank 1 ended" in err and "exit status 2" in err, err
    assert "Traceback" not in err and "crashed" not in err, err
    assert _gone(pids) == [], err


DEAF = """
import os
import signal
import sys
import time
from pathlib import Path

from flowlift.jobs.launch import launch


def worker(argv):
    # a rank deaf to SIGTERM and SIGINT, as one blocked inside a C++ collective is: only the agent's SIGKILL
    # after its grace ends it; each start leaves RANK.RESTART (its pid)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    Path(argv[0], f"{os.environ['RANK']}.{os.environ['TORCHELASTIC_RESTART_COUNT']}").write_text(str(os.getpid()))
    time.sleep(300)
    return 0


if __name__ == "__main__":
    sys.exit(launch(worker, [sys.argv[1]], sys.argv[2:], command="flowlift launch"))
"""


def test_a_burst_of_stop_signals_to_the_launcher_is_one_line_130_and_no_rank_left(tmp_path):
    """SIGINT, then SIGTERM every 20 ms until the launcher has exited (a user's Ctrl-C, then a scheduler insisting).
    torch's handler raised SignalException again for each: out of the agent's shutdown (no SIGKILL after the grace,
    both ranks left running), from an exit callback (a traceback, and SIGTERM's 143), with the line naming the last
    signal. The first is the run's: one line naming it, 130, ranks that ignore SIGTERM killed after the grace."""
    script = tmp_path / "deaf.py"
    script.write_text(DEAF)
    starts = tmp_path / "starts"
    starts.mkdir()
    log = tmp_path / "stderr.txt"  # not a pipe: a rank left running would hold it open
    with log.open("w") as stderr:
        process = _start_script_on_two_ranks(script, starts, tmp_path, "--max-restarts", "2", stderr=stderr)
    first = [starts / "0.0", starts / "1.0"]
    try:
        ranks = _started_ranks(process, first)
        os.kill(process.pid, signal.SIGINT)
        deadline = time.monotonic() + 60
        while process.poll() is None and time.monotonic() < deadline:
            os.kill(process.pid, signal.SIGTERM)
            time.sleep(0.02)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
    err = log.read_text()
    leftover = _gone(ranks, grace_s=5)
    for pid in leftover:
        os.kill(pid, signal.SIGKILL)
    assert process.returncode == 130, err
    assert [text for text in err.splitlines() if text.startswith("flowlift launch")] == [
        "flowlift launch: interrupted by SIGINT"
    ], err
    assert "Traceback" not in err and "SignalException" not in err and "crashed" not in err, err
    assert leftover == [], err
    assert sorted(path.name for path in starts.iterdir()) == ["0.0", "1.0"], err  # no restart, nothing partial


BLOCKED_JOINING = """
import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist

import flowlift.jobs.group_start
from flowlift.errors import FlowliftError
from flowlift.jobs.launch import launch

JOIN = dist.init_process_group


def blocked_in_gloo(*args, **kwargs):
    # gloo's connectFullMesh after a restart: a wait in C++ that neither its timeout nor SIGTERM/SIGINT ends
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    time.sleep(300)


def worker(argv):
    from flowlift.jobs.distributed import DistEnv, process_group

    env = DistEnv.from_environ()
    Path(argv[0], f"{env.rank}.{os.environ['TORCHELASTIC_RESTART_COUNT']}").write_text(str(os.getpid()))
    dist.init_process_group = blocked_in_gloo if env.rank == 1 else JOIN
    try:
        with process_group(env, 3):
            return 0
    except FlowliftError as error:  # rank 0: its own timeout ends its wait for rank 1 (what the commands print)
        print(f"flowlift upscale: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    flowlift.jobs.group_start.JOIN_GRACE_S = 1.0
    sys.exit(launch(worker, [sys.argv[1]], sys.argv[2:], command="flowlift launch"))
"""


def test_a_rank_blocked_joining_its_group_past_the_barrier_timeout_is_ended_not_waited_for(tmp_path):
    """A restarted group's rank can block in gloo's connection set-up for good (pytorch#167288): the agent ends it
    JOIN_GRACE_S after its --barrier-timeout, the launcher exits 1 with one line and restarts nothing."""
    script = tmp_path / "blocked.py"
    script.write_text(BLOCKED_JOINING)
    starts = tmp_path / "starts"
    starts.mkdir()
    code, err = _run_script_on_two_ranks(script, starts, tmp_path, "--max-restarts", "2", timeout=90)
    ranks = [int(path.read_text()) for path in starts.iterdir()]
    assert code == 1, err
    assert sorted(path.name for path in starts.iterdir()) == ["0.0", "1.0"], err  # no restart
    ours = [line for line in err.splitlines() if line.startswith("flowlift")]
    assert ours[0].startswith("flowlift upscale: error: no summary: not every rank reached the start"), err
    assert ours[-1].startswith(
        "flowlift launch: rank 1 could not join the process group within its --barrier-timeout (3 s) and was ended"
    ), err
    assert "Traceback" not in err and "crashed" not in err and "interrupted" not in err, err
    assert _gone(ranks) == [], err


def test_a_joining_rank_leaves_its_deadline_for_the_agent_only_under_flowlift_launch(tmp_path, monkeypatch):
    from flowlift.jobs.group_start import GROUP_START_DIR_ENV, JOIN_GRACE_S, joining, overdue_joins, watched_starts

    monkeypatch.delenv(GROUP_START_DIR_ENV, raising=False)
    with joining(5):  # plain torchrun: no directory named, nothing written
        pass
    with watched_starts() as directory:
        assert os.environ[GROUP_START_DIR_ENV] == directory
        before = time.monotonic()
        with joining(5):
            assert os.listdir(directory) == [f"{os.getpid()}.joining"]
            late = before + 5 + JOIN_GRACE_S + 1
            assert overdue_joins(directory, [os.getpid(), 1], now=late) == {os.getpid(): 5.0}
            assert overdue_joins(directory, [os.getpid()], now=before + 5) == {}
        assert os.listdir(directory) == [] and overdue_joins(directory, [os.getpid()], now=late) == {}
    assert GROUP_START_DIR_ENV not in os.environ and not Path(directory).exists()


RESTARTED_LATE = """
import os
import signal
import sys
import time

import torch.distributed as dist

from flowlift.errors import FlowliftError
from flowlift.jobs.launch import launch


def worker(argv):
    # start 0: both ranks join and meet, then rank 1 crashes (SIGSEGV: the group is restarted); start 1: rank 1
    # joins 5 s late, so rank 0 finds in the agent's store whatever rank 1's address is by then
    from flowlift.jobs.distributed import DistEnv, process_group

    env = DistEnv.from_environ()
    start = os.environ["TORCHELASTIC_RESTART_COUNT"]
    if start == "1" and env.rank == 1:
        time.sleep(5)
    try:
        with process_group(env, 20):
            dist.barrier()
            if start == "0" and env.rank == 1:
                os.kill(os.getpid(), signal.SIGSEGV)
            if start == "0":
                time.sleep(60)  # rank 0 waits for the agent to restart the group
            return 0
    except FlowliftError as error:
        print(f"flowlift upscale: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(launch(worker, [sys.argv[1]], sys.argv[2:], command="flowlift launch"))
"""


def test_a_restarted_group_meets_on_its_own_start_not_the_crashed_ones_addresses(tmp_path):
    """torch names a group's keys the same in every start of an elastic run, in the agent's one store: a restarted
    rank read the crashed rank's address from the start before and failed (or blocked) connecting to it. Each
    start's keys are its own (flowlift.jobs.group_start.join_group), so the restart after the crash meets."""
    script = tmp_path / "late.py"
    script.write_text(RESTARTED_LATE)
    code, err = _run_script_on_two_ranks(script, tmp_path, tmp_path, "--max-restarts", "1", timeout=150)
    assert code == 0, err
    assert "not every rank reached the start" not in err and "could not join" not in err, err


def test_each_start_of_an_elastic_run_keeps_its_group_keys_apart(monkeypatch):
    import datetime

    import torch.distributed as dist

    from flowlift.jobs.group_start import join_group

    agents_store, joined = dist.HashStore(), {}

    def rendezvous(url, timeout):
        assert url == "env://" and timeout == datetime.timedelta(seconds=7)
        yield agents_store, 1, 2

    def init_process_group(backend, store, rank, world_size, timeout):
        joined.update(backend=backend, rank=rank, world_size=world_size, timeout=timeout)
        store.set("0//cpu//0/1", "rank 1's address")

    monkeypatch.setattr(dist, "rendezvous", rendezvous)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    for start in ("0", "1"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", start)
        join_group("gloo", datetime.timedelta(seconds=7))
    assert joined == {"backend": "gloo", "rank": 1, "world_size": 2, "timeout": datetime.timedelta(seconds=7)}
    for start in ("0", "1"):
        assert agents_store.check([f"flowlift/start-{start}/default_pg/0//cpu//0/1"])
    assert not agents_store.check(["default_pg/0//cpu//0/1"])
