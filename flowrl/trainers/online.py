"""Online training: rollout -> score -> advantages -> clipped-ratio update, on accelerate.

One loop for every sampler (group, branch, tempflow, sol): a rollout is a flat set of
stochastic transitions, the rollout's structure picks the advantage function, and the update
recomputes each transition's log-prob under the current weights (DESIGN.md).

Accounting: each iteration trains ``inner_epochs`` passes over the transitions that carry
signal (zero-variance groups and pruned edges are dropped), shuffled into minibatches of
``minibatch_size`` transitions; ``grad_accum`` consecutive minibatches make one optimizer
step (the last group of an epoch may be shorter). The loss is the mean over the transitions
of a minibatch, divided by the number of minibatches in its accumulation group.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch

from ..advantages import transition_advantages
from ..diagnostics import high_frequency_energy, within_group_diversity
from ..faults import maybe_fault
from ..losses import grpo_clipped_loss, kl_to_reference
from ..rollout.base import Rollout, score_images
from ..rollout.ode import ode_sample
from ..sde import get_step
from ..seeding import derive_seeds
from ..types import index_cond
from .checkpoint import CheckpointError, list_checkpoints, load_checkpoint, save_checkpoint
from .config import Config, ConfigError, dump_config, load_config
from .reporting import MetricsLog, plot_curves, read_metrics, save_grid
from .nft_update import OldPolicy, nft_update
from .weights import EMA, Reference, add_lora, load_trainable_state, trainable_state

EVAL_SEED = 20251121  # evaluation seeds are fixed, independent of the training seed
# keys that may change between a run and its resume without changing its trajectory
RESUME_FREE = {"train.iterations", "train.checkpoint_every", "train.keep_checkpoints", "logging", "model.device",
               "model.path", "train.max_consecutive_skips"}


class TrainingStopped(RuntimeError):
    """Training stopped on purpose (too many non-finite steps); the message says why."""


def build_reward(cfg: Config):
    from flowrl.rewards import MultiReward, build

    return MultiReward({k: build(k, **cfg.reward.options.get(k, {})) for k in cfg.reward.weights}, cfg.reward.weights)


def build_policy_from_config(cfg: Config, device):
    from flowrl.pipelines import build_policy

    return build_policy(cfg.model.pipeline, cfg.model.path, guidance_scale=cfg.model.guidance_scale,
                        device=device, **cfg.model.options)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k not in ("options", "weights", "heldout", "advantage_options"):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def config_differences(a: Config, b: Config) -> list[str]:
    """Keys whose values differ and that change the training trajectory."""
    fa, fb = _flat(a.to_dict()), _flat(b.to_dict())
    diff = []
    for k in sorted(set(fa) | set(fb)):
        if k in RESUME_FREE or k.split(".")[0] in RESUME_FREE:
            continue
        if fa.get(k) != fb.get(k):
            diff.append(f"{k}: {fa.get(k)!r} -> {fb.get(k)!r}")
    return diff


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
    met = {"iteration": it, "eval/reward": float(r[torch.isfinite(r)].mean()),
           "eval/reward_std": float(r[torch.isfinite(r)].std()),
           "eval/diversity": within_group_diversity(images, groups), "eval/hf_energy": high_frequency_energy(images)}
    for name, v in comps.items():
        met[f"eval/reward/{name}"] = float(v[torch.isfinite(v)].mean())
    for name, rew in heldout.items():
        hv, _ = score_images(rew, images, prompts)
        met[f"eval/heldout/{name}"] = float(hv[torch.isfinite(hv)].mean())
    return met, images


@dataclass
class IterationResult:
    metrics: dict
    rollout: Rollout


class OnlineTrainer:
    """``OnlineTrainer(config, output_dir, resume=False).train()`` -> summary dict.

    The run directory holds ``config.yaml``, ``metrics.jsonl``, ``checkpoints/iter_NNNNNN``,
    ``samples/*.png``, ``reward_curve.png``, ``before_after.png`` and TensorBoard logs.
    """

    def __init__(self, config: Config, output_dir: str | os.PathLike, resume: bool = False):
        self.cfg = config
        self.run_dir = Path(output_dir)
        self.resume = resume
        self._check_run_dir()
        self._stop_requested = False

    # ---------------------------------------------------------------- set-up
    def _check_run_dir(self) -> None:
        saved = self.run_dir / "config.yaml"
        if saved.exists():
            if not self.resume:
                raise ConfigError(f"output dir {self.run_dir} already holds a run (config.yaml). Pass --resume to "
                                  f"continue it, or choose another --output-dir.")
            try:
                old = load_config(saved)
            except ConfigError as e:
                raise ConfigError(f"{saved} is not a valid flowrl config ({e}); use another --output-dir") from None
            diff = config_differences(old, self.cfg)
            if diff:
                raise ConfigError(f"--resume: the config differs from the run in {self.run_dir} in keys that change "
                                  f"training: {'; '.join(diff)}. Resume with the same settings or start a new "
                                  f"--output-dir.")

    def setup(self) -> None:
        from accelerate import Accelerator
        from accelerate.utils import ProjectConfiguration

        cfg = self.cfg
        trackers = list(cfg.logging.trackers)
        # cpu=True lets accelerate form a gloo (MULTI_CPU) world under torchrun when there is no GPU
        on_cpu = cfg.model.device == "cpu" or (cfg.model.device == "auto" and not torch.cuda.is_available())
        self.acc = Accelerator(cpu=on_cpu, mixed_precision=cfg.train.mixed_precision, log_with=trackers or None,
                               project_config=ProjectConfiguration(project_dir=str(self.run_dir),
                                                                   logging_dir=str(self.run_dir / "logs")))
        device = self.acc.device if cfg.model.device == "auto" else torch.device(cfg.model.device)
        from flowrl.data import load_prompts

        self.prompts = load_prompts(cfg.data.prompts)
        self.eval_prompts = load_prompts(cfg.data.eval_prompts)
        self.sampler = cfg.sampler.build()
        if hasattr(self.sampler, "check_available"):  # e.g. an NVFP4 exploration backend on a CPU machine
            try:
                self.sampler.check_available()
            except ValueError as e:
                raise ConfigError(f"sampler.explore_backend: {e}") from None
        self.policy = build_policy_from_config(cfg, device)  # before the rewards: a bad model path fails fast
        self.reward = build_reward(cfg)
        self.heldout = {}
        if cfg.reward.heldout:
            from flowrl.rewards import build

            self.heldout = {k: build(k, **(v or {})) for k, v in cfg.reward.heldout.items()}
        tr = self.policy.transformer
        if cfg.train.lora_rank > 0:
            with torch.random.fork_rng(devices=[]):  # LoRA init depends on the seed only
                torch.manual_seed(cfg.train.seed)
                add_lora(tr, cfg.train.lora_rank, cfg.train.lora_alpha,
                         cfg.train.lora_targets or getattr(self.policy, "lora_target_modules", None))
        else:
            tr.requires_grad_(True)
        self.ref = Reference(tr, need=cfg.train.beta_kl > 0)
        self.params = [p for p in tr.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(self.params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
        warm = cfg.train.warmup_iterations
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: min(1.0, (it + 1) / warm) if warm else 1.0)
        self.model, self.opt, self.sched = self.acc.prepare(tr, opt, sched)
        self.policy.transformer = self.model
        self.unwrapped = self.acc.unwrap_model(self.model)
        self.ema = EMA(self.unwrapped, cfg.train.ema_decay) if cfg.train.ema else None
        self.old_policy = None  # DiffusionNFT's decayed sampling policy (train.loss=nft)
        self.step_fn = None
        self.start_iteration = 0
        self.opt_steps = self.skipped = self.consecutive_skips = 0
        if self.resume:
            self._load_latest()
        if self.acc.is_main_process:  # the run dir is claimed only once everything loaded
            self.run_dir.mkdir(parents=True, exist_ok=True)
            tmp = self.run_dir / "config.yaml.tmp"
            tmp.write_text(dump_config(cfg))
            os.replace(tmp, self.run_dir / "config.yaml")
            self.metrics = MetricsLog(self.run_dir / "metrics.jsonl", resume_from=self.start_iteration)
            if trackers:
                self.acc.init_trackers(cfg.logging.project, config={k: str(v) for k, v in _flat(cfg.to_dict()).items()})

    # ---------------------------------------------------------------- checkpoints
    def _save(self, iteration_done: int) -> None:
        self.acc.wait_for_everyone()
        if self.acc.is_main_process:
            save_checkpoint(self.run_dir / "checkpoints", iteration_done,
                            trainable=trainable_state(self.unwrapped), optimizer=self.opt.state_dict(),
                            scheduler=self.sched.state_dict(), ema=self.ema.shadow if self.ema else None,
                            extra={"old_policy": self.old_policy.shadow} if self.old_policy else None,
                            state={"opt_steps": self.opt_steps, "skipped": self.skipped,
                                   "consecutive_skips": self.consecutive_skips},
                            keep=self.cfg.train.keep_checkpoints)
        self.acc.wait_for_everyone()

    def _load_latest(self) -> None:
        ckpts = list_checkpoints(self.run_dir / "checkpoints")
        if not ckpts:
            return
        for path in reversed(ckpts):  # newest first; an unreadable one falls back to its predecessor
            try:
                ck = load_checkpoint(path)
                break
            except CheckpointError as e:
                self.acc.print(f"[flowrl] WARNING: {e}")
                if path == ckpts[0]:
                    raise CheckpointError(f"no readable checkpoint in {self.run_dir / 'checkpoints'}; the newest "
                                          f"error: {e}") from None
        ckpts = [path]
        load_trainable_state(self.unwrapped, ck["trainable"])
        self.opt.load_state_dict(ck["optimizer"])
        self.sched.load_state_dict(ck["scheduler"])
        torch.set_rng_state(ck["torch_rng"])
        if self.ema is not None and ck["ema"] is not None:
            self.ema.shadow = ck["ema"]
        if "old_policy" in ck["extra"]:
            self.old_policy = OldPolicy(self.unwrapped)
            self.old_policy.shadow = ck["extra"]["old_policy"]
        st = ck["state"]
        self.start_iteration = int(st["iteration"])
        self.opt_steps, self.skipped = int(st["opt_steps"]), int(st["skipped"])
        self.consecutive_skips = int(st["consecutive_skips"])
        self.acc.print(f"[flowrl] resumed from {ckpts[-1]} (iteration {self.start_iteration})")

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

    def _all_finite(self, x: torch.Tensor) -> bool:
        ok = torch.tensor([1.0 if torch.isfinite(x).all() else 0.0], device=self.acc.device)
        if self.acc.num_processes > 1:
            ok = self.acc.reduce(ok, reduction="sum") / self.acc.num_processes
        return bool(ok.item() == 1.0)

    def _minibatch_loss(self, rollout: Rollout, cond, rows: torch.Tensor, adv: torch.Tensor) -> tuple[torch.Tensor, dict]:
        tr = rollout.transitions.select(rows)
        dev = self.acc.device
        c = index_cond(cond, tr.prompt_index)
        lat, nxt = tr.latents.to(dev), tr.next_latents.to(dev)  # [m, C, H, W]
        sig, sig_n = tr.sigma.to(dev), tr.sigma_next.to(dev)  # [m]
        with self.acc.autocast():
            v = self.policy.velocity(lat, sig, c)  # [m, C, H, W]
        out = self.step_fn(v, lat, sig, sig_n, noise_level=rollout.noise_level, prev_sample=nxt)
        loss, stats = grpo_clipped_loss(out.log_prob, tr.old_log_prob.to(dev), adv[rows].to(dev),
                                        self.cfg.train.clip_range, tr.weight.to(dev))
        stats["policy_loss"] = loss.item()
        if self.cfg.train.beta_kl > 0:
            with torch.no_grad(), self.ref.active(self.policy), self.acc.autocast():
                v_ref = self.policy.velocity(lat, sig, c)
            ref = self.step_fn(v_ref, lat, sig, sig_n, noise_level=rollout.noise_level, prev_sample=nxt)
            kl = kl_to_reference(out.mean, ref.mean, out.std).mean()
            loss = loss + self.cfg.train.beta_kl * kl
            stats["kl"] = kl.item()
        return loss, stats

    def _optimizer_step(self, finite: bool) -> dict:
        norm = self.acc.clip_grad_norm_(self.params, self.cfg.train.max_grad_norm) if finite else torch.tensor(float("nan"))
        norm = torch.as_tensor(norm, dtype=torch.float32)
        if finite and self._all_finite(norm):
            self.opt.step()
            self.opt_steps += 1
            self.consecutive_skips = 0
            if self.ema is not None and self.opt_steps % self.cfg.train.ema_every == 0:
                self.ema.update(self.unwrapped)
        else:
            if finite and getattr(self.acc, "scaler", None) is not None:
                self.opt.step()  # fp16: the GradScaler sees the inf, skips the update and lowers its scale
            self.skipped += 1
            self.consecutive_skips += 1
            if self.consecutive_skips >= self.cfg.train.max_consecutive_skips:
                raise TrainingStopped(
                    f"{self.consecutive_skips} optimizer steps in a row had a non-finite loss or gradient, so training "
                    f"stopped (weights are as of the last good step; the last checkpoint is intact). Causes: a reward "
                    f"returning NaN/inf, a learning rate too high (train.lr={self.cfg.train.lr}), or fp16 overflow "
                    f"(train.mixed_precision={self.cfg.train.mixed_precision}).")
        self.opt.zero_grad(set_to_none=True)
        return {"grad_norm": float(norm)}

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
        with torch.no_grad():
            cond = self.policy.encode_prompts(rollout.prompts)
        sums: dict[str, float] = {}
        count = 0
        ga = self.cfg.train.grad_accum
        self.model.train()
        for epoch in range(self.cfg.train.inner_epochs):
            g = torch.Generator().manual_seed(int(derive_seeds(self.cfg.train.seed * 7919 + it, epoch + 1)[-1]))
            rows = rows_all[torch.randperm(len(rows_all), generator=g)][:n_rows]
            mbs = list(rows.split(self.cfg.train.minibatch_size)) if n_rows else []  # no signal: no update
            for start in range(0, len(mbs), ga):
                group = mbs[start:start + ga]
                finite = True
                for j, mb in enumerate(group):
                    sync = j == len(group) - 1
                    ctx = contextlib.nullcontext() if sync or self.acc.num_processes == 1 else self.acc.no_sync(self.model)
                    with ctx:
                        loss, stats = self._minibatch_loss(rollout, cond, mb, adv)
                        if not self._all_finite(loss.detach()):
                            finite = False
                            continue
                        self.acc.backward(loss / len(group))
                    for k, v in stats.items():
                        sums[k] = sums.get(k, 0.0) + v
                    sums["loss"] = sums.get("loss", 0.0) + loss.item()
                    count += 1
                for k, v in self._optimizer_step(finite).items():
                    sums[k] = sums.get(k, 0.0) + v * len(group)
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
        if self.cfg.train.loss == "nft":
            info = {}
            upd = nft_update(self, rollout, it)
        else:
            if len(rollout.transitions) == 0:
                raise ConfigError(f"the {self.cfg.sampler.name!r} sampler stored no stochastic transitions (an ODE "
                                  f"sampler?), so train.loss=grpo has nothing to train; use train.loss=nft")
            adv, info = self._advantages(rollout, it)
            upd = self._update(rollout, adv, info, it)
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

    def _real_data_reference(self) -> dict:
        ref = getattr(self.policy, "reference_images", None)
        if ref is None:
            return {}
        k = self.cfg.data.eval_seeds_per_prompt
        images = ref(self.eval_prompts, k)
        if images is None:
            return {}
        groups = torch.arange(len(self.eval_prompts)).repeat_interleave(k)
        prompts = [p for p in self.eval_prompts for _ in range(k)]
        r, _ = score_images(self.reward, images, prompts)
        return {"real/reward": float(r[torch.isfinite(r)].mean()), "real/diversity": within_group_diversity(images, groups),
                "real/hf_energy": high_frequency_energy(images)}

    # ---------------------------------------------------------------- the loop
    def _log(self, record: dict) -> None:
        if self.acc.is_main_process:
            self.metrics.write(record)
            if self.cfg.logging.trackers:
                self.acc.log({k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "iteration"},
                             step=record["iteration"])

    def _on_sigterm(self, signum, frame) -> None:  # noqa: ARG002
        self._stop_requested = True
        if self.acc.is_main_process:
            print("[flowrl] SIGTERM: finishing this iteration, writing a checkpoint, then exiting",
                  file=sys.stderr, flush=True)

    def train(self) -> dict:
        from tqdm.auto import tqdm

        if not hasattr(self, "acc"):
            self.setup()
        cfg, lg = self.cfg, self.cfg.logging
        try:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread: the caller handles signals
            pass
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
            summary["num_processes"] = self.acc.num_processes
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.acc.end_training()
        if self.acc.num_processes > 1 and torch.distributed.is_initialized():
            self.acc.wait_for_everyone()
            torch.distributed.destroy_process_group()  # else gloo/NCCL processes abort at exit
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
        recs = read_metrics(self.run_dir / "metrics.jsonl")
        plot_curves(recs, self.run_dir / "reward_curve.png", title=f"{self.cfg.model.pipeline} / {self.cfg.sampler.name}")
        evals = sorted((r for r in recs if "eval/reward" in r), key=lambda r: r["iteration"])
        first, final = (evals[0], evals[-1]) if evals else ({}, {})
        before = self.run_dir / "samples" / "eval_000000.png"
        after = self.run_dir / "samples" / f"eval_{final.get('iteration', 0):06d}.png"
        if before.exists() and after.exists():
            _side_by_side(before, after, self.run_dir / "before_after.png")
        real = next((r for r in recs if "real/reward" in r), {})
        summary = {"iterations_done": last, "stopped_early": self._stop_requested,
                   "eval_reward_before": first.get("eval/reward"), "eval_reward_after": final.get("eval/reward"),
                   "diversity_before": first.get("eval/diversity"), "diversity_after": final.get("eval/diversity"),
                   "hf_energy_before": first.get("eval/hf_energy"), "hf_energy_after": final.get("eval/hf_energy"),
                   **{k: v for k, v in real.items() if k.startswith("real/")}, "skipped_steps": self.skipped,
                   "run_dir": str(self.run_dir)}
        return summary


def _side_by_side(before: Path, after: Path, out: Path) -> None:
    import numpy as np
    from PIL import Image

    from .reporting import save_png

    a, b = np.asarray(Image.open(before).convert("RGB")), np.asarray(Image.open(after).convert("RGB"))
    h = max(a.shape[0], b.shape[0])
    pad = lambda x: np.pad(x, ((0, h - x.shape[0]), (0, 0), (0, 0)), constant_values=255)  # noqa: E731
    gap = np.full((h, 12, 3), 255, np.uint8)
    save_png(np.concatenate([pad(a), gap, pad(b)], axis=1), out)


def train(config: Config, output_dir: str | os.PathLike, resume: bool = False) -> dict:
    """Run online training; returns the summary (also in ``output_dir/summary.json``)."""
    return OnlineTrainer(config, output_dir, resume=resume).train()
