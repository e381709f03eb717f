"""Files flowlift did not write are one line, never a traceback (issue 36, class 8): JSON nested past any bound in a
safetensors header, a manifest line, a dataset manifest, a training config, a model config or an image's metadata
(``RecursionError`` from ``json.loads``), and damaged multi-frame images (a truncated GIF or TIFF fails while
Pillow counts its frames with IndexError or TypeError). LoRA adapter configs are in tests/test_lora_fit.py.
"""

from __future__ import annotations

import io
import json
import struct

import numpy as np
import pytest
from PIL import Image, PngImagePlugin

from flowlift.errors import FlowliftError
from flowlift.files.json_input import MAX_JSON_DEPTH, nesting_depth, parse_json

#: Nested JSON texts: past the bound, past Python's recursion limit, far past it; lists, objects and both.
DEEP_TEXTS = {
    "list-65": "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1),
    "object-65": '{"a":' * (MAX_JSON_DEPTH + 1) + "1" + "}" * (MAX_JSON_DEPTH + 1),
    "list-5000": "[" * 5000 + "]" * 5000,
    "mixed-100000": '[{"a":' * 50_000 + "0" + "}]" * 50_000,
    "unclosed-200000": "[" * 200_000,
}


def _deep_object(text: str) -> str:
    """A JSON object whose one entry holds the nested ``text`` (where a reader expects an object)."""
    return '{"weight_map": ' + text + ', "x": 1}'


# ------------------------------------------------------------------------------------------------ the parser


def test_nesting_depth_counts_levels_without_recursion():
    assert [nesting_depth(v) for v in (1, "x", [], {}, [1, [2]], {"a": [{"b": []}]})] == [0, 0, 1, 1, 2, 4]
    value: list = []
    for _ in range(100_000):  # deeper than any recursion limit
        value = [value]
    assert nesting_depth(value) == 100_001


@pytest.mark.parametrize("name", sorted(DEEP_TEXTS))
def test_parse_json_refuses_deep_nesting_with_a_value_error(name):
    with pytest.raises(ValueError, match="nested more than 64 levels deep|Expecting"):
        parse_json(DEEP_TEXTS[name])
    with pytest.raises(ValueError):
        parse_json(DEEP_TEXTS[name].encode())


def test_parse_json_takes_what_flowlift_reads():
    deepest = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert nesting_depth(parse_json(deepest)) == MAX_JSON_DEPTH
    assert parse_json(b'{"a": {"dtype": "F32", "shape": [1, 2], "data_offsets": [0, 8]}}')["a"]["shape"] == [1, 2]
    assert parse_json("5") == 5


# ------------------------------------------------------------------------------------------------ readers


def _safetensors(path, header_text: str):
    data = header_text.encode()
    path.write_bytes(struct.pack("<Q", len(data)) + data)
    return path


@pytest.mark.parametrize("name", sorted(DEEP_TEXTS))
def test_a_deep_safetensors_header_is_one_line(tmp_path, name):
    from flowlift.models.safetensors_headers import read_header

    for index, text in enumerate((DEEP_TEXTS[name], _deep_object(DEEP_TEXTS[name]))):
        path = _safetensors(tmp_path / f"{index}.safetensors", text)
        with pytest.raises(FlowliftError) as caught:
            read_header(path, what=f"--transformer {path}")
        message = str(caught.value)
        assert message.startswith(f"--transformer {path}: not a readable safetensors file") and "\n" not in message


def test_deep_manifest_lines_are_skipped_like_torn_ones(tmp_path):
    from flowlift.jobs.manifest import MANIFEST_NAME, Manifest

    good = [{"event": "job", "run": "r1"}, {"event": "summary", "run": "r1"}]
    lines = [
        json.dumps(good[0]),
        *DEEP_TEXTS.values(),
        '{"event": ' + DEEP_TEXTS["list-5000"] + "}",
        json.dumps(good[1]),
    ]
    (tmp_path / MANIFEST_NAME).write_text("\n".join(lines) + "\n")
    assert Manifest(tmp_path).records() == good


@pytest.mark.parametrize("name", ["list-5000", "mixed-100000", "object-65"])
def test_deep_dataset_and_training_config_files_are_one_line(tmp_path, name):
    from flowlift.training.config import load_config_file
    from flowlift.training.shards import read_manifest

    (tmp_path / "dataset.json").write_text(_deep_object(DEEP_TEXTS[name]))
    with pytest.raises(FlowliftError, match=r"^cannot read .*dataset\.json: .*nested"):
        read_manifest(tmp_path)
    config = tmp_path / "train.json"
    config.write_text(_deep_object(DEEP_TEXTS[name]))
    with pytest.raises(FlowliftError, match=r"^cannot parse config .*train\.json: .*nested"):
        load_config_file(config)


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 5000])
def test_a_deep_toml_training_config_is_one_line(tmp_path, depth):
    from flowlift.training.config import load_config_file

    config = tmp_path / "train.toml"
    config.write_text("lr = " + "[" * depth + "]" * depth + "\n")
    with pytest.raises(FlowliftError, match=r"^cannot parse config .*train\.toml: ") as caught:
        load_config_file(config)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("name", ["list-5000", "mixed-100000"])
def test_deep_model_configs_are_one_line(tmp_path, name):
    from flowlift.models.flux2_transformer_folders import inspect_transformer_folder
    from flowlift.models.vae_loading import _read_config

    (tmp_path / "config.json").write_text(_deep_object(DEEP_TEXTS[name]))
    with pytest.raises(FlowliftError, match=r"config\.json is not readable JSON \(JSON nested"):
        inspect_transformer_folder(tmp_path)
    with pytest.raises(FlowliftError, match=r"^VAE: cannot read .*nested"):
        _read_config(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "diffusion_pytorch_model.safetensors.index.json").write_text(_deep_object(DEEP_TEXTS[name]))
    with pytest.raises(FlowliftError, match=r"is not a readable shard index"):
        inspect_transformer_folder(tmp_path)


@pytest.mark.parametrize("name", ["list-5000", "mixed-100000"])
def test_deep_json_in_an_images_metadata_claims_nothing(tmp_path, name):
    from flowlift.files.image_outputs import inspect_existing, read_metadata

    info = PngImagePlugin.PngInfo()
    info.add_text("flowlift", _deep_object(DEEP_TEXTS[name]))
    info.add_text("Software", DEEP_TEXTS[name])
    path = tmp_path / "theirs.png"
    Image.new("RGB", (8, 8)).save(path, pnginfo=info)
    metadata = read_metadata(path)
    assert isinstance(metadata["flowlift"], str) and isinstance(metadata["Software"], str)  # kept as text
    found = inspect_existing(path)
    assert found.image and found.complete


# ------------------------------------------------------------------------------------------------ images


def _frames(count: int = 3) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, (24, 32, 3), dtype=np.uint8)) for _ in range(count)]


def _multi_frame(format_name: str) -> bytes:
    first, *rest = _frames()
    buffer = io.BytesIO()
    first.save(buffer, format_name, save_all=True, append_images=rest)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("format_name", "suffix"), [("GIF", ".gif"), ("TIFF", ".tif"), ("PNG", ".png"), ("WEBP", ".webp")]
)
def test_truncated_multi_frame_images_are_one_line_at_every_cut(tmp_path, format_name, suffix):
    from flowlift.files.images import image_size, load_image

    data = _multi_frame(format_name)
    step = max(1, len(data) // 120)
    for cut in range(1, len(data), step):
        path = tmp_path / f"cut{cut}{suffix}"
        path.write_bytes(data[:cut])
        for read in (load_image, image_size):
            try:
                read(path)
            except FlowliftError as error:
                assert str(error).startswith(str(path)) and "\n" not in str(error), (cut, str(error))
        path.unlink()


def _frame_count_fails(data: bytes) -> bool:
    try:
        with Image.open(io.BytesIO(data)) as opened:
            opened.n_frames  # noqa: B018 - Pillow counts by seeking through the file
    except (IndexError, TypeError, struct.error, OSError, EOFError, SyntaxError, ValueError):
        return True
    return False


@pytest.mark.parametrize("format_name", ["GIF", "TIFF"])
def test_a_file_cut_in_a_later_frame_is_refused_as_truncated(tmp_path, format_name):
    """The quoted case and its TIFF sibling: the file opens, Pillow's frame count fails in a later frame
    (IndexError for a GIF, TypeError "Missing dimensions" for a TIFF page)."""
    from flowlift.files.images import load_image

    data = _multi_frame(format_name)
    cuts = [cut for cut in range(len(data) // 3, len(data), 7) if _frame_count_fails(data[:cut])]
    assert cuts, "no cut makes Pillow's frame count fail: the case is not reproduced"
    for cut in cuts:
        path = tmp_path / f"cut{cut}.{format_name.lower()}"
        path.write_bytes(data[:cut])
        with pytest.raises(FlowliftError) as caught:
            load_image(path)
        message = str(caught.value)
        assert message.startswith(f"{path}: unreadable or truncated image (") and "\n" not in message


@pytest.mark.parametrize("name", ["list-5000", "mixed-100000", "unclosed-200000"])
def test_deep_json_at_a_training_runs_file_names_is_not_flowlifts(tmp_path, name):
    """The recognisers of a run's files (issue 36 class 1's replace rule) read a user's file at those names."""
    from flowlift.training.run_files import is_run_config, is_upscaler_weights

    (tmp_path / "config.json").write_text(_deep_object(DEEP_TEXTS[name]))
    assert is_run_config(tmp_path / "config.json") is False
    weights = _safetensors(tmp_path / "flow_upscaler.safetensors", DEEP_TEXTS[name])
    assert is_upscaler_weights(weights) is False
