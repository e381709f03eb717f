"""Finding and reading weight files: local paths, directories, or hub repositories.

A *source* is one of

* a file path (``.safetensors``, or ``.pth``/``.pt``/``.bin`` read with ``weights_only=True``);
* a directory, searched for the expected file names;
* a hub repository id (``owner/name``), resolved through huggingface_hub's cache. Offline mode
  (``HF_HUB_OFFLINE=1``) and an unreachable hub (:func:`flowlift.models.hub.hub_offline_reason`) keep the
  lookup in the cache: a file that is not cached then gives a :class:`~flowlift.errors.FlowliftError`
  saying where it was expected and the command that downloads it.

:func:`require_all` runs the lookups a command needs and reports every missing weight in one message.

Every load is strict: :func:`load_strict` names the missing, unexpected and mis-shaped tensors in
one line instead of silently loading part of a model.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from flowlift.errors import FlowliftError

WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".ckpt")


def looks_like_repo_id(source: str) -> bool:
    """True for ``owner/name`` strings that are neither existing nor path-looking (``a/b.safetensors``)."""
    from flowlift.models.hub import looks_like_path

    if os.path.exists(source) or looks_like_path(source):
        return False
    parts = source.split("/")
    return len(parts) == 2 and all(parts)


def resolve_file(
    source: str | os.PathLike,
    filenames: Sequence[str],
    *,
    what: str,
    subfolder: str | None = None,
    revision: str | None = None,
) -> Path:
    """Return a local path to one of ``filenames`` found in ``source``.

    ``source`` may be a file (returned as is), a directory (searched for ``filenames`` in order, also
    under ``subfolder``) or a hub repo id (each name tried in the hub cache / download). ``what``
    names the thing for error messages, e.g. ``"Flow Upscaler weights"``.
    """
    source_str = os.fspath(source)
    if not str(source_str).strip():  # Path("") is the working folder: never read it for an empty name
        raise FlowliftError(f"{what}: an empty name or path names nothing, got {source_str!r}")
    path = Path(source_str).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        for folder in ([path / subfolder] if subfolder else []) + [path]:
            for name in filenames:
                if (folder / name).is_file():
                    return folder / name
        raise FlowliftError(f"{what}: none of {', '.join(filenames)} found in directory {path}")
    from flowlift.models.hub import looks_like_path

    if looks_like_path(source_str):
        raise FlowliftError(f"{what}: {source_str}: no such file or folder")
    if looks_like_repo_id(source_str):
        return _hub_download(source_str, filenames, what=what, subfolder=subfolder, revision=revision)
    raise FlowliftError(f"{what}: {source_str} is neither a file, a directory nor a hub repo id (owner/name)")


def _hub_download(
    repo_id: str, filenames: Sequence[str], *, what: str, subfolder: str | None, revision: str | None
) -> Path:
    from flowlift.models.hub import access_hint, cached_file, download_hint, hub_offline_reason

    offline = hub_offline_reason()  # offline or unreachable: the cache only, at once, instead of ~25 s of retries
    prefix = f"{subfolder}/" if subfolder else ""
    last_error: Exception | None = None
    if offline is not None:  # the cache's layout, without huggingface_hub's download client
        found = next((p for name in filenames if (p := cached_file(repo_id, prefix + name, revision or "main"))), None)
        if found is not None:
            return Path(found)
    else:
        # Imported here, online only: its download client costs ~0.15 CPU-s, and importing must not touch the network.
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

        for name in filenames:
            try:
                return Path(hf_hub_download(repo_id, name, subfolder=subfolder, revision=revision))
            except (EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError, OSError) as error:
                last_error = error
                if access_hint(repo_id, error):
                    break  # gated: every other file is refused the same way
    where = f"{prefix}{filenames[0]} of {repo_id}" if len(filenames) == 1 else f"{repo_id} ({', '.join(filenames)})"
    if refused := access_hint(repo_id, last_error):
        raise FlowliftError(f"{what}: cannot get {where}: {refused}, or pass a local path")
    if offline is not None:
        raise FlowliftError(
            f"{what}: {where} is not in the Hugging Face cache and {offline}; "
            f"{download_hint(repo_id, [prefix + filenames[0]])} or pass a local path"
        )
    raise FlowliftError(
        f"{what}: could not get {where} from the hub ({type(last_error).__name__}); "
        f"{download_hint(repo_id, [prefix + filenames[0]])} or pass a local path"
    )


def require_all(checks: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run every check (each finds one weight a command needs) and return their results in order.

    When any fail, raise one :class:`FlowliftError` naming all of them, not only the first, so that a
    user without the weights learns everything to fetch from one message instead of one per run:
    ``2 weights are missing or unusable: (1) Flow Upscaler weights: ...; (2) VAE 'flux2': ...`` (each part names
    its own fix). A single failure keeps its own message.
    """
    results: list[Any] = []
    problems: dict[str, FlowliftError] = {}
    for check in checks:
        try:
            results.append(check())
        except FlowliftError as error:
            problems.setdefault(str(error), error)  # the same spec asked twice is one problem
            results.append(None)
    if len(problems) == 1:
        raise next(iter(problems.values()))
    if problems:
        parts = "; ".join(f"({i}) {error.template}" for i, error in enumerate(problems.values(), 1))
        fields = tuple(name for error in problems.values() for name in error.fields)
        raise FlowliftError(f"{len(problems)} weights are missing or unusable: {parts}", field=fields)
    return results


def read_state_dict(path: str | os.PathLike, *, what: str = "weights") -> dict[str, torch.Tensor]:
    """Read a checkpoint into a flat ``{name: tensor}`` dict on the CPU.

    Safetensors files are read with :mod:`safetensors`; pickle-based files only with
    ``torch.load(weights_only=True)``. A corrupt or unreadable file raises one FlowliftError line.
    """
    path = Path(path)
    if not path.is_file():
        raise FlowliftError(f"{what}: file not found: {path}")
    try:
        if path.suffix.lower() == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path), device="cpu")
        else:
            with warnings.catch_warnings():
                # torch's notes on pickle protocols / storage formats say nothing the user can act on
                warnings.simplefilter("ignore")
                state = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:  # code in the pickle, or a pickle cut short: their fixes differ
        from flowlift.models.pickle_checks import pickle_refusal

        raise pickle_refusal(path, error, what=what) from None
    except OSError as error:  # the file itself: permissions, a vanished file, an I/O error
        raise FlowliftError(f"{what}: cannot read {path}: {error.strerror or error}") from None
    except Exception:  # noqa: BLE001 - any reader failure is a bad file to the user
        # the readers' own words (a KeyError('101'), "incomplete metadata, file not fully covered", torch's advice
        # cut mid-sentence) name nothing a user can act on
        kind = "safetensors file" if path.suffix.lower() == ".safetensors" else "PyTorch tensor checkpoint"
        raise FlowliftError(
            f"{what}: cannot read {path}: not a complete {kind} (truncated, corrupt, or another format)"
        ) from None
    if isinstance(state, Mapping) and "state_dict" in state and isinstance(state["state_dict"], Mapping):
        state = state["state_dict"]
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise FlowliftError(f"{what}: {path} does not hold a flat dict of tensors")
    return dict(state)


def header_state(path: str | os.PathLike, *, what: str) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """A safetensors file's tensors as meta tensors of their shapes and dtypes, and its ``__metadata__``, from its
    checked header alone (:func:`flowlift.models.safetensors_headers.read_header`: no tensor is read, nothing is
    allocated), for the loaders' key, shape and dtype checks before any model loads; None for a pickle-based file
    (only reading it tells its tensors). ``what`` starts an unreadable header's error line."""
    from flowlift.models.safetensors_headers import read_header

    path = Path(path)
    if path.suffix.lower() != ".safetensors":
        return None
    header = read_header(path, what=what)
    state = {
        name: torch.empty(shape, dtype=getattr(torch, header.dtypes[name]), device="meta")
        for name, shape in header.shapes.items()
    }
    return state, header.metadata


def _short_list(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... (+{len(names) - limit} more)" if len(names) > limit else "")


def state_dict_mismatch(module: torch.nn.Module, state: Mapping[str, torch.Tensor], limit: int = 6) -> str | None:
    """Describe how ``state`` differs from ``module``'s parameters and buffers (each kind: its count and the first
    ``limit`` names), or None if it fits."""
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshaped = sorted(
        f"{k} {tuple(state[k].shape)} != {expected[k]}"
        for k in set(expected) & set(state)
        if tuple(state[k].shape) != expected[k]
    )
    problems = []
    if missing:
        problems.append(f"missing {len(missing)}: {_short_list(missing, limit)}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)}: {_short_list(unexpected, limit)}")
    if misshaped:
        problems.append(f"mis-shaped {len(misshaped)}: {_short_list(misshaped, limit)}")
    return "; ".join(problems) or None


def dtype_mismatch(module: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> str | None:
    """The first tensor of ``state`` that is not floating point where ``module`` expects floats, described.

    ``load_state_dict`` would cast an int8 or bool tensor into a float parameter without a word
    (quantized or corrupt files then load as garbage), so such a file is refused instead. A
    non-float tensor passes only where ``module`` holds a non-float tensor of the same name (an
    index buffer): loaders that rename keys on the way in (spandrel's) cannot slip one past.
    """
    expected = module.state_dict()
    for name in sorted(state):
        tensor, target = state[name], expected.get(name)
        if not tensor.is_floating_point() and (target is None or target.is_floating_point()):
            return f"`{name}` has dtype {str(tensor.dtype).removeprefix('torch.')}, expected floating point"
    return None


def first_non_finite(state: Mapping[str, torch.Tensor]) -> str | None:
    """``"NaN in `name`"`` / ``"Inf in `name`"`` for the first floating tensor holding one, else None.

    One read of each tensor, no temporaries: ``aminmax`` (a NaN propagates into both ends, an Inf is one of them),
    in one CPU thread (a memory-bound reduction), so that a poisoned file fails here instead of producing black
    images later at a few ms per 100 MB. float8 (no ``aminmax``): its bytes, one tensor-sized uint8 temporary at a
    time (:func:`_fp8_non_finite`; converting to float32 took ~11 s per GB); other dtypes without ``aminmax`` are
    checked in float32. A GGUF tensor (diffusers' ``GGUFParameter``, uint8 blocks) by its blocks' float16 scales
    (:func:`flowlift.models.gguf_checks.quantized_non_finite`).
    """
    from flowlift.devices import one_thread

    with one_thread("cpu"):
        for name in sorted(state):
            tensor = state[name]
            quant_type = getattr(tensor, "quant_type", None)  # a GGUF tensor's blocks: its scales, read in place
            if quant_type is not None and not tensor.is_floating_point():
                from flowlift.models.gguf_checks import quantized_non_finite

                kind = quantized_non_finite(tensor, quant_type)
                if kind:
                    return f"{kind} in `{name}`"
                continue
            if not tensor.is_floating_point() or not tensor.numel():
                continue
            if tensor.dtype in _FP8_TOP_FINITE:
                kind = _fp8_non_finite(tensor.detach())
                if kind:
                    return f"{kind} in `{name}`"
                continue
            try:
                low, high = (float(v) for v in torch.aminmax(tensor.detach()))
                finite = math.isfinite(low) and math.isfinite(high)
            except (NotImplementedError, RuntimeError):
                tensor = tensor.float()  # neither aminmax nor isfinite
                finite = bool(torch.isfinite(tensor).all())
            if not finite:
                kind = "NaN" if bool(torch.isnan(tensor).any()) else "Inf"
                return f"{kind} in `{name}`"
    return None


#: float8 dtypes whose non-finite values are the bytes whose 7 low bits (all but the sign) exceed this value:
#: e4m3fn's only one is NaN (S.1111.111), e5m2's an all-ones exponent (0x7C Inf, above it NaN).
_FP8_TOP_FINITE = {torch.float8_e4m3fn: 0x7E, torch.float8_e5m2: 0x7B}


def _fp8_non_finite(tensor: torch.Tensor) -> str | None:
    """``"NaN"`` / ``"Inf"`` when the float8 ``tensor`` holds one, else None: the largest sign-less byte."""
    top = int(torch.bitwise_and(tensor.contiguous().view(torch.uint8), 0x7F).max())
    if top <= _FP8_TOP_FINITE[tensor.dtype]:
        return None
    return "Inf" if tensor.dtype == torch.float8_e5m2 and top == 0x7C else "NaN"


class NonFiniteResult(FlowliftError):
    """A model's result holds NaN or Inf (finite weights can overflow: a file scaled by 1e30, float16 past 65504).

    ``kind`` is ``"NaN"`` or ``"Inf"``, ``dtype`` the result's; the line names ``what`` gave it. A model adapter
    names itself (``TAEF2's decode``); a door that knows the stage better re-words it (:func:`results_named`).
    """

    def __init__(self, what: str, kind: str, dtype: torch.dtype) -> None:
        self.kind, self.dtype = kind, dtype
        name = str(dtype).removeprefix("torch.")
        super().__init__(f"{what} gave {kind} (weights that overflow in {name}?); nothing was written")


@contextlib.contextmanager
def results_named(what: str) -> Iterator[None]:
    """Within this block a :class:`NonFiniteResult` names ``what`` (a door's words: the shard, the node, the
    stage) in place of the model adapter that raised it; every other error passes unchanged."""
    try:
        yield
    except NonFiniteResult as error:
        raise NonFiniteResult(what, error.kind, error.dtype) from None


def check_finite_result(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """``tensor`` itself, or a :class:`NonFiniteResult` line ``"<what> gave NaN ..."`` when it holds NaN or Inf.

    For a model's result before anything stores it: a writer would turn NaN into a black image, an all-NaN shard
    or a table of NaN that is not even valid JSON. One reduction over the tensor
    (:func:`flowlift.devices.non_finite_kind`): no tensor-sized temporary, where ``isfinite(t).all()`` makes one
    (0.8 GB for a 16K image, past a memory plan's budget).
    """
    from flowlift.devices import non_finite_kind

    kind = non_finite_kind(tensor)
    if kind is not None:
        raise NonFiniteResult(what, kind, tensor.dtype)
    return tensor


def finite_result(what: str, fn: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
    """``fn(*args, **kwargs)``, or one :class:`NonFiniteResult` line naming ``what`` when its result holds NaN or Inf
    (checked here) or ``fn`` refused one (a model adapter checks its own): a door's words for a model's result."""
    with results_named(what):
        return check_finite_result(fn(*args, **kwargs), what)


def check_finite_state(state: Mapping[str, torch.Tensor], *, what: str, origin: str = "") -> None:
    """Raise one FlowliftError line when any floating tensor of ``state`` holds NaN or Inf."""
    bad = first_non_finite(state)
    if bad:
        source = f" ({origin})" if origin else ""
        raise FlowliftError(f"{what}{source} contain {bad}")


def load_strict(
    module: torch.nn.Module, state: Mapping[str, torch.Tensor], *, what: str, origin: str = "", assign: bool = False
) -> None:
    """Load ``state`` into ``module`` exactly (all keys, shapes, float dtypes, finite values) or raise one line.

    Floating tensors are cast to each parameter's dtype, so fp32, fp16 and bf16 files all load;
    integer or bool tensors for floating parameters, and NaN/Inf anywhere, are refused. ``assign=True``
    makes ``state``'s tensors the module's own (no copy; a module built on the meta device needs it):
    the caller casts them to the dtype and device it wants first.
    """
    source = f" from {origin}" if origin else ""
    problem = state_dict_mismatch(module, state) or dtype_mismatch(module, state)
    if problem:
        raise FlowliftError(f"{what}{source} does not match the architecture: {problem}")
    check_finite_state(state, what=what, origin=origin)
    module.load_state_dict(dict(state), strict=True, assign=assign)
