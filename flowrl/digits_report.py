"""``flowrl pretrain-digits``'s sample report: how well the digits base draws each digit.

Application layer (see ``flowrl.layers``): it combines the digits model, the digits reward and
the ODE sampler, so it lives above all three.

The report of a model is cached beside it (``report.json``, with the grid ``samples.png``) and
reused while the model's ``pretrain.json`` is unchanged: measuring it takes about a minute.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from .data.digits import digit_prompt
from .pipelines.digits import DigitsPolicy
from .rewards.digits import DigitsReward
from .rollout.ode import ode_sample
from .seeding import derive_seeds
from .utils.images import image_grid
from .utils.io import save_png, write_json

REPORT_JSON = "report.json"
PER_DIGIT, NUM_STEPS = 16, 20  # the report's samples per digit and ODE steps


@torch.no_grad()
def guidance_grid_report(policy_class, path: str | os.PathLike, grid_png: str | os.PathLike, prompts: list[str],
                         per_row: int, num_steps: int, guidances: tuple[float, ...],
                         score: Callable[[torch.Tensor], dict], scale: int = 3) -> dict:
    """Sample ``prompts`` from the base at ``path`` (``policy_class.from_pretrained``) at each guidance scale
    (ODE, fixed seeds), save one grid PNG (a block per guidance, ``per_row`` samples a row) and return
    ``score(images [N, 3, H, W])`` per guidance (``guidance_<g>``), the grid's path and the sample counts."""
    seeds = derive_seeds(777, len(prompts))
    report, blocks = {}, []
    for g in guidances:
        pol = policy_class.from_pretrained(path, guidance_scale=g)
        _, images = ode_sample(pol, prompts, seeds, num_steps)  # [N, 3, H, W]
        report[f"guidance_{g:g}"] = score(images)
        blocks.append(image_grid(images, nrow=per_row, scale=scale))
        blocks.append(np.full((blocks[-1].shape[0], 12, 3), 255, np.uint8))  # white gap between blocks
    save_png(np.concatenate(blocks[:-1], axis=1), Path(grid_png))
    report["grid"] = str(grid_png)
    report["samples"], report["ode_steps"] = len(prompts), num_steps
    return report


def sample_grid_report(path: str | os.PathLike, grid_png: str | os.PathLike, per_digit: int = PER_DIGIT,
                       num_steps: int = NUM_STEPS, guidances: tuple[float, ...] = (1.0, 3.0)) -> dict:
    """Sample every digit at each guidance scale (ODE, fixed seeds), save one grid PNG (a block
    per guidance, a row per digit) and return the digit classifier's accuracy and mean reward."""
    reward = DigitsReward()
    prompts = [digit_prompt(d) for d in range(10) for _ in range(per_digit)]
    labels = torch.tensor([d for d in range(10) for _ in range(per_digit)])  # [10 * per_digit]

    def score(images: torch.Tensor) -> dict:  # [10 * per_digit, 3, 16, 16]
        acc = (reward.probs(images).argmax(1) == labels).float().mean().item()
        return {"accuracy": acc, "reward": reward(images, prompts).mean().item()}
    return guidance_grid_report(DigitsPolicy, path, grid_png, prompts, per_digit, num_steps, guidances, score)


def cached_report(model_dir: str | os.PathLike, force: bool = False,
                  measure: Optional[Callable[[Path, Path], dict]] = None) -> dict:
    """``measure(model_dir, grid)`` (default :func:`sample_grid_report`: the digits base) of the base in
    ``model_dir`` (grid ``model_dir/samples.png``), read from ``model_dir/report.json`` when that was
    measured on this very model (the same ``pretrain.json``) and ``force`` is off; otherwise measured
    and cached there."""
    d = Path(model_dir)
    trained = (d / "pretrain.json").read_text() if (d / "pretrain.json").is_file() else None
    cache = d / REPORT_JSON
    if not force and cache.is_file():
        rec = json.loads(cache.read_text())
        if rec.get("pretrain") == trained and Path(rec["report"]["grid"]).is_file():
            print(f"[flowrl] sample report of {d}: cached in {cache} (--force retrains and re-measures)")
            return rec["report"]
    report = (measure or sample_grid_report)(d, d / "samples.png")
    write_json({"pretrain": trained, "report": report}, cache)
    return report


def readme_table(record: dict) -> str:
    """The README's table of a digits base (``record``: the contents of its ``report.json``), with the
    comment that names the pretraining run the figures come from (its ``final_loss``)."""
    report = record["report"]
    pretrain = json.loads(record["pretrain"]) if record.get("pretrain") else {}
    steps = pretrain.get("steps_done", "?")
    n, ode = report.get("samples", 10 * PER_DIGIT), report.get("ode_steps", NUM_STEPS)  # (older reports: defaults)
    rows = [f"<!-- from report.json of the digits base with pretrain.json final_loss "
            f"{pretrain.get('final_loss', float('nan')):.6f} (flowrl.digits_report.readme_table) -->",
            f"| base model ({steps} steps), {ode}-step ODE, {n} samples | classifier accuracy | `digits` reward |",
            "| --- | --- | --- |"]
    for key, r in report.items():
        if key.startswith("guidance_"):
            rows.append(f"| guidance {float(key[len('guidance_'):]):.1f} | {r['accuracy']:.3f} | {r['reward']:.3f} |")
    return "\n".join(rows)
