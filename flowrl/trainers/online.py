"""Online training: rollout -> score -> advantages -> clipped-ratio update, on accelerate.

One loop for every sampler (group, branch, tempflow, sol): a rollout is a flat set of
stochastic transitions, the rollout's structure picks the advantage function, and the update
``flowrl.updates.UPDATES[train.loss]`` trains on it (docs/design.md). This module orchestrates:
prompts, rollout seeds, the update's context and checkpointed state, metrics, evaluation.

Accounting (the shared skeleton, ``flowrl.updates.base.train_epochs``): each iteration trains
``inner_epochs`` passes over the rows that carry signal, shuffled into minibatches of
``minibatch_size``; ``grad_accum`` consecutive minibatches make one optimizer step (the last group
of an epoch may be shorter). A minibatch's loss is divided by the number of minibatches in its group.
"""
from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..data.embeddings import attach_text_cache
from ..faults import maybe_fault
from ..rollout.base import Rollout
from ..seeding import stream_seed, stream_sequence
from ..updates import UPDATES as UPDATES_REGISTRY
from ..updates.base import Update, UpdateContext, build_options
from .common import TrainerBase
from .config import LOSSES, Config
from ..errors import ConfigError
from ..utils.images import save_grid
from ..builders import build_policy_from_config, build_reward, build_rewards, evaluate_policy
from ..utils.io import write_json

# keys that may change between a run and its resume without changing its trajectory
RESUME_FREE = {"train.iterations", "train.checkpoint_every", "train.keep_checkpoints", "logging", "model.device",
               "model.path", "train.max_consecutive_skips", "model.text_embedding_cache", "model.drop_text_encoders",
               "train.cpu_offload"}  # offloading the FSDP shards changes where they live, not the numbers


@dataclass
class IterationResult:
    metrics: dict
    rollout: Rollout


class OnlineTrainer(TrainerBase):
    """``OnlineTrainer(config, output_dir, resume=False).train()`` -> summary dict.

    The run directory holds ``config.yaml``, ``metrics.jsonl``, ``checkpoints/iter_NNNNNN``,
    ``samples/*.png``, ``reward_curve.png``, ``before_after.png`` and TensorBoard logs.
    """

    RESUME_FREE = RESUME_FREE
    unit = "iteration"
    stop_causes = "a reward returning NaN/inf, "

    def __init__(self, config: Config, output_dir: str | os.PathLike, resume: bool = False):
        super().__init__(config, output_dir, resume)
        self._updates: dict[str, Update] = {}  # train.loss -> its update (made on first use)
        self._update_state: dict = {}  # a resumed checkpoint's extra tensors, for the update

    # ---------------------------------------------------------------- set-up
    def setup(self) -> None:
        cfg = self.cfg
        device = self._make_accelerator()
        self.prompts = cfg.data.train_prompts()
        self.eval_prompts = cfg.data.eval_prompt_set()
        self.sampler = cfg.sampler.build()
        try:  # e.g. an NVFP4 exploration backend on a CPU machine
            self.sampler.check_available()
        except ValueError as e:
            raise ConfigError(f"sampler.explore_backend: {e}") from None
        self.policy = build_policy_from_config(cfg, device)  # before the rewards: a bad model path fails fast
        self.policy.cfg_uncond_grad = cfg.train.cfg_uncond_grad  # CFG's unconditional half in the update's forwards
        self.policy = attach_text_cache(self.policy, cfg.model, self.prompts + self.eval_prompts,
                                        is_main=self.acc.is_main_process, barrier=self.acc.wait_for_everyone,
                                        progress=cfg.logging.progress and self.acc.is_main_process)
        self.reward = build_reward(cfg)
        self.heldout = build_rewards(cfg.reward.heldout)
        self._prepare_model(need_reference=cfg.train.beta_kl > 0)
        self.start_iteration = 0
        if self.resume:
            ck = self._load_latest()
            if ck is not None:
                self.start_iteration = int(ck["state"]["iteration"])
                self._update_state = dict(ck["extra"])  # e.g. DiffusionNFT's old policy, handed to the update
        self._claim_run_dir(self.start_iteration)  # only once everything loaded

    # ---------------------------------------------------------------- checkpoints
    def _save(self, iteration_done: int) -> None:
        upd = self._updates.get(self.cfg.train.loss)
        super()._save(iteration_done, extra=(upd.state_dict() if upd is not None else None) or None)

    # ---------------------------------------------------------------- one iteration
    def _iteration_prompts(self, it: int) -> list[str]:
        rng = np.random.default_rng(stream_sequence("prompts", self.cfg.train.seed, it, self.acc.process_index))
        k = self.cfg.prompts_per_iteration
        idx = rng.choice(len(self.prompts), size=k, replace=len(self.prompts) < k)
        return [self.prompts[i] for i in idx]

    def _rollout_seed(self, it: int) -> int:
        return stream_seed("rollout", self.cfg.train.seed, it, self.acc.process_index, self.acc.num_processes)

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        if self.acc.num_processes == 1:
            return t
        return self.acc.gather(t.to(self.acc.device)).cpu()

    def _min_over_processes(self, n: int) -> int:
        if self.acc.num_processes == 1:
            return n
        return int(self.acc.gather(torch.tensor([n], device=self.acc.device)).min().item())

    def update_context(self) -> UpdateContext:
        """What an update may use (flowrl.updates.base); built once the model is prepared."""
        return UpdateContext(
            policy=self.policy, model=self.model, unwrapped=self.unwrapped, device=self.acc.device,
            autocast=self.acc.autocast, reference=lambda: self.ref.active(self.policy), gather=self._gather,
            min_over_processes=self._min_over_processes, accumulate=self._accumulate,
            optimizer_steps=lambda: self.opt_steps, train=self.cfg.train, reward=self.cfg.reward,
            sampler_name=self.cfg.sampler.name, num_processes=self.acc.num_processes,
            process_index=self.acc.process_index)

    def update_object(self, name: Optional[str] = None) -> Update:
        """The update ``name`` (default ``train.loss``) of this trainer, made on first use with its options
        (``train.loss_options`` and the alias keys) and any state a resumed checkpoint holds for it."""
        name = name or self.cfg.train.loss
        if name not in self._updates:
            cls = UPDATES_REGISTRY.get(name)
            upd = cls(self.update_context(), build_options(cls, self.cfg.train))
            upd.load_state_dict(self._update_state)
            self._updates[name] = upd
        return self._updates[name]

    def run_iteration(self, it: int) -> IterationResult:
        t0 = time.perf_counter()
        prompts = self._iteration_prompts(it)
        self.model.eval()
        rollout = self.sampler(self.policy, prompts, self.reward, seed=self._rollout_seed(it), iteration=it)
        t1 = time.perf_counter()
        maybe_fault("after_rollout", it)
        upd, info = self.update_object()(rollout, it)
        maybe_fault("after_update", it)
        t2 = time.perf_counter()
        r_all = self._gather(rollout.rewards)
        seeds_all = self._gather(rollout.seeds)
        finite = r_all[torch.isfinite(r_all)]
        met = {"iteration": it, "reward_mean": float(finite.mean()) if len(finite) else float("nan"),
               "reward_std": float(finite.std()) if len(finite) > 1 else 0.0,
               "nonfinite_rewards": int((~torch.isfinite(r_all)).sum()), "samples_gathered": int(r_all.numel()),
               "distinct_seeds_gathered": int(torch.unique(seeds_all).numel()),
               "zero_var_fraction": float(info.get("zero_var_fraction", 0.0)),
               "lr": self.sched.get_last_lr()[0], "skipped_steps": self.skipped,
               "rollout_seconds": rollout.stats.get("rollout_seconds", t1 - t0),
               "reward_seconds": rollout.stats.get("reward_seconds", 0.0), "update_seconds": t2 - t1,
               "model_evals": rollout.stats.get("model_evals", 0)}
        for k, v in rollout.reward_components.items():
            vv = self._gather(v)
            met[f"reward/{k}"] = float(vv[torch.isfinite(vv)].mean()) if torch.isfinite(vv).any() else float("nan")
        met.update({k: v for k, v in info.items() if isinstance(v, (int, float))})
        met.update({k: v for k, v in rollout.stats.items() if "/" in k and isinstance(v, (int, float))})  # sampler stats
        met.update(upd)
        self.sched.step()
        return IterationResult(met, rollout)

    # ---------------------------------------------------------------- evaluation
    def evaluate(self, it: int) -> tuple[dict, torch.Tensor]:
        """Fixed prompts x fixed seeds, deterministic ODE: see :func:`evaluate_policy`."""
        with self.evaluation_model():
            return evaluate_policy(self.policy, self.reward, self.heldout, self.eval_prompts,
                                   self.cfg.data.eval_seeds_per_prompt, self.sampler.num_steps, it)

    # ---------------------------------------------------------------- the loop
    def train(self) -> dict:
        from tqdm.auto import tqdm

        self._begin()
        cfg, lg = self.cfg, self.cfg.logging
        n_it = cfg.train.iterations
        eval_nrow = cfg.data.eval_seeds_per_prompt
        if self.start_iteration == 0 and self.evaluates_here:
            em, imgs = self.evaluate(0)
            if self.acc.is_main_process:
                self._log({**em, **self._real_data_reference(), "iteration": 0})
                save_grid(imgs, self.run_dir / "samples" / "eval_000000.png", nrow=eval_nrow, scale=4)
        bar = tqdm(range(self.start_iteration, n_it), initial=self.start_iteration, total=n_it, desc="flowrl train",
                   disable=not (lg.progress and self.acc.is_main_process), dynamic_ncols=True)
        last = self.start_iteration
        for it in bar:
            res = self.run_iteration(it)
            done = it + 1
            last = done
            if it % lg.log_every == 0 or done == n_it:
                self._log(res.metrics)
            bar.set_postfix(reward=f"{res.metrics['reward_mean']:.3f}", loss=f"{res.metrics.get('loss', float('nan')):.2e}")
            if self.acc.is_main_process and (done % lg.image_every == 0 or done == n_it):
                save_grid(res.rollout.images[: 8 * 8], self.run_dir / "samples" / f"train_{done:06d}.png", nrow=8, scale=4)
            if self.evaluates_here and (done % lg.eval_every == 0 or done == n_it):
                em, imgs = self.evaluate(done)
                self._log(em)  # (main process only)
                if self.acc.is_main_process:
                    save_grid(imgs, self.run_dir / "samples" / f"eval_{done:06d}.png", nrow=eval_nrow, scale=4)
            if done % cfg.train.checkpoint_every == 0 or done == n_it or self._stop_requested:
                self._save(done)
            if self._stop_requested:
                break
        bar.close()
        in_sync = self._ranks_in_sync()
        summary = self._finish(last)
        if summary:
            summary["ranks_in_sync"] = in_sync
            write_json(summary, self.run_dir / "summary.json")
        self._shutdown()
        return summary

    def _ranks_in_sync(self) -> bool:
        """Whether every process holds the same trained weights (checksums gathered over ranks). Sharded:
        one copy of the weights exists, split over the processes, so there is nothing to diverge."""
        if self.sharded:
            return True
        with torch.no_grad():
            ps = [p.detach().double() for p in self.unwrapped.parameters() if p.requires_grad]
            sig = torch.stack([sum(p.sum() for p in ps), sum((p * p).sum() for p in ps)]).view(1, 2)
        if self.acc.num_processes == 1:
            return True
        allsig = self.acc.gather(sig.to(self.acc.device)).cpu()  # [world, 2]
        return bool(torch.allclose(allsig, allsig[:1].expand_as(allsig), rtol=0, atol=0))

    def _finish(self, last: int) -> dict:
        if not self.acc.is_main_process:
            return {}
        return {"iterations_done": last,
                **self._report(last, title=f"{self.cfg.model.pipeline} / {self.cfg.sampler.name}")}


class _UpdatesView(Mapping):
    """``train.loss`` -> ``(trainer, rollout, iteration) -> (update stats, advantage info)``: a view of
    :data:`flowrl.updates.UPDATES` for the online losses (the name this module has always exported)."""

    def __getitem__(self, name: str):
        if name not in LOSSES:
            raise KeyError(name)
        return lambda tr, rollout, it: tr.update_object(name)(rollout, it)

    def __iter__(self):
        return iter(LOSSES)

    def __len__(self) -> int:
        return len(LOSSES)


UPDATES = _UpdatesView()


def train(config: Config, output_dir: str | os.PathLike, resume: bool = False) -> dict:
    """Run online training; returns the summary (also in ``output_dir/summary.json``)."""
    return OnlineTrainer(config, output_dir, resume=resume).train()
