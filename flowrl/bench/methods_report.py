"""The results of ``flowrl bench methods`` (:mod:`flowrl.bench.methods`): time to the baseline's final
reward, the table and the picture; a result of several training seeds is shown with its intervals
(:mod:`flowrl.bench.methods_seeds`)."""
from __future__ import annotations

from pathlib import Path

from . import methods_seeds
from .methods_seeds import num
from .methods_tags import plot_tags, tag_markdown, tag_table
from .training import plot_panels, time_to_reach


def _seeded(res: dict) -> bool:
    """Whether ``res`` holds several training seeds per method (rows of seed means with intervals)."""
    return len(res.get("train_seeds") or ()) > 1


def add_times_to_baseline(res: dict, baseline: str) -> None:
    """When method ``baseline`` ran: ``baseline_final_above_base`` (its final evaluation reward is above the
    base model's: else no method has a time to reach it) and per method ``seconds_to_baseline_final_reward`` /
    ``samples_to_baseline_final_reward`` (the first evaluation at or above it; None: never within the budget,
    or n/a) and ``speedup_seconds`` / ``speedup_samples`` (the baseline's time to its own final reward over the
    method's)."""
    base = res["variants"].get(baseline)
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


def plot(res: dict, path: Path, baseline: str) -> None:
    """Reward vs training seconds, reward vs samples drawn, diversity and HF energy vs seconds (2 x 2); with
    several seeds, their mean curves and shaded intervals (:func:`~flowrl.bench.methods_seeds.plot`); with tags,
    a fifth panel of the final reward per tag (:func:`~flowrl.bench.methods_tags.plot_tags`)."""
    more = (lambda ax: plot_tags(ax, res)) if res.get("tags") else None
    if _seeded(res):
        return methods_seeds.plot(res, path, baseline, more)
    plot_panels(res, path, methods_seeds.PANELS, f"every update on {res.get('pipeline', 'digits')}, "
                f"{res['budget_seconds']:g} training s each", baseline=baseline, shape=(2, 2 if more is None else 3),
                more=more)


HEAD = (f"{'method':<12}{'recipe':>20}{'sampler':>8}{'s/iter':>8}{'iters':>7}{'samples':>9}{'final reward':>14}"
        f"{'diversity':>11}{'HF energy':>11}{'to GRPO s':>11}{'to GRPO samples':>17}{'x fewer samples':>17}")


def _row(name: str, r: dict) -> str:
    c = r["curve"][-1]
    return (f"{name:<12}{Path(r['recipe']).name:>20}{r['sampler']['name']:>8}{r['seconds_per_iteration']:>8.2f}"
            f"{r['iterations']:>7d}{r['samples_drawn']:>9d}{r['final_eval_reward']:>14.4f}{c['diversity']:>11.4f}"
            f"{c['hf_energy']:>11.5f}{num(r.get('seconds_to_baseline_final_reward'), '.1f'):>11}"
            f"{num(r.get('samples_to_baseline_final_reward'), 'd'):>17}{num(r.get('speedup_samples'), '.2f'):>17}")


def _baseline_line(res: dict) -> str:
    name = res["baseline"]
    base = res["variants"].get(name)
    if base is None:
        return f"time to GRPO's final eval reward: n/a ({name} was not among the methods run)"
    first = (base["mean_curves"]["train_seconds"] if _seeded(res) else base["curve"])[0]["eval_reward"]
    if not res["baseline_final_above_base"]:
        return (f"time to GRPO's final eval reward: n/a ({base['final_eval_reward']:.4f} is not above the base "
                f"model's {first:.4f}: the base already reaches it; raise --budget)")
    if _seeded(res):
        return (f"to GRPO s / samples: first point of the seed-mean curve at or above GRPO's seed-mean final eval "
                f"reward {base['final_eval_reward']:.4f}; x fewer samples: GRPO's samples to it over the method's")
    return (f"to GRPO s / samples: first evaluation at or above GRPO's final eval reward {base['final_eval_reward']:.4f}"
            f" ('-': never within the budget); x fewer samples: GRPO's samples to it over the method's")


def report(res: dict) -> str:
    """The table of a bench-methods result: a row per method (unavailable and failed ones say why), the real
    data's watch values, how a recipe's different evaluation reads, and the time to GRPO's final reward."""
    seeded = _seeded(res)
    head, row = (methods_seeds.HEAD, methods_seeds.row) if seeded else (HEAD, _row)
    rows = [head, *(row(name, r) for name, r in res["variants"].items())]
    rows += [f"{name:<12}{why}" for name, why in res["skipped"].items()]
    rows += [f"{name:<12}FAILED: {why}" for name, why in res["failed"].items()]
    real = res.get("real") or {}
    if real:
        rows.append(methods_seeds.real_row(real) if seeded else
                    f"{'real data':<12}{'':>20}{'':>8}{'':>8}{'':>7}{'':>9}{real.get('reward', float('nan')):>14.4f}"
                    f"{real.get('diversity', float('nan')):>11.4f}{real.get('hf_energy', float('nan')):>11.5f}")
    for name, r in res["variants"].items():
        if r.get("differs"):
            rows.append(f"{name}: its recipe evaluates differently: "
                        + "; ".join(f"{k} {a} ({res.get('recipe', 'digits.yaml')}: {b})"
                                    for k, (a, b) in r["differs"].items()))
    rows.append(_baseline_line(res))
    rows += headline_lines(res)
    if seeded:
        rows.append(methods_seeds.legend(res))
    return "\n".join([*rows, *tag_table(res)])


def _trained(r: dict) -> str:
    """A row's final trained reward (``mean [lo, hi]`` over seeds), ``-`` when not measured."""
    f = r.get("final", {}).get(methods_seeds.TRAINED)
    if f is not None:
        return methods_seeds.cell(f[0], f[1:], ".3f")
    return methods_seeds.num(r["curve"][-1].get(methods_seeds.TRAINED) if "curve" in r else None, ".3f")


def headline_lines(res: dict) -> list[str]:
    """With a world's headline (:attr:`flowrl.bench.worlds.World.headline`): what the eval reward is, and each
    row's final trained reward beside it (``[]`` otherwise)."""
    if not res.get("headline"):
        return []
    return [res["headline_about"] + ".",
            "final trained reward: " + "; ".join(f"{name} {_trained(r)}" for name, r in res["variants"].items())]


MARKDOWN_HEAD = ("| method | recipe | sampler | s/iter | samples | final reward | diversity | HF energy | "
                 "to GRPO's final: s | samples | x fewer samples |\n" + "|---" * 11 + "|")


def _cells(r: dict, seeded: bool) -> list[str]:
    """A row's measures for the markdown table: values, ``mean [lo, hi]`` for several seeds."""
    times = [methods_seeds.cell(r.get(k), r.get(f"{k}_interval"), fmt) for k, fmt in (
        ("seconds_to_baseline_final_reward", ".1f"), ("samples_to_baseline_final_reward", ".0f"),
        ("speedup_samples", ".2f"))]
    if seeded:
        f = r["final"]
        ends = [methods_seeds.cell(f[k][0], f[k][1:], fmt) for k, fmt in (
            ("eval_reward", ".3f"), ("diversity", ".3f"), ("hf_energy", ".4f"))]
    else:
        c = r["curve"][-1]
        ends = [f"{r['final_eval_reward']:.3f}", f"{c['diversity']:.3f}", f"{c['hf_energy']:.4f}"]
    return [f"{r['seconds_per_iteration']:.2f}", f"{r['samples_drawn']:.0f}", *ends, *times]


def markdown(res: dict) -> str:
    """The table of a bench-methods result in markdown, the README's columns: a row per method that ran
    (the registry's names), then the real data's reward and watch values; with tags, the table per tag after it."""
    seeded = _seeded(res)
    rows = [MARKDOWN_HEAD]
    for name, r in res["variants"].items():
        rows.append("| " + " | ".join([name, Path(r["recipe"]).name, r["sampler"]["name"], *_cells(r, seeded)]) + " |")
    real = res.get("real") or {}
    if real:
        rows.append(f"| real data | | | | | {real['reward']:.3f} | {real['diversity']:.3f} | {real['hf_energy']:.4f} "
                    f"| | | |")
    tags = tag_markdown(res)
    head = headline_lines(res)
    return "\n".join([*rows, *(["", *head] if head else []),
                      *(["", "Final evaluation reward per tag:", "", *tags] if tags else [])])
