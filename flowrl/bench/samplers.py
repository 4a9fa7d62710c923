"""``flowrl bench {branch,tempflow,sol,preference}``: reward per wall-clock second of a sampler or
loss against flat GRPO, on one machine in one run (docs/algorithms.md §4-6; online DPO / GDRO)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..command_line import positive_float
from ..trainers.config_text import recipes_dir
from ..utils.io import write_json
from ..errors import BenchError
from .training import Variant, compare, table, time_to_reach


BRANCH_VARIANTS = {
    # flat GRPO with the same 16 samples per prompt and the same DanceGRPO step
    "flat_grpo": Variant(sampler={"name": "group", "group_size": 16, "num_steps": 10, "step": "dance",
                                  "noise_level": 0.3}, overrides=["train.loss_options.advantage_options={}"]),
    "branch": Variant(),
    "branch_mix": Variant(overrides=["sampler.mode=mix", "sampler.window=2"]),
}

TEMPFLOW_VARIANTS = {
    # flat GRPO at the same number of trained transitions per iteration (2 prompts x 8 x 8 steps)
    "flat_grpo": Variant(sampler={"name": "group", "group_size": 8, "num_steps": 10, "step": "sde",
                                  "noise_level": 0.7, "timestep_fraction": 0.8}, overrides=["train.batch_size=16"]),
    "tempflow": Variant(),
    "tempflow_no_weights": Variant(overrides=["sampler.noise_aware=false"]),
}

SOL_VARIANTS = {
    # the digits demo's flat GRPO (10 prompts x 8 samples, SDE) against Sol-RL selecting those 8 from 24
    "flat_grpo": Variant(sampler={"name": "group", "group_size": 8, "num_steps": 10, "step": "sde",
                                  "noise_level": 0.7}),
    # Sol-RL as in the paper: deterministic ODE regeneration (the previews rank what is trained on)
    # and the DiffusionNFT update (recipes/digits_sol_nft.yaml)
    "sol_nft_int8": Variant(recipe="digits_sol_nft.yaml"),
    "sol_nft_full_precision_explore": Variant(recipe="digits_sol_nft.yaml", overrides=["sampler.explore_backend=none"]),
    # DiffusionNFT without Sol: 8 random ODE samples per prompt (what the selection adds over the loss)
    "flat_nft": Variant(recipe="digits_sol_nft.yaml", sampler={"name": "ode", "group_size": 8, "num_steps": 10}),
    # Sol selection with Flow-GRPO SDE regeneration: the SDE noise decorrelates the regenerated
    # rewards from the ODE previews (Kendall tau ~0.3 on digits), so the selection is nearly random
    "sol_int8": Variant(),
    "sol_full_precision_explore": Variant(overrides=["sampler.explore_backend=none"]),
    # Sol-RL's ratio (the paper keeps 24 of 96): train on 2 best + 2 worst of 24, half flat GRPO's update
    "sol_int8_keep4": Variant(overrides=["sampler.keep=4", "train.batch_size=40"]),
    "sol_full_precision_explore_keep4": Variant(overrides=["sampler.explore_backend=none", "sampler.keep=4",
                                                           "train.batch_size=40"]),
}

PREFERENCE_VARIANTS = {
    # the demo's flat GRPO against online DPO / GDRO on 8 ODE samples per prompt (DiffusionNFT's recipe
    # settings: lr 1e-3, minibatch 40, no KL term)
    "flat_grpo": Variant(recipe="digits.yaml"),
    # (train.loss_options={}: the preference losses' own defaults, not the recipe's DiffusionNFT beta)
    "online_dpo": Variant(sampler={"name": "ode", "group_size": 8, "num_steps": 10},
                          overrides=["train.loss=dpo", "train.loss_options={}"]),
    "online_gdro": Variant(sampler={"name": "ode", "group_size": 8, "num_steps": 10},
                           overrides=["train.loss=gdro", "train.loss_options={}"]),
}

KINDS = {"branch": ("digits_branch.yaml", BRANCH_VARIANTS), "tempflow": ("digits_tempflow.yaml", TEMPFLOW_VARIANTS),
         "sol": ("digits_sol.yaml", SOL_VARIANTS), "preference": ("digits_sol_nft.yaml", PREFERENCE_VARIANTS)}


def bench_sampler(kind: str, pipeline: str = "digits", budget_seconds: float = 120.0, eval_every_seconds: float = 20.0,
                  out_dir: Optional[str] = None, variants: list[str] | None = None,
                  extra: list[str] | None = None) -> dict:
    """Train every variant of ``kind`` for ``budget_seconds`` of training time each -> the result dict
    (:func:`report` formats it); written as ``out_dir/<kind>.json`` and ``.png`` when ``out_dir`` is given."""
    if pipeline != "digits":
        raise BenchError(f"bench {kind} runs on the offline digits pipeline only (got {pipeline!r}); "
                         f"for SD3/FLUX run the recipes under recipes/ with `flowrl train` on a GPU machine")
    recipe_name, all_variants = KINDS[kind]
    unknown = sorted(set(variants or ()) - set(all_variants))
    chosen = {k: v for k, v in all_variants.items() if not variants or k in variants}
    if unknown or not chosen:
        raise BenchError(f"unknown variant(s) {unknown or variants} of bench {kind}; choose from {sorted(all_variants)}")
    out = Path(out_dir) if out_dir else None
    res = compare(chosen, str(recipes_dir() / recipe_name), budget_seconds, eval_every_seconds,
                  json_path=str(out / f"{kind}.json") if out else None, png_path=str(out / f"{kind}.png") if out else None,
                  title=f"{kind} vs flat GRPO on digits ({budget_seconds:.0f} s each)", extra=extra)
    if "flat_grpo" in res["variants"]:
        flat = res["variants"]["flat_grpo"]
        # a target the base model already meets has no time to reach it (not "0.0 s")
        res["flat_final_above_base"] = flat["final_eval_reward"] > flat["curve"][0]["eval_reward"]
        for name, r in res["variants"].items():
            r["rollout_time_ratio_vs_flat"] = r["rollout_seconds_per_iteration"] / flat["rollout_seconds_per_iteration"] \
                * flat["samples_per_iteration"] / r["samples_per_iteration"]
            r["model_eval_ratio_vs_flat"] = r["model_evals_per_iteration"] / flat["model_evals_per_iteration"] \
                * flat["samples_per_iteration"] / r["samples_per_iteration"]
            # wall-clock to reach the flat baseline's final eval reward (None: never within the budget, or n/a)
            r["seconds_to_flat_final_reward"] = (time_to_reach(r["curve"], flat["final_eval_reward"])
                                                 if res["flat_final_above_base"] else None)
        if out:
            write_json(res, out / f"{kind}.json")
    if out:
        print(f"[bench {kind}] wrote {out / (kind + '.json')} and {out / (kind + '.png')}")
    return res


def report(res: dict) -> str:
    """The table of a :func:`bench_sampler` result, then each variant's cost and time to flat GRPO's reward."""
    lines = [table(res)]
    for name, r in res["variants"].items():
        if "rollout_time_ratio_vs_flat" in r:
            lines.append(f"{name:<20} rollout time per sample vs flat {r['rollout_time_ratio_vs_flat']:.3f}   "
                         f"model evaluations per sample vs flat {r['model_eval_ratio_vs_flat']:.3f}")
    if "flat_grpo" in res["variants"]:
        flat = res["variants"]["flat_grpo"]
        target, base = flat["final_eval_reward"], flat["curve"][0]["eval_reward"]
        if not res.get("flat_final_above_base", target > base):
            lines.append(f"time to flat GRPO's final eval reward: n/a ({target:.4f} is not above the base model's "
                         f"{base:.4f}: the base already reaches it; raise --budget)")
            return "\n".join(lines)
        for name, r in res["variants"].items():
            t = r.get("seconds_to_flat_final_reward")
            lines.append(f"{name:<20} reaches flat GRPO's final eval reward {target:.4f} at "
                         + (f"{t:.1f} training s" if t is not None else "never (within the budget)"))
    return "\n".join(lines)


def add_parsers(bench_sub) -> None:
    for kind in KINDS:
        p = bench_sub.add_parser(kind, help=f"{kind} vs flat GRPO: reward per wall-clock second (table; JSON + PNG "
                                            f"with --out)",
                                 epilog=f"example:\n  flowrl bench {kind} --pipeline digits --budget 120 --out bench")
        p.add_argument("--pipeline", choices=["digits"], default="digits", help="the model (digits only)")
        p.add_argument("--budget", type=positive_float, default=120.0, help="training seconds per variant")
        p.add_argument("--eval-every", type=positive_float, default=20.0, help="evaluate every N training seconds")
        p.add_argument("--out", default=None, help=f"write OUT/{kind}.json and OUT/{kind}.png here "
                                                   f"(default: nothing written, the table only)")
        p.add_argument("--variants", nargs="*", default=None, help=f"subset of {sorted(KINDS[kind][1])}")
        p.add_argument("overrides", nargs="*", help="dotted overrides applied to every variant")
        p.set_defaults(fn=lambda a, k=kind: report(bench_sampler(k, a.pipeline, a.budget, a.eval_every, a.out,
                                                                 a.variants, a.overrides)))
