"""Online training: rollout -> score -> advantages -> update, on accelerate.

One loop for every sampler (group, branch, tempflow, sol, ode): a rollout is a flat set of
stochastic transitions plus the finished samples, the rollout's structure picks the advantage
function, and the update ``flowrl.updates.UPDATES[train.loss]`` trains on it (docs/design.md).
This module feeds the shared loop (:class:`flowrl.trainers.trainer.Trainer`) its unit, an
iteration: the prompts, the rollout seed, the rollout, the update and the iteration's metrics.

Accounting (the update loop, ``flowrl.trainers.steps.OptimizerSteps.train``): each iteration trains
``inner_epochs`` passes over the rows that carry signal, shuffled into minibatches of
``minibatch_size``; ``grad_accum`` consecutive minibatches make one optimizer step (the last group
of an epoch may be shorter). A minibatch's loss is divided by the number of minibatches in its group.
"""
from __future__ import annotations

import os
import sys
import time
import dataclasses
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..errors import ConfigError
from ..faults import maybe_fault
from ..rollout.base import Rollout
from ..seeding import stream_seed, stream_sequence
from ..updates import updates_by_input
from ..updates.base import UpdateContext, incompatibility
from .config import Config
from .frozen import frozen_loader
from .steps import TrainingStopped
from .trainer import Trainer

# keys that may change between a run and its resume without changing its trajectory
RESUME_FREE = {"train.iterations", "train.checkpoint_every", "train.keep_checkpoints", "logging", "model.device",
               "model.compile",  # how the rollout forward runs (like model.device), not what it computes
               "reward.overlap",  # when chunks are scored, not what they score
               "data.source",  # where the prompt files come from, a note
               "model.path", "train.max_consecutive_skips", "model.text_embedding_cache", "model.drop_text_encoders",
               "train.cpu_offload", "train.offload",  # offloading changes where tensors live, not the numbers
               "train.context_parallel", "train.context_parallel_attention"}  # the layout, not the replicas' data


@dataclass
class IterationResult:
    metrics: dict
    rollout: Rollout


NONFINITE_WARN = 0.25  # warn when more than this fraction of an iteration's rewards is NaN/inf
ZERO_VARIANCE_WARN = 0.5  # warn when more than this fraction of its groups has zero reward variance


class OnlineTrainer(Trainer):
    """``OnlineTrainer(config, output_dir, resume=False, *, policy=None, reward=None, sampler=None).train()``
    -> summary dict.

    ``sampler``: a sampler object (the ``flowrl.types.Sampler`` protocol) instead of the config's
    ``sampler`` section; ``policy`` / ``reward`` as in :class:`~flowrl.trainers.trainer.Trainer`. The
    run directory holds ``config.yaml``, ``metrics.jsonl``, ``checkpoints/iter_NNNNNN``,
    ``samples/*.png``, ``reward_curve.png``, ``before_after.png`` and TensorBoard logs.
    """

    RESUME_FREE = RESUME_FREE
    unit = "iteration"
    stop_causes = "a reward returning NaN/inf, "
    progress_desc = "flowrl train"

    def __init__(self, config: Config, output_dir: str | os.PathLike, resume: bool = False, *, policy=None,
                 reward=None, sampler=None):
        super().__init__(config, output_dir, resume, policy=policy, reward=reward)
        self._given_sampler = sampler
        self._warned: set[str] = set()  # reward-health warnings given (each once per run)
        self._scored_any, self._unscored_in_a_row = False, 0  # iterations with no finite reward (_require_scores)

    # ---------------------------------------------------------------- the data
    def _setup_data(self) -> list[str]:
        cfg = self.cfg
        self.prompts = cfg.data.train_prompts()
        self.sampler = self._given_sampler if self._given_sampler is not None else cfg.sampler.build()
        t = cfg.train
        if self._given_sampler is not None:  # a sampler object: the checks the config made on its own sampler
            reason = incompatibility(t.update_needs, t.loss, mode=t.mode, sampler=type(self.sampler).__name__,
                                     stores_transitions=bool(self.sampler.stores_transitions),
                                     aggregate=cfg.reward.aggregate, inner_epochs=t.inner_epochs,
                                     alternatives=updates_by_input(),
                                     rewards=tuple(cfg.reward.weights) if self._given_reward is None else None,
                                     flat_groups=bool(getattr(self.sampler, "flat_groups", True)))
            if reason:
                raise ConfigError(reason)
        per_prompt = int(self.sampler.samples_per_prompt)
        if cfg.train.batch_size % per_prompt:
            raise ConfigError(f"train.batch_size={cfg.train.batch_size} is not a multiple of the sampler's "
                              f"{per_prompt} samples per prompt; set train.batch_size to a multiple of {per_prompt}")
        self.prompts_per_iteration = cfg.train.batch_size // per_prompt  # fixed for the run
        try:  # e.g. an NVFP4 exploration backend on a CPU machine
            self.sampler.check_available()
        except ValueError as e:
            raise ConfigError(f"sampler.explore_backend: {e}") from None
        return self.prompts

    def total_units(self) -> int:
        return self.cfg.train.iterations

    @property
    def eval_every(self) -> int:
        return self.cfg.logging.eval_every

    @property
    def eval_steps(self) -> int:
        return self.sampler.num_steps

    @property
    def eval_max_batch(self) -> Optional[int]:
        return getattr(self.sampler, "max_batch", None)

    def report_title(self) -> str:
        return f"{self.cfg.model.pipeline} / {self.cfg.sampler.name}"

    def summary_fields(self, last: int) -> dict:
        return {"iterations_done": last}

    def progress_postfix(self, met: dict) -> dict:
        return {"reward": f"{met['reward_mean']:.3f}", "loss": f"{met.get('loss', float('nan')):.2e}"}

    # ---------------------------------------------------------------- one iteration
    def _iteration_prompts(self, it: int) -> list[str]:
        rng = np.random.default_rng(stream_sequence("prompts", self.cfg.train.seed, it, self.strategy.layout.dp_rank))
        k = self.prompts_per_iteration
        idx = rng.choice(len(self.prompts), size=k, replace=len(self.prompts) < k)
        return [self.prompts[i] for i in idx]

    def _rollout_seed(self, it: int) -> int:
        return stream_seed("rollout", self.cfg.train.seed, it, self.strategy.layout.dp_rank, self.strategy.layout.dp_size)

    def update_context(self) -> UpdateContext:
        """The trainer's context, plus the loader of the frozen models an update declares (``Needs.frozen_models``:
        on-policy distillation's teachers; :mod:`flowrl.trainers.frozen`)."""
        return dataclasses.replace(super().update_context(), load_frozen=frozen_loader(self.cfg, self.acc.device))

    def run_unit(self, i: int) -> tuple[dict, Optional[Rollout]]:
        res = self.run_iteration(i)
        return res.metrics, res.rollout

    def run_iteration(self, it: int) -> IterationResult:
        """Rollout of this process's prompts, the update on it, the iteration's metrics (rewards gathered
        over processes), the scheduler step."""
        t0 = time.perf_counter()
        prompts = self._iteration_prompts(it)
        self.model.eval()
        with self.reward_available(it), self.update_object().sampling_weights():
            rollout = self.sampler(self.policy, prompts, self.reward, seed=self._rollout_seed(it), iteration=it)
        t1 = time.perf_counter()
        maybe_fault("after_rollout", it)
        r_all = self._gather(rollout.rewards)
        self._require_scores(r_all, it)
        upd, info = self.train_on(rollout, it)
        maybe_fault("after_update", it)
        t2 = time.perf_counter()
        seeds_all = self._gather(rollout.seeds)
        finite = r_all[torch.isfinite(r_all)]
        met = {"iteration": it, "reward_mean": float(finite.mean()) if len(finite) else float("nan"),
               "reward_std": float(finite.std()) if len(finite) > 1 else 0.0,
               "nonfinite_rewards": int((~torch.isfinite(r_all)).sum()), "samples_gathered": int(r_all.numel()),
               "distinct_seeds_gathered": int(torch.unique(seeds_all).numel()),
               "zero_var_fraction": float(info.get("zero_var_fraction", 0.0)),
               "lr": self.sched.get_last_lr()[0], "skipped_steps": self.steps.skipped,
               "rollout_seconds": rollout.stats.get("rollout_seconds", t1 - t0),
               "reward_seconds": rollout.stats.get("reward_seconds", 0.0),
               "reward_wait_seconds": rollout.stats.get("reward_wait_seconds", 0.0), "update_seconds": t2 - t1,
               "model_evals": rollout.stats.get("model_evals", 0)}
        for k, v in rollout.reward_components.items():  # each reward's mean (its share of the advantages: the update)
            vv = self._gather(v)
            vv = vv[torch.isfinite(vv)]
            met[f"reward/{k}/mean"] = float(vv.mean()) if vv.numel() else float("nan")
        met.update({k: v for k, v in info.items() if isinstance(v, (int, float))})
        met.update({k: v for k, v in rollout.stats.items() if "/" in k and isinstance(v, (int, float))})  # sampler stats
        met.update(upd)
        self.sched.step()
        self._warn_reward_health(met)
        return IterationResult(met, rollout)

    def _require_scores(self, r_all: torch.Tensor, it: int) -> None:
        """Stop (:class:`~flowrl.trainers.steps.TrainingStopped`, the same on every process: ``r_all`` is
        gathered) when no reward of the iteration is finite. Such an iteration trains nothing and the
        update loop's non-finite guard never sees it: every group has zero variance, so no minibatch runs
        and no optimizer step is taken or skipped (the logged loss is NaN, the mean of none). The first
        such iteration stops a run that has not had a finite reward yet (in this process); after one that
        had, ``train.max_consecutive_skips`` of them in a row do (a batch of prompts that a reward cannot
        score may be drawn by chance)."""
        if bool(torch.isfinite(r_all).any()):
            self._scored_any, self._unscored_in_a_row = True, 0
            return
        self._unscored_in_a_row += 1
        limit = self.cfg.train.max_consecutive_skips
        if self._scored_any and self._unscored_in_a_row < limit:
            return  # said by _warn_reward_health (once)
        names = ", ".join(self.cfg.reward.weights) if self._given_reward is None else \
            getattr(self._given_reward, "name", type(self._given_reward).__name__)
        when = f"{self._unscored_in_a_row} iterations in a row" if self._scored_any else "from the first iteration on"
        raise TrainingStopped(
            f"iteration {it}: all {r_all.numel()} rewards are NaN/inf ({when}): reward {names} scored no sample, so "
            f"there is nothing to train on and training stopped (the last checkpoint is intact). Causes: prompts "
            f"the reward cannot score (an editing reward such as digits_edit needs prompts with source images: an "
            f"editing set, a .jsonl with 'prompt' and 'image' per row; the digits reward scores only 'a handwritten "
            f"digit N'): choose data.prompts that suit reward.weights; or a reward that returns NaN/inf.")

    def _warn_reward_health(self, met: dict) -> None:
        """Once per run each, on stderr: many non-finite rewards, or most groups without reward variance
        (both leave samples that train nothing)."""
        if not self.acc.is_main_process:
            return
        it, names = met["iteration"], ", ".join(self.cfg.reward.weights)
        bad, n = met["nonfinite_rewards"], max(1, met["samples_gathered"])
        if bad > NONFINITE_WARN * n and "nonfinite" not in self._warned:
            self._warned.add("nonfinite")
            print(f"[flowrl] WARNING: iteration {it}: {bad} of {n} rewards are NaN/inf: reward {names} cannot score "
                  f"those samples (e.g. prompts it does not understand: the digits reward scores only 'a handwritten "
                  f"digit N'), and they train nothing; choose data.prompts that suit reward.weights (warned once)",
                  file=sys.stderr, flush=True)
        zero = met["zero_var_fraction"]
        if zero > ZERO_VARIANCE_WARN and "zero_var" not in self._warned:
            self._warned.add("zero_var")
            print(f"[flowrl] WARNING: iteration {it}: {zero:.0%} of the groups have one reward for all their samples "
                  f"(zero variance): their advantages are 0 and they train nothing; check that reward {names} "
                  f"tells the samples of a prompt apart (NaN rewards count too), or raise sampler.group_size "
                  f"(warned once)", file=sys.stderr, flush=True)


def train(config: Config, output_dir: str | os.PathLike, resume: bool = False) -> dict:
    """Run online training; returns the summary (also in ``output_dir/summary.json``)."""
    return OnlineTrainer(config, output_dir, resume=resume).train()
