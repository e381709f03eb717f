"""Checking a user's ``--device`` and ``--dtype`` once, up front, instead of failing deep inside torch."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from flowlift.errors import FIELD_MARK, FlowliftError

if TYPE_CHECKING:
    import torch

#: The ``--dtype`` choices of every command and the web app.
DTYPES = ("auto", "float32", "bfloat16", "float16")

#: CPU features with which oneDNN computes bfloat16 convolutions and matrix products natively (AMX tiles or the
#: AVX512-BF16 dot products), as ``torch.cpu.get_capabilities()`` and ``/proc/cpuinfo`` name them. Without
#: them a CPU converts bfloat16 to float32 around every kernel and runs slower than plain float32.
NATIVE_BF16_FEATURES = ("amx_bf16", "avx512_bf16")
#: ``FLOWLIFT_CPU_BF16=0`` turns the detection off: every CPU counts as one without native bfloat16.
CPU_BF16_ENV = "FLOWLIFT_CPU_BF16"


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes bfloat16 natively: one of :data:`NATIVE_BF16_FEATURES` is present.

    Asked of torch (``torch.cpu.get_capabilities()``, the CPU features its kernels dispatch on); where
    that call does not exist, of the ``flags`` line of ``cpuinfo`` (Linux). Anything else (an older
    x86 CPU, ARM, macOS) answers False, which keeps float32. The environment variable
    ``FLOWLIFT_CPU_BF16=0`` answers False on any CPU (the test suite sets it, so that every machine runs
    the same float32 reference path; a user's per-command way is ``--dtype float32``).
    """
    if os.environ.get(CPU_BF16_ENV, "").strip() == "0":
        return False
    return any(cpu_has_feature(name, cpuinfo) for name in NATIVE_BF16_FEATURES)


def cpu_has_feature(name: str, cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has the feature ``name`` (e.g. ``amx_bf16``): asked of torch
    (``torch.cpu.get_capabilities()``, the features its kernels dispatch on), else of the ``flags`` line of
    ``cpuinfo`` (Linux); False where neither says."""
    import torch

    capabilities = getattr(torch.cpu, "get_capabilities", None)
    if callable(capabilities):
        return bool(capabilities().get(name))
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as info:
            flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
    except OSError:
        return False
    return name in flags


#: The CPU vendor (``/proc/cpuinfo``'s ``vendor_id``) whose floating-point units produce subnormal float32 results at
#: full speed, as measured for this project (docs/cpu.md, issue 47): AMD's.
SUBNORMALS_AT_FULL_SPEED_VENDOR = "AuthenticAMD"


def cpu_subnormals_at_full_speed(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies into subnormal (denormal) float32 results at full speed.

    AMD's do (:data:`SUBNORMALS_AT_FULL_SPEED_VENDOR`); Intel's take a microcode assist for every such result
    unless flush-to-zero is on (torch leaves it off), which made oneDNN's ReLU with a subnormal slope
    (:mod:`flowlift.models.fused_conv`) run TAEF2's whole decode at 1.45x its CPU time on an Intel Xeon with
    AMX. Read from the ``vendor_id`` line of ``cpuinfo`` (Linux), else from ``platform.processor()`` (Windows
    names the vendor there); a CPU whose vendor is not found counts as slow (the unfused path is right on any).
    """
    import platform

    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as info:
            vendor = next((line.split(":", 1)[1].strip() for line in info if line.startswith("vendor_id")), "")
    except OSError:
        vendor = ""
    return SUBNORMALS_AT_FULL_SPEED_VENDOR in (vendor or platform.processor())


def auto_dtype(device: torch.device, *, cpu_bf16: bool = False) -> torch.dtype:
    """The dtype ``--dtype auto`` means on ``device``: the one rule every front-end and pipeline uses.

    bfloat16 on CUDA; on the CPU bfloat16 when ``cpu_bf16`` (the caller's model is measured to keep its
    results in bfloat16: the Flow Upscaler and TAEF2, docs/cpu.md) and :func:`cpu_has_native_bf16`;
    float32 everywhere else.
    """
    import torch

    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu" and cpu_bf16 and cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def default_channels_last(device: torch.device, dtype: torch.dtype) -> bool:
    """Channels-last UNet weights and inputs: on CUDA, and on the CPU in bfloat16 (oneDNN's fast bf16
    convolutions want NHWC; measured in docs/cpu.md). CPU float32 keeps the contiguous layout the
    results were made with."""
    import torch

    return device.type == "cuda" or (device.type == "cpu" and dtype == torch.bfloat16)


def resolve_device(setting: str | torch.device | None) -> torch.device:
    """``None``/``"auto"`` -> CUDA if available else CPU; otherwise the named device, checked to exist.

    Raises :class:`FlowliftError` for a name torch does not know (``bogus``), for CUDA/MPS/XPU when that
    backend is not available, and for a device index past the number of devices. The CPU is one device:
    ``cpu`` and ``cpu:0`` are it (returned as ``cpu``, what outputs then record); torch also takes
    ``cpu:N`` and runs on that same CPU, so any other index names a device that does not exist and is refused.
    """
    import torch  # here, not at import: the command line's start-up stays fast

    if setting is None or (isinstance(setting, str) and setting.strip().lower() == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(setting.strip() if isinstance(setting, str) else setting)
    except (RuntimeError, TypeError, ValueError):
        raise FlowliftError(f"{str(setting)!r} is not a torch device (use auto, cpu, cuda, cuda:N or mps)") from None
    if device.type == "meta":
        raise FlowliftError("device 'meta' holds no data; use auto, cpu, cuda, cuda:N or mps")
    if device.type == "cpu":
        if device.index not in (None, 0):
            raise FlowliftError(f"device {str(device)!r}: there is one CPU device (cpu, or cpu:0); use cpu")
        return torch.device("cpu")
    backend = getattr(torch, device.type, None)
    available = getattr(backend, "is_available", None)
    if not callable(available) or not available():
        raise FlowliftError(
            f"device {str(device)!r} requested, but {device.type.upper()} is not available on this machine"
        )
    count = getattr(backend, "device_count", None)
    if device.index is not None and callable(count) and device.index >= count():
        raise FlowliftError(f"device {str(device)!r} requested, but this machine has {count()} {device.type} device(s)")
    return device


def resolve_device_option(device: str | torch.device | None, field: str = "device") -> torch.device:
    """:func:`resolve_device` for a request's field: a bad value is one FlowliftError line naming ``field`` (each
    door says it in its words: the command line ``--device``)."""
    try:
        return resolve_device(device)  # unknown names, missing backends, indices past the device count
    except FlowliftError as error:
        raise FlowliftError(f"{FIELD_MARK} {device}: {error}", field=field) from None


def check_dtype_name(dtype: object, field: str = "dtype") -> None:
    """One FlowliftError line naming ``field`` unless ``dtype`` is None or one of :data:`DTYPES` (the option names)."""
    if dtype is not None and (not isinstance(dtype, str) or dtype not in DTYPES):
        raise FlowliftError(f"{FIELD_MARK} {dtype}: choose one of {', '.join(DTYPES)}", field=field)


def check_device_and_dtype(device: object, dtype: object, fields: tuple[str, str] = ("device", "dtype")) -> None:
    """:func:`resolve_device_dtype`'s rule where a request is made: a device that is here (or None / ``auto``) and a
    dtype name, each refused by its field; the request keeps them as given (its run resolves them, under torchrun
    on each rank's own device)."""
    resolve_device_option(device, field=fields[0])  # type: ignore[arg-type]
    check_dtype_name(dtype, field=fields[1])


def resolve_device_dtype(
    device: str | None, dtype: str | None, *, cpu_bf16: bool = False
) -> tuple[torch.device, torch.dtype]:
    """``(torch.device, torch.dtype)`` from the option values; one FlowliftError line for a bad device.

    ``auto`` (or None) is :func:`auto_dtype` (``cpu_bf16``: bfloat16 also on a CPU with native bfloat16).

    float16 on the CPU is allowed but warned about: the CPU has no fast float16 kernels, so it runs many
    times slower than float32 and gains nothing.
    """
    import torch

    dev = resolve_device_option(device)
    check_dtype_name(dtype)
    dt = auto_dtype(dev, cpu_bf16=cpu_bf16) if dtype in (None, "auto") else getattr(torch, dtype)
    if dev.type == "cpu" and dt == torch.float16:
        warnings.warn(
            "--dtype float16 on the CPU runs many times slower than float32 (no fast CPU float16 kernels) "
            "and is no more accurate; use float32 (the default) or bfloat16",
            UserWarning,
            stacklevel=2,
        )
    return dev, dt


#: glibc ``mallopt`` parameters (``<malloc.h>``).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
#: ``FLOWLIFT_REUSE_FREED_MEMORY=0`` keeps the C library's own allocation policy in every command.
REUSE_FREED_MEMORY_ENV = "FLOWLIFT_REUSE_FREED_MEMORY"


#: The OpenMP wait policy a command that is its own process gives torch's threads, unless the user set one.
OMP_WAIT_POLICY_ENV = "OMP_WAIT_POLICY"


def passive_thread_wait() -> bool:
    """Have torch's OpenMP threads sleep, not spin, while they wait for work; True if set.

    libgomp (torch's CPU OpenMP) spins a waiting thread for ~300,000 rounds at every barrier. On a machine
    shared with other jobs the thread it waits for is often descheduled, so the spinning burns whole time
    slices: measured on the 2-core AMD EPYC at load average 17-19, the 256² -> 512² command took 8.9 CPU-s
    and 107 s wall spinning against 4.5 CPU-s and 35 s wall with ``OMP_WAIT_POLICY=PASSIVE`` (docs/cpu.md,
    issue 47); the models' large convolutions wait little either way. Sets :data:`OMP_WAIT_POLICY_ENV` to
    ``PASSIVE`` in the environment, which libgomp reads once, when torch is imported: so only when torch is
    not imported yet and the variable is unset (a user's own setting wins). Inherited by child processes.
    """
    import sys

    if "torch" in sys.modules or os.environ.get(OMP_WAIT_POLICY_ENV):
        return False
    os.environ[OMP_WAIT_POLICY_ENV] = "PASSIVE"
    return True


def reuse_freed_memory() -> bool:
    """Keep memory the process frees for its next allocations instead of handing it back; True if set.

    PyTorch's CPU tensors come straight from ``malloc``, and glibc serves every block above its mmap
    threshold (at most 32 MiB) with a fresh ``mmap`` and returns it with ``munmap`` on free. A model's
    activations are such blocks, so every layer of every pass faults in and zeroes new pages: on the
    first command that is a sixth of its wall time spent in the kernel (``benchmarks/bench_first_run.py
    --heap``, docs/cpu.md). With ``M_MMAP_MAX = 0`` every block comes from the heap, and with an
    unbounded ``M_TRIM_THRESHOLD`` freed blocks stay there for the next layer, already faulted in. The
    price is a higher resident peak (freed blocks are kept, and the heap fragments), so this is for
    one-shot commands without a memory cap, never a long-running server (``app.memory`` does the
    opposite there). Process-wide and irreversible; a no-op returning False outside glibc and when
    :data:`REUSE_FREED_MEMORY_ENV` is ``0``.
    """
    if os.environ.get(REUSE_FREED_MEMORY_ENV, "1") == "0":
        return False
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt answers 1 on success; the trim threshold is an int, so "unbounded" is its largest value.
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


@contextmanager
def one_thread(device: torch.device | str) -> Iterator[None]:
    """On the CPU, torch's intra-op threads set to 1 for the block (restored after, also on an error); elsewhere
    nothing. For memory-bound element-wise work and reductions: a second OpenMP thread mostly waits at each
    operation's barrier, and on a machine shared with other jobs it spins there (docs/cpu.md, issue 47)."""
    import torch

    threads = torch.get_num_threads()
    if torch.device(device).type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def check_holds_values(tensor: torch.Tensor, name: str = "a tensor", *, field: str | None = None) -> None:
    """Refuse a meta tensor (a shape without values) in one line naming ``name``: reading its values fails deep in
    torch (``Tensor.item() cannot be called on meta tensors``), and nothing can be computed from it."""
    if tensor.is_meta:
        raise FlowliftError(
            f"{name}: a meta tensor (a shape without values); give a tensor that holds the data (on cpu or a GPU)",
            field=field,
        )


def non_finite_kind(tensor: torch.Tensor, name: str = "a tensor") -> str | None:
    """``"NaN"`` or ``"Inf"`` when ``tensor`` holds one, else None (integer and empty tensors: None); a meta
    tensor (no values to read) is one line naming ``name`` (:func:`check_holds_values`).

    One read and no temporaries where ``isfinite(t).all()`` reads twice and writes a bool copy: ``aminmax`` (a NaN
    propagates into both ends, an Inf is one of them, so the ends name the kind too), in one CPU thread (a
    memory-bound reduction; docs/cpu.md, issue 47). Dtypes without ``aminmax`` (float8) are checked in float32.
    """
    import math

    import torch

    check_holds_values(tensor, name)
    if not tensor.is_floating_point() or not tensor.numel():
        return None
    tensor = tensor.detach()
    with one_thread(tensor.device):
        try:
            low, high = (float(v) for v in torch.aminmax(tensor))
        except (NotImplementedError, RuntimeError):
            tensor = tensor.float()
            low, high = (float(v) for v in torch.aminmax(tensor))
    if math.isfinite(low) and math.isfinite(high):
        return None
    return "NaN" if math.isnan(low) or math.isnan(high) else "Inf"


#: Set by :func:`end_before_native_teardown`; read once the command has returned (``flowlift.commands.cli.main``).
_native_teardown_unsafe = False


def end_before_native_teardown() -> None:
    """Have this process end, once its command has returned, without running the C++ libraries' teardown.

    After a ``DistributedDataParallel`` model, torch 2.13 keeps the gloo process group's worker threads
    (``pt_gloo_runloop``, ``gloo_tcp_loop``) running past ``destroy_process_group`` (DDP imports
    ``torch._dynamo``, and after that import the group is held from C++: measured, no Python object holds
    it). The interpreter's exit then tears those threads down in static destructors, which can abort the
    rank (SIGABRT, "terminate called without an active exception") after its work is done, so that
    ``torchrun`` reports a finished training run as failed. The command has written and closed its files by
    then; :func:`end_process` runs the ``atexit`` handlers, flushes the streams and leaves with ``os._exit``.
    ``flowlift launch`` stopped by a signal ends so too: the interpreter's teardown would give SIGTERM back its
    default action, and a late one of a burst would kill it with 143 (:class:`flowlift.jobs.launch._FirstStop`).
    """
    global _native_teardown_unsafe
    _native_teardown_unsafe = True


def end_process(status: int) -> int:
    """``status`` back to the caller, or, after :func:`end_before_native_teardown`, the process ended with it."""
    if not _native_teardown_unsafe:
        return status
    import atexit
    import sys

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed or broken stream has nothing left to write
            pass
    os._exit(status)
