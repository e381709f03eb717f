"""A gated hub repository (FLUX.2-dev, Klein-9B) or a token without access is one line saying what to do: accept the
licence on the model's page, log in, run again. It said "download it once with `hf download ...`", which the hub
refuses the same way. Every door that fetches from the hub says it: weight files, VAEs, a model's parts up front,
and the transformer diffusers loads. The hub's errors are made by huggingface_hub's own ``hf_raise_for_status``
from a response as the hub sends it; nothing reaches the network.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from flowlift.errors import FlowliftError

REPO = "black-forest-labs/FLUX.2-dev"


def _hub_error(status: int, error_code: str | None) -> Exception:
    """The exception huggingface_hub raises for the hub's answer ``status`` (``X-Error-Code: error_code``)."""
    from huggingface_hub.utils import get_session, hf_raise_for_status

    http = importlib.import_module(type(get_session()).__module__.split(".")[0])  # httpx (or its fork) as installed
    url = f"https://huggingface.co/{REPO}/resolve/main/transformer/config.json"
    headers = {"X-Error-Code": error_code} if error_code else {}
    response = http.Response(status, headers=headers, request=http.Request("GET", url))
    try:
        hf_raise_for_status(response)
    except Exception as error:  # noqa: BLE001 - the error is what the test wants
        return error
    raise AssertionError(f"huggingface_hub raised nothing for {status}")


GATED = {"logged-out": (401, "GatedRepo"), "not-accepted": (403, "GatedRepo"), "forbidden-token": (403, None)}


@pytest.fixture(params=sorted(GATED))
def refused(request, monkeypatch):
    """Online mode, and every hub download refused as the hub refuses a gated repository."""
    import huggingface_hub
    from diffusers import Flux2Transformer2DModel  # noqa: F401 - imported before the patch: its modules bind
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError  # huggingface_hub's functions at import

    import flowlift.models.hub as hub

    error = _hub_error(*GATED[request.param])
    assert isinstance(error, GatedRepoError if GATED[request.param][1] else HfHubHTTPError), type(error)

    def refuse(*args, **kwargs):
        raise error

    monkeypatch.setattr(hub, "hub_offline_reason", lambda *a, **k: None)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    return refuse


def _says_what_to_do(text: str) -> None:
    assert f"accept its licence at https://huggingface.co/{REPO}" in text, text
    assert "`hf auth login` (or set HF_TOKEN), then run again" in text, text
    assert "hf download" not in text and "\n" not in text, text


def test_weight_files(refused):
    from flowlift.models.weights import resolve_file

    with pytest.raises(FlowliftError) as caught:
        resolve_file(REPO, ["a.safetensors", "b.safetensors"], what="Flow Upscaler weights")
    assert str(caught.value).startswith(f"Flow Upscaler weights: cannot get {REPO} (a.safetensors, b.safetensors): ")
    _says_what_to_do(str(caught.value))


def test_vaes(refused):
    from flowlift.models.vae_loading import check_vae_spec

    with pytest.raises(FlowliftError) as caught:
        check_vae_spec(REPO)
    assert str(caught.value).startswith(f"VAE: cannot get {REPO}: ") and caught.value.field == "vae"
    _says_what_to_do(str(caught.value))


def test_a_models_parts_up_front(refused):
    from flowlift.refine.source_checks import check_model_part

    with pytest.raises(FlowliftError) as caught:
        check_model_part(REPO, "transformer")
    assert str(caught.value).startswith(f"source.model {REPO}: cannot get its transformer/ folder: ")
    _says_what_to_do(str(caught.value))


def test_the_transformer_diffusers_loads(refused, monkeypatch, tmp_path):
    import diffusers.configuration_utils
    from huggingface_hub import constants

    from flowlift.refine.loading import load_transformer

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(diffusers.configuration_utils, "hf_hub_download", refused)  # re-raised as its own OSError
    with pytest.raises(FlowliftError) as caught:
        load_transformer(REPO, dtype=torch.float32)
    assert str(caught.value).startswith(f"source.model {REPO}: cannot get it from the hub: the hub refused access")
    _says_what_to_do(str(caught.value))


def test_a_missing_repository_keeps_its_download_advice(monkeypatch):
    """The hub answers 401 for a repository that does not exist too: that is not a licence to accept."""
    import huggingface_hub

    import flowlift.models.hub as hub
    from flowlift.refine.source_checks import check_model_part

    error = _hub_error(401, None)
    assert hub.access_hint(REPO, error) is None

    def missing(*args, **kwargs):
        raise error

    monkeypatch.setattr(hub, "hub_offline_reason", lambda *a, **k: None)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", missing)
    with pytest.raises(FlowliftError, match="hf download") as caught:
        check_model_part(REPO, "transformer")
    assert "licence" not in str(caught.value)
