"""Optimizer steps with gradient accumulation and the non-finite guard (both trainers, every update).

:class:`OptimizerSteps` is what an update's ``UpdateContext.accumulate`` calls: forward/backward over a
list of passes in groups of ``train.grad_accum``, one guarded optimizer step per group. A group whose
loss or gradient norm is not finite on some process skips its step on every process (its gradients
are dropped); ``train.max_consecutive_skips`` skips in a row stop training (:class:`TrainingStopped`).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch


class TrainingStopped(RuntimeError):
    """Training stopped on purpose (too many non-finite steps); the message says why."""


class OptimizerSteps:
    """Guarded optimizer steps of one run, and their counters.

    ``OptimizerSteps(acc, strategy, model, unwrapped, optimizer, ema, train, stop_causes)``: ``model`` is
    the prepared module (DDP-wrapped or sharded), ``unwrapped`` the module itself (its trained tensors
    are stepped and clipped; the EMA reads them), ``ema`` an EMA object or None (updated every
    ``train.ema_every`` steps), ``stop_causes`` the likely causes of non-finite steps for the stop
    message. ``opt_steps`` / ``skipped`` / ``consecutive_skips`` count steps taken and skipped
    (checkpointed through :meth:`state_dict`). The learning-rate scheduler steps once per iteration,
    in the trainer.
    """

    def __init__(self, acc, strategy, model: torch.nn.Module, unwrapped: torch.nn.Module, optimizer, ema, train,
                 stop_causes: str = "") -> None:
        self.acc, self.strategy, self.model, self.unwrapped = acc, strategy, model, unwrapped
        self.params = [p for p in unwrapped.parameters() if p.requires_grad]
        self.optimizer, self.ema, self.train, self.stop_causes = optimizer, ema, train, stop_causes
        self.opt_steps = self.skipped = self.consecutive_skips = 0

    def state_dict(self) -> dict:
        return {"opt_steps": self.opt_steps, "skipped": self.skipped, "consecutive_skips": self.consecutive_skips}

    def load_state_dict(self, st: dict) -> None:
        self.opt_steps, self.skipped = int(st["opt_steps"]), int(st["skipped"])
        self.consecutive_skips = int(st["consecutive_skips"])

    def finite_everywhere(self, ok: torch.Tensor) -> torch.Tensor:
        """0-dim bool tensor: ``ok`` holds on every process (a device-side reduction, no host read)."""
        ok = ok.to(self.acc.device, torch.float32).reshape(1)
        if self.acc.num_processes > 1:
            ok = self.acc.reduce(ok, reduction="sum") / self.acc.num_processes
        return ok[0] == 1.0

    def accumulate(self, passes: list, loss_of: Callable[[Any], tuple[torch.Tensor, dict]], sums: dict,
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
        count, ga = 0, self.train.grad_accum
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
            flags, norm = self.guarded_step(torch.stack(oks))
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

    def guarded_step(self, loss_ok: torch.Tensor) -> tuple[list[bool], torch.Tensor]:
        """Clip (the strategy's clip), then step if every loss of the group (``loss_ok`` [G] bool) and the
        gradient norm are finite on every process, else skip (:meth:`take_step`); one host read. Returns
        the per-pass flags and the norm (NaN when a loss was not finite), a 0-dim tensor."""
        norm = self.strategy.clip(self.params, self.train.max_grad_norm, loss_ok.device)
        losses_ok = loss_ok.all()
        ok = self.finite_everywhere(losses_ok & torch.isfinite(norm))
        read = torch.cat([loss_ok.float(), ok.float().reshape(1).to(loss_ok.device)]).tolist()  # the one sync
        self.take_step(read[-1] == 1.0, scaler_update_only=True)
        norm = torch.where(losses_ok, norm, torch.full_like(norm, float("nan")))
        return [v == 1.0 for v in read[:-1]], norm

    def take_step(self, ok: bool, scaler_update_only: bool, unscaled: bool = True) -> None:
        """Step (``ok``) or count a skipped step, stopping after ``train.max_consecutive_skips`` in a
        row; then zero the gradients. On a skip with fp16 loss scaling and unscaled gradients, the
        GradScaler records it: ``scaler_update_only`` updates the scale without stepping, else the
        optimizer's step runs through the scaler, which skips it on the inf it sees."""
        if ok:
            self.optimizer.step()
            self.opt_steps += 1
            self.consecutive_skips = 0
            if self.ema is not None and self.opt_steps % self.train.ema_every == 0:
                self.ema.update(self.unwrapped)
        else:
            scaler = getattr(self.acc, "scaler", None)
            if unscaled and scaler is not None:
                if scaler_update_only:
                    scaler.update()  # records the skip (lowers the scale if the gradients overflowed)
                else:
                    self.optimizer.step()  # fp16: the GradScaler sees the inf, skips the update and lowers its scale
            self.skipped += 1
            self.consecutive_skips += 1
            if self.consecutive_skips >= self.train.max_consecutive_skips:
                raise TrainingStopped(
                    f"{self.consecutive_skips} optimizer steps in a row had a non-finite loss or gradient, so training "
                    f"stopped (weights are as of the last good step; the last checkpoint is intact). Causes: "
                    f"{self.stop_causes}a learning rate too high (train.lr={self.train.lr}), or fp16 overflow "
                    f"(train.mixed_precision={self.train.mixed_precision}).")
        self.optimizer.zero_grad(set_to_none=True)


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
