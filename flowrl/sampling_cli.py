"""``flowrl sample`` and ``flowrl eval``: a base model (from a recipe) or a trained run.

With ``--run`` the weights are a checkpoint's (``--checkpoint``, default the latest) trained
weights, or its EMA weights with ``--ema``: the same choice, default and resolution as ``flowrl
export`` (:func:`flowrl.export.resolve_checkpoint`). Which ones were used is printed to stderr.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import torch

from .command_line import require_device
from .errors import ConfigError
from .export import read_run_weights, resolve_checkpoint
from .data.items import item_sources, item_texts
from .media import save_samples
from .scoring import score_images
from .rollout.ode import ode_sample
from .seeding import derive_seeds
from .trainers.config import load_config, load_run_config
from .utils.io import write_json
from .utils.paths import resolve_device


def run_weights(run_dir: Path, checkpoint: Optional[str] = None, ema: bool = False) -> tuple[Path, dict, str]:
    """(checkpoint directory, tensors, one-line description) of the weights ``--checkpoint`` /
    ``--ema`` select in a run: the latest (readable: :func:`flowrl.export.read_run_weights`) checkpoint's
    trained weights by default."""
    ck, tensors = read_run_weights(run_dir, checkpoint, "ema" if ema else "trainable")
    if tensors is None:
        raise ConfigError(f"{ck} has no EMA weights (the run was trained without train.ema); drop --ema")
    also_ema = not ema and (ck / "ema.safetensors").is_file()
    which = "EMA" if ema else "trained" + (" (this run also keeps EMA weights: --ema)" if also_ema else "")
    latest = "" if checkpoint is not None else " (latest)" if ck == resolve_checkpoint(run_dir) else " (newest readable)"
    return ck, tensors, f"checkpoint {ck}{latest}, {which} weights"


def load_policy(config_path, run_dir, overrides, checkpoint: Optional[str] = None, ema: bool = False):
    """(config, policy) with a run's weights applied when ``run_dir`` is given (see :func:`run_weights`)."""
    from .builders import build_policy_from_config
    from .trainable import load_trainable_state, set_up_trainable

    if bool(config_path) == bool(run_dir):
        raise ConfigError("give exactly one of --config (a base model recipe) or --run (a training run directory)")
    if run_dir:
        run = Path(run_dir)
        if not (run / "config.yaml").exists():
            raise ConfigError(f"{run} is not a flowrl run directory (no config.yaml)")
        cfg = load_run_config(run / "config.yaml", overrides)
    else:
        if checkpoint is not None or ema:
            raise ConfigError("--checkpoint and --ema choose a run's weights: give --run RUN_DIR with them")
        cfg = load_config(config_path, overrides)
    require_device(cfg.model.device)
    if run_dir:
        _, tensors, which = run_weights(Path(run_dir), checkpoint, ema)
    policy = build_policy_from_config(cfg, str(resolve_device(cfg.model.device)))
    if run_dir:
        print(f"[flowrl] {run_dir}: {which}", file=sys.stderr, flush=True)
        set_up_trainable(policy.transformer, cfg.train.lora_rank, cfg.train.lora_alpha, cfg.train.lora_targets,
                         getattr(policy, "lora_target_modules", None), seed=cfg.train.seed)
        load_trainable_state(policy.transformer, tensors)
        policy.transformer.requires_grad_(False)
    return cfg, policy


def _generate(a):
    cfg, policy = load_policy(a.config, a.run, a.overrides, a.checkpoint, a.ema)
    prompts = list(a.prompts) if a.prompts else None
    if prompts is None:
        prompts = cfg.data.eval_prompt_set()
    rows = [p for p in prompts for _ in range(a.per_prompt)]
    steps = a.steps or cfg.sampler.build().num_steps
    print(f"[flowrl] {len(prompts)} prompt(s) x {a.per_prompt}, {steps} ODE steps, seed {a.seed}, guidance "
          f"{cfg.model.guidance_scale:g}", file=sys.stderr, flush=True)
    _, images = ode_sample(policy, rows, derive_seeds(a.seed, len(rows)), steps)
    return cfg, rows, images, steps


def sample_command(a) -> dict:
    """``flowrl sample``: write the grid (a row per prompt); returns what was written."""
    _, rows, images, steps = _generate(a)
    prompts = rows[::a.per_prompt]  # a row of the grid per prompt, captioned with it
    save_samples(images, Path(a.out), nrow=a.per_prompt, scale=max(1, 64 // images.shape[-1]),
                 labels=item_texts(prompts), sources=item_sources(prompts))
    return {"samples": len(rows), "out": str(a.out), "steps": steps}


def eval_command(a) -> dict:
    """``flowrl eval``: the mean reward (and each component) of the samples; also written to ``--json``."""
    from .builders import build_reward

    cfg, rows, images, steps = _generate(a)
    r, comps = score_images(build_reward(cfg), images, rows)
    out = {"samples": len(rows), "steps": steps, "reward_mean": float(r.nanmean()),
           "reward_std": float(r[torch.isfinite(r)].std()),
           **{f"reward/{k}": float(v.nanmean()) for k, v in comps.items()}}
    if a.json:
        write_json(out, Path(a.json))
    return out
