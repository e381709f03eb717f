"""What a refine output records: its images and latents, and the parameters that made them.

Every mode of :class:`~flowlift.refine.refiner.Flux2Refiner` returns a :class:`RefineOutput` whose
``parameters`` go into the output file's metadata: what was asked (strength, steps, seed, prompt...), what
ran (dtype, device, the exact sigmas, the schedule's mu and window) and where the weights came from.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from flowlift.errors import FlowliftError
from flowlift.refine.loop import RefineResult
from flowlift.refine.request import HiresSettings

#: The conditioning keywords every mode of :class:`~flowlift.refine.refiner.Flux2Refiner` passes to its ``denoiser``.
CONDITIONING_KEYWORDS = (
    "prompt",
    "prompt_embeds",
    "negative_prompt",
    "negative_prompt_embeds",
    "cfg_scale",
    "guidance",
    "reference_images",
)


@dataclass
class RefineOutput:
    """Images (B, 3, H, W) in [0, 1], their normalized latents, and the parameters that made them."""

    images: torch.Tensor
    latents: torch.Tensor
    parameters: dict[str, Any]


def output_parameters(
    mode: str,
    result: RefineResult,
    *,
    model: str,
    dtype: torch.dtype,
    device: torch.device,
    provenance: dict[str, Any],
    **kwargs: Any,
) -> dict[str, Any]:
    """The metadata of one refine output: the request (``kwargs``, unset ones left out), what ran and the sigmas."""
    from flowlift.version import __version__

    params = {"flowlift": __version__, "mode": mode, "model": model}
    # what ran, not what was asked for ("auto")
    params.update(dtype=str(dtype).removeprefix("torch."), device=str(device))
    params.update({k: v for k, v in kwargs.items() if v is not None})
    params.update(provenance)
    # exact, as the sampler ran them: rounded to 6 decimals, a strength of 1e-9 read as sigmas [0.0, 0.0] and t0 0.0
    params["sigmas"] = [float(s) for s in result.sigmas]
    params["t0"] = float(result.t0)
    params["model_calls"] = result.model_calls
    params.update(result.tiling)  # tile_size as asked; tiles (size, overlap, grid, batch) when tiles ran
    if result.mu is not None:  # the schedule that made the sigmas (none ran at strength 0)
        params.update(mu=float(result.mu), mu_rule=result.mu_rule)
        if mode != "txt2img":  # a full window is the same under both
            params["schedule"] = result.schedule
    return params


def check_conditioning(conditioning: dict[str, Any], mode: str) -> None:
    """One line naming any keyword of ``conditioning`` (a mode's ``**conditioning``) that is not a conditioning
    keyword (:data:`CONDITIONING_KEYWORDS`), before the mode does any work."""
    unknown = [name for name in conditioning if name not in CONDITIONING_KEYWORDS]
    if not unknown:
        return
    hint = ""
    if mode == "hires":
        settings = [name for name in unknown if name in {f.name for f in fields(HiresSettings)}]
        if settings:
            field = "a HiresSettings field" if len(settings) == 1 else "HiresSettings fields"
            hint = f"; {', '.join(settings)} {'is' if len(settings) == 1 else 'are'} {field} (hires' second argument)"
    names = ", ".join(repr(name) for name in unknown)
    raise FlowliftError(
        f"{mode} got unknown keyword{'s' if len(unknown) > 1 else ''} {names}: the conditioning keywords are "
        f"{', '.join(CONDITIONING_KEYWORDS)}{hint}"
    )


def conditioning_parameters(conditioning: dict[str, Any], den: Any) -> dict[str, Any]:
    """The prompt side of the metadata: prompt, the negative prompt true CFG used, CFG scale, guidance, references."""
    negative = None
    if den.cfg_scale != 1.0:
        negative = conditioning.get("negative_prompt")
        if negative is None and conditioning.get("negative_prompt_embeds") is None:
            negative = ""  # the default negative prompt under true CFG
    return {
        "prompt": conditioning.get("prompt"),
        "negative_prompt": negative,
        "cfg_scale": den.cfg_scale,
        "guidance": den.guidance,
        "reference_images": len(den.reference_latents) or None,
    }
