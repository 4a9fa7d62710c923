"""Offline group datasets on disk: the format, the index, and random access to stored groups.

The layout is described in :mod:`flowrl.data.offline`, which writes datasets; this module only
reads them (no sampling code), so training and benchmarks can read a dataset without the
generation machinery.
"""
from __future__ import annotations

import bisect
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch
from safetensors import safe_open

from ..seeding import stream_seed
from .items import item_from_record

FORMAT = "flowrl-offline-groups"
VERSION = 1
INDEX = "index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# spec keys that may change when resuming/extending a dataset without invalidating its shards
EXTENSIBLE = {"groups_per_prompt", "save_png"}


class DatasetError(ValueError):
    """An offline dataset is missing, incomplete or does not match the request; says how to fix it."""


def read_index(path: str | os.PathLike) -> dict:
    """``path/index.json`` as a dict; DatasetError if it is not an offline dataset."""
    p = Path(path) / INDEX
    if not p.is_file():
        raise DatasetError(f"{path} is not a flowrl offline dataset (no {INDEX}). Create one with "
                           f"`flowrl generate-offline --config RECIPE --out {path}`.")
    try:
        idx = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise DatasetError(f"{p} is not valid JSON ({e}); the dataset is damaged, regenerate it") from None
    if idx.get("format") != FORMAT or idx.get("version") != VERSION:
        raise DatasetError(f"{p}: format {idx.get('format')!r} v{idx.get('version')} is not "
                           f"{FORMAT!r} v{VERSION}; regenerate the dataset with this flowrl version")
    return idx


# ---------------------------------------------------------------- reading
@dataclass
class GroupBatch:
    """G groups of k samples read from a dataset."""

    group: torch.Tensor                 # [G] long, global group ids
    prompt_index: torch.Tensor          # [G] long
    prompts: list                       # [G] str, or PromptItem (an edit with its source image)
    seeds: torch.Tensor                 # [G, k] long
    x0: torch.Tensor                    # [G, k, C, H, W] float32
    rewards: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [G, k] float32


class OfflineDataset:
    """Random access to the groups of a dataset directory (memory-mapped shards, never loaded whole).

    ``len(ds)`` complete groups; ``ds.read([g, ...])`` -> :class:`GroupBatch`;
    ``ds.epoch_order(seed, epoch)`` a reproducible permutation of the group ids.
    """

    def __init__(self, path: str | os.PathLike):
        self.root = Path(path)
        self.index = read_index(self.root)
        self.shards = sorted(self.index["shards"], key=lambda s: s["start"])
        self._starts = [s["start"] for s in self.shards]
        self._handles: dict[str, object] = {}
        for s in self.shards:
            for f in set(s["columns"].values()):
                if not (self.root / f).is_file():
                    raise DatasetError(f"{self.root}: index lists {f}, which is missing. Rerun "
                                       f"`flowrl generate-offline` with the same --out to repair it.")

    # --- description
    def __len__(self) -> int:
        return sum(s["count"] for s in self.shards)

    @property
    def k(self) -> int:
        return int(self.index["spec"]["k"])

    @property
    def prompts(self) -> list:
        """The prompts (strings, or :class:`flowrl.data.items.PromptItem` s with their source images)."""
        return [item_from_record(r) for r in self.index["prompts"]]

    @property
    def spec(self) -> dict:
        return dict(self.index["spec"])

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return tuple(self.index["latent_shape"] or ())

    @property
    def reward_names(self) -> list[str]:
        """Reward columns present in every shard."""
        cols = [c for c in self.index["columns"] if c.startswith("reward/")]
        return [c.split("/", 1)[1] for c in cols if all(c in s["columns"] for s in self.shards)]

    @property
    def generation_seconds(self) -> float:
        """Seconds spent generating and scoring the dataset (all runs that wrote it)."""
        return float(self.index["generation_seconds"] + self.index["reward_seconds"])

    def group_ids(self) -> torch.Tensor:
        """``[N]`` long: ids of the complete groups, ascending."""
        if not self.shards:
            return torch.zeros(0, dtype=torch.long)
        return torch.cat([torch.arange(s["start"], s["start"] + s["count"]) for s in self.shards])

    def epoch_order(self, seed: int, epoch: int) -> torch.Tensor:
        """``[N]`` group ids in the reproducible shuffled order of ``epoch`` (depends only on
        (seed, epoch) and the ids present)."""
        ids = self.group_ids()
        g = torch.Generator().manual_seed(stream_seed("offline.order", seed, epoch))
        return ids[torch.randperm(len(ids), generator=g)]

    # --- reading
    def _locate(self, g: int) -> tuple[dict, int]:
        i = bisect.bisect_right(self._starts, int(g)) - 1
        if i < 0 or not self.shards[i]["start"] <= g < self.shards[i]["start"] + self.shards[i]["count"]:
            raise DatasetError(f"group {g} is not in the dataset {self.root} ({len(self)} groups)")
        s = self.shards[i]
        return s, int(g) - s["start"]

    def _handle(self, fname: str):
        if fname not in self._handles:
            try:
                self._handles[fname] = safe_open(str(self.root / fname), framework="pt", device="cpu")
            except Exception as e:  # noqa: BLE001 - truncated or overwritten file
                raise DatasetError(f"{self.root / fname} is damaged ({e}). Delete it and rerun `flowrl "
                                   f"generate-offline` with the same --out: missing shards are regenerated.") from e
        return self._handles[fname]

    def _row(self, shard: dict, column: str, row: int) -> torch.Tensor:
        return self._handle(shard["columns"][column]).get_slice(column)[row:row + 1]

    def read(self, groups: Sequence[int] | torch.Tensor, rewards: Optional[Sequence[str]] = None) -> GroupBatch:
        """The groups ``groups`` (in that order). ``rewards``: reward columns to load (default:
        all complete ones; ``[]``: none); a missing one is an error naming ``flowrl rescore-offline``."""
        ids = [int(g) for g in (groups.tolist() if torch.is_tensor(groups) else groups)]
        names = list(self.reward_names if rewards is None else rewards)
        missing = [n for n in names if n not in self.reward_names]
        if missing:
            raise DatasetError(f"dataset {self.root} has no reward column {missing[0]!r} (it has "
                               f"{self.reward_names or 'none'}). Add it without regenerating: "
                               f"`flowrl rescore-offline --dataset {self.root} --reward {missing[0]}`.")
        rows = [self._locate(g) for g in ids]
        x0 = torch.cat([self._row(s, "x0", r) for s, r in rows]).float() if rows else torch.zeros(0)
        seeds = torch.cat([self._row(s, "seeds", r) for s, r in rows]) if rows else torch.zeros(0, dtype=torch.long)
        pidx = torch.cat([self._row(s, "prompt_index", r) for s, r in rows]) if rows else torch.zeros(0, dtype=torch.long)
        rew = {n: torch.cat([self._row(s, f"reward/{n}", r) for s, r in rows]).float() for n in names}
        prompts = self.prompts
        return GroupBatch(group=torch.tensor(ids, dtype=torch.long), prompt_index=pidx,
                          prompts=[prompts[int(p)] for p in pidx], seeds=seeds, x0=x0, rewards=rew)

    def column(self, name: str) -> torch.Tensor:
        """A whole reward column ``[N, k]`` in group-id order (for statistics)."""
        return torch.cat([self._handle(s["columns"][f"reward/{name}"]).get_tensor(f"reward/{name}")
                          for s in self.shards]) if self.shards else torch.zeros(0, self.k)

    def close(self) -> None:
        self._handles.clear()

    def __repr__(self) -> str:
        return (f"OfflineDataset({str(self.root)!r}, groups={len(self)}, k={self.k}, "
                f"latent_shape={self.latent_shape}, rewards={self.reward_names})")
