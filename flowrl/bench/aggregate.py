"""``flowrl bench aggregate``: several rewards of different scales trained under each rule of
``reward.aggregate``, side by side in one run (docs/rewards.md, "Several rewards").

The recipe (``recipes/digits_two_rewards.yaml``: the digits classifier and JPEG compressibility, some 40x apart
in their spread within a prompt's samples) trains once under ``sum`` (the weighted sum normalised once) and
once under ``per_reward`` (each reward normalised within its group before the weighted sum), each for the same
budget of training seconds from the same base model (:func:`flowrl.bench.training.run_variant`), evaluated on
the same prompts and seeds. The result: each reward's evaluation mean before and after under each rule (its
movement), and each reward's share of the advantage's variance during training (``reward/NAME/adv_share``:
which reward drove it); JSON + PNG with ``--out``.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..command_line import positive_float
from ..errors import BenchError
from ..trainers.config_text import recipes_dir
from ..utils.io import save_figure, write_json
from .training import Variant, run_variant
from .methods_seeds import num
from .precision_measure import cpu_name

RECIPE = "digits_two_rewards.yaml"
RULES = ("sum", "per_reward")


def bench_aggregate(pipeline: str = "digits", budget_seconds: float = 60.0, eval_every_seconds: float = 15.0,
                    out_dir: Optional[str] = None, extra: Sequence[str] = (), progress: bool = True) -> dict:
    """Train :data:`RECIPE` under each rule of :data:`RULES` for ``budget_seconds`` of training time each -> the
    result (:func:`report` formats it); ``out_dir``: written as ``aggregate.json`` and ``aggregate.png``.
    ``extra``: dotted overrides for both runs (the rule is set last)."""
    if pipeline != "digits":
        raise BenchError(f"bench aggregate runs on the offline digits pipeline only (got {pipeline!r}); for SD3/FLUX "
                         f"train a recipe with reward.aggregate=sum and =per_reward with `flowrl train`")
    recipe = str(recipes_dir() / RECIPE)
    variants = {}
    for rule in RULES:
        if progress:
            print(f"[bench aggregate] reward.aggregate={rule}: {RECIPE} ({budget_seconds:g} training s)", flush=True)
        variants[rule] = run_variant(recipe, Variant(overrides=[*extra, f"reward.aggregate={rule}"]), budget_seconds,
                                     eval_every_seconds, progress=progress, each_reward=True)
    res = {"pipeline": pipeline, "recipe": RECIPE, "budget_seconds": budget_seconds,
           "eval_every_seconds": eval_every_seconds, "rewards": sorted(variants[RULES[0]]["curve"][0]["rewards"]),
           "variants": variants, "movement": movement(variants),
           "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(),
                       "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
           "note": "training seconds = rollout + reward + update, evaluation excluded; eval = the fixed prompts and "
                   "seeds, deterministic ODE; adv_share = a reward's share of the variance of the advantages trained "
                   "on, averaged over iterations"}
    if out_dir:
        out = Path(out_dir)
        write_json(res, out / "aggregate.json")
        plot(res, out / "aggregate.png")
        print(f"[bench aggregate] wrote {out / 'aggregate.json'} and {out / 'aggregate.png'}", flush=True)
    return res


def movement(variants: dict) -> dict:
    """``{rule: {reward: {base, final, change, adv_share}}}``: each reward's evaluation mean at the start and the
    end of the run, its change, and its mean share of the advantage's variance over the iterations."""
    out = {}
    for rule, r in variants.items():
        first, last, log = r["curve"][0]["rewards"], r["curve"][-1]["rewards"], r.get("iterations_log", [])
        out[rule] = {}
        for name in first:
            shares = [e[f"reward/{name}/adv_share"] for e in log if f"reward/{name}/adv_share" in e]
            out[rule][name] = {"base": first[name], "final": last[name], "change": last[name] - first[name],
                               "adv_share": float(np.nanmean(shares)) if shares else None}
    return out


def report(res: dict) -> str:
    """The table: per rule, each reward's evaluation mean base -> final (change) and its advantage share."""
    names = res["rewards"]
    head = f"{'reward.aggregate':<18}{'iters':>6}" + "".join(f"{n + ': base -> final (change)':>46}{'adv share':>11}"
                                                           for n in names)
    rows = [head]
    for rule, per in res["movement"].items():
        cells = "".join(f"{_move(per[n]):>46}{num(per[n]['adv_share'], '.3f'):>11}" for n in names)
        rows.append(f"{rule:<18}{res['variants'][rule]['iterations']:>6}{cells}")
    return "\n".join(rows)


def _move(m: dict) -> str:
    return f"{m['base']:.4f} -> {m['final']:.4f} ({m['change']:+.4f})"


def plot(res: dict, path: Path) -> None:
    """One panel per reward: its evaluation mean against training seconds, a line per rule; and each reward's
    share of the advantage's variance per iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = res["rewards"]
    fig, axes = plt.subplots(1, len(names) + 1, figsize=(5 * (len(names) + 1), 4), squeeze=False)
    for ax, name in zip(axes.flat, names):
        for i, (rule, r) in enumerate(res["variants"].items()):
            c = r["curve"]
            ax.plot([p["train_seconds"] for p in c], [p["rewards"][name] for p in c], "o-", ms=3, color=f"C{i}",
                    label=rule)
        ax.set_xlabel("training seconds (rollout + reward + update)")
        ax.set_ylabel(f"eval {name} (fixed prompts and seeds)")
        ax.legend(title="reward.aggregate", fontsize=8)
    ax = axes.flat[-1]
    for i, (rule, r) in enumerate(res["variants"].items()):  # a colour per rule, a line style per reward
        for name, style in zip(names, ("-", "--", ":", "-.")):
            log = r.get("iterations_log", [])
            ax.plot([e["iteration"] for e in log], [e.get(f"reward/{name}/adv_share") for e in log], style,
                    color=f"C{i}", label=f"{rule}: {name}")
    ax.set_xlabel("iteration")
    ax.set_ylabel("share of the advantage's variance")
    ax.legend(fontsize=7)
    fig.suptitle(f"{res['recipe']}: reward.aggregate sum vs per_reward, {res['budget_seconds']:g} training s each")
    save_figure(fig, path)


def add_aggregate_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``aggregate`` under the ``flowrl bench`` sub-commands."""
    p = subparsers.add_parser("aggregate", help="two rewards of different scales under reward.aggregate sum and "
                                                "per_reward: each reward's movement and share (table; JSON + PNG "
                                                "with --out)",
                              epilog="example:\n  flowrl bench aggregate --pipeline digits --budget 60 --out bench")
    p.add_argument("--pipeline", choices=["digits"], default="digits", help="the model (digits only)")
    p.add_argument("--budget", type=positive_float, default=60.0, help="training seconds per rule")
    p.add_argument("--eval-every", type=positive_float, default=15.0, help="evaluate every N training seconds")
    p.add_argument("--out", default=None, help="write OUT/aggregate.json and OUT/aggregate.png here (default: "
                                               "nothing written, the table only)")
    p.add_argument("overrides", nargs="*", help="dotted overrides applied to both runs")
    p.set_defaults(fn=lambda a: report(bench_aggregate(a.pipeline, a.budget, a.eval_every, a.out, a.overrides or [])))
    return p
