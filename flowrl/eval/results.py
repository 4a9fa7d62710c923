"""The numbers of an evaluation, as one JSON-ready dict (``eval.json``): per model and reward the mean
with its bootstrap interval, per tag, the mean over tags (GenEval's overall score), per prompt; the
reward-hacking watch; paired deltas and win rates against the first model; the hacking verdicts.

The mean over tags covers every tag of the suite or is not given: when a reward scored no prompt of
some tag, ``tag_mean`` is null and ``tag_mean_unavailable`` says why (``reason``, ``tags_scored``,
``tags_unscored``, ``prompts_scored`` of ``prompts``); :func:`unscored_tags` words it for the reports."""
from __future__ import annotations

from typing import Optional

import numpy as np

from . import stats
from .hacking import hacking_verdicts
from .panel import ModelScores, Plan

WATCH = ("diversity", "hf_energy")  # the reward-hacking watch's measures (flowrl.diagnostics)


def _clean(x):
    """NaN -> None, recursively (eval.json is standard JSON)."""
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, float) and x != x:
        return None
    return x


def watch_values(s: ModelScores) -> dict:
    """The watch's per-prompt values ``[P]``: diversity over seeds, mean high-frequency energy."""
    return {"diversity": s.diversity, "hf_energy": stats.prompt_means(s.hf_energy)}


def model_summary(s: ModelScores, tags: list, n_boot: int) -> dict:
    """One model: ``rewards`` {name: {mean, lo, hi, n, tag_mean?, tag_mean_unavailable?, tags}}, ``watch``
    {measure: interval} (module doc)."""
    tagged = len(set(tags)) > 1
    out = {"rewards": {}, "watch": {}}
    for name, x in s.scores.items():
        v = stats.prompt_means(x)
        entry = stats.bootstrap_mean(v, n_boot=n_boot).to_dict()
        entry["images"] = int(np.isfinite(x).sum())
        if tagged:
            cover = stats.tag_coverage(v, tags)
            if cover["tags_unscored"]:
                entry["tag_mean"] = None
                entry["tag_mean_unavailable"] = {
                    "reason": f"no score for tag(s) {', '.join(cover['tags_unscored'])}; the mean over tags needs "
                              f"every tag of the suite", **cover}
            else:
                entry["tag_mean"] = stats.bootstrap_mean(v, strata=tags, n_boot=n_boot).to_dict()
            entry["tags"] = {t: i.to_dict() for t, i in stats.by_tag(v, tags, n_boot=n_boot).items()}
        out["rewards"][name] = entry
    for name, v in watch_values(s).items():
        out["watch"][name] = stats.bootstrap_mean(v, n_boot=n_boot).to_dict()
    return out


def unscored_tags(result: dict) -> list[str]:
    """One sentence per reward whose mean over tags is not given (module doc): the tags without a score and,
    per model, how many prompts were scored (one model's count when every model has the same)."""
    lines = []
    for name in result["rewards"]:
        missing = {m["label"]: result["summary"][m["label"]]["rewards"][name].get("tag_mean_unavailable")
                   for m in result["models"]}
        missing = {label: u for label, u in missing.items() if u}
        if not missing:
            continue
        tags = list(dict.fromkeys(t for u in missing.values() for t in u["tags_unscored"]))
        counts = {f"{u['prompts_scored']} of {u['prompts']} prompts scored" for u in missing.values()}
        where = counts.pop() if len(counts) == 1 else "; ".join(
            f"{label}: {u['prompts_scored']} of {u['prompts']} prompts scored" for label, u in missing.items())
        lines.append(f"{name}: no score for tag(s) {', '.join(tags)} ({where}), so its mean over tags (GenEval's "
                     f"overall score) is not reported; the per-tag table shows the tags it scored")
    return lines


def deltas(base: ModelScores, other: ModelScores, n_boot: int) -> dict:
    """``other`` against ``base``: per reward the paired delta and win rate; per watch measure the
    paired delta of the per-prompt values."""
    out = {"rewards": {}, "watch": {}}
    for name in base.scores:
        d, w = stats.paired(base.scores[name], other.scores[name], n_boot=n_boot)
        out["rewards"][name] = {"delta": d.to_dict(), "win_rate": w.to_dict()}
    wb, wo = watch_values(base), watch_values(other)
    for name in WATCH:
        d, _ = stats.paired(wb[name][:, None], wo[name][:, None], n_boot=n_boot)
        out["watch"][name] = {"delta": d.to_dict()}
    return out


def per_prompt(plan: Plan, results: dict[str, ModelScores]) -> list[dict]:
    """One row per prompt: its text, tag and every model's mean of every reward."""
    rows = []
    for p, it in enumerate(plan.suite.items):
        rows.append({"index": p, "prompt": it.text, "tag": it.tag or "all",
                     "models": {m: {k: float(stats.prompt_means(v[p:p + 1])[0]) for k, v in s.scores.items()}
                                for m, s in results.items()}})
    return rows


def assemble(plan: Plan, models: list[dict], results: dict[str, ModelScores], n_boot: int,
             meta: Optional[dict] = None) -> dict:
    """The whole ``eval.json`` (module doc). ``models``: one dict per model (label, kind, path, ...,
    ``trained``: the rewards a run trained on), in order; the first is the baseline."""
    tags = plan.suite.tags
    labels = [m["label"] for m in models]
    summary = {m: model_summary(results[m], tags, n_boot) for m in labels}
    paired = {m: deltas(results[labels[0]], results[m], n_boot) for m in labels[1:]}
    out = {
        "version": 1,
        **(meta or {}),
        "suite": {"name": plan.suite.name, "source": plan.suite.source, "prompts": len(plan.suite.items),
                  "tags": list(dict.fromkeys(tags)), "fingerprint": plan.suite.fingerprint()},
        "per_prompt_seeds": plan.per_prompt,
        "rewards": {k: v for k, v in plan.rewards.items()},
        "models": models,
        "baseline": labels[0],
        "summary": summary,
        "paired": paired,
        "per_prompt": per_prompt(plan, results),
        "bootstrap": {"resamples": n_boot, "level": stats.LEVEL, "unit": "prompt"},
    }
    out["hacking"] = hacking_verdicts(out)
    return _clean(out)
