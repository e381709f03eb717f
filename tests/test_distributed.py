"""Scale-out under torchrun: sharding, the manifest, the status, and a sharded ``eval --run`` (gloo, loopback).

The torchrun runs start ``python -m torch.distributed.run`` with this checkout's ``src`` first on
``PYTHONPATH``, a fresh rendezvous port on 127.0.0.1 and single-threaded workers.
"""

from __future__ import annotations

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
from PIL import Image

from flowlift.distributed import DistEnv, image_pixels, probe_and_gather, rank_device, shard_by_pixels
from flowlift.errors import FlowliftError
from flowlift.manifest import MANIFEST_NAME, Manifest, format_status, image_record, job_status, latest_by_output

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(nproc: int, *cli_args: str) -> list[str]:
    """``torchrun`` on one host, rendezvous on a free 127.0.0.1 port (the multi-host form of the command)."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", uuid.uuid4().hex,
        "-m", "flowlift.cli", "--", *cli_args,
    ]  # fmt: skip  ("--": torchrun would take eval's --run as an abbreviation of its --run-path)


def worker_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")


def run_torchrun(nproc: int, *cli_args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        torchrun_command(nproc, *cli_args), env=worker_env(), capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


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
    assert rank_device(None, ranked, cuda_available=True) == "cuda:1"
    assert rank_device("cuda:0", ranked, cuda_available=True) == "cuda:1"  # one GPU per local rank
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
            manifest.append(
                image_record(input_path=f"in/{k}-{i}.png", input_sha256="0" * 64, output=f"out/{k}-{i}.png",
                             status="done", seconds=0.5, error=None, env=env, run="r")  # fmt: skip
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
        image_record(input_path="a", input_sha256=None, output=None, status="ok", seconds=0, error=None,
                     env=env, run="r")  # fmt: skip


def test_job_status_counts_latest_records(tmp_path):
    with pytest.raises(FlowliftError, match="no job manifest"):
        job_status(tmp_path)
    manifest = Manifest(tmp_path)
    (tmp_path / "a_x2.png").write_bytes(b"x")
    (tmp_path / "b_x2.png").write_bytes(b"x")
    env = DistEnv()

    def image(name, status, run, error=None):
        out = tmp_path / f"{name}_x2.png"
        manifest.append(image_record(input_path=f"{name}.png", input_sha256=None, output=out, status=status,
                                     seconds=1.0, error=error, env=env, run=run))  # fmt: skip

    manifest.append({"event": "job", "run": "r1", "inputs": 4, "todo": 4, "skipped": 0, "world_size": 2})
    image("a", "done", "r1")
    image("c", "failed", "r1", "c.png: truncated")
    image("d", "done", "r1")  # d's output is gone since
    status = job_status(tmp_path)
    assert status.run == "r1" and status.run_counts["done"] == 2 and status.run_counts["failed"] == 1
    assert not status.complete and not status.finished
    text = format_status(status)
    assert "1 not recorded yet" in text and "failed: c.png: c.png: truncated" in text
    assert "missing: " in text and "d_x2.png" in text

    manifest.append({"event": "job", "run": "r2", "inputs": 4, "todo": 3, "skipped": 1, "world_size": 1})
    image("b", "done", "r2")
    image("c", "done", "r2")
    (tmp_path / "c_x2.png").write_bytes(b"x")
    image("d", "done", "r2")
    (tmp_path / "d_x2.png").write_bytes(b"x")
    manifest.append({"event": "summary", "run": "r2", "done": 3, "skipped": 1, "failed": 0})
    status = job_status(tmp_path)
    assert status.finished and status.complete
    assert status.latest["done"] == 4 and status.latest["failed"] == 0 and not status.missing_outputs
    assert format_status(status).endswith("complete")


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
    from flowlift.cli import main

    common = ["--run", "lanczos,vae-roundtrip", "--dataset", str(photos), "--scale", "2",
              "--vae", str(shared / "models" / "taef2"), "--quiet"]  # fmt: skip
    assert main(["eval", *common, "--out", str(tmp_path / "one")]) == 0
    result = run_torchrun(2, "eval", *common, "--out", str(tmp_path / "two"), cwd=tmp_path)
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
