"""flowlift.models.fused_conv: a conv and its activation (and residual add) in one oneDNN pass, bf16 CPU only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cpu_features import FUSED_BF16, needs_fused_bf16
from flowlift.models import fused_conv
from flowlift.models.fused_conv import conv_act, conv_add_act, fusable

BF16 = torch.bfloat16
CL = torch.channels_last
HAS_FUSED_OP = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_convolution_pointwise")


def _conv(cin: int, cout: int, k: int, groups: int = 1, dtype: torch.dtype = BF16) -> nn.Conv2d:
    torch.manual_seed(cin * 7 + cout + k)
    conv = nn.Conv2d(cin, cout, k, padding=k // 2, groups=groups)
    return conv.to(dtype).to(memory_format=CL).requires_grad_(False)


def _input(c: int, dtype: torch.dtype = BF16, h: int = 21, w: int = 17) -> torch.Tensor:
    return torch.randn(1, c, h, w, generator=torch.Generator().manual_seed(c)).to(dtype).contiguous(memory_format=CL)


def _float32(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    k = conv.kernel_size[0]
    return F.conv2d(x.float(), conv.weight.float(), conv.bias.float(), 1, k // 2, 1, conv.groups)


@needs_fused_bf16
@pytest.mark.parametrize(
    ("cin", "cout", "k", "groups"), [(64, 64, 3, 1), (384, 1536, 1, 1), (48, 48, 3, 48), (64, 3, 3, 1)]
)
def test_bf16_relu_is_the_unfused_pair_bit_for_bit(cin, cout, k, groups):
    conv, x = _conv(cin, cout, k, groups), _input(cin)
    assert fusable(x, conv)
    assert torch.equal(conv_act(x, conv, "relu"), torch.relu(conv(x)))


@needs_fused_bf16
@pytest.mark.parametrize(("cin", "cout", "k", "groups"), [(384, 1536, 1, 1), (48, 48, 3, 48)])
def test_bf16_gelu_rounds_once_so_it_is_nearer_float32_than_the_unfused_pair(cin, cout, k, groups):
    conv, x = _conv(cin, cout, k, groups), _input(cin)
    fused, unfused, exact = conv_act(x, conv, "gelu"), F.gelu(conv(x)), F.gelu(_float32(conv, x))
    assert fused.dtype == BF16 and fused.is_contiguous(memory_format=CL)
    # One rounding of the float32 result: within half a bf16 step (2^-8 relative) of it.
    assert ((fused.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()
    assert (fused.float() - exact).abs().mean() < (unfused.float() - exact).abs().mean()


@needs_fused_bf16
@pytest.mark.parametrize("activation", [None, "relu"])
def test_bf16_residual_add_is_the_float32_sum_rounded_once(activation):
    conv, x = _conv(64, 64, 3), _input(64)
    other = _input(64, h=21, w=17).mul_(3)
    before = other.clone()
    exact = _float32(conv, x) + other.float()
    exact = exact if activation is None else exact.relu()
    fused = conv_add_act(x, conv, other, activation)
    assert torch.equal(other, before)  # the residual is read, never written
    assert ((fused.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()
    # views of a larger frame (a tile and its halo) and a plain-layout residual give the same
    tile = conv_add_act(x[:, :, 2:19, 3:15], conv, other[:, :, 2:19, 3:15].contiguous(), activation)
    exact_tile = _float32(conv, x[:, :, 2:19, 3:15]) + other[:, :, 2:19, 3:15].float()
    exact_tile = exact_tile if activation is None else exact_tile.relu()
    assert ((tile.float() - exact_tile).abs() <= exact_tile.abs() * 2**-8 + 1e-6).all()


def test_float32_is_never_fused_and_equals_the_layers():
    conv, x = _conv(64, 64, 3, dtype=torch.float32), _input(64, torch.float32)
    other = _input(64, torch.float32)
    assert not fusable(x, conv)
    assert torch.equal(conv_act(x, conv, "gelu"), F.gelu(conv(x)))
    assert torch.equal(conv_act(x, conv, "relu"), torch.relu(conv(x)))
    assert torch.equal(conv_add_act(x, conv, other, "relu"), torch.relu(conv(x) + other))
    assert torch.equal(conv_add_act(x, conv, other, None), conv(x) + other)


def test_without_the_fused_op_bf16_runs_the_layers(monkeypatch):
    monkeypatch.setattr(fused_conv, "_WORKS", {BF16: False})
    conv, x, other = _conv(64, 64, 3), _input(64), _input(64)
    assert not fusable(x, conv)
    assert torch.equal(conv_act(x, conv, "gelu"), F.gelu(conv(x)))
    assert torch.equal(conv_add_act(x, conv, other, "relu"), torch.relu(conv(x) + other))


def test_a_grouped_conv_takes_no_fused_add():
    conv, x, other = _conv(48, 48, 3, groups=48), _input(48), _input(48)
    assert torch.equal(conv_add_act(x, conv, other, "relu"), torch.relu(conv(x) + other))


def test_reflect_padding_is_never_fused():
    conv, x = _conv(16, 16, 3), _input(16)
    conv.padding_mode = "reflect"
    assert not fusable(x, conv)
    assert torch.equal(conv_act(x, conv, "relu"), torch.relu(conv(x)))


@pytest.mark.parametrize(("cin", "cout", "k", "groups"), [(64, 64, 3, 1), (384, 1536, 1, 1), (48, 48, 3, 48)])
def test_torchs_flop_counter_counts_a_fused_conv_as_the_conv(cin, cout, k, groups):
    """FlopCounterMode sees the fused ops (an uncounted fused model would read as a fraction of its work)."""
    from torch.utils.flop_counter import FlopCounterMode

    conv, x = _conv(cin, cout, k, groups), _input(cin)
    fusable(x, conv)  # the one-time probe, outside the counters
    with torch.no_grad():
        with FlopCounterMode(display=False) as plain:
            conv(x)
        with FlopCounterMode(display=False) as fused:
            conv_act(x, conv, "relu")
        with FlopCounterMode(display=False) as added:
            conv_add_act(x, conv, _input(cout), None)
    assert plain.get_total_flops() > 0
    assert fused.get_total_flops() == plain.get_total_flops() == added.get_total_flops()
    if fusable(x, conv) and groups == 1:  # the in-place add (TAEF2's Block writes over its own input)
        other = _input(cout)
        with torch.no_grad(), FlopCounterMode(display=False) as in_place:
            geometry = (list(conv.padding), list(conv.stride), list(conv.dilation), conv.groups)
            torch.ops.mkldnn._convolution_pointwise_.binary(
                other, x, conv.weight, conv.bias, *geometry, "add", None, "relu", [], ""
            )
        assert in_place.get_total_flops() == plain.get_total_flops()


def test_a_conv_that_needs_a_gradient_runs_the_layers_and_backpropagates():
    """The fused op has no backward: with autograd recording for the input or the weights, the layers run."""
    conv, x = _conv(16, 16, 3), _input(16)
    conv.requires_grad_(True)
    assert not fusable(x, conv)
    y = conv_add_act(x, conv, _input(16), "relu")
    conv_act(x, conv, "gelu").float().sum().add(y.float().sum()).backward()
    assert conv.weight.grad is not None and torch.isfinite(conv.weight.grad.float()).all()
    with torch.no_grad():
        assert fusable(x, conv) == (HAS_FUSED_OP and fused_conv._fused_op_works(BF16))


@pytest.mark.parametrize("activation", ["relu", "gelu", "swish"])
def test_a_nan_or_inf_stays_non_finite_through_every_activation(activation):
    """oneDNN's plain ReLU is max(x, 0), which turns NaN into 0: a model's NaN would vanish into a plausible image
    (issue 43's class). The ReLU runs as oneDNN's leaky ReLU with a 2**-149 slope, which keeps NaN; GELU and
    SiLU keep non-finite values non-finite, as torch's."""
    conv, x = _conv(16, 16, 3), _input(16)
    x[0, :, 4, 4] = float("nan")
    x[0, :, 10, 10] = float("inf")
    with torch.no_grad():
        out = conv_act(x, conv, activation)
        added = conv_add_act(x, conv, _input(16), activation)
    for y in (out, added):
        assert not torch.isfinite(y[0, :, 3:6, 3:6]).all(1).any()  # every pixel that reads the NaN
        assert not torch.isfinite(y[0, :, 9:12, 9:12]).all(1).any()


@pytest.fixture
def subnormals_at_full_speed(monkeypatch):
    """This CPU counted as one whose subnormal products are cheap (an AMD's), whatever runs the tests."""
    monkeypatch.setattr(fused_conv, "cpu_subnormals_at_full_speed", lambda: True)
    monkeypatch.setattr(fused_conv, "_RELU_WORKS", {})


@needs_fused_bf16
@pytest.mark.usefixtures("subnormals_at_full_speed")
def test_the_bf16_relu_runs_in_the_convolutions_pass(monkeypatch):
    """The ReLU is fused (oneDNN's leaky ReLU): torch's separate ReLU pass is not called, and the result is
    ``relu`` bit for bit (a zero may come out as -0.0, which equals 0.0)."""
    conv, x = _conv(64, 64, 3), _input(64)
    expected = torch.relu(conv(x))

    def separate(_):
        raise AssertionError("the ReLU ran as a separate pass")

    monkeypatch.setitem(fused_conv.ACTIVATIONS, "relu", separate)
    assert torch.equal(conv_act(x, conv, "relu"), expected)


@pytest.mark.skipif(not HAS_FUSED_OP, reason="this torch has no oneDNN fused convolution")
@pytest.mark.usefixtures("subnormals_at_full_speed")
def test_the_fused_relu_is_exact_for_large_negative_sums():
    """The slope's products round to a bfloat16 zero for every sum down to -32768 (the design's bound)."""
    conv = nn.Conv2d(1, 1, 1).to(BF16).to(memory_format=CL).requires_grad_(False)
    with torch.no_grad():
        conv.weight.fill_(1.0)
        conv.bias.zero_()
    values = torch.tensor([-32768.0, -1000.0, -1.0, -1e-30, -0.0, 0.0, 1e-30, 3.0, 60000.0])
    x = values.to(BF16).reshape(1, 1, 1, -1).contiguous(memory_format=CL)
    assert torch.equal(conv_act(x, conv, "relu"), torch.relu(x))


@pytest.mark.skipif(not HAS_FUSED_OP, reason="this torch has no oneDNN fused convolution")
def test_where_subnormal_products_are_slow_the_relu_runs_after_the_fused_convolution(monkeypatch):
    """On an Intel CPU the leaky ReLU's subnormal products each take a microcode assist (TAEF2's decode at 1.45x
    its CPU time): the convolution runs fused as before, torch's ReLU after it, and the values are the same."""
    monkeypatch.setattr(fused_conv, "cpu_subnormals_at_full_speed", lambda: False)
    monkeypatch.setattr(fused_conv, "_RELU_WORKS", {})
    conv, x = _conv(64, 64, 3), _input(64)
    with torch.no_grad():
        expected = torch.relu(conv(x))
    calls = []
    monkeypatch.setitem(fused_conv.ACTIVATIONS, "relu", lambda t: calls.append(t) or torch.relu_(t))
    monkeypatch.setattr(fused_conv, "_fused_relu", lambda *args: pytest.fail("the subnormal-slope ReLU ran"))
    with torch.no_grad():
        assert torch.equal(conv_act(x, conv, "relu"), expected)
    assert len(calls) == 1


def test_without_a_nan_keeping_fused_relu_bf16_runs_torchs_relu(monkeypatch):
    """Where the probe finds the fused ReLU dropping a NaN (or unequal to relu), torch's ReLU runs after the conv."""
    monkeypatch.setattr(fused_conv, "_probe_relu", lambda dtype: False)
    monkeypatch.setattr(fused_conv, "_RELU_WORKS", {})
    conv, x = _conv(16, 16, 3), _input(16)
    x[0, :, 4, 4] = float("nan")
    with torch.no_grad():
        out = conv_act(x, conv, "relu")
    assert torch.equal(out.isnan(), torch.relu(conv(x)).isnan()) and out.isnan().any()


def test_the_probe_fuses_exactly_where_the_cpu_runs_the_fused_bf16_op():
    """flowlift's one-time probe says fused where oneDNN's fused bf16 convolution runs (AVX512, AMX) and unfused
    where it raises (an AVX2-only CPU): a broken probe would silently drop the fused path, or crash the decode."""
    fused_conv._WORKS.pop(BF16, None)
    assert fused_conv._fused_op_works(BF16) == FUSED_BF16
