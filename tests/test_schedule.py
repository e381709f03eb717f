import math
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from flowlift.flux2.schedule import (
    canvas_denoising_start,
    compute_empirical_mu,
    flux2_sigmas,
    linear_denoising_start,
    time_shift_flux2,
)

SEQ_LENS = [256, 1024, 4096, 4300, 4301, 16384]  # 256 px ... 2048 px images, both sides of the 4300 switch


def diffusers_sigmas(num_steps, seq_len):
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type="exponential")
    mu = compute_empirical_mu(seq_len, num_steps)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / num_steps, num_steps), mu=mu)
    return scheduler.sigmas


def _diffusers_compute_empirical_mu():
    """diffusers' own FLUX.2 ``compute_empirical_mu``, read from its source file.

    Importing the pipeline module needs transformers; the function itself does not, so it is
    extracted with ``ast`` and executed alone.
    """
    import ast
    import importlib.util

    spec = importlib.util.find_spec("diffusers")
    path = Path(spec.origin).parent / "pipelines" / "flux2" / "pipeline_flux2.py"
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "compute_empirical_mu")
    namespace: dict = {}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace["compute_empirical_mu"]


def test_mu_matches_diffusers_pipeline():
    reference = _diffusers_compute_empirical_mu()
    for seq in SEQ_LENS:
        for steps in (1, 4, 9, 20, 30, 50):
            assert compute_empirical_mu(seq, steps) == pytest.approx(reference(seq, steps), abs=1e-12)


@pytest.mark.parametrize("num_steps", [4, 9, 20, 30])
@pytest.mark.parametrize("seq_len", SEQ_LENS)
def test_full_schedule_equals_diffusers_scheduler(num_steps, seq_len):
    ours = flux2_sigmas(num_steps, seq_len)
    ref = diffusers_sigmas(num_steps, seq_len)
    assert ours.shape == ref.shape == (num_steps + 1,)
    assert torch.allclose(ours, ref.to(torch.float32), atol=1e-6, rtol=0)


def test_time_shift_endpoints_and_monotonic():
    for mu in (0.5, 1.15, 2.5):
        assert time_shift_flux2(mu, 0.0) == 0.0
        assert time_shift_flux2(mu, 1.0) == pytest.approx(1.0)
        t = torch.linspace(0, 1, 101, dtype=torch.float64)
        shifted = time_shift_flux2(mu, t)
        assert shifted[0] == 0 and shifted[-1] == pytest.approx(1.0)
        assert torch.all(shifted[1:] > shifted[:-1])
        assert torch.all(shifted[1:-1] > t[1:-1])  # the shift pushes sigmas towards noise
    assert time_shift_flux2(1.0, 0.5) == pytest.approx(math.e / (math.e + 1))


@pytest.mark.parametrize("start,end", [(0.0, 1.0), (0.3, 1.0), (0.129, 1.0), (0.5, 0.9), (0.0, 0.6), (0.99, 1.0)])
def test_clipped_schedule_endpoints_and_interior(start, end):
    full = flux2_sigmas(20, 4096)
    clipped = flux2_sigmas(20, 4096, denoising_start=start, denoising_end=end)
    assert clipped[0].item() == pytest.approx(1 - start, abs=1e-7)
    assert clipped[-1].item() == pytest.approx(1 - end, abs=1e-7)
    assert torch.all(clipped[1:] < clipped[:-1]), "strictly decreasing, no duplicated endpoints"
    interior = set(clipped[1:-1].tolist())
    kept = {s for s in full.tolist() if (1 - end) < s < (1 - start)}
    assert interior == kept, "the points in between are the shifted schedule's own"


def test_img2img_uses_the_full_schedules_mu_not_the_clipped_one():
    # The interior points must not depend on the window: same points as the full 30-step schedule.
    full = flux2_sigmas(30, 1024)
    clipped = flux2_sigmas(30, 1024, denoising_start=0.5)
    assert all(any(abs(s - f) < 1e-9 for f in full.tolist()) for s in clipped[1:-1].tolist())
    # ... and they are shifted: the linear schedule's points are not in it.
    linear = torch.linspace(1, 1 / 30, 30)
    assert not any(abs(s - lin) < 1e-6 for s in clipped[1:-1].tolist() for lin in linear.tolist())


def test_schedule_floor_and_bad_windows():
    sigmas = flux2_sigmas(9, 4096)
    assert sigmas[-1] == 0 and sigmas[-2] > 0.4  # a distilled model is never run near sigma 0
    with pytest.raises(ValueError):
        flux2_sigmas(9, 4096, denoising_start=0.5, denoising_end=0.5)
    with pytest.raises(ValueError):
        flux2_sigmas(0, 4096)


def test_strength_maps():
    assert linear_denoising_start(0.3) == pytest.approx(0.7)
    assert canvas_denoising_start(0.5) == pytest.approx(1 - 0.5**0.2)
    assert canvas_denoising_start(1.0) == 0.0 and canvas_denoising_start(0.0) == 1.0
    with pytest.raises(ValueError):
        canvas_denoising_start(1.5)
