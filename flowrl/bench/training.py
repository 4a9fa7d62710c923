"""Reward vs wall-clock for several training variants, side by side in one run.

Each variant is the same recipe with overrides (flat GRPO, BranchGRPO, Mix, TempFlow, ...). A
variant trains until its budget of *training* seconds (rollout + reward + update; evaluation
excluded) is spent; the fixed evaluation set is scored every ``eval_every_seconds``. Variants
run one after another in this process, on the same machine state, from the same base model.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..trainers.config import Config
from ..trainers.config_text import apply_overrides, read_recipe, resolve_recipe
from ..trainers.online import OnlineTrainer
from ..utils.io import save_figure, write_json


@dataclass
class Variant:
    """A recipe variant: an optional replacement ``sampler`` section plus dotted overrides; ``recipe``
    (a file name in the benchmark's recipe directory) replaces the benchmark's recipe."""

    overrides: list = field(default_factory=list)
    sampler: Optional[dict] = None
    recipe: Optional[str] = None

    def config(self, recipe: str, extra: list[str]) -> Config:
        path = resolve_recipe(recipe)  # a file, or a shipped recipe by name (recipes/digits.yaml from anywhere)
        if self.recipe is not None:
            path = resolve_recipe(path.parent / self.recipe)
        d = read_recipe(path)
        if self.sampler is not None:
            d["sampler"] = dict(self.sampler)
        d = apply_overrides(d, list(self.overrides) + list(extra))
        return Config.from_dict(d)


def run_variant(recipe: str, variant: Variant, budget_seconds: float, eval_every_seconds: float,
                max_iterations: int = 10_000, workdir: Optional[Path] = None, progress: bool = True,
                extra: Optional[list[str]] = None) -> dict:
    """Train one variant for ``budget_seconds`` of training time -> curve and timing summary."""
    cfg = variant.config(recipe, list(extra or []) + ["logging.trackers=[]", "logging.progress=false",
                                                      f"train.iterations={max_iterations}"])
    run_dir = Path(tempfile.mkdtemp(prefix="flowrl-bench-", dir=workdir))
    tr = OnlineTrainer(cfg, run_dir)
    tr.setup()
    ev0, _ = tr.evaluate(0)
    curve = [{"train_seconds": 0.0, "iteration": 0, "eval_reward": ev0["eval/reward"],
              "diversity": ev0["eval/diversity"], "hf_energy": ev0["eval/hf_energy"]}]
    spent, next_eval, it = 0.0, eval_every_seconds, 0
    per_iter, rollout_s, evals = [], [], []
    while spent < budget_seconds and it < max_iterations:
        t0 = time.perf_counter()
        res = tr.run_iteration(it)
        dt = time.perf_counter() - t0
        spent += dt
        it += 1
        per_iter.append(dt)
        rollout_s.append(res.metrics["rollout_seconds"])
        evals.append(res.metrics["model_evals"])
        if progress:
            print(f"  it {it:4d}  {spent:7.1f}s  reward {res.metrics['reward_mean']:.3f}", flush=True)
        if spent >= next_eval or spent >= budget_seconds:
            ev, _ = tr.evaluate(it)
            curve.append({"train_seconds": spent, "iteration": it, "eval_reward": ev["eval/reward"],
                          "diversity": ev["eval/diversity"], "hf_energy": ev["eval/hf_energy"]})
            next_eval += eval_every_seconds
    tr.acc.end_training()
    return {"recipe": variant.recipe or Path(recipe).name, "sampler": cfg.sampler.to_dict(), "loss": cfg.train.loss,
            "overrides": list(variant.overrides), "iterations": it, "train_seconds": spent,
            "seconds_per_iteration": float(np.mean(per_iter)) if per_iter else float("nan"),
            "rollout_seconds_per_iteration": float(np.mean(rollout_s)) if rollout_s else float("nan"),
            "model_evals_per_iteration": float(np.mean(evals)) if evals else float("nan"),
            "samples_per_iteration": cfg.train.batch_size, "final_eval_reward": curve[-1]["eval_reward"],
            "curve": curve}


def time_to_reach(curve: list[dict], target: float) -> Optional[float]:
    """First training second at which the eval reward reaches ``target`` (None if never)."""
    for p in curve:
        if p["eval_reward"] >= target:
            return p["train_seconds"]
    return None


def compare(variants: dict[str, Variant], recipe: str, budget_seconds: float, eval_every_seconds: float,
            json_path: Optional[str] = None, png_path: Optional[str] = None, title: str = "",
            progress: bool = True, extra: Optional[list[str]] = None) -> dict:
    """Run every variant with the same budget; write JSON and a reward-vs-seconds PNG."""
    results = {}
    for name, var in variants.items():
        if progress:
            print(f"[bench] {name}: {var.recipe or Path(recipe).name}, sampler {var.sampler or '(recipe)'} "
                  f"{' '.join(var.overrides)}", flush=True)
        results[name] = run_variant(recipe, var, budget_seconds, eval_every_seconds, progress=progress, extra=extra)
    out = {"recipe": recipe, "budget_seconds": budget_seconds, "variants": results,
           "machine": {"cpus": os.cpu_count()}}
    if json_path:
        write_json(out, Path(json_path))
    if png_path:
        plot_compare(out, Path(png_path), title)
    return out


def plot_compare(out: dict, path: Path, title: str = "") -> None:
    """Eval reward, within-prompt diversity and high-frequency energy vs training seconds, one line
    per variant; the reward panel marks flat GRPO's final reward (dashed) when it is a variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = (("eval_reward", "eval reward (fixed prompts and seeds)"),
              ("diversity", "within-prompt diversity (hacking watch)"),
              ("hf_energy", "high-frequency energy (hacking watch)"))
    for ax, (key, label) in zip(axes, panels):
        for name, r in out["variants"].items():
            c = r["curve"]
            ax.plot([p["train_seconds"] for p in c], [p[key] for p in c], "o-", ms=3, label=name)
        ax.set_xlabel("training seconds (rollout + reward + update)")
        ax.set_ylabel(label)
    flat = out["variants"].get("flat_grpo")
    if flat is not None:
        axes[0].axhline(flat["final_eval_reward"], color="gray", ls="--", lw=1, label="flat GRPO final")
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path)


def table(out: dict) -> str:
    rows = [f"{'variant':<16}{'s/iter':>9}{'rollout s':>11}{'evals/iter':>12}{'iters':>7}{'final reward':>14}"]
    for name, r in out["variants"].items():
        rows.append(f"{name:<16}{r['seconds_per_iteration']:>9.2f}{r['rollout_seconds_per_iteration']:>11.2f}"
                    f"{r['model_evals_per_iteration']:>12.0f}{r['iterations']:>7d}{r['final_eval_reward']:>14.4f}")
    return "\n".join(rows)
