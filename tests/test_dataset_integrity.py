"""A dataset is what its dataset.json says: the reader takes exactly its items (no shard missing, none past them),
its randomness depends on (seed, item) alone, and a build's refusals come before a model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flowlift.errors import FlowliftError
from flowlift.training.shards import ShardReader
from test_hostile import _tiny_dataset


def _set_num_items(root: Path, num: int) -> None:
    manifest = json.loads((root / "dataset.json").read_text())
    (root / "dataset.json").write_text(json.dumps({**manifest, "num_items": num}))


def test_a_missing_shard_is_named_not_trained_around(tmp_path):
    """A `--part 0/2` build alone (shards 0, 2, ...) was read as its first shard: 4 of 12 items, silently."""
    root = _tiny_dataset(tmp_path / "data", items=6, shard_size=2)
    (root / "shard-00001.safetensors").unlink()
    with pytest.raises(FlowliftError) as caught:
        ShardReader(root)
    text = str(caught.value)
    assert "\n" not in text and text.startswith(f"{root / 'shard-00001.safetensors'} is missing"), text
    assert "6 items take 3 shards, 2 are there" in text, text


def test_a_shard_short_of_its_items_is_refused(tmp_path):
    """A last shard of 1 item where dataset.json's num_items put 2 (the reader stopped there, quietly)."""
    root = _tiny_dataset(tmp_path / "data", items=5, shard_size=2)
    _set_num_items(root, 6)
    with pytest.raises(FlowliftError, match=r"shard-00002.safetensors: holds 1 items where .* 6 items put 2"):
        ShardReader(root)


def test_shards_past_num_items_are_never_read(tmp_path):
    """A rebuild with fewer items left the earlier build's later shards: the reader took them all (8 for 4)."""
    root = _tiny_dataset(tmp_path / "data", items=8, shard_size=2)
    _set_num_items(root, 4)
    (root / "shard-00003.safetensors").write_bytes(b"not a shard")  # never opened
    reader = ShardReader(root)
    try:
        assert len(reader) == 4 and sorted(reader.counts) == [0, 1]
        with pytest.raises(IndexError):
            reader.item(4)
    finally:
        reader.close()


@pytest.mark.parametrize("value", [0, -3, "4", None, 1.5])
def test_a_manifest_without_a_positive_num_items_is_one_line(tmp_path, value):
    root = _tiny_dataset(tmp_path / "data", items=4, shard_size=2)
    _set_num_items(root, value)
    with pytest.raises(FlowliftError, match=r"dataset.json: num_items must be a positive integer"):
        ShardReader(root)


def test_training_on_a_partial_dataset_is_one_line_before_any_output(tmp_path, capsys):
    from builders import TINY_UNET
    from flowlift.commands.cli import main

    root = _tiny_dataset(tmp_path / "data", items=6, shard_size=2)
    (root / "shard-00002.safetensors").unlink()
    sets = [x for k, v in TINY_UNET.items() for x in ("--set", f"{k}={v}")]
    argv = ["train", "--data", str(root), "--output", str(tmp_path / "run"), "--steps", "1", "--batch-size", "2"]
    assert main([*argv, "--crop-latent", "0", *sets, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{root / 'shard-00002.safetensors'} is missing" in err, err
    assert not (tmp_path / "run").exists()


def test_pixel_noise_of_an_image_is_its_own_generators_whatever_the_batch():
    from flowlift.training.degrade import Degradation, degrade_images
    from flowlift.training.shards import item_generator

    images = torch.rand(3, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    noisy = Degradation(noise_std=0.1)
    batch = degrade_images(images, noisy, [item_generator(1, i) for i in range(3)])
    alone = torch.cat([degrade_images(images[i : i + 1], noisy, [item_generator(1, i)]) for i in range(3)])
    assert torch.equal(batch, alone)  # no VAE here: bit-equal
    with pytest.raises(FlowliftError, match="2 generators for a batch of 3 images"):
        degrade_images(images, noisy, [item_generator(1, 0), item_generator(1, 1)])


@pytest.fixture(scope="module")
def taef2(shared):
    from flowlift.models.vae_loading import load_vae

    return load_vae(str(shared / "models" / "taef2"), device="cpu", dtype=torch.float32)


def _build(kind: str, root: Path, vae, batch_size: int, shared: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from flowlift.training.datasets import ShardWriting, build_distill_dataset, build_images_dataset
    from flowlift.training.degrade import Degradation

    common = dict(
        batch_size=batch_size,
        degradation=Degradation(noise_std=0.05),
        writing=ShardWriting(shard_size=4, storage_dtype=torch.float32, progress=False),
    )
    if kind == "images":
        photo = shared / "images" / "kodak" / "kodim08.png"
        build_images_dataset(root, [photo], vae, crop=64, crops_per_image=4, **common)
    else:
        build_distill_dataset(root, lambda n: n * 0.5, vae, num_items=4, latent_size=(8, 8), **common)
    return load_file(root / "shard-00000.safetensors")


@pytest.mark.parametrize("kind", ["images", "distill"])
def test_conditioning_noise_does_not_depend_on_the_build_batch_size(tmp_path, taef2, shared, kind):
    """With noise_std > 0 one generator per chunk drew the pixel noise of the whole chunk: items 1..3 of a
    --batch-size 4 build differed from a --batch-size 1 build (by the noise itself, ~0.1..1 in latent units), where
    the docs promise item i's randomness depends on (seed, i) alone. The tolerance is the VAE's: encoding and
    decoding a batch of 4 vs one image at a time differ by float rounding (~1e-5)."""
    one = _build(kind, tmp_path / "bs1", taef2, 1, shared)
    four = _build(kind, tmp_path / "bs4", taef2, 4, shared)
    assert (one["target"] - four["target"]).abs().max() < 1e-4
    assert (one["cond"] - four["cond"]).abs().max() < 1e-4


@pytest.mark.parametrize("case", ["empty", "unreadable", "small"])
def test_dataset_images_refuses_its_images_before_the_vae_loads(tmp_path, monkeypatch, capsys, case):
    """An empty folder, an unreadable image or images all smaller than the crop were refused only after the VAE
    loaded (the headers alone decide), and the empty folder's line named the Python parameter ``image_paths``."""
    from PIL import Image

    from flowlift.commands.cli import main
    from flowlift.models import vae_loading

    def no_vae(*args, **kwargs):
        raise AssertionError("the VAE loaded before the refusal")

    monkeypatch.setattr(vae_loading, "load_vae", no_vae)
    photos = tmp_path / "photos"
    photos.mkdir()
    if case == "unreadable":
        (photos / "a.png").write_bytes(b"not an image")
    elif case == "small":
        Image.new("RGB", (40, 40)).save(photos / "a.png")
    out = tmp_path / "data"
    assert main(["dataset", "images", str(photos), "--vae", "taef2", "-o", str(out), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and not out.exists(), err
    line = err.strip().splitlines()[-1]
    expected = {
        "empty": f"no input images in {photos}: give image files, or folders holding them (not searched below)",
        "unreadable": f"{photos / 'a.png'}: not an image file Pillow can read",
        "small": "no image is at least 512x512 px, the --crop-px 512 crop (1 skipped); lower --crop-px or add larger",
    }[case]
    assert line.startswith(f"flowlift dataset: error: {expected}"), line
    if case == "small":
        assert f"warning: {photos / 'a.png'}: smaller than the 512x512 crop, skipped" in err
