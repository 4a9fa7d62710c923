"""``flowrl sample`` and ``flowrl eval``: a base model (from a recipe) or a trained run."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .checkpoints import load_checkpoint
from .checkpoints.common import list_checkpoints
from .errors import ConfigError
from .rollout.base import score_images
from .rollout.ode import ode_sample
from .seeding import derive_seeds
from .trainers.config import load_config, load_run_config
from .utils.images import save_grid
from .utils.io import write_json
from .utils.paths import resolve_device


def load_policy(config_path, run_dir, overrides):
    """(config, policy) with a run's latest trained weights applied when ``run_dir`` is given."""
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
        cfg = load_config(config_path, overrides)
    policy = build_policy_from_config(cfg, str(resolve_device(cfg.model.device)))
    if run_dir:
        ckpts = list_checkpoints(Path(run_dir) / "checkpoints")
        if not ckpts:
            raise ConfigError(f"run {run_dir} has no checkpoint yet")
        ck = load_checkpoint(ckpts[-1])
        set_up_trainable(policy.transformer, cfg.train.lora_rank, cfg.train.lora_alpha, cfg.train.lora_targets,
                         getattr(policy, "lora_target_modules", None), seed=cfg.train.seed)
        load_trainable_state(policy.transformer, ck["ema"] if ck["ema"] is not None else ck["trainable"])
        policy.transformer.requires_grad_(False)
    return cfg, policy


def _generate(a):
    cfg, policy = load_policy(a.config, a.run, a.overrides)
    prompts = list(a.prompts) if a.prompts else None
    if prompts is None:
        prompts = cfg.data.eval_prompt_set()
    rows = [p for p in prompts for _ in range(a.per_prompt)]
    steps = a.steps or cfg.sampler.build().num_steps
    _, images = ode_sample(policy, rows, derive_seeds(a.seed, len(rows)), steps)
    return cfg, rows, images


def sample_command(a) -> int:
    _, rows, images = _generate(a)
    save_grid(images, Path(a.out), nrow=a.per_prompt, scale=max(1, 64 // images.shape[-1]))
    print(f"wrote {len(rows)} samples to {a.out}")
    return 0


def eval_command(a) -> int:
    from .builders import build_reward

    cfg, rows, images = _generate(a)
    r, comps = score_images(build_reward(cfg), images, rows)
    out = {"samples": len(rows), "reward_mean": float(r.nanmean()), "reward_std": float(r[torch.isfinite(r)].std()),
           **{f"reward/{k}": float(v.nanmean()) for k, v in comps.items()}}
    print(json.dumps(out, indent=2))
    if a.json:
        write_json(out, Path(a.json))
    return 0
