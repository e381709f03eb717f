"""eval, bands and dataset are jobs of their capabilities (issue 44): a request object in, the result and the files
out, from Python as from the command line, with nothing printed on stdout (printing is the command's)."""

from __future__ import annotations

import json

import pytest

from builders import kodak_crops
from flowlift.errors import FlowliftError


def test_run_eval_from_python_writes_the_report_and_prints_nothing(shared, tmp_path, capsys):
    from flowlift.measure.eval_job import EvalRequest, run_eval
    from flowlift.measure.report import markdown_table

    photos = tmp_path / "photos"
    photos.mkdir()
    kodak_crops(shared, photos, names=("kodim03", "kodim23"))
    out = tmp_path / "report"
    report, paths = run_eval(EvalRequest(output=out, run=["lanczos"], dataset=[str(photos)], scale=2, no_cache=True))
    assert capsys.readouterr().out == ""
    assert sorted(p.name for p in paths.values()) == ["crops.png", "metrics.png", "results.json", "table.md"]
    assert all(p.parent == out and p.is_file() for p in paths.values())
    assert "lanczos" in markdown_table(report) and json.loads(paths["json"].read_text())["config"]["mode"] == "run"


def test_run_eval_refuses_a_request_of_both_modes_before_any_work(tmp_path):
    from flowlift.measure.eval_job import EvalRequest, run_eval

    request = EvalRequest(output=tmp_path / "r", outputs=["a.png"], reference="in", run=["lanczos"], dataset=["d"])
    with pytest.raises(FlowliftError, match="not both"):
        run_eval(request)
    assert not (tmp_path / "r").exists()


def test_run_bands_report_from_python_returns_the_table_and_the_files(monkeypatch, shared, tmp_path, capsys):
    from flowlift.measure.bands_job import BandsRequest, run_bands_report
    from test_bands import IdealVAE, _fake_vae_module

    _fake_vae_module(monkeypatch, IdealVAE)
    kodak = shared / "images" / "kodak"
    request = BandsRequest(images=[str(kodak / "kodim01.png")], vae="fake", output=tmp_path / "b", max_side=256)
    result = run_bands_report(request)
    assert capsys.readouterr().out == ""
    assert "| 0-1/16 |" in result.table
    assert [p.name for p in result.paths] == ["bands.json", "bands.md", "bands.png"]
    assert all(p.is_file() for p in result.paths)


def test_a_dataset_request_takes_exactly_one_source(tmp_path):
    from flowlift.training.dataset_jobs import DatasetRequest, PhotoCrops, TeacherSource

    with pytest.raises(FlowliftError, match="exactly one"):
        DatasetRequest(tmp_path / "d", "taef2")
    with pytest.raises(FlowliftError, match="exactly one"):
        DatasetRequest(tmp_path / "d", "taef2", teacher=TeacherSource("t", 1), crops=PhotoCrops(["p.png"]))
