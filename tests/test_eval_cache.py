"""The eval cache's entries are strict JSON, as ``results.json`` is: an identical image's PSNR is the string "inf"
(a bare ``Infinity`` is no JSON other parsers read), and it reads back as the float it was."""

from __future__ import annotations

import json
import math

import numpy as np
from PIL import Image

from flowlift.measure import cache as C
from flowlift.measure import evaluate as E
from flowlift.measure import methods as MT


def _strict(text: str):
    """``text`` parsed as RFC 8259 JSON: Infinity and NaN refused."""

    def refuse(word: str):
        raise ValueError(f"not JSON: {word}")

    return json.loads(text, parse_constant=refuse)


def test_a_cache_entry_of_an_infinite_psnr_is_strict_json_and_reads_back_as_inf(tmp_path):
    cache = C.ResultCache(tmp_path)
    key = "0123456789abcdef" * 4
    metrics = {"psnr_y": math.inf, "ssim_y": 1.0, "psnr_gt": 41.5}
    cache.store("lanczos", "a", key, metrics, np.zeros((4, 4, 3), np.uint8))
    (entry,) = (tmp_path / "lanczos").glob("*.json")
    assert _strict(entry.read_text())["metrics"] == {"psnr_y": "inf", "ssim_y": 1.0, "psnr_gt": 41.5}
    loaded, crop = cache.load("lanczos", "a", key)
    assert loaded == metrics and math.isinf(loaded["psnr_y"]) and crop.shape == (4, 4, 3)
    assert cache.problems(["lanczos"], overwrite=False) is None  # still known as flowlift's own entry


def test_an_entry_of_an_earlier_release_with_a_bare_infinity_still_reads(tmp_path):
    cache = C.ResultCache(tmp_path)
    key = "fedcba9876543210" * 4
    cache.store("lanczos", "a", key, {"psnr_y": 30.0}, np.zeros((4, 4, 3), np.uint8))
    (entry,) = (tmp_path / "lanczos").glob("*.json")
    entry.write_text(json.dumps({"key": key, "metrics": {"psnr_y": math.inf}}))
    assert cache.load("lanczos", "a", key)[0] == {"psnr_y": math.inf}
    entry.write_text(json.dumps({"key": key, "metrics": {"psnr_y": "much"}}))
    assert cache.load("lanczos", "a", key) is None  # no number: a miss, recomputed


def test_an_eval_of_an_identical_output_caches_strict_json_and_reuses_it(tmp_path):
    photos = tmp_path / "photos"
    photos.mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(photos / "a.png")
    specs = MT.parse_methods("lanczos")
    cache = tmp_path / "cache"

    def run():
        return E.evaluate_methods(specs, [photos], 2, method_fns={"lanczos": lambda low, gt: gt}, cache_dir=cache)

    first = run()
    assert first.results["lanczos"]["a"]["psnr_gt"] == math.inf
    for entry in cache.rglob("*.json"):
        _strict(entry.read_text())
    again = run()
    assert (again.computed, again.cached) == (0, 1) and again.results == first.results
