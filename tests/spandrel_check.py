"""Run inside the ComfyUI venv (spandrel + torchvision) by tests/test_spandrel_eval.py; prints one JSON line.

    python tests/spandrel_check.py OUT_DIR PHOTO...
    python tests/spandrel_check.py --bad-files OUT_DIR PHOTO_DIR

1. makes a randomly initialised small ESRGAN (spandrel's RRDBNet architecture, 4x, seed 0) and saves
   its state dict as OUT_DIR/esrgan.safetensors and OUT_DIR/esrgan.pth;
2. ``direct``: protocol A of the model's own output (spandrel called directly, no flowlift tiling)
   on each photo's eval low-res input;
3. ``tiling``: max |tiled - untiled| of flowlift's tiled inference (the .pth file, read with
   weights_only) on a random 56x72 image in 40 px tiles, for overlaps 2 and 16 input pixels.

``--bad-files``: writes model files that spandrel loads but that cannot give a right result (the
ESRGAN cast to int8, one NaN in it, an SCUNet whose dim 16 is below its head size 32) and runs
``flowlift eval --run spandrel:FILE`` on PHOTO_DIR for each through the CLI's ``main`` (auto tiles,
whose probe runs the model at load, and ``--tile none``, which first runs it on a photo): per case
the exit status, the stderr lines and whether anything escaped ``main``.
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


def bad_files(out_dir: Path, photo_dir: str) -> dict:
    import contextlib
    import io

    from safetensors.torch import save_file
    from spandrel.architectures.ESRGAN import ESRGAN
    from spandrel.architectures.SCUNet import SCUNet

    from flowlift.commands.cli import main

    torch.manual_seed(0)
    esrgan = {k: v.contiguous() for k, v in ESRGAN(in_nc=3, out_nc=3, num_filters=8, num_blocks=1).state_dict().items()}
    poisoned = dict(esrgan)
    name = sorted(poisoned)[3]
    poisoned[name] = poisoned[name].clone()
    poisoned[name].view(-1)[5] = float("nan")
    scunet = SCUNet(in_nc=3, config=[1, 1, 1, 1, 1, 1, 1], dim=16).state_dict()  # 16 < head_dim 32
    files = {
        "int8": {k: (v * 100).round().to(torch.int8) for k, v in esrgan.items()},
        "nan": poisoned,
        "scunet": {k: v.contiguous() for k, v in scunet.items()},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"poisoned": name}
    for case, tile in (("int8", "auto"), ("nan", "auto"), ("scunet", "auto"), ("scunet", "none")):
        path = out_dir / f"{case}.safetensors"
        save_file(files[case], path)
        args = [
            "eval",
            "--run",
            f"spandrel:{path}:bad",
            "--dataset",
            photo_dir,
            "--scale",
            "4",
            "-o",
            str(out_dir / f"report-{case}-{tile}"),
            "--tile",
            tile,
            "--no-progress",
        ]
        err = io.StringIO()
        escaped = None
        with contextlib.redirect_stderr(err):
            try:
                code = main(args)
            except BaseException as error:  # noqa: BLE001 - what escapes main would be a traceback
                code, escaped = None, f"{type(error).__name__}: {error}"
        report = (out_dir / f"report-{case}-{tile}" / "results.json").exists()
        result[f"{case}-{tile}"] = {
            "code": code,
            "err": err.getvalue().splitlines(),
            "escaped": escaped,
            "report": report,
            "path": str(path),
        }
    return result


def main() -> None:
    torch.set_num_threads(1)
    if sys.argv[1] == "--bad-files":
        print(json.dumps(bad_files(Path(sys.argv[2]), sys.argv[3])))
        return
    out_dir, photos = Path(sys.argv[1]), sys.argv[2:]
    result = {"model": make(out_dir)}
    result["direct"] = direct(str(out_dir / "esrgan.safetensors"), photos)
    result["tiling"] = tiling(str(out_dir / "esrgan.pth"), 56, 72, 40, [2, 16])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
