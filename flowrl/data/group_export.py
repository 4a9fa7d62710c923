"""A ``flowrl generate-offline`` dataset turned into an image dataset (:mod:`flowrl.data.image_sets`): preference
pairs by a reward column (``flowrl make-pairs``, for ``train.loss: dpo_offline``), or every image with its prompt
(for ``train.loss: sft``).

Pairs: per group, its best and its worst image by the stored reward (``reward/<name>``), the best preferred;
a group whose best and worst are equal or not finite carries no preference and is left out (unless
``keep_ties``). Images are decoded by the caller's ``decode`` (the model the dataset was generated with) and
written as PNGs beside ``pairs.jsonl`` / ``data.jsonl`` (rows: ``prompt``, ``chosen`` / ``rejected`` or ``image``,
the rewards, an edit's ``source`` paths).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np
import torch

from ..utils.images import to_uint8
from ..utils.io import save_png, write_text
from .items import PromptItem
from .offline_store import DatasetError, OfflineDataset

__all__ = ["export_pairs", "export_images"]

Decode = Callable[[torch.Tensor], torch.Tensor]  # latents [n, C, h, w] -> images [n, 3, H, W] in [0, 1]


def _png(image: torch.Tensor, path: Path) -> str:
    save_png(to_uint8(image).permute(1, 2, 0).cpu().numpy(), path)  # [H, W, 3]
    return path.name


def _prompt_fields(prompt) -> dict:
    if not isinstance(prompt, PromptItem) or not prompt.has_source:
        return {"prompt": prompt if isinstance(prompt, str) else prompt.prompt}
    paths = [str(Path(s).resolve()) for s in prompt.sources]
    return {"prompt": prompt.prompt, "source": paths[0] if len(paths) == 1 else paths}


def _groups(ds: OfflineDataset, chunk: int):
    ids = ds.group_ids().tolist()
    for a in range(0, len(ids), chunk):
        yield ids[a:a + chunk]


def export_pairs(dataset: Union[str, os.PathLike], out: Union[str, os.PathLike], reward: str, decode: Decode, *,
                 keep_ties: bool = False, chunk: int = 64) -> dict:
    """Write ``out/pairs.jsonl`` (+ PNGs): each group's best vs worst image by column ``reward``. Returns
    ``{"pairs", "groups", "ties", "path", "reward_chosen", "reward_rejected"}`` (the means of the pairs' rewards)."""
    ds = OfflineDataset(dataset)
    if reward not in ds.reward_names:
        raise DatasetError(f"{dataset} has no reward column {reward!r} (it has {ds.reward_names or 'none'}); add it "
                           f"with `flowrl rescore-offline --dataset {dataset} --reward {reward}`")
    root = Path(out)
    rows, ties, won, lost = [], 0, [], []
    for ids in _groups(ds, chunk):
        batch = ds.read(ids, rewards=[reward])
        r = batch.rewards[reward]  # [G, k]
        order = torch.argsort(torch.nan_to_num(r, nan=-torch.inf), dim=1, descending=True)  # [G, k]
        for g in range(len(ids)):
            best, worst = int(order[g, 0]), int(order[g, -1])
            rb, rw = float(r[g, best]), float(r[g, worst])
            if not keep_ties and not (np.isfinite(rb) and np.isfinite(rw) and rb > rw):
                ties += 1
                continue
            images = decode(batch.x0[g, [best, worst]])  # [2, 3, H, W]
            gid = int(batch.group[g])
            rows.append({**_prompt_fields(batch.prompts[g]), "chosen": _png(images[0], root / f"g{gid:06d}_w.png"),
                         "rejected": _png(images[1], root / f"g{gid:06d}_l.png"), "reward_chosen": rb,
                         "reward_rejected": rw, "group": gid})
            won.append(rb)
            lost.append(rw)
    ds.close()
    if not rows:
        raise DatasetError(f"{dataset}: no group has a best image better than its worst by {reward!r}; nothing to pair")
    path = write_text(root / "pairs.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    return {"pairs": len(rows), "groups": len(rows) + ties, "ties": ties, "path": str(path),
            "reward_chosen": float(np.mean(won)), "reward_rejected": float(np.mean(lost))}


def export_images(dataset: Union[str, os.PathLike], out: Union[str, os.PathLike], decode: Decode,
                  chunk: int = 64, reward: Optional[str] = None) -> dict:
    """Write ``out/data.jsonl`` (+ PNGs): every image of the dataset with its prompt (and, with ``reward``, that
    column's value). Returns ``{"images", "path"}``."""
    ds = OfflineDataset(dataset)
    root = Path(out)
    rows = []
    for ids in _groups(ds, chunk):
        batch = ds.read(ids, rewards=[reward] if reward else [])
        for g in range(len(ids)):
            images = decode(batch.x0[g])  # [k, 3, H, W]
            gid = int(batch.group[g])
            for j, im in enumerate(images):
                extra = {"reward": float(batch.rewards[reward][g, j])} if reward else {}
                rows.append({**_prompt_fields(batch.prompts[g]), "image": _png(im, root / f"g{gid:06d}_s{j}.png"),
                             **extra})
    ds.close()
    path = write_text(root / "data.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    return {"images": len(rows), "path": str(path)}
