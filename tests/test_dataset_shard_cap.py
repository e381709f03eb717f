"""``flowlift dataset distill --num`` past what the shard names can number (``shard-{index:05d}``: 100000 shards) is
one line naming ``--num`` (``num`` / ``num_items`` in Python) before any model loads or any dataset.json is written;
a part's shard plan looks at that part's shards alone, never a list of every shard."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from flowlift.commands.cli import main
from flowlift.errors import FlowliftError


@pytest.fixture
def no_models(monkeypatch):
    from builders import forbid_call

    for target in ("flowlift.training.dataset_jobs.load_teacher", "flowlift.models.vae_loading.load_vae"):
        forbid_call(monkeypatch, target, "a model was loaded before a --num no shard name can hold was refused")


def test_a_num_past_the_shard_names_is_refused_before_any_model_or_manifest(tmp_path, capsys, no_models):
    teacher = tmp_path / "teacher"
    (teacher / "transformer").mkdir(parents=True)
    (teacher / "transformer" / "config.json").write_text("{}")
    embeds = tmp_path / "prompt.safetensors"
    save_file({"prompt_embeds": torch.zeros(4, 8)}, str(embeds))
    out = tmp_path / "data"
    argv = ["dataset", "distill", "--teacher", str(teacher), "--prompt-embeds", str(embeds), "--vae", "taef2"]
    assert main([*argv, "--num", str(10**12), "-o", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("flowlift dataset: error: --num 1000000000000 would take 3906250000 shards of 256"), err
    assert "shard-99999" in err and "at most 25600000 items" in err, err
    assert not (out / "dataset.json").exists()


def test_the_python_api_names_its_own_field(tmp_path):
    from flowlift.training.dataset_jobs import DatasetRequest, TeacherSource

    with pytest.raises(FlowliftError) as caught:
        DatasetRequest(tmp_path / "data", "taef2", teacher=TeacherSource("teacher", 10**12), shard_size=1000)
    assert caught.value.fields == ("num",) and str(caught.value).startswith("num 1000000000000 would take 1000000000")


def test_the_builder_refuses_before_writing_its_manifest(tmp_path, no_models):
    from flowlift.training.datasets import _shard_plan

    with pytest.raises(FlowliftError, match=r"^num_items 1000000000000 would take") as caught:
        _shard_plan(tmp_path, 10**12, 256, (0, 1))  # was a list of every shard: MemoryError
    assert caught.value.fields == ("num_items",)
    assert not (tmp_path / "dataset.json").exists()


def test_a_parts_plan_looks_only_at_its_own_shards(tmp_path, monkeypatch):
    from flowlift.training import datasets

    done = set(range(0, 700, 2))  # every even shard finished, each full
    asked: list[str] = []

    def shard_count(path):
        asked.append(path.name)
        return 10

    monkeypatch.setattr(datasets, "completed_shards", lambda root: done)
    monkeypatch.setattr(datasets, "shard_count", shard_count)
    pending, items, finished = datasets._shard_plan(tmp_path, 6995, 10, (6, 7))  # 700 shards, the last of 5
    mine = list(range(6, 700, 7))  # 699, the short last shard, among them: pending (odd)
    assert pending == [k for k in mine if k % 2] and items == 10 * len(mine) - 5
    assert finished == 10 * sum(1 for k in mine if k % 2 == 0)
    assert asked == [datasets.shard_name(k) for k in mine if k % 2 == 0]  # no other part's shard was read
