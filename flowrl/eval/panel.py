"""Sampling and scoring one model on a suite: every prompt x every seed, each sample scored by every
reward of the panel, plus the reward-hacking watch (per-sample high-frequency energy, per-prompt
diversity over its seeds). Work goes in chunks of whole prompts; each finished chunk is written
atomically (``samples/<model>/chunk_NNNNN.json`` and a thumbnail of each prompt's first seed), so an
interrupted evaluation resumes at the first missing chunk. A chunk's samples are those of an
uninterrupted run: seed ``i`` of the whole plan is ``derive_seeds(seed, P * S)[i]``, prompt-major,
as ``flowrl eval`` has always drawn them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from flowrl.diagnostics import high_frequency_energy, within_group_diversity
from flowrl.errors import ConfigError
from flowrl.scoring import score_images
from flowrl.rollout.ode import ode_sample
from flowrl.utils.io import save_png, write_json
from flowrl.utils.progress import progress

from .suites import Suite

THUMB = 128  # thumbnail side in pixels (small images are enlarged with nearest neighbours)


@dataclass
class Plan:
    """What every model is evaluated on: the suite, ``per_prompt`` seeds of each prompt, the panel's
    reward options, the chunking."""

    suite: Suite
    per_prompt: int
    seeds: list  # [P * S] prompt-major
    rewards: dict  # name -> options
    prompts_per_chunk: int
    max_batch: Optional[int] = None

    @property
    def chunks(self) -> list[range]:
        n = len(self.suite.items)
        return [range(s, min(s + self.prompts_per_chunk, n)) for s in range(0, n, self.prompts_per_chunk)]


@dataclass
class ModelScores:
    """One model's results: each reward's ``[P, S]`` scores, the watch's ``hf_energy`` ``[P, S]`` and
    ``diversity`` ``[P]`` (NaN: not applicable)."""

    scores: dict
    hf_energy: np.ndarray
    diversity: np.ndarray


def build_panel(rewards: dict) -> dict:
    """``{name: options}`` -> ``{name: reward}`` (built once, shared by every model)."""
    from flowrl.rewards import build

    panel = {}
    for name, opts in rewards.items():
        try:
            panel[name] = build(name, **(opts or {}))
        except TypeError as e:
            raise ConfigError(f"reward {name!r} does not take the options {sorted(opts or {})}: {e}") from None
    return panel


def thumbnail(image: torch.Tensor) -> np.ndarray:
    """``[3, H, W]`` in [0, 1] -> uint8 ``[h, w, 3]`` at most :data:`THUMB` px (nearest upscaling of
    small images, area-averaged downscaling of large ones)."""
    if image.ndim == 4:  # a video [3, F, H, W]: its first frame
        image = image[:, 0]
    x = image.detach().float().clamp(0, 1)[None]  # [1, 3, H, W]
    h, w = x.shape[-2:]
    if max(h, w) < THUMB // 2:
        k = THUMB // (2 * max(h, w)) * 2
        x = x.repeat_interleave(k, 2).repeat_interleave(k, 3)
    elif max(h, w) > THUMB:
        s = THUMB / max(h, w)
        x = torch.nn.functional.interpolate(x, size=(round(h * s), round(w * s)), mode="area")
    return (x[0].permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()


def _nan_to_none(rows):
    return [[None if v != v else v for v in r] for r in rows]


class Store:
    """One model's finished chunks on disk (``root/samples/<slug>``), or nothing without a root."""

    def __init__(self, root: Optional[Path], slug: str, fingerprint: dict):
        self.dir = Path(root) / "samples" / slug if root is not None else None
        if self.dir is None:
            return
        marker = self.dir / "model.json"
        if marker.is_file():
            old = json.loads(marker.read_text())
            diff = sorted(k for k in set(old) | set(fingerprint) if old.get(k) != fingerprint.get(k))
            if diff:
                raise ConfigError(f"{self.dir} holds an evaluation of {slug!r} with other settings ({', '.join(diff)} "
                                  f"differ); give another --out, or delete {self.dir} to evaluate it again")
        else:
            write_json(fingerprint, marker)

    def load(self, index: int) -> Optional[dict]:
        f = self.dir / f"chunk_{index:05d}.json" if self.dir else None
        return json.loads(f.read_text()) if f is not None and f.is_file() else None

    def save(self, index: int, data: dict, thumbs: dict) -> None:
        if self.dir is None:
            return
        for p, image in thumbs.items():
            save_png(thumbnail(image), self.thumb_path(p))
        write_json({**data, "scores": {k: _nan_to_none(v) for k, v in data["scores"].items()},
                    "hf_energy": _nan_to_none(data["hf_energy"]), "diversity": _nan_to_none([data["diversity"]])[0]},
                   self.dir / f"chunk_{index:05d}.json")

    def thumb_path(self, prompt_index: int) -> Optional[Path]:
        return thumb_path(self.dir.parent.parent, self.dir.name, prompt_index) if self.dir else None


def thumb_path(root: Path, slug: str, prompt_index: int) -> Path:
    """Where a model's first-seed image of a prompt is kept under ``--out``."""
    return Path(root) / "samples" / slug / "thumbs" / f"p{prompt_index:05d}.png"


def score_chunk(panel: dict, images: torch.Tensor, rows: list, per_prompt: int) -> dict:
    """Every panel reward and the watch on one chunk of ``len(rows)`` samples (whole prompts)."""
    prompts = [it.prompt for it in rows]
    scores = {}
    for name, reward in panel.items():
        kw = {"metadata": [it.meta or None for it in rows]} if getattr(reward, "takes_metadata", False) else {}
        r, _ = score_images(reward, images, prompts, **kw)
        scores[name] = r.view(-1, per_prompt).tolist()  # [p, S]
    hf = [high_frequency_energy(images[i:i + 1]) for i in range(images.shape[0])]
    groups = torch.zeros(per_prompt, dtype=torch.long)
    div = [within_group_diversity(images[i:i + per_prompt], groups) for i in range(0, images.shape[0], per_prompt)]
    return {"scores": scores, "hf_energy": torch.tensor(hf).view(-1, per_prompt).tolist(), "diversity": div}


def evaluate_model(policy, steps: int, plan: Plan, panel: dict, store: Store, label: str) -> ModelScores:
    """Sample and score every chunk of ``plan`` not yet in ``store`` (module doc)."""
    S, items = plan.per_prompt, plan.suite.items
    done = {i: store.load(i) for i in range(len(plan.chunks))}
    todo = [i for i, d in done.items() if d is None]
    if len(todo) < len(plan.chunks):
        print(f"[flowrl] {label}: resuming, {len(plan.chunks) - len(todo)} of {len(plan.chunks)} chunks already "
              f"scored in {store.dir}", flush=True)
    finished = sum(len(plan.chunks[i]) for i, d in done.items() if d is not None) * S
    bar = progress(total=len(items) * S, initial=finished, desc=f"flowrl eval {label}", unit="sample")
    for i in todo:
        chunk = plan.chunks[i]
        rows = [items[p] for p in chunk for _ in range(S)]
        seeds = [plan.seeds[p * S + s] for p in chunk for s in range(S)]
        with torch.no_grad():
            _, images = ode_sample(policy, [it.prompt for it in rows], seeds, steps, max_batch=plan.max_batch)
        data = {"prompts": list(chunk), **score_chunk(panel, images, rows, S)}
        store.save(i, data, {p: images[k * S] for k, p in enumerate(chunk)})
        done[i] = data
        bar.update(len(rows))
    bar.close()
    return _collect(done, plan)


def _collect(done: dict, plan: Plan) -> ModelScores:
    P, S = len(plan.suite.items), plan.per_prompt
    scores = {k: np.full((P, S), np.nan) for k in plan.rewards}
    hf, div = np.full((P, S), np.nan), np.full(P, np.nan)
    for data in done.values():
        idx = data["prompts"]
        for k in plan.rewards:
            scores[k][idx] = np.array(data["scores"][k], dtype=np.float64)  # None -> nan
        hf[idx] = np.array(data["hf_energy"], dtype=np.float64)
        div[idx] = np.array(data["diversity"], dtype=np.float64)
    return ModelScores(scores, hf, div)
