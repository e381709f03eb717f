"""``flowlift eval``'s pairs mode: images already made, measured against the inputs they were made from.

:func:`evaluate_pairs` pairs the outputs with their inputs by file name, checks every pair's sizes from the
headers before anything is measured (:func:`check_pair_sizes`, :func:`check_ground_truth_sizes`), says which
outputs it leaves out (:func:`warn_left_out`) and measures each pair with
:func:`flowlift.measure.evaluate.measure` into an :class:`~flowlift.measure.evaluate.EvalReport`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from flowlift.errors import FlowliftError
from flowlift.files.naming import index_by_stem
from flowlift.measure import metrics as M
from flowlift.measure.evaluate import MEASURE_DEFAULTS, EvalReport, MeasureSettings, measure, y_shave
from flowlift.measure.inputs import default_crop, input_crop, load_rgb


def evaluate_pairs(
    outputs: Sequence[str | Path],
    reference: str | Path,
    ground_truth: str | Path | None = None,
    *,
    measuring: MeasureSettings = MEASURE_DEFAULTS,
    label: str = "outputs",
    figure_images: int = 3,
    progress: bool | None = False,
) -> EvalReport:
    """Measure existing ``outputs`` (files/folders) against their files in ``reference`` (and
    ``ground_truth``): the same stem, or ``<stem>_x<N>`` / ``<stem>_x<N>_colorfix`` (``flowlift upscale``'s
    and ``flowlift colorfix``'s names) with ``<stem>`` (:func:`flowlift.files.naming.pair_by_stem`); one
    output file given with one reference file is a pair whatever their names. Images without a
    counterpart are skipped; none paired is an error, and so is a pair that is not an upscale by one
    integer factor on both axes (:func:`check_pair_sizes`). ``measuring``: how each output is measured
    (:class:`~flowlift.measure.evaluate.MeasureSettings`: the box, PSNR-Y's luma)."""
    from flowlift.console import progress_bar
    from flowlift.files.images import image_size, list_images
    from flowlift.files.naming import explicit_pair, pair_by_stem
    from flowlift.knobs import check_kind

    check_kind("measuring", measuring, MeasureSettings, "a MeasureSettings")
    box = measuring.box
    out_paths = list_images([str(o) for o in outputs])
    index_by_stem(out_paths, "outputs")
    named = explicit_pair([str(o) for o in outputs], [str(reference)])
    if named is not None:
        pairs, unpaired = [named], []
    else:
        pairs, unpaired = pair_by_stem(out_paths, list_images([str(reference)]))
    check_pair_sizes(pairs)
    gts = index_by_stem(list_images([str(ground_truth)]), "ground truth") if ground_truth is not None else None
    # keyed by the reference's stem: kodim01_x2.png (an upscale output) is the image "kodim01"
    outs = {ref.stem: out for out, ref in pairs if gts is None or ref.stem in gts}
    refs = {ref.stem: ref for _, ref in pairs}
    names = sorted(outs)
    if not names:
        raise FlowliftError(
            "no output file pairs with a reference (same stem, or <stem>_x<N> for <stem>)"
            + (" that has a ground truth file" if gts is not None else "")
        )
    left_out = sorted([p.name for p in unpaired] + [out.name for out, ref in pairs if ref.stem not in outs])
    if left_out:
        warn_left_out(left_out, len(names), gts is not None)
    if gts is not None:
        check_ground_truth_sizes([(outs[name], refs[name], gts[name]) for name in names])
    if box is not None:  # before anything is measured, from the headers
        for name in names:
            M.check_box_inside(box, image_size(outs[name]), f"output {outs[name]}")
    report = EvalReport(
        config={
            "mode": "pairs",
            "outputs": [str(o) for o in outputs],
            "reference": str(reference),
            "ground_truth": None if ground_truth is None else str(ground_truth),
            "box": box,
            "y_channel": measuring.y_channel,
            "images": names,
            "unpaired_outputs": sorted(
                [p.stem for p in unpaired] + [out.stem for out, ref in pairs if ref.stem not in outs]
            ),
        }
    )
    report.crop_columns = ["input", label] + (["ground truth"] if gts is not None else [])
    for c in report.crop_columns:
        report.crops[c] = {}
    report.results[label] = {}
    with progress_bar(names, desc="eval", unit="img", enabled=progress) as bar:
        for i, name in enumerate(bar):
            out = load_rgb(outs[name])
            ref = load_rgb(refs[name])
            gt = load_rgb(gts[name]) if gts is not None else None
            try:
                report.results[label][name] = measure(out, ref, gt, measuring)
            except FlowliftError as error:
                raise FlowliftError(f"{outs[name]}: {error}") from None
            report.computed += 1
            if i < figure_images:
                crop = default_crop((out.shape[1], out.shape[0]), box)
                report.crops["input"][name] = input_crop(ref, (out.shape[1], out.shape[0]), crop)
                report.crops[label][name] = M.as_uint8_rgb(M.crop_box(out, crop))  # a figure's crops: 8 bits
                if gt is not None:
                    report.crops["ground truth"][name] = M.as_uint8_rgb(M.crop_box(gt, crop))
    return report


def warn_left_out(names: Sequence[str], measured: int, with_ground_truth: bool) -> None:
    """One warning line for outputs that are not measured (no reference of their name, or no ground truth)."""
    import warnings

    from flowlift.errors import FlowliftWarning

    needs = "a reference" + (" and a ground truth" if with_ground_truth else "") + " of its name"
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    warnings.warn(
        FlowliftWarning(f"{len(names)} output(s) left out, each without {needs}: {shown} ({measured} measured)"),
        stacklevel=3,
    )


def check_ground_truth_sizes(triples: Sequence[tuple[Path, Path, Path]]) -> None:
    """Refuse (one line, before anything is measured) an (output, reference, ground truth) whose ground truth is
    not the output's size, or whose output is too small for SSIM-Y once :func:`y_shave` px are cut off each
    border. Sizes come from the headers."""
    from flowlift.files.images import image_size

    for output, reference, truth in triples:
        (w, h), (rw, rh), truth_size = image_size(output), image_size(reference), image_size(truth)
        if truth_size != (w, h):
            raise FlowliftError(
                f"{output}: {w}x{h}, but its ground truth {truth} is {truth_size[0]}x{truth_size[1]} "
                "(PSNR and SSIM compare images of one size)"
            )
        shave = y_shave((h, w), (rh, rw))
        if min(w, h) < M.SSIM_WINDOW + 2 * shave:
            raise FlowliftError(
                f"{output}: {w}x{h} is too small for SSIM-Y: {M.SSIM_WINDOW + 2 * shave} px a side at least "
                f"({M.SSIM_WINDOW} px window, {shave} px off each border at this scale); measure it without "
                "--ground-truth"
            )


def check_pair_sizes(pairs: Sequence[tuple[Path, Path]]) -> None:
    """Refuse (one :class:`FlowliftError` line, before anything is measured) any (output, reference)
    pair whose sizes are not ``s`` times one another for one integer ``s >= 1`` on both axes
    (:func:`flowlift.upscale.colorfix_image.integer_scale`, the rule ``flowlift colorfix`` applies):
    the drift metrics compare ``s x s`` block means of the output with the reference's pixels, which
    means nothing for a downscale or a stretched image. Sizes come from the headers."""
    from flowlift.files.images import image_size
    from flowlift.upscale.colorfix_image import integer_scale

    bad = []
    for output, ref in pairs:
        try:
            integer_scale(image_size(output), image_size(ref), minimum=1)
        except FlowliftError as error:
            bad.append(f"{output} against its reference {ref}: {error}")
    if bad:
        more = f" (and {len(bad) - 1} more such pair(s))" if len(bad) > 1 else ""
        raise FlowliftError(bad[0] + more)
