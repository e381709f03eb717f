"""A refine's stages for :mod:`flowlift.progress`: the same names and planned work at every door.

:func:`refine_stages` plans one refine (encode, the hires fix's upscale, the sampling steps, decode, writing) with
work in planned seconds per megapixel (:data:`SECONDS_PER_MP`; only the ratios matter, the run measures its own
speed); the refiner reports the stages as they run (:func:`flowlift.progress.report_stage` in ``encode``/``decode``,
each sampling step, the hires fix's upscale), and the door reports loading and writing.
"""

from __future__ import annotations

from typing import Any

#: Planned seconds per megapixel (``steps``: per step) of each refine stage: FLUX.2 VAE encode and decode, a
#: transformer step, the hires fix's Flow Upscaler passes (per megapixel of the result), writing the file.
SECONDS_PER_MP = {"encode": 2.82, "upscale": 4.17, "steps": 10.0, "decode": 3.61, "writing": 0.14}


def refine_stages(name: str, input_mp: float, frame_mp: float, steps: int, upscale: bool) -> list[tuple[str, float]]:
    """The stages of one refine of ``name`` (an ``input_mp`` megapixel image refined at ``frame_mp``), in order::

    encode (input), [upscale (frame): the hires fix], steps (steps x frame), decode (frame), writing (frame)
    """
    cost = SECONDS_PER_MP
    stages = [("encode", input_mp * cost["encode"])]
    stages += [("upscale", frame_mp * cost["upscale"])] if upscale else []
    stages += [
        ("steps", max(1, steps) * frame_mp * cost["steps"]),
        ("decode", frame_mp * cost["decode"]),
        ("writing", frame_mp * cost["writing"]),
    ]
    return [(f"{name}: {stage}", work) for stage, work in stages]


def plan_job_stages(run: Any, job: Any, steps: int) -> None:
    """Plan a :class:`~flowlift.refine.jobs.RefineJob`'s stages on ``run`` (``steps``: the steps it samples) and
    name them by the input (or the output, for a txt2img)."""
    from pathlib import Path

    request = job.request
    name = Path(request.image if request.image is not None else job.output).name
    height, width = job.frame
    input_mp = job.rgb.width * job.rgb.height / 1e6 if job.rgb is not None else 0.0
    run.plan(refine_stages(name, input_mp, height * width / 1e6, steps, request.mode == "hires"))
    run.group = name
