"""A ``flowrl bench methods`` row of an update on a dataset (``Needs.consumes == "dataset"``: offline GDRO, SFT,
offline Diffusion-DPO), on the footing of the online rows.

What the dataset needs is made first and its seconds count: a ``generate-offline`` dataset of the recipe's
``offline`` section for an update reading groups or pairs (generation + scoring, as ``flowrl bench offline``
counts them), its pairs by the first reward of ``reward.weights`` (``flowrl make-pairs``); an image dataset
(``data.dataset``, e.g. the real digits) is read as it is. Then optimizer steps run until the budget of seconds
(dataset + steps; evaluation excluded) is spent or the recipe's steps are done. Curve points have the online rows'
keys: ``train_seconds`` (dataset + steps so far), ``iteration`` (steps), ``samples`` (images the dataset generated
plus, for an image dataset, the images the steps read).
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np

from ..trainers.offline import OfflineTrainer, generate_offline, make_pairs
from .offline import QUIET
from .training import Variant, _point, real_reference


def _dataset(cfg, variant: Variant, recipe: str, workdir: Path, progress: bool) -> tuple:
    """(the config with its dataset, seconds spent making it, images generated)."""
    kind = cfg.train.update_needs.data
    if kind == "images":
        return cfg, 0.0, 0
    t0 = time.perf_counter()
    gen = generate_offline(cfg, str(workdir / "dataset"), progress=progress)
    more = [f"offline.dataset={workdir / 'dataset'}"]
    if kind == "pairs":
        pairs = make_pairs(str(workdir / "dataset"), str(workdir / "pairs"), next(iter(cfg.reward.weights)), cfg)
        more.append(f"data.dataset={pairs['path']}")
    seconds = time.perf_counter() - t0
    if progress:
        print(f"  dataset: {gen['groups']} groups x k={gen['k']} in {seconds:.1f}s", flush=True)
    return variant.config(recipe, QUIET + more), seconds, gen["groups"] * gen["k"]


def run_dataset_variant(recipe: str, variant: Variant, budget_seconds: float, eval_every_seconds: float,
                        workdir: Optional[Path] = None, progress: bool = True, headline: Optional[str] = None) -> dict:
    """Make the variant's dataset, then train it for ``budget_seconds`` of dataset + step seconds -> the
    result dict of :func:`flowrl.bench.training.run_variant` (plus ``dataset_seconds``; ``headline`` as there)."""
    work = Path(tempfile.mkdtemp(prefix="flowrl-bench-data-", dir=workdir))
    cfg, data_s, generated = _dataset(variant.config(recipe, QUIET), variant, recipe, work, progress)
    tr = OfflineTrainer(cfg, work / "run")
    tr.setup()
    real = real_reference(tr, headline)
    per_step = cfg.offline.batch_groups * cfg.train.grad_accum  # units a step reads
    read = per_step * {"images": 1}.get(cfg.train.update_needs.data, 0)  # images read per step (sft)
    ev0, _ = tr.evaluate(0)
    curve = [_point(0.0, 0, 0, ev0, headline=headline)] + (
        [_point(data_s, 0, generated, ev0, headline=headline)] if data_s else [])
    step, next_eval, per_iter = 0, data_s + eval_every_seconds, []
    while data_s + tr.train_seconds < budget_seconds and step < tr.total_steps:
        t0 = time.perf_counter()
        met = tr.run_step(step)
        per_iter.append(time.perf_counter() - t0)
        step += 1
        spent = data_s + tr.train_seconds
        if progress:
            print(f"  step {step:4d}  {spent:7.1f}s  loss {met.get('loss', float('nan')):.3f}", flush=True)
        if spent >= next_eval or spent >= budget_seconds or step == tr.total_steps:
            ev, _ = tr.evaluate(step)
            curve.append(_point(spent, step, generated + step * read, ev, headline=headline))
            next_eval += eval_every_seconds
    tr.acc.end_training()
    tr.close()
    return {"recipe": Path(variant.recipe or recipe).name, "sampler": {"name": "dataset"}, "loss": cfg.train.loss,
            "overrides": list(variant.overrides), "iterations": step, "train_seconds": data_s + tr.train_seconds,
            "dataset_seconds": data_s, "seconds_per_iteration": float(np.mean(per_iter)) if per_iter else float("nan"),
            "rollout_seconds_per_iteration": float("nan"), "model_evals_per_iteration": float("nan"),
            "samples_per_iteration": read, "samples_drawn": generated + step * read,
            "final_eval_reward": curve[-1]["eval_reward"], "real": real, "curve": curve}
