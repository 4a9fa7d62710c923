"""Prompt items: a text prompt that may carry a condition beyond text (source images to edit).

A :class:`PromptItem` is what an editing prompt set holds per row: the instruction (``prompt``), its
source image or images (each a file path or a float ``[3, H, W]`` tensor in [0, 1]; one to
:data:`MAX_SOURCES`, in order: "picture 1", "picture 2", ...) and free-form ``meta`` (the other
fields of its row). :mod:`flowrl.conditions` splits items into texts and sources for the policy and
the rewards; nothing else looks inside them.

What a reward receives per row (``item.image``, the ``sources=`` entries): None (text only), the
``[3, H, W]`` tensor (one source) or a tuple of them (several, in order). :func:`row_sources` turns
any of the three into a tuple.

Identity: :attr:`PromptItem.key` is a stable string for caches and dict keys. A text-only item's
key is its prompt, so text-only items key exactly as plain prompt strings do; an item with sources
appends a content hash of the decoded source pixels, in order (``"<prompt>\\x1fsha256:<16 hex>"``),
so the same images given as paths or as the tensors read from them give the same key, and a changed
file gives a new one. Equality and hashing use the key; ``meta`` is not part of it.

Editing sets are ``.jsonl`` files, one row per item: ``{"prompt": ..., "image": ...}`` with the
image path relative to the ``.jsonl`` file's folder (Flow-GRPO's editing sets use these two
fields), or ``"image": ["a.png", "b.png"]`` for several sources in order; the instruction may also
be named ``instruction``. :func:`load_edit_set` reads one and checks every image before returning,
with one-line errors that name the file, the row and the image.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

Source = Union[str, os.PathLike, torch.Tensor]
MAX_SOURCES = 3  # source images per prompt (Qwen-Image-Edit-2509 / 2511 take one to three)
# fields a row's instruction may have, tried in order; the image path's field
INSTRUCTION_FIELDS = ("prompt", "instruction")
IMAGE_FIELD = "image"
KEY_SEPARATOR = "\x1f"  # ASCII unit separator: never typed in a prompt

__all__ = ["PromptItem", "Source", "as_items", "load_edit_set", "load_image", "item_texts", "item_sources",
           "item_record", "item_from_record", "is_edit_row", "row_sources", "sources_per_row", "INSTRUCTION_FIELDS",
           "IMAGE_FIELD", "MAX_SOURCES"]


def load_image(path: Union[str, os.PathLike]) -> torch.Tensor:
    """An image file as float32 RGB ``[3, H, W]`` in [0, 1] (greyscale and palette images are
    converted to RGB, alpha is dropped). A missing or unreadable file is an error naming it."""
    from PIL import Image, UnidentifiedImageError

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"source image {p} not found")
    try:
        with Image.open(p) as im:
            rgb = im.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise ValueError(f"source image {p} is not a readable image ({type(e).__name__}: {e})") from None
    pixels = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)  # [H * W * 3]
    return pixels.view(rgb.height, rgb.width, 3).permute(2, 0, 1).float() / 255.0  # [3, H, W]


def _check_image_tensor(x: torch.Tensor) -> torch.Tensor:
    if not (x.ndim == 3 and x.shape[0] == 3 and x.is_floating_point()):
        raise ValueError(f"a source image tensor must be float [3, H, W] in [0, 1]; got {x.dtype} {tuple(x.shape)}")
    lo, hi = float(x.min()), float(x.max())
    if lo < 0 or hi > 1:
        raise ValueError(f"a source image tensor must hold values in [0, 1]; got [{lo:.3g}, {hi:.3g}]")
    return x


def _one_source(src, where: str = "PromptItem.source"):
    """A source as kept: a ``Path`` or a checked float ``[3, H, W]`` tensor."""
    if isinstance(src, (str, os.PathLike)):
        return Path(src)
    if isinstance(src, torch.Tensor):
        return _check_image_tensor(src)
    raise TypeError(f"{where} must be None, a path or a float [3, H, W] tensor (or a list of 1 to {MAX_SOURCES} "
                    f"of those); got {type(src).__name__}")


def _hash_pixels(h, pixels: torch.Tensor) -> None:
    pixels = pixels.contiguous()  # [3, H, W] float32
    h.update(str(tuple(pixels.shape)).encode())
    h.update(pixels.numpy().tobytes())


@dataclass(frozen=True, eq=False)
class PromptItem:
    """A prompt and optional source images (module doc).

    Args:
        prompt: the text (for editing: the instruction).
        source: None (text only), one source (an image file path or a float ``[3, H, W]`` tensor in
            [0, 1]), or a list / tuple of 1 to :data:`MAX_SOURCES` of them, in order (a list of one
            is that one source).
        meta: the row's other fields (targets, tags, ...); not part of :attr:`key`.
    """

    prompt: str
    source: Optional[Union[Source, Sequence[Source]]] = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.prompt, str):
            raise TypeError(f"PromptItem.prompt must be a str, got {type(self.prompt).__name__}")
        src = self.source
        if isinstance(src, (list, tuple)):
            if not 1 <= len(src) <= MAX_SOURCES:
                raise ValueError(f"PromptItem.source: {len(src)} source images; a prompt takes 1 to {MAX_SOURCES}")
            many = tuple(_one_source(x, f"PromptItem.source[{i}]") for i, x in enumerate(src))
            object.__setattr__(self, "source", many[0] if len(many) == 1 else many)
        elif src is not None:
            object.__setattr__(self, "source", _one_source(src))
        if not isinstance(self.meta, dict):
            raise TypeError(f"PromptItem.meta must be a dict, got {type(self.meta).__name__}")

    @property
    def has_source(self) -> bool:
        return self.source is not None

    @property
    def sources(self) -> tuple:
        """The sources as given (paths or tensors), in order; ``()`` for a text-only item."""
        return () if self.source is None else self.source if isinstance(self.source, tuple) else (self.source,)

    @property
    def num_sources(self) -> int:
        return len(self.sources)

    @cached_property
    def images(self) -> tuple[torch.Tensor, ...]:
        """Every source as float32 ``[3, H, W]`` in [0, 1], in order (read once from paths, then kept;
        treat them as read-only); ``()`` for a text-only item."""
        return tuple(s.detach().to("cpu", torch.float32) if isinstance(s, torch.Tensor) else
                     _check_image_tensor(load_image(s)) for s in self.sources)

    @property
    def image(self) -> Union[None, torch.Tensor, tuple[torch.Tensor, ...]]:
        """What a reward receives for this row (``sources=``): None (text only), the source ``[3, H, W]``
        (one source) or the tuple of :attr:`images` (several, in order)."""
        if self.source is None:
            return None
        return self.images if isinstance(self.source, tuple) else self.images[0]

    @cached_property
    def key(self) -> str:
        """Stable cache key: the prompt, plus the source pixels' content hash (in order) when there are sources."""
        if self.source is None:
            return self.prompt
        h = hashlib.sha256()
        if isinstance(self.source, tuple):
            h.update(f"{len(self.images)} sources".encode())
            for pixels in self.images:
                _hash_pixels(h, pixels)
        else:  # one source: the key it has always had
            _hash_pixels(h, self.images[0])
        return f"{self.prompt}{KEY_SEPARATOR}sha256:{h.hexdigest()[:16]}"

    def __eq__(self, other) -> bool:
        return isinstance(other, PromptItem) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        shown = [str(s) if isinstance(s, Path) else f"tensor{tuple(s.shape)}" for s in self.sources]
        src = None if not shown else shown[0] if len(shown) == 1 else shown
        return f"PromptItem(prompt={self.prompt!r}, source={src!r})"

    def __getstate__(self) -> dict:
        # the cached decoded images are dropped when every source is a path (they reload on demand); the key is kept
        state = dict(self.__dict__)
        if self.sources and all(isinstance(s, Path) for s in self.sources):
            state.pop("images", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


def sources_per_row(sources, n: int, who: str) -> list[tuple[torch.Tensor, ...]]:
    """The ``sources=`` of ``n`` rows as :func:`row_sources` tuples (all ``()`` for None); a count other than ``n``
    is one ``ValueError`` naming ``who`` (the reward)."""
    rows = [()] * n if sources is None else [row_sources(s) for s in sources]
    if len(rows) != n:
        raise ValueError(f"{who} got {n} images but {len(rows)} sources; pass one source (or None) per image")
    return rows


def row_sources(entry) -> tuple[torch.Tensor, ...]:
    """One row's ``sources=`` entry (None, a ``[3, H, W]`` tensor, or a sequence of them) as a tuple of
    ``[3, H, W]`` tensors, in order (``()`` for None)."""
    if entry is None:
        return ()
    if isinstance(entry, torch.Tensor):
        return (entry,)
    return tuple(entry)


def as_items(prompts: Sequence[Union[str, PromptItem]]) -> list[PromptItem]:
    """Prompts as items: a ``str`` becomes a text-only :class:`PromptItem`, an item stays as it is."""
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, PromptItem):
            out.append(p)
        elif isinstance(p, str):
            out.append(PromptItem(p))
        else:
            raise TypeError(f"prompt {i} is {type(p).__name__}; a prompt is a str or a PromptItem")
    return out


def item_texts(items: Sequence[Union[str, PromptItem]]) -> list[str]:
    """The text of each prompt or item (what text encoders and text-only rewards see)."""
    return [it.prompt for it in as_items(items)]


def item_sources(items: Sequence[Union[str, PromptItem]]) -> list:
    """Each item's :attr:`PromptItem.image` (None, ``[3, H, W]``, or a tuple of them for several sources,
    in order): the ``sources=`` a reward receives."""
    return [it.image for it in as_items(items)]


def item_record(prompt: Union[str, PromptItem]):
    """A prompt as a JSON value (what an offline dataset's index stores): a string stays a string, and
    so does a text-only item; an item with a source file is ``{"prompt", "image": absolute path,
    "meta"}``, with several ``"image": [absolute paths, in order]``. A tensor source has no file to name:
    an error (load the set from a ``.jsonl`` file)."""
    if isinstance(prompt, str) or prompt.source is None:
        return prompt if isinstance(prompt, str) else prompt.prompt
    if any(isinstance(s, torch.Tensor) for s in prompt.sources):
        raise ValueError(f"prompt item {prompt.prompt!r} holds its source as a tensor, which cannot be stored; "
                         f"give the editing set as a .jsonl file with image paths")
    paths = [str(Path(s).resolve()) for s in prompt.sources]
    return {"prompt": prompt.prompt, IMAGE_FIELD: paths[0] if len(paths) == 1 else paths, "meta": dict(prompt.meta)}


def item_from_record(record) -> Union[str, PromptItem]:
    """The inverse of :func:`item_record`."""
    if isinstance(record, str):
        return record
    return PromptItem(record["prompt"], record[IMAGE_FIELD], dict(record.get("meta") or {}))


def is_edit_row(row) -> bool:
    """Whether a ``.jsonl`` row is an editing row (an instruction and an ``image`` path or list of paths)."""
    return isinstance(row, dict) and IMAGE_FIELD in row and any(f in row for f in INSTRUCTION_FIELDS)


def _row_images(where: str, image, folder: Path, check: bool):
    """A row's ``image`` field (a path or a list of 1 to MAX_SOURCES paths, relative to ``folder``) as
    absolute paths (one path, or a list); ``check`` reads each now."""
    many = isinstance(image, list)
    paths = image if many else [image]
    if many and not 1 <= len(paths) <= MAX_SOURCES:
        raise ValueError(f"{where}: field 'image' lists {len(paths)} images; a row takes 1 to {MAX_SOURCES}")
    out = []
    for path in paths:
        if not isinstance(path, str) or not path:
            raise ValueError(f"{where}: field 'image' must be a path string or a list of 1 to {MAX_SOURCES} path "
                             f"strings, got {image!r}")
        src = (folder / path).resolve()
        if check:
            try:
                load_image(src)
            except (FileNotFoundError, ValueError) as e:
                raise type(e)(f"{where}: {e}") from None
        out.append(src)
    return out if many else out[0]


def load_edit_set(path: Union[str, os.PathLike], check_images: bool = True) -> list[PromptItem]:
    """An editing prompt set: a ``.jsonl`` file whose rows hold an instruction (``prompt`` or
    ``instruction``) and an ``image`` path relative to the file's folder, or a list of 1 to
    :data:`MAX_SOURCES` such paths in order (module doc); the row's other fields become the item's ``meta``. ``check_images`` reads every image now, so a missing or
    unreadable one fails here, naming the file, row and image, instead of mid-training."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"editing prompt set {p} not found; give a .jsonl file with one "
                                f'{{"prompt": ..., "image": ...}} row per edit')
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"editing prompt set {p} is not UTF-8 ({e}); re-save it as UTF-8") from None
    items = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{p}:{i}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a row must be a JSON object with 'prompt' and 'image', "
                             f"got {type(row).__name__}")
        text_field = next((f for f in INSTRUCTION_FIELDS if f in row), None)
        missing = [name for name, ok in (("prompt (or instruction)", text_field), (IMAGE_FIELD, IMAGE_FIELD in row))
                   if not ok]
        if missing:
            raise ValueError(f"{where}: missing field {' and '.join(missing)} (found {sorted(row)})")
        text, image = row[text_field], row[IMAGE_FIELD]
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{where}: field {text_field!r} must be a non-empty string, got {text!r}")
        src = _row_images(where, image, p.parent, check_images)
        meta = {k: v for k, v in row.items() if k not in (text_field, IMAGE_FIELD)}
        items.append(PromptItem(text, src, meta))
    if not items:
        raise ValueError(f"editing prompt set {p} is empty; add at least one row")
    return items
