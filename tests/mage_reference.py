"""A literal, unfolded Mage-VAE for the tests: what the reference computes, step by step, at t = 0.

Independent of flowlift's code (only torch): the adaLN modulations are computed from the t = 0
timestep embedding on every call, the encoder's z_t and the decoder's noise are explicit zero tensors
that go through every layer (``z_proj``, ``s_embedder.proj1``, the unfold and the noise columns of
``x_embedder``), attention windows use explicit replicate padding and ``bmm`` + softmax, and the
decoder's per-pixel path uses ``unfold`` / ``fold``. The log-variance half of the encoder's output is
computed too (and dropped, as the posterior mean is what flowlift's encode returns).

It reads a state dict in the released layout (``student.dconv_encoder.*``, ``pipeline.*``) through
plain dictionary look-ups, so a mis-named parameter in flowlift's module cannot hide here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

EPS = 1e-6


class Weights:
    """``w("conv1")`` -> the tensor under ``prefix + "conv1.weight"``; ``b(...)`` the bias."""

    def __init__(self, state: dict[str, torch.Tensor], prefix: str) -> None:
        self.state, self.prefix = state, prefix

    def sub(self, name: str) -> Weights:
        return Weights(self.state, f"{self.prefix}{name}.")

    def w(self, name: str) -> torch.Tensor:
        return self.state[f"{self.prefix}{name}.weight"].float()

    def b(self, name: str) -> torch.Tensor | None:
        key = f"{self.prefix}{name}.bias"
        return self.state[key].float() if key in self.state else None

    def has(self, name: str) -> bool:
        return f"{self.prefix}{name}.weight" in self.state


def conv(p: Weights, name: str, x: torch.Tensor, **kw) -> torch.Tensor:
    return F.conv2d(x, p.w(name), p.b(name), **kw)


def linear(p: Weights, name: str, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, p.w(name), p.b(name))


def ln2d(x: torch.Tensor, weight=None, bias=None) -> torch.Tensor:
    x = x.permute(0, 2, 3, 1).contiguous()
    x = F.layer_norm(x, (x.shape[-1],), weight, bias, EPS)
    return x.permute(0, 3, 1, 2).contiguous()


def t_embedding(p: Weights, batch: int) -> torch.Tensor:
    t = torch.zeros(batch)
    half = 128
    freqs = torch.exp(-math.log(10000) * torch.arange(0, half, dtype=torch.float32) / half)
    args = t[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    h = F.silu(linear(p, "mlp.0", emb))
    return linear(p, "mlp.2", h)


def dico(p: Weights, inp: torch.Tensor, c: torch.Tensor | None) -> torch.Tensor:
    if c is not None:
        mod = linear(p, "adaLN_modulation.1", F.silu(c))
        s1, k1, g1, s2, k2, g2 = mod.chunk(6, dim=1)
        x = ln2d(inp) * (1 + k1[:, :, None, None]) + s1[:, :, None, None]
    else:
        x = ln2d(inp, p.w("norm1"), p.b("norm1"))
    ch = x.shape[1]
    x = F.gelu(F.conv2d(conv(p, "conv1", x), p.w("conv2"), p.b("conv2"), padding=1, groups=ch))
    pooled = F.adaptive_avg_pool2d(x, 1)
    x = x * torch.sigmoid(conv(p, "ca.1", pooled))
    x = conv(p, "conv3", x)
    if c is not None:
        x = inp + g1[:, :, None, None] * x
        h = ln2d(x) * (1 + k2[:, :, None, None]) + s2[:, :, None, None]
        return x + g2[:, :, None, None] * conv(p, "conv5", F.gelu(conv(p, "conv4", h)))
    x = inp + x
    return x + conv(p, "conv5", F.gelu(conv(p, "conv4", ln2d(x, p.w("norm2"), p.b("norm2")))))


def encode(state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Images [-1, 1] -> posterior mean (B, 128, H/16, W/16), the reference's ``_moments`` at t = 0."""
    p = Weights(state, "student.dconv_encoder.")
    b, _, h, w = x.shape
    z_t = torch.zeros(b, 128, h // 16, w // 16)
    cond = conv(p, "patch_cond_embed", x, stride=16)
    i = 0
    while p.has(f"head_blocks.{i}.conv1"):
        cond = dico(p.sub(f"head_blocks.{i}"), cond, None)
        i += 1
    cond = conv(p, "proj_down", cond)
    s = conv(p, "fuse_proj", torch.cat([cond, conv(p, "z_proj", z_t)], dim=1))
    c = t_embedding(p.sub("t_embedder"), b)
    i = 0
    while p.has(f"blocks.{i}.conv1"):
        s = dico(p.sub(f"blocks.{i}"), s, c)
        i += 1
    out = conv(p, "proj_out", ln2d(s, p.w("norm_out"), p.b("norm_out")))
    mean, logvar = out[:, :128], out[:, 128:].clamp(-20.0, 10.0)
    assert logvar.shape == mean.shape
    return mean


def group_norm(p: Weights, name: str, x: torch.Tensor) -> torch.Tensor:
    return F.group_norm(x, 32, p.w(name), p.b(name), EPS)


def resnet(p: Weights, x: torch.Tensor) -> torch.Tensor:
    h = conv(p, "conv1", F.silu(group_norm(p, "norm1", x)), padding=1)
    h = conv(p, "conv2", F.silu(group_norm(p, "norm2", h)), padding=1)
    return x + h


def attention(p: Weights, x: torch.Tensor, d: int = 32) -> torch.Tensor:
    h = group_norm(p, "norm", x)
    q, k, v = conv(p, "q", h), conv(p, "k", h), conv(p, "v", h)
    b, c, hh, ww = q.shape
    ph, pw = (d - hh % d) % d, (d - ww % d) % d
    if ph or pw:
        q, k, v = (F.pad(t, (0, pw, 0, ph), mode="replicate") for t in (q, k, v))
    nh, nw = (hh + ph) // d, (ww + pw) // d

    def cells(t):
        return t.reshape(b, c, nh, d, nw, d).permute(0, 2, 4, 1, 3, 5).reshape(b * nh * nw, c, d * d)

    q, k, v = cells(q), cells(k), cells(v)
    weights = torch.softmax(torch.bmm(q.permute(0, 2, 1), k) * c**-0.5, dim=2).permute(0, 2, 1)
    out = torch.bmm(v, weights).reshape(b, nh, nw, c, d, d).permute(0, 3, 1, 4, 2, 5)
    out = out.reshape(b, c, nh * d, nw * d)[:, :, :hh, :ww]
    return x + conv(p, "proj_out", out)


def cod_decoder(p: Weights, z: torch.Tensor, window: int = 32) -> torch.Tensor:
    h = conv(p, "conv_in", z, padding=1)
    h = resnet(p.sub("block.0"), h)
    h = attention(p.sub("block.1"), h, window)
    h = resnet(p.sub("block.2"), h)
    h = attention(p.sub("block.3"), h, window)
    h = resnet(p.sub("block.4"), h)
    return conv(p, "conv_out", F.silu(group_norm(p, "norm_out", h)), padding=1)


def dct_table(freqs: int = 8) -> torch.Tensor:
    pos = torch.linspace(0, 1, 16)
    py, px = torch.meshgrid(pos, pos, indexing="ij")
    px, py = px.reshape(-1, 1, 1), py.reshape(-1, 1, 1)
    f = torch.linspace(0, freqs, freqs)
    fx, fy = f[None, :, None], f[None, None, :]
    return (torch.cos(px * fx * torch.pi) * torch.cos(py * fy * torch.pi) / (1 + fx * fy)).view(1, -1, freqs**2)


def decode(state: dict[str, torch.Tensor], z: torch.Tensor, window: int = 32) -> torch.Tensor:
    """Latents (B, 128, h, w) -> images [-1, 1] (B, 3, 16h, 16w), the reference's ``decode`` at t = 0."""
    p = Weights(state, "pipeline.")
    cond = cod_decoder(p.sub("y_embedder.decoder"), z, window)
    b, hidden, lh, lw = cond.shape
    H, W = lh * 16, lw * 16
    noise = torch.zeros(b, 3, H, W)
    c = t_embedding(p.sub("t_embedder"), b)
    s = conv(p, "s_embedder.proj2", torch.cat([F.conv2d(noise, p.w("s_embedder.proj1"), stride=16), cond], dim=1))
    i = 0
    while p.has(f"blocks.{i}.conv1"):
        s = dico(p.sub(f"blocks.{i}"), s, c)
        i += 1
    length = lh * lw
    s = s.permute(0, 2, 3, 1).reshape(-1, hidden)
    x = F.unfold(noise, kernel_size=16, stride=16)
    x = torch.cat([x, conv(p, "y_embedder_x", cond).flatten(2)], dim=1)
    x = x.reshape(b, -1, 256, length).permute(0, 3, 2, 1).flatten(0, 1)
    freqs = round(math.sqrt(p.w("x_embedder.embedder.0").shape[1] - x.shape[-1]))
    x = linear(p, "x_embedder.embedder.0", torch.cat([x, dct_table(freqs).expand(x.shape[0], -1, -1)], dim=-1))
    x = linear(p, "dec_net.input_proj", x)
    cc = linear(p, "dec_net.cond_embed", s).reshape(s.shape[0], 256, -1)
    i = 0
    while p.has(f"dec_net.res_blocks.{i}.in_ln"):
        r = p.sub(f"dec_net.res_blocks.{i}")
        shift, scale, gate = linear(r, "adaLN_modulation.1", F.silu(cc)).chunk(3, dim=-1)
        h = F.layer_norm(x, (x.shape[-1],), r.w("in_ln"), r.b("in_ln"), EPS) * (1 + scale) + shift
        x = x + gate * linear(r, "mlp.2", F.silu(linear(r, "mlp.0", h)))
        i += 1
    xf = x.float()
    x = p.w("final_layer.norm") * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS))
    x = linear(p, "final_layer.linear", x)
    x = x.transpose(1, 2).reshape(b, length, -1)
    return F.fold(x.transpose(1, 2).contiguous(), (H, W), kernel_size=16, stride=16)
