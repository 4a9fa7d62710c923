"""Image datasets for the sampler-free updates: images with prompts (``sft``) and preference pairs (``dpo_offline``).

``data.dataset`` names one:

- **images** (``train.loss: sft``): a ``.jsonl`` file, one row per image, ``{"prompt": ..., "image": "a.png"}``
  (``caption`` / ``text`` for the prompt, ``file_name`` for the image, as Hugging Face's imagefolder writes
  it), paths relative to the file's folder; or a folder holding such a ``metadata.jsonl`` (or ``data.jsonl``,
  as ``digits`` and ``--smoke`` write it), or image files each
  with a ``.txt`` caption beside it (``a.png`` + ``a.txt``). An editing model's row adds its source image(s):
  ``"source": "src.png"`` (or a list of paths), and trains to turn the source into ``image``.
- **pairs** (``train.loss: dpo_offline``): a ``.jsonl`` file (or a folder holding ``pairs.jsonl``), one row per
  pair, ``{"prompt": ..., "chosen": "w.png", "rejected": "l.png"}`` (``preferred`` for ``chosen``), or
  Pick-a-Pic's layout ``{"caption": ..., "jpg_0": ..., "jpg_1": ..., "label_0": 1 | 0 | 0.5}`` (``label_0 = 1``:
  ``jpg_0`` preferred; ties, 0.5, are left out, as Diffusion-DPO's training did); ``source`` as above.
- ``digits``: scikit-learn's real digits (the training split; the held-out split is what the evaluation's
  real-data watch compares with), written once as PNGs + ``data.jsonl`` under ``$FLOWRL_HOME/datasets``:
  offline, the digits ship in scikit-learn's wheel.

Both read images lazily (``read(rows)``); the trainer draws rows as it draws an offline dataset's groups
(``epoch_order``: a permutation depending only on ``(seed, epoch)``). Images come back float32 ``[n, 3, H, W]``
in [0, 1]; the policy's ``encode`` turns them into latents.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from ..seeding import stream_seed
from ..utils.paths import flowrl_home
from .items import PromptItem, load_image
from .prompts import PromptSetError, jsonl_rows

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
PROMPT_FIELDS = ("prompt", "caption", "text")
IMAGE_FIELDS = ("image", "file_name")
SHIPPED = ("digits",)
INDEX_FILES = ("metadata.jsonl", "data.jsonl")  # what a folder of images may hold instead of .txt captions

__all__ = ["ImageDataset", "PairDataset", "ImageRow", "PairRow", "materialize_digits", "resolve_dataset",
           "open_image_set"]


@dataclass(frozen=True)
class ImageRow:
    prompt: Union[str, PromptItem]  # the text, or an edit (text + source images)
    image: Path                     # the target image


@dataclass(frozen=True)
class PairRow:
    prompt: Union[str, PromptItem]
    chosen: Path                    # the preferred image (Diffusion-DPO's x_w)
    rejected: Path                  # the rejected one (x_l)


def materialize_digits(out: Union[str, os.PathLike], split: str = "train") -> Path:
    """scikit-learn's digits ``split`` as ``out/NNNNN.png`` + ``out/data.jsonl`` (prompt "a handwritten digit d");
    written once (atomically: the JSONL last), returns the JSONL's path."""
    import json

    import numpy as np

    from ..utils.io import save_png, write_text
    from .digits import digit_prompt, digits_dataset

    root = Path(out)
    index = root / "data.jsonl"
    if index.is_file():
        return index
    x, y = digits_dataset(split)  # [N, 1, 16, 16] in [-1, 1], [N]
    pixels = ((x[:, 0] + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()  # [N, 16, 16]
    rows = []
    for i, (img, label) in enumerate(zip(pixels, y.tolist())):
        save_png(np.ascontiguousarray(img), root / f"{i:05d}.png")
        rows.append(json.dumps({"prompt": digit_prompt(label), "image": f"{i:05d}.png"}))
    write_text(index, "\n".join(rows) + "\n")
    return index


def resolve_dataset(source: Union[str, os.PathLike], pairs_file: str = "pairs.jsonl") -> Path:
    """The ``.jsonl`` file (or, for images, the folder) ``data.dataset`` names; ``digits`` is materialized first."""
    if str(source) in SHIPPED:
        return materialize_digits(flowrl_home() / "datasets" / "digits-train", "train")
    p = Path(source).expanduser()
    if p.is_dir() and (p / pairs_file).is_file():
        return p / pairs_file
    if not p.exists():
        raise FileNotFoundError(f"data.dataset {p} not found; give a .jsonl file, a folder of images with "
                                f"captions, or a shipped set ({', '.join(SHIPPED)})")
    return p


def _field(row: dict, names: Sequence[str], where: str, what: str):
    name = next((n for n in names if n in row), None)
    if name is None or not isinstance(row[name], str) or not row[name]:
        raise PromptSetError(f"{where}: needs a non-empty {what} field ({' or '.join(names)}), found {sorted(row)}")
    return row[name]


def _prompt(row: dict, folder: Path, where: str) -> Union[str, PromptItem]:
    text = _field(row, PROMPT_FIELDS, where, "prompt")
    if "source" not in row:
        return text
    src = row["source"]
    paths = src if isinstance(src, list) else [src]
    if not paths or not all(isinstance(s, str) and s for s in paths):
        raise PromptSetError(f"{where}: field 'source' must be a path or a list of paths, got {src!r}")
    resolved = [(folder / s).resolve() for s in paths]
    return PromptItem(text, resolved if isinstance(src, list) else resolved[0])


def _jsonl(path: Path) -> list[tuple[str, dict]]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PromptSetError(f"{path} is not UTF-8 ({e}); re-save it as UTF-8") from None
    out = []
    for i, row in jsonl_rows(text, path):
        if not isinstance(row, dict):
            raise PromptSetError(f"{path}:{i}: a row must be a JSON object, got {type(row).__name__}")
        out.append((f"{path}:{i}", row))
    return out


def _image_rows(path: Path) -> list[ImageRow]:
    if path.is_dir():
        for name in INDEX_FILES:
            if (path / name).is_file():
                return _image_rows(path / name)
        rows = []
        for img in sorted(q for q in path.iterdir() if q.suffix.lower() in IMAGE_EXTENSIONS):
            cap = img.with_suffix(".txt")
            if not cap.is_file():
                raise PromptSetError(f"{img}: no caption {cap.name} beside it; give each image a .txt caption, or "
                                     f"the folder a metadata.jsonl")
            rows.append(ImageRow(cap.read_text(encoding="utf-8").strip(), img.resolve()))
        return rows
    return [ImageRow(_prompt(row, path.parent, where), (path.parent / _field(row, IMAGE_FIELDS, where, "image")).resolve())
            for where, row in _jsonl(path)]


def _pair_row(where: str, row: dict, folder: Path) -> Optional[PairRow]:
    """A row of either layout (module doc), or None for a Pick-a-Pic tie."""
    prompt = _prompt(row, folder, where)
    if "jpg_0" in row:
        label = row.get("label_0")
        if label not in (0, 1, 0.5, 0.0, 1.0):
            raise PromptSetError(f"{where}: Pick-a-Pic's label_0 must be 1, 0 or 0.5, got {label!r}")
        if label == 0.5:
            return None
        a, b = _field(row, ("jpg_0",), where, "image"), _field(row, ("jpg_1",), where, "image")
        win, lose = (a, b) if label == 1 else (b, a)
    else:
        win = _field(row, ("chosen", "preferred"), where, "preferred image")
        lose = _field(row, ("rejected",), where, "rejected image")
    return PairRow(prompt, (folder / win).resolve(), (folder / lose).resolve())


class _RowDataset:
    """What the offline trainer asks of a dataset: its length, its prompts, a reproducible order per epoch."""

    rows: list
    generation_seconds = 0.0  # made elsewhere: no generation counted in compute_seconds

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def prompts(self) -> list:
        """The distinct prompts, in first-seen order (what the text-embedding cache encodes)."""
        return list(dict.fromkeys(r.prompt for r in self.rows))

    def epoch_order(self, seed: int, epoch: int) -> torch.Tensor:
        """``[N]`` row ids in the shuffled order of ``epoch`` (depends only on (seed, epoch) and N)."""
        g = torch.Generator().manual_seed(stream_seed("offline.order", seed, epoch))
        return torch.randperm(len(self.rows), generator=g)

    def close(self) -> None:
        pass

    def _check(self, where: str) -> None:
        if not self.rows:
            raise PromptSetError(f"data.dataset {where} holds no {self.kind}; add at least one row")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r}, rows={len(self)})"


class ImageDataset(_RowDataset):
    """``ImageDataset(source)``: the images with prompts of ``source`` (module doc) for supervised fine-tuning."""

    kind = "images"

    def __init__(self, source: Union[str, os.PathLike]):
        self.root = resolve_dataset(source)
        self.rows = _image_rows(self.root)
        self._check(str(source))

    def read(self, ids: Union[Sequence[int], torch.Tensor]) -> tuple[list, torch.Tensor]:
        """``(prompts [n], images [n, 3, H, W] float32 in [0, 1])`` of rows ``ids``."""
        rows = [self.rows[int(i)] for i in ids]
        return [r.prompt for r in rows], torch.stack([load_image(r.image) for r in rows])


class PairDataset(_RowDataset):
    """``PairDataset(source)``: the preference pairs of ``source`` (module doc) for offline Diffusion-DPO."""

    kind = "pairs"

    def __init__(self, source: Union[str, os.PathLike]):
        self.root = Path(source) if str(source) in SHIPPED else resolve_dataset(source)
        if str(source) in SHIPPED or self.root.is_dir():
            raise PromptSetError(f"data.dataset {source}: a pair dataset is a .jsonl file (or a folder holding "
                                 f"pairs.jsonl); make one from a generate-offline dataset with `flowrl make-pairs`")
        rows = [_pair_row(where, row, self.root.parent) for where, row in _jsonl(self.root)]
        self.ties = sum(r is None for r in rows)
        self.rows = [r for r in rows if r is not None]
        self._check(str(source))

    def read(self, ids: Union[Sequence[int], torch.Tensor]) -> tuple[list, torch.Tensor, torch.Tensor]:
        """``(prompts [n], chosen [n, 3, H, W], rejected [n, 3, H, W])``, images float32 in [0, 1]."""
        rows = [self.rows[int(i)] for i in ids]
        return ([r.prompt for r in rows], torch.stack([load_image(r.chosen) for r in rows]),
                torch.stack([load_image(r.rejected) for r in rows]))


def open_image_set(kind: str, source: Union[str, os.PathLike]) -> _RowDataset:
    """The dataset ``source`` read as ``kind``: ``images`` (:class:`ImageDataset`) or ``pairs`` (:class:`PairDataset`);
    a missing or malformed one is a ``ConfigError`` naming ``data.dataset``."""
    from ..errors import ConfigError

    cls = {"images": ImageDataset, "pairs": PairDataset}[kind]
    try:
        return cls(source)
    except (FileNotFoundError, PromptSetError, ValueError) as e:
        raise ConfigError(f"data.dataset: {e}") from None
