"""The passes Mage-VAE's exact tiled executor (:mod:`flowlift.models.mage_tiling`) is made of.

A *pass* runs one layer over the frame tile by tile (:func:`run_pass`): it reads the tile plus a halo
from a *source* (a whole-frame store, or a layer computed on the fly), crops the halo and hands the
tile to a *writer*, which may gather the frame's statistics for the next layer (:class:`GroupSums`).
A DiCo block is two passes (:func:`dico_gate`, then :func:`dico_pass`), a chain of blocks
double-buffers its stores (:func:`dico_run`). Region maths and the statistics are small pure pieces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from flowlift.models.mage_vae import GROUPS, NORM_EPS, DiCoBlock, channel_gate, keeps_released_sums

#: A tile in codec (1/16) coordinates: rows ``[r0, r1)``, columns ``[c0, c1)``.
Region = tuple[int, int, int, int]
#: Reads a (1, C, r1 - r0, c1 - c0) block of a layer's input for a clipped region.
Source = Callable[[Region], torch.Tensor]
TileCallback = Callable[[int, int], None]


# --------------------------------------------------------------------------------------------------
# Region maths and statistics (pure)
# --------------------------------------------------------------------------------------------------


def tile_grid(height: int, width: int, tile: int) -> list[Region]:
    """Row-major tiles of side ``tile`` anchored at (0, 0); the last row/column is cut at the frame edge."""
    return [
        (r0, min(r0 + tile, height), c0, min(c0 + tile, width))
        for r0 in range(0, height, tile)
        for c0 in range(0, width, tile)
    ]


def with_halo(region: Region, halo: int, height: int, width: int) -> tuple[Region, tuple[slice, slice]]:
    """The region grown by ``halo`` and clipped to the frame, and where the region sits inside it."""
    r0, r1, c0, c1 = region
    e0, e1, f0, f1 = max(r0 - halo, 0), min(r1 + halo, height), max(c0 - halo, 0), min(c1 + halo, width)
    return (e0, e1, f0, f1), (slice(r0 - e0, r1 - e0), slice(c0 - f0, c1 - f0))


class GroupSums:
    """Per-group ``sum x`` and ``sum x**2`` of one sample, accumulated over tiles in float64.

    Each tile's sums are torch's float32 sums of each group for a float32 tile (bit for bit the released
    statistics), for a half one from its channels' float32 mean and variance (:func:`channel_moments`; relative
    error ~1e-5 of the variance, far below bfloat16's rounding), added in float64. ``finish()``
    gives GroupNorm's statistics: ``mean = S1 / n``, ``inv_std = 1 / sqrt(S2 / n - mean**2 + 1e-6)`` (biased
    variance), as :func:`~flowlift.models.mage_vae.group_norm_statistics`.
    """

    def __init__(self, channels: int, groups: int = GROUPS) -> None:
        self.groups = groups
        self.s1 = torch.zeros(groups, dtype=torch.float64)
        self.s2 = torch.zeros(groups, dtype=torch.float64)
        self.count = 0
        self.per_group = channels // groups

    def add(self, x: torch.Tensor) -> None:
        if keeps_released_sums(x.dtype):  # float32: torch's sums of each group, as released (bit for bit)
            grouped = x.reshape(self.groups, -1).float()
            self.s1 += grouped.sum(1).double().cpu()
            self.s2 += grouped.square().sum(1).double().cpu()  # not in place: float32 x is a view
        else:
            s1, s2 = channel_moments(x)
            self.s1 += s1.reshape(self.groups, -1).sum(1)
            self.s2 += s2.reshape(self.groups, -1).sum(1)
        self.count += x.numel() // self.groups

    def finish(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        mean = self.s1 / self.count
        var = (self.s2 / self.count - mean.square()).clamp_min(0)
        inv_std = torch.rsqrt(var + NORM_EPS)
        return mean.float()[None].to(device), inv_std.float()[None].to(device)


def channel_mean_var(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and biased variance ``mean((x - mean)**2)`` of a (B, C, h, w) tile, float32, by torch's
    batch-norm statistics kernel (``torch.batch_norm_update_stats`` into float32 buffers, momentum 1: the batch's
    own mean and variance, accumulated in float32 whatever x's dtype; its second result is the biased variance).

    One read of the tile in its layout, no float32 copy: on the 2-core AMD EPYC, a bf16 channels-last tile of
    128x192 positions x 384 in 2.0 CPU-ms where float32 sums of float32 chunks took 5.6 (the sums) and 7.9 (sums
    and squares). Accuracy against float64 at that size: the mean within 3e-7 of the channel's standard deviation
    (1.3e-6 where the mean is 50 standard deviations), the variance within 2e-5 relative (8e-5 at that offset;
    float32 sums of squares were within 2e-7 for centred channels but 4e-4 there).
    """
    if x.device.type not in ("cpu", "cuda"):  # torch's kernel is CPU and CUDA only
        var, mean = torch.var_mean(x.float(), dim=(0, 2, 3), unbiased=False)
        return mean, var
    c = x.shape[1]
    mean = torch.zeros(c, dtype=torch.float32, device=x.device)
    var = torch.ones(c, dtype=torch.float32, device=x.device)
    return torch.batch_norm_update_stats(x, mean, var, 1.0)


def channel_moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel ``sum x`` and ``sum x**2`` of a (1, C, h, w) tile, float64 on the CPU. A half tile: ``n mean``
    and ``n (var + mean**2)`` from :func:`channel_mean_var`, the products in float64; a float32 (or wider) one (the
    executor takes torch's own group sums there): float64 sums."""
    if keeps_released_sums(x.dtype):
        values = x.double()
        return values.sum((0, 2, 3)).cpu(), values.square().sum((0, 2, 3)).cpu()
    n = x.numel() // x.shape[1]
    mean, var = (t.double().cpu() for t in channel_mean_var(x))
    return n * mean, n * (var + mean.square())


def channel_sums(x: torch.Tensor) -> torch.Tensor:
    """Per-channel sums of a (1, C, h, w) tile, for the frame mean ``sum / (H W)``, in float64 for the sum over
    tiles. A float32 (or wider) tile: torch's float32 sum over the tile, bit for bit the released sums. A half
    tile: ``n mean`` from :func:`channel_mean_var` (torch's float32-typed ``sum`` of a half tensor converts all of
    it to float32 first)."""
    if keeps_released_sums(x.dtype):
        return x.sum(dim=(0, 2, 3), dtype=torch.float32).double().cpu()
    return (x.numel() // x.shape[1]) * channel_mean_var(x)[0].double().cpu()


# --------------------------------------------------------------------------------------------------
# Passes
# --------------------------------------------------------------------------------------------------


class Progress:
    """Counts tile steps and reports ``on_tile(done, total)`` after each."""

    def __init__(self, total: int, on_tile: TileCallback | None) -> None:
        self.total, self.done, self.on_tile = total, 0, on_tile

    def step(self) -> None:
        self.done += 1
        if self.on_tile is not None:
            self.on_tile(min(self.done, self.total), self.total)


def store_source(store: torch.Tensor) -> Source:
    return lambda r: store[:, :, r[0] : r[1], r[2] : r[3]]


def run_pass(
    layer: Callable[[torch.Tensor, tuple[slice, slice], Region], torch.Tensor],
    source: Source,
    write: Callable[[Region, torch.Tensor], None],
    *,
    size: tuple[int, int],
    tile: int,
    halo: int,
    progress: Progress,
) -> None:
    """One layer over the frame: ``write(region, layer(source(region + halo), inner, region))`` per tile.

    ``layer`` gets the haloed input and the slices of the tile inside it and returns the tile's output.
    Safe in place (``write`` into the store ``source`` reads) only when ``halo`` is 0.
    """
    for region in tile_grid(*size, tile):
        grown, inner = with_halo(region, halo, *size)
        write(region, layer(source(grown), inner, region))
        progress.step()


def store_writer(store: torch.Tensor, sums: GroupSums | None = None) -> Callable[[Region, torch.Tensor], None]:
    """Writes a tile into ``store`` (and adds it to ``sums``, the next GroupNorm's statistics)."""

    def write(r: Region, y: torch.Tensor) -> None:
        store[:, :, r[0] : r[1], r[2] : r[3]] = y
        if sums is not None:
            sums.add(y)

    return write


def crop(x: torch.Tensor, inner: tuple[slice, slice]) -> torch.Tensor:
    return x[:, :, inner[0], inner[1]]


def dico_gate(
    block: DiCoBlock, source: Source, *, size: tuple[int, int], tile: int, progress: Progress
) -> torch.Tensor:
    """First pass of a DiCo block: ``channel_gate(mean_hw(a))`` from per-tile sums of its branch ``a``."""
    sums = None
    for region in tile_grid(*size, tile):
        grown, inner = with_halo(region, 1, *size)
        part = channel_sums(crop(block.branch_pre_gate(source(grown)), inner))
        sums = part if sums is None else sums + part
        progress.step()
    return _gate(block, sums, size)


def _gate(block: DiCoBlock, sums: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    weight = block.ca[1].weight
    means = (sums / (size[0] * size[1])).to(weight.device, weight.dtype)[None, :, None, None]
    return channel_gate(means, block.ca[1])


def dico_pass(
    block: DiCoBlock,
    source: Source,
    write: Callable[[Region, torch.Tensor], None],
    *,
    size: tuple[int, int],
    tile: int,
    progress: Progress,
) -> None:
    """A whole DiCo block: :func:`dico_gate`, then ``x + conv3(a * gate)`` and the MLP half per tile."""
    gate = dico_gate(block, source, size=size, tile=tile, progress=progress)

    def layer(x: torch.Tensor, inner: tuple[slice, slice], _: Region) -> torch.Tensor:
        return block.finish(crop(x, inner), crop(block.branch_pre_gate(x), inner), gate)

    run_pass(layer, source, write, size=size, tile=tile, halo=1, progress=progress)


def band_rows(size: tuple[int, int], positions: int, multiple: int = 1) -> int:
    """Rows of a full-width band of at most ``positions`` positions (at least one row), rounded down to a
    multiple of ``multiple`` where that leaves at least one multiple."""
    rows = max(1, positions // size[1])
    return rows - rows % multiple if rows >= multiple else rows


def dico_whole(
    block: DiCoBlock,
    source: Source,
    write: Callable[[Region, torch.Tensor], None],
    *,
    size: tuple[int, int],
    band: int,
    progress: Progress,
) -> None:
    """A DiCo block on the whole frame of a small frame: its branch ``a`` once (no halo, no recompute), the
    gate from its float64 sums, then ``x + conv3(a * gate)`` and the pointwise MLP half in full-width bands of
    ``band`` rows (so its 4C-wide hidden stays band-sized). One step for the branch, one per band."""
    h, w = size
    x = source((0, h, 0, w))
    a = block.branch_pre_gate(x)
    gate = _gate(block, channel_sums(a), size)
    progress.step()
    for r0 in range(0, h, band):
        r1 = min(r0 + band, h)
        write((r0, r1, 0, w), block.finish(x[:, :, r0:r1], a[:, :, r0:r1], gate))
        progress.step()


def dico_run(
    blocks: Sequence[DiCoBlock],
    source: Source,
    final: Callable[[Region, torch.Tensor], None],
    *,
    new_store: Callable[[], torch.Tensor],
    pool: Sequence[torch.Tensor] = (),
    reading: torch.Tensor | None = None,
    size: tuple[int, int],
    tile: int,
    progress: Progress,
    band: int | None = None,
) -> None:
    """Run ``blocks`` in turn from ``source``; the last block's output tiles go to ``final(region, y)``.

    Intermediate outputs alternate between two stores: those of ``pool`` that ``source`` is not reading
    (``reading``), else ones made by ``new_store()`` when first needed. No blocks: ``final`` gets the input.
    ``band``: each block runs whole-frame (:func:`dico_whole`, its MLP half in bands of ``band`` rows)
    instead of as two tiled passes (:func:`dico_pass`).
    """
    if not blocks:
        run_pass(lambda x, _i, _r: x, source, final, size=size, tile=tile, halo=0, progress=progress)
        return
    stores = list(pool)
    kw = {"size": size, "progress": progress, **({"tile": tile} if band is None else {"band": band})}
    run = dico_pass if band is None else dico_whole
    for block in blocks[:-1]:
        target = next((s for s in stores if s is not reading), None)
        if target is None:
            target = new_store()
            stores.append(target)
        run(block, source, store_writer(target), **kw)
        reading, source = target, store_source(target)
    run(blocks[-1], source, final, **kw)
