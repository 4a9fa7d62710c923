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
from .reporting import MetricsLog, plot_curves, read_metrics, reward_name, side_by_side

# what a run directory holds (anything else in an --output-dir without config.yaml is someone else's)
RUN_FILES = {"config.yaml", "metrics.jsonl", "checkpoints", "samples", "reward_curve.png", "before_after.png",
             "summary.json", "logs"}
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
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError(f"--output-dir {self.path} is a file, not a directory; choose a new or empty directory")
        if not saved.exists():
            foreign = sorted(p.name for p in self.path.iterdir() if p.name not in RUN_FILES) if self.path.is_dir() else []
            if foreign:
                shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
                raise ConfigError(f"--output-dir {self.path} holds files that are not a flowrl run ({shown}); a run "
                                  f"writes checkpoints, samples and plots there: choose a new or empty directory")
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
        """``reward_curve.png``, ``before_after.png`` and the summary fields every run shares: the first
        evaluation ("before", ``eval_before_iteration``) against the last one after it ("after",
        ``eval_after_iteration``; no "after" fields and no ``before_after.png`` when no evaluation followed
        training), and the real-data values. Main process."""
        recs = read_metrics(self.path / "metrics.jsonl")
        plot_curves(recs, self.path / "reward_curve.png",
                    title=f"{title}: reward {reward_name(self.cfg.reward.weights)}")
        evals = sorted((r for r in recs if "eval/reward" in r), key=lambda r: r["iteration"])
        first = evals[0] if evals else {}
        final = evals[-1] if evals and evals[-1]["iteration"] > first["iteration"] else {}
        out = {}
        if first:
            out["eval_before_iteration"] = first["iteration"]
        if final:
            out["eval_after_iteration"] = final["iteration"]
            before = self.samples / f"eval_{first['iteration']:06d}.png"
            after = self.samples / f"eval_{final['iteration']:06d}.png"
            if before.exists() and after.exists():
                side_by_side(before, after, self.path / "before_after.png",
                             titles=(f"before (iteration {first['iteration']})",
                                     f"after (iteration {final['iteration']})"))
        real = next((r for r in recs if "real/reward" in r), {})
        for key, name in (("eval/reward", "eval_reward"), ("eval/diversity", "diversity"), ("eval/hf_energy", "hf_energy"),
                          ("eval/reward_corrected", "eval_reward_corrected")):
            if key in first:
                out[f"{name}_before"] = first[key]
            if key in final:
                out[f"{name}_after"] = final[key]
        out.update({k: v for k, v in real.items() if k.startswith("real/")})
        return out

    def write_summary(self, summary: dict) -> None:
        write_json(summary, self.path / "summary.json")
