"""The tests' shared builders: the tiny Flow Upscaler, a hub cache laid out by hand, the kinds of thing a
user may have left at an output's name. (Tiny FLUX.2 transformers and VAEs: tests/tiny_flux2.py; random
Mage-VAE checkpoints: tests/mage_files.py.)"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: The tiny Flow Upscaler most tests run: a few MB, a few ms a step on a CPU.
TINY_UNET = {"base_channels": 32, "time_dim": 32, "cond_dim": 64}


def tiny_unet(seed: int | None = None, **config):
    """A tiny :class:`~flowlift.models.upscaler_unet.FlowUpscalerUNet` (:data:`TINY_UNET`, ``config`` on top),
    dropout off, in eval mode; ``seed`` seeds torch's global generator first (None: as it stands)."""
    from flowlift.models.upscaler_unet import FlowUpscalerUNet

    if seed is not None:
        torch.manual_seed(seed)
    return FlowUpscalerUNet(**{**TINY_UNET, "dropout": 0.0, **config}).eval()


def save_tiny_unet(path: Path, seed: int | None = 0, **config) -> Path:
    """:func:`tiny_unet` saved as a Flow Upscaler weights file at ``path`` (the same bytes for the same seed)."""
    from flowlift.models.upscaler_weights import save_upscaler

    return save_upscaler(tiny_unet(seed, **config), path)


def fake_hub_cache(cache: Path, repo_id: str, files: dict[str, bytes | Path]) -> None:
    """Lay out ``files`` (name in the repository -> its bytes, or a file here to copy) as huggingface_hub's
    cache holds a downloaded snapshot of ``repo_id`` (:func:`as_hub_blobs`)."""
    commit = "0" * 40
    repo_dir = cache / f"models--{repo_id.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    for name, data in files.items():
        target = repo_dir / "snapshots" / commit / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data.read_bytes() if isinstance(data, Path) else data)
    as_hub_blobs(repo_dir)


def run_offline_with_hub_cache(script: str, cache: Path) -> list[str]:
    """Run ``script`` in a fresh interpreter on this checkout's flowlift (not an installed one), offline, with
    ``cache`` as the Hugging Face cache; return its output lines (its stderr in the failure when it fails)."""
    import subprocess
    import sys

    src = str(Path(__file__).resolve().parents[1] / "src")
    path = os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


#: Files the hub stores with git LFS (its default ``.gitattributes``), whose cache blobs are named by SHA-256.
LFS_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".ckpt")


def as_hub_blobs(repo_dir: Path) -> None:
    """Move every file of ``repo_dir``'s snapshots into ``blobs/`` and link it back, as huggingface_hub's cache
    does: an LFS file's blob is named by the SHA-256 of its content, any other by its git blob hash."""
    import hashlib

    blobs = repo_dir / "blobs"
    blobs.mkdir(exist_ok=True)
    for file in sorted(p for p in (repo_dir / "snapshots").rglob("*") if p.is_file() and not p.is_symlink()):
        data = file.read_bytes()
        if file.suffix in LFS_SUFFIXES:
            etag = hashlib.sha256(data).hexdigest()
        else:
            etag = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        if not (blobs / etag).exists():
            file.rename(blobs / etag)
        else:
            file.unlink()
        file.symlink_to(os.path.relpath(blobs / etag, file.parent))


#: What :func:`put_kind` can leave at a name, and the words of flowlift's refusal of it.
KIND_WORDS = {
    "link": "is a symbolic link",
    "dangling link": "is a symbolic link",
    "fifo": "is a FIFO",
    "folder": "is a folder",
    "foreign file": "was not written by flowlift",
    "empty file": None,  # flowlift replaces an empty file
    "own file": None,  # a copy of a file flowlift wrote
}


def put_kind(path: Path, kind: str, victim: Path, own: Path | None = None) -> str | None:
    """Put ``kind`` (a key of :data:`KIND_WORDS`) at ``path``: a link to ``victim`` (the user's file), a
    dangling link, a FIFO, a folder with a file of the user's, the user's own notes, an empty file, or a copy
    of ``own``. Returns the words of the refusal, or None when the command goes on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "link":
        path.symlink_to(victim)
    elif kind == "dangling link":
        path.symlink_to(victim.parent / "nowhere.txt")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
        (path / "inside.txt").write_text("the user's")
    elif kind == "foreign file":
        path.write_bytes(b"the user's own notes\n")
    elif kind == "empty file":
        path.write_bytes(b"")
    elif kind == "own file" and own is not None:
        shutil.copyfile(own, path)
    else:
        raise ValueError(f"put_kind: no kind {kind!r} (or no own file to copy)")
    return KIND_WORDS[kind]


def snapshot(folder: Path) -> dict[str, object]:
    """Every entry below ``folder``: a regular file's bytes, anything else's mode (links are not followed)."""
    found = {}
    for entry in sorted(folder.rglob("*")):
        info = os.lstat(entry)
        found[str(entry.relative_to(folder))] = entry.read_bytes() if stat.S_ISREG(info.st_mode) else info.st_mode
    return found


def resized_photo(source: Path, path: Path, size: tuple[int, int] = (48, 32)) -> Path:
    """``source`` as RGB, box-resized to ``size`` (width, height), saved at ``path``."""
    from PIL import Image

    with Image.open(source) as image:
        image.convert("RGB").resize(size, Image.Resampling.BOX).save(path)
    return path


def kodak_crops(shared: Path, folder: Path, names=("kodim03", "kodim07", "kodim23"), box=(300, 200, 436, 304)) -> Path:
    """The ``box`` crop of each named Kodak image of ``shared``, saved as ``folder/<name>.png``; ``folder``."""
    from PIL import Image

    for name in names:
        with Image.open(shared / "images" / "kodak" / f"{name}.png") as image:
            image.convert("RGB").crop(box).save(folder / f"{name}.png")
    return folder


def refine_inputs(folder: Path, name: str, size: tuple[int, int], seed: int) -> Path:
    """``folder`` with ``prompt.safetensors`` (the tiny FLUX.2's ``prompt_embeds``) and ``name``: a random RGB
    image of ``size`` (height, width) drawn from ``seed``."""
    from PIL import Image
    from safetensors.torch import save_file

    from tiny_flux2 import prompt_embeds

    save_file({"prompt_embeds": prompt_embeds()}, str(folder / "prompt.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    array = (torch.rand(*size, 3, generator=generator) * 255).to(torch.uint8).numpy()
    Image.fromarray(array, "RGB").save(folder / name)
    return folder


def command_line(*words: object, **options: object) -> list[str]:
    """A command line as strings: ``words`` as they stand, then each option as ``--its-name value`` (``_`` in a
    name becomes ``-``; a one-letter name is ``-o``); True is the bare flag, None or False leaves it out."""
    line = [str(word) for word in words]
    for name, value in options.items():
        if value is None or value is False:
            continue
        line.append(f"-{name}" if len(name) == 1 else f"--{name.replace('_', '-')}")
        if value is not True:
            line.append(str(value))
    return line


def one_error_line(stderr: str, command: str) -> str:
    """The one ``flowlift <command>: error:`` line of ``stderr``, which must hold exactly one and no traceback."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith(f"flowlift {command}: error:")]
    assert len(lines) == 1, stderr
    return lines[0]


def transformer_forward(model, *, text_dim: int, seed: int = 0, guidance: bool = False) -> torch.Tensor:
    """One no-grad call of a tiny FLUX.2 transformer on seeded random tokens: a 4x6 image grid (128 channels), 5
    text tokens of ``text_dim``, timestep 0.6, guidance 4 when ``guidance``; its output."""
    g = torch.Generator().manual_seed(seed)
    img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(4), torch.arange(6), torch.arange(1))[None]
    txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(5))[None]
    with torch.no_grad():
        return model(
            hidden_states=torch.randn(1, 24, 128, generator=g),
            encoder_hidden_states=torch.randn(1, 5, text_dim, generator=g),
            timestep=torch.tensor([0.6]),
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=torch.tensor([4.0]) if guidance else None,
            return_dict=False,
        )[0]


def forbid_call(monkeypatch, target: str, message: str) -> None:
    """Make ``target`` (a dotted ``module.attribute``) raise ``AssertionError(message)`` if anything calls it."""

    def forbidden(*args, **kwargs):
        raise AssertionError(message)

    monkeypatch.setattr(target, forbidden)


class Allocations(TorchDispatchMode):
    """Records the bytes of every tensor an op allocates (outputs whose storage is not an input's: a view of an
    input is no allocation)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves
        inputs = {t.untyped_storage().data_ptr() for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.sizes.append(t.untyped_storage().nbytes())
        return out


def prompt_embeds_file(folder: Path, name: str = "e.safetensors") -> Path:
    """A prompt embeddings file of a batch of 1 in ``folder`` (the refine commands' plan reads it, before any model
    loads: a placeholder of a few bytes is refused there)."""
    from safetensors.torch import save_file

    from tiny_flux2 import prompt_embeds

    path = Path(folder) / name
    save_file({"prompt_embeds": prompt_embeds()}, str(path))
    return path
