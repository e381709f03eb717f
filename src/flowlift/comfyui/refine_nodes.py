"""The Tiled FLUX.2 Refine node (ComfyUI's V3 schema): MODEL in, a patched clone out.

The clone's ``model_function_wrapper`` is :class:`~flowlift.comfyui.tiled_model.TiledModelFunction`: every
model call of every ComfyUI sampler, scheduler and guider downstream runs in flowlift's overlapping tiles, the
predictions blended at every step (flowlift's refine core, :mod:`flowlift.refine.tiled_velocity`). The three
inputs are the refine knob table's (:data:`flowlift.refine.settings.TILE_KNOBS`): ``tile_size`` and
``tile_batch`` take numbers and words (``auto``), so they are text widgets checked by the tiling parse when the
node runs; ``tile_overlap`` is a number widget with the knob's default, minimum, maximum and step.
"""

from __future__ import annotations

import comfy.model_base
import comfy.model_management as mm
import comfy.model_patcher
import comfy.patcher_extension
from comfy_api.latest import io

from flowlift.comfyui.layouts import widget_range
from flowlift.comfyui.loaders import CATEGORY
from flowlift.comfyui.tiled_model import TiledModelFunction
from flowlift.errors import FlowliftError
from flowlift.knobs import Knob, labels
from flowlift.refine.settings import TILE_BATCH, TILE_KNOBS, TILE_OVERLAP, TILE_SIZE
from flowlift.refine.tiling import TileRequest

NODE_ID = "FlowliftTiledFlux2Refine"
TITLE = "Tiled FLUX.2 Refine (flowlift)"


def text_knob_input(name: str, knob: Knob) -> io.String.Input:
    """A text widget for a number knob that also takes words (``tile_size``: px, auto or off): the knob's default
    and its help with its domain in words as tooltip; the value is checked when the node runs."""
    return io.String.Input(name, default=str(knob.default), tooltip=f"{knob.help} ({knob.describe()})")


def number_knob_input(name: str, knob: Knob) -> io.Int.Input:
    """An INT widget with the knob's default, minimum, maximum (always given: :func:`~flowlift.comfyui.layouts.
    widget_range`) and step, and its help as tooltip."""
    return io.Int.Input(name, default=knob.default, step=knob.step, tooltip=knob.help, **widget_range(knob))


class FlowliftTiledFlux2Refine(io.ComfyNode):
    """MODEL -> MODEL: a FLUX.2 model whose every call runs in overlapping tiles, blended per step."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID,
            display_name=TITLE,
            category=CATEGORY,
            description="Patches a FLUX.2 model so that every sampler step runs it in overlapping tiles of the "
            "latent and blends their predictions (flowlift's tiled refine: no seams, no seam-fix pass). Put it "
            "before a KSampler refining a large latent, e.g. after Flow Upscale Latent 4x; 'auto' leaves frames "
            "up to 4 MP untouched.",
            inputs=[
                io.Model.Input("model", tooltip="a FLUX.2 model (UNETLoader, CheckpointLoader)"),
                text_knob_input("tile_size", TILE_SIZE),
                number_knob_input("tile_overlap", TILE_OVERLAP),
                text_knob_input("tile_batch", TILE_BATCH),
            ],
            outputs=[io.Model.Output(tooltip="the same model, patched: connect it to the sampler")],
        )

    @classmethod
    def execute(
        cls, model: comfy.model_patcher.ModelPatcher, tile_size: str, tile_overlap: int, tile_batch: str
    ) -> io.NodeOutput:
        try:
            request = TileRequest.parse(tile_size, tile_overlap, tile_batch)
        except FlowliftError as error:
            raise FlowliftError(f"{TITLE}: {error.worded(labels(TILE_KNOBS))}") from None
        base = getattr(model, "model", None)
        if not isinstance(base, comfy.model_base.Flux2):
            raise FlowliftError(f"{TITLE}: needs a FLUX.2 model, got {type(base).__name__}")
        patched = model.clone()
        previous = patched.model_options.get("model_function_wrapper")
        if isinstance(previous, TiledModelFunction):  # an earlier Tiled FLUX.2 Refine: this one replaces it
            previous = previous.previous
            patched.model_options.pop("model_function_wrapper")
            patched.remove_wrappers_with_key(comfy.patcher_extension.WrappersMP.PREPARE_SAMPLING, NODE_ID)
            if previous is not None:
                patched.set_model_unet_function_wrapper(previous)
        if request.size == "off":  # the model as it was before any tiled refine
            return io.NodeOutput(patched)
        wrapper = TiledModelFunction(request, mm.throw_exception_if_processing_interrupted, previous, TITLE)
        patched.set_model_unet_function_wrapper(wrapper)
        patched.add_wrapper_with_key(
            comfy.patcher_extension.WrappersMP.PREPARE_SAMPLING, NODE_ID, wrapper.prepare_sampling
        )
        return io.NodeOutput(patched)
