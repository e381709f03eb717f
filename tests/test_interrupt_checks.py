"""A front-end's interrupt check runs between every layer, strip and tile of every stage (issue 32, class I).

``FlowUpscalerPipeline(check_interrupt=...)`` is how ComfyUI's node stops on Interrupt (its
``throw_exception_if_processing_interrupted``): the check runs before every leaf module of the upscaler and the
VAE (so inside a plain pass too), after every strip of a chunked pass and every decode tile, and before every strip
of the colour fix. Here an 8x image upscale (TAEF2, a tiny UNet) counts the checks of each stage, is stopped at
checks all through the run, leaves no hook behind, and gives the same image bit for bit with the check. The
longest gap between two checks is printed (the worst case an interrupt waits, on this machine).
"""

from __future__ import annotations

import time

import pytest
import torch

from builders import tiny_unet
from flowlift.upscale.pipeline import FlowUpscalerPipeline

pytestmark = pytest.mark.usefixtures("single_thread_torch")


class Stop(Exception):
    pass


class Checks:
    """Counts checks per stage (the pipeline's stage callback closes each) and raises at check number ``stop_at``."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.count, self.stop_at, self.stages, self.times = 0, stop_at, [], [time.perf_counter()]

    def __call__(self) -> None:
        self.count += 1
        self.times.append(time.perf_counter())
        if self.stop_at is not None and self.count >= self.stop_at:
            raise Stop

    def stage(self, name: str) -> None:
        self.stages.append((name, self.count - sum(n for _, n in self.stages)))


@pytest.fixture(scope="module")
def pipeline(shared):
    return FlowUpscalerPipeline(tiny_unet(seed=0), shared / "models" / "taef2", device="cpu", dtype=torch.float32)


def _image() -> torch.Tensor:
    return torch.rand(1, 3, 64, 96, generator=torch.Generator().manual_seed(3))


def _run(pipeline, checks: Checks | None, *, chunked: bool = False) -> torch.Tensor:
    pipeline.check_interrupt, pipeline.chunked, pipeline.vae_tiled = checks, chunked, chunked
    pipeline.chunk_rows = 16 if chunked else None
    try:
        return pipeline.upscale_image(
            _image(), 3, seed=1, output_type="pt", callback=None if checks is None else checks.stage
        )
    finally:
        pipeline.check_interrupt = None


def _hooks(pipeline) -> int:
    modules = [*pipeline.upscaler.modules(), *pipeline.vae.model.modules()]
    return sum(len(m._forward_pre_hooks) for m in modules)


@pytest.mark.parametrize("chunked", [False, True])
def test_every_stage_is_checked_and_the_result_is_unchanged(pipeline, chunked):
    plain = _run(pipeline, None, chunked=chunked)
    checks = Checks()
    checked = _run(pipeline, checks, chunked=chunked)
    assert torch.equal(plain, checked)
    names = [name for name, _ in checks.stages]
    assert names == ["encode", "pass 1/3", "pass 2/3", "pass 3/3", "decode", "color fix"]
    counts = dict(checks.stages)
    for name in ("pass 1/3", "pass 2/3", "pass 3/3"):
        assert counts[name] >= 20, (name, counts)  # the UNet's layers (plain) or its strips and layers (chunked)
    assert counts["encode"] > 10 and counts["decode"] > 10, counts  # TAEF2's layers (and tiles)
    assert counts["color fix"] >= 3  # its strips (two lookups of the low band and the result, at least one each)
    gaps = [b - a for a, b in zip(checks.times, checks.times[1:], strict=False)]
    print(f"chunked={chunked}: {checks.count} checks, longest gap {max(gaps) * 1000:.1f} ms")
    assert _hooks(pipeline) == 0


def test_a_check_that_raises_stops_the_run_anywhere_and_leaves_no_hook(pipeline):
    total = Checks()
    _run(pipeline, total, chunked=True)
    for stop_at in sorted({1, 2, total.count // 4, total.count // 2, 3 * total.count // 4, total.count}):
        checks = Checks(stop_at)
        with pytest.raises(Stop):
            _run(pipeline, checks, chunked=True)
        assert checks.count == stop_at  # stopped at the very check that raised
        assert _hooks(pipeline) == 0
    assert torch.equal(_run(pipeline, None), _run(pipeline, None))  # still usable, unhooked
