"""How the Flow Upscaler UNet runs for one sample shape: compiled or eager, whole frame or strip by strip.

* :class:`CompiledUNet` wraps the UNet in ``torch.compile`` (static shapes: one graph per input shape,
  so a batch of same-size images compiles once; on CUDA ``mode="reduce-overhead"``, i.e. the compiled
  graph replayed as a CUDA graph). Each new shape's compile time is reported once on stderr; when
  compilation is unavailable or fails, one warning (a UserWarning, so the CLI's per-image warning line
  shows it) and the eager model from then on.
* :func:`velocity_model` returns the callable a pass evaluates ``v(noise, 1000, cond)`` with: the UNet
  (compiled or not), or a :class:`flowlift.upscale.chunked.executor.ChunkedExecutor` around it as the pass's memory
  plan (:mod:`flowlift.upscale.memory_plan`) or, without a budget, the size
  (:func:`flowlift.upscale.chunked.budget.should_chunk`)
  says.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from flowlift.errors import FlowliftError
from flowlift.upscale.settings import COMPILE_MODES

__all__ = ["CompiledUNet", "default_compile_mode", "velocity_model"]

#: Distinct input shapes that get their own compiled graph (dynamo's recompile limit, raised for calls
#: through :class:`CompiledUNet`); beyond it dynamo runs the extra shapes eagerly.
MAX_COMPILED_SHAPES = 64


def default_compile_mode(device: torch.device) -> str | None:
    """``"reduce-overhead"`` (compiled graph replayed as a CUDA graph) on CUDA, inductor's default elsewhere."""
    return "reduce-overhead" if device.type == "cuda" else None


class CompiledUNet:
    """Callable like the UNet: ``torch.compile(model, dynamic=False)``, falling back to eager.

    ``mode`` is ``torch.compile``'s mode (default :func:`default_compile_mode` of the model's
    device); ``backend`` its backend (``"inductor"``; tests use a counting backend). With
    ``channels_last`` the model's weights and the inputs are channels-last (the fast layout for cuDNN
    convolutions in bf16/fp16). Compiled outputs equal eager ones to float rounding (fp32: <= 1e-4;
    bf16: bf16 rounding, ~1e-2 relative). ``compile_seconds`` maps each compiled input shape to its
    compile time; ``fallback_reason`` is set once compilation has failed.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        mode: str | None = None,
        backend: str | Callable = "inductor",
        channels_last: bool = False,
        report: Callable[[str], None] | None = None,
    ) -> None:
        if mode is not None and mode not in COMPILE_MODES:
            raise FlowliftError(f"mode must be one of {', '.join(COMPILE_MODES)}, got {mode!r}", field="mode")
        self.model = model
        param = next(model.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        self.mode = mode if mode is not None else default_compile_mode(device)
        self.backend = backend
        self.channels_last = channels_last
        self.report = report or (lambda line: print(line, file=sys.stderr, flush=True))
        self.compile_seconds: dict[tuple, float] = {}
        self.fallback_reason: str | None = None
        self._compiled: Callable | None = None
        if channels_last:
            model.to(memory_format=torch.channels_last)

    @property
    def config(self) -> dict[str, Any]:
        return self.model.config

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x

    def __call__(
        self, sample: torch.Tensor, timestep: torch.Tensor | float, latents_small: torch.Tensor
    ) -> torch.Tensor:
        sample, latents_small = self._prepare(sample), self._prepare(latents_small)
        if self.fallback_reason is not None:
            return self.model(sample, timestep, latents_small)
        key = (tuple(sample.shape), tuple(latents_small.shape), sample.dtype, str(sample.device))
        first = key not in self.compile_seconds
        start = time.perf_counter()
        try:
            if self._compiled is None:
                self._compiled = torch.compile(self.model, dynamic=False, mode=self.mode, backend=self.backend)
            with torch._dynamo.config.patch(recompile_limit=MAX_COMPILED_SHAPES):
                if self.mode == "reduce-overhead" and sample.device.type == "cuda":
                    torch.compiler.cudagraph_mark_step_begin()
                out = self._compiled(sample, timestep, latents_small)
        except Exception as error:  # noqa: BLE001 - any compile failure means: run eager, say so once
            if not first:
                raise
            root: BaseException = error
            while True:  # dynamo wraps the backend's own error (inner_exception, or the cause)
                inner = getattr(root, "inner_exception", None) or root.__cause__
                if inner is None or inner is root:
                    break
                root = inner
            text = str(root).strip().splitlines()
            self.fallback_reason = f"{type(root).__name__}: {text[0] if text else ''}"
            warnings.warn(
                f"torch.compile is unavailable or failed ({self.fallback_reason}); running the UNet eagerly",
                UserWarning,
                stacklevel=2,
            )
            return self.model(sample, timestep, latents_small)
        if self.mode == "reduce-overhead":
            out = out.clone()  # a CUDA graph's output buffer is overwritten by its next replay
        if first:
            if sample.device.type == "cuda":
                torch.cuda.synchronize(sample.device)
            seconds = time.perf_counter() - start
            self.compile_seconds[key] = seconds
            self.report(f"flowlift: compiled the UNet for sample {tuple(sample.shape)} in {seconds:.1f} s")
        return out


def velocity_model(
    upscaler: Callable,
    sample_shape: tuple[int, ...],
    *,
    device: torch.device,
    dtype: torch.dtype,
    chunked: bool | None = None,
    chunk_rows: int | None = None,
    offload_device: torch.device | str | None = None,
    pass_plan: Any = None,
    plain: Callable | None = None,
    budget_bytes: int | None = None,
    on_strip: Callable[[int, int], None] | None = None,
) -> Callable:
    """The UNet (``plain``: its compiled wrapper, if any), or a ChunkedExecutor around it for this sample.

    ``chunked``: ``False`` never chunks, ``True`` always (a custom model that is not a
    ``FlowUpscalerUNet`` then raises); ``pass_plan`` (a :class:`flowlift.upscale.pass_plan.UNetPassPlan`: plain /
    chunked / offload with its strip rows, planned with ``chunked`` held) is followed when given, else the size
    (above ``budget_bytes`` of estimated plain-forward memory; default:
    :func:`flowlift.upscale.chunked.budget.should_chunk`'s). Explicit ``chunk_rows`` and ``offload_device`` win over
    the plan's (a plan holds both already, checked against its budget: an ``offload_device`` that is the device
    itself keeps the stores there, counted). ``on_strip`` goes to the executor
    (progress and cancel per strip).
    """
    plain = plain if plain is not None else upscaler
    if chunked is False:
        return plain
    try:
        from flowlift.models.upscaler_unet import FlowUpscalerUNet
        from flowlift.upscale.chunked.budget import should_chunk
        from flowlift.upscale.chunked.executor import ChunkedExecutor
    except ImportError:  # the executor is optional for custom models
        return plain
    if not isinstance(upscaler, FlowUpscalerUNet):
        if chunked:
            raise FlowliftError("chunked execution needs a FlowUpscalerUNet, not a custom model")
        return plain
    if pass_plan is not None:  # the plan held chunked=True: its strips within the budget, never plain
        if pass_plan.mode == "plain":
            return plain
        if offload_device is None and pass_plan.mode == "offload":
            offload_device = "cpu"
        rows = chunk_rows if chunk_rows is not None else pass_plan.strip_rows
        return ChunkedExecutor(upscaler, chunk=rows, offload_device=offload_device, on_strip=on_strip)
    batch, _, height, width = sample_shape
    base = int(upscaler.config.get("base_channels", 384))
    if not should_chunk(
        height, width, device, batch=batch, base_channels=base, dtype=dtype, force=chunked, budget_bytes=budget_bytes
    ):
        return plain
    kwargs: dict[str, Any] = {"offload_device": offload_device, "on_strip": on_strip}
    if chunk_rows is not None:
        kwargs["chunk"] = chunk_rows
    return ChunkedExecutor(upscaler, **kwargs)
