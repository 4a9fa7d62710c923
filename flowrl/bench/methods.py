"""``flowrl bench methods``: every update on the same prompts, seeds and wall budget, in one run.

On the digits world by default; ``--pipeline shapes`` runs the same bench on the shapes world: a world is one
entry of :data:`flowrl.bench.worlds.WORLDS` (its base recipe, and ``<world>_<x>.yaml`` for a method whose digits
recipe is ``digits_<x>.yaml``); what follows says "digits" for the default world's files.

Each registered update is a row (:func:`all_methods`), made from its declaration alone: its one-line
``summary``, its own digits recipe (``digits_recipe``, used as is when this build ships it) and, for an update
that declares none, the overrides that put it on ``recipes/digits.yaml`` (10 prompts x 8 samples per
iteration, the fixed evaluation set): the GRPO family keeps the recipe's group sampler with SDE steps (it
trains on stored transitions); the updates on finished samples get 8 deterministic ODE samples per prompt,
DiffusionNFT's digits minibatch and their own default options. An update on a dataset (offline GDRO, SFT,
offline Diffusion-DPO) runs on its recipe: its dataset is made first and those seconds count
(:mod:`flowrl.bench.dataset_methods`). Whatever the recipe, every method gets the bench's footing
(:data:`FOOTING`: the base model, the training and evaluation prompts, the evaluation seeds, ``train.seed``)
from ``digits.yaml`` and the shared overrides, and trains for the same budget of training seconds (rollout
+ reward + update, evaluation excluded; :func:`flowrl.bench.training.run_variant`), one after another in
this process. A recipe that evaluates differently in another way (ODE steps, reward weights) is run and
the difference is printed and kept in its row (``differs``).

The result (:mod:`flowrl.bench.methods_report`): per method the evaluation reward against training seconds
and against samples drawn, the watch's within-prompt diversity and high-frequency energy
(:mod:`flowrl.diagnostics`) beside the real data's, and when GRPO ran, the seconds and samples each method
took to reach GRPO's final evaluation reward. A method that needs its recipe where this build has none is
one line, "not available in this build"; a method that fails while training is reported as failed (its
traceback on stderr) and the others still run.
"""
from __future__ import annotations

import argparse
import json
import os
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

from ..command_line import positive_float, positive_int
from ..errors import BenchError
from ..trainers.config_text import read_recipe, recipes_dir, resolve_recipe
from ..utils.io import write_json
from .dataset_methods import run_dataset_variant
from .methods_merge import merge_results, read_parts
from .methods_report import add_times_to_baseline, markdown, plot, report
from .methods_tags import add_tags
from .methods_seeds import add_intervals, combine
from .precision_measure import cpu_name
from .training import Variant, run_variant
from .worlds import WORLDS, World, world

RECIPE = "digits.yaml"
BASELINE = "grpo"  # the method the "time to reach" columns measure against

# the updates that train on finished samples: 8 ODE samples per prompt (the recipe's group size and
# steps), the update's own default options, DiffusionNFT's digits minibatch (recipes/digits_sol_nft.yaml)
ON_SAMPLES = ("sampler={name: ode, group_size: 8, num_steps: 10}", "train.loss_options={}",
              "train.minibatch_size=40", "train.grad_accum=1")
# what every method shares, taken from digits.yaml + the shared overrides: the same base model, prompts,
# evaluation prompts, seeds and held-out rewards, and seed of every random draw (a method's recipe cannot change them)
FOOTING = ("model", "data.prompts", "data.eval_prompts", "data.eval_seeds_per_prompt", "reward.heldout", "train.seed")
# what a method's recipe may change although it changes the evaluation too: reported, not forced
# (the evaluation's ODE steps are the sampler's; the evaluation reward is the weighted sum of the rewards)
EVALUATION = ("sampler.num_steps", "reward.weights")


@dataclass(frozen=True)
class Method:
    """One row of the bench: update ``loss`` (``train.loss``). ``recipe``: its own digits recipe (a file of
    the shipped recipes), used as is when shipped (it must train ``loss``). Otherwise ``recipes/digits.yaml``
    with ``train.loss=loss`` and ``overrides`` (empty: a GRPO-family update keeps the recipe's group sampler
    and the GRPO loss options it takes); ``overrides=None``: the method runs only on its recipe."""

    name: str
    loss: str
    overrides: Optional[tuple[str, ...]] = ()
    recipe: Optional[str] = None
    note: str = ""
    offline: bool = False  # trains on a dataset (train.mode offline): its dataset made first (bench.dataset_methods)

    def in_world(self, w: World) -> "Method":
        """This row in world ``w``: its recipe the world's (``digits_<x>.yaml`` -> ``<world>_<x>.yaml``)."""
        return replace(self, recipe=w.method_recipe(self.recipe))

    def shipped_recipe(self) -> Optional[Path]:
        """This method's digits recipe when this build ships it (None: it has none here)."""
        path = recipes_dir() / self.recipe if self.recipe else None
        return path if path is not None and path.is_file() else None

    def variant(self, more: Sequence[str] = (), recipe: Optional[str] = None) -> Variant:
        """The bench variant: ``recipe`` (a given one), else its shipped recipe, else digits.yaml with this row's
        overrides; then ``more``. ``train.loss`` is this row's on every recipe."""
        mine = self.shipped_recipe()
        if recipe is None and mine is not None:
            got = (read_recipe(mine).get("train") or {}).get("loss")
            if got != self.loss:
                raise BenchError(f"method {self.name}: recipes/{self.recipe} trains train.loss={got}, not {self.loss}; "
                                 f"fix the update's digits_recipe declaration")
            recipe = str(mine)
        fallback = () if recipe is not None else tuple(self.overrides or ())
        return Variant(overrides=[f"train.loss={self.loss}", *fallback, *more], recipe=recipe)


def all_methods() -> tuple[Method, ...]:
    """A row per registered update, in the registry's order, from its declaration alone: its ``summary``, its
    ``digits_recipe`` (it runs on that recipe only), else ``recipes/digits.yaml`` with the GRPO family's group
    sampler kept or, for an update on finished samples, :data:`ON_SAMPLES`. An update on a dataset runs on its
    recipe (:mod:`flowrl.bench.dataset_methods`)."""
    from ..updates import UPDATES, default_needs

    rows = []
    for name in UPDATES.entries:
        cls, needs = UPDATES.get(name), default_needs(name)
        overrides = None if cls.digits_recipe else ON_SAMPLES if not needs.transitions else ()
        rows.append(Method(name, name, overrides, recipe=cls.digits_recipe, note=cls.summary,
                           offline=needs.consumes != "rollout"))
    return tuple(rows)


def _check_names(names, what: str) -> None:
    known = [m.name for m in all_methods()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise BenchError(f"unknown method(s) {', '.join(map(repr, unknown))}{what}; choose from "
                         f"{', '.join(known)}")


def skip_reason(m: Method, given_recipe: bool = False) -> Optional[str]:
    """Why ``m`` cannot run in this build (None: it can); ``given_recipe``: the user gave it a recipe."""
    if m.overrides is None and not given_recipe and m.shipped_recipe() is None:
        return f"not available in this build (it runs on recipes/{m.recipe}, which this build does not ship)"
    return None


def _get(d: dict, key: str):
    for part in key.split("."):
        d = d[part]
    return d


def _footing(base) -> list[str]:
    """The :data:`FOOTING` of config ``base`` as overrides (whole values, JSON is YAML)."""
    d = base.to_dict()
    return [f"{k}={json.dumps(_get(d, k))}" for k in FOOTING]


def _evaluation(cfg) -> dict:
    d = cfg.to_dict()
    out = {k: _get(d, k) for k in EVALUATION}
    out["reward.weights"] = {k: w for k, w in out["reward.weights"].items() if w}  # weight 0: logged only
    return out


def chosen_runs(methods: Optional[Sequence[str]] = None, method_overrides: Optional[dict] = None,
                method_recipes: Optional[dict] = None, extra: Sequence[str] = (),
                pipeline: str = "digits") -> tuple[dict, dict]:
    """The chosen methods (all when ``methods`` is empty), in the table's order -> (``{name: Variant}`` of those
    that run, every config validated, ``{name: reason}`` of those skipped). ``method_overrides`` /
    ``method_recipes``: ``{name: [overrides]}`` / ``{name: recipe}`` for single methods; ``extra``: overrides
    for every method (after a method's own declaration, before its ``method_overrides``); the footing last
    (from world ``pipeline``'s base recipe, :mod:`flowrl.bench.worlds`)."""
    w = world(pipeline)
    w.check_shipped()
    method_overrides, method_recipes = dict(method_overrides or {}), dict(method_recipes or {})
    _check_names(list(methods or ()), "")
    _check_names([*method_overrides, *method_recipes], " in --method-override / --method-recipe")
    try:
        footing = _footing(Variant().config(w.recipe, list(extra)))
    except ValueError as e:
        raise BenchError(f"the shared overrides: {e}") from None
    runs, skipped = {}, {}
    for m in (m.in_world(w) for m in all_methods() if not methods or m.name in methods):
        reason = skip_reason(m, m.name in method_recipes)
        if reason is not None:
            skipped[m.name] = reason
            continue
        try:
            recipe = method_recipes.get(m.name)
            var = m.variant([*extra, *method_overrides.get(m.name, ()), *footing],
                            str(resolve_recipe(recipe).resolve()) if recipe else None)
            var.config(w.recipe, [])  # validated before any model loads
        except BenchError:
            raise
        except ValueError as e:
            raise BenchError(f"method {m.name}: {e}") from None
        runs[m.name] = var
    return runs, skipped


def _differences(runs: dict, extra: Sequence[str], recipe: str = RECIPE) -> dict:
    """``{name: {key: [method's, the base recipe's]}}`` of the :data:`EVALUATION` keys a method's recipe changes
    (``recipe``: the world's base recipe)."""
    base = _evaluation(Variant().config(recipe, list(extra)))
    out = {}
    for name, var in runs.items():
        mine = _evaluation(var.config(recipe, []))
        diff = {k: [mine[k], base[k]] for k in EVALUATION if mine[k] != base[k]}
        if diff:
            out[name] = diff
    return out


def _train_all(runs: dict, train_seeds: list, budget_seconds: float, eval_every_seconds: float,
               progress: bool, recipe: str = RECIPE, headline: Optional[str] = None) -> tuple[dict, dict]:
    """Every method on every training seed, seed by seed (each seed's methods one after another, so a drift of
    the machine's load touches every method alike) -> (``{name: [result per seed]}``, ``{name: failure}``). With
    one seed, the footing's ``train.seed`` as is; else ``train.seed`` of each. A method that fails on a seed is
    dropped from the later seeds. ``recipe``: the world's base recipe; ``headline``: its
    :attr:`~flowrl.bench.worlds.World.headline`."""
    results, failed, rows = {name: [] for name in runs}, {}, {m.name: m for m in all_methods()}
    many = len(train_seeds) > 1
    for k, seed in enumerate(train_seeds, 1):
        todo = [name for name in runs if name not in failed]
        for i, name in enumerate(todo, 1):
            var = runs[name]
            if many:
                var = Variant(overrides=[*var.overrides, f"train.seed={seed}"], sampler=var.sampler, recipe=var.recipe)
            if progress:
                at = f"seed {seed} ({k}/{len(train_seeds)}), " if many else ""
                print(f"[bench methods] {at}{i}/{len(todo)} {name}: {Path(var.recipe or recipe).name} "
                      f"train.loss={rows[name].loss} ({budget_seconds:g} training s)", flush=True)
            try:
                run = run_dataset_variant if rows[name].offline else run_variant  # a dataset made first, counted
                results[name].append(run(recipe, var, budget_seconds, eval_every_seconds, progress=progress,
                                         headline=headline))
            except Exception as e:  # noqa: BLE001 (one method's failure is its row; the others still run)
                traceback.print_exc()
                failed[name] = (f"train.seed {seed}: " if many else "") + " ".join(f"{type(e).__name__}: {e}".split())
                print(f"[bench methods] {name}: FAILED: {failed[name]}", flush=True)
    return {name: r for name, r in results.items() if name not in failed}, failed


def bench_methods(pipeline: str = "digits", budget_seconds: float = 120.0, eval_every_seconds: float = 20.0,
                  out_dir: Optional[str] = None, methods: Optional[Sequence[str]] = None,
                  method_overrides: Optional[dict] = None, method_recipes: Optional[dict] = None,
                  extra: Sequence[str] = (), progress: bool = True, seeds: int = 1) -> dict:
    """Train every chosen method for ``budget_seconds`` of training time each, on ``seeds`` training seeds
    (``train.seed`` of the world's base recipe with the shared overrides, and the next ``seeds - 1``; world
    ``pipeline``: :mod:`flowrl.bench.worlds`) -> the result dict
    (:func:`~flowrl.bench.methods_report.report` formats it); written as ``out_dir/methods.json`` and
    ``methods.png`` when ``out_dir`` is given, nothing written otherwise. Arguments as :func:`chosen_runs`.
    With one seed a row is that run; with more, the seed means with 95% intervals
    (:mod:`flowrl.bench.methods_seeds`), every seed's run kept in the row's ``runs``. When the evaluation prompts
    carry tags, each row also has its final evaluation reward per tag (``final_tags``; ``tags``: the tags). A world
    with a ``headline`` (:mod:`flowrl.bench.worlds`) ranks by that held-out reward: the rows' evaluation reward is
    its (``headline``, ``headline_about`` in the result), the trained reward's kept in each point."""
    runs, skipped = chosen_runs(methods, method_overrides, method_recipes, extra, pipeline)
    w = world(pipeline)
    recipe = w.recipe
    differs = _differences(runs, extra, recipe)
    for name, reason in skipped.items():
        print(f"[bench methods] {name}: {reason}", flush=True)
    for name, diff in differs.items():
        print(f"[bench methods] {name}: its recipe evaluates differently: "
              + "; ".join(f"{k} {a} ({recipe}: {b})" for k, (a, b) in diff.items()), flush=True)
    first = Variant().config(recipe, list(extra)).train.seed
    train_seeds = [first + k for k in range(seeds)]
    results, failed = _train_all(runs, train_seeds, budget_seconds, eval_every_seconds, progress, recipe, w.headline)
    rows = {m.name: m for m in all_methods()}
    variants = {name: {"note": rows[name].note, "overrides": list(runs[name].overrides),
                       "differs": differs.get(name, {}),
                       **(r[0] if seeds == 1 else combine(r, train_seeds))} for name, r in results.items()}
    res = {"pipeline": pipeline, "recipe": recipe, "budget_seconds": budget_seconds,
           "eval_every_seconds": eval_every_seconds, "baseline": BASELINE, "train_seeds": train_seeds,
           **({"headline": w.headline, "headline_about": w.headline_about} if w.headline else {}),
           "variants": variants, "skipped": skipped, "failed": failed,
           "real": next((r["real"] for r in variants.values() if r.get("real")), {}),
           "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
           "note": "training seconds = rollout + reward + update, evaluation excluded; samples = finished samples "
                   "the rollouts scored"}
    return finish(res, out_dir)


def finish(res: dict, out_dir: Optional[str] = None) -> dict:
    """The measures across a result's rows (the time to the baseline's final reward, with intervals when it has
    several seeds; the per-tag table), then ``out_dir/methods.json`` and ``methods.png`` when ``out_dir`` is given."""
    (add_times_to_baseline if len(res["train_seeds"]) == 1 else add_intervals)(res, res["baseline"])
    add_tags(res)
    if out_dir:
        out = Path(out_dir)
        write_json(res, out / "methods.json")
        plot(res, out / "methods.png", res["baseline"])
        print(f"[bench methods] wrote {out / 'methods.json'} and {out / 'methods.png'}", flush=True)
    return res


def _pairs(items: Sequence[str], flag: str) -> list[tuple[str, str]]:
    out = []
    for it in items or ():
        name, sep, value = it.partition(":")
        if not sep or not name or not value:
            raise BenchError(f"{flag} {it!r}: expected METHOD:VALUE, e.g. {flag} nft:train.lr=3e-4")
        out.append((name, value))
    return out


def _run(a) -> str:
    if a.merge:
        res = finish(merge_results(read_parts(a.merge)), a.out)
        return markdown(res) if a.markdown else report(res)
    overrides: dict[str, list[str]] = {}
    for name, o in _pairs(a.method_override, "--method-override"):
        overrides.setdefault(name, []).append(o)
    recipes = dict(_pairs(a.method_recipe, "--method-recipe"))
    methods = [m.strip() for m in (a.methods or "").split(",") if m.strip()]
    res = bench_methods(a.pipeline, a.budget, a.eval_every, a.out, methods, overrides, recipes, a.overrides or [],
                        seeds=a.seeds)
    return markdown(res) if a.markdown else report(res)


def add_methods_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``methods`` under the ``flowrl bench`` sub-commands."""
    p = subparsers.add_parser("methods", help="every update on the same prompts, seeds and budget: reward vs "
                                              "seconds and samples, the hacking watch (table; JSON + PNG with --out)",
                              epilog="example:\n  flowrl bench methods --pipeline digits --budget 60 --out bench\n"
                                     "  flowrl bench methods --methods grpo,nft,dpo --budget 60\n"
                                     "  flowrl bench methods --seeds 3 --budget 60 --out bench\n"
                                     "  flowrl bench methods --pipeline shapes --seeds 3 --budget 60 --out bench\n"
                                     "  flowrl bench methods --merge a/methods.json b/methods.json --out bench")
    p.add_argument("--pipeline", choices=list(WORLDS), default="digits",
                   help="the world: " + "; ".join(f"{w.name}: {w.about}" for w in WORLDS.values()))
    p.add_argument("--budget", type=positive_float, default=120.0, help="training seconds per method")
    p.add_argument("--eval-every", type=positive_float, default=20.0, help="evaluate every N training seconds")
    p.add_argument("--seeds", type=positive_int, default=1,
                   help="training seeds per method (train.seed and the next ones; the same prompts and evaluation "
                        "seeds): with more than one, the seed means with 95%% intervals over the seeds")
    p.add_argument("--methods", default=None, help="comma-separated subset of the registered updates (default: all; "
                                                   "`flowrl train --help` lists them)")
    p.add_argument("--method-override", action="append", metavar="METHOD:KEY=VALUE",
                   help="a dotted override for one method (repeatable), e.g. nft:train.loss_options.beta=0.5")
    p.add_argument("--method-recipe", action="append", metavar="METHOD:RECIPE",
                   help="run one method on this recipe (a shipped name or a path) instead of its own or digits.yaml")
    p.add_argument("--markdown", action="store_true",
                   help="print the table in markdown, the README's columns (default: the text table)")
    p.add_argument("--out", default=None, help="write OUT/methods.json and OUT/methods.png here (default: nothing "
                                               "written, the table only)")
    p.add_argument("--merge", nargs="+", metavar="METHODS_JSON", default=None,
                   help="run nothing: combine the methods.json of runs of the same bench split across processes "
                        "(each method in one part) into one table (and OUT/methods.json, methods.png with --out)")
    p.add_argument("overrides", nargs="*", help="dotted overrides applied to every method")
    p.set_defaults(fn=_run)
    return p


def __getattr__(name: str):
    """``METHODS`` / ``BY_NAME``: the rows of the updates registered now (:func:`all_methods`)."""
    if name == "METHODS":
        return all_methods()
    if name == "BY_NAME":
        return {m.name: m for m in all_methods()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
