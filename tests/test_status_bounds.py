"""``flowlift status`` (issue 36.7): the manifest is streamed in bounded reads with a bound per line, and a
folder or file that cannot be read is one line, never a traceback.

Memory is checked through what the code asks for (the size of every ``read`` on the manifest, the
longest line held), never through the process's RSS. Permission failures are simulated by making the
system calls the code uses for exactly one path raise ``PermissionError``: the tests run as root,
which ignores permission bits, and the interpreter lives where an unprivileged user cannot run it.
"""

from __future__ import annotations

import builtins
import io
import json
import os
from pathlib import Path

import pytest
from PIL import Image

from flowlift.commands.cli import main
from flowlift.jobs import manifest as manifest_module
from flowlift.jobs.manifest import MANIFEST_NAME, MAX_LINE_BYTES, READ_CHUNK_BYTES, Manifest, RecordStream, job_status

JOB = {"event": "job", "run": "r1", "inputs": 2, "todo": 2, "skipped": 0, "world_size": 1}


def _image(name: str, folder: Path, status: str = "done") -> dict:
    return {
        "event": "image",
        "input": f"{name}.png",
        "output": str(folder / f"{name}_x2.png"),
        "status": status,
        "seconds": 1.0,
        "error": None,
        "run": "r1",
    }


def _write_manifest(folder: Path, pieces: list[bytes]) -> Path:
    for name in ("a", "b"):
        Image.new("RGB", (8, 8)).save(folder / f"{name}_x2.png")
    path = folder / MANIFEST_NAME
    path.write_bytes(b"".join(pieces))
    return path


def _line(record: dict) -> bytes:
    return (json.dumps(record) + "\n").encode()


@pytest.fixture
def reads(monkeypatch) -> list[int]:
    """The size asked for by every os.read of the manifest module."""
    sizes: list[int] = []
    real = os.read

    def spy(descriptor: int, size: int) -> bytes:
        sizes.append(size)
        return real(descriptor, size)

    monkeypatch.setattr(manifest_module.os, "read", spy)
    return sizes


LONG = MAX_LINE_BYTES * 3


@pytest.mark.parametrize("where", ["first", "middle", "last without newline", "two of them", "just over the bound"])
def test_an_over_long_line_is_one_bad_line_read_in_bounded_chunks(tmp_path, capsys, reads, where):
    long = b"x" * (MAX_LINE_BYTES + 1 if where == "just over the bound" else LONG)
    good = [_line(JOB), _line(_image("a", tmp_path)), _line(_image("b", tmp_path))]
    pieces = {
        "first": [long + b"\n", *good],
        "middle": [good[0], long + b"\n", *good[1:]],
        "last without newline": [*good, long],
        "two of them": [good[0], long + b"\n", good[1], b"{" + long + b"\n", good[2]],
        "just over the bound": [good[0], long + b"\n", *good[1:]],
    }[where]
    path = _write_manifest(tmp_path, pieces)
    bad = 2 if where == "two of them" else 1
    status = job_status(tmp_path)
    assert status.bad_lines == bad and status.run_counts["done"] == 2 and status.complete
    assert reads and max(reads) <= READ_CHUNK_BYTES  # never the whole file in one read
    assert len(reads) >= path.stat().st_size // READ_CHUNK_BYTES
    assert main(["status", str(tmp_path)]) == 0
    assert f"{bad} line(s) of the manifest are no record" in capsys.readouterr().out


def test_the_line_bound_holds_whatever_the_chunk(tmp_path):
    """No line longer than the bound is ever handed on (held whole), for chunk sizes around it."""
    pieces = [
        _line(JOB),
        b"y" * 500 + b"\n",
        _line(_image("a", tmp_path)),
        b"z" * 99 + b"\n",
        b"\n",
        _line(_image("b", tmp_path)),
        b"w" * 1000,
    ]
    path = _write_manifest(tmp_path, pieces)
    for chunk in (1, 7, 64, 399, 400, 401, 4096):
        stream = RecordStream(path, max_line=400, chunk=chunk)
        held: list[int] = []
        real = stream._lines

        def lines(real=real, held=held):
            for line in real():
                held.append(len(line))
                yield line

        stream._lines = lines  # type: ignore[method-assign]
        records = list(stream.records)
        assert [r["event"] for r in records] == ["job", "image", "image"], chunk
        assert stream.bad_lines == 3 and max(held) <= 400, chunk  # 500 y, 99 z (not JSON), 1000 w; blank skipped


@pytest.mark.parametrize(
    "junk", [b"[" * 100_000, b'{"event": ' * 50_000, b"\xff\xfe not utf-8", b"[1, 2]", b'{"no event": 1}']
)
def test_a_line_that_is_no_record_is_counted_not_a_traceback(tmp_path, capsys, junk):
    _write_manifest(tmp_path, [_line(JOB), junk + b"\n", _line(_image("a", tmp_path)), _line(_image("b", tmp_path))])
    assert main(["status", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "1 line(s) of the manifest are no record" in captured.out


@pytest.mark.parametrize(
    "odd",
    [
        {"seconds": "soon"},
        {"seconds": [1]},
        {"run": {"x": 1}},
        {"run": ["r1"]},
        {"output": {"a": 1}},
        {"status": ["done"]},
    ],
)
def test_records_corrupt_in_their_fields_are_no_traceback(tmp_path, capsys, odd):
    record = {**_image("a", tmp_path), **odd}
    job = {**JOB, "run": odd["run"]} if "run" in odd else JOB
    _write_manifest(tmp_path, [_line(job), _line(record), _line(_image("b", tmp_path))])
    try:
        code = main(["status", str(tmp_path)])
    except Exception as error:  # noqa: BLE001 - the bug: an exception out of the command
        pytest.fail(f"flowlift status raised {error!r}")
    assert code in (0, 1)
    assert "Traceback" not in capsys.readouterr().err


def _deny(monkeypatch, target: Path, *names: str) -> None:
    """Make ``os.<name>`` (for "open": ``open``, ``io.open`` and ``os.open``) raise PermissionError for
    ``target`` alone."""
    target = os.path.abspath(target)
    places = [(os, name) for name in names if name != "open"]
    places += [(module, "open") for module in (builtins, io, os)] if "open" in names else []
    for module, attribute in places:
        real = getattr(module, attribute)

        def denied(path, *args, _real=real, **kwargs):
            if isinstance(path, (str, bytes, os.PathLike)) and os.path.abspath(os.fsdecode(path)) == target:
                raise PermissionError(13, "Permission denied", os.fsdecode(path))
            return _real(path, *args, **kwargs)

        monkeypatch.setattr(module, attribute, denied)


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flowlift status: error: "), err
    return lines[0]


def test_a_folder_that_cannot_be_listed_is_one_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    Image.new("RGB", (8, 8)).save(out / "a.png")
    _deny(monkeypatch, out, "scandir", "listdir")
    assert main(["status", str(out)]) == 2
    assert "Permission denied" in _one_error_line(capsys)


def test_a_folder_that_cannot_be_searched_is_one_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / MANIFEST_NAME).write_bytes(_line(JOB))
    _deny(monkeypatch, out / MANIFEST_NAME, "stat", "lstat", "open")
    assert main(["status", str(out)]) == 2
    assert "Permission denied" in _one_error_line(capsys)


def test_a_manifest_that_cannot_be_read_is_one_line(tmp_path, capsys, monkeypatch):
    _write_manifest(tmp_path, [_line(JOB)])
    _deny(monkeypatch, tmp_path / MANIFEST_NAME, "open")
    assert main(["status", str(tmp_path)]) == 2
    line = _one_error_line(capsys)
    assert "Permission denied" in line and MANIFEST_NAME in line


def test_an_image_that_cannot_be_read_is_listed_not_a_traceback(tmp_path, capsys, monkeypatch):
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    Image.new("RGB", (8, 8)).save(tmp_path / "b_x2.png")
    _deny(monkeypatch, tmp_path / "b_x2.png", "open")
    assert main(["status", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert "broken: b_x2.png (unreadable: Permission denied" in captured.out


def test_a_users_broken_file_at_an_output_name_is_said_as_the_run_treats_it(tmp_path, capsys):
    """The status said "the next run redoes it" of a user's truncated picture at an output name, which the run refuses
    (it never destroys a file flowlift did not write); an empty file the run does redo."""
    import io

    Image.new("RGB", (8, 8)).save(tmp_path / "b.png")
    Image.new("RGB", (8, 8)).save(tmp_path / "c.png")
    picture = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 10, 10)).save(picture, format="PNG")
    (tmp_path / "b_x2.png").write_bytes(picture.getvalue()[: len(picture.getvalue()) // 2])
    (tmp_path / "c_x2.png").write_bytes(b"")
    assert main(["status", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    users = "broken: b_x2.png (truncated; not written by flowlift: the next run refuses it, --overwrite replaces it)"
    assert users in out, out
    assert "broken: c_x2.png (empty; the next run redoes it)" in out


def test_a_fifo_at_the_manifest_name_never_blocks(tmp_path, capsys):
    os.mkfifo(tmp_path / MANIFEST_NAME)
    assert not Manifest(tmp_path).exists()
    assert main(["status", str(tmp_path)]) == 1  # the files' account: nothing here
    assert "no flowlift outputs here" in capsys.readouterr().out
