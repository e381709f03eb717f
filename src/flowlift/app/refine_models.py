"""The Refine tab's models, loaded on first use and kept for the server's life (:class:`RefineModels`): the FLUX.2
refiner of ``--model`` (its text encoder once a prompt needs one) and the hires fix's Flow Upscaler on the refiner's
VAE, stoppable before every layer as the Upscale tab's pipelines are."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from flowlift.app.results import model_name
from flowlift.errors import FlowliftError


class RefineModels:
    """The refiner and the hires pipeline of one app server. ``lock`` serializes loading with the service's other
    models; ``check_interrupt`` is the page's Stop (:meth:`flowlift.app.progress.OneRun.check`); ``upscale_pipelines``
    the service's Upscale tab pipelines, whose loaded UNet the hires fix reuses."""

    def __init__(
        self,
        config: Any,
        lock: threading.Lock,
        check_interrupt: Callable[[], None],
        upscale_pipelines: dict[Any, Any],
    ) -> None:
        self.config, self.lock, self.check_interrupt = config, lock, check_interrupt
        self.upscale_pipelines = upscale_pipelines
        self._refiner: Any = None
        self._hires: Any = None

    def refiner(self, text_encoder: bool = False) -> Any:
        """The FLUX.2 refiner of ``--model`` (loaded on first use; the text encoder only once a prompt needs it);
        what loads is reported to the request's run (:mod:`flowlift.progress`). A model without a text encoder is
        one line, in the page's words, before anything loads."""
        model = self.config.model
        if not model:
            raise FlowliftError("no FLUX.2 model configured; start the app with --model to refine")
        with self.lock:
            from flowlift.devices import resolve_device_dtype
            from flowlift.progress import report_loading

            if text_encoder and (self._refiner is None or self._refiner.prompt_encoder is None):
                self._check_text_encoder(model)
            device, dtype = resolve_device_dtype(self.config.device or "auto", self.config.dtype)
            if self._refiner is None:
                from flowlift.refine.loading import load_refiner

                report_loading(f"the FLUX.2 model {model_name(model)} (once per server)")
                self._refiner = load_refiner(model, vae=self.config.model_vae, device=device, dtype=dtype)
            if text_encoder and self._refiner.prompt_encoder is None:
                from flowlift.refine.prompts import PromptEncoder

                report_loading(f"the FLUX.2 text encoder of {model_name(model)} (once per server)")
                self._refiner.prompt_encoder = PromptEncoder(model, device=device, dtype=dtype)
            report_loading(None)
            return self._refiner

    @staticmethod
    def _check_text_encoder(model: str) -> None:
        from flowlift.refine.source_checks import check_model_part

        try:
            check_model_part(model, "text_encoder")
        except FlowliftError:
            raise FlowliftError(
                f"the model {model_name(model)} has no text encoder to embed a prompt with; upload prompt "
                "embeddings (.safetensors with 'prompt_embeds') instead"
            ) from None

    def hires_upscaler(self, refiner: Any) -> Any:
        """The hires fix's Flow Upscaler on the refiner's VAE, device and dtype (made once; the UNet an upscale
        request already loaded is reused where it is in the refiner's dtype, :class:`~flowlift.upscale.latent_source.
        FlowUpscalerSource`: one in another dtype is loaded from its file again, since a bf16 UNet converted to
        float32 would be the file's weights rounded to bf16), its passes stopped by the page's Stop before every
        layer."""
        from flowlift.upscale.latent_source import FlowUpscalerSource

        with self.lock:
            if self._hires is None:
                loaded = next(iter(self.upscale_pipelines.values()), None)
                unet = loaded.upscaler if loaded is not None else None
                if unet is not None and next(unet.parameters()).dtype != refiner.dtype:
                    unet = None  # the Upscale tab's bf16 UNet under a float32 refiner: the file's own weights
                source = FlowUpscalerSource(self.config.upscaler, unet)
                self._hires = source.load(
                    refiner.vae, device=refiner.device, dtype=refiner.dtype, check_interrupt=self.check_interrupt
                )
            return self._hires
