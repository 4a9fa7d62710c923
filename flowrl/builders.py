"""Builders shared by the trainers, the CLI, export and the benchmarks: the policy and the rewards of a
config, and the fixed evaluation (reward-hacking watch). Nothing here imports a trainer.

The config's sampler is built by ``cfg.sampler.build()`` (the same call validates its options).
"""
from __future__ import annotations

import torch

from .diagnostics import high_frequency_energy, within_group_diversity
from .rollout.base import score_images
from .rollout.ode import ode_sample
from .seeding import derive_seeds

EVAL_SEED = 20251121  # evaluation seeds are fixed, independent of the training seed


def build_reward(cfg):
    """The trained reward: ``reward.weights`` with each reward's ``reward.options``, as a ``MultiReward``."""
    from flowrl.rewards import build_multi

    return build_multi(cfg.reward.weights, {k: cfg.reward.options.get(k, {}) for k in cfg.reward.weights})


def build_rewards(spec: dict) -> dict:
    """``{name: {kwargs}}`` (``reward.heldout``, ``offline.judge``) -> ``{name: reward}``, built in order."""
    from flowrl.rewards import build

    return {k: build(k, **(v or {})) for k, v in spec.items()}


def build_policy_from_config(cfg, device):
    from flowrl.pipelines import build_policy

    return build_policy(cfg.model.pipeline, cfg.model.path, guidance_scale=cfg.model.guidance_scale,
                        device=device, **cfg.model.options)


@torch.no_grad()
def evaluate_policy(policy, reward, heldout: dict, eval_prompts: list[str], seeds_per_prompt: int, num_steps: int,
                    it: int) -> tuple[dict, torch.Tensor]:
    """Fixed prompts x fixed seeds (``EVAL_SEED``), deterministic ODE: trained reward, held-out
    rewards, within-prompt diversity and high-frequency energy (reward-hacking watch).
    Shared by the online and offline (GDRO) trainers, so their curves compare point for point.
    Returns (metrics, images [len(eval_prompts) * seeds_per_prompt, 3, H, W])."""
    k = seeds_per_prompt
    prompts = [p for p in eval_prompts for _ in range(k)]
    seeds = derive_seeds(EVAL_SEED, len(prompts))
    groups = torch.arange(len(eval_prompts)).repeat_interleave(k)
    _, images = ode_sample(policy, prompts, seeds, num_steps)
    r, comps = score_images(reward, images, prompts)
    fin = r[torch.isfinite(r)]
    met = {"iteration": it, "eval/reward": float(fin.mean()) if fin.numel() else float("nan"),
           "eval/reward_std": float(fin.std()) if fin.numel() > 1 else float("nan"),
           "eval/diversity": within_group_diversity(images, groups), "eval/hf_energy": high_frequency_energy(images)}
    for name, v in comps.items():
        met[f"eval/reward/{name}"] = float(v[torch.isfinite(v)].mean())
    for name, rew in heldout.items():
        hv, _ = score_images(rew, images, prompts)
        met[f"eval/heldout/{name}"] = float(hv[torch.isfinite(hv)].mean())
    return met, images
