"""InvokeAI's node events read the one progress model (:mod:`flowlift.progress`): stage names, share and time left.

The module imports InvokeAI's names at the top; here they are stand-ins (the node packs' own tests run the real
InvokeAI in its venv), so the event stream is checked in the main environment.
"""

from __future__ import annotations

import importlib
import sys
import types

import pytest


class CanceledException(Exception):
    pass


class Context:
    def __init__(self) -> None:
        self.events: list[tuple[str, float]] = []
        self.canceled = False
        self.util = types.SimpleNamespace(is_canceled=lambda: self.canceled, signal_progress=self.signal)

    def signal(self, text: str, share: float) -> None:
        self.events.append((text, share))


@pytest.fixture
def node_progress(monkeypatch):
    common = types.ModuleType("invokeai.app.services.session_processor.session_processor_common")
    common.CanceledException = CanceledException
    api = types.ModuleType("invokeai.invocation_api")
    api.InvocationContext = object
    monkeypatch.setitem(sys.modules, common.__name__, common)
    monkeypatch.setitem(sys.modules, api.__name__, api)
    monkeypatch.delitem(sys.modules, "flowlift.invokeai.progress", raising=False)
    module = importlib.import_module("flowlift.invokeai.progress")
    yield module.NodeProgress
    sys.modules.pop("flowlift.invokeai.progress", None)


def test_events_name_the_stage_and_the_time_left(node_progress):
    context = Context()
    progress = node_progress(context, "Flow Upscale Image (FLUX.2)", 3, [1.0, 4.0, 4.0])
    progress.begin("encode")
    progress.stage("encode")
    progress.strip(1, 2)
    progress.stage("pass 1/1")
    texts = [text for text, _ in context.events]
    assert texts[0] == "Flow Upscale Image (FLUX.2): encode"  # nothing measured yet: no time left
    assert texts[1].startswith("Flow Upscale Image (FLUX.2): encode done, about ") and texts[1].endswith(" left")
    assert any("strip 1/2" in text for text in texts)
    shares = [share for _, share in context.events]
    assert shares == sorted(shares) and shares[-1] == pytest.approx(5 / 9)
    context.canceled = True
    with pytest.raises(CanceledException):
        progress.stage("decode")


def test_decode_tiles_move_the_bar_and_are_cancel_points(node_progress):
    """The image node reported nothing inside its decode: a 107 s decode showed 'about 5.1 s left' and a cancel
    waited for its end."""
    context = Context()
    progress = node_progress(context, "Flow Upscale Image (FLUX.2)", 3, [1.0, 4.0, 4.0])
    progress.stage("encode")
    progress.stage("pass 1/1")
    progress.tile(1, 4)
    progress.tile(2, 4)
    texts = [text for text, _ in context.events]
    assert any("decode, tile 1/4" in text for text in texts) and any("decode, tile 2/4" in text for text in texts)
    shares = [share for _, share in context.events]
    assert shares == sorted(shares) and shares[-1] == pytest.approx(5 / 9 + 4 / 9 * 2 / 4)
    context.canceled = True
    with pytest.raises(CanceledException):
        progress.tile(3, 4)
