"""One Sol-RL iteration and one flat-GRPO iteration on a random-weight architecture, timed.

A thin driver over flowrl's public pieces, not the trainer: a LoRA adapter on the
:class:`~flowrl.bench.precision_arch_models.ArchPolicy` transformer (``flowrl.trainable.add_lora``),

* **Sol-RL**: :class:`~flowrl.rollout.sol.SolSampler` (re-sync the quantized copy, explore
  ``pool_size`` seeds per prompt with it in ``preview_steps`` ODE steps, select ``keep``,
  regenerate them in full precision with the Flow-GRPO SDE group sampler), then the update;
* **flat GRPO**: :class:`~flowrl.rollout.group.GroupSampler` (``group_size`` samples per prompt
  in full precision), then the same update;
* **update**: group advantages, the PPO-clip surrogate (``flowrl.losses.grpo_clipped_loss``) on
  every stored transition in minibatches, backward, AdamW step per minibatch.

Each iteration runs twice; the second is timed (the first warms up kernels and allocators, and compiles).
With ``compile`` (a ``model.compile`` mode) the rollouts run as a training run's do: the policy's no-gradient
forward compiled (:func:`flowrl.utils.compile.compile_rollouts`), Sol-RL's exploration copy compiled too and
re-synced in place, the update eager; each iteration record's ``recompiles`` counts the compiles its run made
(the timed one: 0 when nothing recompiled). The reward is the mean pixel value (the weights are random; a reward
model's cost is not measured).
What it leaves out compared with ``flowrl train``: accelerate / DDP, gradient checkpointing, EMA,
KL to a reference, CFG, checkpointing, logging.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from ..advantages import group_advantages
from ..losses import grpo_clipped_loss
from ..quant.kernels import display_label, kernel_info
from ..sde import get_step
from ..types import index_cond
from ..utils.compile import compile_log, compile_rollouts
from .precision_measure import sync_device

ITERATION_SEED = 20260411


@dataclass
class IterationOptions:
    """Sizes of the timed iterations (defaults: Sol-RL's paper setting for one prompt, 512 px).

    Args:
        resolution: image side, pixels. prompts: prompts per iteration.
        pool_size / preview_steps / keep: Sol-RL exploration pool, its ODE steps, seeds regenerated.
        group_size: flat-GRPO samples per prompt (default = keep: the same training batch).
        train_steps: SDE steps of the regeneration and of flat GRPO (every one stored and trained).
        minibatch: transitions per optimizer step. lora_rank: adapter rank (alpha = rank).
        explore_backend: Sol-RL's exploration backend spec (default: the benchmark's first quantized one).
        max_batch: chunk sampling velocity calls to this many rows (memory), None = all.
    """

    resolution: int = 512
    prompts: int = 1
    pool_size: int = 96
    preview_steps: int = 6
    keep: int = 24
    group_size: Optional[int] = None
    train_steps: int = 10
    minibatch: int = 4
    lora_rank: int = 32
    explore_backend: Optional[str] = None
    max_batch: Optional[int] = 24

    def __post_init__(self) -> None:
        if self.group_size is None:
            self.group_size = self.keep
        for k in ("resolution", "prompts", "pool_size", "preview_steps", "keep", "group_size", "train_steps",
                  "minibatch", "lora_rank"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"iteration timing {k} must be a positive integer, got {v!r}")
        if self.keep < 2 or self.group_size < 2:
            raise ValueError(f"keep and group_size must be >= 2 (a group of one has no advantage), got "
                             f"{self.keep}, {self.group_size}")
        if self.keep > self.pool_size:
            raise ValueError(f"keep={self.keep} exceeds pool_size={self.pool_size}")


def mean_pixel_reward(images: torch.Tensor, prompts: list[str], **meta) -> torch.Tensor:
    """float32 ``[B]``: mean of ``images`` ``[B, 3, H, W]`` or videos ``[B, 3, F, H, W]`` (a stand-in reward
    at no cost)."""
    return images.float().flatten(1).mean(dim=1)


def grpo_update(policy, rollout, optimizer, minibatch: int, clip_range: float = 1e-4) -> dict:
    """One pass of the clipped-ratio update over every transition of ``rollout``; returns stats
    (``ratio_mean`` of the first minibatch: 1 up to rollout/training numerics)."""
    adv, _ = group_advantages(rollout.rewards, rollout.group_index)  # [N]
    tr, dev = rollout.transitions, policy.device
    step_fn = get_step(rollout.step_type)
    with torch.no_grad():
        cond = rollout.conditioning(policy)
    first_ratio, n = None, 0
    for rows in torch.arange(len(tr)).split(minibatch):
        t = tr.select(rows)
        lat, nxt = t.latents.to(dev), t.next_latents.to(dev)  # [m, C, H, W]
        sig, sig_n = t.sigma.to(dev), t.sigma_next.to(dev)  # [m]
        v = policy.velocity(lat, sig, index_cond(cond, t.prompt_index))  # [m, C, H, W]
        out = step_fn(v, lat, sig, sig_n, noise_level=rollout.noise_level, prev_sample=nxt)
        loss, stats = grpo_clipped_loss(out.log_prob, t.old_log_prob.to(dev), adv[t.sample_index].to(dev), clip_range,
                                        t.weight.to(dev))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        first_ratio = float(stats["ratio_mean"]) if first_ratio is None else first_ratio
        n += len(rows)
    return {"transitions_trained": n, "first_ratio_mean": first_ratio}


def _timed_iteration(policy, sampler, prompts, optimizer, opts: IterationOptions, seed: int) -> dict:
    dev = policy.device
    clog = compile_log(policy.transformer)
    compiles = clog.compiles + clog.recompiles
    sync_device(dev)
    t0 = time.perf_counter()
    rollout = sampler(policy, prompts, mean_pixel_reward, seed=seed)
    sync_device(dev)
    t1 = time.perf_counter()
    upd = grpo_update(policy, rollout, optimizer, opts.minibatch)
    sync_device(dev)
    t2 = time.perf_counter()
    st = rollout.stats
    out = {"total_seconds": t2 - t0, "sample_seconds": t1 - t0, "update_seconds": t2 - t1, **upd,
           "samples_trained": rollout.num_samples, "recompiles": clog.compiles + clog.recompiles - compiles}
    if "sol/explore_seconds" in st:
        out.update({"sync_seconds": st["sol/sync_seconds"], "explore_seconds": st["sol/explore_seconds"],
                    "regen_seconds": st["sol/regen_seconds"], "explore_model_evals": st["sol/explore_model_evals"]})
        out["sample_seconds"] = out["regen_seconds"]  # full-precision sampling only; sync/explore separate
    return out


def time_iterations(policy, quantizers: dict, *, log=print, compile: str = "off", **options) -> dict:
    """Time one Sol-RL and one flat-GRPO iteration (module doc), rollouts compiled with ``compile`` -> a
    JSON-able dict."""
    from ..rollout.group import GroupSampler
    from ..rollout.sol import SolSampler
    from ..trainable import add_lora

    opts = IterationOptions(**options)
    spec = opts.explore_backend or next(iter(quantizers), "none")
    policy.set_resolution(opts.resolution)
    add_lora(policy.transformer, opts.lora_rank, float(opts.lora_rank))
    compile_rollouts(policy.transformer, compile)  # LoRA first: the compiled graph traces it
    params = [p for p in policy.transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    prompts = [f"benchmark prompt {i}" for i in range(opts.prompts)]
    regen = {"num_steps": opts.train_steps, "max_batch": opts.max_batch}
    sol = SolSampler(explore_backend=spec, pool_size=opts.pool_size, preview_steps=opts.preview_steps,
                     keep=opts.keep, regen="group", regen_options=regen, explore_batch=opts.max_batch,
                     calibration_prompts=prompts, calibration_seeds=1)
    grpo = GroupSampler(group_size=opts.group_size, num_steps=opts.train_steps, max_batch=opts.max_batch)
    out: dict = {"settings": {**asdict(opts), "explore_backend": spec, "train_timesteps": opts.train_steps,
                              "dtype": str(policy.dtype).replace("torch.", ""), "compile": compile}}
    try:
        for name, sampler in (("sol", sol), ("grpo", grpo)):
            for rep in range(2):  # the first iteration warms up (and compiles); the second is reported
                log(f"[bench precision] {name} iteration {rep + 1}/2 at {opts.resolution}px ...", flush=True)
                r = _timed_iteration(policy, sampler, prompts, optimizer, opts, ITERATION_SEED + rep)
            out[name] = r
    finally:
        compile_rollouts(policy.transformer, "off")
    info = kernel_info(spec, sol.exploration_copy.module)
    out["sol"].update({"backend": spec, "label": display_label(spec, info), **info})
    out["grpo"]["label"] = "grpo (bf16)"
    out["sol_over_grpo"] = out["sol"]["total_seconds"] / out["grpo"]["total_seconds"]
    out["note"] = ("thin driver: no accelerate/DDP, gradient checkpointing, EMA, KL reference, CFG or checkpoints; "
                   "reward = mean pixel (random weights); the update trains every stored SDE transition")
    return out
