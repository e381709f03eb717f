"""Full-frame stores of the strip executor kept off the compute device, with overlapped copies.

:class:`OffloadedStores` owns every full-frame activation of one
:class:`flowlift.upscale.chunked.executor.ChunkedExecutor` run when ``offload_device`` differs from the
compute device (host memory for a GPU run). Three things make the per-strip copies cheap:

* **Row-major layout**: a logical (B, C, H, W) frame is stored as (H, B, C, W), so the rows ``[a, b)``
  of all channels are one contiguous block: one DMA each way, no host-side gather.
* **Pinned memory** (CUDA): page-locked host stores, so copies are real asynchronous DMAs.
* **A side stream, double-buffered** (CUDA): a strip's write-back and the next strip's reads run on a
  copy stream while the compute stream works. Reads of a store follow a fixed stride (strip ``k+1``
  reads the rows of strip ``k`` shifted by one strip), so after two reads of the same length the next
  one is predicted and started at once: strip ``k+1``'s input travels while strip ``k`` computes. A
  predicted block is used only when the next read asks for exactly its rows, and is dropped when
  those rows are written first, so a wrong guess costs a copy, never a wrong number.

Ordering: every copy runs on the one copy stream, after the compute stream's work it depends on
(``wait_stream`` for write-backs); the compute stream waits on an event before using a read. On the
CPU (tests, or a CPU offload target) the same logic runs synchronously with real copies, which is
what keeps the prediction and invalidation paths tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["OffloadedStores"]


@dataclass
class _Ahead:
    """A predicted read: rows ``[a, b)`` of one store, on the compute device, ready after ``event``."""

    a: int
    b: int
    rows: torch.Tensor
    event: torch.cuda.Event | None


class OffloadedStores:
    """Allocates, writes and reads row-major stores on ``store_device`` for compute on ``device``.

    Stores are plain tensors of shape (H, B, C, W); :meth:`read` and :meth:`write` take and return
    the logical (B, C, rows, W) layout. ``prefetch=False`` turns prediction off (every read is a
    synchronous copy; used to compare).
    """

    def __init__(
        self, device: torch.device, dtype: torch.dtype, store_device: torch.device, *, prefetch: bool = True
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.store_device = store_device
        self.prefetch = prefetch
        cuda = device.type == "cuda" and store_device.type == "cpu" and torch.cuda.is_available()
        self.pin = cuda
        self.stream = torch.cuda.Stream(device=device) if cuda else None
        # per store (keyed by the store's data pointer; reset whenever a store is allocated there)
        self._last: dict[tuple[int, int], int] = {}  # (store, read length) -> start row of the last read
        self._ahead: dict[tuple[int, int], _Ahead] = {}  # (store, read length) -> predicted next read
        self.hits = 0
        self.misses = 0

    # -- allocation ------------------------------------------------------------------------------

    def empty(self, shape: tuple[int, int, int, int]) -> torch.Tensor:
        """A new store for a logical (B, C, H, W) frame: an uninitialised (H, B, C, W) tensor."""
        b, c, h, w = shape
        store = torch.empty((h, b, c, w), dtype=self.dtype, device=self.store_device, pin_memory=self.pin)
        self._forget(store)
        return store

    def from_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """A store holding ``tensor`` (B, C, H, W) from the compute device (a synchronous copy)."""
        store = self.empty(tuple(tensor.shape))
        store.copy_(tensor.to(self.dtype).permute(2, 0, 1, 3))
        return store

    @staticmethod
    def logical_shape(store: torch.Tensor) -> tuple[int, int, int, int]:
        h, b, c, w = store.shape
        return b, c, h, w

    # -- copies ----------------------------------------------------------------------------------

    def write(self, store: torch.Tensor, a: int, b: int, strip: torch.Tensor) -> None:
        """Rows ``[a, b)`` of ``store`` := ``strip`` (B, C, b - a, W) computed on the compute device."""
        self._drop_overlapping(store, a, b)
        rows = strip.permute(2, 0, 1, 3)
        if self.stream is None:
            store[a:b].copy_(rows)
            return
        rows = rows.contiguous()  # one device-side transpose, then one DMA
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            store[a:b].copy_(rows, non_blocking=True)
        rows.record_stream(self.stream)

    def read(self, store: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """Rows ``[a, b)`` of ``store`` on the compute device as (B, C, b - a, W); then predicts the next read."""
        key = (store.data_ptr(), b - a)
        ahead = self._ahead.pop(key, None)
        if ahead is not None and (ahead.a, ahead.b) == (a, b):
            self.hits += 1
            rows = self._ready(ahead)
        else:
            self.misses += int(self.prefetch)
            rows = self._ready(self._start(store, a, b))
        last = self._last.get(key)
        self._last[key] = a
        if self.prefetch and last is not None and a > last:
            step = a - last
            if b + step <= store.shape[0]:
                self._ahead[key] = self._start(store, a + step, b + step)
        return rows.permute(1, 2, 0, 3)

    def finish(self) -> None:
        """Wait (on the compute stream) for every copy; drop predictions. Call before reading stores elsewhere."""
        self._ahead.clear()
        self._last.clear()
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    # -- internals -------------------------------------------------------------------------------

    def _start(self, store: torch.Tensor, a: int, b: int) -> _Ahead:
        if self.stream is None:
            # CPU: a real copy (not a view), so a stale prediction would show as a wrong number
            return _Ahead(a, b, store[a:b].to(device=self.device, copy=True), None)
        with torch.cuda.stream(self.stream):
            rows = store[a:b].to(device=self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return _Ahead(a, b, rows, event)

    def _ready(self, ahead: _Ahead) -> torch.Tensor:
        if ahead.event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(ahead.event)
            ahead.rows.record_stream(current)  # allocated on the copy stream, used on the compute stream
        return ahead.rows

    def _drop_overlapping(self, store: torch.Tensor, a: int, b: int) -> None:
        ptr = store.data_ptr()
        for key in [k for k, v in self._ahead.items() if k[0] == ptr and v.a < b and a < v.b]:
            del self._ahead[key]

    def _forget(self, store: torch.Tensor) -> None:
        ptr = store.data_ptr()
        for table in (self._last, self._ahead):
            for key in [k for k in table if k[0] == ptr]:
                del table[key]
