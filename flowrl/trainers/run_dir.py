"""A run directory: what ``flowrl train --output-dir RUN`` owns, and the one place a resume is checked.

``RUN/config.yaml`` (the resolved recipe), ``metrics.jsonl``, ``checkpoints/iter_NNNNNN``,
``samples/*.png``, ``reward_curve.png``, ``before_after.png``, ``summary.json`` and tracker logs.
:class:`RunDirectory` refuses an output directory that holds another run unless ``--resume`` is
given, and then refuses a config that differs in keys that change training (a trainer lists the
keys a resume may change); it claims the directory once everything loaded, logs metrics and
writes the end-of-run report.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from ..errors import ConfigError
from ..utils.io import write_json, write_text
from .config import Config, dump_config, load_run_config
from .reporting import MetricsLog, plot_curves, read_metrics, side_by_side

# option dicts compared whole by the resume check (their keys are not config keys)
WHOLE = ("options", "weights", "heldout", "advantage_options", "loss_options")


def flat_config(d: dict, prefix: str = "") -> dict:
    """``{"train": {"lr": 1}}`` -> ``{"train.lr": 1}`` (option dicts stay whole)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k not in WHOLE:
            out.update(flat_config(v, key + "."))
        else:
            out[key] = v
    return out


def config_differences(a: Config, b: Config, free: set) -> list[str]:
    """Keys whose values differ between ``a`` and ``b``, except those in ``free`` or under a free prefix
    (``logging`` frees ``logging.eval_every``, ``offline.judge`` frees ``offline.judge.vlm_judge.url``).
    ``train.loss_options`` compare as the update uses them (defaults filled in)."""
    fa, fb = flat_config(a.to_dict()), flat_config(b.to_dict())
    fa["train.loss_options"], fb["train.loss_options"] = a.effective_loss_options(), b.effective_loss_options()

    def is_free(k: str) -> bool:
        parts = k.split(".")
        return any(".".join(parts[:i]) in free for i in range(1, len(parts) + 1))

    return [f"{k}: {fa.get(k)!r} -> {fb.get(k)!r}" for k in sorted(set(fa) | set(fb))
            if not is_free(k) and fa.get(k) != fb.get(k)]


class RunDirectory:
    """``RunDirectory(path, config, resume, resume_free)``: checks the directory on construction (before
    any model loads); :meth:`claim` writes ``config.yaml`` and opens the metrics log (main process)."""

    def __init__(self, path: str | os.PathLike, config: Config, resume: bool, resume_free: set):
        self.path = Path(path)
        self.cfg, self.resume = config, resume
        self.metrics: Optional[MetricsLog] = None
        self.acc = None
        self.check(resume_free)

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def samples(self) -> Path:
        return self.path / "samples"

    def check(self, resume_free: set) -> None:
        """A new run needs a directory without ``config.yaml``; ``--resume`` needs the same config except
        keys in ``resume_free``. Errors name what differs and how to go on."""
        saved = self.path / "config.yaml"
        if not saved.exists():
            return
        if not self.resume:
            raise ConfigError(f"output dir {self.path} already holds a run (config.yaml). Pass --resume to "
                              f"continue it, or choose another --output-dir.")
        try:
            old = load_run_config(saved)
        except ConfigError as e:
            raise ConfigError(f"{saved} is not a valid flowrl config ({e}); use another --output-dir") from None
        diff = config_differences(old, self.cfg, resume_free)
        if diff:
            raise ConfigError(f"--resume: the config differs from the run in {self.path} in keys that change "
                              f"training: {'; '.join(diff)}. Resume with the same settings or start a new "
                              f"--output-dir.")

    def claim(self, acc, start: int) -> None:
        """Once everything loaded: ``config.yaml``, the metrics log (records from ``start`` on dropped),
        trackers (main process only)."""
        self.acc = acc
        if not acc.is_main_process:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        write_text(self.path / "config.yaml", dump_config(self.cfg))
        self.metrics = MetricsLog(self.path / "metrics.jsonl", resume_from=start)
        if self.cfg.logging.trackers:
            acc.init_trackers(self.cfg.logging.project,
                              config={k: str(v) for k, v in flat_config(self.cfg.to_dict()).items()})

    def log(self, record: dict) -> None:
        """Append ``record`` to ``metrics.jsonl`` and the trackers (main process)."""
        if self.acc is None or not self.acc.is_main_process:
            return
        self.metrics.write(record)
        if self.cfg.logging.trackers:
            self.acc.log({k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "iteration"},
                         step=record["iteration"])

    def report(self, title: str) -> dict:
        """``reward_curve.png``, ``before_after.png`` and the summary fields every run shares (first vs
        last evaluation, real-data values). Main process."""
        recs = read_metrics(self.path / "metrics.jsonl")
        plot_curves(recs, self.path / "reward_curve.png", title=title)
        evals = sorted((r for r in recs if "eval/reward" in r), key=lambda r: r["iteration"])
        first, final = (evals[0], evals[-1]) if evals else ({}, {})
        before = self.samples / "eval_000000.png"
        after = self.samples / f"eval_{final.get('iteration', 0):06d}.png"
        if before.exists() and after.exists():
            side_by_side(before, after, self.path / "before_after.png")
        real = next((r for r in recs if "real/reward" in r), {})
        out = {}
        for key, name in (("eval/reward", "eval_reward"), ("eval/diversity", "diversity"), ("eval/hf_energy", "hf_energy"),
                          ("eval/reward_corrected", "eval_reward_corrected")):
            if key in final or key in first:
                out[f"{name}_before"], out[f"{name}_after"] = first.get(key), final.get(key)
        out.update({k: v for k, v in real.items() if k.startswith("real/")})
        return out

    def write_summary(self, summary: dict) -> None:
        write_json(summary, self.path / "summary.json")
