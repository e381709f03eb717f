"""The page's Gradio controls that every tab builds alike: a knob's slider or number field (its range, step and
default are the knob's), the seed, the image input and the before/after result column.

Gradio is passed in (``gr``), never imported here: it is the optional ``app`` extra.
"""

from __future__ import annotations

from typing import Any

from flowlift.knobs import SEED, Knob


def knob_slider(gr: Any, knob: Knob, **kwargs: Any) -> Any:
    """A ``gr.Slider`` over ``knob``'s range, at its default, in its step; ``kwargs`` the tab's words (label, info)."""
    return gr.Slider(knob.low, knob.high, value=knob.default, step=knob.step, **kwargs)


def knob_number(gr: Any, knob: Knob, **kwargs: Any) -> Any:
    """A ``gr.Number`` over ``knob``: its default, its range, its step where it has one, no decimals for an integer;
    ``kwargs`` the tab's words and any value of its own (a default that is not the knob's)."""
    given: dict[str, Any] = {"value": knob.default, "minimum": knob.low, "maximum": knob.high}
    if knob.step is not None:
        given["step"] = knob.step
    if knob.kind is int:
        given["precision"] = 0
    return gr.Number(**{**given, **kwargs})


def seed_number(gr: Any, **kwargs: Any) -> Any:
    """The seed field of every tab, from :data:`flowlift.knobs.SEED` (its default and range)."""
    return knob_number(gr, SEED, label="Seed", **kwargs)


def image_input(gr: Any, label: str, elem_id: str) -> Any:
    """One image in: dropped, pasted or clicked, handed over as a file path (opened by flowlift, not Gradio)."""
    return gr.Image(label=label, type="filepath", image_mode=None, sources=["upload", "clipboard"], elem_id=elem_id)


def result_column(gr: Any, prefix: str, slider_label: str) -> tuple[Any, Any, Any]:
    """The before/after slider, the full-resolution download and the summary line of a tab (``<prefix>-slider``...)."""
    slider = gr.ImageSlider(label=slider_label, type="pil", format="png", elem_id=f"{prefix}-slider")
    download = gr.File(label="Full-resolution PNG", elem_id=f"{prefix}-download")
    info = gr.Markdown(elem_id=f"{prefix}-info")
    return slider, download, info
