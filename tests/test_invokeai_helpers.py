"""The InvokeAI pack's plain modules (no InvokeAI needed): raw latents, input checks, weight-file keys."""

from __future__ import annotations

import os

import pytest
import torch

from builders import save_tiny_unet
from flowlift.errors import FlowliftError
from flowlift.flux2.latents import normalize
from flowlift.invokeai import files, latents
from flowlift.upscale import node_choices as choices


def bn_stats(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(128, generator=gen) * 0.3, torch.rand(128, generator=gen) + 0.5


def test_raw_latents_round_trip_through_flowlifts_normalization():
    mean, std = bn_stats()
    raw = torch.randn(2, 32, 6, 10, generator=torch.Generator().manual_seed(1)) * 2 + 0.5
    normalized = latents.raw_to_normalized(raw, mean, std)
    torch.testing.assert_close(normalized, normalize(raw, mean, std), rtol=0, atol=0)
    torch.testing.assert_close(latents.normalized_to_raw(normalized, mean, std), raw, rtol=0, atol=1e-6)
    # per 2x2 patch channel c*4 + pi*2 + pj: latent (0, 0) of channel 0 uses statistic 0, (0, 1) statistic 1
    assert torch.isclose(normalized[0, 0, 0, 1], (raw[0, 0, 0, 1] - mean[1]) / std[1])


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (torch.zeros(1, 4, 8, 8), "needs FLUX.2 latents (batch, 32, height/8, width/8)"),
        (torch.zeros(1, 128, 4, 4), "(1, 128, 4, 4)"),
        (torch.zeros(32, 8, 8), "(32, 8, 8)"),
        ("not a tensor", "str"),
        (torch.zeros(1, 32, 8, 8, dtype=torch.int64), "float latents"),
        (torch.zeros(1, 32, 9, 8), "need even sides: make the image sides multiples of 16"),
    ],
)
def test_latent_inputs_that_cannot_be_flux2_are_one_line(value, message):
    with pytest.raises(FlowliftError) as caught:
        latents.check_raw_latents(value, "Flow Upscale Latents (FLUX.2)")
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_raw_latents_pass_as_float32():
    out = latents.check_raw_latents(torch.zeros(1, 32, 8, 6, dtype=torch.bfloat16), "node")
    assert out.dtype == torch.float32 and out.shape == (1, 32, 8, 6)


def test_scales_chunking_and_the_cap():
    assert [choices.latent_plan(s, 4, 6)[0] for s in (2, 4, 8)] == [1, 2, 3]
    assert [choices.chunked_flag(c) for c in choices.CHUNKING] == [None, True, False]
    for bad in (lambda: choices.latent_plan(1.5, 4, 6), lambda: choices.chunked_flag("sometimes")):
        with pytest.raises(FlowliftError):
            bad()
    latents.check_output_cap(2048, 2048, 3, "node", 8.0)  # 16384 px exactly: allowed
    with pytest.raises(
        FlowliftError, match=r"node: scale 8 on 2049x16 px: 3 2x pass\(es\) would make 16392x128 px, over the 16384 px"
    ):
        latents.check_output_cap(16, 2049, 3, "node", 8.0)


@pytest.mark.parametrize("scale", [1.0, 1.05])
def test_a_latent_fraction_that_makes_nothing_larger_is_refused_in_the_hires_fixs_words(scale):
    # SesquiLSR ran at 1.0 and 1.05 on 64x64 px and rewrote the latents at their own size; `flowlift hires` refuses
    with pytest.raises(FlowliftError) as caught:
        choices.latent_plan(scale, 8, 8, fraction_last=True)
    assert str(caught.value) == (
        f"scale: hires at {scale:g}x of a 64x64 base is 64x64 on the 16 px grid the refine needs, no larger on one "
        "side; use a scale of at least 1.125"
    )
    assert caught.value.field == "scale"
    assert choices.latent_plan(1.125, 8, 8, fraction_last=True) == (0, (10, 10))


def test_a_latent_fraction_over_the_16k_cap_is_refused_before_any_work():
    # ComfyUI's latent node wrote 17440x128 px from 2208x16 at 7.9x: the cap held only for whole passes
    with pytest.raises(FlowliftError, match=r"^scale: 7.9x of 2208x16 px would make 17440x128 px, over the 16384"):
        choices.latent_plan(7.9, 2, 276, fraction_last=True)
    assert choices.latent_plan(7.4, 2, 276, fraction_last=True) == (2, (14, 2042))  # 16336 px: within


def test_the_latents_node_plans_a_fraction_as_the_hires_fix_does():
    # issue 46.3: with a latent upscaler the passes below the factor, then the hires fix's even latent size
    plan = [choices.latent_plan(s, 64, 96, fraction_last=True) for s in (1.5, 3, 6, 4)]
    assert plan == [(0, (96, 144)), (1, (192, 288)), (2, (384, 576)), (2, None)]
    with pytest.raises(FlowliftError, match=r"got 3; choose a latent upscaler \(SesquiLSR\)"):
        choices.latent_plan(3, 64, 96)
    latents.check_output_cap(1024, 1024, 3, "node", 16.0, (2048, 2048))  # 16384 px exactly: allowed
    with pytest.raises(
        FlowliftError, match=r"node: scale 1.5 on 11000x16 px: SesquiLSR would make 16512x24 px, over the 16384 px"
    ):
        latents.check_output_cap(16, 11000, 0, "node", 1.5, (3, 2064))


@pytest.mark.parametrize(
    ("scale", "width", "passes", "canvas", "fit"),
    [(3.0, 5000, 2, "20032x64", 2), (5.0, 2064, 3, "16512x128", 4), (8.0, 2064, 3, "16512x128", 4)],
)
def test_an_image_nodes_scale_over_the_cap_names_that_scale_and_its_passes_canvas(scale, width, passes, canvas, fit):
    # scale 3 on a 5000 px image: 2 passes on a 20032 px canvas (5008 padded); the line said "scale 4 ... at most
    # 2" (and InvokeAI's "4x ... would make 20000") though the 15000 px asked fits the cap: both packs use image_plan
    for fraction_last in (False, True) if scale == 8 else (False,):
        with pytest.raises(FlowliftError) as caught:
            choices.image_plan(scale, width, 16, fraction_last=fraction_last)
        assert str(caught.value) == (
            f"Flow Upscaler: scale {scale:g} on a {width}x16 image runs {passes} 2x pass(es) on a {canvas} px canvas, "
            f"over the 16384 px cap a side; choose a scale of at most {fit}"
        )
        assert caught.value.field == "scale"
    assert choices.image_plan(fit, width, 16) == (fit.bit_length() - 1, None)  # the scale it names runs
    with pytest.raises(FlowliftError, match=r"^Flow Upscaler: a 9000x16 image cannot be upscaled: every scale"):
        choices.image_plan(1.5, 9000, 16)


def test_the_image_nodes_hand_the_pipeline_a_latent_upscaler_only_for_a_fraction():
    # a SesquiLSR file left selected loaded SesquiLSR at 2, 4 and 8 too, and refused TAEF2 and Mage-VAE for its
    # statistics (docs: 2, 4 and 8 do not run it)
    spec = "sesqui:/models/upscaler_Flux2.safetensors"
    for scale in (2, 4, 8):
        passes, size = choices.image_plan(scale, 48, 32, fraction_last=True)
        assert choices.image_latent_upscaler(spec, size) is None
    assert choices.image_latent_upscaler(spec, choices.image_plan(3, 48, 32, fraction_last=True)[1]) == spec
    assert choices.image_latent_upscaler(None, (144, 96)) is None


def test_a_weight_file_is_hashed_once_per_version_on_disk(tmp_path, monkeypatch):
    path = tmp_path / "weights.safetensors"
    path.write_bytes(b"first version")
    reads = []
    real_open = open
    monkeypatch.setattr(files, "open", lambda p, *a: reads.append(p) or real_open(p, *a), raising=False)
    first = files.file_digest(path)
    assert files.file_digest(path) == first and len(reads) == 1  # the second call costs a stat only
    path.write_bytes(b"second version, longer")  # replaced in place: another size and mtime
    second = files.file_digest(path)
    assert second != first and len(reads) == 2
    assert files.cache_key("upscaler", second, "float32", path.name).as_posix() == (
        f"flowlift/upscaler/{second}-float32/weights.safetensors"
    )
    link = tmp_path / "link.safetensors"
    os.symlink(path, link)
    assert files.file_digest(link) == second and len(reads) == 2  # the same file through a link


def test_a_model_of_several_files_gets_one_order_independent_digest(tmp_path):
    a, b = tmp_path / "taef2_encoder.pth", tmp_path / "taef2_decoder.pth"
    a.write_bytes(b"encoder")
    b.write_bytes(b"decoder")
    assert files.files_digest([a, b]) == files.files_digest([b, a]) != files.files_digest([a])
    with pytest.raises(FlowliftError, match="cannot read"):
        files.file_digest(tmp_path / "missing.safetensors")
    with pytest.raises(FlowliftError):
        files.files_digest([])


# ------------------------------------------------------------------------------------------------
# issue 32.G: server paths are checked before they are read, and refused without telling what they hold


def _upscaler_file(folder):
    return save_tiny_unet(folder / "flow_upscaler.safetensors", cond_dim=32)


def test_a_named_server_file_is_checked_before_a_byte_of_its_data_is_read(tmp_path, monkeypatch):
    """A 300 GB sparse file, a dotfile, garbage, a FIFO, a folder, no file at all: one refusal each, the same
    words for all (what was expected, never what is there), and no data read (so the queue never stalls)."""
    good = _upscaler_file(tmp_path)
    assert files.local_upscaler_file(str(good)) == good.resolve()
    assert files.local_upscaler_file(str(tmp_path)) == good.resolve()  # a folder's flow_upscaler.safetensors
    header = good.read_bytes()[: 8 + int.from_bytes(good.read_bytes()[:8], "little")]
    big = tmp_path / "big.safetensors"
    with open(big, "wb") as handle:
        handle.truncate(300 << 30)  # sparse: no disk used
    (tmp_path / ".bashrc").write_text("# ~/.bashrc: executed by bash\nexport SECRET=1\n")
    (tmp_path / "garbage.safetensors").write_bytes(b"#!" + os.urandom(4000))
    (tmp_path / "cut.safetensors").write_bytes(header + b"\0" * 100)  # a header whose data is missing
    (tmp_path / "listed.safetensors").write_bytes(len(b"[1,2]").to_bytes(8, "little") + b"[1,2]")
    os.mkfifo(tmp_path / "pipe.safetensors")
    (tmp_path / "folder.safetensors").mkdir()
    os.symlink(tmp_path / ".bashrc", tmp_path / "link.safetensors")
    sources = [
        big,
        tmp_path / ".bashrc",
        tmp_path / "garbage.safetensors",
        tmp_path / "cut.safetensors",
        tmp_path / "listed.safetensors",
        tmp_path / "pipe.safetensors",
        tmp_path / "folder.safetensors",
        tmp_path / "link.safetensors",
        tmp_path / "missing.safetensors",
        tmp_path / "nowhere" / "x.safetensors",
        tmp_path / "empty-folder",
    ]
    (tmp_path / "empty-folder").mkdir()
    monkeypatch.setattr(files, "file_digest", lambda *a: pytest.fail("a refused file was hashed"))
    lines = set()
    for source in sources:
        with pytest.raises(FlowliftError) as error:
            files.local_upscaler_file(str(source))
        text = str(error.value)
        assert "\n" not in text and text.startswith(f"Flow Upscaler: cannot use {source}: expected ")
        lines.add(text.replace(str(source), "SOURCE"))
    assert len(lines) == 1, lines  # nothing tells one case from another
    (line,) = lines
    for secret in ("No such file", "Permission", "FIFO", "directory", "35", "#", "SECRET", "operand", "300"):
        assert secret not in line, (secret, line)


def test_a_hub_cache_file_is_checked_by_its_name_and_its_header(tmp_path):
    """The Hugging Face cache links ``snapshots/<rev>/flow_upscaler.safetensors`` to a suffix-less blob."""
    good = _upscaler_file(tmp_path)
    blob = tmp_path / "blobs" / "0123abcd"
    blob.parent.mkdir()
    good.rename(blob)
    link = tmp_path / "snapshots" / "flow_upscaler.safetensors"
    link.parent.mkdir()
    os.symlink(blob, link)
    assert files.check_weight_file(link, files.UPSCALER_FILE) == blob.resolve()
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling.safetensors")
    with pytest.raises(FlowliftError, match="cannot use"):
        files.check_weight_file(tmp_path / "dangling.safetensors", files.UPSCALER_FILE)


def test_taef2_sources_are_the_two_files_or_one_safetensors_never_a_folder_walk(tmp_path, shared, monkeypatch):
    folder = shared / "models" / "taef2"
    assert sorted(p.name for p in files.local_taef2_files(str(folder))) == ["taef2_decoder.pth", "taef2_encoder.pth"]
    walked = []
    monkeypatch.setattr(type(tmp_path), "rglob", lambda self, *a: walked.append(self) or iter(()))
    for source in ("/", str(tmp_path), str(tmp_path / ".bashrc"), str(tmp_path / "x.pth")):
        with pytest.raises(FlowliftError, match=r"^TAEF2: cannot use .*: expected TAEF2's weights: a folder holding"):
            files.local_taef2_files(source)
    assert walked == []


def test_hashing_stops_within_one_chunk_of_a_cancel(tmp_path):
    path = tmp_path / "w.safetensors"
    path.write_bytes(os.urandom(5 << 20))  # five chunks
    calls = []

    class Cancelled(Exception):
        pass

    def stop_after_two():
        calls.append(1)
        if len(calls) > 2:
            raise Cancelled

    with pytest.raises(Cancelled):
        files.file_digest(path, stop_after_two)
    assert len(calls) == 3  # two chunks read, stopped before the third
    digest = files.file_digest(path, lambda: None)  # a cancelled hash is not remembered as the file's digest
    import hashlib

    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiled_denoise_loop_with_the_model_object_invokeai_hands_it():
    # the Tiled FLUX.2 Denoise node's loop on a diffusers Flux2Transformer2DModel (what InvokeAI's model cache
    # hands the node) and raw latents: a tile covering the frame is the untiled run bit for bit; smaller tiles
    # really run, change the result, and are named in the record
    import torch

    from flowlift.refine.loop import tiled_refine_raw_latents, tiling_line
    from flowlift.refine.settings import SamplingSettings
    from flowlift.refine.tiling import TileRequest
    from tiny_flux2 import prompt_embeds, tiny_transformer

    transformer = tiny_transformer().eval()
    raw = torch.randn(1, 32, 12, 16, generator=torch.Generator().manual_seed(3))  # 96x128 px
    bn_mean, bn_std = torch.randn(128) * 0.1, torch.rand(128) + 0.5
    sampling = SamplingSettings(steps=3, seed=7)

    def run(size, overlap=16):
        with torch.no_grad():
            tiles = TileRequest.parse(size, overlap)
            return tiled_refine_raw_latents(
                transformer,
                raw,
                bn_mean,
                bn_std,
                prompt_embeds(),
                strength=0.6,
                sampling=sampling,
                tiles=tiles,
                device="cpu",
            )

    untiled, off_record = run("off")
    whole, whole_record = run(128)
    tiled, record = run(64, 32)
    assert torch.equal(whole, untiled) and "tiles" not in whole_record and off_record == {"tile_size": "off"}
    assert record["tiles"]["grid"] == [2, 3] and record["tiles"]["overlap"] == 32, record
    assert tiled.shape == raw.shape and torch.isfinite(tiled).all()
    assert not torch.allclose(tiled, untiled, atol=1e-4)
    assert not torch.allclose(untiled, raw, atol=1e-2)  # the loop ran: raw in, refined raw out
    # the node's log line (a LatentsOutput carries no metadata)
    assert tiling_line((96, 128), record) == "128x96 px refined in 2x3 tiles of 64x64 px, overlap 32 px, 1 per call"
    assert tiling_line((96, 128), whole_record) == "128x96 px refined untiled (tile size 128)"


def test_a_mage_vae_file_passes_its_own_check_and_other_sources_are_one_line(tmp_path):
    """issue 37: Mage-VAE's file kind (one .safetensors, a bound of its own) and its one refusal line."""
    from mage_files import released_state, save_released

    path = save_released(tmp_path / "mage_vae.safetensors", released_state())
    assert files.check_weight_file(path, files.MAGE_SAFETENSORS) == path.resolve()
    assert set(files.NATIVE_VAE_FILES) == {"taef2", "mage"}
    for source in (tmp_path / "missing.safetensors", tmp_path / "mage_vae.pt", tmp_path):
        with pytest.raises(FlowliftError, match=r"^Mage-VAE: cannot use .*: expected Mage-VAE's weights: one "):
            files.check_weight_file(source, files.MAGE_SAFETENSORS, shown=str(source))


@pytest.mark.parametrize(
    ("sent", "expected"),
    [
        ("5", 5),
        ("5.0", 5),
        ('"5"', 5),
        ("18446744073709551615", 2**64 - 1),
        ("true", None),
        ("false", None),
        ("5.5", None),
        ("-1", None),
        ('"-1"', None),
        ("18446744073709551616", None),
        ('"5.5"', None),
        ("null", None),
        ("[5]", None),
    ],
)
def test_the_seed_fields_take_the_seed_rule_before_pydantic(sent, expected):
    """Issue 36 class 10: the nodes' seed type (``Seed``) in a pydantic model with the knob's bounds, as
    ``knob_field`` declares it, fed the graph's JSON: pydantic's own int took ``true`` as 1."""
    from pydantic import Field, ValidationError, create_model

    from flowlift.knobs import SEED

    node = create_model("Node", seed=(latents.Seed, Field(default=SEED.default, ge=SEED.low, le=SEED.high)))
    if expected is None:
        with pytest.raises(ValidationError, match="seed must be a non-negative integer at most 18446744073709551615"):
            node.model_validate_json('{"seed": ' + sent + "}")
    else:
        got = node.model_validate_json('{"seed": ' + sent + "}").seed
        assert got == expected and type(got) is int


@pytest.mark.parametrize(
    ("kind", "sent", "expected"),
    [
        ("Number", "2", 2.0),
        ("Number", "true", None),
        ("Number", "false", None),
        ("Count", "3", 3),
        ("Count", "true", None),
        ("Number", '"2"', 2.0),
    ],
)
def test_the_number_fields_refuse_bools_before_pydantic(kind, sent, expected):
    """``"scale": true`` ran at 1x, a tiled denoise ``"strength": true`` redrew the whole image: pydantic's float and
    int take a bool as 1 or 0."""
    from pydantic import Field, ValidationError, create_model

    node = create_model("Node", value=(getattr(latents, kind), Field(default=1, ge=0, le=8)))
    if expected is None:
        with pytest.raises(ValidationError, match="a number is needed, got " + sent):
            node.model_validate_json('{"value": ' + sent + "}")
    else:
        got = node.model_validate_json('{"value": ' + sent + "}").value
        assert got == expected and type(got) is type(expected)


def test_a_latent_upscaler_file_is_checked_at_once_and_every_failure_reads_the_same(tmp_path):
    """The SesquiLSR field told a caller a server file's size, that it existed, and another network's tensor names,
    and a missing file passed unnoticed at 2x (where SesquiLSR does not run)."""
    from sesqui_reference import save_random_sesqui

    (tmp_path / "good").mkdir()
    good = save_random_sesqui(tmp_path / "good")
    sparse = tmp_path / "big.safetensors"
    with open(sparse, "wb") as handle:
        handle.truncate(1 << 40)
    (tmp_path / "profile").write_text("export X=1\n")
    flow = save_tiny_unet(tmp_path / "flow_upscaler.safetensors")
    for path in (tmp_path / "none.safetensors", sparse, tmp_path / "profile", flow, tmp_path):
        with pytest.raises(FlowliftError) as refused:
            files.checked_sesqui_spec(f"sesqui:{path}", shown=f"sesqui:{path}")
        assert str(refused.value) == f"SesquiLSR: cannot use sesqui:{path}: {files.SESQUI_FILE.expected}"
    with pytest.raises(FlowliftError, match="SesquiLSR: cannot use spandrel:x"):
        files.checked_sesqui_spec("spandrel:x", shown="spandrel:x")
    assert files.checked_sesqui_spec(f"sesqui:{good}", shown="mine") == f"sesqui:{os.path.realpath(good)}"


@pytest.mark.parametrize(
    ("knob", "sent", "ok"),
    [
        ("TILE_SIZE", "auto", True),
        ("TILE_SIZE", "512", True),
        ("TILE_SIZE", "no", False),
        ("TILE_SIZE", "0", False),
        ("TILE_SIZE", "", False),
        ("TILE_BATCH", "auto", True),
        ("TILE_BATCH", "4", True),
        ("TILE_BATCH", "0", False),
        ("TILE_BATCH", "off", False),
    ],
)
def test_the_tiled_denoise_text_fields_are_checked_as_the_graph_arrives(knob, sent, ok):
    """``"tile_size": "no"`` passed InvokeAI's 422 check and failed only when the node ran, after its upstream nodes."""
    from pydantic import ValidationError, create_model

    from flowlift.refine import settings

    node = create_model("Node", value=(latents.knob_text(getattr(settings, knob)), "auto"))
    if ok:
        assert node.model_validate({"value": sent}).value == sent
    else:
        with pytest.raises(ValidationError, match=getattr(settings, knob).name + " must be"):
            node.model_validate({"value": sent})


def test_a_latent_scale_a_hair_off_two_is_shown_as_it_came():
    with pytest.raises(FlowliftError, match=r"got 2\.0000000000000004; choose a latent upscaler"):
        choices.latent_plan(2.0000000000000004, 8, 8)
