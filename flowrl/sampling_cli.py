"""``flowrl sample`` and ``flowrl eval``: a base model (from a recipe) or a trained run.

With ``--run`` the weights are a checkpoint's (``--checkpoint``, default the latest) trained
weights, or its EMA weights with ``--ema``: the same choice, default and resolution as ``flowrl
export`` (:func:`flowrl.export.resolve_checkpoint`). Which ones were used is printed to stderr.

Editing models (an adapter with ``max_sources``: FLUX.1 Kontext, Qwen-Image-Edit): ``flowrl sample
--source PATH`` (repeatable, in order: picture 1, 2, ...) gives the source images every prompt of
``--prompts`` edits; without it, the prompts are held against the model and the rewards before any
model loads (:func:`flowrl.conditions.check_sources`: Qwen-Image-Edit refuses them, Kontext samples
text-to-image and says so). ``--source`` on a text-to-image model is refused.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from .command_line import require_device
from .conditions import check_sources
from .errors import ConfigError
from .export import read_run_weights, resolve_checkpoint
from .data.items import PromptItem, item_sources, item_texts, load_image
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


def load_policy(config_path, run_dir, overrides, checkpoint: Optional[str] = None, ema: bool = False,
                check: Optional[Callable] = None):
    """(config, policy) with a run's weights applied when ``run_dir`` is given (see :func:`run_weights`);
    ``check(config)`` runs once the config is read, before any weights load (input checks that need it)."""
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
    if check is not None:
        check(cfg)
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


SOURCE_HINT = "give the source image(s) with --source PATH (repeat it for several, in order)"
# flowrl eval: sources come with a suite's rows (flowrl.eval.suites)
SUITE_HINT = ("evaluate an editing suite: --suite FILE.jsonl with a 'prompt' and an 'image' field per row (e.g. "
              "--suite digits-edit-sample)")


def _prompts(a, cfg) -> list:
    """``--prompts`` (each an editing item of the ``--source`` images when given), else the recipe's
    ``data.eval_prompts``."""
    if not a.prompts:
        return cfg.data.eval_prompt_set()
    sources = list(getattr(a, "source", None) or [])
    return [PromptItem(p, [Path(s) for s in sources]) if sources else p for p in a.prompts]


def _check_inputs(a, cfg, prompts: list, rewards: Sequence[str] = ()) -> None:
    """Before any weights load: ``--source`` against the model's ``max_sources`` (each image read), then
    the prompts against what the model and ``rewards`` need (:func:`flowrl.conditions.check_sources`)."""
    from .pipelines import policy_class

    model = policy_class(cfg.model.pipeline)
    sources = list(getattr(a, "source", None) or [])
    most = int(getattr(model, "max_sources", 0) or 0)
    if sources and not most:
        raise ConfigError(f"--source: model.pipeline={cfg.model.pipeline} is a text-to-image model and takes no source "
                          f"image; drop --source, or sample an editing model (flux-kontext: one source, "
                          f"qwen-image-edit: one to three)")
    if len(sources) > most:
        raise ConfigError(f"--source given {len(sources)} times, and model.pipeline={cfg.model.pipeline} takes at most "
                          f"{most} source image(s) per prompt")
    for s in sources:
        try:
            load_image(s)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"--source {s}: {e}") from None
    how = SOURCE_HINT if hasattr(a, "source") else SUITE_HINT  # (flowrl sample takes --source, flowrl eval a suite)
    setting = "--prompts" if a.prompts else "data.eval_prompts"
    note = check_sources(model, prompts, setting, rewards, how)
    if note:
        print(f"[flowrl] note: {note}", file=sys.stderr, flush=True)


def _generate(a, rewards_of: Optional[Callable] = None):
    """(config, rows, images, steps) of ``--per-prompt`` samples of each prompt; ``rewards_of(cfg)``: the
    rewards that will score them (checked against the prompts before the model loads)."""
    def check(c):
        _check_inputs(a, c, _prompts(a, c), rewards_of(c) if rewards_of else ())

    cfg, policy = load_policy(a.config, a.run, a.overrides, a.checkpoint, a.ema, check=check)
    prompts = _prompts(a, cfg)
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

    cfg, rows, images, steps = _generate(a, lambda c: [n for n, w in c.reward.weights.items() if w])
    r, comps = score_images(build_reward(cfg), images, rows)
    out = {"samples": len(rows), "steps": steps, "reward_mean": float(r.nanmean()),
           "reward_std": float(r[torch.isfinite(r)].std()),
           **{f"reward/{k}": float(v.nanmean()) for k, v in comps.items()}}
    if a.json:
        write_json(out, Path(a.json))
    return out
