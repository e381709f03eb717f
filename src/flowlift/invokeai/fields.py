"""The pack's InvokeAI input fields made from flowlift's knob tables (one declaration, every door derives it).

No ``from __future__ import annotations`` here: InvokeAI reads the fields' types at class creation.
"""

from typing import Any

from invokeai.invocation_api import InputField

from flowlift.knobs import Knob

CATEGORY = "flowlift"
SEED_DESCRIPTION = "Noise seed (each pass draws its own stream on the CPU, so a seed means the same result anywhere)"


def knob_field(knob: Knob, description: str | None = None, **extra: Any) -> Any:
    """An InvokeAI ``InputField`` from a knob of the tables: its default (a choice as the node packs label it),
    its range (``ge``/``le``), its grid (``multiple_of``) and its help as the description.

    A knob's ``step`` (the sliders' increment at the other doors) has no place here: InvokeAI 6's field API takes
    no step, and its node editor steps a number field by the schema's ``multipleOf``, which pydantic and the editor
    also enforce as a rule, so ``scale``'s 0.05 would refuse 1.37 (and, in the editor's float modulo, 0.15). The
    fields step by InvokeAI's own default instead; ``multiple_of`` is only a knob's ``multiple``, a real rule."""
    kwargs: dict[str, Any] = {"default": knob.label(knob.default) if knob.choices else knob.default}
    if not knob.choices:
        kwargs.update(ge=knob.low, le=knob.high)
    if knob.multiple:
        kwargs["multiple_of"] = knob.multiple
    kwargs.update(extra)  # e.g. a node's own default
    return InputField(description=description or knob.help[:1].upper() + knob.help[1:], **kwargs)


def text_knob_field(knob: Knob, description: str) -> Any:
    """A text field for a number knob that also takes words (``tile_size``: px, auto or off): its default and
    its domain in words; its type (:func:`~flowlift.invokeai.latents.knob_text`) checks the value as it arrives."""
    return InputField(default=str(knob.default), description=f"{description} ({knob.describe()})")
