"""What flowlift tells a user about the Hugging Face hub: download advice, path-versus-repo-id, reachability.

* :func:`download_command` names the command that exists for the installed huggingface_hub
  (``hf download`` from 0.34 on, ``huggingface-cli download`` before), with plain file names.
* :func:`download_hint` is the one sentence every "not in the cache" error ends with: that command and
  where the file goes (the hub cache folder), so a user can act on it without reading docs.
* :func:`access_hint` is what a gated repository (or a token without access) gets instead: accept the licence on
  the model's page, log in, run again (``hf download`` would be refused the same way).
* :func:`looks_like_path` tells a mistyped local path (``models/fu.safetensors``) from a hub id
  (``owner/name``), so a missing file is reported as "no such file" instead of a hub lookup.
* :func:`hub_offline_reason` says whether hub lookups must stay in the local cache: ``HF_HUB_OFFLINE``,
  or one quick request to the endpoint that gets no answer. Without it, a machine without network
  waits ~25 s per file while huggingface_hub retries its connection with back-off, then fails anyway.
* :func:`weight_file_sha256` is a weight file's SHA-256 for an output's provenance; for a hub-cached file
  :func:`cached_blob_sha256` reads it from the name the cache stores it under, without reading the file.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Sequence

#: Suffixes of files flowlift reads; a hub *repository* id never ends in one of them.
FILE_SUFFIXES = (
    ".safetensors",
    ".pth",
    ".pt",
    ".bin",
    ".ckpt",
    ".json",
    ".toml",
    ".txt",
    ".png",
    ".jpg",
    ".jpeg",
    ".webp",
    ".bmp",
    ".tif",
    ".tiff",
    ".gif",
    ".avif",
)
#: huggingface_hub release that ships the ``hf`` command (``huggingface-cli`` was removed in 1.0).
HF_CLI_VERSION = (0, 34)


def _hub_version() -> tuple[int, ...]:
    from huggingface_hub import __version__

    numbers = []
    for part in __version__.split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        numbers.append(int(digits or 0))
    return tuple(numbers)


def download_command(repo_id: str, filenames: Sequence[str] = (), *, include: str | None = None) -> str:
    """The shell command that downloads ``filenames`` (or the whole repo) of ``repo_id`` into the cache."""
    tool = "hf download" if _hub_version() >= HF_CLI_VERSION else "huggingface-cli download"
    parts = [tool, repo_id, *filenames]
    if include:
        parts.append(f"--include '{include}'")
    return " ".join(parts)


def cache_folder() -> str:
    """The hub cache folder downloads go to (``HF_HUB_CACHE`` / ``HF_HOME`` honoured)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def download_hint(repo_id: str, filenames: Sequence[str] = (), *, include: str | None = None) -> str:
    """``download it once with `CMD` (it goes to CACHE)``: the tail of every missing-weights error."""
    return f"download it once with `{download_command(repo_id, filenames, include=include)}` (into {cache_folder()})"


def login_command() -> str:
    """The shell command that logs in to the hub for the installed huggingface_hub."""
    return "hf auth login" if _hub_version() >= HF_CLI_VERSION else "huggingface-cli login"


def _refused_access(error: BaseException) -> bool:
    """True for huggingface_hub's answer to a gated repository (``GatedRepoError``, logged in or not) or to a
    token without access (``HfHubHTTPError`` with status 403, or 401 unless it is a plain ``RepositoryNotFoundError``:
    the hub answers 401 for a repository that does not exist too)."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    if isinstance(error, GatedRepoError):
        return True
    status = getattr(getattr(error, "response", None), "status_code", None)
    if not isinstance(error, HfHubHTTPError) or status not in (401, 403):
        return False
    return status == 403 or not isinstance(error, RepositoryNotFoundError)


def access_hint(repo_id: str, error: BaseException | None) -> str | None:
    """The fix when the hub refused ``repo_id`` (a gated model such as FLUX.2-dev or Klein-9B, a token without
    access), else None: ``error`` or any error it was raised from or while handling (diffusers re-raises the hub's
    as ``OSError``). Downloading it with ``hf download`` would be refused the same way, so the advice is the
    licence and a login: ``REPO is gated or needs a login: accept its licence at URL, then `hf auth login` (or set
    HF_TOKEN), then run again``."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if _refused_access(error):
            return (
                f"the hub refused access to {repo_id} (a gated model, or a login it needs): accept its licence at "
                f"{_endpoint()}/{repo_id} with your account, then `{login_command()}` (or set HF_TOKEN), then run again"
            )
        error = error.__cause__ or error.__context__
    return None


def cached_repo_path(path: str | os.PathLike) -> tuple[str, str] | None:
    """``(repo_id, path inside the repository)`` for a file or folder of a model snapshot in the Hugging Face cache
    (``.../models--OWNER--NAME/snapshots/REV/INSIDE``; ``INSIDE`` empty for the snapshot itself), else None. The path
    as given, not resolved: a cached file is a link from ``snapshots/`` into ``blobs/``."""
    parts = os.path.abspath(os.fspath(path)).split(os.sep)
    for index, part in enumerate(parts[:-2]):
        if part.startswith("models--") and parts[index + 1] == "snapshots":
            return part.removeprefix("models--").replace("--", "/", 1), "/".join(parts[index + 3 :])
    return None


def looks_like_path(source: str) -> bool:
    """True when ``source`` reads as a local path rather than a hub id ``owner/name``.

    Path-looking: absolute, starting with ``.`` or ``~``, with a backslash, with more or fewer than one
    ``/``, or ending in a file suffix flowlift reads (``models/fu.safetensors``).
    """
    text = os.fspath(source)
    if os.path.isabs(text) or text.startswith((".", "~")) or "\\" in text:
        return True
    if text.count("/") != 1:
        return True
    return text.lower().endswith(FILE_SUFFIXES)


#: Seconds the one reachability request may take before the hub counts as unreachable.
HUB_CHECK_TIMEOUT_S = 3.0
#: How long an answer is reused: a command checks once; a long-running app re-checks now and then.
HUB_CHECK_TTL_S = 60.0

_checked: dict[str, tuple[float, str | None]] = {}
_checked_lock = threading.Lock()


def _env_offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    return flag or bool(getattr(constants, "HF_HUB_OFFLINE", False))


def _endpoint() -> str:
    from huggingface_hub import constants

    return str(getattr(constants, "ENDPOINT", "https://huggingface.co")).rstrip("/")


def _probe(endpoint: str, timeout: float) -> str | None:
    """None when ``endpoint`` answers one HEAD request (any status), else why not (the error's type).

    Through huggingface_hub's own HTTP session (its proxies and headers), without retries; run in a
    thread joined with a deadline, because a name lookup that hangs is not bounded by the request's
    own timeout.
    """
    outcome: list[str | None] = []

    def attempt() -> None:
        try:
            from huggingface_hub.utils import get_session

            get_session().head(endpoint, timeout=timeout)
            outcome.append(None)
        except Exception as error:  # noqa: BLE001 - any failure means: no answer from the hub
            outcome.append(type(error).__name__)

    thread = threading.Thread(target=attempt, name="flowlift-hub-check", daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    if not outcome:
        return f"no answer within {timeout:g} s"
    return outcome[0]


def hub_offline_reason(timeout: float = HUB_CHECK_TIMEOUT_S) -> str | None:
    """Why hub lookups must use the local cache only, as the tail of a sentence, or None when the hub answers.

    ``"HF_HUB_OFFLINE=1"`` when offline mode is set (no request is made); ``"the hub
    https://huggingface.co cannot be reached (ConnectError)"`` when one HEAD request to the endpoint
    (``HF_ENDPOINT`` honoured) gets no answer within ``timeout`` seconds. The answer is kept for
    :data:`HUB_CHECK_TTL_S`, so a command pays for at most one check.
    """
    if _env_offline():
        return "HF_HUB_OFFLINE=1"
    endpoint = _endpoint()
    now = time.monotonic()
    with _checked_lock:
        cached = _checked.get(endpoint)
        if cached is not None and now - cached[0] < HUB_CHECK_TTL_S:
            return cached[1]
        error = _probe(endpoint, timeout)
        reason = None if error is None else f"the hub {endpoint} cannot be reached ({error})"
        _checked[endpoint] = (time.monotonic(), reason)
        return reason


def cached_snapshot(repo_id: str, revision: str = "main") -> str | None:
    """The cached snapshot folder of model repository ``repo_id`` at ``revision``, or None: the cache only.

    The hub cache's documented layout, read directly: ``<HF_HUB_CACHE>/models--<owner>--<name>/refs/<revision>``
    holds the commit of ``snapshots/<commit>/`` (a 40-hex ``revision`` is that commit itself). What
    ``snapshot_download(..., local_files_only=True)`` answers for a cached repository, without importing its
    client (``huggingface_hub.hf_api`` and its HTTP stack: ~0.3 CPU-s per command); never a request.
    """
    from huggingface_hub import constants

    storage = os.path.join(str(constants.HF_HUB_CACHE), "models--" + repo_id.replace("/", "--"))
    commit = revision
    if not (len(revision) == 40 and all(ch in "0123456789abcdef" for ch in revision)):
        try:
            with open(os.path.join(storage, "refs", revision)) as handle:
                commit = handle.read().strip()
        except OSError:
            return None
    folder = os.path.join(storage, "snapshots", commit)
    return folder if commit and os.path.isdir(folder) else None


def cached_file(repo_id: str, filename: str, revision: str = "main") -> str | None:
    """The cached copy of ``filename`` (a path inside the repository) of model repository ``repo_id`` at
    ``revision``, or None: what ``huggingface_hub.try_to_load_from_cache`` answers for a cached file, read from
    the layout as :func:`cached_snapshot` reads it, without importing huggingface_hub's download client (~0.15
    CPU-s of every offline command, issue 47); never a request."""
    folder = cached_snapshot(repo_id, revision)
    if folder is None:
        return None
    path = os.path.join(folder, *filename.split("/"))
    return path if os.path.isfile(path) else None


#: A blob of the hub cache named by a SHA-256: an LFS file (a plain git file's blob is named by its 40-hex git hash).
_SHA256_NAME = re.compile(r"[0-9a-f]{64}")
#: The folders of cached repositories: ``models--owner--name`` (datasets and spaces alike).
_REPO_FOLDER_PREFIXES = ("models--", "datasets--", "spaces--")


def cached_blob_sha256(path: str | os.PathLike) -> str | None:
    """The SHA-256 of a file in huggingface_hub's cache, from the cache's own layout, or None for any other file.

    The hub cache stores each downloaded file once, as ``<cache>/models--<owner>--<name>/blobs/<etag>``, and a
    snapshot's file is a link to that blob; an LFS file's etag is the SHA-256 of its content (huggingface_hub's
    ``REGEX_SHA256``; the hub's LFS pointer and its file page show the same value). So a weight file whose real
    path is such a blob has its SHA-256 in its name, and hashing it again costs a full read for nothing (Mage-VAE's
    690 MB: 0.5 CPU-s per command, issue 47). What this trusts is the cache: a blob changed in place after the
    download would keep its name (``hf cache verify`` checks blobs against the hub). Files that are not blobs
    (a local path, a ``--local-dir`` download, a cache without links, where huggingface_hub copies files into
    the snapshot) and blobs named by a git hash return None: the caller hashes those.
    """
    real = os.path.realpath(path)
    blobs, name = os.path.split(real)
    repo_folder, folder = os.path.split(blobs)
    if folder != "blobs" or not os.path.basename(repo_folder).startswith(_REPO_FOLDER_PREFIXES):
        return None
    return name if _SHA256_NAME.fullmatch(name) and os.path.isfile(real) else None


def weight_file_sha256(path: str | os.PathLike) -> str:
    """A weight file's SHA-256 for an output's provenance: the name huggingface_hub's cache stores it under when
    it is a cached LFS file (:func:`cached_blob_sha256`), else read and hashed
    (:func:`~flowlift.files.image_outputs.file_sha256`)."""
    from flowlift.files.image_outputs import file_sha256

    return cached_blob_sha256(path) or file_sha256(path)
