"""A pickle-based weight file torch.load(weights_only=True) refuses: code in it is named and never run; a cut
file is called incomplete, not code (the two need opposite fixes: never load it, or download it again)."""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from flowlift.errors import FlowliftError
from flowlift.models.weights import read_state_dict


class _MakesAFolder:
    """A pickle payload with a visible effect: unpickling it calls os.mkdir (it must never run)."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (os.mkdir, (str(self.target),))


def _write(path: Path, how: str, payload: object) -> Path:
    """``{"weight": tensor, "extra": payload}`` written the way ``how`` names."""
    state = {"weight": torch.zeros(3), "extra": payload}
    if how == "zip":
        torch.save(state, path)
    elif how == "legacy":
        torch.save(state, path, _use_new_zipfile_serialization=False)
    else:  # a plain pickle, as pickle.dump writes it (protocol 4 has opcodes torch's reader refuses outright)
        with open(path, "wb") as handle:
            pickle.dump({"extra": payload}, handle, protocol=int(how.removeprefix("pickle")))
    return path


@pytest.mark.parametrize("how", ["zip", "legacy", "pickle2", "pickle4"])
def test_a_pickle_holding_code_is_refused_naming_the_global_and_never_run(tmp_path, how):
    ran = tmp_path / "ran"
    path = _write(tmp_path / "model.ckpt", how, _MakesAFolder(ran))
    with pytest.raises(FlowliftError) as caught:
        read_state_dict(path, what="VAE weights")
    text = str(caught.value)
    assert not ran.exists()
    assert "\n" not in text and "weights_only=False" not in text
    assert text.startswith(f"VAE weights: {path} is not loaded: its pickle holds code or objects other than tensors")
    assert f"({os.mkdir.__module__}.mkdir)" in text  # the global torch refused (posix.mkdir here)
    assert "safetensors copy" in text and "only if you trust" in text
    assert "not a complete" not in text and "truncated" not in text


def test_a_harmless_class_is_named_too(tmp_path):
    import datetime

    torch.save({"weight": torch.zeros(2), "when": datetime.date(2024, 1, 1)}, tmp_path / "dated.pt")
    with pytest.raises(FlowliftError, match=r"objects other than tensors \(datetime\.date\)"):
        read_state_dict(tmp_path / "dated.pt")


def _cut(path: Path, how: str) -> Path:
    """A good checkpoint written ``how``, then damaged the way a cut download or a bad copy leaves it."""
    state = {f"layer{i}.weight": torch.randn(16) for i in range(4)}
    if how == "zip cut":
        torch.save(state, path)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "legacy cut":  # torch names a global cut mid-word (torch._utils._rebuild_tens...): not code
        torch.save(state, path, _use_new_zipfile_serialization=False)
        data = path.read_bytes()
        path.write_bytes(data[: data.index(b"_rebuild_tensor") + 12])
    else:  # a zip whose own index is whole but whose data.pkl is cut
        torch.save(state, path.with_suffix(".whole"))
        with zipfile.ZipFile(path.with_suffix(".whole")) as source, zipfile.ZipFile(path, "w") as target:
            for info in source.infolist():
                data = source.read(info)
                target.writestr(info, data[: len(data) // 2] if info.filename.endswith("data.pkl") else data)
    return path


@pytest.mark.parametrize("how", ["zip cut", "legacy cut", "data.pkl cut"])
def test_a_cut_checkpoint_is_called_incomplete_not_code(tmp_path, how):
    path = _cut(tmp_path / "model.pth", how)
    with pytest.raises(FlowliftError) as caught:
        read_state_dict(path, what="VAE weights")
    text = str(caught.value)
    assert text == (
        f"VAE weights: cannot read {path}: not a complete PyTorch tensor checkpoint (truncated, corrupt, or another "
        "format)"
    )


def test_a_whole_checkpoint_still_loads(tmp_path):
    torch.save({"weight": torch.ones(2)}, tmp_path / "a.pt")
    torch.save({"weight": torch.ones(2)}, tmp_path / "b.pt", _use_new_zipfile_serialization=False)
    for name in ("a.pt", "b.pt"):
        assert torch.equal(read_state_dict(tmp_path / name)["weight"], torch.ones(2))


def test_the_pixel_upscaler_reader_tells_code_from_a_cut_file(tmp_path):
    """eval's pixel upscaler files (spandrel models) are read by their own reader, with the same distinction."""
    from flowlift.measure.pixel_upscaler import read_model_state

    ran = tmp_path / "ran"
    evil = _write(tmp_path / "evil.pth", "legacy", _MakesAFolder(ran))
    with pytest.raises(FlowliftError, match=rf"refused: .*pickled code or classes: {os.mkdir.__module__}\.mkdir"):
        read_model_state(evil)
    assert not ran.exists()
    cut = _cut(tmp_path / "cut.pth", "legacy cut")
    with pytest.raises(FlowliftError, match="cannot read: not a complete PyTorch checkpoint") as caught:
        read_model_state(cut)
    assert "refused" not in str(caught.value)
