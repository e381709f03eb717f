"""The exact chunked executor: equal to the plain forward for any strips, and its strip kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch.utils.flop_counter import FlopCounterMode

from flowlift.errors import FlowliftError
from flowlift.models import upscaler_unet as U
from flowlift.upscale.chunked import budget as B
from flowlift.upscale.chunked import executor as E
from flowlift.upscale.chunked import strip_kernels as K


def small_model(seed: int = 0, base: int = 16) -> U.FlowUpscalerUNet:
    torch.manual_seed(seed)
    model = U.FlowUpscalerUNet(base_channels=base, time_dim=32, cond_dim=64).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:  # non-trivial norm affines and biases
                param.normal_(0.1, 0.5)
    return model


def inputs(batch: int, height: int, width: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    sample = torch.randn(batch, 32, height, width, generator=gen)
    small = torch.randn(batch, 32, height // 2, width // 2, generator=gen) * 2 + 0.5
    timestep = torch.tensor([1000.0, 437.5, 12.0][:batch])
    return sample, timestep, small


@pytest.mark.parametrize(
    ("batch", "height", "width", "chunks"), [(2, 20, 28, (3, 7)), (1, 12, 16, (1, 5, 1000)), (1, 36, 8, (4,))]
)
def test_executor_equals_plain_forward_for_any_chunk(batch, height, width, chunks):
    model = small_model()
    sample, timestep, small = inputs(batch, height, width)
    with torch.no_grad():
        reference = model(sample, timestep, small)
    for chunk in chunks:
        out = E.ChunkedExecutor(model, chunk=chunk)(sample, timestep, small)
        assert out.shape == reference.shape
        assert (out - reference).abs().max().item() <= 1e-4, chunk


def test_a_channels_last_model_runs_channels_last_frames_and_equals_its_plain_forward(monkeypatch):
    """A bf16 CPU model is channels-last: its frames follow, so a strip is a dense channels-last row range (NCHW
    frames made every strip a transposing copy and every convolution a reorder: 2x the plain pass's CPU time)."""
    model = small_model()
    assert E._model_memory_format(model) == torch.contiguous_format
    model = model.to(torch.bfloat16).to(memory_format=torch.channels_last)
    assert E._model_memory_format(model) == torch.channels_last
    sample, timestep, small = (t.to(torch.bfloat16) for t in inputs(2, 20, 28))
    made = []
    empty = torch.empty

    def recording(*args, **kwargs):
        frame = empty(*args, **kwargs)
        made.append(frame)
        return frame

    monkeypatch.setattr(E.torch, "empty", recording)
    out = E.ChunkedExecutor(model, chunk=3)(sample, timestep, small)
    monkeypatch.undo()
    frames = [f for f in made if f.dim() == 4 and f.shape[1] > 1 and f.shape[2] * f.shape[3] > 1]
    assert frames and all(f.is_contiguous(memory_format=torch.channels_last) for f in frames)
    with torch.no_grad():
        reference = model(sample, timestep, small)
    assert (out.float() - reference.float()).abs().max().item() <= 0.05 * reference.float().abs().max().item()


def test_executor_reproduces_golden_vectors(shared):
    path = shared / "golden" / "flow_upscaler_base64.safetensors"
    with safe_open(str(path), framework="pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    model = U.FlowUpscalerUNet(base_channels=64).eval()
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")}, strict=True)
    for case, chunk in (("case0", 5), ("case1", 3)):
        out = E.ChunkedExecutor(model, chunk=chunk, offload_device="cpu")(
            tensors[f"{case}.sample"], tensors[f"{case}.timestep"], tensors[f"{case}.latents_small"]
        )
        assert (out - tensors[f"{case}.velocity"]).abs().max().item() <= 1e-4


def test_executor_does_not_recompute_convolutions():
    model = small_model()
    sample, timestep, small = inputs(1, 24, 16)
    counts = []
    for fn in (model, E.ChunkedExecutor(model, chunk=5)):
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            fn(sample, timestep, small)
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] > 0


def test_executor_works_with_one_step_upscale_and_rejects_bad_input():
    model = small_model()
    sample, _, small = inputs(1, 16, 16)
    executor = E.ChunkedExecutor(model, chunk=4)
    with torch.no_grad():
        expected = U.one_step_upscale(model, sample, small)
    assert (U.one_step_upscale(executor, sample, small) - expected).abs().max().item() <= 1e-4
    with pytest.raises(FlowliftError):
        executor(sample, 1000.0, small[:, :, :4])
    with pytest.raises(ValueError):
        E.ChunkedExecutor(model, chunk=0)


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("height", [1, 2, 7, 10])
def test_conv_rows_equals_full_convolution(stride, height):
    x = torch.randn(2, 3, height, 5)
    weight, bias = torch.randn(4, 3, 3, 3), torch.randn(4)
    full = F.conv2d(x, weight, bias, stride=stride, padding=1)
    out_h = full.shape[2]
    for step in (1, 2, 3):
        strips = [
            E.conv_rows(lambda a, b: x[:, :, a:b], height, weight, bias, stride, (1, 1), a, min(a + step, out_h))
            for a in range(0, out_h, step)
        ]
        assert torch.allclose(torch.cat(strips, 2), full, atol=1e-5)


@pytest.mark.parametrize(
    ("in_size", "out_size"), [((5, 7), (10, 14)), ((4, 6), (7, 9)), ((6, 4), (3, 5)), ((2, 3), (3, 3))]
)
def test_resize_rows_equals_interpolate(in_size, out_size):
    x = torch.randn(2, 3, *in_size)
    full = F.interpolate(x, size=out_size, mode="bilinear", align_corners=False)
    for step in (1, 2, 5):
        strips = [
            E.resize_rows(lambda a, b: x[:, :, a:b], in_size, out_size, a, min(a + step, out_size[0]))
            for a in range(0, out_size[0], step)
        ]
        assert torch.allclose(torch.cat(strips, 2), full, atol=1e-6)


def test_bilinear_taps_formula():
    i0, i1, lam = E.bilinear_taps(4, 8, 0, 8)
    assert i0.tolist() == [0, 0, 0, 1, 1, 2, 2, 3]
    assert i1.tolist() == [1, 1, 1, 2, 2, 3, 3, 3]
    assert lam.tolist() == [0.0, 0.25, 0.75, 0.25, 0.75, 0.25, 0.75, 0.25]


def test_channel_stats_merge_is_exact_and_stable():
    x = torch.randn(2, 8, 13, 6) * 0.5 + 1000.0  # large mean: naive sum-of-squares would cancel
    stats = None
    for a in range(0, 13, 4):
        part = E.ChannelStats.of(x[:, :, a : a + 4], torch.float64)
        stats = part if stats is None else stats.merge(part)
    var, mean = torch.var_mean(x.double(), dim=(2, 3), correction=0)
    assert stats.count == 13 * 6
    assert torch.allclose(stats.mean, mean, rtol=1e-7)
    assert torch.allclose(stats.m2 / stats.count, var, rtol=1e-4)


@pytest.mark.parametrize("shape", [(1, 24, 5, 7), (2, 24, 5, 7), (2, 1, 3, 4), (1, 24, 1, 9)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_as_nchw_is_contiguous_with_the_same_values_and_stats_do_not_depend_on_the_layout(shape, dtype):
    x = torch.randn(shape).to(dtype)
    for layout in (torch.channels_last, torch.contiguous_format):
        y = x.contiguous(memory_format=layout)
        out = K.as_nchw(y)
        assert out.is_contiguous() and out.dtype == dtype and torch.equal(out, x)
    sliced = torch.randn(2, 8, 9, 7)[:, :, 1:6]  # neither layout
    assert torch.equal(K.as_nchw(sliced), sliced.contiguous())
    a, b = (
        E.ChannelStats.of(x.contiguous(memory_format=f), torch.float64)
        for f in (torch.channels_last, torch.contiguous_format)
    )
    assert torch.equal(a.mean, b.mean) and torch.equal(a.m2, b.m2)  # the same kernel on the same values


@pytest.mark.parametrize("batch", [1, 2])
def test_affine_silu_rounds_as_the_plain_forward_in_bf16_and_once_in_float32(batch):
    """bf16: the affine map rounded to bf16, then SiLU rounded (GroupNorm's and SiLU's two roundings in the plain
    forward); float32: ``silu(x * scale + shift)`` as before."""
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(batch, 16, 6, 5, generator=gen) * 3).contiguous(memory_format=torch.channels_last)
    scale, shift = torch.rand(batch, 16, generator=gen) + 0.5, torch.randn(batch, 16, generator=gen)
    affine = x * scale[:, :, None, None] + shift[:, :, None, None]
    assert torch.equal(
        E.affine_silu(x, scale, shift), F.silu(torch.addcmul(shift[..., None, None], x, scale[..., None, None]))
    )
    half = x.to(torch.bfloat16)
    out = E.affine_silu(half, scale, shift)
    assert out.dtype == torch.bfloat16 and out.is_contiguous(memory_format=torch.channels_last)
    rounded = (half.float() * scale[:, :, None, None] + shift[:, :, None, None]).to(torch.bfloat16)
    expected = F.silu(rounded.float()).to(torch.bfloat16)
    assert (out.float() - expected.float()).abs().max() <= 2**-7 * expected.float().abs().max()  # one bf16 step
    exact_affine = half.double() * scale.double()[:, :, None, None] + shift.double()[:, :, None, None]
    truth = F.silu(exact_affine)
    # two roundings of 2**-9: the affine value's (SiLU's slope is under 1.1) and the output's
    assert ((out.double() - truth).abs() <= 2**-8 * (exact_affine.abs() + truth.abs()) + 1e-6).all()
    assert not torch.equal(affine, affine.to(torch.bfloat16).float())  # the test's values do round


def test_group_norm_affine_equals_group_norm():
    norm = torch.nn.GroupNorm(4, 12, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(3, 12, 5, 7) * 3 + 2
    scale, shift = E.group_norm_affine(E.ChannelStats.of(x, torch.float64), norm)
    with torch.no_grad():
        expected = norm(x)
    assert torch.allclose(x * scale[:, :, None, None] + shift[:, :, None, None], expected, atol=1e-5)


def test_should_chunk_by_size_with_force_and_forbid():
    assert B.plain_peak_bytes(256, 256) == int(B.PLAIN_PEAK_FRAMES * 384 * 256 * 256 * 4)
    assert B.plain_peak_bytes(256, 256, dtype=torch.bfloat16) * 2 == B.plain_peak_bytes(256, 256)
    assert not B.should_chunk(128, 128, "cpu")
    assert B.should_chunk(1024, 1024, "cpu")
    assert B.should_chunk(16, 16, "cpu", force=True)
    assert not B.should_chunk(4096, 4096, "cpu", force=False)
    need = B.plain_peak_bytes(64, 64)
    assert B.should_chunk(64, 64, "cpu", budget_bytes=need - 1)
    assert not B.should_chunk(64, 64, "cpu", budget_bytes=need)


# -- issue 13: budget-sized strips, offloaded stores with predicted (double-buffered) reads ----------


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize(("batch", "height", "width", "chunk"), [(2, 20, 28, 3), (1, 36, 8, 4), (1, 12, 16, 5)])
def test_offloaded_stores_equal_plain_forward(batch, height, width, chunk, prefetch):
    """The offload path (row-major stores, predicted reads, write-back invalidation) on the CPU: real
    copies, so a stale prediction (a read served from rows written after it was taken) shows as an error."""
    model = small_model()
    sample, timestep, small = inputs(batch, height, width)
    with torch.no_grad():
        reference = model(sample, timestep, small)
    executor = E.ChunkedExecutor(model, chunk=chunk, prefetch=prefetch)
    executor.stage_on_same_device = True
    out = executor(sample, timestep, small)
    assert (out - reference).abs().max().item() <= 1e-4
    stores = executor.stores_used
    assert stores is not None
    if not prefetch:
        assert stores.hits == 0


def test_offloaded_reads_are_mostly_predicted_with_many_strips():
    model = small_model()
    sample, timestep, small = inputs(1, 64, 16)
    with torch.no_grad():
        reference = model(sample, timestep, small)
    executor = E.ChunkedExecutor(model, chunk=2)
    executor.stage_on_same_device = True
    out = executor(sample, timestep, small)
    assert (out - reference).abs().max().item() <= 1e-4
    assert executor.stores_used.hits > 2 * executor.stores_used.misses


def test_offloaded_stores_drop_predictions_overwritten_before_use():
    from flowlift.upscale.chunked.strip_io import OffloadedStores

    stores = OffloadedStores(torch.device("cpu"), torch.float32, torch.device("cpu"))
    frame = torch.arange(2 * 3 * 12 * 4, dtype=torch.float32).view(2, 3, 12, 4)
    store = stores.from_tensor(frame)
    assert torch.equal(stores.read(store, 0, 3), frame[:, :, 0:3])
    assert torch.equal(stores.read(store, 3, 6), frame[:, :, 3:6])  # stride 3 seen: rows 6..9 predicted
    stores.write(store, 7, 8, torch.full((2, 3, 1, 4), -1.0))  # overwrites a predicted row
    expected = frame.clone()
    expected[:, :, 7] = -1.0
    assert torch.equal(stores.read(store, 6, 9), expected[:, :, 6:9])
    assert torch.equal(stores.read(store, 9, 12), expected[:, :, 9:12])  # predicted, untouched: a hit
    assert stores.hits == 1


def test_strip_rows_come_from_the_budget():
    model = small_model(base=16)
    sizes = {"batch": 1, "base_channels": 16, "dtype": torch.float32}
    per_row = B.strip_bytes_per_row(64, **sizes)
    stores = B.chunked_store_bytes(48, 64, **sizes)
    # offloaded: the whole budget is strips
    executor = E.ChunkedExecutor(model, offload_device="meta", budget_bytes=12 * per_row)
    assert executor.strip_rows(1, 48, 64) == 10
    # on the device the stores come off first
    executor = E.ChunkedExecutor(model, budget_bytes=stores + 12 * per_row)
    assert executor.strip_rows(1, 48, 64) == 10
    assert E.ChunkedExecutor(model, budget_bytes=stores + 1000 * per_row).strip_rows(1, 48, 64) == 48
    assert E.ChunkedExecutor(model, budget_bytes=1).strip_rows(1, 48, 64) == 1
    # an explicit chunk wins; on the CPU without a budget the cache-sized default stays
    assert E.ChunkedExecutor(model, chunk=7, budget_bytes=1).strip_rows(1, 48, 64) == 7
    assert E.ChunkedExecutor(model).strip_rows(1, 48, 64) == B.default_chunk(64)


def test_budget_sized_executor_equals_plain_forward():
    model = small_model()
    sample, timestep, small = inputs(1, 24, 20)
    with torch.no_grad():
        reference = model(sample, timestep, small)
    budget = B.chunked_store_bytes(24, 20, base_channels=16) + 7 * B.strip_bytes_per_row(20, base_channels=16)
    executor = E.ChunkedExecutor(model, budget_bytes=budget)
    out = executor(sample, timestep, small)
    assert executor.last_chunk == 5
    assert (out - reference).abs().max().item() <= 1e-4


def test_on_strip_reports_every_strip_and_can_cancel():
    model = small_model(seed=3)
    sample, small = torch.randn(1, 32, 24, 20), torch.randn(1, 32, 12, 10)
    expected = E.ChunkedExecutor(model, chunk=5)(sample, 1000.0, small)
    seen = []
    executor = E.ChunkedExecutor(model, chunk=5, on_strip=lambda done, total: seen.append((done, total)))
    out = executor(sample, 1000.0, small)
    assert torch.equal(out, expected)  # the hook changes nothing
    total = executor.count_strips(sample, 1000.0, small)
    assert total > 20 and seen == [(i, total) for i in range(1, total + 1)]

    class Cancelled(Exception):
        pass

    def cancel_at_third(done: int, total: int) -> None:
        if done == 3:
            raise Cancelled

    with pytest.raises(Cancelled):
        E.ChunkedExecutor(model, chunk=5, on_strip=cancel_at_third)(sample, 1000.0, small)
