"""``flowrl bench methods --merge A.json B.json ...``: one result from runs of the same bench split across
processes (or machines): e.g. two one-core processes, each running half the methods, on a 2-core machine.

The parts must agree on everything that makes their rows comparable (:data:`SAME`: the world, its base recipe,
the budget, the evaluation cadence, the training seeds, the baseline and the headline measure) and name each
method once; the merged result holds every part's rows in order, and what depends on several rows (the time to
the baseline's final reward with its intervals, the per-tag table) is computed again over all of them.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from ..errors import BenchError

SAME = ("pipeline", "recipe", "budget_seconds", "eval_every_seconds", "train_seeds", "baseline", "headline")


def read_parts(paths: Sequence[str]) -> list[dict]:
    """The ``methods.json`` results at ``paths`` (a one-line error for a missing or unreadable file)."""
    parts = []
    for p in paths:
        try:
            parts.append(json.loads(Path(p).read_text()))
        except (OSError, ValueError) as e:
            raise BenchError(f"--merge {p}: cannot read a bench methods result ({type(e).__name__}: {e})") from None
        if not isinstance(parts[-1], dict) or "variants" not in parts[-1]:
            raise BenchError(f"--merge {p}: not a `flowrl bench methods` result (no 'variants')")
    return parts


def merge_results(parts: Sequence[dict]) -> dict:
    """One result of the ``parts`` (module doc): the first part's settings, every part's rows, skipped and failed
    methods (a method that ran in one part is not skipped), ``machine`` the first part's (``machines``: each
    part's when they differ) and ``merged_from`` the number of parts. The rows' cross-row measures are left to
    the caller (:func:`flowrl.bench.methods.finish`)."""
    if len(parts) < 2:
        raise BenchError(f"--merge needs at least two results, got {len(parts)}")
    first = parts[0]
    for k, part in enumerate(parts[1:], 2):
        for key in SAME:
            if part.get(key) != first.get(key):
                raise BenchError(f"--merge: part {k} has {key}={part.get(key)!r}, part 1 {first.get(key)!r}; only runs "
                                 f"of the same bench (world, budget, evaluation, seeds) merge")
    variants: dict = {}
    for k, part in enumerate(parts, 1):
        for name, row in part["variants"].items():
            if name in variants:
                raise BenchError(f"--merge: method {name!r} is in two parts (part {k} and an earlier one); run each "
                                 f"method in one part")
            variants[name] = row
    ran = set(variants)
    machines = [p.get("machine") for p in parts]
    out = {**first, "variants": variants,
           "skipped": {n: why for p in parts for n, why in p.get("skipped", {}).items() if n not in ran},
           "failed": {n: why for p in parts for n, why in p.get("failed", {}).items()},
           "real": next((p["real"] for p in parts if p.get("real")), {}), "merged_from": len(parts)}
    if any(m != machines[0] for m in machines):
        out["machines"] = machines
    return out
