"""``flowrl eval``'s harness flags (light: imported when the parser is built)."""
from __future__ import annotations

import argparse

from flowrl.command_line import positive_int


class ModelAction(argparse.Action):
    """``--config`` / ``--run``, repeatable: each value is appended to ``models`` as ``(kind, value)`` in
    command-line order (the first model is the baseline); ``config`` / ``run`` keep the last value, so a
    one-model evaluation reads as it always has."""

    def __call__(self, parser, namespace, values, option_string=None):
        models = list(getattr(namespace, "models", None) or [])
        models.append((self.dest, values))
        namespace.models = models
        setattr(namespace, self.dest, values)


def add_harness_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that make ``flowrl eval`` a comparison of models on a suite (flowrl.eval)."""
    p.set_defaults(models=[])
    p.add_argument("--suite", default=None, help="prompt suite: geneval, ocr, digits, a shipped set, or a "
                   ".txt / .jsonl / .csv file (default: the first model's data.eval_prompts)")
    p.add_argument("--rewards", default=None, help="comma-separated reward panel, every sample scored by each, e.g. "
                   "geneval,pickscore (default: the models' trained and held-out rewards); options as "
                   "reward.options.NAME.KEY=VALUE")
    p.add_argument("--out", default=None, help="directory for eval.json, report.html and the per-chunk results; an "
                   "interrupted evaluation with the same --out resumes")
    p.add_argument("--batch", type=positive_int, default=64, help="samples per chunk (whole prompts; each finished chunk "
                   "is saved)")
    p.add_argument("--bootstrap", type=positive_int, default=1000, help="bootstrap resamples for the 95%% intervals")


def harness_requested(a) -> bool:
    """Whether ``flowrl eval`` runs as the harness (a suite, a panel, a report or several models)
    rather than printing the one-model JSON it always has."""
    return bool(a.suite or a.rewards or a.out or len(getattr(a, "models", None) or []) > 1)
