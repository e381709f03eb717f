"""Scale-out under torchrun: sharding, the manifest, the status, and a sharded ``eval --run`` (gloo, loopback).

The torchrun runs start ``python -m torch.distributed.run`` with this checkout's ``src`` first on
``PYTHONPATH``, a fresh rendezvous port on 127.0.0.1 and single-threaded workers.
"""

from __future__ import annotations

import io
import json
import os
import random
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import torch
from PIL import Image

from builders import save_tiny_unet
from door_helpers import cpu_upscale_options
from flowlift.errors import FlowliftError
from flowlift.jobs.distributed import DistEnv, image_pixels, probe_and_gather, rank_device, shard_by_pixels
from flowlift.jobs.manifest import MANIFEST_NAME, Manifest, format_status, image_record, job_status, latest_by_output

REPO = Path(__file__).resolve().parents[1]

#: What the replace rule says of a folder where the manifest goes (files/atomic.py).
FOLDER_AT_MANIFEST = "exists and is a folder, not a file flowlift wrote; remove it or choose another output"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous_options(nproc: int) -> list[str]:
    """One host, rendezvous on a free 127.0.0.1 port (the multi-host form of the options)."""
    return [
        "--nnodes",
        "1",
        "--nproc_per_node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-id",
        uuid.uuid4().hex,
    ]


def torchrun_command(
    nproc: int, *cli_args: str, program: tuple[str, ...] = ("-m", "flowlift", "--"), options: tuple[str, ...] = ()
) -> list[str]:
    """``torchrun`` with :func:`rendezvous_options` and ``options``, then the program.

    ``--`` ends torchrun's options: it would take eval's ``--run`` as an abbreviation of its ``--run-path``.
    """
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous_options(nproc), *options, *program, *cli_args]


def worker_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")


def run_in_worker_env(command: list[str], *, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """``command`` run to its end under :func:`worker_env` in ``cwd``, its output captured as text."""
    return subprocess.run(command, env=worker_env(), capture_output=True, text=True, timeout=timeout, cwd=cwd)


def run_torchrun(
    nproc: int, *cli_args: str, cwd: Path, timeout: float = 120, options: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    return run_in_worker_env(torchrun_command(nproc, *cli_args, options=options), cwd=cwd, timeout=timeout)


def processes_naming(marker: str, grace_s: float = 10.0) -> list[str]:
    """Command lines of live processes that contain ``marker`` (e.g. a test's output folder), after
    waiting up to ``grace_s`` for them to go: torchrun's workers run in sessions of their own, so
    "torchrun returned" alone does not prove that every rank exited."""
    import time

    deadline = time.monotonic() + grace_s
    while True:
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                if marker in line:
                    found.append(line)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


# --------------------------------------------------------------------------------------------------
# pure parts


def test_shard_by_pixels_balances_and_covers_everything_once():
    rng = random.Random(0)
    for world in (1, 2, 3, 5, 8):
        for n in (0, 1, 7, 40):
            pixels = [rng.choice([0, 64 * 64, 512 * 384, 4096 * 3072]) for _ in range(n)]
            shards = shard_by_pixels(pixels, world)
            assert len(shards) == world
            flat = sorted(i for s in shards for i in s)
            assert flat == list(range(n))  # each item exactly once
            assert all(s == sorted(s) for s in shards)
            loads = [sum(pixels[i] for i in s) for s in shards]
            if n:
                assert max(loads) <= sum(pixels) / world + max(pixels)  # Graham's LPT bound
            assert shards == shard_by_pixels(list(pixels), world)  # deterministic
    # by pixels, not by file count: one huge image against many small ones
    shards = shard_by_pixels([100, 1, 1, 1, 1, 1], 2)
    assert shards == [[0], [1, 2, 3, 4, 5]]
    # equal costs go round-robin in input order
    assert shard_by_pixels([5, 5, 5, 5], 2) == [[0, 2], [1, 3]]
    with pytest.raises(ValueError):
        shard_by_pixels([1], 0)


def test_dist_env_and_rank_device():
    assert DistEnv.from_environ({}) == DistEnv(0, 1, 0)
    env = DistEnv.from_environ({"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1"})
    assert (env.rank, env.world_size, env.local_rank, env.distributed, env.is_main) == (5, 16, 1, True, False)
    with pytest.raises(FlowliftError):
        DistEnv.from_environ({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(FlowliftError):
        DistEnv.from_environ({"WORLD_SIZE": "two"})
    single, ranked = DistEnv(), DistEnv(5, 16, 1)
    assert rank_device(None, single, cuda_available=False) == "cpu"
    assert rank_device(None, ranked, cuda_available=True, bind=False) == "cuda:1"
    assert rank_device("cuda:0", ranked, cuda_available=True, bind=False) == "cuda:1"  # one GPU per local rank
    assert rank_device("cuda:3", single, cuda_available=True) == "cuda:3"  # one process: as given
    assert rank_device("cpu", ranked, cuda_available=True) == "cpu"
    with pytest.raises(FlowliftError):
        rank_device("cuda", ranked, cuda_available=False)


def test_image_pixels_reads_headers_and_zero_for_unreadable(tmp_path):
    Image.new("RGB", (30, 20)).save(tmp_path / "a.png")
    (tmp_path / "bad.png").write_bytes(b"not an image")
    assert image_pixels(tmp_path / "a.png") == 600
    assert image_pixels(tmp_path / "bad.png") == 0
    assert image_pixels(tmp_path / "missing.png") == 0
    assert probe_and_gather(DistEnv(), ["x", "yy"], len) == [1, 2]


def test_manifest_concurrent_appends_stay_whole_lines(tmp_path):
    manifest = Manifest(tmp_path)
    env = DistEnv(1, 2, 1)

    def writer(k: int) -> None:
        for i in range(100):
            manifest.write_record(
                image_record(
                    input_path=f"in/{k}-{i}.png",
                    input_sha256="0" * 64,
                    output=f"out/{k}-{i}.png",
                    status="done",
                    seconds=0.5,
                    error=None,
                    env=env,
                    run="r",
                )
            )

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with open(tmp_path / MANIFEST_NAME, "ab") as f:
        f.write(b'{"event": "image", "output": "torn')  # a writer killed mid-line
    records = manifest.records()
    assert len(records) == 400
    assert len(latest_by_output(records)) == 400
    assert {r["rank"] for r in records} == {1}
    with pytest.raises(ValueError):
        image_record(
            input_path="a", input_sha256=None, output=None, status="ok", seconds=0, error=None, env=env, run="r"
        )


def record_of(input_path, output, status, run, error=None, seconds=1.0) -> dict:
    """One ``image`` record of a single-process run (the keyword fields the status tests leave alone fixed)."""
    return image_record(
        input_path=input_path,
        input_sha256=None,
        output=output,
        status=status,
        seconds=seconds,
        error=error,
        env=DistEnv(),
        run=run,
    )


def whole_image(path: Path) -> None:
    Image.new("RGB", (4, 4), (10, 20, 30)).save(path)


def test_job_status_counts_latest_records(tmp_path):
    with pytest.raises(FlowliftError, match="no job manifest"):
        job_status(tmp_path)
    manifest = Manifest(tmp_path)
    whole_image(tmp_path / "a_x2.png")
    whole_image(tmp_path / "b_x2.png")

    def image(name, status, run, error=None):
        manifest.write_record(record_of(tmp_path / f"{name}.png", tmp_path / f"{name}_x2.png", status, run, error))

    manifest.write_record({"event": "job", "run": "r1", "inputs": 4, "todo": 4, "skipped": 0, "world_size": 2})
    image("a", "done", "r1")
    (tmp_path / "c.png").write_bytes(b"x")  # the failed input is still there: a rerun must redo it
    image("c", "failed", "r1", "c.png: truncated")
    image("d", "done", "r1")  # d's output is gone since
    whole_image(tmp_path / "e_x2.png")  # finished before any record: rank 0 records it while planning
    planned = record_of("e.png", tmp_path / "e_x2.png", "skipped", "r1", seconds=0)
    manifest.write_record({**planned, "plan": True})
    status = job_status(tmp_path)
    assert status.run == "r1" and status.run_counts["done"] == 2 and status.run_counts["failed"] == 1
    assert status.run_counts["skipped"] == 0 and status.latest["skipped"] == 1  # plan records are not progress
    assert not status.complete and not status.finished
    text = format_status(status)
    assert "1 not recorded yet" in text and f"failed: {tmp_path / 'c.png'}: c.png: truncated" in text
    assert "missing: " in text and "d_x2.png" in text

    manifest.write_record({"event": "job", "run": "r2", "inputs": 4, "todo": 3, "skipped": 1, "world_size": 1})
    image("b", "done", "r2")
    image("c", "done", "r2")
    whole_image(tmp_path / "c_x2.png")
    image("d", "done", "r2")
    whole_image(tmp_path / "d_x2.png")
    manifest.write_record({"event": "summary", "run": "r2", "done": 3, "skipped": 1, "failed": 0})
    status = job_status(tmp_path)
    assert status.finished and status.complete
    assert status.latest["done"] == 4 and status.latest["skipped"] == 1 and not status.missing_outputs
    assert format_status(status).endswith("complete")


def test_job_status_says_which_recorded_outputs_are_broken_and_what_the_next_run_does(tmp_path):
    """A recorded output cut short (a disk that filled, a copy interrupted) or replaced by a user's broken file was
    "done" to flowlift status, which checked only that it existed: it is "broken", the job not complete."""
    from flowlift.files.image_outputs import save_image_atomic

    manifest = Manifest(tmp_path)
    manifest.write_record({"event": "job", "run": "r1", "inputs": 3, "todo": 3, "skipped": 0, "world_size": 1})
    noise = (torch.rand(64, 64, 3, generator=torch.Generator().manual_seed(0)) * 255).to(torch.uint8).numpy()
    picture = Image.fromarray(noise)
    for name in ("ours", "users", "whole"):
        out = tmp_path / f"{name}_x2.png"
        save_image_atomic(picture, out, {"flowlift": {"input": f"{name}.png"}})
        manifest.write_record(record_of(f"{name}.png", out, "done", "r1"))
    manifest.write_record({"event": "summary", "run": "r1", "done": 3, "skipped": 0, "failed": 0})
    assert job_status(tmp_path).complete
    ours, users = tmp_path / "ours_x2.png", tmp_path / "users_x2.png"
    ours.write_bytes(ours.read_bytes()[: ours.stat().st_size // 2])
    buffer = io.BytesIO()
    picture.save(buffer, "PNG")  # a user's picture at the output's name, cut short too
    users.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    status = job_status(tmp_path)
    assert not status.complete and not status.missing_outputs
    assert dict(status.broken_outputs) == {
        str(ours): "truncated; the next run redoes it",
        str(users): "truncated; not written by flowlift: the next run refuses it, --overwrite replaces it",
    }
    text = format_status(status)
    assert "0 recorded but missing on disk, 2 broken" in text and f"  broken: {ours} (truncated;" in text, text
    assert text.endswith("not complete: rerun the same command to finish")


def test_a_plans_refusal_is_superseded_once_its_input_is_done(tmp_path):
    """A duplicate stem (a.png beside a.jpg) is refused at planning with no output; after a.jpg went and a rerun
    upscaled a.png, the status still said "failed: a.png ..." and "not complete", whatever was rerun."""
    manifest = Manifest(tmp_path)
    (tmp_path / "a.png").write_bytes(b"x")

    def record(output, status, run, error=None):
        return record_of(tmp_path / "a.png", output, status, run, error, seconds=0.0)

    manifest.write_record({"event": "job", "run": "r1", "inputs": 1, "todo": 0, "skipped": 0, "world_size": 2})
    manifest.write_record({**record(None, "failed", "r1", "a_x2.png is also the output of a.jpg"), "plan": True})
    manifest.write_record({"event": "summary", "run": "r1", "done": 0, "skipped": 0, "failed": 1})
    assert not job_status(tmp_path).complete
    manifest.write_record({"event": "job", "run": "r2", "inputs": 1, "todo": 1, "skipped": 0, "world_size": 2})
    whole_image(tmp_path / "a_x2.png")
    manifest.write_record(record(tmp_path / "a_x2.png", "done", "r2"))
    manifest.write_record({"event": "summary", "run": "r2", "done": 1, "skipped": 0, "failed": 0})
    status = job_status(tmp_path)
    assert status.complete and not status.failures and status.latest["done"] == 1, format_status(status)
    assert list(latest_by_output(Manifest(tmp_path).read().records)) == [str(tmp_path / "a_x2.png")]


def test_scaleout_refusals_are_one_line_errors(tmp_path, capsys):
    from flowlift.commands.cli import main
    from flowlift.files.output_paths import output_target
    from flowlift.jobs.batch import Job
    from flowlift.jobs.scaleout import run_batch

    jobs = [Job(tmp_path / "a.png", tmp_path / "a_x2.png")]
    for output in (None, str(tmp_path / "one.png")):  # no folder for the manifest
        folder = output_target(output, 1)[1]
        with pytest.raises(FlowliftError, match="-o must name an output folder"):
            run_batch(jobs, lambda: None, command="upscale", folder=folder, env=DistEnv(0, 2, 0))
    assert main(["status", str(tmp_path / "absent")]) == 2  # no folder there (without a
    # manifest, an existing folder's state comes from its files: tests/test_cli_upscale.py)
    assert main(["upscale"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("flowlift status: error: ") and "no such folder" in err[0]
    assert err[1] == "flowlift upscale: error: give INPUT images"


BARRIER_SCRIPT = """
import os
import time
from flowlift.jobs.distributed import DistEnv, finish, process_group


def say(line):
    # one write(2) per line: both ranks share the pipe, and print's separate writes of text and newline interleave
    os.write(1, (line + "\\n").encode())


env = DistEnv.from_environ()
with process_group(env, 60):
    per_rank, reason = finish(env, {"done": env.rank + 1}, timeout_s=60)
    say(f"on time, rank {env.rank}: {per_rank} | {reason}")
    if env.rank == 1:
        time.sleep(4)
    per_rank, reason = finish(env, {"done": env.rank + 1}, timeout_s=1)
    say(f"late, rank {env.rank}: {per_rank} | {reason}")
"""


def test_end_barrier_gathers_counts_or_times_out_naming_the_late_rank(tmp_path):
    script = tmp_path / "barrier.py"
    script.write_text(BARRIER_SCRIPT)
    command = torchrun_command(2, program=(str(script),))
    done = run_in_worker_env(command, cwd=tmp_path)
    lines = (done.stdout + done.stderr).splitlines()
    assert "on time, rank 0: [{'done': 1}, {'done': 2}] | " in lines, lines[-20:]
    assert "on time, rank 1: [{'done': 1}, {'done': 2}] | " in lines
    late = next(x for x in lines if x.startswith("late, rank 0:"))
    assert late.startswith("late, rank 0: None | ") and "Ranks 1 failed to pass" in late  # rank 0 names rank 1
    assert any(x.startswith("late, rank 1: None | ") for x in lines)  # and rank 1 does not hang either


# --------------------------------------------------------------------------------------------------
# eval --run, sharded


@pytest.fixture(scope="module")
def photos(tmp_path_factory, shared):
    """Six small photos of mixed sizes (multiples of 32 and not)."""
    folder = tmp_path_factory.mktemp("photos")
    sizes = [(96, 64), (64, 64), (128, 96), (70, 50), (64, 96), (160, 64)]
    sources = sorted((shared / "images" / "kodak").glob("*.png"))
    for i, size in enumerate(sizes):
        with Image.open(sources[i % len(sources)]) as im:
            im.convert("RGB").resize(size, Image.Resampling.BOX).save(folder / f"p{i}.png")
    return folder


def test_eval_run_sharded_equals_single_process(tmp_path, shared, photos, single_thread_torch):
    from flowlift.commands.cli import main

    common = [
        "--run",
        "lanczos,vae-roundtrip",
        "--dataset",
        str(photos),
        "--scale",
        "2",
        "--vae",
        str(shared / "models" / "taef2"),
        "--no-progress",
    ]
    assert main(["eval", *common, "-o", str(tmp_path / "one")]) == 0
    result = run_torchrun(2, "eval", *common, "-o", str(tmp_path / "two"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    one = json.loads((tmp_path / "one" / "results.json").read_text())
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    assert two["images"] == one["images"]  # merged == single process, exactly
    assert two["summary"] == one["summary"]
    assert "cache: 0 reused, 12 computed" in result.stdout  # each (method, image) computed once over the ranks
    assert result.stdout.count("wrote ") == 1  # rank 0 alone writes the report
    entries = sorted(p.relative_to(tmp_path / "two" / "cache") for p in (tmp_path / "two" / "cache").rglob("*.json"))
    assert len(entries) == 12
    assert not list((tmp_path / "two").rglob("*.partial*"))


# --------------------------------------------------------------------------------------------------
# upscale under torchrun

SIZES = [(48, 32), (64, 48), (48, 48), (80, 48), (48, 64), (96, 64), (64, 40), (72, 72)]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return save_tiny_unet(tmp_path_factory.mktemp("weights") / "flow_upscaler.safetensors")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, shared):
    """Eight small images of mixed sizes and one corrupt file."""
    folder = tmp_path_factory.mktemp("inputs")
    sources = sorted((shared / "images" / "photos").glob("*.png"))
    for i, size in enumerate(SIZES):
        with Image.open(sources[i % len(sources)]) as im:
            im.convert("RGB").resize(size, Image.Resampling.BOX).save(folder / f"img{i}.png")
    (folder / "corrupt.png").write_bytes((folder / "img0.png").read_bytes()[:150])
    return folder


def upscale_args(inputs: Path, out: Path, shared: Path, weights: Path, *extra: str) -> list[str]:
    return [
        "upscale",
        str(inputs),
        "-o",
        str(out),
        "--seed",
        "7",
        *cpu_upscale_options(shared, weights),
        *extra,
    ]


def image_records(out: Path) -> list[dict]:
    return [r for r in Manifest(out).records() if r["event"] == "image"]


def outputs_of(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("img*_x2.png"))}


def test_sharded_upscale_equals_one_process_and_reports_the_corrupt_image(
    tmp_path, shared, weights, inputs, single_thread_torch, capsys
):
    from flowlift.commands.cli import main

    assert main(upscale_args(inputs, tmp_path / "one", shared, weights)) == 1  # the corrupt input fails
    assert not (tmp_path / "one" / MANIFEST_NAME).exists()  # one process, no job: nothing new written
    capsys.readouterr()

    # --max-restarts 2, as the docs recommend: a failed image is the job's outcome, not a crash to
    # restart the group for (issue 22 item 13): every rank exits 0, torchrun prints no failure report
    result = run_torchrun(
        2, *upscale_args(inputs, tmp_path / "two", shared, weights), cwd=tmp_path, options=("--max-restarts", "2")
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("flowlift upscale:")]
    assert sum("corrupt.png" in line for line in errors) == 1  # one rank reports it, once
    assert "flowlift upscale: 2 ranks: 8 done, 0 skipped, 1 failed of 9 image(s)" in errors
    summaries = [line for line in result.stdout.splitlines() if " written, " in line]
    assert len(summaries) == 1, result.stdout  # one summary for the job (rank 0's, every rank counted), issue 39
    assert summaries[0].startswith("flowlift upscale: 8 written, 0 skipped, 1 failed (9 inputs) in "), summaries
    assert any("`flowlift status " in line and "exits 1" in line for line in errors)  # says where the failure shows
    jobs = [r for r in Manifest(tmp_path / "two").records() if r["event"] == "job"]
    assert len(jobs) == 1  # one attempt of the group: no restart
    assert not processes_naming(str(tmp_path / "two"))

    one, two = outputs_of(tmp_path / "one"), outputs_of(tmp_path / "two")
    assert len(one) == 8 and two == one  # every image, byte-identical (pixels and PNG metadata)

    records = image_records(tmp_path / "two")
    done = [r for r in records if r["status"] == "done"]
    assert sorted(Path(r["output"]).name for r in done) == sorted(one)  # each exactly once
    assert {r["rank"] for r in done} == {0, 1}
    (failed,) = [r for r in records if r["status"] == "failed"]
    assert failed["input"].endswith("corrupt.png") and failed["error"] and failed["output"].endswith("corrupt_x2.png")
    assert all(len(r["input_sha256"]) == 64 and r["seconds"] > 0 for r in done)
    # balanced by pixels: each rank's share is within one image of half the work
    per_rank = [
        sum(
            w * h
            for (w, h), i in zip(SIZES, range(8), strict=True)
            if any(r["rank"] == rank and r["input"].endswith(f"img{i}.png") for r in done)
        )
        for rank in (0, 1)
    ]
    assert abs(per_rank[0] - per_rank[1]) <= max(w * h for w, h in SIZES)

    assert main(["status", str(tmp_path / "two")]) == 1  # not complete: one failed
    status = capsys.readouterr().out
    assert "8 done, 0 skipped, 1 failed" in status and "corrupt.png" in status


def test_a_manifest_that_cannot_be_written_stops_every_rank_with_one_line(tmp_path, shared, weights, inputs):
    """Issue 22 item 8: a folder where the manifest goes once killed rank 0 with an IsADirectoryError
    traceback while rank 1 went on. Every rank checks, they agree, each says so in one line, exit 2."""
    out = tmp_path / "out"
    (out / MANIFEST_NAME).mkdir(parents=True)
    result = run_torchrun(2, *upscale_args(inputs, out, shared, weights), cwd=tmp_path)
    line = f"flowlift upscale: error: {out / MANIFEST_NAME} {FOLDER_AT_MANIFEST}"
    # (compared as text: two ranks' lines on one pipe can interleave their newlines) torchrun stops the
    # group as soon as one rank exits 2, so the slower rank may say "interrupted" instead
    assert line in result.stderr, result.stderr[-3000:]
    assert "flowlift upscale:" not in result.stderr.replace(line, "").replace("flowlift upscale: interrupted", "")
    assert "IsADirectoryError" not in result.stderr and f'File "{REPO}' not in result.stderr
    assert "exitcode  : 2" in result.stderr  # a rank's own status (torchrun reports any non-zero one as a failure)
    assert not processes_naming(str(out)) and not list(out.glob("*.png"))


def launcher_command(nproc: int, *cli_args: str, options: tuple[str, ...] = ()) -> list[str]:
    """``flowlift launch`` with torchrun's rendezvous options (its spelling), then ``--`` and the command."""
    return [sys.executable, "-m", "flowlift", "launch", *rendezvous_options(nproc), *options, "--", *cli_args]


def test_launcher_exit_status_is_the_jobs_and_failed_images_are_not_restarted(tmp_path, shared, weights, inputs):
    """Issue 22 item 13 with ``flowlift launch``: a corrupt image under --max-restarts 2 is tried once,
    the exit status says an image failed (1), no ChildFailedError; a user error is exit 2, not retried."""
    import shutil

    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    for name in ("img0.png", "img1.png", "corrupt.png"):
        shutil.copy(inputs / name, src / name)
    launched = run_in_worker_env(
        launcher_command(2, *upscale_args(src, out, shared, weights), options=("--max-restarts", "2")),
        cwd=tmp_path,
        timeout=180,
    )
    assert launched.returncode == 1, launched.stderr[-3000:]
    assert "Traceback" not in launched.stderr and "ChildFailedError" not in launched.stderr, launched.stderr[-3000:]
    assert "flowlift upscale: 2 ranks: 2 done, 0 skipped, 1 failed of 3 image(s)" in launched.stderr
    records = Manifest(out).records()
    assert sum(r["event"] == "job" for r in records) == 1  # one attempt of the group
    tried = sorted((Path(r["input"]).name, r["status"]) for r in records if r["event"] == "image")
    assert tried == [("corrupt.png", "failed"), ("img0.png", "done"), ("img1.png", "done")]  # each once
    assert not processes_naming(str(out))

    blocked = tmp_path / "blocked"
    (blocked / MANIFEST_NAME).mkdir(parents=True)
    refused = run_in_worker_env(
        launcher_command(2, *upscale_args(src, blocked, shared, weights), options=("--max-restarts", "2")),
        cwd=tmp_path,
        timeout=180,
    )
    assert refused.returncode == 2, refused.stderr[-3000:]
    line = f"flowlift upscale: error: {blocked / MANIFEST_NAME} {FOLDER_AT_MANIFEST}"
    # one line per rank, once: no restart, no traceback (as text: two ranks' newlines may interleave)
    assert refused.stderr.count(line) == 2 and not refused.stderr.replace(line, "").strip(), refused.stderr


CRASH_SCRIPT = """
import os
import sys

from flowlift.jobs.launch import launch


def worker(argv):
    with open(argv[0], "a") as log:
        log.write(f"{os.environ['RANK']} {os.environ['TORCHELASTIC_RESTART_COUNT']}\\n")
    raise RuntimeError("a bug")


if __name__ == "__main__":
    sys.exit(launch(worker, [sys.argv[1]], sys.argv[2:], command="flowlift launch"))
"""


def test_launcher_restarts_a_crashed_group_then_reports_each_crash_in_one_line(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(CRASH_SCRIPT)
    attempts = tmp_path / "attempts.log"
    result = run_in_worker_env(
        [sys.executable, str(script), str(attempts), *rendezvous_options(1), "--max-restarts", "1"], cwd=tmp_path
    )
    assert result.returncode == 3, result.stderr[-3000:]  # jobs.launch.CRASHED: neither images nor a user error
    assert attempts.read_text().splitlines() == ["0 0", "0 1"]  # started again once
    ours = [line for line in result.stderr.splitlines() if line.startswith("flowlift launch:")]
    assert ours == ["flowlift launch: rank 0 crashed (exit code 1: RuntimeError: a bug); 1 restart(s) did not help"]
    assert "RuntimeError: a bug" in result.stderr.replace(ours[0], "")  # the crash keeps its traceback
    assert not processes_naming(str(attempts))


def test_launcher_options_and_exit_status(monkeypatch):
    from flowlift.jobs.launch import CRASHED, job_status
    from flowlift.jobs.launch_options import launch_config

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torchrun's configuration sets it when unset
    config = launch_config(["--nproc_per_node", "3", "--max-restarts", "2"])
    assert (config.nproc_per_node, config.max_restarts, config.min_nodes, config.max_nodes) == (3, 2, 1, 1)
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("c10d", "localhost:0")  # one node: torchrun's standalone
    config = launch_config(["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h0:29400"])
    assert (config.min_nodes, config.max_nodes, config.rdzv_endpoint) == (1, 2, "h0:29400")
    for bad in (["--nnodes", "x"], ["--nproc-per-node", "many"], ["--bogus"]):
        with pytest.raises(FlowliftError, match="^launcher options: ") as info:
            launch_config(bad)
        assert "\n" not in str(info.value)
    assert job_status({0: 0, 1: 0}) == 0 and job_status({}) == 0
    assert job_status({0: 1, 1: 0}) == 1  # an image failed on some rank
    assert job_status({0: 1, 1: 2}) == 2 and job_status({0: 130, 1: 1}) == 130  # not hidden behind a 1
    assert job_status({0: None}) == CRASHED


def test_launcher_refuses_a_missing_or_unlaunchable_command_in_one_line(capsys):
    from flowlift.commands.cli import main

    assert main(["launch", "--nproc-per-node", "2"]) == 2
    assert main(["launch", "--", "app"]) == 2
    assert main(["launch", "--max-restarts", "-1", "--", "upscale", "a.png"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("flowlift launch: error: ") for line in err), err
    assert "after --" in err[0] and "app" in err[1] and "--max-restarts must be 0 (no restart) or more" in err[2]


def test_manifest_that_cannot_be_written_is_one_line(tmp_path):
    from flowlift.jobs.distributed import agree

    (tmp_path / MANIFEST_NAME).mkdir()
    blocked = Manifest(tmp_path)
    assert blocked.writable_problem() == f"{tmp_path / MANIFEST_NAME} {FOLDER_AT_MANIFEST}"
    with pytest.raises(FlowliftError, match="is a folder"):
        blocked.write_record({"event": "summary"})
    with pytest.raises(FlowliftError, match="Is a directory"):
        blocked.records()
    with pytest.raises(FlowliftError, match="is a folder"):
        agree(DistEnv(), blocked.writable_problem())
    agree(DistEnv(), None)
    fresh = Manifest(tmp_path / "new" / "out")
    assert fresh.writable_problem() is None and fresh.exists() and fresh.records() == []


def test_killed_rank_loses_only_its_image_in_flight_and_reruns_finish_the_job(
    tmp_path, shared, weights, inputs, single_thread_torch, capsys
):
    import shutil
    import signal
    import time

    from flowlift.commands.cli import main

    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    for path in sorted(inputs.glob("img*.png")):
        shutil.copy(path, src / path.name)
    args = upscale_args(src, out, shared, weights)

    # world size 2; SIGKILL rank 1 right after it recorded its first image (torchrun then stops rank 0)
    with open(tmp_path / "run1.log", "w") as log:
        proc = subprocess.Popen(torchrun_command(2, *args), env=worker_env(), stdout=log, stderr=log, cwd=tmp_path)
        victim, deadline = None, time.monotonic() + 150
        while victim is None and proc.poll() is None and time.monotonic() < deadline:
            mine = [r for r in image_records(out) if r["rank"] == 1 and r["status"] == "done"] if out.exists() else []
            if mine:
                victim = mine[0]["pid"]
                os.kill(victim, signal.SIGKILL)
            time.sleep(0.02)
        proc.wait(timeout=120)
    assert victim is not None, (tmp_path / "run1.log").read_text()[-3000:]
    assert proc.returncode != 0
    first = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.glob("img*_x2.png")}
    assert 1 <= len(first) < 8
    recorded = {Path(r["output"]).name for r in image_records(out) if r["status"] == "done"}
    assert recorded <= set(first)  # a record only once its output exists
    assert len(set(first) - recorded) <= 1  # at most rank 0's image between its rename and its record

    # rerun with world size 3: exactly the missing images are done, the finished ones are left alone
    result = run_torchrun(3, *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    missing = 8 - len(first)
    assert f"flowlift upscale: 3 ranks: {missing} done, {len(first)} skipped, 0 failed of 8 image(s)" in result.stderr
    second = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.glob("img*_x2.png")}
    assert len(second) == 8
    assert all(second[name] == first[name] for name in first)  # nothing valid redone (same bytes, same mtime)

    def done_counts() -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in image_records(out):
            if r["status"] == "done":
                counts[Path(r["output"]).name] = counts.get(Path(r["output"]).name, 0) + 1
        return counts

    before = done_counts()
    assert set(before.values()) == {1}  # no image done twice over both runs
    assert len(before) >= 7  # (an output renamed just before rank 0 was stopped is recorded as skipped)
    latest = latest_by_output(Manifest(out).records())
    assert sorted(Path(k).name for k, r in latest.items() if r["status"] in ("done", "skipped")) == sorted(second)

    # world size 1 (no torchrun) continues the job: two outputs lost are redone, the same bytes, nothing else
    lost = sorted(second)[:2]
    for name in lost:
        (out / name).unlink()
    assert main(args) == 0
    capsys.readouterr()
    third = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.glob("img*_x2.png")}
    assert all(third[name][0] == second[name][0] for name in second)
    assert all(third[name] == second[name] for name in second if name not in lost)
    assert done_counts() == {**before, **{name: before.get(name, 0) + 1 for name in lost}}
    assert main(["status", str(out)]) == 0
    assert capsys.readouterr().out.strip().endswith("complete")
