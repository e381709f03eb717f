"""Run inside the ComfyUI venv (spandrel + torchvision) by tests/test_spandrel_eval.py; prints one JSON line.

    python tests/spandrel_check.py OUT_DIR PHOTO...

1. makes a randomly initialised small ESRGAN (spandrel's RRDBNet architecture, 4x, seed 0) and saves
   its state dict as OUT_DIR/esrgan.safetensors and OUT_DIR/esrgan.pth;
2. ``direct``: protocol A of the model's own output (spandrel called directly, no flowlift tiling)
   on each photo's eval low-res input;
3. ``tiling``: max |tiled - untiled| of flowlift's tiled inference (the .pth file, read with
   weights_only) on a random 56x72 image in 40 px tiles, for overlaps 2 and 16 input pixels.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def make(out_dir: Path) -> dict:
    from safetensors.torch import save_file
    from spandrel.architectures.ESRGAN import ESRGAN

    torch.manual_seed(0)
    model = ESRGAN(in_nc=3, out_nc=3, num_filters=8, num_blocks=1, scale=4)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, out_dir / "esrgan.safetensors")
    torch.save(state, out_dir / "esrgan.pth")
    return {"tensors": len(state), "parameters": sum(v.numel() for v in state.values())}


def direct(model_path: str, photos: list[str]) -> dict:
    import spandrel

    from flowlift.files.images import tensor_to_uint8, to_tensor
    from flowlift.measure.inputs import load_rgb, prepare_pair
    from flowlift.measure.metrics import drift_at_input_scale
    from flowlift.measure.pixel_upscaler import read_model_state

    state = spandrel.canonicalize_state_dict(read_model_state(model_path))
    descriptor = spandrel.ModelLoader().load_from_state_dict(state).eval()
    result = {}
    for photo in photos:
        _gt, low = prepare_pair(load_rgb(Path(photo)), descriptor.scale)
        with torch.no_grad():
            out = tensor_to_uint8(descriptor(to_tensor(low)))[0]
        result[Path(photo).stem] = drift_at_input_scale(out, low)
    return result


def tiling(model_path: str, height: int, width: int, tile: int, overlaps: list[int]) -> dict:
    from flowlift.measure.pixel_upscaler import load_pixel_upscaler

    torch.manual_seed(1)
    image = torch.rand(1, 3, height, width)
    untiled = load_pixel_upscaler(model_path, tile=None).upscale_tensor(image)
    result = {"untiled_shape": list(untiled.shape)}
    for overlap in overlaps:
        model = load_pixel_upscaler(model_path, tile=tile, overlap=overlap)
        tiled = model.upscale_tensor(image)
        result[str(overlap)] = float((tiled - untiled).abs().max())
    return result


def main() -> None:
    torch.set_num_threads(1)
    out_dir, photos = Path(sys.argv[1]), sys.argv[2:]
    result = {"model": make(out_dir)}
    result["direct"] = direct(str(out_dir / "esrgan.safetensors"), photos)
    result["tiling"] = tiling(str(out_dir / "esrgan.pth"), 56, 72, 40, [2, 16])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
