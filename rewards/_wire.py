"""The reward server's wire format, shared by ``flowrl serve-reward`` and the ``remote`` reward. No pickle.

Request: ``POST /score`` with ``Content-Type: application/octet-stream`` and a safetensors file as the
body (parsed by the safetensors library: a JSON header and raw little-endian arrays, nothing
executable). Its ``__metadata__`` holds one key, ``flowrl``, a JSON object::

    {"version": 1, "encoding": "uint8" | "png" | "float32", "prompts": [B strings],
     "meta": {JSON-valued keyword arguments of the reward}, "image_meta": [names of image arguments]}

and its tensors are the images in that encoding:

- ``uint8``: ``images`` uint8 ``[B, H, W, 3]`` (8-bit, rounded: what PIL-based references see);
- ``png``: ``images.png.0`` ... ``images.png.{B-1}``, each the bytes of an RGB PNG file as uint8 ``[n]``;
- ``float32``: ``images`` float32 ``[B, 3, H, W]`` in [0, 1] (lossless: the local reward's input).

An image-valued reward argument (the source image of an edit, ``[B, 3, H, W]``) travels the same way
under ``meta.NAME`` instead of ``images`` (``meta.NAME`` or ``meta.NAME.png.i``). An argument with
several images per row (the sources of a multi-source edit, :class:`ImageRows`) sends all of them,
row after row and each row's in order, as one image batch ``[S, 3, H, W]`` under ``meta.NAME``, and
the header adds ``"image_counts": {NAME: [images of each row]}``; the server hands the reward one
entry per row: the ``[3, H, W]`` image of a row with one, a tuple of them for a row with several. A
request whose every row has one image carries no ``image_counts`` (the one-source payload). Response: JSON
``{"rewards": [B numbers or null], "components": {name: [B numbers or null]}}``; ``null`` is NaN
(not applicable); a bare ``NaN`` / ``Infinity`` is not JSON and is refused. Errors: HTTP 4xx/5xx with
``{"error": message, "field": the offending field}``.
"""
from __future__ import annotations

import io
import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from flowrl.utils.images import to_uint8

PROTOCOL = 1
ENCODINGS = ("uint8", "png", "float32")
CONTENT_TYPE = "application/octet-stream"
MAX_HEADER_BYTES = 16 << 20  # JSON header of a request (prompts, metadata)


@dataclass(frozen=True)
class ImageRows:
    """An image argument with one or more images per row: ``images`` float ``[S, 3, H, W]`` in [0, 1], row
    after row (each row's in order), and ``counts`` the images of each row (each >= 1, summing to S)."""

    images: torch.Tensor
    counts: tuple[int, ...]

    def __getitem__(self, rows: slice) -> "ImageRows":
        """The rows ``rows`` (a slice with step 1) with their images."""
        starts = [0]
        for c in self.counts:
            starts.append(starts[-1] + c)
        a, b, _ = rows.indices(len(self.counts))
        return ImageRows(self.images[starts[a]:starts[b]], tuple(self.counts[a:b]))

    def rows(self) -> list:
        """One entry per row: the image ``[3, H, W]`` of a row with one, a tuple of them for several."""
        out, k = [], 0
        for c in self.counts:
            part = tuple(self.images[k:k + c])
            out.append(part[0] if c == 1 else part)
            k += c
        return out


class WireError(ValueError):
    """A malformed request or response; ``field`` names the part that is wrong."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


# ---------------------------------------------------------------- images <-> tensors
def _to_uint8_hwc(images: torch.Tensor) -> torch.Tensor:
    """``[B, 3, H, W]`` in [0, 1] -> uint8 ``[B, H, W, 3]``, rounded (as the references' PIL conversion)."""
    return to_uint8(images).permute(0, 2, 3, 1).contiguous()


def _png_bytes(hwc: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(hwc).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def _encode_images(prefix: str, images: torch.Tensor, encoding: str) -> dict[str, torch.Tensor]:
    if encoding == "float32":
        return {prefix: images.detach().float().cpu().clone(memory_format=torch.contiguous_format)}  # [B, 3, H, W]
    hwc = _to_uint8_hwc(images.cpu())  # [B, H, W, 3]
    if encoding == "uint8":
        return {prefix: hwc}
    return {f"{prefix}.png.{i}": torch.frombuffer(bytearray(_png_bytes(a)), dtype=torch.uint8)
            for i, a in enumerate(hwc.numpy())}


def _check_images(field: str, images: Any) -> torch.Tensor:
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise WireError(field, f"expected images [B, 3, H, W] in [0, 1], got {shape}")
    return images


def encode_request(images: torch.Tensor, prompts: Sequence[str], meta: Optional[Mapping[str, Any]] = None,
                   encoding: str = "uint8") -> bytes:
    """The request body for ``images`` [B, 3, H, W] in [0, 1], their ``prompts`` and the reward's
    keyword arguments ``meta`` (JSON values, image tensors [B, 3, H, W], or :class:`ImageRows`)."""
    from safetensors.torch import save

    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    _check_images("images", images)
    if len(prompts) != images.shape[0]:
        raise WireError("prompts", f"{len(prompts)} prompts for {images.shape[0]} images")
    tensors = _encode_images("images", images, encoding)
    json_meta, image_meta, counts = {}, [], {}
    for k, v in (meta or {}).items():
        if isinstance(v, ImageRows):
            _check_images(f"meta.{k}", v.images)
            if len(v.counts) != images.shape[0] or sum(v.counts) != v.images.shape[0] or min(v.counts) < 1:
                raise WireError(f"meta.{k}", f"image counts {list(v.counts)} for {images.shape[0]} samples and "
                                             f"{v.images.shape[0]} images")
            tensors.update(_encode_images(f"meta.{k}", v.images, encoding))
            image_meta.append(k)
            counts[k] = list(v.counts)
        elif isinstance(v, torch.Tensor):
            _check_images(f"meta.{k}", v)
            if v.shape[0] != images.shape[0]:
                raise WireError(f"meta.{k}", f"{v.shape[0]} images for {images.shape[0]} samples")
            tensors.update(_encode_images(f"meta.{k}", v, encoding))
            image_meta.append(k)
        else:
            json_meta[k] = v
    header = {"version": PROTOCOL, "encoding": encoding, "prompts": list(prompts), "meta": json_meta,
              "image_meta": image_meta, **({"image_counts": counts} if counts else {})}
    try:
        text = json.dumps(header, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise WireError("meta", f"reward arguments must be JSON values or image tensors ({e})") from None
    return save(tensors, metadata={"flowrl": text})


# ---------------------------------------------------------------- request: bytes -> images, prompts, meta
def _header(body: bytes) -> dict:
    """The safetensors JSON header (read here for ``__metadata__``, which ``safetensors.torch.load`` drops)."""
    if len(body) < 8:
        raise WireError("body", f"not a safetensors payload ({len(body)} bytes)")
    (n,) = struct.unpack("<Q", body[:8])
    if n > MAX_HEADER_BYTES or 8 + n > len(body):
        raise WireError("body", f"not a safetensors payload (header length {n} for a {len(body)}-byte body)")
    try:
        header = json.loads(body[8:8 + n])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise WireError("body", "not a safetensors payload (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise WireError("body", "not a safetensors payload (its header is not a JSON object)")
    return header


def _decode_png(field: str, data: torch.Tensor, max_pixels: int) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        im = Image.open(io.BytesIO(data.numpy().tobytes()))
        if im.format != "PNG":
            raise WireError(field, f"not a PNG file ({im.format})")
        if im.width * im.height > max_pixels:
            raise WireError(field, f"{im.width}x{im.height} exceeds the server's {max_pixels} pixels per image")
        if im.mode != "RGB":
            raise WireError(field, f"PNG mode {im.mode!r}; send RGB")
        return np.asarray(im.convert("RGB"))  # [H, W, 3] uint8
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        raise WireError(field, f"not a readable PNG file ({e})") from None


def _decode_images(tensors: dict, prefix: str, encoding: str, n: int, max_pixels: int) -> torch.Tensor:
    """Images of ``prefix`` -> float32 [n, 3, H, W] in [0, 1]."""
    if encoding == "png":
        arrays = []
        for i in range(n):
            key = f"{prefix}.png.{i}"
            if key not in tensors:
                raise WireError(key, f"missing: {n} prompts need {n} PNG images")
            t = tensors[key]
            if t.dtype != torch.uint8 or t.ndim != 1:
                raise WireError(key, f"expected the PNG file's bytes as uint8 [n], got {t.dtype} {tuple(t.shape)}")
            arrays.append(_decode_png(key, t, max_pixels))
            if arrays[-1].shape != arrays[0].shape:
                raise WireError(key, f"size {arrays[-1].shape[:2]} differs from the first image's {arrays[0].shape[:2]}")
        return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255  # [n, 3, H, W]
    if prefix not in tensors:
        raise WireError(prefix, "missing")
    t = tensors[prefix]
    if encoding == "uint8":
        if t.dtype != torch.uint8 or t.ndim != 4 or t.shape[3] != 3:
            raise WireError(prefix, f"expected uint8 [B, H, W, 3], got {t.dtype} {tuple(t.shape)}")
        images = t.permute(0, 3, 1, 2).float() / 255  # [B, 3, H, W]
    else:
        if t.dtype != torch.float32 or t.ndim != 4 or t.shape[1] != 3:
            raise WireError(prefix, f"expected float32 [B, 3, H, W], got {t.dtype} {tuple(t.shape)}")
        if not torch.isfinite(t).all():
            raise WireError(prefix, f"{int((~torch.isfinite(t)).sum())} NaN or infinite values")
        if t.numel() and (t.min() < 0 or t.max() > 1):
            raise WireError(prefix, f"values outside [0, 1] (min {float(t.min()):.4g}, max {float(t.max()):.4g})")
        images = t
    if images.shape[0] != n:
        raise WireError(prefix, f"{images.shape[0]} images for {n} prompts")
    if images.shape[2] * images.shape[3] > max_pixels:
        raise WireError(prefix, f"{images.shape[2]}x{images.shape[3]} exceeds the server's {max_pixels} pixels per image")
    return images


def decode_request(body: bytes, max_images: int = 4096, max_pixels: int = 4096 * 4096
                   ) -> tuple[torch.Tensor, list[str], dict[str, Any]]:
    """A request body -> ``(images float32 [B, 3, H, W] in [0, 1], prompts, reward keyword arguments)``;
    :class:`WireError` naming the field for anything malformed."""
    from safetensors.torch import load

    meta_json = _header(body).get("__metadata__") or {}
    if not isinstance(meta_json, dict) or "flowrl" not in meta_json:
        raise WireError("metadata.flowrl", "missing: the safetensors metadata needs the key 'flowrl' (a JSON object)")
    try:
        head = json.loads(meta_json["flowrl"], parse_constant=_refuse_constant)
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise WireError("metadata.flowrl", f"not a JSON object ({e})") from None
    if not isinstance(head, dict):
        raise WireError("metadata.flowrl", "not a JSON object")
    if head.get("version") != PROTOCOL:
        raise WireError("version", f"protocol {head.get('version')!r}; this server speaks {PROTOCOL}")
    encoding = head.get("encoding")
    if encoding not in ENCODINGS:
        raise WireError("encoding", f"{encoding!r}; one of {ENCODINGS}")
    prompts = head.get("prompts")
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise WireError("prompts", "expected a list of strings")
    if not prompts:
        raise WireError("prompts", "empty: send at least one image and its prompt")
    if len(prompts) > max_images:
        raise WireError("prompts", f"{len(prompts)} images exceed the server's limit of {max_images} per request")
    meta = head.get("meta", {})
    image_meta = head.get("image_meta", [])
    if not isinstance(meta, dict):
        raise WireError("meta", "expected a JSON object of the reward's keyword arguments")
    if not isinstance(image_meta, list) or not all(isinstance(k, str) for k in image_meta):
        raise WireError("image_meta", "expected a list of argument names")
    try:
        tensors = load(body)
    except Exception as e:  # noqa: BLE001 (the library's own parse errors: SafetensorError and friends)
        raise WireError("body", f"not a safetensors payload ({e})") from None
    n = len(prompts)
    counts = _image_counts(head, image_meta, n)
    images = _decode_images(tensors, "images", encoding, n, max_pixels)
    sizes = {"images": n}
    for k in image_meta:
        sizes[f"meta.{k}"] = sum(counts[k]) if k in counts else n
        meta[k] = _decode_images(tensors, f"meta.{k}", encoding, sizes[f"meta.{k}"], max_pixels)
        if k in counts:
            meta[k] = ImageRows(meta[k], tuple(counts[k])).rows()  # one entry per row
    expected = {f"{p}.png.{i}" for p, m in sizes.items() for i in range(m)} if encoding == "png" else set(sizes)
    extra = sorted(set(tensors) - expected)
    if extra:
        raise WireError(extra[0], f"unexpected tensor (encoding {encoding!r}, {n} prompts)")
    return images, prompts, meta


def _image_counts(head: dict, image_meta: list, n: int) -> dict[str, list[int]]:
    """The header's ``image_counts`` (several images per row), checked against the ``n`` prompts."""
    counts = head.get("image_counts", {})
    if not isinstance(counts, dict):
        raise WireError("image_counts", "expected an object: argument name -> images per row")
    for k, c in counts.items():
        if k not in image_meta:
            raise WireError(f"image_counts.{k}", "names no image argument (image_meta)")
        if not (isinstance(c, list) and len(c) == n and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1
                                                             for x in c)):
            raise WireError(f"image_counts.{k}", f"expected {n} positive integers, one per prompt")
    return counts


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON (send null for a missing value)")


# ---------------------------------------------------------------- response
def _as_list(field: str, scores: torch.Tensor, n: int) -> list:
    t = torch.as_tensor(scores).detach().to("cpu", torch.float32)
    if t.shape != (n,):
        raise WireError(field, f"the reward returned shape {tuple(t.shape)} for {n} images; expected [{n}]")
    if torch.isinf(t).any():
        raise WireError(field, "the reward returned an infinite score")
    return [None if math.isnan(v) else v for v in t.tolist()]


def encode_response(rewards: torch.Tensor, components: Mapping[str, torch.Tensor], n: int) -> dict:
    """The JSON response (NaN -> null) for ``rewards`` [n] and ``components`` name -> [n]."""
    return {"rewards": _as_list("rewards", rewards, n),
            "components": {k: _as_list(f"components.{k}", v, n) for k, v in components.items()}}


def _scores(field: str, values: Any, n: int) -> torch.Tensor:
    if not isinstance(values, list):
        raise WireError(field, f"expected a list of {n} numbers, got {type(values).__name__}")
    if len(values) != n:
        raise WireError(field, f"{len(values)} values for {n} images")
    if not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values):
        raise WireError(field, "expected numbers or null")
    return torch.tensor([float("nan") if v is None else float(v) for v in values], dtype=torch.float32)  # [n]


def decode_response(body: bytes, n: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A response body -> ``(rewards float32 [n], components name -> [n])``; :class:`WireError` naming
    the field when it is not one."""
    try:
        data = json.loads(body, parse_constant=_refuse_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        text = body[:200].decode("utf-8", "replace")
        raise WireError("response", f"not JSON ({e}): {text!r}") from None
    if not isinstance(data, dict) or "rewards" not in data:
        raise WireError("rewards", f"missing from the response {json.dumps(data)[:200]}")
    comps = data.get("components", {})
    if not isinstance(comps, dict):
        raise WireError("components", "expected an object name -> list")
    return _scores("rewards", data["rewards"], n), {str(k): _scores(f"components.{k}", v, n) for k, v in comps.items()}
