"""The update loop of both trainers: epochs, minibatches, gradient accumulation, clipping and the optimizer
step, in one method (:meth:`OptimizerSteps.train`), the same for every update, online and offline.

An update (:mod:`flowrl.updates.base`) says what one call trains on (a :class:`~flowrl.updates.base.Batch`)
and gives the loss of one minibatch; this module does the rest. A group of minibatches whose loss or
gradient norm is not finite on some process skips its optimizer step on every process (its gradients are
dropped); ``train.max_consecutive_skips`` skips in a row stop training (:class:`TrainingStopped`).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..seeding import stream_seed
from ..updates.base import Batch, Minibatch, Update


class TrainingStopped(RuntimeError):
    """Training stopped on purpose (too many non-finite steps); the message says why."""


class OptimizerSteps:
    """The optimizer steps of one run, and their counters.

    ``OptimizerSteps(acc, strategy, model, unwrapped, optimizer, ema, train, stop_causes)``: ``model`` is
    the prepared module (DDP-wrapped or sharded), ``unwrapped`` the module itself (its trained tensors
    are stepped and clipped; the EMA reads them), ``ema`` an EMA object or None (updated every
    ``train.ema_every`` steps), ``stop_causes`` the likely causes of non-finite steps for the stop
    message. ``opt_steps`` / ``skipped`` / ``consecutive_skips`` count steps taken and skipped
    (checkpointed through :meth:`state_dict`). The learning-rate scheduler steps once per unit, in the
    trainer.
    """

    def __init__(self, acc, strategy, model: torch.nn.Module, unwrapped: torch.nn.Module, optimizer, ema, train,
                 stop_causes: str = "") -> None:
        self.acc, self.strategy, self.model, self.unwrapped = acc, strategy, model, unwrapped
        self.params = [p for p in unwrapped.parameters() if p.requires_grad]
        self.optimizer, self.ema, self.train_cfg, self.stop_causes = optimizer, ema, train, stop_causes
        self.opt_steps = self.skipped = self.consecutive_skips = 0

    def state_dict(self) -> dict:
        return {"opt_steps": self.opt_steps, "skipped": self.skipped, "consecutive_skips": self.consecutive_skips}

    def load_state_dict(self, st: dict) -> None:
        self.opt_steps, self.skipped = int(st["opt_steps"]), int(st["skipped"])
        self.consecutive_skips = int(st["consecutive_skips"])

    # ---------------------------------------------------------------- the loop
    def train(self, update: Update, batch: Batch, iteration: int) -> tuple[dict, int]:
        """One update call on ``batch``: ``train.inner_epochs`` epochs, read top to bottom.

        Per epoch the rows are permuted by a generator seeded from ``(batch.shuffle, train.seed, iteration,
        epoch)``, cut to the count every process has, and split into minibatches of
        ``batch.minibatch_size``; the epoch's random tensors (``batch.draws``) come from the same generator.
        Every ``train.grad_accum`` consecutive minibatches make one optimizer step: forward and backward of
        each (its loss divided by the group's size; DDP syncs gradients on the group's last), clip, then
        step if every loss and the gradient norm are finite on every process (else skip, dropping the
        gradients), then ``update.after_step``. Host syncs: one read per optimizer step (step or skip);
        stats stay on the device until the end.

        Returns (each stat averaged over the finite minibatches that gave it, ``grad_norm`` over every
        minibatch; units trained, summed over epochs)."""
        cfg = self.train_cfg
        n = self.fewest(len(batch.rows))  # DDP: every process runs as many minibatches
        kept: list[tuple[str, Any]] = []  # (name, float or 0-dim tensor) of the finite minibatches, in order
        counts: dict[str, int] = {}  # contributions per name
        self.model.train()
        for epoch in range(cfg.inner_epochs):
            gen = torch.Generator().manual_seed(stream_seed(batch.shuffle, cfg.seed, iteration, epoch)) \
                if batch.shuffle else None
            order = batch.rows if gen is None else batch.rows[torch.randperm(len(batch.rows), generator=gen)]
            order = order[:n].to(self.acc.device)  # [n] ids, one copy per epoch
            draws = batch.draws(gen) if batch.draws is not None else {}
            minibatches = list(order.split(batch.minibatch_size)) if n else []  # no signal: no step
            for first in range(0, len(minibatches), cfg.grad_accum):  # one optimizer step per group
                group = minibatches[first:first + cfg.grad_accum]
                finite, group_stats = [], []
                for j, rows in enumerate(group):
                    sync = j == len(group) - 1 or self.acc.num_processes == 1
                    with contextlib.nullcontext() if sync else self.acc.no_sync(self.model):
                        loss, stats = update.loss(batch, Minibatch(rows, first + j, epoch, draws))
                        finite.append(torch.isfinite(loss.detach()))  # 0-dim bool, on the device
                        self.acc.backward(loss / len(group))  # non-finite: the group's step is skipped below
                    group_stats.append({**stats, "loss": loss.detach()})
                losses_ok = torch.stack(finite)  # [len(group)]
                norm = self.strategy.clip(self.params, cfg.max_grad_norm, losses_ok.device)  # 0-dim, before clipping
                flags, ok = self.all_finite(losses_ok, norm)  # the one host read of the step
                self.step() if ok else self.skip()
                self.optimizer.zero_grad(set_to_none=True)
                for good, st in zip(flags, group_stats):
                    if good:
                        kept.extend(st.items())
                        for k in st:
                            counts[k] = counts.get(k, 0) + 1
                norm = torch.where(losses_ok.all(), norm, torch.full_like(norm, float("nan")))
                kept.append(("grad_norm", norm * len(group)))
                counts["grad_norm"] = counts.get("grad_norm", 0) + len(group)
                update.after_step(self.opt_steps)
        self.model.eval()
        sums: dict[str, float] = {}
        flush_stats(kept, sums)
        return {k: v / counts[k] for k, v in sums.items()}, n * cfg.inner_epochs

    # ---------------------------------------------------------------- its parts
    def fewest(self, n: int) -> int:
        """The smallest ``n`` over processes (DDP: every process runs as many backward passes)."""
        if self.acc.num_processes == 1:
            return n
        return int(self.acc.gather(torch.tensor([n], device=self.acc.device)).min().item())

    def all_finite(self, losses_ok: torch.Tensor, norm: torch.Tensor) -> tuple[list[bool], bool]:
        """(per-minibatch loss flags, whether every loss of the group (``losses_ok`` [G] bool) and the
        gradient norm are finite on every process); one host read."""
        ok = losses_ok.all() & torch.isfinite(norm)
        ok = ok.to(self.acc.device, torch.float32).reshape(1)
        if self.acc.num_processes > 1:  # a device-side reduction
            ok = self.acc.reduce(ok, reduction="sum") / self.acc.num_processes
        ok = ok[0] == 1.0
        read = torch.cat([losses_ok.float(), ok.float().reshape(1).to(losses_ok.device)]).tolist()  # the one sync
        return [v == 1.0 for v in read[:-1]], read[-1] == 1.0

    def step(self) -> None:
        """The optimizer step, and the EMA every ``train.ema_every`` steps."""
        self.optimizer.step()
        self.opt_steps += 1
        self.consecutive_skips = 0
        if self.ema is not None and self.opt_steps % self.train_cfg.ema_every == 0:
            self.ema.update(self.unwrapped)

    def skip(self) -> None:
        """Count a skipped step (fp16 loss scaling: the GradScaler records it and lowers its scale), and stop
        after ``train.max_consecutive_skips`` in a row."""
        scaler = getattr(self.acc, "scaler", None)
        if scaler is not None:
            scaler.update()
        self.skipped += 1
        self.consecutive_skips += 1
        if self.consecutive_skips >= self.train_cfg.max_consecutive_skips:
            cfg = self.train_cfg
            raise TrainingStopped(
                f"{self.consecutive_skips} optimizer steps in a row had a non-finite loss or gradient, so training "
                f"stopped (weights are as of the last good step; the last checkpoint is intact). Causes: "
                f"{self.stop_causes}a learning rate too high (train.lr={cfg.lr}), or fp16 overflow "
                f"(train.mixed_precision={cfg.mixed_precision}).")


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
