"""Mage-VAE: architecture, strict loading of the released layout, the adapter's latent convention, and
equality to a literal reference-style implementation (tests/mage_reference.py) on square and non-square
images. Checkpoints are random, in the released layout, made here (tests/mage_files.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

import mage_reference as ref
from builders import fake_hub_cache, run_offline_with_hub_cache, save_tiny_unet
from door_helpers import assert_refuses_misshapen_inputs
from flowlift.errors import FlowliftError
from flowlift.flux2.latents import patchify, unpatchify
from flowlift.models.mage_vae import MageVAEConfig, MageVAEModel, dct_position_features, window_attention
from flowlift.models.mage_vae_files import mage_from_state_dict
from flowlift.models.vae import MageVAE
from flowlift.models.vae_loading import MAGE_REPOS, load_vae
from mage_files import NARROW, SKIPPED, released_state, save_released

pytestmark = pytest.mark.usefixtures("single_thread_torch")


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    return released_state(NARROW, seed=0)


@pytest.fixture(scope="module")
def vae(state) -> MageVAE:
    return mage_from_state_dict(state)


@pytest.fixture(scope="module")
def released_file(tmp_path_factory, state) -> Path:
    return save_released(tmp_path_factory.mktemp("mage") / "mage_vae.safetensors", state)


# --------------------------------------------------------------------------------------------------
# Architecture
# --------------------------------------------------------------------------------------------------


def test_full_size_parameter_counts_before_and_after_the_fold():
    model = MageVAEModel(device="meta")

    def count(module: torch.nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    # ~67M encoder and ~70M decoder before the fold, as other runtimes report for the released file.
    assert count(model.encoder) == 67_421_824
    assert count(model.decoder) == 70_630_211
    assert count(model.decoder.y_embedder.decoder) == 10_924_800  # the CoD decoder
    model.fold_t0()
    # The fold drops both timestep MLPs and all 42 DiCo adaLN layers (~37.7M parameters), and the per-pixel
    # fold x_embedder, input_proj and the RMSNorm weight (4,288: y_embedder_x becomes pixel_embed, same size);
    # the per-pixel modulation is kept twice (9,504 more): as released for float32, with the three LayerNorms'
    # affines folded in for half dtypes; so are the two attention blocks' projections (591,360 more: q and k
    # as one 1x1 convolution, v and proj_out as another, for half dtypes).
    assert count(model.encoder) == 48_547_456
    assert count(model.decoder) == 51_761_059 + 2 * 2 * (384 * 384 + 384)
    assert model.encoder.t_embedder is None and all(b.adaLN_modulation is None for b in model.decoder.blocks)


def test_device_builds_every_layer_there_with_the_layout_of_a_cpu_build():
    """The loader builds its skeleton with ``device="meta"`` (no data, no initialisation): a layer left out of the
    ``device`` plumbing would be made on the CPU with random weights, or missing from the state dict."""
    meta, cpu = MageVAEModel(NARROW, device="meta"), MageVAEModel(NARROW)
    meta_state, cpu_state = meta.state_dict(), cpu.state_dict()
    assert {k: v.shape for k, v in meta_state.items()} == {k: v.shape for k, v in cpu_state.items()}
    assert {v.device.type for v in meta_state.values()} == {"meta"}
    assert {v.device.type for v in cpu_state.values()} == {"cpu"}


def test_full_size_shapes_on_meta():
    with torch.device("meta"):
        model = MageVAEModel().fold_t0()
        z = model.encode(torch.empty(2, 3, 48, 80))
        x = model.decode(torch.empty(2, 128, 3, 5))
    assert tuple(z.shape) == (2, 128, 3, 5)
    assert tuple(x.shape) == (2, 3, 48, 80)


def test_unfolded_blocks_refuse_to_run():
    model = MageVAEModel(NARROW, encoder=False)
    with pytest.raises(RuntimeError, match="fold_t0"):
        model.decode(torch.zeros(1, 128, 2, 2))


def test_window_attention_is_per_window_with_replicate_padding():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 6, 10) for _ in range(3))
    out = window_attention(q, k, v, 4)
    # The window at rows 4..7 x cols 8..11 holds real rows 4..5, cols 8..9, padded by repetition.
    pad = [torch.nn.functional.pad(t, (0, 2, 0, 2), mode="replicate")[:, :, 4:8, 8:12] for t in (q, k, v)]
    cells = [t.reshape(1, 8, 16).transpose(1, 2) for t in pad]
    expected = torch.softmax(cells[0] @ cells[1].transpose(1, 2) / 8**0.5, -1) @ cells[2]
    torch.testing.assert_close(out[:, :, 4:6, 8:10], expected.transpose(1, 2).reshape(1, 8, 4, 4)[:, :, :2, :2])
    # A change in another window leaves this one alone.
    k2 = k.clone()
    k2[:, :, :4, :4] += 1
    torch.testing.assert_close(window_attention(q, k2, v, 4)[:, :, 4:, 8:], out[:, :, 4:, 8:])


def test_dct_features_match_the_reference_table():
    ours = dct_position_features(16, 8, device=torch.device("cpu"), dtype=torch.float32)
    torch.testing.assert_close(ours, ref.dct_table(8)[0])


# --------------------------------------------------------------------------------------------------
# Equality to the reference-style implementation
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [(64, 64), (48, 112), (528, 272)])
def test_encode_equals_the_reference(vae, state, size):
    """Posterior mean, unpatchified: square, non-square, and over two attention windows (528 = 33 x 16)."""
    torch.manual_seed(1)
    images = torch.rand(2, 3, *size)
    expected = ref.encode(state, images * 2 - 1)
    latents = vae.encode(images)
    assert tuple(latents.shape) == (2, 32, size[0] // 8, size[1] // 8)
    assert relative(patchify(latents), expected) <= 1e-4


@pytest.mark.parametrize("grid", [(4, 4), (3, 7), (33, 17)])
def test_decode_equals_the_reference(vae, state, grid):
    """Latent grids (at 1/16) inside one attention window, across several, with replicate-padded edges."""
    torch.manual_seed(2)
    codes = torch.randn(1, 128, *grid)
    expected = (ref.decode(state, codes) + 1) / 2
    images = vae.decode(unpatchify(codes))
    assert tuple(images.shape) == (1, 3, grid[0] * 16, grid[1] * 16)
    assert relative(images, expected) <= 1e-4


def test_round_trip_through_load_vae_equals_the_reference(released_file, state):
    loaded = load_vae(str(released_file))
    assert isinstance(loaded, MageVAE) and loaded.has_encoder
    assert loaded.bn_mean is None and loaded.bn_std is None and loaded.spatial_factor == 8
    assert loaded.approximate_decode
    torch.manual_seed(3)
    images = torch.rand(1, 3, 80, 48)
    expected = (ref.decode(state, ref.encode(state, images * 2 - 1)) + 1) / 2
    assert relative(loaded.decode(loaded.encode(images)), expected) <= 1e-4


@pytest.mark.parametrize("owned", [False, True])
def test_loading_leaves_the_callers_tensors_alone(state, owned):
    """A second load (and the reference) must not see folded weights; and tensors handed over (``owned``: a
    file's, often its mapped pages) are folded into new tensors, never written (a write faults and copies
    every page: issue 47)."""
    before = {k: v.clone() for k, v in state.items()}
    mage_from_state_dict(state, owned=owned)
    assert all(torch.equal(before[k], state[k]) for k in state)


def test_a_bf16_file_loads_and_runs_in_the_requested_dtype(tmp_path, state):
    path = save_released(tmp_path / "mage_bf16.safetensors", state, torch.bfloat16)
    loaded = load_vae(path, dtype=torch.bfloat16)
    assert loaded.dtype == torch.bfloat16
    out = loaded.decode(torch.randn(1, 32, 8, 8, dtype=torch.bfloat16))
    assert out.dtype == torch.float32 and bool(torch.isfinite(out).all())  # its pixels are computed in float32


# --------------------------------------------------------------------------------------------------
# Strict loading
# --------------------------------------------------------------------------------------------------


def _error(tmp_path: Path, tensors: dict[str, torch.Tensor], name: str = "bad.safetensors") -> str:
    path = save_released(tmp_path / name, tensors)
    with pytest.raises(FlowliftError) as info:
        load_vae(path)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_missing_tensor_is_named(tmp_path, state):
    keys = ("pipeline.blocks.1.conv3.bias", "student.dconv_encoder.z_proj.weight", "pipeline.s_embedder.proj1.weight")
    for key in keys:
        broken = {k: v for k, v in state.items() if k != key}
        message = _error(tmp_path, broken)
        assert "missing 1" in message and key in message


def test_an_extra_tensor_is_named(tmp_path, state):
    for key in ("pipeline.blocks.9.conv1.weight", "student.dconv_encoder.extra.bias", "ema.decay"):
        message = _error(tmp_path, {**state, key: torch.zeros(3)})
        assert "unexpected 1" in message and key in message


def test_a_misshapen_tensor_is_named(tmp_path, state):
    key = "pipeline.y_embedder.decoder.block.1.q.weight"
    message = _error(tmp_path, {**state, key: torch.zeros(64, 64, 3, 3)})
    assert key in message and "(64, 64, 3, 3) != (64, 64, 1, 1)" in message


def test_non_float_and_non_finite_tensors_are_refused(tmp_path, state):
    key = "pipeline.final_layer.linear.bias"
    assert key in _error(tmp_path, {**state, key: torch.zeros(3, dtype=torch.int32)})
    poisoned = {**state, key: torch.tensor([0.0, float("nan"), 0.0])}
    assert "NaN" in _error(tmp_path, poisoned) and key in _error(tmp_path, poisoned)


def test_loading_gives_the_caller_its_threads_back(state):
    """The loader's copies, fold and conversion run in one CPU thread (``devices.one_thread``); the caller's
    thread count is back after a load and after a refused one."""
    key = "pipeline.final_layer.linear.bias"
    torch.set_num_threads(2)
    try:
        mage_from_state_dict(state, dtype=torch.bfloat16)
        assert torch.get_num_threads() == 2
        with pytest.raises(FlowliftError, match="NaN"):
            mage_from_state_dict({**state, key: torch.tensor([0.0, float("nan"), 0.0])})
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)


def test_the_flux2_encoder_group_is_skipped_and_only_it(tmp_path, state):
    assert all(k in state for k in SKIPPED)  # the fixture carries it, with arbitrary shapes
    without = {k: v for k, v in state.items() if k not in SKIPPED}
    a = load_vae(save_released(tmp_path / "with.safetensors", state))
    b = load_vae(save_released(tmp_path / "without.safetensors", without))
    z = torch.randn(1, 32, 4, 4)
    torch.testing.assert_close(a.decode(z), b.decode(z), rtol=0, atol=0)
    # A look-alike outside the two skipped groups is not skipped.
    message = _error(tmp_path, {**state, "pipeline.y_embedder.encoders.w": torch.zeros(1)})
    assert "pipeline.y_embedder.encoders.w" in message


def test_a_decode_only_file_gives_a_decode_only_vae(tmp_path, state, vae):
    decoder_only = {k: v for k, v in state.items() if not k.startswith("student.")}
    path = save_released(tmp_path / "mage_decoder.safetensors", decoder_only)
    loaded = load_vae(path)
    assert not loaded.has_encoder and loaded.model.encoder is None
    z = torch.randn(1, 32, 6, 4)
    torch.testing.assert_close(loaded.decode(z), vae.decode(z))
    with pytest.raises(FlowliftError, match="decode-only") as info:
        loaded.encode(torch.rand(1, 3, 32, 32))
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_the_vae_refusals_name_the_vae_field_in_the_python_apis_words(tmp_path, state):
    """A decode-only file asked to encode and the diffusers port name the ``vae`` field, which each door words (the
    command line ``--vae``, ComfyUI its input, InvokeAI its TAEF2 field): the Python API never reads ``--vae``."""
    from flowlift.errors import FIELD_MARK
    from flowlift.models.vae_loading import MAGE_DIFFUSERS_PORT_CLASS

    decoder_only = {k: v for k, v in state.items() if not k.startswith("student.")}
    with pytest.raises(FlowliftError) as info:
        load_vae(save_released(tmp_path / "mage_decoder.safetensors", decoder_only)).encode(torch.rand(1, 3, 32, 32))
    assert info.value.fields == ("vae",) and FIELD_MARK in info.value.template
    assert "set vae to taef2" in str(info.value) and "--vae" not in str(info.value)
    assert "set the TAEF2 field to taef2" in info.value.worded({"vae": "the TAEF2 field"})
    port = tmp_path / "port"
    port.mkdir()
    (port / "config.json").write_text(f'{{"_class_name": "{MAGE_DIFFUSERS_PORT_CLASS}"}}')
    with pytest.raises(FlowliftError) as info:
        load_vae(port)
    assert info.value.fields == ("vae",) and "set vae to mage for the released one" in str(info.value)
    assert "--vae" not in str(info.value)


def test_a_file_without_the_decoder_is_one_line(tmp_path, state):
    encoder_only = {k: v for k, v in state.items() if k.startswith("student.")}
    assert "no decoder" in _error(tmp_path, encoder_only)


def test_pickled_checkpoints_are_refused(tmp_path, state):
    path = tmp_path / "mage_vae.pt"
    torch.save(state, path)
    with pytest.raises(FlowliftError, match=r"pickled Mage-VAE.*\.safetensors") as info:
        load_vae(path)
    assert "\n" not in str(info.value)
    # The reference's own training checkpoints wrap the state dict with other objects: refused unread.
    wrapped = tmp_path / "checkpoint-state_dict.pt"
    torch.save({"module": state, "step": Path("step")}, wrapped)
    with pytest.raises(FlowliftError, match="pickle") as info:
        load_vae(wrapped)
    assert "\n" not in str(info.value)


def test_full_size_mismatch_is_caught_before_anything_is_allocated():
    """The released widths, on meta: a misshapen tensor is named without reading or copying any weight."""
    with torch.device("meta"):
        model = MageVAEModel()
    state = {
        ("student.dconv_encoder." if k.startswith("encoder.") else "pipeline.") + k.split(".", 1)[1]: v
        for k, v in model.state_dict().items()
    }
    state["pipeline.blocks.20.conv4.weight"] = torch.empty(1536, 384, 3, 3, device="meta")
    with pytest.raises(FlowliftError, match=r"pipeline\.blocks\.20\.conv4\.weight \(1536, 384, 3, 3\)"):
        mage_from_state_dict(state)
    del state["pipeline.blocks.20.conv4.weight"]
    with pytest.raises(FlowliftError, match=r"missing 1: pipeline\.blocks\.20\.conv4\.weight"):
        mage_from_state_dict(state)


def test_a_full_size_file_loads_and_decodes_as_the_reference(tmp_path):
    full = released_state(MageVAEConfig(), seed=5, encoder=False)
    path = save_released(tmp_path / "mage_vae_decoder.safetensors", full, torch.bfloat16)
    loaded = load_vae(path)
    assert not loaded.has_encoder
    assert sum(p.numel() for p in loaded.model.parameters()) == 51_761_059 + 2 * 2 * (384 * 384 + 384)  # + folds
    as_stored = {k: v.to(torch.bfloat16).float() for k, v in full.items()}
    codes = torch.randn(1, 128, 2, 3)
    expected = (ref.decode(as_stored, codes) + 1) / 2
    assert relative(loaded.decode(unpatchify(codes)), expected) <= 1e-4


# --------------------------------------------------------------------------------------------------
# The adapter
# --------------------------------------------------------------------------------------------------


def test_bad_inputs_are_one_line(vae):
    assert_refuses_misshapen_inputs(vae)


def test_tiled_runs_the_hook_which_defaults_to_the_exact_executor(vae):
    torch.manual_seed(4)
    z = torch.randn(1, 32, 8, 8)
    whole = vae.decode(z, tiled=False)
    assert vae.tiled_decoder.func.__name__ == "decode_tiled"  # the exact executor (tests/test_mage_tiling.py)
    torch.testing.assert_close(vae.decode(z, tiled=True), whole, rtol=1e-5, atol=1e-6)
    calls = []

    def executor(decoder, codes, on_tile=None, unit_range=False):
        calls.append(tuple(codes.shape))
        return decoder(codes, unit_range=unit_range)

    before = vae.tiled_decoder
    vae.tiled_decoder = executor
    try:
        torch.testing.assert_close(vae.decode(z, tiled=True), whole, rtol=0, atol=0)
        vae.decode(z, tiled=False)
    finally:
        vae.tiled_decoder = before
    assert calls == [(1, 128, 4, 4)]


def test_on_tile_reports_one_tile(vae):
    seen = []
    vae.decode(torch.randn(1, 32, 4, 4), on_tile=lambda done, total: seen.append((done, total)))
    assert seen == [(1, 1)]


# --------------------------------------------------------------------------------------------------
# Specs: folders, hub ids, 'mage', the diffusers port
# --------------------------------------------------------------------------------------------------


def test_a_mage_flow_repository_folder_loads_its_vae(tmp_path, released_file):
    repo = tmp_path / "Mage-Flow-Base"
    (repo / "vae").mkdir(parents=True)
    (repo / "vae" / "mage_vae.safetensors").write_bytes(released_file.read_bytes())
    (repo / "model_index.json").write_text("{}")
    assert isinstance(load_vae(repo), MageVAE)
    assert isinstance(load_vae(repo / "vae"), MageVAE)


def test_mage_spec_tries_the_repositories_in_order(tmp_path, monkeypatch, released_file):
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    fake_hub_cache(cache, MAGE_REPOS[-1], {"vae/mage_vae.safetensors": released_file.read_bytes()})
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    assert isinstance(load_vae("mage"), MageVAE)
    assert isinstance(load_vae(MAGE_REPOS[-1]), MageVAE)
    from flowlift.models.vae_loading import check_vae_spec
    from flowlift.upscale.loading import vae_spec_files

    check_vae_spec("mage")
    assert [p.name for p in vae_spec_files("mage")] == ["mage_vae.safetensors"]  # provenance: the file hashed


def test_a_cached_mage_loads_offline_without_the_hub_client(tmp_path, released_file):
    """Offline, a cached snapshot is found from the cache's layout: check, load and provenance import no
    ``huggingface_hub.hf_api`` / ``_snapshot_download`` (~0.3 CPU-s of a command's start)."""

    cache = tmp_path / "hub"
    fake_hub_cache(cache, MAGE_REPOS[1], {"vae/mage_vae.safetensors": released_file.read_bytes()})
    script = (
        "import sys\n"
        "from flowlift.models.vae_loading import check_vae_spec, load_vae\n"
        "from flowlift.upscale.loading import vae_spec_files\n"
        "check_vae_spec('mage'); vae = load_vae('mage')\n"
        "print([p.name for p in vae_spec_files('mage')], type(vae).__name__)\n"
        "print(sorted(m for m in sys.modules if m.startswith('huggingface_hub.')))\n"
    )
    files, modules = run_offline_with_hub_cache(script, cache)
    assert files == "['mage_vae.safetensors'] MageVAE"
    assert "hf_api" not in modules and "_snapshot_download" not in modules and "file_download" not in modules


def test_the_cache_lookup_answers_as_snapshot_download(tmp_path, monkeypatch):
    import huggingface_hub.constants
    from huggingface_hub import snapshot_download

    from flowlift.models.hub import cached_snapshot

    cache = tmp_path / "hub"
    fake_hub_cache(cache, "owner/cached", {"vae/a.json": b"{}"})
    (cache / "models--owner--no-snapshot" / "refs").mkdir(parents=True)
    (cache / "models--owner--no-snapshot" / "refs" / "main").write_text("1" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    found = snapshot_download("owner/cached", local_files_only=True)
    assert cached_snapshot("owner/cached") == found
    assert cached_snapshot("owner/cached", "0" * 40) == found  # a commit is its own snapshot
    for repo, revision in (("owner/missing", "main"), ("owner/no-snapshot", "main"), ("owner/cached", "dev")):
        assert cached_snapshot(repo, revision) is None
        with pytest.raises(Exception):  # noqa: B017 - huggingface_hub's own "not cached" error
            snapshot_download(repo, revision=revision, local_files_only=True)


def test_mage_spec_without_cache_is_one_line_with_the_download_command(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(FlowliftError) as info:
        load_vae("mage")
    message = str(info.value)
    assert "\n" not in message and "HF_HUB_OFFLINE=1" in message
    assert "download microsoft/Mage-Flow-Base --include 'vae/*'" in message
    assert all(repo in message for repo in MAGE_REPOS)


def test_the_diffusers_port_is_refused_naming_what_flowlift_reads(tmp_path):
    port = tmp_path / "MageFlow-VAE-diffusers"
    port.mkdir()
    (port / "config.json").write_text('{"_class_name": "AutoencoderKLMega", "folded": true}')
    from safetensors.torch import save_file

    save_file({"encoder.patch_embed.weight": torch.zeros(2)}, str(port / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(FlowliftError, match="AutoencoderKLMega") as info:
        load_vae(port)
    message = str(info.value)
    assert "\n" not in message and "student.dconv_encoder.*" in message and "TAEF2" in message


def test_unrecognised_files_name_the_readable_layouts(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "other.safetensors"
    save_file({"model.weight": torch.zeros(2)}, str(path))
    with pytest.raises(FlowliftError, match="Mage-VAE") as info:
        load_vae(path)
    assert "\n" not in str(info.value) and "pipeline.*" in str(info.value)


def test_a_module_spec(state):
    model = MageVAEModel(NARROW)
    loaded = load_vae(model)
    assert isinstance(loaded, MageVAE) and model.folded
    narrow = replace(NARROW, decoder_blocks=1)
    assert isinstance(load_vae(MageVAEModel(narrow, encoder=False)), MageVAE)


# --------------------------------------------------------------------------------------------------
# The CLI
# --------------------------------------------------------------------------------------------------


def test_cli_upscale_with_a_mage_vae_file(tmp_path, released_file, capsys):
    import numpy as np
    from PIL import Image

    from flowlift.commands.cli import main

    upscaler = save_tiny_unet(tmp_path / "flow_upscaler.safetensors")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8)).save(tmp_path / "photo.png")
    common = ["--upscaler", str(upscaler), "--device", "cpu", "--scale", "2"]
    photo = str(tmp_path / "photo.png")
    rc = main(["upscale", photo, "-o", str(tmp_path / "out"), "--vae", str(released_file), *common])
    assert rc == 0, capsys.readouterr().err
    with Image.open(tmp_path / "out" / "photo_x2.png") as out:
        assert out.size == (112, 80)
    bad = save_released(tmp_path / "bad.safetensors", {"pipeline.blocks.0.conv1.weight": torch.zeros(2)})
    capsys.readouterr()
    rc = main(["upscale", photo, "-o", str(tmp_path / "out2"), "--vae", str(bad), *common])
    err = capsys.readouterr().err
    assert rc != 0 and "Traceback" not in err
    lines = [line for line in err.splitlines() if "Mage-VAE" in line]
    assert len(lines) == 1 and "pipeline.blocks.0.conv1.weight" in lines[0]
    assert not (tmp_path / "out2").exists() or not any((tmp_path / "out2").iterdir())
    # a decode-only file cannot encode the photo: the one line names the command line's option
    decoder_only = {k: v for k, v in released_state().items() if not k.startswith("student.")}
    decoder = save_released(tmp_path / "decoder.safetensors", decoder_only)
    rc = main(["upscale", photo, "-o", str(tmp_path / "out3"), "--vae", str(decoder), *common])
    lines = [line for line in capsys.readouterr().err.splitlines() if "decode-only" in line]
    assert rc != 0 and len(lines) == 1 and "set --vae to taef2" in lines[0], lines
