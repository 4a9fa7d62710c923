"""The one training loop, shared by online (rollout) and offline (dataset) training.

:class:`Trainer` sets up a run (accelerator and distribution strategy, policy, rewards, the trained parameters,
reference, optimizer and EMA, resume) and runs it: evaluation before the first unit, then per unit (an online
iteration, an offline optimizer step) the subclass's :meth:`run_unit`, metrics (with ``compile/recompiles``),
image grids, evaluation, checkpoints and SIGTERM / Ctrl-C handling; then the report and summary. ``--resume`` of
a finished run (its last checkpoint at ``total_units()`` and its summary written) changes nothing and returns
the summary it has. :class:`~flowrl.trainers.online.OnlineTrainer` feeds rollouts of a sampler to the update,
:class:`~flowrl.trainers.offline.OfflineTrainer` steps of a dataset. Everything that differs between DDP and
FSDP2 is the strategy object's (:mod:`flowrl.distributed.strategy`); the run directory and the resume check are
:class:`~flowrl.trainers.run_dir.RunDirectory`'s. One update call (:meth:`Trainer.train_on`, every forward
eager) asks the update what it trains on, then runs the one update loop, epochs, minibatches, accumulation,
clipping and the optimizer step (:meth:`flowrl.trainers.steps.OptimizerSteps.train`).

A subclass sets ``RESUME_FREE`` (keys a resume may change), ``unit`` (what a checkpoint counts), ``stop_causes``
(likely causes of non-finite steps), ``progress_desc`` and ``extend_hint`` (how to train a finished run
further), and implements the hooks in the "hooks" section.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from typing import Optional

import torch

from ..builders import (build_policy_from_config, build_reward, build_rewards, check_run_sources, evaluate_policy,
                        reference_metrics)
from ..checkpoints.common import CheckpointError, list_checkpoints
from ..data.embeddings import attach_text_cache, text_cache_covers
from ..data.items import item_sources, item_texts
from ..distributed.accelerate_state import forget_stale_accelerate_settings
from ..distributed.fsdp import check_launcher
from ..distributed.offload import Offload, offload_idle
from ..distributed.strategy import evaluation_weights, strategy_for
from ..media import save_samples
from ..registry import Registry
from ..rollout.base import Rollout
from ..trainable import EMA, Reference, set_up_trainable
from ..utils.compile import compile_log, eager_forwards
from ..utils.cuda_quirks import apply_cuda_workarounds
from ..updates import UPDATES
from ..updates.base import Update, UpdateContext
from .config import Config
from .reporting import rollout_rows
from .run_dir import RunDirectory
from .steps import OptimizerSteps, TrainingStopped


class Trainer:
    """``Trainer(config, output_dir, resume=False, *, policy=None, reward=None)``; ``train()`` -> summary.

    ``policy`` / ``reward``: objects to train and score with instead of building them from the config's
    ``model`` / ``reward.weights`` (config validation still runs; the run's ``config.yaml`` records the
    config, not the objects, so a resume must pass the same objects).
    """

    RESUME_FREE: set = set()
    unit = "iteration"
    stop_causes = ""
    progress_desc = "flowrl train"
    extend_hint = "raise train.iterations"
    updates: Registry = UPDATES  # where train.loss names its update class

    def __init__(self, config: Config, output_dir: str | os.PathLike, resume: bool = False, *, policy=None,
                 reward=None):
        self.cfg = config
        self.run = RunDirectory(output_dir, config, resume, self.RESUME_FREE)  # checked before any model loads
        self.run_dir, self.resume = self.run.path, resume
        self._given_policy, self._given_reward = policy, reward
        self._stop_requested = False
        self.stopped_by: Optional[str] = None  # the signal that stopped the run early (SIGTERM, SIGINT)
        self.finished = False  # set up a resume of a run that is already complete (nothing to do)
        self._old_handlers: dict = {}
        self._update: Optional[Update] = None  # the update object (made on first use)
        self._update_state: dict = {}  # a resumed checkpoint's extra tensors, for the update
        self._update_scalars: dict = {}  # ... and its JSON values (Update.scalar_state)

    # ---------------------------------------------------------------- hooks
    def _open_data(self) -> None:
        """Before the accelerator: open and check the training data (offline: the dataset)."""

    def _setup_data(self) -> list[str]:
        """After the accelerator: the training data; returns the training prompts the text cache encodes."""
        raise NotImplementedError

    def total_units(self) -> int:
        """Units (iterations or steps) the run trains in all."""
        raise NotImplementedError

    @property
    def eval_every(self) -> int:
        raise NotImplementedError

    @property
    def eval_steps(self) -> int:
        """ODE steps of the evaluation."""
        raise NotImplementedError

    @property
    def eval_max_batch(self) -> Optional[int]:
        """Rows per evaluation chunk (each chunk scored while the next samples); None: all at once."""
        return None

    def run_unit(self, i: int) -> tuple[dict, Optional[Rollout]]:
        """Train unit ``i`` -> (metrics with ``"iteration": i``, the rollout it trained on, to show, or None)."""
        raise NotImplementedError

    def progress_postfix(self, met: dict) -> dict:
        return {"loss": f"{met.get('loss', float('nan')):.2e}"}

    def checkpoint_state(self) -> dict:
        """JSON-able counters of the subclass saved with each checkpoint."""
        return {}

    def restore_state(self, ck: dict) -> None:
        """Take back what :meth:`checkpoint_state` saved (``ck["state"]``)."""

    def extend_evaluation(self, met: dict, images: torch.Tensor) -> None:
        """Add subclass metrics to an evaluation's ``met`` (in place)."""

    def summary_fields(self, last: int) -> dict:
        raise NotImplementedError

    def report_title(self) -> str:
        return self.cfg.model.pipeline

    def close(self) -> None:
        """Release the training data."""

    # ---------------------------------------------------------------- set-up
    def setup(self) -> None:
        """Everything a run needs, in an order that fails fast on bad input; the run directory claimed last."""
        cfg = self.cfg
        self._open_data()
        device = self._make_accelerator()
        apply_cuda_workarounds(device)  # known CUDA library faults (flowrl.utils.cuda_quirks)
        prompts = self._setup_data()
        self.eval_prompts = cfg.data.eval_prompt_set()
        self.eval_tags = cfg.data.eval_prompt_tags()  # each evaluation prompt's tag (None: an untagged set)
        check_run_sources(cfg, prompts, self.eval_prompts, self._given_policy, self._given_reward, self.acc)
        # the rewards before the model: a reward server that does not answer fails before minutes of loading
        self.reward = self._given_reward if self._given_reward is not None else build_reward(cfg)
        self.heldout = build_rewards(cfg.reward.heldout)
        policy = self._given_policy if self._given_policy is not None else build_policy_from_config(
            cfg, device, without_text_encoders=text_cache_covers(cfg.model, prompts + self.eval_prompts))
        offload_idle(policy, Offload(**cfg.train.offload), device)  # train.offload: text encoders, VAE
        policy.cfg_uncond_grad = cfg.train.update_options.cfg_uncond_grad  # CFG's unconditional half in training
        policy.token_multiple = self.strategy.layout.cp  # a context-parallel split takes equal token slices
        self.policy = attach_text_cache(policy, cfg.model, prompts + self.eval_prompts,
                                        is_main=self.acc.is_main_process, barrier=self.acc.wait_for_everyone,
                                        progress=cfg.logging.progress and self.acc.is_main_process)
        self._prepare_model(cfg.train.update_needs.reference)  # as the update declares
        self.start_iteration = 0  # first unit to train (an offline run's unit is an optimizer step)
        if self.resume:
            ck = self._load_latest()
            if ck is not None:
                self.start_iteration = int(ck["state"]["iteration"])
                self._update_state = self._update_copies(dict(ck["extra"]))  # e.g. DiffusionNFT's old policy
                self._update_scalars = dict(ck["state"].get("update", {}))  # e.g. GARDO's gate
                self.restore_state(ck)
                self._note_world_size(ck["state"].get("data_parallel", ck["state"].get("num_processes")))
        self.finished = (self.resume and self.start_iteration >= self.total_units()
                         and (self.run.path / "summary.json").is_file())
        if not self.finished:  # a finished run's directory is left exactly as it is
            self.run.claim(self.acc, self.start_iteration)

    def _note_world_size(self, saved: Optional[int]) -> None:
        """One line when a run resumes on another number of data-parallel replicas than its checkpoint was
        written by: the data of a unit is per replica, so the global batch of a unit changes (the
        process layout, FSDP x context parallel, may change freely)."""
        now = self.strategy.layout.dp_size
        if saved is not None and int(saved) != now and self.acc.is_main_process:
            print(f"[flowrl] note: this run's checkpoint was written by {saved} data-parallel replica(s) and resumes "
                  f"on {now}: train.batch_size (prompts and samples per {self.unit}) is per replica (per process "
                  f"with train.context_parallel=1), so each {self.unit} now trains on {now}/{saved} of the run's "
                  f"global batch so far; launch {saved} x train.context_parallel processes to keep it",
                  file=sys.stderr, flush=True)

    def _make_accelerator(self) -> torch.device:
        """``self.acc`` and ``self.strategy``; returns the device the model goes to."""
        from accelerate import Accelerator
        from accelerate.utils import ProjectConfiguration

        cfg = self.cfg
        # cpu=True lets accelerate form a gloo (MULTI_CPU) world under torchrun when there is no GPU
        on_cpu = cfg.model.device == "cpu" or (cfg.model.device == "auto" and not torch.cuda.is_available())
        forget_stale_accelerate_settings(cfg.train.mixed_precision, on_cpu)  # an earlier run in this process
        # step_scheduler_with_optimizer=False: one scheduler step per call (accelerate would otherwise step it
        # num_processes times, making train.warmup_iterations depend on the number of processes)
        project = ProjectConfiguration(project_dir=str(self.run.path), logging_dir=str(self.run.path / "logs"))
        self.acc = Accelerator(cpu=on_cpu, mixed_precision=cfg.train.mixed_precision, project_config=project,
                               log_with=list(cfg.logging.trackers) or None, step_scheduler_with_optimizer=False)
        check_launcher(self.acc.distributed_type, cfg.train.sharding)
        self.strategy = strategy_for(cfg.train.sharding, self.acc, cfg.train)
        return self.acc.device if cfg.model.device == "auto" else torch.device(cfg.model.device)

    def _prepare_model(self, need_reference: bool) -> None:
        """The trained parameters (LoRA with a seeded init, or all), the reference, AdamW with linear
        warm-up, the strategy's preparation (DDP wrapper or FSDP2 shards), EMA, the optimizer steps."""
        cfg = self.cfg
        tr = set_up_trainable(self.policy.transformer, cfg.train.lora_rank, cfg.train.lora_alpha,
                              cfg.train.lora_targets, getattr(self.policy, "lora_target_modules", None),
                              seed=cfg.train.seed)  # LoRA init depends on train.seed only
        self.ref = Reference(tr, need=need_reference)
        self.strategy.shard([tr, self.ref.copy])  # (a full fine-tune's frozen reference is sharded too)
        params = [p for p in tr.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
        warm = cfg.train.warmup_iterations
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: min(1.0, (it + 1) / warm) if warm else 1.0)
        self.model, self.opt, self.sched, self.unwrapped = self.strategy.prepare(tr, opt, sched)
        self.policy.transformer = self.model
        self.ema = EMA(self.unwrapped, cfg.train.ema_decay, host=cfg.train.offload["ema"]) if cfg.train.ema else None
        self.steps = OptimizerSteps(self.acc, self.strategy, self.model, self.unwrapped, self.opt, self.ema, cfg.train,
                                    self.stop_causes)

    # ---------------------------------------------------------------- the update
    def update_context(self) -> UpdateContext:
        """What an update may use (flowrl.updates.base); built once the model is prepared."""
        return UpdateContext(
            policy=self.policy, unwrapped=self.unwrapped, device=self.acc.device, autocast=self.acc.autocast,
            reference=lambda: self.ref.active(self.policy), gather=self._gather, train=self.cfg.train,
            reward=self.cfg.reward, sampler_name=self.cfg.sampler.name, num_processes=self.strategy.layout.dp_size,
            process_index=self.strategy.layout.dp_rank, dataset=getattr(self, "ds", None),
            optimizer_steps=lambda: self.steps.opt_steps)

    def update_object(self) -> Update:
        """The update ``train.loss`` names, made on first use with its options (built when the config loaded)
        and any state a resumed checkpoint holds for it."""
        if self._update is None:
            self._update = self.updates.get(self.cfg.train.loss)(self.update_context(), self.cfg.train.update_options)
            self._update.load_state_dict(self._update_state)
            self._update.load_scalar_state(self._update_scalars)
        return self._update

    def train_on(self, data, it: int) -> tuple[dict, dict]:
        """One update call on ``data`` (a rollout, or an offline step's group ids) -> (stats, advantage info): the
        update says what it trains on (in eval mode, before any step), the update loop trains it, all eagerly."""
        update = self.update_object()
        with eager_forwards():
            batch = update.batch(data, it)
            stats, trained = self.steps.train(update, batch, it)
        return {**batch.stats, **stats, **update.after_update(batch, trained, self.steps.opt_steps)}, batch.info

    def _update_copies(self, extra: dict) -> dict:
        """A checkpoint's extra tensors, checked against the copies the update declares it keeps."""
        missing = [c for c in self.cfg.train.update_needs.copies if c not in extra]
        if missing:
            raise CheckpointError(f"--resume: the newest checkpoint holds no {missing[0]!r}, which train.loss="
                                  f"{self.cfg.train.loss} keeps and checkpoints, so the run cannot continue exactly "
                                  f"(a checkpoint of another loss or an older flowrl); start a new --output-dir")
        return extra

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` of every data-parallel replica, concatenated in replica order (a context-parallel group's
        ranks hold the same rows: one copy each)."""
        if self.acc.num_processes == 1:
            return t
        return self.strategy.layout.replica_rows(self.acc.gather(t.to(self.acc.device)).cpu())

    # ---------------------------------------------------------------- checkpoints
    def _save(self, done: int) -> None:
        """Checkpoint after ``done`` units (the strategy writes it; every process returns once it is complete)."""
        upd = self._update
        own = upd.scalar_state() if upd is not None else {}
        scalars = {"update": own} if own else {}
        self.strategy.save(self.run.checkpoints, done, model=self.model, unwrapped=self.unwrapped, optimizer=self.opt,
                           scheduler=self.sched, ema=self.ema.shadow if self.ema else None,
                           state={**self.steps.state_dict(), **self.checkpoint_state(),
                                  "num_processes": self.acc.num_processes,
                                  "data_parallel": self.strategy.layout.dp_size, **scalars},
                           extra=(upd.state_dict() if upd is not None else None) or None,
                           keep=self.cfg.train.keep_checkpoints)

    def _load_latest(self) -> Optional[dict]:
        """Restore the newest readable checkpoint (an unreadable one falls back to its predecessor):
        weights, optimizer, scheduler, RNG, EMA, counters. Returns it (None: nothing to resume)."""
        ckpts = list_checkpoints(self.run.checkpoints)
        if not ckpts:
            why = "no checkpoint yet" if (self.run.path / "config.yaml").is_file() else "no run there"
            self.acc.print(f"[flowrl] --resume: nothing to resume in {self.run.path} ({why}): starting a new run")
            return None
        for path in reversed(ckpts):
            try:
                ck = self.strategy.restore(path, model=self.model, unwrapped=self.unwrapped, optimizer=self.opt,
                                           ema=self.ema)
                break
            except CheckpointError as e:
                self.acc.print(f"[flowrl] WARNING: {e}")
                if path == ckpts[0]:
                    raise CheckpointError(f"no readable checkpoint in {self.run.checkpoints}; the newest "
                                          f"error: {e}") from None
        self.sched.load_state_dict(ck["scheduler"])
        torch.set_rng_state(ck["torch_rng"])
        self.steps.load_state_dict(ck["state"])
        self.acc.print(f"[flowrl] resumed from {path} ({self.unit} {int(ck['state']['iteration'])})")
        return ck

    # ---------------------------------------------------------------- evaluation
    def evaluate(self, i: int) -> tuple[dict, torch.Tensor]:
        """Fixed prompts x fixed seeds, deterministic ODE (:func:`flowrl.builders.evaluate_policy`, chunks of
        ``eval_max_batch`` scored while the next samples), evaluation weights (EMA if kept), subclass metrics."""
        with evaluation_weights(self.strategy, self.policy, self.unwrapped, self.ema), self.reward_available(i):
            met, images = evaluate_policy(self.policy, self.reward, self.heldout, self.eval_prompts,
                                          self.cfg.data.eval_seeds_per_prompt, self.eval_steps, i,
                                          max_batch=self.eval_max_batch, frame_stride=self.cfg.reward.frame_stride,
                                          tags=self.eval_tags)
        self.extend_evaluation(met, images)
        return met, images

    @contextlib.contextmanager
    def reward_available(self, i: int):
        """A reward that became unreachable (its server gone: ``flowrl.rewards.RewardUnavailable``) stops the
        run here, before the unit's update: a :class:`TrainingStopped` that says how to continue."""
        from flowrl.rewards import RewardUnavailable

        try:
            yield
        except RewardUnavailable as e:
            raise TrainingStopped(f"{e}. Training stopped at {self.unit} {i}, before its update; the newest "
                                  f"checkpoint in {self.run_dir / 'checkpoints'} is intact: bring the reward back "
                                  f"and continue with --resume") from e

    def _evaluate_and_log(self, i: int, first: bool = False) -> None:
        """Evaluate (every process the strategy evaluates on), log (with the real-data reference at the
        first evaluation) and save the grid (main process)."""
        met, images = self.evaluate(i)
        if self.acc.is_main_process:
            real = self.real_data_reference() if first else {}
            self.run.log({**met, **real, "iteration": i})
            save_samples(images, self.run.samples / f"eval_{i:06d}.png", nrow=self.cfg.data.eval_seeds_per_prompt,
                         scale=max(1, 64 // images.shape[-1]), labels=item_texts(self.eval_prompts),
                         sources=item_sources(self.eval_prompts))  # a row per prompt: its text, an edit's inputs

    def real_data_reference(self) -> dict:
        """The evaluation metrics on real data (digits: held-out images), when the policy has them."""
        ref = getattr(self.policy, "reference_images", None)
        if ref is None:
            return {}
        k = self.cfg.data.eval_seeds_per_prompt
        images = ref(item_texts(self.eval_prompts), k)  # real data of the prompts' texts
        if images is None:
            return {}
        return reference_metrics(self.reward, images, self.eval_prompts, k, self.cfg.reward.frame_stride, self.eval_tags,
                                 self.heldout)

    # ---------------------------------------------------------------- the loop
    def train(self) -> dict:
        """Run (set up if not yet done) to ``total_units()``; returns the summary (main process; ``{}`` on
        the others), also written to ``summary.json``."""
        if not hasattr(self, "acc"):
            self.setup()
        if self.finished:
            return self._already_finished()
        try:
            self._catch_signals()
            return self._train()
        finally:
            self._release_signals()

    def _train(self) -> dict:
        from ..utils.progress import progress

        cfg, lg = self.cfg, self.cfg.logging
        n = self.total_units()
        if self.start_iteration == 0 and self.strategy.evaluates_here:
            self._evaluate_and_log(0, first=True)
        bar = progress(range(self.start_iteration, n), initial=self.start_iteration, total=n, desc=self.progress_desc,
                       unit=self.unit, disable=not (lg.progress and self.acc.is_main_process), dynamic_ncols=True)
        last = self.start_iteration
        for i in bar:
            met, shown = self.run_unit(i)
            met["compile/recompiles"] = compile_log(self.unwrapped).after_unit(self.unit, i, self.start_iteration,
                                                                               warn=self.acc.is_main_process)
            done = last = i + 1
            if i % lg.log_every == 0 or done == n:
                self.run.log(met)
            bar.set_postfix(**self.progress_postfix(met))
            if shown is not None and self.acc.is_main_process and (done % lg.image_every == 0 or done == n):
                images, nrow, labels, sources = rollout_rows(shown.images, shown.prompt_index, shown.prompts)
                save_samples(images, self.run.samples / f"train_{done:06d}.png", nrow=nrow,
                             scale=max(1, 64 // images.shape[-1]), labels=labels, sources=sources)
            if self.strategy.evaluates_here and (done % self.eval_every == 0 or done == n):
                self._evaluate_and_log(done)
            if done % cfg.train.checkpoint_every == 0 or done == n or self._stop_requested:
                self._save(done)
            if self._stop_requested:
                break
        bar.close()
        in_sync = self.strategy.in_sync(self.unwrapped)  # (collective)
        summary = self._finish(last, in_sync)
        self.close()
        self._shutdown()
        return summary

    def _already_finished(self) -> dict:
        """``--resume`` of a finished run: say so, touch nothing, return the summary it has."""
        n, summary = self.total_units(), {}
        if self.acc.is_main_process:
            print(f"[flowrl] the run in {self.run.path} is finished ({self.unit} {self.start_iteration} of {n}): "
                  f"nothing to train and nothing changed; to train it further, {self.extend_hint} with --resume",
                  file=sys.stderr, flush=True)
            summary = json.loads((self.run.path / "summary.json").read_text())
        self.close()
        self._shutdown()
        return summary

    def _catch_signals(self) -> None:
        """SIGTERM and Ctrl-C (SIGINT) finish the current unit, checkpoint and end the run early (a second
        Ctrl-C stops at once); the previous handlers come back when training returns."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread: the caller handles signals
                return

    def _release_signals(self) -> None:
        while self._old_handlers:
            signal.signal(*self._old_handlers.popitem())  # (signal, its previous handler)

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002
        name = signal.Signals(signum).name
        if self._stop_requested and signum == signal.SIGINT:  # Ctrl-C twice: stop now, without a checkpoint
            raise KeyboardInterrupt
        self._stop_requested, self.stopped_by = True, self.stopped_by or name
        if self.acc.is_main_process:
            again = " (Ctrl-C again stops at once, without it)" if signum == signal.SIGINT else ""
            print(f"[flowrl] {'Ctrl-C' if signum == signal.SIGINT else name}: finishing this {self.unit}, writing a "
                  f"checkpoint, then exiting{again}", file=sys.stderr, flush=True)

    def _finish(self, last: int, in_sync: bool) -> dict:
        """Main process: the report (``reward_curve.png``, ``before_after.png``) and ``summary.json``."""
        if not self.acc.is_main_process:
            return {}
        summary = {**self.summary_fields(last), "stopped_early": self._stop_requested,
                   **({"stopped_by": self.stopped_by} if self.stopped_by else {}),
                   **self.run.report(self.report_title()), "skipped_steps": self.steps.skipped,
                   "num_processes": self.acc.num_processes, "run_dir": str(self.run.path), "ranks_in_sync": in_sync}
        self.run.write_summary(summary)
        return summary

    def _shutdown(self) -> None:
        self.acc.end_training()
        if torch.distributed.is_initialized():  # (also the one-process group of train.sharding=fsdp)
            self.acc.wait_for_everyone()
            torch.distributed.destroy_process_group()  # else gloo/NCCL processes abort at exit
