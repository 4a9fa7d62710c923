"""``vlm_judge``: a vision-language model as judge, behind an OpenAI-compatible chat-completions API.

Each image goes, as a base64 PNG data URL, with its prompt inserted into ``template``, in one
``POST {url}/chat/completions`` request (``url`` is the API base such as
``http://127.0.0.1:8000/v1``; a URL already ending in ``/chat/completions`` is used as is).
Servers that speak this API: vLLM, SGLang, llama.cpp's server, OpenAI.

reward = ``(s - lo) / (hi - lo)`` in [0, 1] for the score ``s`` parsed from the reply with
``score_pattern`` (its last match), ``(lo, hi) = score_range``. With ``score_range=(0, 5)``
and a 1-5 rubric this is Flow-GRPO's UnifiedReward ``score / 5``.

Editing: called with ``sources=`` (each row's source image ``[3, H, W]``, a tuple of them for a
row with several sources, or None, as the trainer passes an editing set's sources), a row with a
source is judged as an edit: the request carries the source image, then the result, then
``edit_template`` with the instruction in ``{prompt}``; a row with several sources carries every
source in order, then the result, then ``multi_edit_template`` (``{prompt}``, and ``{sources}``: how
many sources); rows without a source are judged with ``template`` as above.

Failure handling: each request has a ``timeout`` (seconds); timeouts, connection errors, HTTP
429 and 5xx are retried ``retries`` times with exponential backoff, then raise
:class:`VLMJudgeError`. A reply that is not chat-completions JSON, holds no score, or a score
outside ``score_range`` raises :class:`VLMReplyError` quoting the reply (``on_invalid="nan"``
scores it NaN instead). The API key is read from the environment variable named by
``api_key_env`` and is never logged, printed or put in an error message.
"""
from __future__ import annotations

import base64
import io
import json
import logging
import math
import os
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, Mapping, Optional

import torch
from PIL import Image

from flowrl.data.items import row_sources
from flowrl.options import URL, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt
from flowrl.utils.images import to_pil

from . import RewardUnavailable
from ._clip_common import check_inputs
from ._http import fetch

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = (
    "You are given a text caption and an image generated from it. Judge how well the image matches the "
    "caption (objects, counts, attributes, relations, any quoted text) and its visual quality.\n"
    "Caption: {prompt}\n"
    "Answer with a short justification, then a last line 'Score: N' with N from 0 (worst) to 10 (best)."
)
DEFAULT_EDIT_TEMPLATE = (
    "You are given two images: the first is the source image, the second is the result of editing it with "
    "the instruction below. Judge how well the result follows the instruction, keeps everything the "
    "instruction does not ask to change, and its visual quality.\n"
    "Instruction: {prompt}\n"
    "Answer with a short justification, then a last line 'Score: N' with N from 0 (worst) to 10 (best)."
)
DEFAULT_MULTI_EDIT_TEMPLATE = (
    "You are given {sources} source images, in order (picture 1, picture 2, ...), then a last image: the result "
    "of editing them with the instruction below. Judge how well the result follows the instruction, using "
    "every source image as it asks, keeps everything the instruction does not ask to change, and its visual "
    "quality.\n"
    "Instruction: {prompt}\n"
    "Answer with a short justification, then a last line 'Score: N' with N from 0 (worst) to 10 (best)."
)
DEFAULT_SCORE_PATTERN = r"score\s*[:=]?\s*\**\s*(-?\d+(?:\.\d+)?)"
_RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class VLMJudgeError(RewardUnavailable):
    """The judge endpoint could not be used (timeouts, connection or HTTP errors after retries)."""


class VLMReplyError(VLMJudgeError, ValueError):
    """The endpoint answered, but not with a usable score."""


def png_data_url(image: torch.Tensor, max_side: Optional[int] = None) -> str:
    """``[3, H, W]`` in [0, 1] -> ``data:image/png;base64,...`` (longer side resized to ``max_side``)."""
    pil = to_pil(image)
    if max_side and max(pil.size) != max_side:
        scale = max_side / max(pil.size)
        pil = pil.resize((max(1, round(pil.width * scale)), max(1, round(pil.height * scale))), Image.BICUBIC)
    buf = io.BytesIO()
    pil.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _snippet(text: Any, n: int = 200) -> str:
    s = text if isinstance(text, str) else repr(text)
    return s if len(s) <= n else s[:n] + "..."


def reply_text(raw: bytes) -> str:
    """The assistant message of a chat-completions response body; VLMReplyError if malformed."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise VLMReplyError(f"judge reply is not JSON: {_snippet(raw.decode('utf-8', 'replace'))!r}") from None
    try:
        content = data["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise VLMReplyError(f"judge reply has no choices[0].message.content: {_snippet(json.dumps(data))}") from None
    if isinstance(content, list):  # content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    if not isinstance(content, str):
        raise VLMReplyError(f"judge reply content is not text: {_snippet(content)}")
    return content


class VLMJudge:
    """Scores each (image, prompt) pair with a remote VLM; float32 [B] in [0, 1] on CPU."""

    name = "vlm_judge"
    resident_params = 0  # parameters kept loaded, for `flowrl plan`
    resident_note = "an external chat-completions server: no local weights"

    def __init__(self, url: URL, model: str = "default", api_key_env: Optional[str] = None,
                 template: str = DEFAULT_TEMPLATE, system: Optional[str] = None,
                 score_pattern: str = DEFAULT_SCORE_PATTERN, score_range: tuple[float, float] = (0.0, 10.0),
                 timeout: PositiveFloat = 60.0, retries: NonNegativeInt = 2, backoff: NonNegativeFloat = 1.0,
                 concurrency: PositiveInt = 4, max_side: Optional[PositiveInt] = None, temperature: NonNegativeFloat = 0.0,
                 max_tokens: PositiveInt = 256, extra_body: Optional[Mapping[str, Any]] = None,
                 on_invalid: Literal["raise", "nan"] = "raise",
                 edit_template: str = DEFAULT_EDIT_TEMPLATE, multi_edit_template: str = DEFAULT_MULTI_EDIT_TEMPLATE):
        if not re.match(r"^https?://", url or ""):
            raise ValueError(f"url must be an http(s) URL of an OpenAI-compatible API (e.g. http://127.0.0.1:8000/v1), "
                             f"got {url!r}")
        if "{prompt}" not in template:
            raise ValueError("template must contain '{prompt}', where the image's prompt is inserted")
        for name, text in (("edit_template", edit_template), ("multi_edit_template", multi_edit_template)):
            if "{prompt}" not in text:
                raise ValueError(f"{name} must contain '{{prompt}}', where the edit's instruction is inserted")
        lo, hi = map(float, score_range)
        if not hi > lo:
            raise ValueError(f"score_range must be (low, high) with high > low, got {score_range!r}")
        if timeout <= 0 or retries < 0 or concurrency < 1:
            raise ValueError("need timeout > 0, retries >= 0 and concurrency >= 1")
        if on_invalid not in ("raise", "nan"):
            raise ValueError(f"on_invalid must be 'raise' or 'nan', got {on_invalid!r}")
        self._api_key: Optional[str] = None
        if api_key_env:
            self._api_key = os.environ.get(api_key_env)
            if not self._api_key:
                raise ValueError(f"environment variable {api_key_env!r} (api_key_env) is not set or empty: export the "
                                 "judge's API key there, or pass api_key_env=None for an endpoint without a key")
        url = url.rstrip("/")
        self.endpoint = url if url.endswith("/chat/completions") else url + "/chat/completions"
        self.model, self.template, self.system, self.edit_template = model, template, system, edit_template
        self.multi_edit_template = multi_edit_template
        self.pattern = re.compile(score_pattern, re.IGNORECASE)
        if self.pattern.groups < 1:
            raise ValueError("score_pattern needs a capture group around the number")
        self.score_range = (lo, hi)
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        self.concurrency, self.max_side = int(concurrency), max_side
        self.temperature, self.max_tokens = float(temperature), int(max_tokens)
        self.extra_body, self.on_invalid = dict(extra_body or {}), on_invalid

    def __repr__(self) -> str:  # no key in here
        return f"VLMJudge(endpoint={self.endpoint!r}, model={self.model!r}, key={'set' if self._api_key else 'none'})"

    # ------------------------------------------------------------ one request
    def request_body(self, image: torch.Tensor, prompt: str, source=None) -> dict:
        """One chat-completions request: the image and ``template``; with a ``source`` (an edit) the
        source image, the result ``image`` and ``edit_template``, in that order; with several sources (a
        tuple) every source in order, the result and ``multi_edit_template``."""
        messages = [{"role": "system", "content": self.system}] if self.system else []
        sources = row_sources(source)
        shown = [*sources, image]
        if len(sources) < 2:
            text = (self.edit_template if sources else self.template).replace("{prompt}", prompt)
        else:
            text = self.multi_edit_template.replace("{sources}", str(len(sources))).replace("{prompt}", prompt)
        messages.append({"role": "user", "content": [
            *({"type": "image_url", "image_url": {"url": png_data_url(im, self.max_side)}} for im in shown),
            {"type": "text", "text": text},
        ]})
        return {"model": self.model, "messages": messages, "temperature": self.temperature,
                "max_tokens": self.max_tokens, **self.extra_body}

    def _post_with_retries(self, body: bytes) -> bytes:
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        req = urllib.request.Request(self.endpoint, data=body, headers=headers, method="POST")
        return fetch(req, timeout=self.timeout, retries=self.retries, backoff=self.backoff,
                     what=f"judge endpoint {self.endpoint}", error=VLMJudgeError,
                     detail=lambda e: _snippet(e.read().decode("utf-8", "replace")), retry_status=_RETRY_STATUS)

    def parse_score(self, text: str) -> float:
        """The last ``score_pattern`` match (or a bare number), mapped to [0, 1]; VLMReplyError if none."""
        found = self.pattern.findall(text)
        value: Optional[float] = None
        if found:
            value = float(found[-1] if isinstance(found[-1], str) else found[-1][0])
        else:
            try:
                value = float(text.strip())
            except ValueError:
                pass
        if value is None or not math.isfinite(value):
            raise VLMReplyError(f"no score in the judge's reply (pattern {self.pattern.pattern!r}): {_snippet(text)!r}")
        lo, hi = self.score_range
        if not lo <= value <= hi:
            raise VLMReplyError(f"judge score {value:g} is outside score_range {self.score_range}: {_snippet(text)!r}")
        return (value - lo) / (hi - lo)

    def score_one(self, image: torch.Tensor, prompt: str, source=None) -> float:
        body = json.dumps(self.request_body(image, prompt, source)).encode("utf-8")
        try:
            return self.parse_score(reply_text(self._post_with_retries(body)))
        except VLMReplyError as e:
            if self.on_invalid == "nan":
                log.warning("%s; scoring NaN", e)
                return float("nan")
            raise

    # ------------------------------------------------------------ the reward
    def __call__(self, images: torch.Tensor, prompts: list[str], sources=None, **meta) -> torch.Tensor:
        """Scores ``images`` [B, 3, H, W] with their ``prompts``; ``sources`` (per row a ``[3, H, W]``, a
        tuple of them, or None; or a ``[B, 3, H, W]`` tensor) judges those rows as edits (module doc)."""
        check_inputs(images, prompts, self.name)
        images = images.detach().cpu()
        n = images.shape[0]
        rows = [None] * n if sources is None else list(sources)
        if len(rows) != n:
            raise ValueError(f"{self.name} got {n} images but {len(rows)} sources; pass one source (or None) per image")
        rows = [tuple(s.detach().cpu() for s in row_sources(r)) or None for r in rows]
        rows = [r[0] if r is not None and len(r) == 1 else r for r in rows]  # one source: as the tensor
        log.debug("judging %d images at %s", n, self.endpoint)
        if self.concurrency == 1 or n == 1:
            scores = [self.score_one(images[i], prompts[i], rows[i]) for i in range(n)]
        else:
            with ThreadPoolExecutor(min(self.concurrency, n)) as pool:
                scores = list(pool.map(self.score_one, list(images), list(prompts), rows))
        return torch.tensor(scores, dtype=torch.float32)
