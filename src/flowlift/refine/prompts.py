"""Prompt conditioning: prompt strings to FLUX.2 embeddings with the model's text encoder.

Precomputed embeddings are read and checked by :mod:`flowlift.models.prompt_embeds`; either way the refiner gets
float32 ``prompt_embeds`` (and optional ``negative_prompt_embeds``) it can trust.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from flowlift.errors import FIELD_MARK, FlowliftError

#: Longest upstream message kept in one error line; a longer one is cut at a word boundary, with "...".
UPSTREAM_WORDS_MAX = 300


def _first_line(error: BaseException) -> str:
    """The first line of an upstream library's error, cut (if at all) between words, never inside one."""
    lines = str(error).strip().splitlines()
    line = lines[0] if lines else ""
    if len(line) > UPSTREAM_WORDS_MAX:
        line = line[:UPSTREAM_WORDS_MAX].rsplit(" ", 1)[0].rstrip(",;:") + " ..."
    return line or type(error).__name__


def missing_part_error(model: str, part: str, option: str) -> FlowliftError:
    """The one line for a local diffusers folder without ``part/``, naming the fix (issue 48: before any load); the
    text encoder's names the prompt fields (``prompt.text``, ``prompt.embeds``) for each door to word."""
    fix = (
        f"copy the model's {part}/ folder into it"
        if part != "text_encoder"
        else "copy the model's text_encoder/ "
        f'and tokenizer/ folders into it (e.g. hf download REPO --include "text_encoder/*" "tokenizer/*" '
        f"--local-dir {model}), or pass precomputed {FIELD_MARK}"
    )
    what = f"{FIELD_MARK} needs the model's text encoder, and " if part == "text_encoder" else ""
    fields = ("prompt.text", "prompt.embeds") if part == "text_encoder" else ()
    return FlowliftError(
        f"{option} {model}: {what}this folder has no {part}/ (with its config.json); {fix}", field=fields
    )


class PromptEncoder:
    """Prompt -> FLUX.2 embeddings with the matching diffusers pipeline's text encoder (optional extra).

    Loads the pipeline of ``model`` (``Flux2Pipeline``: Mistral-3; ``Flux2KleinPipeline``: Qwen3) without
    its transformer and VAE, and calls its ``encode_prompt``. Needs ``pip install 'flowlift[text]'``. With
    ``offload`` the text encoder waits in host memory and moves to ``device`` for each prompt.
    """

    def __init__(self, model: str, *, device: torch.device | str, dtype: torch.dtype, offload: bool = False) -> None:
        try:
            import transformers  # noqa: F401
        except ImportError:
            from flowlift.console import install_command

            raise FlowliftError(
                f"computing prompt embeddings needs the text extra ({install_command('text')}); "
                f"or pass precomputed {FIELD_MARK}",
                field="prompt.embeds",
            ) from None
        from diffusers import DiffusionPipeline
        from diffusers.utils import logging as diffusers_logging

        from flowlift.models.hub import hub_offline_reason

        if os.path.isdir(model) and not os.path.isfile(os.path.join(model, "text_encoder", "config.json")):
            raise FlowliftError(  # diffusers' own line lists the pipeline class's expected parts
                f"{FIELD_MARK} {model} has no text_encoder/ folder to embed the prompt with; give prompt embeddings "
                f"({FIELD_MARK}) instead",
                field=("source.model", "prompt.embeds"),
            )
        cache_only = not os.path.exists(model) and hub_offline_reason() is not None  # no retries when unreachable
        bar = diffusers_logging.is_progress_bar_enabled()
        diffusers_logging.disable_progress_bar()  # its "Loading pipeline components" bar would break one-line errors
        try:
            self.pipe = DiffusionPipeline.from_pretrained(
                model, transformer=None, vae=None, torch_dtype=dtype, local_files_only=cache_only
            )
        except Exception as error:  # noqa: BLE001 - any loader failure is a bad model to the user
            raise FlowliftError(f"cannot load the text encoder of {model}: {_first_line(error)}") from None
        finally:
            if bar:
                diffusers_logging.enable_progress_bar()
        self.device = torch.device(device)
        self.offload = offload
        self.pipe.text_encoder.to("cpu" if offload else device)

    @torch.inference_mode()
    def __call__(self, prompt: str) -> torch.Tensor:
        if self.offload:  # on the device only while it encodes (model offload of the text encoder)
            self.pipe.text_encoder.to(self.device)
        try:
            embeds, _ = self.pipe.encode_prompt(prompt=prompt, device=self.device)
        finally:
            if self.offload:
                self.pipe.text_encoder.to("cpu")
        return embeds.float()

    def close(self) -> None:
        """Drop the text encoder's pipeline and return its device memory (before the transformer loads)."""
        import gc

        self.pipe = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def embed_prompts(
    model: str, prompts: Sequence[str], *, device: torch.device | str, dtype: torch.dtype
) -> list[torch.Tensor]:
    """Each prompt embedded by the text encoder of ``model``, which is loaded, run and freed here.

    The command line embeds this way before the transformer loads, so the text encoder (Qwen3 4B/8B for Klein,
    Mistral 3 for dev) and the transformer never share the device. Embeddings come back float32 on the CPU.
    """
    encoder = PromptEncoder(model, device=device, dtype=dtype)
    try:
        return [encoder(prompt).cpu() for prompt in prompts]
    finally:
        encoder.close()
        del encoder
