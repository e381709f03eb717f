"""Per input of an upscale, from its header only: the passes that run, the output's name and size, the cap's note.

:class:`OutputSizes` is what every door's plan asks about each input (the command line's and the app's
:mod:`flowlift.upscale.plan`, the progress plan's :meth:`OutputSizes.planned_image`); :func:`format_limit_problem`
says when the output's format cannot hold that size. No torch here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowlift.errors import FlowliftError
from flowlift.jobs.batch import Target, error_line
from flowlift.upscale.asked_size import AskedSize
from flowlift.upscale.outputs import output_name

if TYPE_CHECKING:
    from flowlift.upscale.stages import PlannedImage

__all__ = ["FORMAT_MAX_SIDE", "OutputSizes", "format_limit_problem"]

#: Largest side each output format can store (WebP's 14-bit dimensions; JPEG's 16-bit).
FORMAT_MAX_SIDE = {".webp": 16383, ".jpg": 65535, ".jpeg": 65535}


class OutputSizes:
    """Per input, from its header only: the passes that will run (the cap may drop some), what the output is
    named by, the (width, height) a complete output has, whether the decoded frame is resampled to it, and the
    line that says when the cap dropped passes (so that the command prints it before any work).

    ``asked``: an :class:`~flowlift.upscale.asked_size.AskedSize` (or a number of passes, the scale ``2**N``). A
    power-of-two scale is the passes' own output, the cap dropping whole passes (named by the scale that ran);
    any other request is its exact size, refused in one line when over 8x, over the cap or below the input.
    ``fraction_last`` (a latent upscaler, :mod:`flowlift.upscale.latent_fraction`): such a request runs one pass
    fewer and leaves the fraction to SesquiLSR, refused in one line when a side falls outside its [1, 2].
    """

    def __init__(self, asked: AskedSize | int, resize_mode: str, fraction_last: bool = False) -> None:
        self.asked = asked if isinstance(asked, AskedSize) else AskedSize.of_passes(asked)
        self.resize_mode = resize_mode
        self.fraction_last = fraction_last
        self._cache: dict[Path, tuple[int, tuple[int, int] | None, str | None, Any]] = {}
        self._input: dict[Path, tuple[int, int] | None] = {}  # each header's (width, height), None: unreadable

    @property
    def passes(self) -> int:
        """The passes of a power-of-two request (0 for any other: those depend on the input)."""
        return self.asked.passes

    def _plan(self, path: Path) -> tuple[int, tuple[int, int] | None, str | None, Any]:
        from flowlift.files.images import image_size

        if path not in self._cache:
            try:
                width, height = image_size(path)
            except FlowliftError:  # unreadable: named by the request, it fails in its own step (one line)
                self._input[path] = None
                self._cache[path] = max(1, self.passes), None, None, self.asked.named_by(self.asked.size or (0, 0))
                return self._cache[path]
            self._input[path] = width, height
            self._cache[path] = self._sized(path, width, height)
        return self._cache[path]

    def _sized(self, path: Path, width: int, height: int) -> tuple[int, tuple[int, int], str | None, Any]:
        from flowlift.upscale.latent_fraction import fraction_passes
        from flowlift.upscale.sizes import (
            MAX_OUTPUT_SIDE,
            dropped_passes_message,
            no_pass_fits,
            planned_passes,
            upscaled_size,
        )

        try:
            target = None if self.asked.power_of_two else self.asked.target(width, height)
        except FlowliftError as error:  # its field kept, for the door to say (``--size``)
            raise FlowliftError(f"{path}: {error.template}", field=error.fields) from None
        fraction = self.fraction_last and target is not None
        try:  # SesquiLSR for the fraction: its passes, each side left 1-2x (else one line, before any work)
            asked = fraction_passes(height, width, self.resize_mode, target) if fraction else None
        except FlowliftError as error:
            raise FlowliftError(f"{path}: {error.template}", field=error.fields) from None
        if asked is None:
            asked = self.asked.passes if target is None else self.asked.passes_for(width, height)
        run = planned_passes(height, width, asked, self.resize_mode, MAX_OUTPUT_SIDE)
        if run == 0 and not fraction:
            raise FlowliftError(f"{path}: {no_pass_fits(width, height)}")
        note = None
        if run < asked:
            note = dropped_passes_message(width, height, asked, run, self.resize_mode)
            if target is not None:
                note += f"; then resampled up to the asked {target[0]}x{target[1]}"
        if target is None:
            out_h, out_w = upscaled_size(height, width, run, self.resize_mode)
            return run, (out_w, out_h), note, 2**run
        return run, target, note, self.asked.named_by(target)

    def passes_for(self, path: Path) -> int:
        """The passes that run for ``path``: the requested ones, fewer when the cap drops some."""
        return self._plan(path)[0]

    def input_size(self, path: Path) -> tuple[int, int] | None:
        """``path``'s (width, height) from its header, None when it cannot be read (read once, with the plan)."""
        self._plan(path)
        return self._input[path]

    def planned_image(self, path: Path) -> PlannedImage:
        """``path``'s upscale as its stages are planned (:class:`~flowlift.upscale.stages.PlannedImage`): the passes
        that run, the input's and the output's megapixels, whether SesquiLSR sizes the latents (a header that cannot
        be read: 1 megapixel, a planning weight only: its own step says what is wrong)."""
        from flowlift.upscale.latent_fraction import fraction_runs
        from flowlift.upscale.stages import PlannedImage

        passes, out, _, _ = self._plan(path)
        size = self._input[path]
        if out is None or size is None:
            return PlannedImage(path.name, passes, 1.0)
        width, height = size
        fraction = (
            self.fraction_last
            and not self.asked.power_of_two
            and fraction_runs(height, width, self.resize_mode, passes, out)
        )
        return PlannedImage(path.name, passes, width * height / 1e6, out[0] * out[1] / 1e6, fraction)

    def named_by(self, path: Path) -> float | tuple[int, int]:
        """What ``path``'s output name carries: the scale that runs (``_x4``, ``_x1.5``) or the size (``_WxH``)."""
        return self._plan(path)[3]

    def output_size(self, path: Path) -> tuple[int, int] | None:
        return self._plan(path)[1]

    def resample_to(self, path: Path) -> tuple[int, int] | None:
        """The (width, height) the decoded frame is resampled to (the asked size), None for a power of two."""
        return None if self.asked.power_of_two else self._plan(path)[1]

    def dropped_note(self, path: Path) -> str | None:
        """``Flow Upscaler: 20 pass(es) on a 64x48 image would exceed ...`` when the cap drops passes, else None."""
        return self._plan(path)[2]

    def target(self, path: Path, single_file: Path | None, folder: Path | None, output_format: str) -> Target:
        """Where ``path``'s output goes (``single_file``, else ``<folder or next to it>/<stem>_x<N>.<format>``),
        the size it must have, or why it has none (unreadable header, over the cap or the format's limit)."""
        try:
            out = single_file or (folder or path.parent) / output_name(path, self.named_by(path), output_format)
        except FlowliftError as error:
            return Target(path, None, error_line(error))
        size = self.output_size(path)
        note = self.dropped_note(path) or ""  # said before any work if the job runs
        return Target(path, out, format_limit_problem(out, size), expected_size=size, warning=note)


def format_limit_problem(out: Path, size: tuple[int, int] | None) -> str:
    """Why ``out``'s format cannot hold an image of ``size`` (``""`` when it can)."""
    limit = FORMAT_MAX_SIDE.get(out.suffix.lower())
    if limit is None or size is None or max(size) <= limit:
        return ""
    return f"output {out} would be {size[0]}x{size[1]}, over {out.suffix} format's {limit} px limit; write it as png"
