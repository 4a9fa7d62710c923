"""Helpers shared by several test modules (test files import from here or from conftest, never from
each other): the tiny-recipe overrides of the SD3 / FLUX / SANA training tests, the fixed prompts and
the plain loops the pipeline tests compare against, and readers of a run's files."""
import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from flowrl.sde import ode_step

ROOT = Path(__file__).resolve().parents[1]
IMAGE = 32  # pixels: 16 x 4 x 4 latents
PROMPTS = ["a photo of a cat", "a red apple on a table"]

# recipe sampler options -> overrides that make the sampler tiny (same sampler, same step type)
SHRINK = {
    "group": {"sampler.group_size": 2, "sampler.num_steps": 2, "train.batch_size": 4},
    "branch": {"sampler.num_steps": 3, "sampler.split_steps": "[0, 1]", "sampler.window": 2, "train.batch_size": 4},
    "tempflow": {"sampler.num_steps": 3, "sampler.branch_steps": "[0, 1]", "sampler.branches": 2,
                 "sampler.seeds_per_prompt": 1, "train.batch_size": 4},
    # int8 exploration: the CPU stand-in for the recipes' nvfp4 (CUDA)
    "sol": {"sampler.pool_size": 4, "sampler.preview_steps": 2, "sampler.keep": 2, "sampler.regen_options": "{num_steps: 2}",
            "sampler.explore_backend": "int8-dynamic", "train.batch_size": 4},
}


def tiny_overrides(path, sampler: str, **extra) -> list[str]:
    """Overrides that run a GPU recipe in seconds on a tiny CPU model at ``path``."""
    base = {"model.path": str(path), "model.device": "cpu", "model.options.resolution": IMAGE,
            "model.options.max_sequence_length": 8, "model.options.dtype": "float32",
            "model.options.gradient_checkpointing": "false", "sampler.max_batch": "null",
            "train.iterations": 2, "train.lr": 1e-2, "train.mixed_precision": "'no'", "train.minibatch_size": 64,
            "train.grad_accum": 1, "train.checkpoint_every": 1, "train.ema_every": 1,
            "reward.weights": "{jpeg_compressibility: 1.0}", "reward.options": "{}", "reward.heldout": "{}",
            "data.prompts": "[a photo of a cat, a red apple on a table]", "data.eval_prompts": "[a photo of a cat]",
            "data.eval_seeds_per_prompt": 2, "logging.trackers": "[]", "logging.progress": "false",
            "logging.eval_every": 100, "logging.image_every": 100, **SHRINK[sampler]}
    if sampler == "sol":  # the Sol sampler chunks its exploration with explore_batch
        del base["sampler.max_batch"]
        base["sampler.explore_batch"] = "null"
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def train_records(run) -> list[dict]:
    """The training records (one per iteration) of a run's ``metrics.jsonl``."""
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines() if "reward_mean" in line]


def lora_weights(ckpt) -> dict[str, torch.Tensor]:
    """The trainable (LoRA) tensors of a checkpoint directory."""
    return load_file(str(Path(ckpt) / "trainable.safetensors"))


def fixed_velocity(policy, transformer) -> torch.Tensor:
    """v(x, sigma, c) of ``transformer`` inside ``policy`` on fixed inputs (CFG / guidance as trained):
    two seeds, sigmas 0.9 / 0.45, the two :data:`PROMPTS`."""
    policy.transformer = transformer
    cond = policy.encode_prompts(PROMPTS)
    x = policy.initial_noise([11, 12])  # [2, C, h, w]
    with torch.no_grad():
        return policy.velocity(x, torch.tensor([0.9, 0.45]), cond)


def ode_loop(policy, prompts, seeds, num_steps) -> torch.Tensor:
    """Plain Euler over ``policy.sigmas(num_steps)``, written out (no sampler) -> x0 [B, C, h, w]."""
    x = policy.initial_noise(seeds)  # [B, C, h, w]
    cond = policy.encode_prompts(prompts)
    sig = policy.sigmas(num_steps)
    with torch.no_grad():
        for i in range(num_steps):
            v = policy.velocity(x, sig[i].expand(len(seeds)), cond)
            x = ode_step(v, x, sig[i], sig[i + 1]).sample
    return x


def cli_verbs(help_text: str) -> set[str]:
    """The sub-commands an argparse ``--help`` lists in its ``{a,b,c}`` choices (exact names, so
    ``train`` is not found inside ``pretrain-digits``)."""
    found = re.search(r"\{([a-z0-9,_-]+)\}", help_text)
    return set(found.group(1).split(",")) if found else set()
