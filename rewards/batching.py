"""Request batching of the reward server (:mod:`flowrl.rewards.server`): concurrent requests whose image
sizes and shared arguments agree are merged into one reward call of at most ``max_batch`` images, run
on one worker thread; each request gets back exactly its own rows.

An argument that is a JSON list with one value per image is per-sample (concatenated when requests
merge); image arguments ``[B, 3, H, W]`` are concatenated too; any other argument must be equal for
requests to merge.
"""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from ._wire import WireError


def _call(reward, images: torch.Tensor, prompts: list[str], meta: dict) -> tuple[torch.Tensor, dict]:
    """One reward call -> (total [B], components)."""
    if hasattr(reward, "components") and hasattr(reward, "combine"):
        comps = reward.components(images, prompts, **meta)
        return reward.combine(comps), comps
    return reward(images, prompts, **meta), {}


class RewardRejected(Exception):
    """The reward refused the request's arguments (TypeError / ValueError): a 422."""


# ---------------------------------------------------------------- batching
@dataclass
class _Item:
    images: torch.Tensor  # [n, 3, H, W]
    prompts: list[str]
    meta: dict
    future: asyncio.Future
    per_sample: tuple = ()  # JSON arguments that are lists of one value per image
    key: str = ""

    def __post_init__(self) -> None:
        n = len(self.prompts)
        self.per_sample = tuple(sorted(k for k, v in self.meta.items() if isinstance(v, list) and len(v) == n))
        shared = {k: v for k, v in self.meta.items() if k not in self.per_sample and not isinstance(v, torch.Tensor)}
        images = sorted((k, tuple(v.shape[1:])) for k, v in self.meta.items() if isinstance(v, torch.Tensor))
        self.key = json.dumps([list(self.images.shape[1:]), shared, images, self.per_sample], sort_keys=True,
                              default=str)


def _packs(items: list[_Item], max_batch: int) -> Iterator[list[_Item]]:
    """Mergeable runs of ``items`` (same key), each at most ``max_batch`` images (a larger request alone)."""
    groups: dict[str, list[_Item]] = {}
    for it in items:
        groups.setdefault(it.key, []).append(it)
    for group in groups.values():
        pack, n = [], 0
        for it in group:
            if pack and n + len(it.prompts) > max_batch:
                yield pack
                pack, n = [], 0
            pack.append(it)
            n += len(it.prompts)
        if pack:
            yield pack


def _merge(pack: list[_Item]) -> tuple[torch.Tensor, list[str], dict]:
    if len(pack) == 1:
        return pack[0].images, pack[0].prompts, pack[0].meta
    meta = dict(pack[0].meta)
    for k, v in pack[0].meta.items():
        if isinstance(v, torch.Tensor):
            meta[k] = torch.cat([it.meta[k] for it in pack])
        elif k in pack[0].per_sample:
            meta[k] = [x for it in pack for x in it.meta[k]]
    return torch.cat([it.images for it in pack]), [p for it in pack for p in it.prompts], meta


class Batcher:
    """Merges concurrent requests into reward calls on one worker thread (module doc)."""

    def __init__(self, reward, max_batch: int, max_wait: float):
        self.reward, self.max_batch, self.max_wait = reward, int(max_batch), float(max_wait)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flowrl-serve")
        self.stats = {"requests": 0, "images": 0, "reward_calls": 0, "largest_call": 0}
        self.queue: Optional[asyncio.Queue] = None
        self.task: Optional[asyncio.Task] = None

    async def start(self) -> None:
        self.queue = asyncio.Queue()
        self.task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def score(self, images: torch.Tensor, prompts: list[str], meta: dict) -> tuple[torch.Tensor, dict]:
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put(_Item(images, prompts, meta, fut))
        return await fut

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = [await self.queue.get()]
            deadline = loop.time() + self.max_wait
            while sum(len(it.prompts) for it in items) < self.max_batch:
                try:
                    items.append(await asyncio.wait_for(self.queue.get(), max(0.0, deadline - loop.time())))
                except asyncio.TimeoutError:
                    break
            for pack in _packs(items, self.max_batch):
                await self._score(loop, pack)

    async def _score(self, loop, pack: list[_Item]) -> None:
        images, prompts, meta = _merge(pack)
        try:
            total, comps = await loop.run_in_executor(self.pool, self._call, images, prompts, meta)
        except Exception as e:  # noqa: BLE001 (handed to every request of the pack)
            for it in pack:
                if not it.future.done():
                    it.future.set_exception(e)
            return
        n_all = len(prompts)
        total = torch.as_tensor(total).detach().float().cpu()  # [N]
        comps = {k: torch.as_tensor(v).detach().float().cpu() for k, v in comps.items()}  # name -> [N]
        bad = [(k, tuple(v.shape)) for k, v in [("rewards", total), *comps.items()] if tuple(v.shape) != (n_all,)]
        if bad:
            err = WireError(bad[0][0], f"the reward returned shape {bad[0][1]} for {n_all} images; expected [{n_all}]")
            for it in pack:
                if not it.future.done():
                    it.future.set_exception(err)
            return
        self.stats["requests"] += len(pack)
        self.stats["images"] += n_all
        self.stats["reward_calls"] += 1
        self.stats["largest_call"] = max(self.stats["largest_call"], n_all)
        start = 0
        for it in pack:
            rows = slice(start, start + len(it.prompts))
            start = rows.stop
            if not it.future.done():
                it.future.set_result((total[rows], {k: v[rows] for k, v in comps.items()}))

    def _call(self, images, prompts, meta):
        with torch.no_grad():
            try:
                return _call(self.reward, images, prompts, meta)
            except (TypeError, ValueError) as e:
                raise RewardRejected(f"{type(e).__name__}: {e}") from e
