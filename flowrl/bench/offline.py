"""``flowrl bench offline``: offline GDRO vs online GRPO, reward against total compute, in one run.

Both start from the same base model and are scored on the same fixed evaluation set (prompts,
seeds, ODE steps). Compute is wall-clock seconds of work on this machine, evaluation excluded:
- offline: generating + scoring the dataset (the dataset's index records it) + GDRO steps;
  its curve starts at the generation cost, where the reward is still the base model's;
- online: rollouts + rewards + updates (``flowrl.bench.training.run_variant``).
Online GRPO trains for the whole budget of total compute seconds; offline GDRO runs the steps its
recipe plans (``offline.epochs``), cut short if it would exceed the same budget. When generating
the dataset alone spends the budget, GDRO makes no step: the result carries a warning (and the
table prints it) naming the budget that would leave time for training. JSON and PNG are written
where asked (``--out DIR``, or ``--json`` / ``--png``).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from ..command_line import positive_float
from ..utils.io import save_figure, write_json
from ..errors import BenchError

QUIET = ["logging.trackers=[]", "logging.progress=false"]


def _point(seconds: float, step: int, ev: dict) -> dict:
    return {"compute_seconds": seconds, "step": step, "eval_reward": ev["eval/reward"],
            "diversity": ev["eval/diversity"], "hf_energy": ev["eval/hf_energy"],
            **({"eval_reward_corrected": ev["eval/reward_corrected"]} if "eval/reward_corrected" in ev else {})}


def run_offline(recipe: str, overrides: Sequence[str], budget_seconds: float, eval_every_seconds: float,
                workdir: Path, dataset: Optional[str] = None, progress: bool = True) -> dict:
    """Generate a dataset (or reuse ``dataset``), then the recipe's GDRO steps (``offline.epochs``
    / ``max_steps``), stopping early when generation + training seconds reach ``budget_seconds``
    -> curve and timing summary."""
    from ..data.offline_store import OfflineDataset
    from ..trainers.config import load_config
    from ..trainers.offline import OfflineTrainer, generate_offline

    ds_dir = str(dataset or workdir / "dataset")
    cfg = load_config(recipe, list(overrides) + QUIET + [f"offline.dataset={ds_dir}"])
    t0 = time.perf_counter()
    gen = generate_offline(cfg, ds_dir, progress=progress)
    gen_wall = time.perf_counter() - t0
    gen_seconds = OfflineDataset(ds_dir).generation_seconds  # generation + scoring, all runs that wrote it
    if progress:
        print(f"[bench offline] dataset {gen['groups']} groups x k={gen['k']}: {gen_seconds:.1f}s", flush=True)
    tr = OfflineTrainer(cfg, Path(tempfile.mkdtemp(prefix="gdro-", dir=workdir)))
    tr.setup()
    ev0, _ = tr.evaluate(0)
    curve = [_point(0.0, 0, ev0), _point(gen_seconds, 0, ev0)]  # the base model, before and after generation
    step, next_eval = 0, eval_every_seconds
    while gen_seconds + tr.train_seconds < budget_seconds and step < tr.total_steps:
        met = tr.run_step(step)
        step += 1
        if progress and step % 10 == 0:
            print(f"  gdro step {step:4d}  {gen_seconds + tr.train_seconds:7.1f}s  loss {met.get('loss', float('nan')):.3f}"
                  f"  top1 {met.get('top1_accuracy', float('nan')):.2f}", flush=True)
        if tr.train_seconds >= next_eval or gen_seconds + tr.train_seconds >= budget_seconds or step == tr.total_steps:
            ev, _ = tr.evaluate(step)
            curve.append(_point(gen_seconds + tr.train_seconds, step, ev))
            next_eval += eval_every_seconds
    tr.acc.end_training()
    tr.ds.close()
    return {"overrides": list(overrides), "dataset": ds_dir, "dataset_groups": gen["groups"], "k": gen["k"],
            "generation_seconds": gen_seconds, "generation_wall_seconds_this_run": gen_wall,
            "train_seconds": tr.train_seconds, "compute_seconds": gen_seconds + tr.train_seconds, "steps": step,
            "generation_model_evals": gen["model_evals"],  # sampler rows through the model (load-independent)
            "train_forward_rows": step * tr.per_step * gen["k"] * 2,  # policy + reference rows per trained image
            "epochs": step / tr.steps_per_epoch, "final_eval_reward": curve[-1]["eval_reward"], "curve": curve}


def run_online(recipe: str, overrides: Sequence[str], budget_seconds: float, eval_every_seconds: float,
               workdir: Path, progress: bool = True) -> dict:
    """Online GRPO for ``budget_seconds`` of training compute (``flowrl.bench.training``)."""
    from .training import Variant, run_variant

    r = run_variant(recipe, Variant(overrides=list(overrides)), budget_seconds, eval_every_seconds, workdir=workdir,
                    progress=progress)
    curve = [{"compute_seconds": p["train_seconds"], "step": p["iteration"], "eval_reward": p["eval_reward"],
              "diversity": p["diversity"], "hf_energy": p["hf_energy"]} for p in r["curve"]]
    return {**{k: v for k, v in r.items() if k != "curve"}, "compute_seconds": r["train_seconds"], "curve": curve}


def time_to_reach(curve: list[dict], target: float) -> Optional[float]:
    """First compute second at which the eval reward reaches ``target`` (None if never)."""
    return next((p["compute_seconds"] for p in curve if p["eval_reward"] >= target), None)


def bench_offline(offline_recipe: str = "recipes/digits_gdro.yaml", online_recipe: str = "recipes/digits.yaml",
                  budget_seconds: float = 300.0, eval_every_seconds: float = 30.0,
                  offline_overrides: Sequence[str] = (), online_overrides: Sequence[str] = (),
                  dataset: Optional[str] = None, json_path: Optional[str] = None, png_path: Optional[str] = None,
                  workdir: Optional[str] = None, progress: bool = True) -> dict:
    """Offline GDRO and online GRPO, each for ``budget_seconds`` of total compute; the eval reward
    every ``eval_every_seconds``. Returns the result dict (also written to ``json_path``; the
    reward-vs-compute plot to ``png_path``)."""
    import torch

    if not budget_seconds > 0 or not eval_every_seconds > 0:
        raise BenchError(f"budget_seconds and eval_every_seconds must be > 0, got {budget_seconds}, {eval_every_seconds}")
    wd = Path(workdir or tempfile.mkdtemp(prefix="flowrl-bench-offline-"))
    wd.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"[bench offline] GDRO: {offline_recipe} {' '.join(offline_overrides)}", flush=True)
    off = run_offline(offline_recipe, offline_overrides, budget_seconds, eval_every_seconds, wd, dataset, progress)
    warnings = []
    if off["steps"] == 0:
        warnings.append(f"generating the dataset took {off['generation_seconds']:.0f} s of the {budget_seconds:g} s "
                        f"budget, so GDRO made no training step and its curve is the base model's: raise --budget "
                        f"well above {off['generation_seconds']:.0f} s (generation counts against it, also for a "
                        f"reused --dataset)")
        print(f"[bench offline] WARNING: {warnings[-1]}", flush=True)
    if progress:
        print(f"[bench offline] online GRPO: {online_recipe} {' '.join(online_overrides)}", flush=True)
    on = run_online(online_recipe, online_overrides, budget_seconds, eval_every_seconds, wd, progress)
    base = off["curve"][0]["eval_reward"]
    best_common = min(max(p["eval_reward"] for p in off["curve"]), max(p["eval_reward"] for p in on["curve"]))
    out = {"budget_seconds": budget_seconds, "eval_every_seconds": eval_every_seconds,
           "offline": off, "online": on, "base_eval_reward": base,
           "target_reward": best_common,  # the best reward both reached: time to it compares speed
           "time_to_target": {"offline": time_to_reach(off["curve"], best_common),
                              "online": time_to_reach(on["curve"], best_common)},
           "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                       "cuda": torch.cuda.is_available()},
           "note": "compute = wall seconds of generation + scoring + training on this machine, evaluation excluded",
           "warnings": warnings}
    if json_path:
        write_json(out, Path(json_path))
    if png_path:
        plot(out, Path(png_path))
    return out


def plot(out: dict, path: Path, title: str = "") -> None:
    """Eval reward vs total compute seconds, offline GDRO beside online GRPO."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for key, label in (("offline", "offline GDRO (generation + training)"), ("online", "online GRPO")):
        c = out[key]["curve"]
        ax.plot([p["compute_seconds"] for p in c], [p["eval_reward"] for p in c], "o-", label=label, ms=3)
    ax.axvline(out["offline"]["generation_seconds"], color="grey", ls=":", lw=1, label="dataset ready")
    ax.set_xlabel("total compute seconds (evaluation excluded)")
    ax.set_ylabel("eval reward (fixed prompts and seeds)")
    ax.set_title(title or "offline GDRO vs online GRPO")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def table(out: dict) -> str:
    rows = [f"{'method':<10}{'compute s':>11}{'gen s':>8}{'train s':>9}{'steps':>7}{'final reward':>14}{'to target s':>13}"]
    for key in ("offline", "online"):
        r = out[key]
        tt = out["time_to_target"][key]
        rows.append(f"{key:<10}{r['compute_seconds']:>11.1f}{r.get('generation_seconds', 0.0):>8.1f}"
                    f"{r['train_seconds']:>9.1f}{r.get('steps', r.get('iterations', 0)):>7d}"
                    f"{r['final_eval_reward']:>14.4f}{(f'{tt:.1f}' if tt is not None else '-'):>13}")
    rows.append(f"base model eval reward {out['base_eval_reward']:.4f}; target = best reward both reached "
                f"{out['target_reward']:.4f}")
    rows += [f"WARNING: {w}" for w in out.get("warnings", [])]
    return "\n".join(rows)


def _run(a) -> str:
    json_path, png_path = a.json, a.png
    if a.out:
        json_path, png_path = json_path or str(Path(a.out) / "offline.json"), png_path or str(Path(a.out) / "offline.png")
    out = bench_offline(a.offline_recipe, a.online_recipe, a.budget_seconds, a.eval_every_seconds,
                        a.offline_override or [], a.online_override or [], a.dataset, json_path, png_path, a.workdir)
    for path in filter(None, (json_path, png_path)):
        print(f"[bench offline] wrote {path}")
    return table(out)


def add_offline_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``offline`` under the ``flowrl bench`` sub-commands."""
    p = subparsers.add_parser("offline", help="offline GDRO vs online GRPO: reward vs total compute seconds",
                              epilog="example:\n  flowrl bench offline --pipeline digits --budget 300 --out bench")
    p.add_argument("--pipeline", choices=["digits"], default="digits",
                   help="the model (digits only; the recipes below choose it)")
    p.add_argument("--offline-recipe", default="recipes/digits_gdro.yaml")
    p.add_argument("--online-recipe", default="recipes/digits.yaml")
    p.add_argument("--budget", "--budget-seconds", dest="budget_seconds", type=positive_float, default=300.0,
                   help="total compute seconds per method (dataset generation counts)")
    p.add_argument("--eval-every", "--eval-every-seconds", dest="eval_every_seconds", type=positive_float, default=30.0,
                   help="evaluate every N compute seconds")
    p.add_argument("--offline-override", action="append", help="dotted override for the GDRO recipe (repeatable)")
    p.add_argument("--online-override", action="append", help="dotted override for the online recipe (repeatable)")
    p.add_argument("--dataset", default=None, help="reuse (or resume) this dataset directory; its recorded "
                                                   "generation seconds still count")
    p.add_argument("--workdir", default=None, help="where datasets and runs go (default: a temporary directory)")
    p.add_argument("--out", default=None, help="write OUT/offline.json and OUT/offline.png (default: nothing "
                                               "written, the table only)")
    p.add_argument("--json", default=None, help="write the result JSON here (overrides --out's)")
    p.add_argument("--png", default=None, help="write the plot here (overrides --out's)")
    p.set_defaults(fn=_run)
    return p
