"""Reward vs wall-clock for several training variants, side by side in one run.

Each variant is the same recipe with overrides (flat GRPO, BranchGRPO, Mix, TempFlow, ...). A
variant trains until its budget of *training* seconds (rollout + reward + update; evaluation
excluded) is spent; the fixed evaluation set is scored every ``eval_every_seconds``. Variants
run one after another in this process, on the same machine state, from the same base model.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from ..trainers.config import Config, load_config
from ..trainers.config_text import resolve_recipe
from ..trainers.online import OnlineTrainer
from ..utils.io import save_figure, write_json


@dataclass
class Variant:
    """A recipe variant: an optional replacement ``sampler`` section plus dotted overrides; ``recipe``
    (a file name in the benchmark's recipe directory, or a path) replaces the benchmark's recipe. The
    config is built as ``flowrl train`` builds it (:func:`~flowrl.trainers.config.load_config`): a
    ``train.loss=X`` override keeps the recipe's loss options that X takes and drops the others."""

    overrides: list = field(default_factory=list)
    sampler: Optional[dict] = None
    recipe: Optional[str] = None

    def config(self, recipe: str, extra: list[str]) -> Config:
        path = resolve_recipe(recipe)  # a file, or a shipped recipe by name (recipes/digits.yaml from anywhere)
        if self.recipe is not None:
            path = resolve_recipe(path.parent / self.recipe)
        section = [f"sampler={json.dumps(self.sampler)}"] if self.sampler is not None else []  # a whole section
        return load_config(path, section + list(self.overrides) + list(extra))


def run_variant(recipe: str, variant: Variant, budget_seconds: float, eval_every_seconds: float,
                max_iterations: int = 10_000, workdir: Optional[Path] = None, progress: bool = True,
                extra: Optional[list[str]] = None, each_reward: bool = False, headline: Optional[str] = None) -> dict:
    """Train one variant for ``budget_seconds`` of training time -> curve and timing summary.

    Each curve point: ``train_seconds`` (rollout + reward + update so far, evaluation excluded),
    ``iteration``, ``samples`` (finished samples the rollouts scored so far), the evaluation's
    ``eval_reward``, ``diversity`` and ``hf_energy``; ``real`` holds the same measures of real data
    (held-out digits for the evaluation prompts; empty when the model has none). When the evaluation prompts
    carry tags (``data.eval_prompts`` with GenEval's ``tag``), each point and ``real`` also hold ``tags``, the
    evaluation reward per tag (``{tag: mean}``). ``each_reward``: each curve
    point also holds ``rewards`` (each trained reward's evaluation mean, name -> value), and ``iterations_log``
    each iteration's ``train_seconds`` and ``reward/<name>/...`` metrics (its mean, its advantage share).
    ``headline``: ``eval_reward`` (and ``tags``, ``real``) is that held-out reward's (:func:`_headline`)."""
    cfg = variant.config(recipe, list(extra or []) + ["logging.trackers=[]", "logging.progress=false",
                                                      f"train.iterations={max_iterations}"])
    run_dir = Path(tempfile.mkdtemp(prefix="flowrl-bench-", dir=workdir))
    tr = OnlineTrainer(cfg, run_dir)
    tr.setup()
    real = real_reference(tr, headline)
    ev0, _ = tr.evaluate(0)
    curve = [_point(0.0, 0, 0, ev0, each_reward, headline)]
    spent, next_eval, it, samples = 0.0, eval_every_seconds, 0, 0
    per_iter, rollout_s, evals, log = [], [], [], []
    while spent < budget_seconds and it < max_iterations:
        t0 = time.perf_counter()
        res = tr.run_iteration(it)
        dt = time.perf_counter() - t0
        spent += dt
        it += 1
        per_iter.append(dt)
        rollout_s.append(res.metrics["rollout_seconds"])
        evals.append(res.metrics["model_evals"])
        samples += res.metrics["samples_gathered"]
        if each_reward:
            log.append({"iteration": it, "train_seconds": spent,
                        **{k: v for k, v in res.metrics.items() if k.startswith("reward/")}})
        if progress:
            print(f"  it {it:4d}  {spent:7.1f}s  reward {res.metrics['reward_mean']:.3f}", flush=True)
        if spent >= next_eval or spent >= budget_seconds:
            ev, _ = tr.evaluate(it)
            curve.append(_point(spent, it, samples, ev, each_reward, headline))
            next_eval += eval_every_seconds
    tr.acc.end_training()
    return {"recipe": Path(variant.recipe or recipe).name, "sampler": cfg.sampler.to_dict(), "loss": cfg.train.loss,
            "overrides": list(variant.overrides), "iterations": it, "train_seconds": spent,
            "seconds_per_iteration": float(np.mean(per_iter)) if per_iter else float("nan"),
            "rollout_seconds_per_iteration": float(np.mean(rollout_s)) if rollout_s else float("nan"),
            "model_evals_per_iteration": float(np.mean(evals)) if evals else float("nan"),
            "samples_per_iteration": cfg.train.batch_size, "samples_drawn": samples,
            "final_eval_reward": curve[-1]["eval_reward"], "real": real, "curve": curve,
            **({"iterations_log": log} if each_reward else {})}


def _tags(metrics: dict, prefix: str) -> dict:
    """``{"tags": {tag: value}}`` of the ``<prefix>tag/<tag>`` metrics (the reward per tag), ``{}`` when none."""
    tags = {k.removeprefix(f"{prefix}tag/"): v for k, v in metrics.items() if k.startswith(f"{prefix}tag/")}
    return {"tags": tags} if tags else {}


def _headline(metrics: dict, prefix: str, headline: Optional[str]) -> dict:
    """``reward`` (and ``tags``) of the measure the bench ranks by: the trained reward's ``<prefix>reward``, or
    with ``headline`` (a held-out reward's name, :attr:`flowrl.bench.worlds.World.headline`) that reward's
    ``<prefix>heldout/<headline>``, the trained reward's then kept as ``trained_reward`` (and ``trained_tags``)."""
    if headline is None:
        return {"reward": metrics[f"{prefix}reward"], **_tags(metrics, prefix)}
    trained = _tags(metrics, prefix)
    return {"reward": metrics[f"{prefix}heldout/{headline}"], **_tags(metrics, f"{prefix}heldout/{headline}/"),
            "trained_reward": metrics[f"{prefix}reward"], **({"trained_tags": trained["tags"]} if trained else {})}


def real_reference(tr, headline: Optional[str] = None) -> dict:
    """Trainer ``tr``'s real-data reference (:meth:`~flowrl.trainers.trainer.Trainer.real_data_reference`) as the
    bench keeps it: ``reward``, ``diversity``, ``hf_energy`` (and ``tags``, the reward per tag; with ``headline``,
    that held-out reward's, :func:`_headline`), ``{}`` for none."""
    got = tr.real_data_reference()
    if not got:
        return {}
    watch = {k.removeprefix("real/"): v for k, v in got.items()
             if k != "real/reward" and not k.startswith(("real/tag/", "real/heldout/"))}  # diversity, hf_energy, ...
    return {**watch, **_headline(got, "real/", headline)}


def _point(seconds: float, it: int, samples: int, ev: dict, each_reward: bool = False,
           headline: Optional[str] = None) -> dict:
    head = _headline(ev, "eval/", headline)
    point = {"train_seconds": seconds, "iteration": it, "samples": samples, "eval_reward": head.pop("reward"),
             "diversity": ev["eval/diversity"], "hf_energy": ev["eval/hf_energy"], **head}
    if each_reward:  # the trained rewards' evaluation means (eval/reward/NAME; held-out ones are eval/heldout/NAME)
        point["rewards"] = {k.removeprefix("eval/reward/"): v for k, v in ev.items() if k.startswith("eval/reward/")}
    return point


def time_to_reach(curve: list[dict], target: float, x: str = "train_seconds") -> Optional[float]:
    """First training second (or ``x``: another key of the curve points, e.g. ``samples``) at which the
    eval reward reaches ``target`` (None if never)."""
    for p in curve:
        if p["eval_reward"] >= target:
            return p[x]
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


SECONDS = ("train_seconds", "training seconds (rollout + reward + update)")
WATCH = (("diversity", "within-prompt diversity (hacking watch)"), ("hf_energy", "high-frequency energy (hacking watch)"))


def plot_compare(out: dict, path: Path, title: str = "") -> None:
    """Eval reward, within-prompt diversity and high-frequency energy vs training seconds, one line
    per variant (:func:`plot_panels`)."""
    plot_panels(out, path, [(SECONDS, ("eval_reward", "eval reward (fixed prompts and seeds)")),
                            *((SECONDS, w) for w in WATCH)], title, baseline="flat_grpo", shape=(1, 3))


def reference_lines(ax, yk: str, real: dict, base: Optional[dict], base_label: str) -> None:
    """The dashed lines a panel of ``yk`` compares with: the real data's value and, on the reward panel, the
    baseline's final evaluation reward (``base``: its result, None: not run)."""
    ref = real.get("reward" if yk == "eval_reward" else yk)
    if ref is not None:
        ax.axhline(ref, color="k", ls="--", lw=1, label="real data")
    if base is not None and yk == "eval_reward":
        ax.axhline(base["final_eval_reward"], color="gray", ls="--", lw=1, label=base_label)


def plot_panels(out: dict, path: Path, panels: list, title: str = "", baseline: str = "flat_grpo",
                shape: tuple = (1, 3), more: Optional[Callable] = None) -> None:
    """One subplot per ``((x_key, x_label), (y_key, y_label))`` of ``panels``, one line per variant of
    ``out["variants"]`` through its curve points. Dashed lines: the real data's value of ``y_key`` (black,
    from a variant's ``real``, when it has one) and, on eval-reward panels, the ``baseline`` variant's final
    eval reward (grey). ``more(ax)``: draws the subplot after the panels' (the rest of ``shape`` left empty)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*shape, figsize=(5 * shape[1], 4 * shape[0]), squeeze=False)
    real = next((r["real"] for r in out["variants"].values() if r.get("real")), {})
    base = out["variants"].get(baseline)
    for ax, ((xk, xl), (yk, yl)) in zip(axes.flat, panels):
        for name, r in out["variants"].items():
            c = r["curve"]
            ax.plot([p[xk] for p in c], [p[yk] for p in c], "o-", ms=3, label=name)
        reference_lines(ax, yk, real, base, f"{baseline} final")
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
    axes.flat[0].legend(fontsize=8)
    finish_extra_panels(axes, len(panels), more)
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path)


def finish_extra_panels(axes, used: int, more: Optional[Callable] = None) -> None:
    """After ``used`` panels of ``axes``: ``more(ax)`` on the next one, when given; the ones left switched off."""
    rest = list(axes.flat[used:])
    if more is not None and rest:
        more(rest.pop(0))
    for ax in rest:
        ax.set_axis_off()


def table(out: dict) -> str:
    rows = [f"{'variant':<16}{'s/iter':>9}{'rollout s':>11}{'evals/iter':>12}{'iters':>7}{'final reward':>14}"]
    for name, r in out["variants"].items():
        rows.append(f"{name:<16}{r['seconds_per_iteration']:>9.2f}{r['rollout_seconds_per_iteration']:>11.2f}"
                    f"{r['model_evals_per_iteration']:>12.0f}{r['iterations']:>7d}{r['final_eval_reward']:>14.4f}")
    return "\n".join(rows)
