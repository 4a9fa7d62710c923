"""The models an evaluation compares: base models (``--config RECIPE``) and trained runs (``--run
DIR``), in command-line order; the first is the baseline of the paired deltas. ``LABEL=PATH`` names
one (default: the recipe's or run directory's name, made unique)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from flowrl.errors import ConfigError

_LABEL = re.compile(r"^([A-Za-z0-9_.+-]+)=(.+)$")


@dataclass(frozen=True)
class ModelSpec:
    kind: str  # "config" | "run"
    path: str
    label: str

    @property
    def slug(self) -> str:
        """The label as a directory name."""
        return re.sub(r"[^A-Za-z0-9_.+-]", "_", self.label)


def model_specs(given: list[tuple[str, str]]) -> list[ModelSpec]:
    """``[(kind, value)]`` in command-line order -> specs with unique labels."""
    if not given:
        raise ConfigError("give a model to evaluate: --config RECIPE (a base model) and/or --run RUN_DIR (a trained "
                          "run), each as often as needed")
    specs, seen = [], set()
    for kind, value in given:
        m = _LABEL.match(value)
        label, path = (m.group(1), m.group(2)) if m and not Path(value).exists() else (None, value)
        if label is None:
            p = Path(path.rstrip("/"))
            label = p.stem if kind == "config" else p.name
            base, n = label, 2
            while label in seen:
                label, n = f"{base}-{n}", n + 1
        elif label in seen:
            raise ConfigError(f"two models are labelled {label!r}; give each --config / --run its own LABEL=")
        seen.add(label)
        specs.append(ModelSpec(kind, path, label))
    return specs


def load_model_config(spec: ModelSpec, overrides: list[str]):
    """The config a model samples with: the recipe's, or the run's saved one."""
    from flowrl.trainers.config import load_config, load_run_config

    if spec.kind == "run":
        run = Path(spec.path)
        if not (run / "config.yaml").exists():
            raise ConfigError(f"--run {run}: not a flowrl run directory (no config.yaml)")
        return load_run_config(run / "config.yaml", overrides)
    return load_config(spec.path, overrides)


def check_same_pipeline(specs: list[ModelSpec], configs: list) -> None:
    """Every model must be one pipeline (the same prompts and seeds mean the same thing)."""
    pipes = {s.label: c.model.pipeline for s, c in zip(specs, configs)}
    if len(set(pipes.values())) > 1:
        listed = ", ".join(f"{k} ({s.kind}): {v}" for (k, v), s in zip(pipes.items(), specs))
        raise ConfigError(f"the models are on different pipelines ({listed}); compare models of one pipeline, "
                          f"e.g. a run against the recipe it was trained from")


def load_model(spec: ModelSpec, overrides: list[str], checkpoint: Optional[str], ema: bool):
    """(config, policy, one line on the weights) of one model (``flowrl.sampling_cli.load_policy``)."""
    from flowrl.sampling_cli import load_policy

    if spec.kind == "run":
        cfg, policy = load_policy(None, spec.path, overrides, checkpoint, ema)
        return cfg, policy, {"weights": "EMA" if ema else "trained", "checkpoint": checkpoint_of(spec, checkpoint)}
    cfg, policy = load_policy(spec.path, None, overrides)
    return cfg, policy, {"weights": f"base model {cfg.model.path or cfg.model.pipeline}", "checkpoint": None}


def checkpoint_of(spec: ModelSpec, checkpoint: Optional[str]) -> Optional[str]:
    """The checkpoint directory a run's weights come from (None for a base model)."""
    from flowrl.export import resolve_checkpoint

    return str(Path(resolve_checkpoint(Path(spec.path), checkpoint)).resolve()) if spec.kind == "run" else None


def trained_rewards(spec: ModelSpec, cfg) -> list[str]:
    """The rewards a run trained on (its ``reward.weights`` with a non-zero weight); none for a base model, nor for
    a run whose update reads no reward (``Needs.reward_in_loss`` false: on-policy distillation scores its rollouts
    for logging only)."""
    if spec.kind != "run" or not cfg.train.update_needs.reward_in_loss:
        return []
    return [k for k, w in cfg.reward.weights.items() if w]
