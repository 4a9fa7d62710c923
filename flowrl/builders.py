"""Builders shared by the trainers, the CLI, export and the benchmarks: the policy and the rewards of a
config, and the fixed evaluation (reward-hacking watch). Nothing here imports a trainer.

The config's sampler is built by ``cfg.sampler.build()`` (the same call validates its options).
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

import torch

from .checkpoints.runs import apply_run_weights, run_chain
from .diagnostics import watch
from .errors import ConfigError
from .rollout.ode import ode_generate
from .scoring import finite_mean, score_images
from .seeding import derive_seeds

EVAL_SEED = 20251121  # evaluation seeds are fixed, independent of the training seed


def build_reward(cfg):
    """The trained reward: ``reward.weights`` with each reward's ``reward.options`` and ``reward.aggregate``, as a
    ``MultiReward``."""
    from flowrl.rewards import build_multi

    return build_multi(cfg.reward.weights, {k: cfg.reward.options.get(k, {}) for k in cfg.reward.weights},
                       overlap=cfg.reward.overlap, frame_stride=cfg.reward.frame_stride, aggregate=cfg.reward.aggregate)


def build_rewards(spec: dict) -> dict:
    """``{name: {kwargs}}`` (``reward.heldout``, ``offline.judge``) -> ``{name: reward}``, built in order.
    Their callers score videos with ``reward.frame_stride`` (``flowrl.scoring.score_images(...,
    frame_stride=)``), as the trained reward."""
    from flowrl.rewards import build

    return {k: build(k, **(v or {})) for k, v in spec.items()}


def check_run_sources(cfg, prompts: list, eval_prompts: list, policy=None, reward=None, acc=None) -> None:
    """Before a run's rewards and model load: its prompt sets (``data.prompts``, ``data.eval_prompts``) carry
    the source images that ``cfg.model`` (or the ``policy`` object given instead) and the weighted rewards of
    ``reward.weights`` (none checked when a ``reward`` object is given) need
    (:func:`flowrl.conditions.check_sources`: a ``ConfigError`` otherwise). An editing model run text-to-image
    is said once on stderr (by ``acc``'s main process when an accelerator is given)."""
    from .conditions import check_sources

    model = policy if policy is not None else cfg.model.pipeline
    rewards = [] if reward is not None else [n for n, w in cfg.reward.weights.items() if w]
    notes = [check_sources(model, rows, setting, rewards)
             for setting, rows in (("data.prompts", prompts), ("data.eval_prompts", eval_prompts))]
    note = next((n for n in notes if n), None)
    if note and (acc is None or acc.is_main_process):
        print(f"[flowrl] note: {note}", file=sys.stderr, flush=True)


def build_policy_from_config(cfg, device, without_text_encoders: bool = False):
    """The policy ``cfg.model`` names, on ``device`` (``model.path`` a run directory: its base with the run's newest
    trained weights fused in, :mod:`flowrl.checkpoints.runs`); ``without_text_encoders``: its pipeline's text encoders
    are not loaded (a text-embedding cache serves every prompt; diffusers loads a component passed as None).
    On the CPU, torch's threads are then chosen for its size (:func:`flowrl.utils.threads.use_cpu_threads`,
    under the command line). ``model.compile``: the transformer's rollout forward is compiled here, the one
    place every command builds it (:func:`flowrl.utils.compile.compile_rollouts`; LoRA added later is traced
    at the first call)."""
    from flowrl.pipelines import build_policy, policy_class
    from flowrl.utils.compile import compile_rollouts
    from flowrl.utils.threads import model_params, use_cpu_threads

    skip = {}
    if without_text_encoders:
        skip = {n: None for n in getattr(policy_class(cfg.model.pipeline), "text_encoder_names", ())}
    path, runs = run_chain(cfg.model.path)  # model.path a run directory: its base, then its trained weights (fused)
    for rm in runs:
        if rm.pipeline != cfg.model.pipeline:
            raise ConfigError(f"model.path {rm.run} is a {rm.pipeline} run and model.pipeline is "
                              f"{cfg.model.pipeline}; set model.pipeline={rm.pipeline}")
    policy = build_policy(cfg.model.pipeline, path, guidance_scale=cfg.model.guidance_scale,
                          device=device, **cfg.model.options, **skip)
    for rm in reversed(runs):  # the deepest run first
        apply_run_weights(policy.transformer, rm, getattr(policy, "lora_target_modules", None))
    transformer = getattr(policy, "transformer", None)
    use_cpu_threads(model_params(transformer) if transformer is not None else None, str(device))
    if transformer is not None:
        compile_rollouts(transformer, cfg.model.compile)
    return policy


def _with_heldout(reward, heldout: dict, frame_stride: int):
    """Scoring of the trained reward plus the held-out ones (components ``heldout/NAME``), per chunk;
    videos every ``frame_stride``-th frame."""
    def score(images: torch.Tensor, prompts: list[str]) -> tuple[torch.Tensor, dict]:
        r, comps = score_images(reward, images, prompts, frame_stride=frame_stride)
        return r, {**comps, **{f"heldout/{k}": score_images(rew, images, prompts, frame_stride=frame_stride)[0]
                               for k, rew in heldout.items()}}
    return score


@torch.no_grad()
def tag_means(rewards: torch.Tensor, tags: Sequence[str], seeds_per_prompt: int) -> dict[str, float]:
    """``rewards`` ``[P * k]`` (prompt-major, ``k = seeds_per_prompt`` per prompt) and ``tags`` ``[P]`` (each
    prompt's) -> ``{tag: mean of its prompts' finite rewards}`` (NaN: none finite), tags in first-seen order."""
    per_sample = [t for t in tags for _ in range(seeds_per_prompt)]  # [P * k]
    return {tag: finite_mean(rewards[torch.tensor([t == tag for t in per_sample])])  # [n_tag * k]
            for tag in dict.fromkeys(tags)}


def reference_metrics(reward, images: torch.Tensor, eval_prompts: list, seeds_per_prompt: int,
                      frame_stride: Optional[int] = None, tags: Optional[Sequence[str]] = None,
                      heldout: Optional[dict] = None) -> dict:
    """The evaluation's measures of given images (``[len(eval_prompts) * k, 3, (F,) H, W]``, prompt-major; real
    data): ``real/reward`` (finite mean), ``real/<watch>`` (:func:`flowrl.diagnostics.watch`), each ``heldout``
    reward's ``real/heldout/<name>`` and, with ``tags`` (one per prompt), ``real/tag/<tag>`` and
    ``real/heldout/<name>/tag/<tag>`` (:func:`tag_means`)."""
    k = seeds_per_prompt
    groups = torch.arange(len(eval_prompts)).repeat_interleave(k)  # [P * k]
    prompts = [p for p in eval_prompts for _ in range(k)]
    out = {}
    # (the mean's key, the prefix of its per-tag keys, the reward): the trained reward, then each held-out one
    for key, per_tag, rew in (("real/reward", "real/tag", reward),
                              *((f"real/heldout/{n}", f"real/heldout/{n}/tag", h) for n, h in (heldout or {}).items())):
        r, _ = score_images(rew, images, prompts, frame_stride=frame_stride)  # [P * k]
        out[key] = finite_mean(r)
        out.update({f"{per_tag}/{t}": v for t, v in (tag_means(r, tags, k) if tags is not None else {}).items()})
    return {**out, **{f"real/{n}": v for n, v in watch(images, groups).items()}}


def evaluate_policy(policy, reward, heldout: dict, eval_prompts: list[str], seeds_per_prompt: int, num_steps: int,
                    it: int, max_batch: Optional[int] = None, frame_stride: Optional[int] = None,
                    tags: Optional[Sequence[str]] = None) -> tuple[dict, torch.Tensor]:
    """Fixed prompts x fixed seeds (``EVAL_SEED``), deterministic ODE: trained reward, held-out
    rewards, within-prompt diversity and high-frequency energy, for videos temporal consistency
    (reward-hacking watch, :func:`flowrl.diagnostics.watch`).
    Shared by the online and offline (GDRO) trainers, so their curves compare point for point.
    ``max_batch`` samples at a time, each chunk scored while the next samples (``reward.overlap``);
    videos are scored every ``frame_stride``-th frame (None: the trained reward's, else 1); ``tags`` (one per
    evaluation prompt, e.g. GenEval's): the trained reward's mean per tag too, ``eval/tag/<tag>`` (:func:`tag_means`),
    and each held-out reward's, ``eval/heldout/<name>/tag/<tag>``.
    Returns (metrics, images [len(eval_prompts) * seeds_per_prompt, 3, (F,) H, W])."""
    k = seeds_per_prompt
    prompts = [p for p in eval_prompts for _ in range(k)]
    seeds = derive_seeds(EVAL_SEED, len(prompts))
    groups = torch.arange(len(eval_prompts)).repeat_interleave(k)
    _, images, scores = ode_generate(policy, prompts, seeds, num_steps, reward, max_batch,
                                     score=_with_heldout(reward, heldout, frame_stride))
    r = scores.rewards
    comps = {n: v for n, v in scores.components.items() if not n.startswith("heldout/")}
    fin = r[torch.isfinite(r)]
    met = {"iteration": it, "eval/reward": float(fin.mean()) if fin.numel() else float("nan"),
           "eval/reward_std": float(fin.std()) if fin.numel() > 1 else float("nan"),
           **{f"eval/{k}": v for k, v in watch(images, groups).items()}}  # diversity, hf_energy (+ temporal_consistency)
    for name, v in comps.items():
        met[f"eval/reward/{name}"] = finite_mean(v)
    for name in heldout:
        hv = scores.components[f"heldout/{name}"]  # [P * k]
        met[f"eval/heldout/{name}"] = finite_mean(hv)
        if tags is not None:
            met.update({f"eval/heldout/{name}/tag/{t}": v for t, v in tag_means(hv, tags, k).items()})
    if tags is not None:
        met.update({f"eval/tag/{t}": v for t, v in tag_means(r, tags, k).items()})
    return met, images
