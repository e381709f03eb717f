"""Mage-VAE files in the released layout: recognising them and loading them strictly into :class:`MageVAE`.

The released single file holds ``student.dconv_encoder.*`` (the encoder) and ``pipeline.*`` (the DConv
denoiser and its CoD decoder ``pipeline.y_embedder.decoder.*``); ``pipeline.y_embedder.encoder.*`` and
``pipeline.y_embedder.bottleneck.*`` are a FLUX.2-VAE encoder side the codec never runs and are skipped.
flowlift's module names are the released ones with the prefixes ``encoder.`` / ``decoder.``, so the
mapping is a prefix swap, and every error names the tensor in the file's own spelling.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from flowlift.errors import FlowliftError
from flowlift.models.vae import MageVAE

#: Prefixes of the released Mage-VAE file and the flowlift module each maps to.
MAGE_ENCODER_PREFIX = "student.dconv_encoder."
MAGE_DECODER_PREFIX = "pipeline."
#: The FLUX.2-VAE encoder side stored with the decoder, which inference never uses: skipped.
MAGE_SKIPPED_PREFIXES = ("pipeline.y_embedder.encoder.", "pipeline.y_embedder.bottleneck.")


def is_mage_vae(state: Mapping[str, torch.Tensor]) -> bool:
    """True when ``state`` has the released Mage-VAE layout (``student.dconv_encoder.*`` / ``pipeline.*``)."""
    return any(k.startswith((MAGE_ENCODER_PREFIX, MAGE_DECODER_PREFIX)) for k in state)


def _released_name(flowlift_key: str) -> str:
    if flowlift_key.startswith("encoder."):
        return MAGE_ENCODER_PREFIX + flowlift_key.removeprefix("encoder.")
    return MAGE_DECODER_PREFIX + flowlift_key.removeprefix("decoder.")


def _flowlift_name(released_key: str) -> str | None:
    if released_key.startswith(MAGE_ENCODER_PREFIX):
        return "encoder." + released_key.removeprefix(MAGE_ENCODER_PREFIX)
    if released_key.startswith(MAGE_DECODER_PREFIX):
        return "decoder." + released_key.removeprefix(MAGE_DECODER_PREFIX)
    return None


def mage_from_state_dict(
    state: Mapping[str, torch.Tensor],
    *,
    origin: str = "",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    config: Any = None,
    owned: bool = False,
) -> MageVAE:
    """Build a :class:`MageVAE` from a state dict in the released layout, strictly.

    ``pipeline.y_embedder.encoder.*`` / ``pipeline.y_embedder.bottleneck.*`` are skipped; every other
    tensor must be one of the architecture's (named in the released spelling when it is not, is
    missing or has another shape). No ``student.dconv_encoder.*`` tensor at all gives a decode-only
    VAE; no ``pipeline.*`` tensor is an error (flowlift needs the decoder). Weights load in float32,
    the t = 0 adaLN fold runs in float32, then the model moves to ``device`` / ``dtype``. ``owned``: the
    caller gives ``state``'s tensors away (they may be changed in place), which saves copying float32 ones.
    """
    from flowlift.devices import one_thread
    from flowlift.models.mage_vae import MageVAEConfig, MageVAEModel, infer_config
    from flowlift.models.weights import check_finite_state, state_dict_mismatch

    source = f" from {origin}" if origin else ""
    kept = {k: v for k, v in state.items() if not k.startswith(MAGE_SKIPPED_PREFIXES)}
    has_encoder = any(k.startswith(MAGE_ENCODER_PREFIX) for k in kept)
    if not any(k.startswith(MAGE_DECODER_PREFIX) for k in kept):
        raise FlowliftError(
            f"Mage-VAE weights{source} hold no decoder (no pipeline.* tensors besides the skipped ones)"
        )
    shapes = {name: tuple(v.shape) for k, v in kept.items() if (name := _flowlift_name(k)) is not None}
    # On the meta device through the layers' own ``device`` argument, not ``with torch.device("meta")``, whose
    # mode sends each layer's initialisation through torch's Python decompositions: 0.040 against 0.053 CPU-s for
    # the released widths with the command's frozen garbage collector (the 2-core AMD EPYC; issue 47).
    try:
        skeleton = MageVAEModel(config or infer_config(shapes), encoder=has_encoder, decoder=True, device="meta")
    except (ValueError, RuntimeError, ZeroDivisionError):
        # Widths that fit no GroupNorm (a damaged file): compare with the released widths, naming tensors.
        skeleton = MageVAEModel(MageVAEConfig(), encoder=has_encoder, decoder=True, device="meta")
    expected = {_released_name(k): v for k, v in skeleton.state_dict().items()}
    problem = state_dict_mismatch(_Shapes(expected), kept)
    bad = next((k for k, v in kept.items() if not v.is_floating_point()), None)
    if problem is None and bad is not None:
        problem = f"`{bad}` has dtype {str(kept[bad].dtype).removeprefix('torch.')}, expected floating point"
    if problem:
        raise FlowliftError(f"Mage-VAE weights{source} do not match the architecture: {problem}")
    # Float32 copies: the model must not share memory with the caller's tensors (and the finiteness check is
    # several times faster on float32 than on a bf16 file's tensors); tensors the caller hands over (``owned``,
    # e.g. just read from a file) are used as they are when already float32. The t = 0 fold writes new tensors.
    with one_thread("cpu"):
        tensors = {k: v.to(torch.float32, copy=not owned) for k, v in kept.items()}
    check_finite_state(tensors, what="Mage-VAE weights", origin=origin)
    # The meta skeleton takes the tensors as they are (no random init of ~140M parameters).
    skeleton.load_state_dict({_flowlift_name(k): v for k, v in tensors.items()}, strict=True, assign=True)
    # The fold and the conversion in one CPU thread, like the copies above and the finiteness check: they
    # read ~550 MB and write ~280 MB once, memory- and page-fault-bound work that a second OpenMP thread does
    # not speed up but pays for (its waits, its faults): on the 2-core AMD EPYC the command's loading took
    # 0.63-0.72 against 0.76-0.80 CPU-s so, ~0.1 s more wall time (docs/cpu.md, issue 47).
    with one_thread("cpu"):
        model = skeleton.fold_t0(dtype)
        # Channels-last in the same conversion (MageVAE keeps it so): one copy of the weights, not two.
        model = model.to(device=device, dtype=dtype, memory_format=torch.channels_last)
    return MageVAE(model, origin=origin)


class _Shapes(torch.nn.Module):
    """A stand-in whose ``state_dict()`` is a given {name: tensor} map, for :func:`state_dict_mismatch`."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self._tensors = dict(tensors)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return self._tensors
