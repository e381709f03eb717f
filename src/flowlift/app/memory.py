"""Give the memory a finished request freed back to the system, so a long-running app stays flat.

Gradio runs each request's handler on whichever worker thread of its pool is free, and glibc's
``malloc`` keeps a separate pool ("arena") for every thread that allocates; memory a request frees
stays in its thread's arena. With the model running on a different worker each time, every worker's
arena ends up holding the model's freed buffers, and the server's resident memory climbs with the
number of workers that ever ran a request. ``benchmarks/soak_app.py --full-size --requests 250``
measured it (docs/app.md): +106 MiB between the idle samples after 25 and after 250 requests, still
climbing; +17 MiB with the allocator held to two arenas (``MALLOC_ARENA_MAX=2``), which confirms the
cause; +2 MiB with :func:`release_freed_memory` after every request, at the same speed.

:func:`release_freed_memory` calls glibc's ``malloc_trim(0)`` after each request: it returns the
free memory of every arena to the system (the pages stay mapped, so nothing moves and the next
request allocates as before). Running the model on one dedicated thread instead would also have kept
one arena, but measured 2.5x slower per request on the CPU (PyTorch's OpenMP pool and a second
thread team on two cores). On other C libraries (macOS, musl, Windows) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.lru_cache(maxsize=1)
def _malloc_trim():  # noqa: ANN202 - a ctypes function or None
    """glibc's ``malloc_trim``, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_freed_memory() -> bool:
    """Return freed heap memory of all threads to the system; True when glibc did it."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
