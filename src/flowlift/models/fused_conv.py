"""Convolutions with the activation (and the residual add) after them done in the same pass, on the CPU in bf16.

On the CPU torch runs a convolution through oneDNN, then the activation (and a residual ``+ x``) as separate
element-wise passes over the output, which on a wide, cheap layer cost as much as the layer: a DiCo block's
1x1 ``384 -> 1536`` convolution and its GELU, measured on a 2-core AMD EPYC (Zen 4, AVX512-BF16) in bfloat16
channels-last, take 119 ms against 92 ms when oneDNN applies the GELU to its float32 sums before rounding
(``torch.ops.mkldnn._convolution_pointwise``, the fused kernel torch's own compiler emits). docs/cpu.md, issue 47.

**When**: a bfloat16 input on the CPU, the conv's padding zeros (``padding_mode="zeros"``), nothing that needs a
gradient (the fused op has no backward), and oneDNN's fused op present and working in this torch (probed once
on a tiny input). Everything else, float32 above all, runs
the unfused layers: float32 results stay the released model's bit for bit.

**Exactness in bfloat16**: the fused op rounds once, after the activation and the add, where the unfused
path rounds the convolution's output, then the activation's (and the sum's): ``gelu``, ``swish`` and the
residual add are the same maths rounded once instead of two or three times (closer to float32; the models'
bf16 error vs float32 is stated in docs/cpu.md).

**The ReLU as oneDNN's leaky ReLU**: oneDNN's plain ReLU is ``max(x, 0)``, which turns a NaN into 0, so a NaN or
Inf made inside a model (finite weights that overflow, issue 43) would vanish into a plausible image. Its leaky
ReLU, ``x > 0 ? x : slope * x``, keeps NaN (the comparison fails, ``slope * NaN`` is NaN) and keeps -Inf; with
the smallest float32 as the slope (:data:`RELU_SLOPE`, 2**-149) every negative sum down to -32768 gives a product
below bfloat16's smallest subnormal, which rounds to zero: the fused ReLU equals ``relu`` in bfloat16 up to the
sign of a zero (below -32768, a negative value under 1e-40 in magnitude where relu gives 0). The probe checks
both on this torch (a NaN must come out NaN) and falls back to torch's own ReLU after the convolution when either
fails. A ReLU after a fused residual add runs as torch's in-place pass (oneDNN takes only its plain ReLU after an add).
On TAEF2's decode the ReLUs after the convolutions were 0.3 CPU-s of separate passes on a 2-core AMD EPYC (docs/cpu.md,
issue 47). **Only where subnormal products are cheap**: every element's product with the slope is a float32
subnormal, which an Intel CPU computes through a microcode assist (flush-to-zero is off): on an Intel Xeon with AMX
the fused ReLU made TAEF2's 3072x2048 decode take 20.8 CPU-s against 14.3 with torch's ReLU after the convolution,
so the fusion runs on the CPUs :func:`~flowlift.devices.cpu_subnormals_at_full_speed` names (AMD's), torch's ReLU
elsewhere; both give the same values.
GELU and SiLU keep NaN and Inf non-finite, as torch's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from flowlift.devices import cpu_subnormals_at_full_speed

#: The activations this module applies, each in its unfused form (oneDNN's name is the same but for the ReLU,
#: which runs as its leaky ReLU with :data:`RELU_SLOPE`); they run in the convolution's pass where :func:`fusable`.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": lambda t: torch.relu_(t),
    "gelu": F.gelu,  # the exact (erf) GELU: oneDNN's "gelu" with algorithm "none"
    "swish": lambda t: F.silu(t, inplace=True),  # SiLU, x * sigmoid(x): oneDNN's "swish" with alpha 1
}

#: Activations oneDNN applies in the convolution's pass (the ReLU as its leaky ReLU, see above).
FUSED_ACTIVATIONS = frozenset({"gelu", "swish", "relu"})
#: The fused ReLU's negative slope: the smallest float32, so ``slope * x`` rounds to a bfloat16 zero for every
#: ``|x| <= 32768`` while ``slope * NaN`` stays NaN (oneDNN's zero-slope ReLU is ``max(x, 0)``: NaN -> 0).
RELU_SLOPE = 2.0**-149
_FUSED_DTYPES = (torch.bfloat16,)
_WORKS: dict[torch.dtype, bool] = {}
_RELU_WORKS: dict[torch.dtype, bool] = {}


def _fused_op_works(dtype: torch.dtype) -> bool:
    """Whether oneDNN's fused convolution runs here in ``dtype`` and agrees with the unfused layers (once)."""
    if dtype not in _WORKS:
        _WORKS[dtype] = _probe(dtype)
    return _WORKS[dtype]


def _fused_relu_works(dtype: torch.dtype) -> bool:
    """Whether the fused (leaky) ReLU runs at speed here, equals ``relu`` and keeps a NaN in ``dtype`` (once)."""
    if dtype not in _RELU_WORKS:
        _RELU_WORKS[dtype] = cpu_subnormals_at_full_speed() and _fused_op_works(dtype) and _probe_relu(dtype)
    return _RELU_WORKS[dtype]


def _probe_relu(dtype: torch.dtype) -> bool:
    """The fused ReLU on a tiny input equals torch's ReLU of the conv, and a NaN in the input comes out NaN."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 5, 5, generator=generator).to(dtype).contiguous(memory_format=torch.channels_last)
    weight = (torch.randn(16, 16, 3, 3, generator=generator) / 12).to(dtype)
    bias = torch.randn(16, generator=generator).to(dtype)
    geometry = ([1, 1], [1, 1], [1, 1], 1)
    try:
        fused = _fused_relu(x, weight, bias, geometry)
        unfused = torch.relu(torch.ops.mkldnn._convolution_pointwise(x, weight, bias, *geometry, "none", [], ""))
        x[0, :, 2, 2] = float("nan")
        poisoned = _fused_relu(x, weight, bias, geometry)
    except (RuntimeError, NotImplementedError):
        return False
    return bool(torch.equal(fused, unfused)) and bool(poisoned[0, :, 1:4, 1:4].isnan().all())


def _fused_relu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, geometry: tuple) -> torch.Tensor:
    return torch.ops.mkldnn._convolution_pointwise(x, weight, bias, *geometry, "leaky_relu", [RELU_SLOPE], "")


def _probe(dtype: torch.dtype) -> bool:
    op = getattr(torch.ops.mkldnn, "_convolution_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return False
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 5, 5, generator=generator).to(dtype).contiguous(memory_format=torch.channels_last)
    weight = (torch.randn(16, 16, 3, 3, generator=generator) / 12).to(dtype)
    bias = torch.randn(16, generator=generator).to(dtype)
    try:
        fused = op(x, weight, bias, [1, 1], [1, 1], [1, 1], 1, "gelu", [], "none")
        added = op.binary(x, x, weight, bias, [1, 1], [1, 1], [1, 1], 1, "add", None, None, [], None)
    except (RuntimeError, NotImplementedError):
        return False
    exact = F.conv2d(x.float(), weight.float(), bias.float(), 1, 1)
    return bool(torch.allclose(fused.float(), F.gelu(exact), atol=0.02, rtol=0.02)) and bool(
        torch.allclose(added.float(), exact + x.float(), atol=0.05, rtol=0.02)
    )


def fusable(x: torch.Tensor, conv: nn.Conv2d) -> bool:
    """True when :func:`conv_act` and :func:`conv_add_act` run ``conv`` on ``x`` as one fused oneDNN op."""
    return (
        x.device.type == "cpu"
        and x.dtype in _FUSED_DTYPES
        and x.dim() == 4
        and conv.padding_mode == "zeros"
        and isinstance(conv.padding, tuple)
        and conv.weight.dtype == x.dtype
        and not (torch.is_grad_enabled() and (x.requires_grad or conv.weight.requires_grad))  # no backward
        and _fused_op_works(x.dtype)
    )


def _geometry(conv: nn.Conv2d) -> tuple[list[int], list[int], list[int], int]:
    return list(conv.padding), list(conv.stride), list(conv.dilation), conv.groups


def _algorithm(activation: str) -> str:
    return "none" if activation == "gelu" else ""


def conv_act(x: torch.Tensor, conv: nn.Conv2d, activation: str) -> torch.Tensor:
    """``activation(conv(x))``, fused where :func:`fusable` and the activation is one of :data:`FUSED_ACTIVATIONS`
    (``activation``: a key of :data:`ACTIVATIONS`; the ReLU as oneDNN's leaky ReLU with :data:`RELU_SLOPE` where
    the probe found it equal to ``relu`` and NaN-keeping, else torch's, in place after the convolution)."""
    fused = activation in FUSED_ACTIVATIONS and fusable(x, conv)
    if not fused or (activation == "relu" and not _fused_relu_works(x.dtype)):
        return ACTIVATIONS[activation](conv(x))
    if activation == "relu":
        return _fused_relu(x, conv.weight, conv.bias, _geometry(conv))
    return torch.ops.mkldnn._convolution_pointwise(
        x, conv.weight, conv.bias, *_geometry(conv), activation, [], _algorithm(activation)
    )


def conv_add_act(x: torch.Tensor, conv: nn.Conv2d, other: torch.Tensor, activation: str | None) -> torch.Tensor:
    """``activation(conv(x) + other)`` (no activation: ``conv(x) + other``): the add in the convolution's pass
    where :func:`fusable`, ``other`` has the output's dtype and ``conv`` is not grouped (oneDNN fuses no add into
    a grouped one); the activation after it, in place. ``other`` is not changed."""
    if not fusable(x, conv) or other.dtype != x.dtype or conv.groups != 1:
        y = conv(x).add_(other)
    else:
        y = torch.ops.mkldnn._convolution_pointwise.binary(
            x, other, conv.weight, conv.bias, *_geometry(conv), "add", None, None, [], None
        )
    return y if activation is None else ACTIVATIONS[activation](y)


def _register_flop_formulas() -> None:
    """Have torch's ``FlopCounterMode`` count the fused convolutions as it counts ``F.conv2d`` (the same
    multiply-adds; uncounted, a fused model would read as a fraction of its work). One formula per op packet:
    ``_convolution_pointwise`` (``(x, weight, ...)``; its ``.binary`` overload ``(x, other, weight, ...)``) and
    the in-place ``_convolution_pointwise_`` (``.binary``: ``(other, x, weight, ...)``). Costs ~1 ms at import."""
    from torch.utils.flop_counter import conv_flop_count, flop_registry, register_flop_formula

    mkldnn = torch.ops.mkldnn
    if not hasattr(mkldnn, "_convolution_pointwise"):
        return

    def pointwise(*args, out_shape=None, **_):
        x, weight = (args[0], args[1]) if len(args) == 10 else (args[0], args[2])  # default | binary
        return conv_flop_count(x, weight, out_shape, transposed=False)

    def pointwise_inplace(_other, x, weight, *_, out_shape=None, **__):
        return conv_flop_count(x, weight, out_shape, transposed=False)

    for packet, formula in (
        (mkldnn._convolution_pointwise, pointwise),
        (mkldnn._convolution_pointwise_, pointwise_inplace),
    ):
        # Once per process (a reloaded module finds its own formula); an op another tool has wrapped (a
        # benchmark's own counter) is left to that tool.
        if isinstance(packet, torch._ops.OpOverloadPacket) and packet not in flop_registry:
            register_flop_formula(packet)(formula)


_register_flop_formulas()

__all__ = ["ACTIVATIONS", "FUSED_ACTIVATIONS", "RELU_SLOPE", "conv_act", "conv_add_act", "fusable"]
