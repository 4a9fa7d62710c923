"""``remote``: a reward served by ``flowrl serve-reward`` in another process, environment, GPU or node.

    reward:
      weights: {remote: 1.0, pickscore: 0.5}     # alone or weighted with local rewards
      options:
        remote: {url: "http://127.0.0.1:8700", timeout: 60, retries: 3}

Each call sends the images and prompts (and the reward's keyword arguments: JSON values, or image
tensors such as an edit's source images, every source of every row in order) in requests of at most
``batch_size`` images, in the wire
format of :mod:`flowrl.rewards._wire` (no pickle): ``encoding="uint8"`` (default: 8-bit, what the
PIL-based references see, 4x smaller than float), ``"png"`` (smaller still, same values) or
``"float32"`` (lossless: the served reward then scores exactly what a local one would).

Failures: each request has a ``timeout`` (seconds); a refused or dropped connection, a timeout, and
HTTP 408 / 429 / 502 / 503 / 504 are retried ``retries`` times with exponential backoff (``backoff``,
``2 backoff``, ...), then :class:`RemoteRewardError` names the URL and the last error. A request the
server refuses (4xx: malformed, too large, unauthorized) or a reward that failed there (500) is
not retried: the error carries the server's message and the field it names. The constructor asks
``/health`` first, so a wrong URL fails before any sampling, at once when nothing listens there (a
refused connection is not retried then; other failures are, as above). Errors are
:class:`flowrl.rewards.RewardUnavailable`: training stops at the iteration boundary and continues
with ``--resume`` once the server is back. The bearer token, if any, is read from the environment
variable ``token_env`` and never logged.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import urllib.error
import urllib.request
from typing import Literal, Optional

import torch

from flowrl.data.items import row_sources
from flowrl.options import URL, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

from . import RewardUnavailable
from ._clip_common import check_inputs, chunks
from ._http import fetch
from ._wire import CONTENT_TYPE, ENCODINGS, PROTOCOL, ImageRows, WireError, decode_response, encode_request

RETRY_STATUS = {408, 429, 502, 503, 504}  # not 500: there the served reward itself failed, and would again


def _is_images(v) -> bool:
    """A row's image entry: a tensor, or a non-empty sequence of tensors (several sources)."""
    return isinstance(v, torch.Tensor) or (isinstance(v, (list, tuple)) and bool(v)
                                           and all(isinstance(t, torch.Tensor) for t in v))


def _as_image_batch(name: str, value):
    """A per-row list of images (an editing set's ``sources``: ``[3, H, W]`` per row, or a tuple of them
    for a row with several) as the wire's image argument: one ``[B, 3, H, W]`` tensor when every row
    has one image, else :class:`flowrl.rewards._wire.ImageRows` (all images in order, and the count
    per row); other values unchanged. The images must share one size and no row may be None (the
    wire has no missing image)."""
    if not (isinstance(value, (list, tuple)) and value and any(_is_images(v) for v in value)):
        return value
    if any(v is None for v in value):
        raise ValueError(f"{name}: {sum(v is None for v in value)} of {len(value)} rows have no image; a remote reward "
                         f"needs an image for every row (split text-only and editing prompts into separate sets)")
    rows = [row_sources(v) for v in value]
    shapes = {tuple(t.shape) for row in rows for t in row}
    if len(shapes) != 1:
        raise ValueError(f"{name}: images of different sizes {sorted(shapes)}; a remote reward needs one size per "
                         f"batch (resize the editing set's source images to one size)")
    flat = torch.stack([t.detach().float().cpu() for row in rows for t in row])  # [S, 3, H, W], row-major
    return flat if all(len(row) == 1 for row in rows) else ImageRows(flat, tuple(len(row) for row in rows))


class RemoteRewardError(RewardUnavailable):
    """The reward server could not score a request (after retries, or a refusal it will repeat)."""


class RemoteReward:
    """Scores by ``POST {url}/score`` on a ``flowrl serve-reward`` server; float32 [B] on CPU."""

    name = "remote"
    resident_params = 0  # parameters kept loaded, for `flowrl plan`
    resident_note = "a reward served by `flowrl serve-reward`: its weights live in the server's process"

    def __init__(self, url: URL, timeout: PositiveFloat = 60.0, retries: NonNegativeInt = 3,
                 backoff: NonNegativeFloat = 0.5, encoding: Literal[ENCODINGS] = "uint8", batch_size: PositiveInt = 64,
                 token_env: Optional[str] = None, check: bool = True, takes_metadata: bool = False):
        if not re.match(r"^https?://[^/\s]+", url or ""):
            raise ValueError(f"url must be the http(s) address `flowrl serve-reward` printed (e.g. "
                             f"http://127.0.0.1:8700), got {url!r}")
        if not timeout > 0 or retries < 0 or backoff < 0 or batch_size < 1:
            raise ValueError("need timeout > 0, retries >= 0, backoff >= 0 and batch_size >= 1")
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
        self.url = url.rstrip("/")
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        self.encoding, self.batch_size = encoding, int(batch_size)
        self.takes_metadata = bool(takes_metadata)  # the served reward reads metadata= (geneval): flowrl eval sends it
        self._token: Optional[str] = None
        if token_env:
            self._token = os.environ.get(token_env)
            if not self._token:
                raise ValueError(f"environment variable {token_env!r} (token_env) is not set or empty: export the "
                                 f"server's bearer token there")
        self.served: Optional[str] = None  # the reward the server serves (its /health)
        if check:
            self.health(refused_is_final=True)

    def __repr__(self) -> str:  # no token in here
        return f"RemoteReward(url={self.url!r}, served={self.served!r}, encoding={self.encoding!r})"

    # ------------------------------------------------------------ HTTP with retries
    def _request(self, path: str, body: Optional[bytes] = None, refused_is_final: bool = False) -> bytes:
        headers = {"Content-Type": CONTENT_TYPE} if body is not None else {}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        req = urllib.request.Request(self.url + path, data=body, headers=headers, method="POST" if body else "GET")
        return fetch(req, timeout=self.timeout, retries=self.retries, backoff=self.backoff,
                     what=f"reward server {self.url}{path}", error=RemoteRewardError, detail=_server_error,
                     retry_status=RETRY_STATUS, hint=". Is `flowrl serve-reward` running there?",
                     refused_is_final=refused_is_final)

    def health(self, refused_is_final: bool = False) -> dict:
        """The server's ``/health`` (checks that it is a flowrl reward server of this protocol);
        ``refused_is_final``: a refused connection fails at once (the check when the reward is built)."""
        raw = self._request("/health", refused_is_final=refused_is_final)
        try:
            info = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            info = None
        if not isinstance(info, dict) or info.get("status") != "ok" or "protocol" not in info:
            raise RemoteRewardError(f"{self.url}/health did not answer like `flowrl serve-reward`: "
                                    f"{raw[:200].decode('utf-8', 'replace')!r}")
        if info["protocol"] != PROTOCOL:
            raise RemoteRewardError(f"reward server {self.url} speaks protocol {info['protocol']}, this client {PROTOCOL}: "
                                    f"run the same flowrl version on both sides")
        self.served = info.get("reward")
        return info

    # ------------------------------------------------------------ the reward
    def __call__(self, images: torch.Tensor, prompts: list[str], **meta) -> torch.Tensor:
        check_inputs(images, prompts, self.name)
        prompts, out = list(prompts), []
        meta = {k: _as_image_batch(k, v) for k, v in meta.items()}
        per_row = {k for k, v in meta.items()
                   if isinstance(v, (torch.Tensor, ImageRows)) or (isinstance(v, list) and len(v) == len(prompts))}
        for s in chunks(images.shape[0], self.batch_size):
            part = {k: (v[s] if k in per_row else v) for k, v in meta.items()}  # per-row values split with the images
            body = encode_request(images[s], prompts[s], part, self.encoding)
            raw = self._request("/score", body)
            try:
                rewards, _ = decode_response(raw, len(prompts[s]))
            except WireError as e:
                raise RemoteRewardError(f"reward server {self.url}/score answered something that is not a score "
                                        f"list: {e}") from None
            out.append(rewards)
        return torch.cat(out)  # [B]


def _server_error(e: urllib.error.HTTPError) -> str:
    """The server's ``{"error", "field"}`` message, or the start of its body."""
    try:
        raw = e.read()
    except (OSError, http.client.HTTPException):
        return str(e.reason)
    try:
        data = json.loads(raw)
        if isinstance(data, dict) and "error" in data:
            return str(data["error"])
    except (json.JSONDecodeError, UnicodeDecodeError):
        pass
    text = raw[:300].decode("utf-8", "replace")
    return text or str(e.reason)
