"""``flowrl bench methods``: every update on the same prompts, seeds and wall budget, in one run.

Each method (:data:`METHODS`) is the digits recipe (``recipes/digits.yaml``: 10 prompts x 8 samples per
iteration, the fixed evaluation set) with its update and the sampler that update trains on: the GRPO
family on the recipe's group sampler with SDE steps (it trains on stored transitions), the updates on
finished samples on 8 deterministic ODE samples per prompt with DiffusionNFT's minibatch settings and
their own default options. Every method starts from the same base model, draws the same prompts and
seeds (``train.seed``) and trains for the same budget of training seconds (rollout + reward + update,
evaluation excluded; :func:`flowrl.bench.training.run_variant`), one after another in this process.

The result: per method the evaluation reward against training seconds and against samples drawn, the
watch's within-prompt diversity and high-frequency energy (:mod:`flowrl.diagnostics`) beside the real
data's, and when GRPO ran, the seconds and samples each method took to reach GRPO's final evaluation
reward (n/a when the base model already reaches it). A method whose update is not registered in this
build, or whose row is not filled in yet, is skipped with a line that says so; a method that fails while
training is reported as failed (its traceback on stderr) and the others still run.
"""
from __future__ import annotations

import argparse
import os
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ..command_line import positive_float
from ..errors import BenchError
from ..trainers.config_text import resolve_recipe
from ..utils.io import write_json
from .training import SECONDS, WATCH, Variant, plot_panels, run_variant, time_to_reach

RECIPE = "digits.yaml"
BASELINE = "grpo"  # the method the "time to reach" columns measure against

# the updates that train on finished samples: 8 ODE samples per prompt (the recipe's group size and
# steps), the update's own default options, DiffusionNFT's digits minibatch (recipes/digits_sol_nft.yaml)
ON_SAMPLES = ("sampler={name: ode, group_size: 8, num_steps: 10}", "train.loss_options={}",
              "train.minibatch_size=40", "train.grad_accum=1")


@dataclass(frozen=True)
class Method:
    """One row of the bench: update ``loss`` (``train.loss``) on :data:`RECIPE` (or ``recipe``, a shipped
    recipe name or a path) with ``overrides``. Without overrides a GRPO-family update keeps the recipe's
    group sampler (SDE) and the GRPO loss options it takes. ``loss=None``: the row is not filled in yet and
    is skipped, with ``note`` saying why."""

    name: str
    loss: Optional[str]
    overrides: tuple[str, ...] = ()
    recipe: Optional[str] = None
    note: str = ""

    def variant(self, more: Sequence[str] = (), recipe: Optional[str] = None) -> Variant:
        """The bench variant: this row's overrides, then ``more``; ``recipe`` replaces the row's recipe."""
        return Variant(overrides=[f"train.loss={self.loss}", *self.overrides, *more], recipe=recipe or self.recipe)


METHODS: tuple[Method, ...] = (
    Method("grpo", "grpo", note="Flow-GRPO (arXiv 2505.05470)"),
    Method("grpo_guard", "grpo_guard", note="GRPO-Guard (arXiv 2510.22319)"),
    Method("dppo", "dppo", note="Flow-DPPO: trust region by the exact transition KL"),
    Method("nft", "nft", ON_SAMPLES, note="DiffusionNFT (arXiv 2509.16117)"),
    Method("awm", "awm", ON_SAMPLES, note="AWM (arXiv 2509.25050)"),
    Method("dgpo", "dgpo", ON_SAMPLES, note="DGPO"),
    # GARDO on GRPO (arXiv 2512.24138): fill in its update's name and options when it lands
    Method("gardo_grpo", None, note="GARDO on GRPO: its update's name and options are not filled in yet "
                                    "(flowrl/bench/methods.py, METHODS)"),
    Method("dpo", "dpo", ON_SAMPLES, note="online DPO (best vs worst of each group)"),
    Method("gdro", "gdro", ON_SAMPLES, note="online GDRO (Plackett-Luce over each group's ranking)"),
)
BY_NAME = {m.name: m for m in METHODS}


def _check_names(names, what: str) -> None:
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise BenchError(f"unknown method(s) {', '.join(map(repr, unknown))}{what}; choose from "
                         f"{', '.join(BY_NAME)}")


def skip_reason(m: Method) -> Optional[str]:
    """Why ``m`` cannot run in this build (None: it can)."""
    from ..updates import UPDATES

    if m.loss is None:
        return m.note or "its update is not filled in yet"
    if m.loss not in UPDATES:
        return f"update {m.loss!r} is not registered in this build (registered: {', '.join(UPDATES.names())})"
    return None


def chosen_runs(methods: Optional[Sequence[str]] = None, method_overrides: Optional[dict] = None,
         method_recipes: Optional[dict] = None, extra: Sequence[str] = ()) -> tuple[dict, dict]:
    """The chosen methods (all when ``methods`` is empty) -> (``{name: (Variant, base recipe)}`` of those that
    run, with every config validated, ``{name: reason}`` of those skipped). ``method_overrides`` /
    ``method_recipes``: ``{name: [overrides]}`` / ``{name: recipe}`` for single methods; ``extra``: overrides
    for every method (applied before a method's own)."""
    method_overrides, method_recipes = dict(method_overrides or {}), dict(method_recipes or {})
    _check_names(list(methods or ()), "")
    _check_names([*method_overrides, *method_recipes], " in --method-override / --method-recipe")
    chosen = [m for m in METHODS if not methods or m.name in methods]
    runs, skipped = {}, {}
    for m in chosen:
        reason = skip_reason(m)
        if reason is not None:
            skipped[m.name] = reason
            continue
        try:
            recipe = method_recipes.get(m.name)
            var = m.variant([*extra, *method_overrides.get(m.name, ())],
                            str(resolve_recipe(recipe).resolve()) if recipe else None)
            var.config(RECIPE, [])  # validated before any model loads
        except ValueError as e:
            raise BenchError(f"method {m.name}: {e}") from None
        runs[m.name] = var
    return runs, skipped


def bench_methods(pipeline: str = "digits", budget_seconds: float = 120.0, eval_every_seconds: float = 20.0,
                  out_dir: Optional[str] = None, methods: Optional[Sequence[str]] = None,
                  method_overrides: Optional[dict] = None, method_recipes: Optional[dict] = None,
                  extra: Sequence[str] = (), progress: bool = True) -> dict:
    """Train every chosen method for ``budget_seconds`` of training time each -> the result dict
    (:func:`report` formats it); written as ``out_dir/methods.json`` and ``methods.png`` when ``out_dir`` is
    given, nothing written otherwise. Arguments as :func:`chosen_runs`."""
    if pipeline != "digits":
        raise BenchError(f"bench methods runs on the offline digits pipeline only (got {pipeline!r}); for SD3/FLUX "
                         f"run each method's recipe with `flowrl train` on a GPU machine")
    runs, skipped = chosen_runs(methods, method_overrides, method_recipes, extra)
    for name, reason in skipped.items():
        print(f"[bench methods] {name}: skipped: {reason}", flush=True)
    variants, failed = {}, {}
    for i, (name, var) in enumerate(runs.items(), 1):
        if progress:
            print(f"[bench methods] {i}/{len(runs)} {name}: {var.recipe or RECIPE} {' '.join(var.overrides)} "
                  f"({budget_seconds:g} training s)", flush=True)
        try:
            variants[name] = {"note": BY_NAME[name].note, **run_variant(
                RECIPE, var, budget_seconds, eval_every_seconds, progress=progress)}
        except Exception as e:  # noqa: BLE001 (one method's failure is its row; the others still run)
            traceback.print_exc()
            failed[name] = " ".join(f"{type(e).__name__}: {e}".split())
            print(f"[bench methods] {name}: FAILED: {failed[name]}", flush=True)
    res = {"pipeline": pipeline, "recipe": RECIPE, "budget_seconds": budget_seconds,
           "eval_every_seconds": eval_every_seconds, "baseline": BASELINE, "variants": variants,
           "skipped": skipped, "failed": failed,
           "real": next((r["real"] for r in variants.values() if r.get("real")), {}),
           "machine": {"cpus": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
           "note": "training seconds = rollout + reward + update, evaluation excluded; samples = finished samples "
                   "the rollouts scored"}
    add_times_to_baseline(res)
    if out_dir:
        out = Path(out_dir)
        write_json(res, out / "methods.json")
        plot(res, out / "methods.png")
        print(f"[bench methods] wrote {out / 'methods.json'} and {out / 'methods.png'}", flush=True)
    return res


def add_times_to_baseline(res: dict) -> None:
    """When :data:`BASELINE` ran: ``baseline_final_above_base`` (its final evaluation reward is above the base
    model's: else no method has a time to reach it) and per method ``seconds_to_baseline_final_reward`` /
    ``samples_to_baseline_final_reward`` (None: never within the budget, or n/a) and ``speedup_seconds`` /
    ``speedup_samples`` (the baseline's time to its own final reward over the method's)."""
    base = res["variants"].get(BASELINE)
    if base is None:
        return
    target = base["final_eval_reward"]
    res["baseline_final_above_base"] = above = target > base["curve"][0]["eval_reward"]
    for r in res["variants"].values():
        for x, key in (("train_seconds", "seconds"), ("samples", "samples")):
            r[f"{key}_to_baseline_final_reward"] = time_to_reach(r["curve"], target, x) if above else None
    for r in res["variants"].values():
        for key in ("seconds", "samples"):
            mine, theirs = r[f"{key}_to_baseline_final_reward"], base[f"{key}_to_baseline_final_reward"]
            r[f"speedup_{key}"] = theirs / mine if mine and theirs else None


def plot(res: dict, path: Path) -> None:
    """Reward vs training seconds, reward vs samples drawn, diversity and HF energy vs seconds (2 x 2)."""
    reward = ("eval_reward", "eval reward (fixed prompts and seeds)")
    samples = ("samples", "samples drawn (scored by the reward)")
    plot_panels(res, path, [(SECONDS, reward), (samples, reward), *((SECONDS, w) for w in WATCH)],
                f"every update on digits, {res['budget_seconds']:g} training s each", baseline=BASELINE, shape=(2, 2))


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def report(res: dict) -> str:
    """The table of a :func:`bench_methods` result: a row per method (skipped and failed ones say why), the
    real data's watch values, and how each method's time to GRPO's final reward reads."""
    head = (f"{'method':<12}{'sampler':>8}{'s/iter':>8}{'iters':>7}{'samples':>9}{'final reward':>14}"
            f"{'diversity':>11}{'HF energy':>11}{'to GRPO s':>11}{'to GRPO samples':>17}{'x fewer samples':>17}")
    rows = [head]
    for name, r in res["variants"].items():
        c = r["curve"][-1]
        rows.append(f"{name:<12}{r['sampler']['name']:>8}{r['seconds_per_iteration']:>8.2f}{r['iterations']:>7d}"
                    f"{r['samples_drawn']:>9d}{r['final_eval_reward']:>14.4f}{c['diversity']:>11.4f}"
                    f"{c['hf_energy']:>11.5f}{_num(r.get('seconds_to_baseline_final_reward'), '.1f'):>11}"
                    f"{_num(r.get('samples_to_baseline_final_reward'), 'd'):>17}"
                    f"{_num(r.get('speedup_samples'), '.2f'):>17}")
    rows += [f"{name:<12}skipped: {why}" for name, why in res["skipped"].items()]
    rows += [f"{name:<12}FAILED: {why}" for name, why in res["failed"].items()]
    real = res.get("real") or {}
    if real:
        rows.append(f"{'real data':<12}{'':>8}{'':>8}{'':>7}{'':>9}{real.get('reward', float('nan')):>14.4f}"
                    f"{real.get('diversity', float('nan')):>11.4f}{real.get('hf_energy', float('nan')):>11.5f}")
    base = res["variants"].get(BASELINE)
    if base is None:
        rows.append("time to GRPO's final eval reward: n/a (grpo was not among the methods run)")
    elif not res["baseline_final_above_base"]:
        rows.append(f"time to GRPO's final eval reward: n/a ({base['final_eval_reward']:.4f} is not above the base "
                    f"model's {base['curve'][0]['eval_reward']:.4f}: the base already reaches it; raise --budget)")
    else:
        rows.append(f"to GRPO s / samples: first evaluation at or above GRPO's final eval reward "
                    f"{base['final_eval_reward']:.4f} ('-': never within the budget); x fewer samples: GRPO's "
                    f"samples to it over the method's")
    return "\n".join(rows)


def _pairs(items: Sequence[str], flag: str) -> list[tuple[str, str]]:
    out = []
    for it in items or ():
        name, sep, value = it.partition(":")
        if not sep or not name or not value:
            raise BenchError(f"{flag} {it!r}: expected METHOD:VALUE, e.g. {flag} nft:train.lr=3e-4")
        out.append((name, value))
    return out


def _run(a) -> str:
    overrides: dict[str, list[str]] = {}
    for name, o in _pairs(a.method_override, "--method-override"):
        overrides.setdefault(name, []).append(o)
    recipes = dict(_pairs(a.method_recipe, "--method-recipe"))
    methods = [m for m in (a.methods or "").split(",") if m]
    return report(bench_methods(a.pipeline, a.budget, a.eval_every, a.out, methods, overrides, recipes,
                                a.overrides or []))


def add_methods_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``methods`` under the ``flowrl bench`` sub-commands."""
    p = subparsers.add_parser("methods", help="every update on the same prompts, seeds and budget: reward vs "
                                              "seconds and samples, the hacking watch (table; JSON + PNG with --out)",
                              epilog="example:\n  flowrl bench methods --pipeline digits --budget 120 --out bench\n"
                                     "  flowrl bench methods --methods grpo,nft,dpo --budget 60")
    p.add_argument("--pipeline", choices=["digits"], default="digits", help="the model (digits only)")
    p.add_argument("--budget", type=positive_float, default=120.0, help="training seconds per method")
    p.add_argument("--eval-every", type=positive_float, default=20.0, help="evaluate every N training seconds")
    p.add_argument("--methods", default=None, help=f"comma-separated subset of {','.join(BY_NAME)} (default: all)")
    p.add_argument("--method-override", action="append", metavar="METHOD:KEY=VALUE",
                   help="a dotted override for one method (repeatable), e.g. nft:train.loss_options.beta=0.5")
    p.add_argument("--method-recipe", action="append", metavar="METHOD:RECIPE",
                   help="run one method on this recipe (a shipped name or a path) instead of digits.yaml")
    p.add_argument("--out", default=None, help="write OUT/methods.json and OUT/methods.png here (default: nothing "
                                               "written, the table only)")
    p.add_argument("overrides", nargs="*", help="dotted overrides applied to every method")
    p.set_defaults(fn=_run)
    return p
