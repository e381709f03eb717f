"""Soak the web app: many requests to ``flowlift app``'s ``upscale`` endpoint from concurrent clients.

``flowlift app`` runs as a user runs it, in its own process on a free 127.0.0.1 port (this checkout's
sources, a random Flow Upscaler checkpoint, the real TAEF2 from ``../shared/models/taef2``, CPU).
``--clients`` gradio_client clients, each in its own thread, share ``--requests`` requests: small
Kodak crops (a different image and seed per request) at ``--scale``. Every answer is checked: a PNG
of exactly the input's size times the scale, with flowlift's metadata and the request's seed. The
server's resident memory, open files and threads are read from ``/proc`` with the server idle: the
clients send the first 10% of the requests, wait for every answer, and the server is sampled; then the
other 90%, and the server is sampled again (:mod:`soak_common`). Comparing two idle moments leaves out
what a request in flight holds; the run is flat when memory is within 10% (or 50 MB) of the first
sample and files and threads did not grow. Afterwards the server is
stopped (SIGTERM) and must exit within 30 s.

    PYTHONPATH=src python benchmarks/soak_app.py [--requests 100] [--clients 8] [--size 128x96] \\
        [--scale 2] [--full-size]

Prints the Markdown table row (docs/app.md keeps the figures); exit 0 only when every request was
answered with a valid PNG, the server exited, and memory, files and threads stayed flat. Traffic
goes to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_common import TABLE_HEADER, ProcessSample, flat_verdict, table_row, warm_index  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SERVER_START_S = 300
STOP_S = 30
#: Pause after a phase before the server is sampled (its last answers are written and sent by then).
SETTLE_S = 2.0


@dataclass
class SoakResult:
    """What a soak run saw: answers, the server's samples, and how the server ended."""

    requests: int
    clients: int
    valid: int = 0
    errors: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    warm: ProcessSample | None = None
    end: ProcessSample | None = None
    seconds: float = 0.0
    server_exit: int | None = None
    server_log: str = ""
    #: (requests answered, server RSS in bytes, threads) at every tenth of the run: the shape of any growth.
    trace: list[tuple[int, int, int]] = field(default_factory=list)

    def problems(self, check_flat: bool = True) -> list[str]:
        """Why the run failed (empty when it passed)."""
        found = list(self.errors[:5])
        if self.valid != self.requests:
            found.append(f"{self.valid} of {self.requests} requests answered with a valid PNG")
        if self.server_exit is None:
            found.append(f"the server did not exit within {STOP_S} s of SIGTERM")
        if check_flat and self.warm is not None and self.end is not None:
            found += flat_verdict(self.warm, self.end)
        return found

    def row(self, name: str) -> str:
        latencies = sorted(self.latencies) or [0.0]
        p95 = latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))]
        notes = (
            f"{self.valid}/{self.requests} valid, {self.clients} clients, median {statistics.median(latencies):.2f} s, "
            f"p95 {p95:.2f} s, {self.requests / max(self.seconds, 1e-9):.2f} req/s"
        )
        assert self.warm is not None and self.end is not None
        return table_row(name, self.requests, self.warm, self.end, notes)


def random_upscaler(folder: Path, full_size: bool) -> Path:
    """A random Flow Upscaler checkpoint: the released architecture (``full_size``) or a narrow one."""
    import torch

    from flowlift.models.upscaler_unet import FlowUpscalerUNet
    from flowlift.models.upscaler_weights import save_upscaler

    torch.manual_seed(0)
    small = dict(base_channels=32, time_dim=32, cond_dim=64, dropout=0.0)
    model = FlowUpscalerUNet() if full_size else FlowUpscalerUNet(**small)
    return save_upscaler(model, folder / "flow_upscaler.safetensors")


def test_images(shared: Path, folder: Path, size: tuple[int, int], count: int = 8) -> list[Path]:
    """``count`` Kodak photos shrunk to ``size`` (box filter), written as PNGs."""
    from PIL import Image

    paths = []
    for index in range(1, count + 1):
        path = folder / f"kodim{index:02d}.png"
        with Image.open(shared / "images" / "kodak" / path.name) as image:
            image.convert("RGB").resize(size, Image.Resampling.BOX).save(path)
        paths.append(path)
    return paths


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(upscaler: Path, vae: Path, folder: Path) -> tuple[subprocess.Popen, str]:
    """``flowlift app`` in its own process on a free loopback port; returns once the page answers."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False", GRADIO_TEMP_DIR=str(folder / "gradio"))
    port = free_port()
    command = [sys.executable, "-m", "flowlift", "app", "--upscaler", str(upscaler), "--vae", str(vae)]
    command += ["--device", "cpu", "--host", "127.0.0.1", "--port", str(port)]
    log = open(folder / "server.log", "w+")  # noqa: SIM115 - the server's stdout and stderr; closed by stop_server
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=folder)
    server.log_file = log  # type: ignore[attr-defined]
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + SERVER_START_S
    while True:
        if server.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"flowlift app exited with {server.returncode}:\n{log.read()}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return server, url
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_server(server)
            raise RuntimeError(f"flowlift app did not answer on {url} within {SERVER_START_S} s")
        time.sleep(0.5)


def stop_server(server: subprocess.Popen) -> tuple[int | None, str]:
    """SIGTERM, then wait; (exit code, or None when it had to be killed; the server's output)."""
    exit_code: int | None = None
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
    try:
        exit_code = server.wait(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    log = server.log_file  # type: ignore[attr-defined]
    log.seek(0)
    text = log.read()
    log.close()
    return exit_code, text


def check_answer(path: str, source_size: tuple[int, int], scale: int, seed: int) -> str | None:
    """Why the downloaded answer is not the requested upscale (None when it is)."""
    from PIL import Image

    from flowlift.files.image_outputs import read_metadata

    try:
        with Image.open(path) as png:
            png.load()
            if png.format != "PNG" or png.size != (source_size[0] * scale, source_size[1] * scale):
                return f"{Path(path).name}: a {png.format} of {png.size}, expected a PNG of {scale}x {source_size}"
        parameters = read_metadata(path).get("flowlift", {})
    except (OSError, ValueError) as error:
        return f"{Path(path).name}: unreadable answer ({error})"
    if parameters.get("seed") != seed or parameters.get("scale") != scale:
        return f"{Path(path).name}: metadata {parameters} does not match seed {seed}, scale {scale}"
    return None


def run_soak(
    requests: int,
    clients: int,
    *,
    size: tuple[int, int] = (128, 96),
    scale: int = 2,
    full_size: bool = False,
    shared: Path | None = None,
    request_timeout: float = 600.0,
) -> SoakResult:
    """Start the server, send ``requests`` upscales from ``clients`` concurrent clients, stop it."""
    from gradio_client import Client, handle_file

    shared = shared or Path(os.environ.get("FLOWLIFT_SHARED", ROOT.parent / "shared"))
    result = SoakResult(requests=requests, clients=clients)
    with tempfile.TemporaryDirectory(prefix="flowlift-soak-app-") as temporary:
        folder = Path(temporary)
        images = test_images(shared, folder, size)
        server, url = start_server(random_upscaler(folder, full_size), shared / "models" / "taef2", folder)
        lock = threading.Lock()
        answered = [0]
        try:
            connected = [Client(url, verbose=False, download_files=str(folder)) for _ in range(clients)]
        except Exception:
            result.server_exit, result.server_log = stop_server(server)
            raise

        def send(client: Client, queue: Iterator[int]) -> None:
            while True:
                with lock:
                    index = next(queue, None)
                if index is None:
                    return
                started = time.perf_counter()
                try:
                    job = client.submit(
                        handle_file(str(images[index % len(images)])), scale, index, 1.0, 1.0, api_name="/upscale"
                    )
                    _preview, png, _summary = job.result(timeout=request_timeout)
                    problem = check_answer(png, size, scale, index)
                    Path(png).unlink(missing_ok=True)  # keep the client's disk use bounded
                except Exception as error:  # noqa: BLE001 - a failed request is a finding, not a crash
                    first = str(error).splitlines()[0] if str(error) else ""
                    problem = f"request {index}: {type(error).__name__}: {first}"
                with lock:
                    result.latencies.append(time.perf_counter() - started)
                    if problem is None:
                        result.valid += 1
                    else:
                        result.errors.append(problem)
                    answered[0] += 1
                    if answered[0] % max(1, requests // 10) == 0:
                        sample = ProcessSample.of(server.pid)
                        result.trace.append((answered[0], sample.rss, sample.threads))

        def phase(indices: range) -> ProcessSample:
            """All clients at once on ``indices``; the server's sample once it is idle again."""
            queue = iter(indices)
            threads = [threading.Thread(target=send, args=(c, queue), daemon=True) for c in connected]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            time.sleep(SETTLE_S)
            return ProcessSample.of(server.pid)

        started = time.perf_counter()
        try:
            # the warm-up gives every client a request at once, so the server's per-connection threads exist
            warm_count = max(warm_index(requests) + 1, min(clients, requests))
            result.warm = phase(range(warm_count))
            result.end = phase(range(warm_count, requests))
            result.seconds = time.perf_counter() - started
        finally:
            result.server_exit, result.server_log = stop_server(server)
    return result


def parse_size(text: str) -> tuple[int, int]:
    width, height = (int(v) for v in text.lower().split("x"))
    return width, height


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--size", type=parse_size, default=(128, 96), help="input size WxH (default 128x96)")
    parser.add_argument("--scale", type=int, choices=(2, 4, 8), default=2)
    parser.add_argument("--full-size", action="store_true", help="the released architecture (random weights)")
    args = parser.parse_args(argv)
    result = run_soak(args.requests, args.clients, size=args.size, scale=args.scale, full_size=args.full_size)
    unet = "full-size" if args.full_size else "small"
    name = f"app /upscale, {args.size[0]}x{args.size[1]} x{args.scale}, TAEF2, random {unet} UNet"
    print(f"command: PYTHONPATH=src python benchmarks/soak_app.py {shlex.join(sys.argv[1:] if argv is None else argv)}")
    print(TABLE_HEADER)
    print(result.row(name))
    trace = ", ".join(f"{n}: {rss / 2**20:.0f} MiB/{threads}" for n, rss, threads in result.trace)
    print(f"server RSS/threads by requests answered, under load: {trace}")
    problems = result.problems()
    for problem in problems:
        print(f"soak_app: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
