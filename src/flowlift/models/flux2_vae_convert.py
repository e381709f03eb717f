"""FLUX.2 VAE state dicts -> :class:`~flowlift.models.vae.Flux2VAE` (:func:`flux2_from_state_dict`), single-file
checkpoints (original BFL / ComfyUI key names) converted to the diffusers layout first.

diffusers 0.42's ``AutoencoderKLFlux2.from_single_file`` does not handle this class, yet ComfyUI users
hold ``flux2-vae.safetensors`` with the original (LDM-style) names. The renaming, as documented by
diffusers' ``scripts/convert_flux2_to_diffusers.py``:

==========================================  =======================================================
original                                    diffusers
==========================================  =======================================================
``{enc,dec}oder.conv_in / conv_out``        same
``{enc,dec}oder.norm_out``                  ``{enc,dec}oder.conv_norm_out``
``encoder.quant_conv``                      ``quant_conv``
``decoder.post_quant_conv``                 ``post_quant_conv``
``encoder.down.{i}.block.{j}``              ``encoder.down_blocks.{i}.resnets.{j}``
``encoder.down.{i}.downsample.conv``        ``encoder.down_blocks.{i}.downsamplers.0.conv``
``decoder.up.{k}.block.{j}``                ``decoder.up_blocks.{n-1-k}.resnets.{j}`` (reversed)
``decoder.up.{k}.upsample.conv``            ``decoder.up_blocks.{n-1-k}.upsamplers.0.conv``
``*.nin_shortcut``                          ``*.conv_shortcut``
``*.mid.block_{1,2}``                       ``*.mid_block.resnets.{0,1}``
``*.mid.attn_1.{norm,q,k,v,proj_out}``      ``*.mid_block.attentions.0.{group_norm,to_q,to_k,to_v,to_out.0}``
                                            (1x1-conv weights (C, C, 1, 1) become linear (C, C))
``bn.running_mean / running_var``           same
==========================================  =======================================================

Everything is checked: a key that fits no rule, or a converted state that does not match the model
built from the inferred config, is one :class:`~flowlift.errors.FlowliftError` line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from flowlift.errors import FlowliftError
from flowlift.models.vae import Flux2VAE
from flowlift.models.weights import load_strict

#: Prefixes some single-file checkpoints put in front of the VAE keys.
KNOWN_PREFIXES = ("first_stage_model.", "vae.", "model.")

_FIXED = {
    "encoder.norm_out.": "encoder.conv_norm_out.",
    "decoder.norm_out.": "decoder.conv_norm_out.",
    "encoder.quant_conv.": "quant_conv.",
    "decoder.post_quant_conv.": "post_quant_conv.",
    "encoder.conv_in.": "encoder.conv_in.",
    "encoder.conv_out.": "encoder.conv_out.",
    "decoder.conv_in.": "decoder.conv_in.",
    "decoder.conv_out.": "decoder.conv_out.",
}
_ATTN = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}
_RESNET_PARTS = {"norm1", "conv1", "norm2", "conv2", "nin_shortcut"}
_BN_KEYS = {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}


def is_original_flux2_vae(state: Mapping[str, torch.Tensor]) -> bool:
    """True when the keys look like an original (BFL / ComfyUI) FLUX.2 VAE checkpoint."""
    keys = strip_prefix(state).keys()
    return "encoder.down.0.block.0.conv1.weight" in keys or "decoder.up.0.block.0.conv1.weight" in keys


def is_diffusers_flux2_vae(state: Mapping[str, torch.Tensor]) -> bool:
    """True when the keys look like diffusers' ``AutoencoderKLFlux2`` (with its ``bn`` stats)."""
    return "encoder.down_blocks.0.resnets.0.conv1.weight" in state and "bn.running_mean" in state


def strip_prefix(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop a prefix from :data:`KNOWN_PREFIXES` that every key carries."""
    for prefix in KNOWN_PREFIXES:
        if state and all(k.startswith(prefix) for k in state):
            return {k[len(prefix) :]: v for k, v in state.items()}
    return dict(state)


def _num_up_blocks(keys: list[str]) -> int:
    found = {int(m.group(1)) for k in keys if (m := re.match(r"decoder\.up\.(\d+)\.", k))}
    return max(found) + 1 if found else 0


def original_key_to_diffusers(key: str, num_up_blocks: int) -> str | None:
    """The diffusers name of one original key (see the module table), or None if no rule fits."""
    if key in _BN_KEYS:
        return key
    for old, new in _FIXED.items():
        if key.startswith(old) and key.count(".") == old.count("."):
            return new + key[len(old) :]
    m = re.fullmatch(r"encoder\.down\.(\d+)\.block\.(\d+)\.(\w+)\.(weight|bias)", key)
    if m and m.group(3) in _RESNET_PARTS:
        part = "conv_shortcut" if m.group(3) == "nin_shortcut" else m.group(3)
        return f"encoder.down_blocks.{m.group(1)}.resnets.{m.group(2)}.{part}.{m.group(4)}"
    m = re.fullmatch(r"encoder\.down\.(\d+)\.downsample\.conv\.(weight|bias)", key)
    if m:
        return f"encoder.down_blocks.{m.group(1)}.downsamplers.0.conv.{m.group(2)}"
    m = re.fullmatch(r"decoder\.up\.(\d+)\.block\.(\d+)\.(\w+)\.(weight|bias)", key)
    if m and m.group(3) in _RESNET_PARTS and int(m.group(1)) < num_up_blocks:
        part = "conv_shortcut" if m.group(3) == "nin_shortcut" else m.group(3)
        block = num_up_blocks - 1 - int(m.group(1))
        return f"decoder.up_blocks.{block}.resnets.{m.group(2)}.{part}.{m.group(4)}"
    m = re.fullmatch(r"decoder\.up\.(\d+)\.upsample\.conv\.(weight|bias)", key)
    if m and int(m.group(1)) < num_up_blocks:
        return f"decoder.up_blocks.{num_up_blocks - 1 - int(m.group(1))}.upsamplers.0.conv.{m.group(2)}"
    m = re.fullmatch(r"(encoder|decoder)\.mid\.block_([12])\.(\w+)\.(weight|bias)", key)
    if m and m.group(3) in _RESNET_PARTS:
        part = "conv_shortcut" if m.group(3) == "nin_shortcut" else m.group(3)
        return f"{m.group(1)}.mid_block.resnets.{int(m.group(2)) - 1}.{part}.{m.group(4)}"
    m = re.fullmatch(r"(encoder|decoder)\.mid\.attn_1\.(\w+)\.(weight|bias)", key)
    if m and m.group(2) in _ATTN:
        return f"{m.group(1)}.mid_block.attentions.0.{_ATTN[m.group(2)]}.{m.group(3)}"
    return None


def convert_original_flux2_vae(state: Mapping[str, torch.Tensor], *, origin: str = "") -> dict[str, torch.Tensor]:
    """Rename an original FLUX.2 VAE state dict to diffusers' ``AutoencoderKLFlux2`` layout.

    Attention projections stored as 1x1 convolutions ``(C, C, 1, 1)`` become linear ``(C, C)``.
    Raises FlowliftError naming the keys no rule maps.
    """
    state = strip_prefix(state)
    keys = list(state)
    n_up = _num_up_blocks(keys)
    out: dict[str, torch.Tensor] = {}
    unmapped = []
    for key in keys:
        new = original_key_to_diffusers(key, n_up)
        if new is None:
            unmapped.append(key)
            continue
        value = state[key]
        if ".mid_block.attentions.0.to_" in new and new.endswith(".weight") and value.ndim == 4:
            value = value[:, :, 0, 0]
        out[new] = value
    if unmapped:
        shown = ", ".join(sorted(unmapped)[:5]) + (f" (+{len(unmapped) - 5} more)" if len(unmapped) > 5 else "")
        where = f" {origin}" if origin else ""
        raise FlowliftError(f"FLUX.2 VAE single file{where}: {len(unmapped)} keys fit no known name: {shown}")
    return out


def infer_flux2_config(
    state: Mapping[str, torch.Tensor], *, norm_num_groups: int = 32, batch_norm_eps: float = 1e-4
) -> dict[str, Any]:
    """``AutoencoderKLFlux2`` config from a diffusers-layout state dict's shapes.

    ``norm_num_groups`` and ``batch_norm_eps`` leave no trace in the weights; the defaults are the
    released FLUX.2 VAE's.
    """
    try:
        n_down = 1 + max(int(m.group(1)) for k in state if (m := re.match(r"encoder\.down_blocks\.(\d+)\.", k)))
        n_up = 1 + max(int(m.group(1)) for k in state if (m := re.match(r"decoder\.up_blocks\.(\d+)\.", k)))
        block_out = tuple(int(state[f"encoder.down_blocks.{i}.resnets.0.conv1.weight"].shape[0]) for i in range(n_down))
        dec_out = tuple(
            int(state[f"decoder.up_blocks.{n_up - 1 - i}.resnets.0.conv1.weight"].shape[0]) for i in range(n_up)
        )
        layers = 1 + max(
            int(m.group(1)) for k in state if (m := re.match(r"encoder\.down_blocks\.0\.resnets\.(\d+)\.", k))
        )
        latent = int(state["decoder.conv_in.weight"].shape[1])
        patch_channels = int(state["bn.running_mean"].shape[0])
        config = {
            "in_channels": int(state["encoder.conv_in.weight"].shape[1]),
            "out_channels": int(state["decoder.conv_out.weight"].shape[0]),
            "down_block_types": ("DownEncoderBlock2D",) * n_down,
            "up_block_types": ("UpDecoderBlock2D",) * n_up,
            "block_out_channels": block_out,
            "decoder_block_out_channels": None if dec_out == block_out else dec_out,
            "layers_per_block": layers,
            "latent_channels": latent,
            "norm_num_groups": norm_num_groups,
            "use_quant_conv": "quant_conv.weight" in state,
            "use_post_quant_conv": "post_quant_conv.weight" in state,
            "mid_block_add_attention": any(".mid_block.attentions." in k for k in state),
            "batch_norm_eps": batch_norm_eps,
        }
    except (KeyError, ValueError, IndexError) as error:
        raise FlowliftError(f"FLUX.2 VAE: cannot infer the architecture from the weights (no {error})") from None
    side = round((patch_channels // latent) ** 0.5)
    if side * side * latent != patch_channels:
        raise FlowliftError(f"FLUX.2 VAE: bn has {patch_channels} channels, not a square patch of {latent}")
    config["patch_size"] = (side, side)
    return config


#: config.json keys the weights' shapes determine (:func:`infer_flux2_config`), compared before anything is built.
_FROM_SHAPES = (
    "in_channels",
    "out_channels",
    "block_out_channels",
    "decoder_block_out_channels",
    "layers_per_block",
    "latent_channels",
    "use_quant_conv",
    "use_post_quant_conv",
    "mid_block_add_attention",
    "patch_size",
)


def _as_plain(value: Any) -> Any:
    """JSON lists and Python tuples compare alike."""
    return list(value) if isinstance(value, (list, tuple)) else value


def config_problem(config: Mapping[str, Any], state: Mapping[str, torch.Tensor]) -> str | None:
    """The first value of ``config`` (a diffusers-layout VAE's config.json) that its weights ``state``
    contradict, said as ``block_out_channels is [100000, ...], the weights hold [128, ...]``; None when they agree
    or the shapes imply no config (the strict check on the meta model then names the tensors)."""
    try:
        implied = infer_flux2_config(state)
    except FlowliftError:
        return None
    implied["decoder_block_out_channels"] = implied["decoder_block_out_channels"] or implied["block_out_channels"]
    given = dict(config)
    if given.get("decoder_block_out_channels") is None:  # None: the decoder takes the encoder's widths
        given.pop("decoder_block_out_channels", None)
        if "block_out_channels" in given:
            given["decoder_block_out_channels"] = given["block_out_channels"]
    for key in ("down_block_types", "up_block_types"):
        if isinstance(given.get(key), (list, tuple)) and len(given[key]) != len(implied[key]):
            return f"{key} lists {len(given[key])} blocks, the weights hold {len(implied[key])}"
    for key in _FROM_SHAPES:
        if key in given and _as_plain(given[key]) != _as_plain(implied[key]):
            return f"{key} is {_as_plain(given[key])!r}, the weights hold {_as_plain(implied[key])!r}"
    return None


def flux2_from_state_dict(
    state: Mapping[str, torch.Tensor],
    *,
    config: Mapping[str, Any] | None = None,
    config_file: str | None = None,
    origin: str = "",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    norm_num_groups: int = 32,
) -> Flux2VAE:
    """Build a :class:`Flux2VAE` from a diffusers-layout or original single-file state dict.

    Original (BFL / ComfyUI) keys are converted (:func:`convert_original_flux2_vae`); without a
    ``config`` the architecture is inferred from the tensor shapes (``norm_num_groups`` cannot be).
    A ``config`` (from ``config_file``, named when it does not fit) is checked against the shapes first
    (:func:`config_problem`), then the model is built on the meta device and checked strictly, so that a
    hand-edited config.json (``block_out_channels: [100000, ...]``) is one line and allocates nothing; the
    weights then become the model's own tensors (no random initialisation).
    """
    from diffusers import AutoencoderKLFlux2  # only now: importing diffusers takes seconds

    if is_original_flux2_vae(state):
        state = convert_original_flux2_vae(state, origin=origin)
    state = dict(state)
    if "bn.running_mean" in state and "bn.num_batches_tracked" not in state:
        state["bn.num_batches_tracked"] = torch.tensor(0, dtype=torch.long)
    named = f" {config_file}" if config_file else (f" {origin}" if origin else "")
    problem = config_problem(config, state) if config is not None else None
    if problem:
        raise FlowliftError(
            f"FLUX.2 VAE config{named} does not match its weights: {problem}; put back the config.json that came "
            "with these weights (fetch the folder again)"
        )
    if config is None:
        config = infer_flux2_config(state, norm_num_groups=norm_num_groups)
    try:
        with torch.device("meta"):
            model = AutoencoderKLFlux2.from_config(dict(config))
    except Exception as error:  # noqa: BLE001 - a bad config file is a user error
        raise FlowliftError(f"FLUX.2 VAE config{named} is invalid: {error}") from None
    # load_strict names any tensor the meta model still lacks or mis-shapes before the float32 copies become it
    state = {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in state.items()}
    load_strict(model, state, what="FLUX.2 VAE weights", origin=origin, assign=True)
    return Flux2VAE(model.to(device=device, dtype=dtype))
