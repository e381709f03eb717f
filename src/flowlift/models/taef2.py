"""TAEF2: the tiny autoencoder for the FLUX.2 latent space, with exact tiled encode/decode.

Architecture (madebyollin's released TAEF2, MIT; written here from its description):

* ``conv(a, b)``: 3x3 conv, padding 1, bias unless stated.
* ``Block(n)``: ``relu(conv(relu(conv(relu(conv(x))))) + x)`` with the convs at ``conv.0/2/4``. A
  *GN* block first adds ``pool(x)`` to ``x``, where ``pool`` = 1x1 conv n->4n (no bias),
  GroupNorm(4, 4n), ReLU, 1x1 conv 4n->n (no bias) at ``pool.0/1/3``.
* Encoder (indices 0..14): conv(3,64); Block; stride-2 conv; Block x3; stride-2 conv; Block x3;
  stride-2 conv; GN-Block x3; conv(64,32).
* Decoder (indices 0..19): ``tanh(x/3)*3``; conv(32,64); ReLU; GN-Block x3; Upsample; conv (no bias);
  Block x3; Upsample; conv; Block x3; Upsample; conv; Block; conv(64,3).

Images are float [0, 1]; the encoder's output already lives in the *normalized* FLUX.2 latent space;
the decoder output is approximately [0, 1] and is not clamped here.

Exact tiling
------------
The only non-local operations are the GroupNorms, all at latent resolution. The encoder's local part
(indices 0..10, image -> latent resolution) and the decoder's local part (indices 6..19, latent -> image
resolution) are plain 3x3 convolutions, stride-2 convolutions and nearest upsamplings, so an output
region depends on a finite input region that :func:`~flowlift.models.taef2_tiling.input_interval`
computes layer by layer. Tiled runs feed each tile that region (cropping the surplus before every
resampling op), so tiles equal the full-frame computation up to float summation order; the
latent-resolution part runs on the whole frame. Two tile levels keep the recomputed halos small:
decoding runs the cheap 2x/4x stages in *bands* and the memory-dominant 8x stage in *tiles* inside each
band; encoding runs the full-resolution stem in tiles and the 1/2..1/8 stages in bands.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from flowlift.devices import cpu_has_feature
from flowlift.limits import LATENT_CHANNELS
from flowlift.models.fused_conv import conv_act, conv_add_act
from flowlift.models.taef2_layers import (
    PairConv,
    UpConv,
    conv_add_relu_into,
    fuse_decoder_layers,
    fuse_upsample_convs,
    run_layers,
    subpixel_weights,
)
from flowlift.models.taef2_tiling import LocalOp, run_two_level

WIDTH = 64
SPATIAL_FACTOR = 8

#: Default decode tiling, in latent pixels: bands through the 2x and 4x stages, tiles through the
#: 8x stage. A 64x64 tile is 512x512 output pixels (64 channels: ~70 MB per fp32 activation); at
#: 2048 px these defaults recompute ~5% extra convolution work (halos).
DEFAULT_DECODE_BAND = 128
DEFAULT_DECODE_TILE = 64
#: Decode tiling on a CPU with AMX tiles, in bfloat16: AMX computes a 64-channel 3x3 convolution faster than
#: memory feeds it, so the 8x stage's tiles are kept near the L2's size (a 16x16 latent tile is 128x128 pixels,
#: 2 MB per bf16 activation). On an Intel Xeon with AMX the 3072x2048 decode took 13.1-13.5 CPU-s against
#: 15.3-15.5 with the defaults (docs/cpu.md, issue 47). Float32 and CPUs without AMX keep the defaults, whose
#: smaller halos were measured best on AVX512-BF16 (the 2-core AMD EPYC); these tiles were not timed there.
AMX_DECODE_BAND = 64
AMX_DECODE_TILE = 16


def decode_tiling(latents: torch.Tensor) -> tuple[int, int]:
    """The (band, tile) :meth:`TAEF2.decode_tiled` uses for ``latents`` by default: :data:`AMX_DECODE_BAND` and
    :data:`AMX_DECODE_TILE` for bfloat16 on a CPU with ``amx_bf16``, else :data:`DEFAULT_DECODE_BAND` and
    :data:`DEFAULT_DECODE_TILE`."""
    if latents.device.type == "cpu" and latents.dtype == torch.bfloat16 and cpu_has_feature("amx_bf16"):
        return AMX_DECODE_BAND, AMX_DECODE_TILE
    return DEFAULT_DECODE_BAND, DEFAULT_DECODE_TILE


#: Default encode tiling, in latent pixels: bands through the 1/2..1/8 stages, tiles through the
#: full-resolution stem (conv, Block, stride-2 conv). The encoder's receptive field is wide (a band
#: needs 30 px of halo at 1/2 resolution), so at 2048 px these recompute ~14% extra work.
DEFAULT_ENCODE_BAND = 128
DEFAULT_ENCODE_TILE = 64


def _dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when dense (contiguous or channels-last), else a dense copy in its layout (a crop's view)."""
    if x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last):
        return x
    channels_last = x.shape[1] > 1 and x.stride(1) == 1
    return x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def _conv(n_in: int, n_out: int, *, stride: int = 1, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 3, stride=stride, padding=1, bias=bias)


class Clamp(nn.Module):
    """Soft clamp ``tanh(x / 3) * 3`` (decoder index 0, no weights)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3) * 3


class Block(nn.Module):
    """``relu(conv(x') + x')`` with ``x' = x + pool(x)`` for GN blocks, ``x' = x`` otherwise.

    The convs run with their ReLUs, and the last with the residual add, in one pass each
    (:mod:`flowlift.models.fused_conv`: bf16 on the CPU; float32 runs the released layers, bit for bit).
    """

    def __init__(self, n: int, use_gn: bool = False) -> None:
        super().__init__()
        self.conv = nn.Sequential(_conv(n, n), nn.ReLU(inplace=True), _conv(n, n), nn.ReLU(inplace=True), _conv(n, n))
        self.pool: nn.Sequential | None = None
        if use_gn:
            self.pool = nn.Sequential(
                nn.Conv2d(n, 4 * n, 1, bias=False),
                nn.GroupNorm(4, 4 * n),
                nn.ReLU(inplace=True),
                nn.Conv2d(4 * n, n, 1, bias=False),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, owned=False)

    def consume(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward`, free to write its result over ``x``'s memory (bf16 fused: the residual add done in
        place, no new output buffer); for a caller that reads ``x`` no more (TAEF2's own layer chains)."""
        return self._run(x, owned=True)

    def _run(self, x: torch.Tensor, owned: bool) -> torch.Tensor:
        if self.pool is not None:
            x, owned = x + self.pool(x), True
        dense = _dense(x)  # a tile's crop: copied once here, not by the first conv and again by the residual add
        owned = owned or dense is not x
        convs = self.conv
        y = conv_act(conv_act(dense, convs[0], "relu"), convs[2], "relu")
        return conv_add_relu_into(y, convs[4], dense) if owned else conv_add_act(y, convs[4], dense, "relu")


def build_encoder() -> nn.Sequential:
    """The TAEF2 encoder as a Sequential whose indices are the released state-dict keys."""
    n = WIDTH
    return nn.Sequential(
        _conv(3, n),
        Block(n),
        _conv(n, n, stride=2, bias=False),
        Block(n),
        Block(n),
        Block(n),
        _conv(n, n, stride=2, bias=False),
        Block(n),
        Block(n),
        Block(n),
        _conv(n, n, stride=2, bias=False),
        Block(n, True),
        Block(n, True),
        Block(n, True),
        _conv(n, LATENT_CHANNELS),
    )


def build_decoder() -> nn.Sequential:
    """The TAEF2 decoder as a Sequential whose indices are the released state-dict keys."""
    n = WIDTH
    return nn.Sequential(
        Clamp(),
        _conv(LATENT_CHANNELS, n),
        nn.ReLU(inplace=True),
        Block(n, True),
        Block(n, True),
        Block(n, True),
        nn.Upsample(scale_factor=2),
        _conv(n, n, bias=False),
        Block(n),
        Block(n),
        Block(n),
        nn.Upsample(scale_factor=2),
        _conv(n, n, bias=False),
        Block(n),
        Block(n),
        Block(n),
        nn.Upsample(scale_factor=2),
        _conv(n, n, bias=False),
        Block(n),
        _conv(n, 3),
    )


# Encoder: indices [0, 11) are local (image -> latent resolution); [11, 15) run on the whole frame.
ENCODER_LOCAL_END = 11
# ... of which [0, 3) is the full-resolution stem (the tiled part of the inner level).
ENCODER_STEM_END = 3
# Decoder: [0, 6) run on the whole frame at latent resolution; [6, 20) are local.
DECODER_LOCAL_START = 6
# ... of which [16, 20) is the last, 8x stage (the inner tile level).
DECODER_LAST_STAGE_START = 16


def local_op(layer: nn.Module) -> LocalOp:
    """The :class:`LocalOp` of one TAEF2 layer outside the GroupNorm blocks."""
    if isinstance(layer, nn.Conv2d):
        if layer.kernel_size == (1, 1):
            return LocalOp("same", 0)
        if layer.kernel_size != (3, 3) or layer.padding != (1, 1):
            raise ValueError(f"unsupported conv {layer}")
        return LocalOp("down" if layer.stride == (2, 2) else "same", 0 if layer.stride == (2, 2) else 1)
    if isinstance(layer, Block):
        if layer.pool is not None:
            raise ValueError("GroupNorm blocks are not spatially local")
        return LocalOp("same", 3)
    if isinstance(layer, nn.Upsample):
        return LocalOp("up")
    if isinstance(layer, UpConv):
        return LocalOp("upconv")
    if isinstance(layer, PairConv):
        return LocalOp("same", 1)
    if isinstance(layer, (nn.ReLU, Clamp)):
        return LocalOp("same", 0)
    raise ValueError(f"no local op for {type(layer).__name__}")


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------


class TAEF2(nn.Module):
    """TAEF2 encoder and/or decoder; state-dict keys ``encoder.{i}.*`` / ``decoder.{i}.*`` where
    ``i`` is the released Sequential index."""

    def __init__(self, encoder: bool = True, decoder: bool = True) -> None:
        super().__init__()
        if not (encoder or decoder):
            raise ValueError("TAEF2 needs an encoder, a decoder or both")
        self.encoder = build_encoder() if encoder else None
        self.decoder = build_decoder() if decoder else None
        if self.decoder is not None:
            self.refresh_subpixel_weights()
            self.register_load_state_dict_post_hook(lambda module, _keys: module.refresh_subpixel_weights())

    @torch.no_grad()
    def refresh_subpixel_weights(self) -> None:
        """Give every decoder conv after an upsampling a ``subpixel_weight`` buffer (:func:`subpixel_weights`).

        Not persistent (the state dict is the released one); made at construction and after every
        ``load_state_dict``, in the weights' dtype, and cast with the module by ``.to(dtype)``.
        """
        for layer in fuse_upsample_convs(list(self._need(self.decoder, "decoder"))):
            if isinstance(layer, UpConv):
                layer.conv.register_buffer("subpixel_weight", subpixel_weights(layer.conv.weight), persistent=False)

    # Full frame -------------------------------------------------------------------------------
    def encode_full(self, images: torch.Tensor) -> torch.Tensor:
        """Images [0, 1] (B, 3, H, W) -> latents (B, 32, H/8, W/8) in one pass."""
        return run_layers(list(self._need(self.encoder, "encoder")), images)

    def decode_full(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents (B, 32, h, w) -> images (B, 3, 8h, 8w), unclamped, in one pass (:func:`fuse_decoder_layers`)."""
        return run_layers(fuse_decoder_layers(list(self._need(self.decoder, "decoder"))), latents)

    # Tiled -------------------------------------------------------------------------------------
    def encode_tiled(
        self, images: torch.Tensor, *, band: int = DEFAULT_ENCODE_BAND, tile: int = DEFAULT_ENCODE_TILE
    ) -> torch.Tensor:
        """:meth:`encode_full` with bounded memory, equal up to float summation order.

        Per image: the full-resolution stem (indices 0..2) in tiles of ``tile x tile`` latent pixels,
        the rest of the local part (3..10) in bands of ``band x band`` latent pixels, then the
        GroupNorm blocks and the output conv (11..14) on the whole latent frame.
        """
        enc = self._need(self.encoder, "encoder")
        stem, rest = list(enc[:ENCODER_STEM_END]), list(enc[ENCODER_STEM_END:ENCODER_LOCAL_END])
        outs = []
        for image in images.split(1):
            x = run_two_level(
                stem,
                [local_op(m) for m in stem],
                rest,
                [local_op(m) for m in rest],
                image,
                band=band,
                band_unit=1,
                tile=tile,
                tile_unit=4,
                tile_first=True,
            )
            outs.append(enc[ENCODER_LOCAL_END:](x))
        return torch.cat(outs)

    def decode_tiled(
        self,
        latents: torch.Tensor,
        *,
        band: int | None = None,
        tile: int | None = None,
        on_tile: Callable[[int, int], None] | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """:meth:`decode_full` with bounded memory, equal up to float summation order.

        Per latent: the latent-resolution part (indices 0..5, with the GroupNorms) on the whole
        frame, the 2x and 4x stages (6..15) in bands of ``band x band`` latent pixels, and the 8x
        stage (16..19) in tiles of ``tile x tile`` latent pixels inside each band (either left out:
        :func:`decode_tiling`'s). ``on_tile(done, total)`` is called after every 8x tile, counted over
        the whole batch (progress only).

        The result is a contiguous frame in ``dtype`` (None: the latents'), allocated once and written band by band:
        a bfloat16 decode handed back in float32 never holds the frame in both dtypes (the bands' values widen
        exactly, so the pixels are those of the bfloat16 frame converted afterwards).
        """
        default_band, default_tile = decode_tiling(latents)
        band = default_band if band is None else band
        tile = default_tile if tile is None else tile
        dec = self._need(self.decoder, "decoder")
        mid = fuse_decoder_layers(list(dec[DECODER_LOCAL_START:DECODER_LAST_STAGE_START]))
        last = fuse_decoder_layers(list(dec[DECODER_LAST_STAGE_START:]))
        count, height, width = latents.shape[0], latents.shape[-2], latents.shape[-1]
        shape = (count, 3, height * SPATIAL_FACTOR, width * SPATIAL_FACTOR)
        out: torch.Tensor | None = None
        for index, latent in enumerate(latents.split(1)):
            h = run_layers(list(dec[:DECODER_LOCAL_START]), latent)
            if out is None:  # after the first latent's GroupNorm stage, whose 256-channel working set it need not meet
                out = torch.empty(shape, dtype=dtype or latents.dtype, device=latents.device)
            run_two_level(
                mid,
                [local_op(m) for m in mid],
                last,
                [local_op(m) for m in last],
                h,
                band=band,
                band_unit=SPATIAL_FACTOR,
                tile=tile,
                tile_unit=SPATIAL_FACTOR,
                tile_first=False,
                on_tile=None if on_tile is None else _batch_tiles(on_tile, index, count),
                out=out[index : index + 1],
            )
            del h
        assert out is not None
        return out

    @staticmethod
    def _need(part: nn.Module | None, name: str) -> nn.Module:
        if part is None:
            from flowlift.errors import FlowliftError

            raise FlowliftError(
                f"this TAEF2 has no {name}: only the other half was loaded; put taef2_{name}.pth beside it "
                "(TAEF2 is two files, taef2_encoder.pth and taef2_decoder.pth, in one folder)"
            )
        return part


def _batch_tiles(on_tile: Callable[[int, int], None], index: int, count: int) -> Callable[[int, int], None]:
    """Per-image tile progress as progress over a batch of ``count``: image ``index``'s tile ``d`` of ``t``
    is tile ``index * t + d`` of ``count * t`` (every image of a batch has the same size)."""

    def report(done: int, total: int) -> None:
        on_tile(index * total + done, count * total)

    return report


# --------------------------------------------------------------------------------------------------
# State-dict layouts
# --------------------------------------------------------------------------------------------------


def _index_keys(state: Mapping[str, torch.Tensor]) -> set[int]:
    return {int(k.split(".", 1)[0]) for k in state if k.split(".", 1)[0].isdigit()}


def detect_layout(state: Mapping[str, torch.Tensor]) -> str:
    """Name the layout of a TAEF2 state dict from its keys.

    * ``"encoder"`` / ``"decoder"``: one released ``.pth`` (keys ``{i}.*``; the encoder has index 0
      with 3 input channels, the decoder starts at index 1 because its clamp has no weights);
    * ``"diffusers"``: ``encoder.layers.{i}.*`` and/or ``decoder.layers.{i-1}.*``;
    * ``"flowlift"``: this module's own ``encoder.{i}.*`` / ``decoder.{i}.*``;
    * ``"unknown"`` otherwise.
    """
    keys = list(state)
    if not keys:
        return "unknown"
    if all(k.startswith(("encoder.layers.", "decoder.layers.")) for k in keys):
        return "diffusers"
    if all(k.split(".", 1)[0] in ("encoder", "decoder") and k.split(".")[1].isdigit() for k in keys):
        return "flowlift"
    if all(k.split(".", 1)[0].isdigit() for k in keys):
        indices = _index_keys(state)
        first = state.get("0.weight")
        if 0 in indices and first is not None and first.ndim == 4 and first.shape[1] == 3:
            return "encoder"
        if 0 not in indices and "1.weight" in state and state["1.weight"].shape[1] == LATENT_CHANNELS:
            return "decoder"
    return "unknown"


def to_flowlift_layout(state: Mapping[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """Rename a state dict of the given :func:`detect_layout` layout to ``encoder.{i}`` / ``decoder.{i}``.

    The diffusers layout's decoder index is the Sequential index minus one (``decoder.layers.{j}`` ->
    ``decoder.{j+1}``).
    """
    if layout in ("encoder", "decoder"):
        return {f"{layout}.{k}": v for k, v in state.items()}
    if layout == "flowlift":
        return dict(state)
    if layout == "diffusers":
        out: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            part, _, index, rest = key.split(".", 3)
            i = int(index) + (1 if part == "decoder" else 0)
            out[f"{part}.{i}.{rest}"] = value
        return out
    raise ValueError(f"unknown TAEF2 layout {layout!r}")
