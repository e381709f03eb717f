"""Helpers for the ``flowlift app`` tests: crafted bad files, ports and listening sockets."""

from __future__ import annotations

import os
import socket
import struct
import zlib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def bomb_png(path: Path, side: int = 30000) -> Path:
    """A 60-byte PNG that declares ``side`` x ``side`` pixels (a decompression bomb's header)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b""))
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def subprocess_env(tmp_path: Path) -> dict[str, str]:
    """Environment for a server subprocess: this checkout's sources first, offline, no analytics."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False", GRADIO_TEMP_DIR=str(tmp_path / "gradio"))
    return env


def process_tree(pid: int) -> set[int]:
    """``pid`` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, todo = set(), [pid]
    while todo:
        current = todo.pop()
        if current not in tree:
            tree.add(current)
            todo.extend(children.get(current, []))
    return tree


def _socket_inodes(pids: set[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        try:
            for fd in fd_dir.iterdir():
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    return inodes


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def listening_addresses(pids: set[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state owned by one of ``pids``."""
    inodes = _socket_inodes(pids)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A = TCP_LISTEN
                address, port = local.split(":")
                found.append((_address(address), int(port, 16)))
    return found


def is_loopback(address: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback
