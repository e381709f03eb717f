"""A :class:`~flowlift.refine.request.RefineRequest` planned once, then run: refine's job, whichever door asked.

:func:`plan_refine_job` decides everything that needs no weights, before any load: the device, the prompt's
files and extras, the output (name, format, what is there), the input images read and checked (mask size, a mask
not all 0, outpaint's image on the 16-px grid and its canvas under the 16K cap, img2img's input under it,
references and hires inputs on the 16-px grid), the prompt embeddings' batch (one image: one prompt), the strength
and the frame the memory plan is made for, and ``mu empirical`` at that size. The plan (:class:`RefineJob`) is data.

:func:`run_refine` is the whole command: the plan, every weight found in one message (:func:`find_weights`), what
the transformer's config says of the conditioning checked before anything loads
(:func:`check_transformer_conditioning`), the prompts embedded before the transformer loads (:func:`load_for_job`),
the mode run (:func:`refine_job`; hires through :meth:`~flowlift.refine.refiner.Flux2Refiner.hires`), the result
written with its metadata (:func:`write_job`). The web app runs the same plan and the same :func:`refine_job` on the
refiner it keeps loaded. Nothing here prints: a front-end shows the result.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowlift.errors import FIELD_MARK, FlowliftError, from_field
from flowlift.limits import PIXEL_MULTIPLE, hires_latent_size
from flowlift.refine.request import LatentUpscaler, RefineRequest
from flowlift.refine.settings import check_hires_size, check_within_cap


@dataclass
class RefineJob:
    """One planned refine: the request, the resolved ``device``/``dtype``, the ``output`` path, the inputs as read
    (``rgb`` and ``alpha`` Pillow images, ``images``/``mask``/``references`` tensors), ``pads`` (outpaint borders
    as asked), the strength it runs at, and ``frame`` (height, width px): the largest image the refine decodes,
    what the memory plan is made for."""

    request: RefineRequest
    device: Any
    dtype: Any
    output: Path
    frame: tuple[int, int]
    strength: float
    rgb: Any = None
    alpha: Any = None
    images: Any = None
    mask: Any = None
    references: list[Any] = field(default_factory=list)
    pads: tuple[int, int, int, int] | None = None


def _check_prompt(request: RefineRequest) -> None:
    """The prompt's file is there; text to embed here needs the text encoder's extra."""
    prompt = request.prompt
    if prompt.embeds is not None and not Path(prompt.embeds).is_file():
        said = "{} is a folder: give a .safetensors file" if Path(prompt.embeds).is_dir() else "file not found: {}"
        raise FlowliftError("prompt.embeds: " + said.format(prompt.embeds), field="prompt.embeds")
    if prompt.needs_text_encoder:
        import importlib.util

        if importlib.util.find_spec("transformers") is None:
            from flowlift.console import install_command

            raise FlowliftError(
                f"{FIELD_MARK} needs the FLUX.2 text encoder, in the text extra ({install_command('text')}); "
                f"or pass precomputed {FIELD_MARK}",
                field=("prompt.text", "prompt.embeds"),
            )


def _check_mu(request: RefineRequest, height: int, width: int) -> None:
    """``mu empirical`` at this size (pixels) must give a mu in range: refused before weights load."""
    if request.sampling.mu != "empirical":
        return
    from flowlift.flux2.schedule import resolve_mu
    from flowlift.refine.loading import model_default_steps

    steps = request.sampling.steps
    if steps is None:  # the model's, as the refiner will resolve it
        steps = model_default_steps(request.source.model, request.source.transformer)[0]
    tokens = -(-height // PIXEL_MULTIPLE) * -(-width // PIXEL_MULTIPLE)
    try:
        resolve_mu("empirical", tokens, steps)
    except FlowliftError as error:
        raise FlowliftError(f"mu: {error} ({width}x{height} px)", field="mu") from None


#: How far apart a grey mask's R, G and B may be (a JPEG's chroma noise); past it the mask is coloured.
MASK_CHROMA_LEVELS = 8


def grey_mask(rgb: Any, alpha: Any) -> Any:
    """A mask image's grey levels (Pillow ``L``: white regenerates, black keeps, grey blends), or one line for a
    mask whose meaning they would not carry: one with transparent pixels (an editor's export that marks the region in
    alpha would regenerate everything) or a coloured one (a red stroke would be a uniform 30% soft mask)."""
    import numpy as np

    if alpha is not None and alpha.getextrema()[0] < 255:
        raise FlowliftError(
            "mask has transparent pixels: flowlift reads a mask's grey levels (white = regenerate, black = keep), "
            "not its alpha; export it as a greyscale image",
            field="mask",
        )
    pixels = np.asarray(rgb, dtype=np.int16)
    if int((pixels.max(axis=2) - pixels.min(axis=2)).max()) > MASK_CHROMA_LEVELS:
        raise FlowliftError(
            "mask is coloured: give a greyscale mask (white = regenerate, black = keep, grey = a soft edge)",
            field="mask",
        )
    return rgb.convert("L")


def _read_inputs(job: RefineJob) -> None:
    """The input image, the mask and the references, read and checked against each other."""
    from flowlift.files.images import load_image, to_tensor

    request = job.request
    job.rgb, job.alpha = load_image(request.image)
    job.images = to_tensor(job.rgb)
    if request.mask is not None:
        with from_field("mask"):
            mask_rgb, mask_alpha = load_image(request.mask)
        width, height = job.rgb.size
        if mask_rgb.size != job.rgb.size:
            raise FlowliftError(
                f"mask is {mask_rgb.size[0]}x{mask_rgb.size[1]}, the image {width}x{height}: give a mask of the "
                "image's size",
                field="mask",
            )
        from flowlift.refine.canvas import checked_mask  # the API's rule: a mask of 0 everywhere paints nothing

        job.mask = checked_mask(to_tensor(grey_mask(mask_rgb, mask_alpha).convert("RGB"))[:, :1], job.images)
    with from_field("references"):
        job.references = [to_tensor(load_image(path)[0]) for path in request.references]
    for path, ref in zip(request.references, job.references, strict=True):
        if ref.shape[-1] % PIXEL_MULTIPLE or ref.shape[-2] % PIXEL_MULTIPLE:
            got = f"{ref.shape[-1]}x{ref.shape[-2]}"
            raise FlowliftError(
                f"references {path}: sides must be multiples of {PIXEL_MULTIPLE} px, got {got}", field="references"
            )


def _frame(job: RefineJob) -> tuple[int, int]:
    """(height, width) px of the largest image the refine decodes: the padded input, the outpaint canvas, the
    txt2img size, or the hires input (or base) times the scale."""
    from flowlift.refine.canvas import outpaint_pads

    request = job.request
    if request.mode == "hires":  # the base size was checked with the request; an image's here, with the same rule
        width, height = (job.rgb.width, job.rgb.height) if job.rgb is not None else request.hires.base_size
        if job.rgb is not None:
            check_hires_size(width, height, request.hires.scale, "image")
        out_h, out_w = hires_latent_size(height // 8, width // 8, request.hires.scale)  # latents: 1/8 of the pixels
        return out_h * 8, out_w * 8
    if request.mode == "txt2img":
        width, height = request.size
        return height, width
    if job.pads is not None:
        left, top, right, bottom = outpaint_pads(job.rgb.height, job.rgb.width, *job.pads)  # the cap, before loading
        return job.rgb.height + top + bottom, job.rgb.width + left + right
    check_within_cap(job.rgb.width, job.rgb.height, "image")  # img2img and inpaint write the input's size
    return -(-job.rgb.height // PIXEL_MULTIPLE) * PIXEL_MULTIPLE, -(-job.rgb.width // PIXEL_MULTIPLE) * PIXEL_MULTIPLE


def _output(request: RefineRequest) -> Path:
    """The output (``request.output``, else ``<stem>_<suffix>.png`` beside the input), checked: it can be written
    and destroys nothing, it is none of the files the request reads (issue 36.2, each named by its field), and a
    file flowlift did not write needs ``overwrite``."""
    from flowlift.files.image_outputs import check_single_output
    from flowlift.files.naming import refined_output
    from flowlift.files.output_paths import same_file_error
    from flowlift.refine.loras import parse_lora_spec

    image = os.fspath(request.image) if request.image is not None else None
    output = Path(request.output) if request.output else refined_output(image, request.name_suffix)

    source, hires = request.source, request.hires
    upscaler = hires.upscaler.name if hires is not None and hires.upscaler is not None else None
    files = {
        "image": request.image,
        "mask": request.mask,
        "references": list(request.references) or None,
        "prompt.embeds": request.prompt.embeds,
        "source.model": source.model,
        "source.transformer": source.transformer,
        "source.vae": source.vae,
        "hires.upscaler": upscaler,
        "source.loras": [parse_lora_spec(text)[0] for text in source.loras] or None,
    }
    for name, paths in files.items():
        if paths is not None and (error := same_file_error(output, {name: paths})):
            raise error
    try:
        check_single_output(output, request.overwrite, option=FIELD_MARK)
    except FlowliftError as error:  # its fields kept, each with its mark (a user's file: output, overwrite)
        fields = error.fields or ("output",)
        raise FlowliftError(error.template if error.fields else error.args[0], field=fields) from None
    return output


def plan_refine_job(request: RefineRequest) -> RefineJob:
    """Everything of ``request`` that needs no weights, checked in the order a user meets it (see the module
    docstring); nothing is loaded or written."""
    from flowlift.devices import resolve_device_dtype
    from flowlift.flux2.denoiser import check_embeds_batch

    _check_prompt(request)
    job = RefineJob(request, None, None, _output(request), (0, 0), request.mode_strength, pads=request.outpaint)
    check_embeds_batch(job_conditioning(job), 1, "prompt.embeds")  # the file's, as used: one image, one prompt
    if request.image is not None:
        _read_inputs(job)
    job.frame = _frame(job)
    _check_mu(request, *job.frame)  # at the size the refine pass runs
    job.device, job.dtype = resolve_device_dtype(request.source.device, request.source.dtype)
    return job


def find_weights(job: RefineJob) -> list[Any]:
    """Every weight the job needs, found before any loads, all missing ones named in one message
    (:func:`~flowlift.refine.source_checks.check_refiner_source`): what the
    :class:`~flowlift.refine.request.RefinerSource` names, the transformer, the VAE, the text encoder when a prompt
    is embedded here, and (hires) the upscaler. Returns the LoRAs as ``(path, scale)`` pairs."""
    from flowlift.refine.source_checks import check_model_part, check_refiner_source

    request = job.request
    upscaler = request.hires.upscaler if request.mode == "hires" else None
    also = [upscaler.find] if upscaler is not None else []
    prompt, text_encoder = request.prompt, _embeds_a_text(request.prompt)
    if prompt.embeds is not None and text_encoder:  # only the negative prompt is left to embed: say so
        try:
            check_model_part(request.source.model, "text_encoder")
        except FlowliftError:
            if prompt.negative is not None:  # a negative text given: it is what needs the encoder
                raise FlowliftError(
                    f"{FIELD_MARK} needs the model's text encoder to embed it, which the model lacks: save it as "
                    f"negative_prompt_embeds in the {FIELD_MARK} file instead",
                    field=("prompt.negative", "prompt.embeds"),
                ) from None
            raise FlowliftError(
                f"{FIELD_MARK} {prompt.cfg_scale:g} embeds a negative prompt with the model's text encoder, which the "
                f"model lacks: save negative_prompt_embeds in the {FIELD_MARK} file, or use a cfg scale of 1",
                field=("prompt.cfg_scale", "prompt.embeds"),
            ) from None
    return check_refiner_source(request.source, text_encoder=text_encoder, also=also)


def _embeds_a_text(prompt: Any) -> bool:
    """Whether :func:`job_conditioning` will embed a text here: no embeddings file, or classifier-free guidance
    (``cfg_scale != 1``) whose negative is text or missing from the file (then the empty prompt is embedded)."""
    from flowlift.models.prompt_embeds import load_prompt_embeds

    if prompt.embeds is None:
        return True
    return prompt.cfg_scale != 1.0 and (prompt.negative is not None or load_prompt_embeds(prompt.embeds)[1] is None)


def job_conditioning(job: RefineJob, embed: Callable[[Sequence[str]], list[Any]] | None = None) -> dict[str, Any]:
    """The conditioning keywords of the job's prompt: its embeddings file read; texts embedded by ``embed`` (the
    command line's text encoder, freed before the transformer loads), or left as text for a refiner with its own
    prompt encoder (``embed`` None)."""
    from flowlift.models.prompt_embeds import load_prompt_embeds

    prompt = job.request.prompt
    embeds = negative = None
    if prompt.embeds is not None:
        embeds, negative = load_prompt_embeds(prompt.embeds)
    true_cfg = prompt.cfg_scale != 1.0
    # a negative text given is embedded and used (over the file's); without true CFG no negative is used at all
    need_negative = true_cfg and (prompt.negative is not None or negative is None)
    negative = None if need_negative or not true_cfg else negative
    negative_text = (prompt.negative or "") if need_negative else None
    if embed is not None and (embeds is None or need_negative):
        texts = ([prompt.text] if embeds is None else []) + ([negative_text] if need_negative else [])
        encoded = embed(texts)
        embeds = encoded.pop(0) if embeds is None else embeds
        negative = encoded.pop(0) if need_negative else negative
    return {
        "prompt": prompt.text,
        "prompt_embeds": embeds,
        "negative_prompt": negative_text,
        "negative_prompt_embeds": negative,
        "cfg_scale": prompt.cfg_scale,
        "guidance": prompt.guidance,
    }


def _check_embeds_width(conditioning: dict[str, Any], config: dict[str, Any]) -> None:
    """Prompt embeddings as wide as the transformer's text input (``config``'s; none there: unknown yet)."""
    width = config.get("joint_attention_dim")
    for key, what in (("prompt_embeds", "prompt embeddings"), ("negative_prompt_embeds", "negative prompt embeddings")):
        embeds = conditioning.get(key)
        if width is not None and embeds is not None and embeds.shape[-1] != width:
            raise FlowliftError(
                f"{FIELD_MARK}: {what} have dim {embeds.shape[-1]} but the transformer expects {width} (embeddings "
                "from another model's text encoder?)",
                field="prompt.embeds",
            )


def check_transformer_conditioning(job: RefineJob) -> dict[str, Any]:
    """What the transformer's config (:func:`~flowlift.refine.source_checks.transformer_config`: a file's headers or
    its ``config.json``, read once the weights are found, before anything loads or a loading line is shown) says of
    the job's conditioning: ``guidance`` only for a model with a guidance embedding (dev, not Klein), and the
    embeddings file as wide as its text input. Returns the config, for embeddings a text encoder makes later."""
    from flowlift.refine.source_checks import transformer_config

    source, prompt = job.request.source, job.request.prompt
    config = transformer_config(source.model, source.transformer)
    if "guidance_embeds" in config:
        from flowlift.flux2.denoiser import check_guidance

        check_guidance(prompt.guidance, config["guidance_embeds"], ("prompt.guidance", "prompt.cfg_scale"))
    if prompt.embeds is not None:
        _check_embeds_width(job_conditioning(job), config)
    return config


def load_for_job(job: RefineJob, loras: Sequence[Any], config: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The refiner for ``job`` and its conditioning: prompts given as text embedded first, by a text encoder that is
    freed before the transformer loads, and held to the transformer's ``config``
    (:func:`check_transformer_conditioning`); the memory plan made for the job's frame."""
    from flowlift.refine.loading import load_refiner
    from flowlift.refine.memory_plan import RefineMemory
    from flowlift.refine.prompts import embed_prompts

    source = job.request.source

    def embed(texts: Sequence[str]) -> list[Any]:
        return embed_prompts(source.model, texts, device=job.device, dtype=job.dtype)

    conditioning = job_conditioning(job, embed)
    _check_embeds_width(conditioning, config)
    tokens = conditioning["prompt_embeds"].shape[1]
    memory = RefineMemory(source.offload, source.max_memory, job.frame, tokens)
    refiner = load_refiner(
        source.model,
        vae=source.vae,
        transformer=source.transformer,
        loras=loras,
        memory=memory,
        device=job.device,
        dtype=job.dtype,
        progress=job.request.progress,
        tiles=job.request.tiles,
    )
    return refiner, conditioning


def refine_job(
    job: RefineJob, refiner: Any, conditioning: dict[str, Any], upscaler: LatentUpscaler | None = None
) -> Any:
    """Run the job's mode on ``refiner`` (hires: :meth:`~flowlift.refine.refiner.Flux2Refiner.hires` on
    ``upscaler``); the :class:`~flowlift.refine.parameters.RefineOutput`."""
    request = job.request
    common = dict(strength_map=request.strength_map, sampling=request.sampling, tiles=request.tiles, **conditioning)
    if request.mode == "hires":
        if upscaler is None:
            raise FlowliftError("the hires fix needs an upscaler")
        return refiner.hires(upscaler, request.hires, images=job.images, **common)
    if request.mode == "txt2img":
        width, height = request.size
        return refiner.txt2img(
            height=height, width=width, sampling=request.sampling, tiles=request.tiles, **conditioning
        )
    common.update(reference_images=job.references)
    if job.pads is not None:
        left, top, right, bottom = job.pads
        return refiner.outpaint(
            job.images, left=left, top=top, right=right, bottom=bottom, strength=job.strength, **common
        )
    return refiner.img2img(job.images, mask=job.mask, strength=job.strength, **common)


def job_metadata(job: RefineJob, result: Any, shown: Callable[[Any], Any] = os.fspath) -> dict[str, Any]:
    """The output's ``flowlift`` metadata: the refiner's parameters, the command, the inputs (as ``shown`` names
    them: the path on the command line, the uploaded file's name in the app) with their SHA-256, the VAE."""
    from flowlift.files.image_outputs import input_hashes

    request = job.request
    files = {"input": request.image, "mask": request.mask, "prompt_embeds": request.prompt.embeds}
    metadata = dict(result.parameters)
    metadata.update(
        command=request.command or ("hires" if request.mode == "hires" else "img2img"),
        input=shown(request.image) if request.image is not None else None,
        mask=shown(request.mask) if request.mask is not None else None,
        references=[shown(path) for path in request.references] or None,
        prompt_embeds=shown(request.prompt.embeds) if request.prompt.embeds is not None else None,
        vae=request.source.vae or request.source.model,
        **input_hashes({key: os.fspath(path) if path is not None else None for key, path in files.items()}),
    )
    return {key: value for key, value in metadata.items() if value is not None}


def write_job(job: RefineJob, result: Any, shown: Callable[[Any], Any] = os.fspath) -> Any:
    """Write the result to the job's output with its :func:`job_metadata` (inputs named as ``shown`` names them;
    the input's alpha put back, resized with the image; outpaint has none; ICC profile and EXIF of the input kept);
    returns the written Pillow image."""
    from flowlift.files.alpha import attach_alpha
    from flowlift.files.image_outputs import save_image_atomic
    from flowlift.files.images import tensor_to_pil
    from flowlift.files.metadata import metadata_record

    metadata = job_metadata(job, result, shown)
    alpha = None if job.pads is not None else job.alpha
    image = attach_alpha(tensor_to_pil(result.images[0]), alpha)
    source = os.fspath(job.request.image) if job.request.image is not None else None
    record = metadata_record(str(metadata.get("command", job.request.mode)), metadata)  # schema 1 (docs/metadata.md)
    save_image_atomic(image, job.output, record, source=source, overwrite=job.request.overwrite)
    return image


def run_refine(request: RefineRequest) -> Path:
    """The whole refine of ``request``: planned (:func:`plan_refine_job`), its weights found, loaded, run and
    written; returns the output path. Its stages go to one :class:`~flowlift.progress.RunProgress` from the
    command's start (off a terminal, :func:`flowlift.console.run_lines`: what loads, then each stage and step)."""
    from flowlift.console import command_started, run_lines
    from flowlift.progress import RunProgress, running

    job = plan_refine_job(request)  # no stage of the run: refused (or planned) before any line is shown
    run = RunProgress(started=command_started())
    with running(run), run_lines(run, request.progress):
        return _run_job(job, run)


def _run_job(job: RefineJob, run: Any) -> Path:
    """The planned ``job`` run under ``run``: its weights found, loaded, its mode run and the result written."""
    from flowlift.refine.stages import plan_job_stages

    request = job.request
    loras = find_weights(job)
    config = check_transformer_conditioning(job)
    run.loading(f"the FLUX.2 model {Path(request.source.model).name}")
    refiner, conditioning = load_for_job(job, loras, config)
    upscaler = None
    if request.mode == "hires":
        plan = refiner.memory_plan  # the upscaler gets what the transformer leaves of max_memory
        upscaler = request.hires.upscaler.load(
            refiner.vae,
            device=refiner.device,
            dtype=refiner.dtype,
            budget_bytes=plan.upscaler_budget_bytes if plan else None,
        )
    run.loading(None)
    plan_job_stages(run, job, request.sampling.steps or refiner.default_steps)
    result = refine_job(job, refiner, conditioning, upscaler)
    run.begin("writing")
    write_job(job, result)
    run.finished("writing")
    return job.output
