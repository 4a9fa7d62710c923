"""What an update sees, and the one epoch / minibatch / accumulation skeleton every update shares.

The trainer hands an update an :class:`UpdateContext` (the policy, the trained module, the device,
autocast, the reference, the gradient-accumulation callable, the optimizer step counter, the train
config) and never anything else: an update does not touch trainer state. An update is a class with
an ``Options`` dataclass (its own knobs, ``train.loss_options``) and
``__call__(rollout, iteration) -> (stats, advantage info)``; :func:`train_epochs` is its loop.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional

import torch


@dataclass
class UpdateContext:
    """Everything an update may use (built by the trainer once its model is prepared)."""

    policy: Any                                   # the Policy: velocity(x, sigma, cond), encode_prompts
    model: torch.nn.Module                        # the prepared (maybe DDP-wrapped) trained module
    unwrapped: torch.nn.Module                    # the same module unwrapped (its tensors: old policy copies)
    device: torch.device                          # where training runs
    autocast: Callable[[], ContextManager]        # mixed-precision context for the trained forward
    reference: Callable[[], ContextManager]       # inside it, policy.velocity evaluates the reference model
    gather: Callable[[torch.Tensor], torch.Tensor]  # concatenation over processes (identity on one)
    min_over_processes: Callable[[int], int]      # the smallest of an int over processes (DDP: equal pass counts)
    accumulate: Callable[..., int]                # OptimizerSteps.accumulate(passes, loss_of, sums, after_step, counts)
    optimizer_steps: Callable[[], int]            # optimizer steps taken so far
    train: Any                                    # the TrainConfig (seed, minibatch_size, inner_epochs, ...)
    reward: Any = None                            # the RewardConfig (aggregate, weights), when the update needs it
    sampler_name: str = ""                        # for error messages
    num_processes: int = 1
    process_index: int = 0


class Update:
    """Base of every update: ``Update(ctx, options)``; ``__call__(rollout, it) -> (stats, info)``.

    Subclasses set ``Options`` (a dataclass validated in ``__post_init__``) and may keep state
    across iterations; :meth:`state_dict` / :meth:`load_state_dict` carry it through checkpoints
    (saved as the checkpoint's ``extra`` tensors).
    """

    @dataclass
    class Options:
        pass

    # top-level train.* keys that feed an option of this update (kept for old recipes): {train key: option}
    ALIASES: dict = {}

    def __init__(self, ctx: UpdateContext, options: Optional[Any] = None):
        self.ctx = ctx
        self.opts = options if options is not None else self.Options()

    def __call__(self, rollout, it: int) -> tuple[dict, dict]:
        raise NotImplementedError

    def state_dict(self) -> dict:
        """Tensors to checkpoint (name -> {key: tensor}); empty: nothing."""
        return {}

    def load_state_dict(self, extra: dict) -> None:
        """Restore what :meth:`state_dict` saved (``extra``: the checkpoint's extra tensors)."""


def build_options(cls: type, train, where: str = "train.loss_options") -> Any:
    """The ``Options`` of update class ``cls`` from a TrainConfig: each alias key (``train.nft_beta``,
    ...) feeds its option, then ``train.loss_options`` overrides. An unknown key, or an alias and
    an option set to different values, is a ``ValueError`` naming the key."""
    opts_cls = cls.Options
    valid = [f.name for f in dataclasses.fields(opts_cls)]
    given = dict(getattr(train, "loss_options", None) or {})
    for k in given:
        if k not in valid:
            close = difflib.get_close_matches(k, valid, n=1)
            hint = f" Did you mean {where}.{close[0]}?" if close else ""
            raise ValueError(f"{where}.{k}: not an option of train.loss={train.loss!r}.{hint} "
                             f"Valid: {', '.join(valid) or '(none)'}")
    kw = {}
    defaults = {f.name: f.default for f in dataclasses.fields(type(train))}
    for key, opt in cls.ALIASES.items():
        v = getattr(train, key)
        if opt in given and v != defaults.get(key) and v != given[opt]:
            raise ValueError(f"train.{key}={v!r} and {where}.{opt}={given[opt]!r} set the same option; keep one")
        kw[opt] = v
    kw.update(given)
    return opts_cls(**kw)


def average(sums: dict, count: int, counts: Optional[dict] = None) -> dict:
    """``sums`` averaged: over ``count`` passes, or per key over ``counts[key]`` passes."""
    if counts is not None:
        return {k: v / counts[k] for k, v in sums.items() if counts.get(k)}
    return {k: v / count for k, v in sums.items()} if count else {}


def train_epochs(ctx: UpdateContext, items: torch.Tensor, *, seed_of_epoch: Callable[[int], int], pass_size: int,
                 loss_of: Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]],
                 draws: Optional[Callable[[torch.Generator], dict]] = None, limit: Optional[int] = None,
                 after_step: Optional[Callable[[], None]] = None) -> tuple[dict, int]:
    """The shared loop: ``train.inner_epochs`` epochs over ``items`` [n] (row ids).

    Per epoch: a generator seeded by ``seed_of_epoch(epoch)`` permutes ``items`` (first ``limit``
    kept), then ``draws(generator)`` makes the epoch's random tensors (in that order, so seeds keep
    their values), the permutation is split into passes of ``pass_size`` and handed to
    ``ctx.accumulate`` with ``loss_of(pass_rows, draws)``. Runs in train mode. Returns (stats
    averaged over the finite passes, passes counted).
    """
    sums: dict[str, float] = {}
    count = 0
    n = len(items) if limit is None else limit
    ctx.model.train()
    for epoch in range(ctx.train.inner_epochs):
        g = torch.Generator().manual_seed(int(seed_of_epoch(epoch)))
        rows = items[torch.randperm(len(items), generator=g)][:n].to(ctx.device)  # one copy per epoch
        extra = draws(g) if draws is not None else {}
        passes = list(rows.split(pass_size)) if n else []  # no signal: no update
        count += ctx.accumulate(passes, lambda mb, extra=extra: loss_of(mb, extra), sums, after_step)
    ctx.model.eval()
    return average(sums, count), count


def train_passes(ctx: UpdateContext, passes: list, loss_of: Callable[[Any], tuple[torch.Tensor, dict]],
                 after_step: Optional[Callable[[], None]] = None) -> dict:
    """One optimizer-step group of prebuilt ``passes`` (the offline step), in train mode -> stats, each
    averaged over the finite passes that produced it (per key; ``grad_norm``: the step's norm)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    ctx.model.train()
    ctx.accumulate(passes, loss_of, sums, after_step, counts)
    ctx.model.eval()
    return average(sums, 0, counts)
