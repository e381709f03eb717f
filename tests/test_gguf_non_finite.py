"""A GGUF transformer whose quantized blocks hold a NaN or Inf scale is refused at load in one line naming the file
and the tensor, as every other weight format is (its uint8 blocks passed the float check unread, and every image
came out NaN). The scales are found by ggml's block layouts, checked here against gguf-py's own dequantizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from flowlift.errors import FlowliftError

gguf = pytest.importorskip("gguf")

from flowlift.models.gguf_checks import FP16_SCALE_OFFSETS, quantized_non_finite  # noqa: E402

NON_FINITE = {"NaN": np.float16(np.nan), "Inf": np.float16(np.inf)}


def _blocks(name: str, scale: float = 0.5) -> np.ndarray:
    """Two rows of three ``name`` blocks: every byte 0xFF (a float16 NaN wherever a scale the table misses sits),
    then the table's scales set to ``scale``."""
    _, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    data = np.full((2, 3 * type_size), 0xFF, np.uint8)
    for offset in FP16_SCALE_OFFSETS[name]:
        data.reshape(-1, type_size)[:, offset : offset + 2] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
    return data


def test_every_quantized_type_diffusers_reads_has_its_scales_listed():
    from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES

    assert {t.name for t in SUPPORTED_GGUF_QUANT_TYPES} - {"BF16"} <= set(FP16_SCALE_OFFSETS)


@pytest.mark.parametrize("name", sorted(FP16_SCALE_OFFSETS))
def test_the_scale_offsets_are_the_block_layouts(name):
    """With the listed scales finite, gguf-py dequantizes the blocks to finite values (no scale is missed); a NaN
    or Inf in any listed scale of any block makes gguf-py's values non-finite and is found, named by its kind."""
    from gguf.quants import dequantize

    qtype = gguf.GGMLQuantizationType[name]
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    data = _blocks(name)
    assert np.isfinite(dequantize(data, qtype)).all()
    assert quantized_non_finite(torch.from_numpy(data), qtype) is None
    for offset in FP16_SCALE_OFFSETS[name]:
        for kind, value in NON_FINITE.items():
            bad = data.copy()
            bad.reshape(-1, type_size)[4, offset : offset + 2] = np.frombuffer(value.tobytes(), np.uint8)
            assert not np.isfinite(dequantize(bad, qtype)).all()
            assert quantized_non_finite(torch.from_numpy(bad), qtype) == kind


def test_bf16_tensors_are_checked_on_every_value():
    values = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert quantized_non_finite(values.view(torch.uint8), gguf.GGMLQuantizationType.BF16) is None
    values[2, 5] = float("-inf")
    assert quantized_non_finite(values.view(torch.uint8), gguf.GGMLQuantizationType.BF16) == "Inf"


def test_a_type_without_a_listed_layout_is_dequantized_in_chunks(monkeypatch):
    from flowlift.models import gguf_checks

    good = _blocks("Q8_0")
    monkeypatch.delitem(gguf_checks.FP16_SCALE_OFFSETS, "Q8_0")
    monkeypatch.setattr(gguf_checks, "_CHUNK_BLOCKS", 2)  # the bad block is in the third chunk
    assert quantized_non_finite(torch.from_numpy(good), gguf.GGMLQuantizationType.Q8_0) is None
    good.reshape(-1, 34)[5, 0:2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
    assert quantized_non_finite(torch.from_numpy(good), gguf.GGMLQuantizationType.Q8_0) == "NaN"


# ------------------------------------------------------------------------------------- a GGUF transformer file


@pytest.fixture
def never_built(monkeypatch):
    """diffusers must not build a model from a file whose weights are refused."""
    import diffusers

    def built(*args, **kwargs):
        raise AssertionError("diffusers built the model from non-finite weights")

    monkeypatch.setattr(diffusers.Flux2Transformer2DModel, "from_single_file", built)


def _poisoned_gguf(path: Path, kind: str, value: np.float16, scale: int) -> str:
    """A tiny FLUX.2 transformer GGUF whose first ``kind`` tensor holds ``value`` in scale ``scale`` (0: ``d``, 1:
    ``dmin``) of its second block; returns that tensor's name."""
    from flux2_files import write_gguf
    from tiny_flux2 import tiny_transformer

    wide = {"text_dim": 256, "attention_head_dim": 128, "timestep_guidance_channels": 256}  # rows for Q4_K's blocks
    write_gguf(tiny_transformer(**(wide | {"axes_dims_rope": (32, 32, 32, 32)} if kind == "Q4_K" else {})), path, kind)
    reader = gguf.GGUFReader(str(path), "r+")
    tensor = next(t for t in reader.tensors if t.tensor_type.name == kind)
    _, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    offset = FP16_SCALE_OFFSETS[kind][scale]
    tensor.data.reshape(-1, type_size)[1, offset : offset + 2] = np.frombuffer(value.tobytes(), np.uint8)
    reader.data.flush()
    return tensor.name


@pytest.mark.parametrize(
    "kind, scale, value", [("Q8_0", 0, "NaN"), ("Q8_0", 0, "Inf"), ("Q4_K", 0, "NaN"), ("Q4_K", 1, "Inf")]
)
def test_a_gguf_with_a_non_finite_block_scale_is_one_line(tmp_path, never_built, kind, scale, value):
    from flowlift.refine.loading import load_transformer

    path = tmp_path / f"flux-2-tiny-{kind}.gguf"
    name = _poisoned_gguf(path, kind, NON_FINITE[value], scale)
    with pytest.raises(FlowliftError) as caught:
        load_transformer(str(path), dtype=torch.float32, option="--transformer")
    text = str(caught.value)
    assert text.startswith(f"--transformer {path}: its weights contain {value} in `{name}`"), text
    assert "\n" not in text


def test_a_finite_gguf_still_loads(tmp_path):
    from flowlift.refine.loading import load_transformer
    from flux2_files import write_gguf
    from tiny_flux2 import tiny_transformer

    write_gguf(tiny_transformer(), tmp_path / "flux-2-tiny-Q8_0.gguf", "Q8_0")
    assert load_transformer(str(tmp_path / "flux-2-tiny-Q8_0.gguf"), dtype=torch.float32) is not None
