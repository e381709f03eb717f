"""The published SesquiLSR network (``LatentUpscaler(in_channels=32)`` of ``LoganBooker/SesquiLSR``) written
plainly as one function over a state dict, for the tests: no modules, every step as the description states
it, loops where the description loops. flowlift's :mod:`flowlift.models.sesqui_lsr` must equal it.

Also :func:`released_layout`, the 80 tensor names and shapes of ``models/upscaler_Flux2.safetensors``, and
:func:`random_state`, a random checkpoint in that layout.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

C, W = 32, 128


def _block_sizes(channels: int, expand: float, shrink: float) -> tuple[int, int, int]:
    gate = math.ceil(expand * channels / 9)
    gate = math.ceil(gate / 8) * 8
    return gate * 8, gate, math.ceil(channels * shrink)


def released_layout() -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the released FLUX.2 checkpoint (80 tensors, ~3.07M parameters)."""
    layout: dict[str, tuple[int, ...]] = {
        "head_conv.0.weight": (W // 2, C, 3, 3),
        "head_conv.2.weight": (W, W // 2, 3, 3),
        "head_conv.2.bias": (W,),
    }

    def block(prefix: str, expand: float, shrink: float) -> None:
        value, gate, mid = _block_sizes(W, expand, shrink)
        layout[f"{prefix}.norm.weight"] = (W,)
        layout[f"{prefix}.up.weight"] = (value + gate, W, 1, 1)
        layout[f"{prefix}.down.weight"] = (mid, value, 1, 1)
        layout[f"{prefix}.mix.weight"] = (W, mid, 3, 3)

    for i in range(8):
        block(f"in_blocks.{i}", 1.5, 0.75)
    layout |= {
        "upsample.ps_expand.weight": (4 * W, W, 1, 1),
        "upsample.ps_expand.bias": (4 * W,),
        "upsample.lift_expand.weight": (4 * 64, W, 1, 1),
        "upsample.lift_mix.weight": (W, 64, 3, 3),
    }
    block("upsample.refine", 2.0, 1.0)
    layout |= {
        "upsample.base_taps": (2, 2, W, 4),
        "upsample.pe.freqs": (4,),
        "upsample.axis_emb.weight": (2, 8),
        "upsample.rank_emb.weight": (2, 8),
        "upsample.filter_net.0.weight": (64, 25),
        "upsample.filter_net.0.bias": (64,),
        "upsample.filter_net.2.weight": (4 * W, 64),
        "upsample.filter_net.2.bias": (4 * W,),
        "upsample.rank_gain": (2,),
    }
    for i in range(6):
        block(f"out_blocks.{i}", 2.0, 1.0)
    layout |= {
        "tail_conv.0.weight": (W // 2, W, 1, 1),
        "tail_conv.2.weight": (C, W // 2, 3, 3),
        "tail_conv.2.bias": (C,),
        "skip_conv.weight": (C, C, 5, 5),
    }
    return layout


def random_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights in the released layout, scaled so activations stay O(1) through 15 residual blocks."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in released_layout().items():
        fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
        state[name] = torch.randn(shape, generator=g) / math.sqrt(fan_in)
    state["upsample.pe.freqs"] = 2.0 ** torch.linspace(0, 2, 4)
    state["upsample.base_taps"][0] += torch.tensor([-0.0625, 0.5625, 0.5625, -0.0625])
    for name in state:
        if name.endswith("norm.weight"):
            state[name] = 1 + 0.1 * torch.randn(state[name].shape, generator=g)
    return state


def _conv(x, weight, bias=None):
    pad = weight.shape[-1] // 2
    if pad:
        x = F.pad(x, (pad, pad, pad, pad), mode="reflect")
    return F.conv2d(x, weight, bias)


def _mish(x):
    return x * torch.tanh(F.softplus(x))


def _gated(s, p, x):
    var, mean = torch.var_mean(x, dim=(1, 2, 3), unbiased=False, keepdim=True)
    std = torch.sqrt(var + 1e-6)
    y = (x - mean) / std * s[p + ".norm.weight"].view(1, -1, 1, 1)
    hidden = _conv(y, s[p + ".up.weight"])
    n_values = s[p + ".down.weight"].shape[1]
    n_gates = hidden.shape[1] - n_values
    v, g = _mish(hidden[:, :n_values]), torch.tanh(0.5 * hidden[:, n_values:])
    b, _, h, w = v.shape
    y = (v.view(b, n_gates, 8, h, w) * g[:, :, None]).reshape(b, n_values, h, w)
    return x + _conv(_conv(y, s[p + ".down.weight"]), s[p + ".mix.weight"]) * std


def _coords(n_src, n_tgt):
    pos = (torch.arange(n_tgt, dtype=torch.float32) + 0.5) * (n_src / n_tgt) - 0.5
    base = torch.floor(pos).long().clamp(0, n_src - 1)
    return pos - base.float(), base


def _weights(s, frac, log_foot, axis, rank):
    """(n, C, 4) taps for one axis and rank, one output position at a time."""
    rows = []
    for f in frac.tolist():
        angles = [f * float(q) * math.pi for q in s["upsample.pe.freqs"]]
        cond = torch.tensor(
            [math.sin(a) for a in angles] + [math.cos(a) for a in angles] + [log_foot], dtype=torch.float32
        )
        cond = torch.cat([cond, s["upsample.axis_emb.weight"][axis], s["upsample.rank_emb.weight"][rank]])
        hidden = _mish(s["upsample.filter_net.0.weight"] @ cond + s["upsample.filter_net.0.bias"])
        res = 0.2 * torch.tanh(s["upsample.filter_net.2.weight"] @ hidden + s["upsample.filter_net.2.bias"])
        res = res.view(W, 4)
        res = res - res.mean(dim=1, keepdim=True)
        rows.append(res + s["upsample.base_taps"][rank, axis])
    return torch.stack(rows)


def _resample(x, base, taps, axis):
    """Along H (axis 0) or W (axis 1): out[i] = sum_k taps[i, c, k] * x[clamp(base[i] - 1 + k)]."""
    n_src = x.shape[2 + axis]
    outs = []
    for i, b in enumerate(base.tolist()):
        acc = 0
        for k in range(4):
            j = min(max(b - 1 + k, 0), n_src - 1)
            line = x[:, :, j : j + 1, :] if axis == 0 else x[:, :, :, j : j + 1]
            acc = acc + line * taps[i, :, k].view(1, -1, 1, 1)
        outs.append(acc)
    return torch.cat(outs, dim=2 + axis)


def reference_forward(s: dict[str, torch.Tensor], x: torch.Tensor, target_size: tuple[int, int]) -> torch.Tensor:
    """The published ``LatentUpscaler.forward(x, target_size)`` on state dict ``s`` (float32)."""
    th, tw = target_size
    h = _conv(_mish(_conv(x, s["head_conv.0.weight"])), s["head_conv.2.weight"], s["head_conv.2.bias"])
    for i in range(8):
        h = _gated(s, f"in_blocks.{i}", h)
    base = F.pixel_shuffle(_conv(h, s["upsample.ps_expand.weight"], s["upsample.ps_expand.bias"]), 2)
    lift = _conv(F.pixel_shuffle(_conv(h, s["upsample.lift_expand.weight"]), 2), s["upsample.lift_mix.weight"])
    h = _gated(s, "upsample.refine", base + lift)
    hs, ws = h.shape[-2:]
    fy, iy = _coords(hs, th)
    fx, ix = _coords(ws, tw)
    out = torch.zeros(x.shape[0], W, th, tw)
    for r in range(2):
        kx = _weights(s, fx, math.log2(max(ws / tw, 0.01)), 1, r)
        ky = _weights(s, fy, math.log2(max(hs / th, 0.01)), 0, r)
        out = out + torch.sigmoid(s["upsample.rank_gain"][r]) * _resample(_resample(h, ix, kx, 1), iy, ky, 0)
    h = out
    for i in range(6):
        h = _gated(s, f"out_blocks.{i}", h)
    h = _conv(_mish(_conv(h, s["tail_conv.0.weight"])), s["tail_conv.2.weight"], s["tail_conv.2.bias"])
    skip = _conv(F.interpolate(x, size=(th, tw), mode="bicubic", align_corners=False), s["skip_conv.weight"])
    return h + skip


def save_random_sesqui(folder: Path | str) -> Path:
    """:func:`random_state` (seed 0) saved as ``folder/upscaler_Flux2.safetensors``, the released file's name."""
    from safetensors.torch import save_file

    path = Path(folder) / "upscaler_Flux2.safetensors"
    save_file(random_state(0), str(path))
    return path
