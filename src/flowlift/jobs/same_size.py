"""Same-size inputs computed together: a batch's ``batch_size`` (``flowlift upscale --batch-size``).

:class:`SameSizeBatches` is a ``process(source, output)`` callback for :func:`flowlift.jobs.batch.run_jobs`
(so resume, one-line failures and atomic outputs stay the batch module's). Before the run it groups
the pending inputs by image size (read from the file header, EXIF orientation applied) into groups of
at most ``batch_size`` in input order. When ``run_jobs`` reaches an input whose result is not ready,
its whole group is computed at once (the caller's ``compute``) and the other members' results wait until
their turn (so at most a few groups of results are held). A group that fails as a whole is retried one
image at a time, so one bad input still costs only its own line.

Like the rest of :mod:`flowlift.jobs` it knows nothing of what is done to an image; the upscaler gives every
image the same noise in a group as alone (:func:`flowlift.upscale.sizes.pass_noise`), so there a batch
equals one-by-one runs to float rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from flowlift.jobs.batch import ITEM_ERRORS

__all__ = ["SameSizeBatches", "header_size"]


def header_size(path: Path) -> tuple[int, int] | None:
    """(width, height) as :func:`flowlift.files.images.load_image` will return it, from the header
    (:func:`flowlift.files.images.image_size`); None when the header is unreadable or refused."""
    from flowlift.errors import FlowliftError
    from flowlift.files.images import image_size

    try:
        return image_size(path)
    except FlowliftError:  # an unreadable file gets its own group; load_image reports it
        return None


class SameSizeBatches:
    """``process(source, output)``: upscale ``source``, computing its same-size group at once.

    ``sources``: the pending inputs in the order ``run_jobs`` will visit them. ``compute(paths)``
    returns one result per path (raises for the group); ``save(path, output, result)`` writes one.
    """

    def __init__(
        self,
        sources: Sequence[Path],
        batch_size: int,
        compute: Callable[[list[Path]], list[Any]],
        save: Callable[[Path, Path, Any], None],
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.compute = compute
        self.save = save
        self.group_of: dict[Path, list[Path]] = {}
        open_groups: dict[object, list[Path]] = {}
        for index, path in enumerate(sources):
            size = header_size(path)
            key: object = size if size is not None else ("unreadable", index)
            group = open_groups.get(key)
            if group is None or len(group) >= batch_size:
                group = open_groups[key] = []
            group.append(path)
            self.group_of[path] = group
        self.ready: dict[Path, Any] = {}
        self.batches_run = 0

    def __call__(self, source: Path, output: Path) -> None:
        if source not in self.ready:
            group = [p for p in self.group_of.get(source, [source]) if p == source or p not in self.ready]
            try:
                results = self.compute(group)
                self.batches_run += 1
            except ITEM_ERRORS:
                if len(group) == 1:
                    raise
                for path in group:  # retry alone: each input's own error, on its own turn
                    self.group_of[path] = [path]
                results = [self.compute([source])]
                self.batches_run += 1
                group = [source]
            self.ready.update(zip(group, results, strict=True))
        self.save(source, output, self.ready.pop(source))
