"""Is a Hugging Face model there to load? A fast check before diffusers / transformers go looking.

A hub id (``org/name``) that is neither in the local cache nor downloadable costs a user about a
minute of retries and 70-120 lines of library messages before anything says which model is missing.
:func:`require_hub_model` answers at once: a local directory, or a hub id with a snapshot in the
cache, passes; otherwise, when ``HF_HUB_OFFLINE`` is set or the hub endpoint does not answer a
``HEAD`` request within :data:`PROBE_SECONDS` (proxies from the environment are used, as the
libraries use them), it raises ``FileNotFoundError`` with one sentence naming the model, the
setting it came from and the three ways out. A reachable hub passes (the library downloads).
"""
from __future__ import annotations

import functools
import os
import urllib.error
import urllib.request
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
