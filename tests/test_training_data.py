"""Dataset builders, pixel-space degradation, the shard format and the streaming loader.

The real TAEF2 (../shared/models/taef2) encodes small Kodak crops; a tiny random diffusers
``Flux2Transformer2DModel`` stands in for the FLUX.2 teacher.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from builders import command_line
from flowlift.commands.cli import main as cli_main
from flowlift.errors import FlowliftError
from flowlift.training.degrade import Degradation, conditioning_latents, degrade_images, downscale
from flowlift.training.shards import (
    CROP_ALIGN,
    ShardReader,
    ShardStream,
    TimeSampling,
    prepare_dataset_dir,
    write_shard,
)
from tiny_flux2 import tiny_transformer

# Tiny models: single-threaded torch for this module (conftest.single_thread_torch).
pytestmark = pytest.mark.usefixtures("single_thread_torch")


@pytest.fixture(scope="module")
def taef2(shared):
    from flowlift.models.vae_loading import load_vae

    return load_vae(str(shared / "models" / "taef2"), device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def kodak_crops(shared):
    from flowlift.files.images import load_image, to_tensor

    crops = []
    for name, (top, left) in (("kodim03.png", (200, 300)), ("kodim23.png", (150, 350))):
        image = to_tensor(load_image(shared / "images" / "kodak" / name)[0])
        crops.append(image[:, :, top : top + 128, left : left + 128])
    return torch.cat(crops)


def _read_shards(root):
    from safetensors import safe_open

    out = {}
    for path in sorted(root.glob("shard-*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out[path.name] = ({k: f.get_tensor(k) for k in f.keys()}, f.metadata())
    return out


# ------------------------------------------------------------------------------------------------
# degradation


def test_downscale_filters():
    x = torch.rand(1, 3, 16, 16)
    assert torch.allclose(downscale(x, 2, "area"), x.view(1, 3, 8, 2, 8, 2).mean((3, 5)))
    for name in ("bicubic", "bilinear", "lanczos"):
        y = downscale(x, 2, name)
        assert y.shape == (1, 3, 8, 8)
        assert (y - x.mean()).abs().mean() < (x - x.mean()).abs().mean()  # low-passed
    const = torch.full((1, 3, 16, 16), 0.3)
    for name in ("area", "bicubic", "bilinear", "lanczos"):
        assert torch.allclose(downscale(const, 2, name), torch.full((1, 3, 8, 8), 0.3), atol=1e-5)
    with pytest.raises(FlowliftError):
        downscale(torch.rand(1, 3, 15, 16), 2, "area")
    with pytest.raises(FlowliftError):
        Degradation(filter="nearest")


def test_optional_jpeg_and_noise_degradations():
    x = torch.rand(2, 3, 32, 32)
    plain = degrade_images(x, Degradation())
    jpeg = degrade_images(x, Degradation(jpeg_quality=10))
    assert jpeg.shape == plain.shape and (jpeg - plain).abs().mean() > 0.01
    noisy_a = degrade_images(x, Degradation(noise_std=0.05), torch.Generator().manual_seed(1))
    noisy_b = degrade_images(x, Degradation(noise_std=0.05), torch.Generator().manual_seed(1))
    assert torch.equal(noisy_a, noisy_b)
    assert 0.02 < (noisy_a - plain).std() < 0.06
    with pytest.raises(FlowliftError):
        Degradation(jpeg_quality=0)


def test_a_degradation_keeps_the_values_its_checks_passed(tmp_path):
    """numpy's int64 / float32 passed the checks but stayed in the Degradation: its JSON, the manifest
    ``dataset.json``, then failed with a TypeError traceback after the VAE had loaded. ``DatasetRequest`` makes its
    one Degradation (it made one to check the fields and ``run_dataset`` another from the same fields)."""
    import numpy as np

    from flowlift.training.dataset_jobs import DatasetRequest, PhotoCrops

    made = Degradation(factor=np.int64(2), jpeg_quality=np.int64(90), noise_std=np.float32(0.25))
    assert (type(made.factor), type(made.jpeg_quality), type(made.noise_std)) == (int, int, float)
    assert json.loads(made.to_json()) == {"factor": 2, "filter": "area", "jpeg_quality": 90, "noise_std": 0.25}
    request = DatasetRequest(
        tmp_path / "d", "taef2", crops=PhotoCrops(["p.png"]), jpeg_quality=np.int64(80), noise_std=np.float32(0.5)
    )
    assert request.degradation == Degradation(jpeg_quality=80, noise_std=0.5)
    assert type(request.degradation.jpeg_quality) is int


def test_conditioning_is_made_in_pixel_space_not_by_latent_interpolation(taef2, kodak_crops):
    with torch.no_grad():
        target = taef2.encode(kodak_crops)  # (2, 32, 16, 16)
        cond = conditioning_latents(taef2, target)
        reference = taef2.encode(F.avg_pool2d(taef2.decode(target).clamp(0, 1), 2))
    assert cond.shape == (2, 32, 8, 8)
    assert torch.allclose(cond, reference, atol=1e-5)
    # The swapped-in shortcut (downscaling latents directly) gives clearly different latents.
    for mode in ("area", "bilinear", "bicubic"):
        shortcut = F.interpolate(target, scale_factor=0.5, mode=mode, antialias=mode != "area")
        assert (shortcut - reference).abs().mean() > 0.2 * reference.abs().mean()


# ------------------------------------------------------------------------------------------------
# builders


def test_dataset_distill_cli_with_tiny_flux2_transformer_teacher(tmp_path, taef2, shared):
    from safetensors.torch import save_file

    from flowlift.flux2.latents import seeded_noise
    from flowlift.training.datasets import TransformerTeacher, item_seed

    transformer = tiny_transformer(mlp_ratio=2.0)
    transformer.save_pretrained(tmp_path / "teacher")
    embeds = torch.randn(6, 32, generator=torch.Generator().manual_seed(3))
    save_file({"prompt_embeds": embeds}, str(tmp_path / "embeds.safetensors"))
    out = tmp_path / "distill"
    files = {"vae": shared / "models" / "taef2", "teacher": tmp_path / "teacher"}
    sizes = {"num": "5", "width": "128", "height": "96", "steps": "2", "shard_size": "2", "batch_size": "2"}
    argv = command_line(
        "dataset", "distill", "-o", out, **files, prompt_embeds=tmp_path / "embeds.safetensors", **sizes
    )
    argv += command_line(storage_dtype="float32", seed="7", device="cpu", no_progress=True)
    assert cli_main(argv) == 0
    manifest = json.loads((out / "dataset.json").read_text())
    assert manifest["kind"] == "distill" and manifest["has_noise"] and manifest["num_items"] == 5
    assert manifest["target_shape"] == [32, 12, 16] and manifest["cond_shape"] == [32, 6, 8]
    reader = ShardReader(out)
    assert len(reader) == 5
    teacher = TransformerTeacher(transformer, embeds, num_steps=2)
    for index in (0, 3, 4):
        item = reader.item(index)
        noise = seeded_noise((32, 12, 16), item_seed(7, index))
        assert torch.equal(item["noise"], noise)
        expected = teacher(noise[None])
        assert torch.allclose(item["target"], expected[0], atol=1e-4)
        with torch.no_grad():
            cond = taef2.encode(F.avg_pool2d(taef2.decode(item["target"][None]).clamp(0, 1), 2))
        assert torch.allclose(item["cond"], cond[0], atol=1e-4)
        assert not torch.allclose(item["target"], item["noise"], atol=0.05)  # the teacher did move it
    reader.close()

    # Resume: a lost shard is rebuilt with the same tensors and metadata; complete shards are not touched.
    before = _read_shards(out)
    (out / "shard-00001.safetensors").unlink()
    mtime = (out / "shard-00000.safetensors").stat().st_mtime_ns
    assert cli_main(argv) == 0
    after = _read_shards(out)
    assert after.keys() == before.keys()
    for name in before:
        assert after[name][1] == before[name][1]
        assert all(torch.equal(after[name][0][k], before[name][0][k]) for k in before[name][0])
    assert (out / "shard-00000.safetensors").stat().st_mtime_ns == mtime

    # Different settings into the same folder: one clear error, nothing changed.
    bad = [a if a != "96" else "64" for a in argv]
    assert cli_main(bad) == 2


def test_dataset_images_builder_encodes_recorded_crops(tmp_path, taef2, shared):
    from safetensors import safe_open

    from flowlift.files.images import load_image, to_tensor

    out = tmp_path / "images"
    kodak = shared / "images" / "kodak"
    photos = [kodak / "kodim05.png", kodak / "kodim19.png"]
    crops = {"crop_px": "64", "crops_per_image": "2", "shard_size": "3", "batch_size": "3"}
    argv = command_line("dataset", "images", *photos, "-o", out, vae=shared / "models" / "taef2", **crops)
    argv += command_line(storage_dtype="float32", device="cpu", no_progress=True)
    assert cli_main(argv) == 0
    manifest = json.loads((out / "dataset.json").read_text())
    assert manifest["kind"] == "images" and not manifest["has_noise"] and manifest["num_items"] == 4
    reader = ShardReader(out)
    with safe_open(str(out / "shard-00001.safetensors"), framework="pt") as f:
        items = json.loads(f.metadata()["items"])
    assert [i["index"] for i in items] == [3]
    flips = []
    for index in range(4):
        shard = index // 3
        with safe_open(str(out / f"shard-{shard:05d}.safetensors"), framework="pt") as f:
            record = json.loads(f.metadata()["items"])[index % 3]
        image = to_tensor(load_image(record["source"])[0])
        crop = image[:, :, record["top"] : record["top"] + 64, record["left"] : record["left"] + 64]
        crop = crop.flip(-1) if record["flip"] else crop
        flips.append(record["flip"])
        with torch.no_grad():
            target = taef2.encode(crop)
            cond = taef2.encode(F.avg_pool2d(taef2.decode(target).clamp(0, 1), 2))
        item = reader.item(index)
        assert torch.allclose(item["target"], target[0], atol=1e-5)
        assert torch.allclose(item["cond"], cond[0], atol=1e-5)
    assert "noise" not in reader.item(0)
    reader.close()

    # split across two workers (--part 1/2, then 0/2): the same dataset as one build
    split = tmp_path / "split"
    argv_split = [a if a != str(out) else str(split) for a in argv]
    assert cli_main(argv_split + ["--part", "1/2"]) == 0
    assert sorted(p.name for p in split.glob("shard-*")) == ["shard-00001.safetensors"]
    assert cli_main(argv_split + ["--part", "0/2"]) == 0
    whole, parts = _read_shards(out), _read_shards(split)
    assert whole.keys() == parts.keys()
    for name in whole:
        assert all(torch.equal(whole[name][0][k], parts[name][0][k]) for k in whole[name][0])
    assert cli_main(argv_split + ["--part", "2/2"]) == 2


def test_dataset_cli_errors_are_one_line_and_leave_no_output(tmp_path, shared, capsys):
    out = tmp_path / "never"
    taef2_dir = shared / "models" / "taef2"
    missing = tmp_path / "missing-teacher"
    code = cli_main(
        command_line("dataset", "distill", "-o", out, vae=taef2_dir, teacher=missing, num="2", no_progress=True)
    )
    assert code == 2 and not out.exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "teacher" in err[0]
    photo = shared / "images" / "kodak" / "kodim01.png"
    code = cli_main(command_line("dataset", "images", photo, "-o", out, vae=taef2_dir, crop_px="48", no_progress=True))
    assert code == 2 and not out.exists()


# ------------------------------------------------------------------------------------------------
# shard format and streaming loader


def _synthetic_dataset(root, count=10, size=16, noise=True):
    prepare_dataset_dir(
        root,
        {
            "kind": "distill" if noise else "images",
            "target_shape": [32, size, size],
            "cond_shape": [32, size // 2, size // 2],
            "shard_size": 4,
            "num_items": count,
            "has_noise": noise,
        },
    )
    base = torch.arange(count, dtype=torch.float32).view(count, 1, 1, 1)
    grid = torch.arange(size * size, dtype=torch.float32).view(1, 1, size, size)
    target = (base * 1000 + grid).expand(count, 32, size, size).clone()
    cond = F.avg_pool2d(target, 2)
    for shard in range((count + 3) // 4):
        sl = slice(shard * 4, min(count, shard * 4 + 4))
        tensors = {"target": target[sl], "cond": cond[sl]}
        if noise:
            tensors["noise"] = -target[sl]
        write_shard(
            root, shard, sl.start, tensors, [{"index": i} for i in range(sl.start, sl.stop)], dtype=torch.float32
        )
    return target, cond


def test_stream_crops_are_grid_aligned_and_consistent(tmp_path):
    target, cond = _synthetic_dataset(tmp_path)
    reader = ShardReader(tmp_path)
    stream = ShardStream(reader, micro_batch=3, crop=8, seed=5, time_sampling=TimeSampling("uniform"))
    for step in range(4):
        batch = stream.batch(step)
        assert batch["target"].shape == (3, 32, 8, 8) and batch["cond"].shape == (3, 32, 4, 4)
        for b in range(3):
            value = batch["target"][b, 0, 0, 0].item()
            index, offset = divmod(int(value), 1000)
            top, left = divmod(offset, 16)
            assert top % CROP_ALIGN == 0 and left % CROP_ALIGN == 0
            assert torch.equal(batch["target"][b], target[index, :, top : top + 8, left : left + 8])
            assert torch.equal(batch["cond"][b], cond[index, :, top // 2 : top // 2 + 4, left // 2 : left // 2 + 4])
            assert torch.equal(batch["noise"][b], -batch["target"][b])  # stored noise, same window
        assert ((batch["t"] >= 0) & (batch["t"] <= 1)).all()
    # an epoch visits every item once
    seen = sorted(stream.item_at(p) for p in range(10))
    assert seen == list(range(10))
    reader.close()


def test_stream_ranks_partition_the_global_batch_and_are_reproducible(tmp_path):
    _synthetic_dataset(tmp_path, noise=False)
    reader = ShardReader(tmp_path)
    single = ShardStream(reader, micro_batch=4, crop=4, seed=2, time_sampling=TimeSampling("logit_normal"))
    per_rank = {"micro_batch": 1, "crop": 4, "seed": 2, "world_size": 2, "grad_accum": 2}
    ranks = [ShardStream(reader, **per_rank, rank=r, time_sampling=TimeSampling("logit_normal")) for r in range(2)]
    for step in (0, 3):
        whole = single.batch(step)
        parts = [ranks[r].batch(step, m) for m in range(2) for r in range(2)]
        for key in ("target", "cond", "noise", "t"):
            assert torch.equal(torch.cat([p[key] for p in parts]), whole[key])
        assert torch.equal(single.batch(step)["noise"], whole["noise"])  # fresh noise, but seeded
    assert not torch.equal(single.batch(0)["noise"], single.batch(1)["noise"])
    fixed = ShardStream(reader, micro_batch=2, seed=2)
    assert torch.equal(fixed.batch(0)["t"], torch.ones(2))
    with pytest.raises(FlowliftError):
        ShardStream(reader, micro_batch=2, crop=6)
    reader.close()


def test_pipeline_teacher_passes_patchified_noise_and_normalizes_raw_output():
    """A stand-in with the diffusers FLUX.2 pipeline interface: it returns the raw (denormalized,
    unpatchified) version of the latents it was given, so the teacher must give back the noise."""
    from types import SimpleNamespace

    from flowlift.flux2.latents import denormalize, unpatchify
    from flowlift.training.datasets import PipelineTeacher

    mean, var = torch.randn(128) * 0.1, torch.rand(128) + 0.5
    calls = []

    class FakeFlux2Pipeline:
        device = torch.device("cpu")
        transformer = SimpleNamespace(dtype=torch.float32)
        vae = SimpleNamespace(
            bn=SimpleNamespace(running_mean=mean, running_var=var), config=SimpleNamespace(batch_norm_eps=1e-4)
        )

        def __call__(self, *, prompt, height, width, num_inference_steps, latents, output_type, return_dict):
            calls.append((prompt, height, width, num_inference_steps, tuple(latents.shape), output_type))
            return (denormalize(unpatchify(latents), mean, torch.sqrt(var + 1e-4)),)

    teacher = PipelineTeacher(FakeFlux2Pipeline(), ["a", "b", "c"], num_steps=3)
    teacher.next_item = 2
    noise = torch.randn(2, 32, 8, 12)
    assert torch.allclose(teacher(noise), noise, atol=1e-5)
    assert calls == [(["c", "a"], 64, 96, 3, (2, 128, 4, 6), "latent")]


def test_transformer_teacher_matches_a_diffusers_scheduler_loop():
    """The bare-transformer teacher = diffusers' FLUX.2 loop (FlowMatchEulerDiscreteScheduler with
    exponential dynamic shifting, the pipeline's packing and position ids)."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler

    from flowlift.flux2.latents import pack, patchify, unpack, unpatchify
    from flowlift.flux2.schedule import compute_empirical_mu
    from flowlift.training.datasets import TransformerTeacher

    transformer = tiny_transformer(mlp_ratio=2.0)
    embeds = torch.randn(5, 32, generator=torch.Generator().manual_seed(4))
    noise = torch.randn(1, 32, 8, 12, generator=torch.Generator().manual_seed(5))
    steps = 3
    ours = TransformerTeacher(transformer, embeds, num_steps=steps)(noise)

    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type="exponential")
    seq = 4 * 6
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=compute_empirical_mu(seq, steps))
    latents = pack(patchify(noise))
    # the pipeline's position ids: (T=0, H=i, W=j, L=0) per token, (0, 0, 0, l) per text token
    img_ids = torch.tensor([[0, i, j, 0] for i in range(4) for j in range(6)])[None]
    txt_ids = torch.tensor([[0, 0, 0, l] for l in range(5)])[None]
    with torch.no_grad():
        for t in scheduler.timesteps:
            v = transformer(
                hidden_states=latents,
                encoder_hidden_states=embeds[None],
                timestep=t.expand(1) / 1000,
                img_ids=img_ids,
                txt_ids=txt_ids,
                guidance=None,
                return_dict=False,
            )[0]
            latents = scheduler.step(v, t, latents, return_dict=False)[0]
    reference = unpatchify(unpack(latents, 4, 6))
    assert torch.allclose(ours, reference, atol=1e-4), (ours - reference).abs().max()


def test_dataset_distill_names_every_missing_piece_at_once(tmp_path, shared, capsys, monkeypatch):
    """Issue 48: ``dataset distill`` named a missing prompts file, and the missing teacher weights only once that
    was fixed. Now one line names both (and a missing VAE), before any model loads."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    out = tmp_path / "never"
    missing = {"vae": tmp_path / "no-vae.safetensors", "teacher": "nobody/no-such-teacher"}
    code = cli_main(
        command_line(
            "dataset", "distill", "-o", out, **missing, prompts=tmp_path / "prompts.txt", num="2", no_progress=True
        )
    )
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not out.exists()
    assert line.startswith("flowlift dataset: error: 3 things are missing: (1) --teacher nobody/no-such-teacher: ")
    assert "hf download nobody/no-such-teacher" in line
    assert f"(2) --prompts {tmp_path / 'prompts.txt'}: file not found" in line
    assert "(3) " in line and "no-vae.safetensors" in line
