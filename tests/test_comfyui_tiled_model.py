"""The tiled refine's ComfyUI model function wrapper (flowlift.comfyui.tiled_model) without ComfyUI.

A stand-in ``apply_model`` with ComfyUI's calling convention (``apply_model(x, sigma, **c)`` -> the denoised
prediction ``x - sigma * v``) whose velocity depends on the whole input it gets (so a tile is not a crop of the
whole frame's result). The real server runs the node in tests/test_comfyui_tiled_refine.py.
"""

from __future__ import annotations

import logging

import pytest
import torch

from flowlift.comfyui.tiled_model import TiledModelFunction
from flowlift.errors import FlowliftError
from flowlift.flux2.latents import patchify, unpatchify
from flowlift.refine.tiled_velocity import TiledVelocity
from flowlift.refine.tiling import TileRequest, tile_layout


class FakeModel:
    """apply_model in ComfyUI's convention; records each call's batch and conditioning shapes."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def velocity(self, x: torch.Tensor, c_crossattn: torch.Tensor, ref_latents=None) -> torch.Tensor:
        v = torch.tanh(x) + x.mean(dim=(1, 2, 3), keepdim=True) + c_crossattn.mean(dim=(1, 2)).view(-1, 1, 1, 1)
        if ref_latents is not None:
            v = v + sum(ref.mean(dim=(1, 2, 3)).view(-1, 1, 1, 1) for ref in ref_latents)
        return v

    def __call__(self, x, timestep, c_crossattn, transformer_options, ref_latents=None, **rest):
        assert c_crossattn.shape[0] == x.shape[0] == timestep.shape[0]
        assert ref_latents is None or all(ref.shape[0] == x.shape[0] for ref in ref_latents)
        self.calls.append({"batch": x.shape[0], "size": tuple(x.shape[-2:])})
        return x - timestep.view(-1, 1, 1, 1) * self.velocity(x, c_crossattn, ref_latents)


def call(wrapper, model, x, sigma=0.7, **conditioning):
    c = {"c_crossattn": torch.ones(x.shape[0], 4, 8), "transformer_options": {}} | conditioning
    return wrapper(model, {"input": x, "timestep": torch.full((x.shape[0],), sigma), "c": c, "cond_or_uncond": [0]})


def latent(batch=1, h=8, w=12, seed=0):
    return torch.randn(batch, 128, h, w, generator=torch.Generator().manual_seed(seed))


def test_untiled_is_the_model_function_itself_bit_for_bit():
    x = latent()
    for size in ("auto", 256, 192):  # auto below 4 MP; a tile at least as large as the 192x128 px frame
        model = FakeModel()
        out = call(TiledModelFunction(TileRequest.parse(size, 32)), model, x)
        assert torch.equal(out, call(lambda m, a: m(a["input"], a["timestep"], **a["c"]), FakeModel(), x))
        assert model.calls == [{"batch": 1, "size": (8, 12)}]


def test_tiles_equal_the_refine_cores_tiled_velocity_and_batches_equal_single_tiles(caplog):
    x, sigma = latent(), 0.7
    model = FakeModel()
    reference = TiledVelocity(
        lambda crops, _s: unpatchify(model.velocity(patchify(crops), torch.ones(crops.shape[0], 4, 8))),
        tile_layout(128, 192, 64, 32),
    )
    expected = x - sigma * patchify(reference(unpatchify(x), sigma))
    with caplog.at_level(logging.INFO, logger="flowlift"):
        for batch, calls in ((1, 15), (2, 8), (4, 4)):
            model = FakeModel()
            got = call(TiledModelFunction(TileRequest.parse(64, 32, batch)), model, x, sigma)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
            assert len(model.calls) == calls and model.calls[0] == {"batch": batch, "size": (4, 4)}
    lines = [r.getMessage() for r in caplog.records if "Tiled FLUX.2 Refine" in r.getMessage()]
    assert lines[0] == "flowlift: Tiled FLUX.2 Refine: 192x128 px in 3x5 tiles of 64x64 px, overlap 32 px, 1 per call"
    assert (got - call(TiledModelFunction(TileRequest.parse("off")), FakeModel(), x)).abs().max() > 1e-2


def test_batched_latents_and_reference_latents_run_per_tile(caplog):
    x, ref = latent(batch=2), [latent(batch=2, h=3, w=5, seed=1)]
    model = FakeModel()
    with caplog.at_level(logging.INFO, logger="flowlift"):
        got = call(TiledModelFunction(TileRequest.parse(64, 32, 4)), model, x, ref_latents=ref)
    # the grid line records what ran (one tile of both latents per call), not the tile batch asked for
    lines = [r.getMessage() for r in caplog.records if "Tiled FLUX.2 Refine" in r.getMessage()]
    assert lines == ["flowlift: Tiled FLUX.2 Refine: 192x128 px in 3x5 tiles of 64x64 px, overlap 32 px, 1 per call"]
    assert {c["batch"] for c in model.calls} == {2} and len(model.calls) == 15  # a batch of 2: one tile per call
    for item in range(2):  # each batch item equals its own tiled run
        alone = call(
            TiledModelFunction(TileRequest.parse(64, 32)),
            FakeModel(),
            x[item : item + 1],
            ref_latents=[ref[0][item : item + 1]],
        )
        torch.testing.assert_close(got[item : item + 1], alone, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("key", "words"),
    [
        ("c_concat", "c_concat"),
        ("control", "ControlNet"),
        ("attention_mask", "attention mask"),
        ("y_extra", "'y_extra'"),
    ],
)
def test_frame_wide_or_unknown_conditioning_is_refused_with_one_line(key, words):
    wrapper = TiledModelFunction(TileRequest.parse(64, 32), where="Tiled FLUX.2 Refine (flowlift)")
    with pytest.raises(FlowliftError) as caught:
        call(wrapper, FakeModel(), latent(), **{key: torch.ones(1, 128, 8, 12)})
    text = str(caught.value)
    assert "\n" not in text and words in text
    assert text.startswith("Tiled FLUX.2 Refine (flowlift): cannot refine in tiles")
    call(wrapper, FakeModel(), latent(), **{key: None})  # an absent entry is no entry


def test_other_latents_are_refused():
    with pytest.raises(FlowliftError, match=r"needs FLUX.2 latents \(batch, 128, h, w\), got \(1, 16, 8, 12\)"):
        call(TiledModelFunction(TileRequest.parse(64, 32)), FakeModel(), torch.zeros(1, 16, 8, 12))


@pytest.mark.parametrize("size", [64, "off", "auto", 256])  # tiled, and untiled (auto below 4 MP, a whole tile)
def test_nan_latents_and_a_nan_model_output_are_one_line_not_an_all_nan_latent(size):
    x = latent()
    x[0, 5, 3, 4] = float("nan")
    with pytest.raises(FlowliftError, match="the sampler's latents hold NaN/Inf"):
        call(TiledModelFunction(TileRequest.parse(size, 32)), FakeModel(), x)

    class Overflowing(FakeModel):
        def velocity(self, x, c_crossattn, ref_latents=None):
            return torch.full_like(x, float("inf"))

    with pytest.raises(FlowliftError, match="the model's output holds NaN/Inf"):
        call(TiledModelFunction(TileRequest.parse(size, 32)), Overflowing(), latent())


def test_interrupt_is_checked_before_every_tile_and_stops_between_tiles():
    checks = []

    def check():
        checks.append(1)
        if len(checks) == 4:
            raise InterruptedError

    model = FakeModel()
    with pytest.raises(InterruptedError):
        call(TiledModelFunction(TileRequest.parse(64, 32), check_interrupt=check), model, latent())
    assert len(model.calls) == 3  # tiles 1-3 ran, the 4th never started


def test_an_earlier_wrapper_runs_per_tile():
    seen = []

    def earlier(apply_model, args):
        seen.append(tuple(args["input"].shape))
        return apply_model(args["input"], args["timestep"], **args["c"]) * 2

    got = call(TiledModelFunction(TileRequest.parse(64, 32), previous=earlier), FakeModel(), latent())
    alone = call(TiledModelFunction(TileRequest.parse(64, 32)), FakeModel(), latent())
    assert seen == [(1, 128, 4, 4)] * 15
    torch.testing.assert_close(got, 2 * alone, rtol=0, atol=1e-5)


def test_comfyuis_memory_estimate_is_made_for_one_tiled_call():
    shapes = []

    def executor(model, noise_shape, conds, model_options=None, force_full_load=False):
        shapes.append(noise_shape)
        return "loaded"

    cases = [
        (TileRequest.parse(), [1, 128, 256, 256], [1, 128, 64, 64]),  # auto at 4096 px: 1024 px tiles
        (TileRequest.parse(), [1, 128, 128, 128], [1, 128, 128, 128]),  # auto at 2048 px: untouched
        (TileRequest.parse(64, 32, 2), [1, 128, 8, 12], [2, 128, 4, 4]),  # two tiles per call
        (TileRequest.parse(64, 32, 2), [2, 128, 8, 12], [2, 128, 4, 4]),  # a batch of two: one tile per call
        (TileRequest.parse(256, 32), [1, 128, 8, 12], [1, 128, 8, 12]),  # one tile: the frame
    ]
    for request, latent_shape, expected in cases:
        wrapper = TiledModelFunction(request)
        assert wrapper.prepare_sampling(executor, "model", torch.Size(latent_shape), {}, model_options={}) == "loaded"
        assert shapes[-1] == expected, (request, latent_shape)
