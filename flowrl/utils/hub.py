"""Is a Hugging Face model there to load? A fast check before diffusers / transformers go looking.

A hub id (``org/name``) that is neither in the local cache nor downloadable costs a user about a
minute of retries and 70-120 lines of library messages before anything says which model is missing.
:func:`require_hub_model` answers at once: a local directory, or a hub id with a snapshot in the
cache, passes; otherwise, when ``HF_HUB_OFFLINE`` is set or the hub endpoint does not answer a
``HEAD`` request within :data:`PROBE_SECONDS` (proxies from the environment are used, as the
libraries use them), it raises ``FileNotFoundError`` with one sentence naming the model, the
setting it came from and the three ways out. A reachable hub passes (the library downloads).

One file of a hub repository (a reward's weights) is named ``hf://ORG/NAME/FILE``: :func:`hub_file` gives
its local path, from the cache or downloaded, with the same one-line error when neither can be had.
"""
from __future__ import annotations

import functools
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

PROBE_SECONDS = 5.0
_TRUE = {"1", "on", "yes", "true"}


def looks_like_hub_id(path_or_id: str) -> bool:
    """``org/name`` or ``name`` that is not a local path (no leading ``.``, ``/`` or ``~``, at most one
    slash, nothing of that name here)."""
    s = str(path_or_id)
    return s.count("/") <= 1 and not s.startswith((".", "/", "~")) and all(s.split("/")) and not Path(s).exists()


def hub_cache_dir(cache_dir: Optional[str] = None) -> Path:
    """The hub cache the libraries read: ``cache_dir`` if given, else huggingface_hub's (``HF_HUB_CACHE``,
    ``$HF_HOME/hub``, default ``~/.cache/huggingface/hub``)."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def in_hub_cache(repo_id: str, cache_dir: Optional[str] = None) -> bool:
    """Whether the cache holds a snapshot of model ``repo_id`` (``models--org--name/snapshots/*``)."""
    snapshots = hub_cache_dir(cache_dir) / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    return snapshots.is_dir() and any(snapshots.iterdir())


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) set in the environment or read by huggingface_hub."""
    from huggingface_hub import constants

    env = any(os.environ.get(k, "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return env or bool(constants.HF_HUB_OFFLINE)


@functools.lru_cache(maxsize=4)
def _unreachable(endpoint: str) -> Optional[str]:
    """Why ``endpoint`` cannot be reached (None: it answered, any HTTP status); one probe per process."""
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=PROBE_SECONDS).close()
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        return f"{endpoint} cannot be reached from here ({reason})"
    return None


def hub_unavailable() -> Optional[str]:
    """Why nothing can be downloaded from the hub now (None: downloads work)."""
    if hub_offline():
        return "HF_HUB_OFFLINE is set"
    from huggingface_hub import constants

    return _unreachable(os.environ.get("HF_ENDPOINT") or constants.ENDPOINT)


def require_hub_model(path_or_id, what: str, setting: str, cache_dir: Optional[str] = None) -> None:
    """Raise ``FileNotFoundError`` (one line) when ``path_or_id`` is a hub id that is not in the local cache
    and cannot be downloaded (:func:`hub_unavailable`); ``what`` names the model (``"sd3 base model"``),
    ``setting`` where it was given (``"model.path"``). Local paths and ``None`` pass (checked elsewhere)."""
    if path_or_id is None or not looks_like_hub_id(str(path_or_id)) or in_hub_cache(str(path_or_id), cache_dir):
        return
    why = hub_unavailable()
    if why is None:
        return
    raise FileNotFoundError(
        f"{what} {str(path_or_id)!r} ({setting}) is neither a local directory nor in the local Hugging Face cache "
        f"{hub_cache_dir(cache_dir)} "
        f"and {why}: download it on a machine with network (`huggingface-cli download {path_or_id}`, then copy "
        f"the cache), point {setting} to a local copy (a save_pretrained directory), or set HF_HOME to the cache "
        f"that holds it")


# ---------------------------------------------------------------- one file of a hub repository
HUB_FILE_PREFIX = "hf://"
HUB_FILE_FORM = "hf://ORG/NAME/FILE (a model repository), hf://ORG/NAME@REVISION/FILE or hf://datasets/ORG/NAME/FILE"


@dataclass(frozen=True)
class HubFile:
    """One file of a Hugging Face hub repository, named ``hf://[datasets/]ORG/NAME[@REVISION]/PATH`` (the form
    huggingface_hub's ``HfFileSystem`` reads); ``revision`` None is the repository's default branch."""

    repo_id: str
    filename: str
    revision: Optional[str] = None
    repo_type: str = "model"

    def __str__(self) -> str:
        kind = "" if self.repo_type == "model" else f"{self.repo_type}s/"
        at = f"@{self.revision}" if self.revision else ""
        return f"{HUB_FILE_PREFIX}{kind}{self.repo_id}{at}/{self.filename}"

    def download_command(self) -> str:
        """The ``hf download`` line that puts this file into the local cache."""
        extra = (f" --repo-type {self.repo_type}" if self.repo_type != "model" else "") + \
                (f" --revision {self.revision}" if self.revision else "")
        return f"hf download {self.repo_id} {self.filename}{extra}"


def is_hub_file(value) -> bool:
    """Whether ``value`` is written as a hub file reference (``hf://...``; well formed or not)."""
    return isinstance(value, str) and value.startswith(HUB_FILE_PREFIX)


def parse_hub_file(ref: str) -> HubFile:
    """``hf://[datasets/]ORG/NAME[@REVISION]/PATH`` -> :class:`HubFile`; ``ValueError`` (one line) otherwise."""
    rest = str(ref)[len(HUB_FILE_PREFIX):] if is_hub_file(ref) else None
    repo_type = "model"
    if rest is not None and rest.startswith("datasets/"):
        repo_type, rest = "dataset", rest[len("datasets/"):]
    parts = rest.split("/") if rest is not None else []
    if len(parts) < 3 or not all(parts):
        raise ValueError(f"{ref!r} is not a hub file reference; write it as {HUB_FILE_FORM}")
    org, name = parts[0], parts[1]
    name, _, revision = name.partition("@")
    if not name or (_ and not revision):
        raise ValueError(f"{ref!r} has an empty repository name or revision; write it as {HUB_FILE_FORM}")
    return HubFile(f"{org}/{name}", "/".join(parts[2:]), revision or None, repo_type)


def cached_hub_file(ref: str, cache_dir: Optional[str] = None) -> Optional[Path]:
    """The local cache's copy of hub file ``ref`` (None: not cached); reads the cache only."""
    from huggingface_hub import try_to_load_from_cache

    f = parse_hub_file(ref)
    got = try_to_load_from_cache(f.repo_id, f.filename, cache_dir=cache_dir, revision=f.revision,
                                 repo_type=f.repo_type)
    return Path(got) if isinstance(got, str) else None


def hub_file(ref: str, setting: str, cache_dir: Optional[str] = None) -> Path:
    """The local path of hub file ``ref``: the cached copy, else downloaded into the cache. When it is not
    cached and nothing can be downloaded (:func:`hub_unavailable`), a one-line ``FileNotFoundError`` names
    ``setting`` (where it was given) and the ``hf download`` line that fetches it."""
    f = parse_hub_file(ref)
    cached = cached_hub_file(ref, cache_dir)
    if cached is not None:
        return cached
    why = hub_unavailable()
    if why is not None:
        raise FileNotFoundError(
            f"{setting}={ref} is not in the local Hugging Face cache {hub_cache_dir(cache_dir)} and {why}: "
            f"run `{f.download_command()}` on a machine with network (then copy the cache), set HF_HOME to the "
            f"cache that holds it, or point {setting} to a local copy of the file")
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(f.repo_id, f.filename, revision=f.revision, repo_type=f.repo_type,
                                cache_dir=cache_dir))
