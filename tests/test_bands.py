import numpy as np
import pytest
import torch

from flowlift.errors import FlowliftError
from flowlift.measure import bands as B

FACTOR = 8
MIX = torch.tensor(np.random.default_rng(0).standard_normal((3, 4)) * 0.1, dtype=torch.float32)


def ideal_decoder(z: torch.Tensor) -> torch.Tensor:
    """Linear 'decoder': channel mix 4 -> 3, then exact band-limited (FFT zero-padding) 8x upsampling."""
    x = torch.einsum("oc,bchw->bohw", MIX, z.float()).double()
    _, _, h, w = x.shape
    spectrum = torch.fft.fftshift(torch.fft.fft2(x), dim=(-2, -1))
    big = torch.zeros(x.shape[:2] + (h * FACTOR, w * FACTOR), dtype=spectrum.dtype)
    top, left = (h * FACTOR - h) // 2, (w * FACTOR - w) // 2
    big[..., top : top + h, left : left + w] = spectrum
    up = torch.fft.ifft2(torch.fft.ifftshift(big, dim=(-2, -1))).real * FACTOR**2
    return (0.5 + up).float()


def nearest_decoder(z: torch.Tensor) -> torch.Tensor:
    """Linear 'decoder' with blocky (nearest) upsampling: aliases energy above the latent Nyquist."""
    x = torch.einsum("oc,bchw->bohw", MIX, z.float())
    return 0.5 + x.repeat_interleave(FACTOR, dim=2).repeat_interleave(FACTOR, dim=3)


def test_radial_frequency_and_masks():
    r = B.radial_frequency(8, 16)
    assert r[0, 0] == 0 and r[0, 8] == pytest.approx(1.0) and r[4, 0] == pytest.approx(1.0)
    assert r.max() == pytest.approx(np.sqrt(2))
    masks = [
        B.band_mask(32, 32, lo, hi, closed=(k == 4))
        for k, (lo, hi) in enumerate(zip(B.BAND_EDGES[:-1], B.BAND_EDGES[1:], strict=True))
    ]
    total = np.sum(masks, axis=0)
    assert total.max() == 1  # disjoint
    assert (total == 1).sum() == (r_ := B.radial_frequency(32, 32) <= 1).sum() and np.all(total[r_] == 1)
    assert B.band_labels() == ["0-1/16", "1/16-1/8", "1/8-1/4", "1/4-1/2", "1/2-1"]


def test_band_limited_noise_is_in_band_and_scaled():
    delta = B.band_limited_noise((1, 4, 32, 48), 1 / 8, 1 / 4, 0.1, seed=3)
    assert delta.dtype == torch.float32
    assert delta.pow(2).mean().sqrt().item() == pytest.approx(0.1, rel=1e-5)
    power = torch.fft.fft2(delta.double()).abs().pow(2).sum(dim=(0, 1)).numpy()
    inside = B.band_mask(32, 48, 1 / 8, 1 / 4)
    assert power[~inside].sum() < 1e-9 * power.sum()
    assert torch.equal(delta, B.band_limited_noise((1, 4, 32, 48), 1 / 8, 1 / 4, 0.1, seed=3))
    with pytest.raises(FlowliftError, match="no frequency"):
        B.band_limited_noise((1, 1, 4, 4), 0.01, 0.02, 0.1)


def test_pixel_band_fractions_of_pure_tones():
    n = 256
    y, x = np.mgrid[0:n, 0:n]
    # a cosine at 3/256 cycles/px = 3/256 * 16 = 0.1875 latent Nyquists -> band 1/8-1/4
    tone = np.cos(2 * np.pi * 3 * x / n)
    frac = B.pixel_band_fractions(tone, FACTOR)
    assert frac[2] == pytest.approx(100.0) and frac.sum() == pytest.approx(100.0)
    # 40/256 cycles/px = 2.5 latent Nyquists -> finer than the latent Nyquist
    fine = np.cos(2 * np.pi * 40 * y / n)
    assert B.pixel_band_fractions(fine, FACTOR)[-1] == pytest.approx(100.0)
    # a constant lands in the lowest band; zeros give zeros
    assert B.pixel_band_fractions(np.ones((16, 16)), FACTOR)[0] == pytest.approx(100.0)
    assert B.pixel_band_fractions(np.zeros((16, 16)), FACTOR).sum() == 0


def test_ideal_decoder_maps_every_band_to_itself():
    z = torch.randn(1, 4, 32, 32, generator=torch.Generator().manual_seed(0))
    m = B.band_response(ideal_decoder, z, FACTOR)
    assert m.shape == (5, 6)
    np.testing.assert_allclose(m.sum(axis=1), 100.0, atol=1e-6)
    assert np.all(np.diag(m) > 99.0), np.diag(m)
    assert np.all(m[:, -1] < 1.0)


def test_blocky_decoder_leaks_upwards_and_low_band_stays_low():
    z = torch.randn(1, 4, 32, 32, generator=torch.Generator().manual_seed(1))
    m = B.band_response(nearest_decoder, z, FACTOR)
    np.testing.assert_allclose(m.sum(axis=1), 100.0, atol=1e-6)
    # a pure low-band perturbation lands mostly in low pixel bands
    assert m[0, 0] > 85.0 and m[0, :2].sum() > 90.0
    # leakage above the latent Nyquist grows with the latent band (sinc sidelobes of the blocks)
    finer = m[:, -1]
    assert np.all(np.diff(finer) > 0) and finer[-1] > 30.0
    table = B.format_table(m, reference=B.MAGE_REFERENCE, full=True)
    assert table.count("\n") == 6 and "| 0-1/16 | " in table and "87.7%" in table


def test_run_bands_with_a_vae_like_object(tmp_path):
    images = [torch.rand(1, 3, 270, 390), torch.rand(1, 3, 256, 256)]
    mean, per_image = B.run_bands(IdealVAE(), images, seed=5)
    assert len(per_image) == 2 and mean.shape == (5, 6)
    np.testing.assert_allclose(mean, (per_image[0] + per_image[1]) / 2)
    assert np.all(np.diag(mean) > 99.0)
    assert B.heatmap_png(mean, "test")[:8] == b"\x89PNG\r\n\x1a\n"


def _fake_vae_module(monkeypatch, vae_cls):
    import sys
    import types

    module = types.ModuleType("flowlift.models.vae_loading")
    module.ENCODE_DECODE = ("encode", "decode")  # what the job asks of the VAE it loads
    module.load_vae = lambda spec, device="cpu", dtype=torch.float32, needs=(): vae_cls()
    monkeypatch.setitem(sys.modules, "flowlift.models.vae_loading", module)


class IdealVAE:
    spatial_factor = FACTOR

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        pooled = torch.nn.functional.avg_pool2d(images - 0.5, FACTOR)
        return torch.cat([pooled, pooled[:, :1]], dim=1) * 4

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return ideal_decoder(latents)


def test_bands_cli_writes_table_json_heatmap(monkeypatch, shared, tmp_path, capsys):
    import json

    from flowlift.commands.cli import main

    _fake_vae_module(monkeypatch, IdealVAE)
    out = tmp_path / "bands"
    kodak = shared / "images" / "kodak"
    argv = [
        "bands",
        str(kodak / "kodim01.png"),
        str(kodak / "kodim02.png"),
        "--vae",
        "fake",
        "-o",
        str(out),
        "--max-side",
        "256",
        "--no-progress",
        "--full",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| 0-1/16 |" in printed and "Mage: same" in printed and "px > 1" in printed
    assert sorted(p.name for p in out.iterdir()) == ["bands.json", "bands.md", "bands.png"]
    data = json.loads((out / "bands.json").read_text())
    mean = np.array(data["mean_percent"])
    assert mean.shape == (5, 6) and set(data["images"]) == {"kodim01", "kodim02"}
    np.testing.assert_allclose(mean.sum(axis=1), 100.0, atol=1e-6)
    assert np.all(np.diag(mean) > 99.0)
    # user errors: one line, exit 2, nothing written
    bad = tmp_path / "bad"
    for extra, msg in [(["--amplitude", "0"], "amplitude"), (["--max-side", "8"], "max-side")]:
        with pytest.raises(SystemExit, match="2"):  # the knob's parse refuses it (its help says the domain)
            main(["bands", str(kodak / "kodim01.png"), "--vae", "fake", "-o", str(bad), *extra])
        err = capsys.readouterr().err.strip()
        assert msg in err and err.count("\n") == 0
    assert main(["bands", str(tmp_path / "missing.png"), "--vae", "fake", "-o", str(bad)]) == 2
    assert not bad.exists()


def test_taef2_band_response_on_a_real_crop(shared):
    from PIL import Image

    from flowlift.files.images import to_tensor
    from flowlift.models.vae_loading import load_vae

    vae = load_vae(str(shared / "models" / "taef2"), device="cpu", dtype=torch.float32)
    with Image.open(shared / "images" / "kodak" / "kodim23.png") as im:
        image = to_tensor(im.convert("RGB").crop((128, 128, 512, 384)))  # 48x32 latent
    mean, _ = B.run_bands(vae, [image])
    np.testing.assert_allclose(mean.sum(axis=1), 100.0, atol=1e-6)
    inside = mean[:, :5]
    # every latent band lands mostly in its own pixel band among the bands the latent grid can hold
    # (measured 89/81/65/42/23 % on this crop, every other in-grid band < 4 %) ...
    assert np.all(np.argmax(inside, axis=1) == np.arange(5)) and mean[0, 0] > 70.0
    # ... and leaks more detail above the latent Nyquist the higher the band (6.5 -> 76 %)
    assert np.all(np.diff(mean[:, -1]) > 0)


def test_bands_records_bin_counts_and_warns_when_small(monkeypatch, shared, tmp_path, capsys):
    import json

    from flowlift.commands.cli import main

    assert B.latent_bin_counts(32, 20) == [1, 8, 22, 88, 372]  # a 256x160 image: only DC below 1/16
    assert min(B.latent_bin_counts(64, 64)) >= B.MIN_BINS_PER_BAND
    assert B.latent_size(170, 256, 8) == (20, 32)
    _fake_vae_module(monkeypatch, IdealVAE)
    kodak = shared / "images" / "kodak"
    for side, warned in ((256, True), (512, False)):
        out = tmp_path / f"bands{side}"
        options = ["--vae", "fake", "-o", str(out), "--max-side", str(side), "--no-progress"]
        assert main(["bands", str(kodak / "kodim01.png"), *options]) == 0
        err = capsys.readouterr().err
        assert ("warning:" in err and "latent FFT bins" in err) == warned, err
        # --max-side only shrinks: the advice says it shrank them, never to raise the images' size with it
        assert ("--max-side 256 shrinks them below it" in err) == warned and "px (--max-side)" not in err, err
        data = json.loads((out / "bands.json").read_text())
        counts = data["latent_bins_per_band"]["kodim01"]
        assert len(counts) == 5 and (min(counts) < data["min_bins_per_band"]) == warned


def test_a_perturbation_lost_in_the_rounding_is_one_line_and_nothing_is_written(shared, tmp_path, capsys):
    from PIL import Image

    from flowlift.commands.cli import main

    photos = tmp_path / "photos"
    photos.mkdir()
    Image.open(shared / "images" / "kodak" / "kodim01.png").convert("RGB").crop((0, 0, 160, 160)).save(photos / "p.png")
    out = tmp_path / "out"
    argv = ["bands", str(photos), "--vae", str(shared / "models" / "taef2"), "-o", str(out), "--device", "cpu"]
    assert main([*argv, "--amplitude", "1e-12", "--no-progress"]) == 2  # wrote an all-zero table, exit 0
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and err.startswith("flowlift bands: error: latent band 0-1/16"), err
    assert "--amplitude 1e-12 is zero; raise --amplitude" in err, err
    assert not out.exists()


def test_a_response_within_the_decodes_rounding_names_the_dtype_below_float32():
    from flowlift.errors import FlowliftError

    base = np.full((8, 8), 0.5)
    B.check_response(base * 1e-3, base, torch.float32, "0-1/16", 0.1)  # a real response passes
    with pytest.raises(FlowliftError) as lost:
        B.check_response(base * 1e-3, base, torch.bfloat16, "0-1/16", 1e-4)  # a quarter of a bf16 step of 0.5
    assert lost.value.fields == ("amplitude", "amplitude", "dtype")
    assert str(lost.value).endswith("raise amplitude or decode in float32 (dtype float32)"), str(lost.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("amplitude", "0.1"),
        ("amplitude", True),
        ("amplitude", 11.0),
        ("limit", 1.5),
        ("max_side", 100),
        ("output", None),
        ("seed", -1),
        ("seed", "a"),
        ("images", []),
        ("full", "yes"),
        ("device", "bogus"),  # was refused when the run began
        ("dtype", "fp8"),
    ],
)
def test_a_bands_request_checks_every_field_when_it_is_made(field, value):
    from flowlift.errors import FlowliftError
    from flowlift.measure.bands_job import BandsRequest

    fields = {"images": ["photos"], "vae": "taef2", "output": "out", field: value}
    with pytest.raises(FlowliftError) as refused:
        BandsRequest(**fields)
    assert refused.value.field == field and "--" not in str(refused.value), str(refused.value)
    assert BandsRequest(images="a folder", vae="taef2", output="out").images == ("a folder",)  # one path, not letters


def test_a_bfloat16_response_of_a_few_rounding_steps_is_measured_not_refused():
    """TAEF2's band 1/4-1/2 in bfloat16 at the default amplitude responds with ~0.0095 RMS on a Kodak luma of ~0.45
    (2.7 bf16 steps), and its row is within 0.7 points of float32's: a measurement, not rounding."""
    base = np.full((8, 8), 0.45)
    B.check_response(np.full((8, 8), 0.0095), base, torch.bfloat16, "1/4-1/2", 0.1)


def test_a_mostly_black_or_white_image_is_warned_about_and_its_share_recorded(monkeypatch, shared, tmp_path, capsys):
    """TAEF2's decode saturates at black and white: the top latent band of a white image came back 65 % in the
    lowest pixel band (kodim01: 0.0 %), a row about saturation, not detail. The command says so (one warning line)
    and ``bands.json`` keeps every image's share of such pixels."""
    import json

    from PIL import Image

    from flowlift.commands.cli import main

    pixels = np.full((8, 8, 3), 128, np.uint8)
    pixels[:2] = 255
    pixels[2, :4] = (0, 2, 3)
    pixels[3, :4] = (0, 4, 0)  # 4 levels from black in one channel: not saturated
    assert B.saturated_share(pixels) == (16 + 4) / 64
    _fake_vae_module(monkeypatch, IdealVAE)
    white = tmp_path / "white.png"
    Image.new("RGB", (512, 512), (255, 255, 254)).save(white)
    kodim01 = shared / "images" / "kodak" / "kodim01.png"
    options = ["--vae", "fake", "--max-side", "512", "--no-progress", "-o"]
    assert main(["bands", str(kodim01), str(white), *options, str(tmp_path / "both")]) == 0
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "warning: 1 image(s) with 25% or more of their pixels black or white" in err
    assert "(e.g. white: 100%)" in err and "lowest pixel band" in err, err
    shares = json.loads((tmp_path / "both" / "bands.json").read_text())["saturated_share"]
    assert shares["white"] == 1.0 and shares["kodim01"] < B.MAX_SATURATED_SHARE
    assert main(["bands", str(kodim01), *options, str(tmp_path / "kodak")]) == 0
    assert "black or white" not in capsys.readouterr().err
