"""Online training: rollout -> score -> advantages -> clipped-ratio update, on accelerate.

One loop for every sampler (group, branch, tempflow, sol): a rollout is a flat set of
stochastic transitions, the rollout's structure picks the advantage function, and the update
recomputes each transition's log-prob under the current weights (docs/design.md).

Accounting: each iteration trains ``inner_epochs`` passes over the transitions that carry
signal (zero-variance groups and pruned edges are dropped), shuffled into minibatches of
``minibatch_size`` transitions; ``grad_accum`` consecutive minibatches make one optimizer
step (the last group of an epoch may be shorter). The loss is the mean over the transitions
of a minibatch, divided by the number of minibatches in its accumulation group.
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch

from ..advantages import transition_advantages
from ..data.embeddings import attach_text_cache
from ..faults import maybe_fault
from ..losses import grpo_clipped_loss, kl_form_for_step, kl_to_reference
from ..pipelines.common import cfg_uncond_gradient
from ..rollout.base import Rollout, Transitions
from ..sde import get_step
from ..seeding import derive_seeds
from ..types import index_cond
from .common import TrainerBase, TrainingStopped  # noqa: F401 (TrainingStopped: public here too)
from .config import LOSSES, Config, ConfigError
from .reporting import save_grid
from .nft_update import OldPolicy, nft_update
from ..builders import EVAL_SEED, build_policy_from_config, build_reward, evaluate_policy  # noqa: F401 (public here too)
from .preference_update import preference_update
from ..utils.io import write_json

# keys that may change between a run and its resume without changing its trajectory
RESUME_FREE = {"train.iterations", "train.checkpoint_every", "train.keep_checkpoints", "logging", "model.device",
               "model.path", "train.max_consecutive_skips", "model.text_embedding_cache", "model.drop_text_encoders"}


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

    # ---------------------------------------------------------------- set-up
    def setup(self) -> None:
        cfg = self.cfg
        device = self._make_accelerator()
        self.prompts = cfg.data.train_prompts()
        self.eval_prompts = cfg.data.eval_prompt_set()
        self.sampler = cfg.sampler.build()
        if hasattr(self.sampler, "check_available"):  # e.g. an NVFP4 exploration backend on a CPU machine
            try:
                self.sampler.check_available()
            except ValueError as e:
                raise ConfigError(f"sampler.explore_backend: {e}") from None
        self.policy = build_policy_from_config(cfg, device)  # before the rewards: a bad model path fails fast
        self.policy = attach_text_cache(self.policy, cfg.model, self.prompts + self.eval_prompts,
                                        is_main=self.acc.is_main_process, barrier=self.acc.wait_for_everyone,
                                        progress=cfg.logging.progress and self.acc.is_main_process)
        self.reward = build_reward(cfg)
        self.heldout = {}
        if cfg.reward.heldout:
            from flowrl.rewards import build

            self.heldout = {k: build(k, **(v or {})) for k, v in cfg.reward.heldout.items()}
        self._prepare_model(need_reference=cfg.train.beta_kl > 0)
        self.old_policy = None  # DiffusionNFT's decayed sampling policy (train.loss=nft)
        self.step_fn = None
        self.start_iteration = 0
        if self.resume:
            ck = self._load_latest()
            if ck is not None:
                self.start_iteration = int(ck["state"]["iteration"])
                if "old_policy" in ck["extra"]:
                    self.old_policy = OldPolicy(self.unwrapped)
                    self.old_policy.shadow = ck["extra"]["old_policy"]
        self._claim_run_dir(self.start_iteration)  # only once everything loaded

    # ---------------------------------------------------------------- checkpoints
    def _save(self, iteration_done: int) -> None:
        super()._save(iteration_done, extra={"old_policy": self.old_policy.shadow} if self.old_policy else None)

    # ---------------------------------------------------------------- one iteration
    def _iteration_prompts(self, it: int) -> list[str]:
        rng = np.random.default_rng([self.cfg.train.seed, it, self.acc.process_index, 1])
        k = self.cfg.prompts_per_iteration
        idx = rng.choice(len(self.prompts), size=k, replace=len(self.prompts) < k)
        return [self.prompts[i] for i in idx]

    def _rollout_seed(self, it: int) -> int:
        return derive_seeds(self.cfg.train.seed * 1_000_003 + it, self.acc.num_processes)[self.acc.process_index]

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        if self.acc.num_processes == 1:
            return t
        return self.acc.gather(t.to(self.acc.device)).cpu()

    def _advantages(self, rollout: Rollout, it: int) -> tuple[torch.Tensor, dict]:
        opts = dict(self.cfg.train.advantage_options)
        opts.setdefault("global_std", self.cfg.train.global_std)
        opts.setdefault("adv_clip", self.cfg.train.adv_clip_max)
        if self.cfg.reward.aggregate == "per_reward":
            opts.setdefault("per_reward_weights", self.cfg.reward.weights)
        view = rollout
        if self.acc.num_processes > 1 and rollout.structure == "group":
            # groups stay on their rank; statistics (global std, logging) see every rank's samples
            n, p = rollout.num_samples, len(rollout.prompts)
            rank = self.acc.process_index
            view = SimpleNamespace(
                structure="group", rewards=self._gather(rollout.rewards),
                group_index=self._gather(rollout.group_index + rank * p),
                reward_components={k: self._gather(v) for k, v in rollout.reward_components.items()},
                transitions=SimpleNamespace(sample_index=rollout.transitions.sample_index + rank * n))
        adv, info = transition_advantages(view, iteration=it, **opts)
        return adv.clamp(-self.cfg.train.adv_clip_max, self.cfg.train.adv_clip_max), info

    def _minibatch_loss(self, rollout: Rollout, cond, rows: torch.Tensor, adv: torch.Tensor,
                        transitions: Optional[Transitions] = None) -> tuple[torch.Tensor, dict]:
        """Clipped-ratio loss of transitions ``rows`` [m] (of ``transitions``, default the rollout's)
        -> (loss, stats as 0-dim tensors: no host read here). With everything on the device already
        (``_update`` moves it once), the ``.to(dev)`` calls below copy nothing."""
        tr = (rollout.transitions if transitions is None else transitions).select(rows)
        dev = self.acc.device
        c = index_cond(cond, tr.prompt_index)
        lat, nxt = tr.latents.to(dev), tr.next_latents.to(dev)  # [m, C, H, W]
        sig, sig_n = tr.sigma.to(dev), tr.sigma_next.to(dev)  # [m]
        with self.acc.autocast():
            v = self.policy.velocity(lat, sig, c)  # [m, C, H, W]
        out = self.step_fn(v, lat, sig, sig_n, noise_level=rollout.noise_level, prev_sample=nxt)
        loss, stats = grpo_clipped_loss(out.log_prob, tr.old_log_prob.to(dev), adv[rows.to(adv.device)].to(dev),
                                        self.cfg.train.clip_range, tr.weight.to(dev), host_stats=False)
        stats["policy_loss"] = loss.detach()
        if self.cfg.train.beta_kl > 0:
            with torch.no_grad(), self.ref.active(self.policy), self.acc.autocast():
                v_ref = self.policy.velocity(lat, sig, c)
            ref = self.step_fn(v_ref, lat, sig, sig_n, noise_level=rollout.noise_level, prev_sample=nxt)
            kl = kl_to_reference(out.mean, ref.mean, out.std, dt=sig_n - sig,
                                 form=kl_form_for_step(self.cfg.train.kl_form, rollout.step_type)).mean()
            loss = loss + self.cfg.train.beta_kl * kl
            stats["kl"] = kl.detach()
        return loss, stats

    def _grpo_update(self, rollout: Rollout, it: int) -> tuple[dict, dict]:
        """Advantages of the rollout's structure, then the clipped-ratio update -> (stats, advantage info)."""
        if len(rollout.transitions) == 0:
            raise ConfigError(f"the {self.cfg.sampler.name!r} sampler stored no stochastic transitions (an ODE "
                              f"sampler?), so train.loss=grpo has nothing to train; use train.loss=nft")
        adv, info = self._advantages(rollout, it)
        return self._update(rollout, adv, info, it), info

    def _update(self, rollout: Rollout, adv: torch.Tensor, info: dict, it: int) -> dict:
        m = len(rollout.transitions)
        mask = torch.ones(m, dtype=torch.bool)
        if "train_mask" in info:
            mask &= info["train_mask"].bool()
        if "zero_var" in info:
            mask &= ~info["zero_var"].bool()
        rows_all = torch.nonzero(mask).flatten()
        # every rank must run the same number of backward passes (DDP): use the smallest count
        n_rows = int(len(rows_all))
        if self.acc.num_processes > 1:
            t = torch.tensor([n_rows], device=self.acc.device)
            n_rows = int(self.acc.gather(t).min().item())
        self.step_fn = get_step(rollout.step_type)
        dev = self.acc.device
        cond = rollout.conditioning(self.policy)  # the rollout's own: prompts are not encoded again
        trans = rollout.transitions.to(dev)  # once per update (a no-op for what the sampler left there)
        adv_d = adv.to(dev)  # [M]
        sums: dict[str, float] = {}
        count = 0
        self.model.train()
        for epoch in range(self.cfg.train.inner_epochs):
            g = torch.Generator().manual_seed(int(derive_seeds(self.cfg.train.seed * 7919 + it, epoch + 1)[-1]))
            rows = rows_all[torch.randperm(len(rows_all), generator=g)][:n_rows].to(dev)  # one copy per epoch
            mbs = list(rows.split(self.cfg.train.minibatch_size)) if n_rows else []  # no signal: no update
            count += self._accumulate(mbs, lambda mb: self._minibatch_loss(rollout, cond, mb, adv_d, trans), sums)
        self.model.eval()
        out = {k: v / count for k, v in sums.items()} if count else {}
        out["transitions_trained"] = n_rows * self.cfg.train.inner_epochs
        return out

    def run_iteration(self, it: int) -> IterationResult:
        t0 = time.perf_counter()
        prompts = self._iteration_prompts(it)
        self.model.eval()
        rollout = self.sampler(self.policy, prompts, self.reward, seed=self._rollout_seed(it), iteration=it)
        t1 = time.perf_counter()
        maybe_fault("after_rollout", it)
        with cfg_uncond_gradient(self.cfg.train.cfg_uncond_grad):
            upd, info = UPDATES[self.cfg.train.loss](self, rollout, it)
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
        ctx = self.ema.applied(self.unwrapped) if self.ema is not None else contextlib.nullcontext()
        with ctx:
            return evaluate_policy(self.policy, self.reward, self.heldout, self.eval_prompts,
                                   self.cfg.data.eval_seeds_per_prompt, getattr(self.sampler, "num_steps", 10), it)

    # ---------------------------------------------------------------- the loop
    def train(self) -> dict:
        from tqdm.auto import tqdm

        self._begin()
        cfg, lg = self.cfg, self.cfg.logging
        n_it = cfg.train.iterations
        eval_nrow = cfg.data.eval_seeds_per_prompt
        if self.start_iteration == 0 and self.acc.is_main_process:
            real = self._real_data_reference()
            em, imgs = self.evaluate(0)
            self._log({**em, **real, "iteration": 0})
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
            if self.acc.is_main_process and (done % lg.eval_every == 0 or done == n_it):
                em, imgs = self.evaluate(done)
                self._log(em)
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
        """Whether every process holds the same trained weights (checksums gathered over ranks)."""
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


# train.loss -> (trainer, rollout, iteration) -> (update stats, advantage info)
UPDATES = {
    "grpo": lambda tr, rollout, it: tr._grpo_update(rollout, it),
    "nft": lambda tr, rollout, it: (nft_update(tr, rollout, it), {}),
    "dpo": lambda tr, rollout, it: (preference_update(tr, rollout, it, pairwise=True), {}),
    "gdro": lambda tr, rollout, it: (preference_update(tr, rollout, it, pairwise=False), {}),
}
assert set(UPDATES) == set(LOSSES), "trainers/config.py LOSSES and UPDATES must name the same losses"


def train(config: Config, output_dir: str | os.PathLike, resume: bool = False) -> dict:
    """Run online training; returns the summary (also in ``output_dir/summary.json``)."""
    return OnlineTrainer(config, output_dir, resume=resume).train()
