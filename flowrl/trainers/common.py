"""What the online (rollout) and offline (GDRO) trainers share: the run directory and its resume
check, the accelerator, the trained model (LoRA, reference, optimizer, EMA), checkpoints with
fallback to the previous one, the non-finite guard, metric logging and SIGTERM handling."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..checkpoints.common import CheckpointError, list_checkpoints
from ..checkpoints.sharded import ShardedCheckpoint
from ..checkpoints.unsharded import UnshardedCheckpoint
from ..diagnostics import high_frequency_energy, within_group_diversity
from ..errors import ConfigError
from ..rollout.base import score_images
from ..trainable import EMA, Reference, load_trainable_state, set_up_trainable, trainable_state
from ..types import swapped_transformer
from ..utils.io import write_text
from .config import Config, dump_config, load_config
from .reporting import MetricsLog, plot_curves, read_metrics, side_by_side
from .sharding import check_launcher, clip_grad_norm, shard_model


class TrainingStopped(RuntimeError):
    """Training stopped on purpose (too many non-finite steps); the message says why."""


def flat_config(d: dict, prefix: str = "") -> dict:
    """``{"train": {"lr": 1}}`` -> ``{"train.lr": 1}`` (option dicts stay whole)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k not in ("options", "weights", "heldout", "advantage_options", "loss_options"):
            out.update(flat_config(v, key + "."))
        else:
            out[key] = v
    return out


def config_differences(a: Config, b: Config, free: set) -> list[str]:
    """Keys whose values differ between ``a`` and ``b``, except those in ``free`` or under a free prefix
    (``logging`` frees ``logging.eval_every``, ``offline.judge`` frees ``offline.judge.vlm_judge.url``)."""
    fa, fb = flat_config(a.to_dict()), flat_config(b.to_dict())

    def is_free(k: str) -> bool:
        parts = k.split(".")
        return any(".".join(parts[:i]) in free for i in range(1, len(parts) + 1))

    return [f"{k}: {fa.get(k)!r} -> {fb.get(k)!r}" for k in sorted(set(fa) | set(fb))
            if not is_free(k) and fa.get(k) != fb.get(k)]


class TrainerBase:
    """Subclasses set ``RESUME_FREE`` (keys a resume may change), ``unit`` (what a checkpoint counts:
    iteration / step) and ``stop_causes`` (likely causes of non-finite steps, for the message)."""

    RESUME_FREE: set = set()
    unit = "iteration"
    stop_causes = ""

    def __init__(self, config: Config, output_dir: str | os.PathLike, resume: bool = False):
        self.cfg = config
        self.run_dir = Path(output_dir)
        self.resume = resume
        self._stop_requested = False
        self._check_run_dir()

    # ---------------------------------------------------------------- set-up
    def _check_run_dir(self) -> None:
        saved = self.run_dir / "config.yaml"
        if not saved.exists():
            return
        if not self.resume:
            raise ConfigError(f"output dir {self.run_dir} already holds a run (config.yaml). Pass --resume to "
                              f"continue it, or choose another --output-dir.")
        try:
            old = load_config(saved)
        except ConfigError as e:
            raise ConfigError(f"{saved} is not a valid flowrl config ({e}); use another --output-dir") from None
        diff = config_differences(old, self.cfg, self.RESUME_FREE)
        if diff:
            raise ConfigError(f"--resume: the config differs from the run in {self.run_dir} in keys that change "
                              f"training: {'; '.join(diff)}. Resume with the same settings or start a new "
                              f"--output-dir.")

    def _make_accelerator(self) -> torch.device:
        """``self.acc``; returns the device the model goes to."""
        from accelerate import Accelerator
        from accelerate.utils import ProjectConfiguration

        cfg = self.cfg
        trackers = list(cfg.logging.trackers)
        # cpu=True lets accelerate form a gloo (MULTI_CPU) world under torchrun when there is no GPU
        on_cpu = cfg.model.device == "cpu" or (cfg.model.device == "auto" and not torch.cuda.is_available())
        # step_scheduler_with_optimizer=False: one scheduler step per call (accelerate would otherwise step it
        # num_processes times, making train.warmup_iterations depend on the number of processes)
        self.acc = Accelerator(cpu=on_cpu, mixed_precision=cfg.train.mixed_precision, log_with=trackers or None,
                               step_scheduler_with_optimizer=False,
                               project_config=ProjectConfiguration(project_dir=str(self.run_dir),
                                                                   logging_dir=str(self.run_dir / "logs")))
        check_launcher(self.acc.distributed_type, cfg.train.sharding)
        return self.acc.device if cfg.model.device == "auto" else torch.device(cfg.model.device)

    @property
    def sharded(self) -> bool:
        """``train.sharding=fsdp``: the transformer is FSDP2-sharded over the processes (trainers/sharding.py)."""
        return self.cfg.train.sharding == "fsdp"

    @property
    def evaluates_here(self) -> bool:
        """Evaluation runs on the main process, and on every process when sharded (forwards are collective)."""
        return self.acc.is_main_process or self.sharded

    def _prepare_model(self, need_reference: bool) -> None:
        """LoRA (seeded init) or full fine-tune on ``self.policy.transformer``, the reference (the
        adapter-disabled model), AdamW with linear warm-up, ``accelerate.prepare``, EMA."""
        cfg = self.cfg
        tr = set_up_trainable(self.policy.transformer, cfg.train.lora_rank, cfg.train.lora_alpha,
                              cfg.train.lora_targets, getattr(self.policy, "lora_target_modules", None),
                              seed=cfg.train.seed)  # LoRA init depends on train.seed only
        self.ref = Reference(tr, need=need_reference)
        if self.sharded:  # FSDP2 in place (blocks, then the root); a full fine-tune's frozen reference too
            for m in (tr, self.ref.copy):
                if m is not None:
                    shard_model(m, self.acc.device, mixed_precision=cfg.train.mixed_precision,
                                cpu_offload=cfg.train.cpu_offload)
        self.params = [p for p in tr.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(self.params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
        warm = cfg.train.warmup_iterations
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: min(1.0, (it + 1) / warm) if warm else 1.0)
        if self.sharded:  # not through accelerate.prepare, which would wrap the sharded model in DDP
            self.model, self.opt, self.sched = tr, opt, sched
        else:
            self.model, self.opt, self.sched = self.acc.prepare(tr, opt, sched)
        self.policy.transformer = self.model
        self.unwrapped = self.model if self.sharded else self.acc.unwrap_model(self.model)
        self.ema = EMA(self.unwrapped, cfg.train.ema_decay) if cfg.train.ema else None
        self.opt_steps = self.skipped = self.consecutive_skips = 0

    def _claim_run_dir(self, start: int) -> None:
        """Once everything loaded: ``config.yaml``, the metrics log (cut at ``start``), trackers."""
        if not self.acc.is_main_process:
            return
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_text(self.run_dir / "config.yaml", dump_config(cfg))
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl", resume_from=start)
        if cfg.logging.trackers:
            self.acc.init_trackers(cfg.logging.project, config={k: str(v) for k, v in flat_config(cfg.to_dict()).items()})

    # ---------------------------------------------------------------- checkpoints
    def _save(self, done: int, state: Optional[dict] = None, extra: Optional[dict] = None) -> None:
        """Checkpoint after ``done`` iterations/steps (main process writes; everyone waits)."""
        counters = {"opt_steps": self.opt_steps, "skipped": self.skipped, "consecutive_skips": self.consecutive_skips,
                    **(state or {})}
        if self.sharded:  # every process writes its shards (collective)
            ShardedCheckpoint.save(self.run_dir / "checkpoints", done, model=self.model, optimizer=self.opt,
                                    scheduler=self.sched.state_dict(), state=counters,
                                    ema=self.ema.shadow if self.ema else None, extra=extra or {},
                                    keep=self.cfg.train.keep_checkpoints, is_main=self.acc.is_main_process,
                                    barrier=self.acc.wait_for_everyone)
            return
        self.acc.wait_for_everyone()
        if self.acc.is_main_process:
            UnshardedCheckpoint.save(self.run_dir / "checkpoints", done,
                            trainable=trainable_state(self.unwrapped), optimizer=self.opt.state_dict(),
                            scheduler=self.sched.state_dict(), ema=self.ema.shadow if self.ema else None,
                            extra=extra or None, state=counters, keep=self.cfg.train.keep_checkpoints)
        self.acc.wait_for_everyone()

    def _load_latest(self) -> Optional[dict]:
        """Restore the newest readable checkpoint (an unreadable one falls back to its predecessor):
        weights, optimizer, scheduler, RNG, EMA, counters. Returns it (None: nothing to resume)."""
        ckpts = list_checkpoints(self.run_dir / "checkpoints")
        if not ckpts:
            return None
        for path in reversed(ckpts):
            try:
                ck = self._read_checkpoint(path)
                break
            except CheckpointError as e:
                self.acc.print(f"[flowrl] WARNING: {e}")
                if path == ckpts[0]:
                    raise CheckpointError(f"no readable checkpoint in {self.run_dir / 'checkpoints'}; the newest "
                                          f"error: {e}") from None
        if not self.sharded:  # (sharded: restored in place by _read_checkpoint)
            load_trainable_state(self.unwrapped, ck["trainable"])
            self.opt.load_state_dict(ck["optimizer"])
            if self.ema is not None and ck["ema"] is not None:
                self.ema.shadow = ck["ema"]
        self.sched.load_state_dict(ck["scheduler"])
        torch.set_rng_state(ck["torch_rng"])
        st = ck["state"]
        self.opt_steps, self.skipped = int(st["opt_steps"]), int(st["skipped"])
        self.consecutive_skips = int(st["consecutive_skips"])
        self.acc.print(f"[flowrl] resumed from {path} ({self.unit} {int(st['iteration'])})")
        return ck

    def _read_checkpoint(self, path: Path) -> dict:
        """One checkpoint: read (unsharded), or restored into the sharded model, optimizer and EMA (collective)."""
        if not self.sharded:
            return UnshardedCheckpoint.load(path)
        if not ShardedCheckpoint.is_one(path):
            raise CheckpointError(f"{path} is not a sharded checkpoint (written with train.sharding=none)")
        return ShardedCheckpoint.restore(path, model=self.model, optimizer=self.opt,
                                         ema=self.ema.shadow if self.ema is not None else None)

    # ---------------------------------------------------------------- optimizer
    def _finite_everywhere(self, ok: torch.Tensor) -> torch.Tensor:
        """0-dim bool tensor: ``ok`` holds on every process (a device-side reduction, no host read)."""
        ok = ok.to(self.acc.device, torch.float32).reshape(1)
        if self.acc.num_processes > 1:
            ok = self.acc.reduce(ok, reduction="sum") / self.acc.num_processes
        return ok[0] == 1.0

    def _accumulate(self, passes: list, loss_of: Callable[[Any], tuple[torch.Tensor, dict]], sums: dict,
                    after_step: Optional[Callable[[], None]] = None, counts: Optional[dict] = None) -> int:
        """Forward/backward over ``passes`` in groups of ``train.grad_accum``, one optimizer step per
        group (DDP syncs gradients on a group's last pass only). ``loss_of(pass) -> (loss, stats)``
        (stats: floats or 0-dim tensors); each pass's loss is divided by its group's size. A group with
        a non-finite loss skips its optimizer step (its gradients are dropped unused). Adds the stats
        of finite passes, ``loss`` and ``grad_norm`` (weighted by group size) into ``sums``;
        ``after_step()`` runs after every step. Returns passes counted. With ``counts``, each key's
        number of contributions is added there too (``grad_norm``: the group size), for per-key means.

        Host syncs: the finite checks stay on the device until one read per optimizer step (the
        step-or-skip decision); tensor stats are read once, at the end (:func:`flush_stats`).
        """
        count, ga = 0, self.cfg.train.grad_accum
        kept: list[tuple[str, Any]] = []  # (name, float or 0-dim tensor) of finite passes, in order
        for start in range(0, len(passes), ga):
            group = passes[start:start + ga]
            oks, group_stats = [], []
            for j, p in enumerate(group):
                sync = j == len(group) - 1 or self.acc.num_processes == 1
                with contextlib.nullcontext() if sync else self.acc.no_sync(self.model):
                    loss, stats = loss_of(p)
                    oks.append(torch.isfinite(loss.detach()))  # 0-dim bool, on the device
                    self.acc.backward(loss / len(group))  # non-finite: the group's step is skipped below
                group_stats.append({**stats, "loss": loss.detach()})
            flags, norm = self._guarded_step(torch.stack(oks))
            for ok, st in zip(flags, group_stats):
                if ok:
                    kept.extend(st.items())
                    count += 1
                    if counts is not None:
                        for k in st:
                            counts[k] = counts.get(k, 0) + 1
            kept.append(("grad_norm", norm * len(group)))
            if counts is not None:
                counts["grad_norm"] = counts.get("grad_norm", 0) + len(group)
            if after_step is not None:
                after_step()
        flush_stats(kept, sums)
        return count

    def _guarded_step(self, loss_ok: torch.Tensor) -> tuple[list[bool], torch.Tensor]:
        """Clip, then step if every loss of the group (``loss_ok`` [G] bool) and the gradient norm are
        finite on every process, else skip (:meth:`_take_step`); one host read. Returns the per-pass
        flags and the norm (NaN when a loss was not finite), a 0-dim tensor."""
        if self.sharded:
            norm = clip_grad_norm(self.params, self.cfg.train.max_grad_norm).to(loss_ok.device)
        else:
            norm = torch.as_tensor(self.acc.clip_grad_norm_(self.params, self.cfg.train.max_grad_norm),
                                   dtype=torch.float32, device=loss_ok.device)  # unscales fp16 gradients first
        losses_ok = loss_ok.all()
        ok = self._finite_everywhere(losses_ok & torch.isfinite(norm))
        read = torch.cat([loss_ok.float(), ok.float().reshape(1).to(loss_ok.device)]).tolist()  # the one sync
        self._take_step(read[-1] == 1.0, scaler_update_only=True)
        norm = torch.where(losses_ok, norm, torch.full_like(norm, float("nan")))
        return [v == 1.0 for v in read[:-1]], norm

    def _take_step(self, ok: bool, scaler_update_only: bool, unscaled: bool = True) -> None:
        """Step (``ok``) or count a skipped step, stopping after ``train.max_consecutive_skips`` in a
        row; then zero the gradients. On a skip with fp16 loss scaling and unscaled gradients, the
        GradScaler records it: ``scaler_update_only`` updates the scale without stepping, else the
        optimizer's step runs through the scaler, which skips it on the inf it sees."""
        if ok:
            self.opt.step()
            self.opt_steps += 1
            self.consecutive_skips = 0
            if self.ema is not None and self.opt_steps % self.cfg.train.ema_every == 0:
                self.ema.update(self.unwrapped)
        else:
            scaler = getattr(self.acc, "scaler", None)
            if unscaled and scaler is not None:
                if scaler_update_only:
                    scaler.update()  # records the skip (lowers the scale if the gradients overflowed)
                else:
                    self.opt.step()  # fp16: the GradScaler sees the inf, skips the update and lowers its scale
            self.skipped += 1
            self.consecutive_skips += 1
            if self.consecutive_skips >= self.cfg.train.max_consecutive_skips:
                raise TrainingStopped(
                    f"{self.consecutive_skips} optimizer steps in a row had a non-finite loss or gradient, so training "
                    f"stopped (weights are as of the last good step; the last checkpoint is intact). Causes: "
                    f"{self.stop_causes}a learning rate too high (train.lr={self.cfg.train.lr}), or fp16 overflow "
                    f"(train.mixed_precision={self.cfg.train.mixed_precision}).")
        self.opt.zero_grad(set_to_none=True)

    @contextlib.contextmanager
    def evaluation_model(self):
        """Inside, ``self.policy`` evaluates the evaluation weights (the EMA when kept). Unsharded it runs the
        bare module: a DDP forward broadcasts buffers, a collective the other processes (not evaluating)
        would never join. Sharded it stays the FSDP module, evaluated on every process."""
        ema = self.ema.applied(self.unwrapped) if self.ema is not None else contextlib.nullcontext()
        bare = contextlib.nullcontext() if self.sharded else swapped_transformer(self.policy, self.unwrapped)
        with ema, bare:
            yield

    # ---------------------------------------------------------------- reporting
    def _real_data_reference(self) -> dict:
        """The evaluation metrics on real data (digits: held-out images), when the policy has them."""
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

    def _log(self, record: dict) -> None:
        if self.acc.is_main_process:
            self.metrics.write(record)
            if self.cfg.logging.trackers:
                self.acc.log({k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "iteration"},
                             step=record["iteration"])

    def _on_sigterm(self, signum, frame) -> None:  # noqa: ARG002
        self._stop_requested = True
        if self.acc.is_main_process:
            print(f"[flowrl] SIGTERM: finishing this {self.unit}, writing a checkpoint, then exiting",
                  file=sys.stderr, flush=True)

    # ---------------------------------------------------------------- the loop
    def _begin(self) -> None:
        """Set up if not yet done; SIGTERM then finishes the current step, checkpoints and exits."""
        if not hasattr(self, "acc"):
            self.setup()
        try:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread: the caller handles signals
            pass

    # ---------------------------------------------------------------- the end
    def _report(self, last: int, title: str) -> dict:
        """Main process: ``reward_curve.png``, ``before_after.png`` and the summary fields both trainers
        share (first vs last evaluation, real-data values, skipped steps)."""
        recs = read_metrics(self.run_dir / "metrics.jsonl")
        plot_curves(recs, self.run_dir / "reward_curve.png", title=title)
        evals = sorted((r for r in recs if "eval/reward" in r), key=lambda r: r["iteration"])
        first, final = (evals[0], evals[-1]) if evals else ({}, {})
        before = self.run_dir / "samples" / "eval_000000.png"
        after = self.run_dir / "samples" / f"eval_{final.get('iteration', 0):06d}.png"
        if before.exists() and after.exists():
            side_by_side(before, after, self.run_dir / "before_after.png")
        real = next((r for r in recs if "real/reward" in r), {})
        out = {"stopped_early": self._stop_requested}
        for key, name in (("eval/reward", "eval_reward"), ("eval/diversity", "diversity"), ("eval/hf_energy", "hf_energy"),
                          ("eval/reward_corrected", "eval_reward_corrected")):
            if key in final or key in first:
                out[f"{name}_before"], out[f"{name}_after"] = first.get(key), final.get(key)
        out.update({k: v for k, v in real.items() if k.startswith("real/")})
        out.update({"skipped_steps": self.skipped, "num_processes": self.acc.num_processes, "run_dir": str(self.run_dir)})
        return out

    def _shutdown(self) -> None:
        self.acc.end_training()
        if torch.distributed.is_initialized():  # (also the one-process group of train.sharding=fsdp)
            self.acc.wait_for_everyone()
            torch.distributed.destroy_process_group()  # else gloo/NCCL processes abort at exit


def flush_stats(kept: list[tuple[str, Any]], sums: dict) -> None:
    """Add ``(name, value)`` pairs into ``sums`` in order: floats as they are, 0-dim tensors read in one
    host transfer per (device, dtype), giving the same float64 sums as adding ``float(value)`` one by one."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for _, v in kept:
        if isinstance(v, torch.Tensor):
            groups.setdefault((v.device, v.dtype), []).append(v.detach().reshape(()))
    read = {key: iter(torch.stack(ts).tolist()) for key, ts in groups.items()}
    for k, v in kept:
        val = next(read[(v.device, v.dtype)]) if isinstance(v, torch.Tensor) else float(v)
        sums[k] = sums.get(k, 0.0) + float(val)
