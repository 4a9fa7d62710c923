"""What an update sees, and the one epoch / minibatch / accumulation skeleton every update shares.

The trainer hands an update an :class:`UpdateContext` (the policy, the trained module, the device,
autocast, the reference, the gradient-accumulation callable, the optimizer step counter, the train
config) and never anything else: an update does not touch trainer state. An update is a class with
an ``Options`` dataclass (its own knobs, ``train.loss_options``) and
``__call__(rollout, iteration) -> (stats, advantage info)``; :func:`train_epochs` is its loop.

An update also declares what it needs (class attributes of :class:`Update`: what it consumes,
stored transitions, a KL term, the reference, per-reward statistics); config validation reads them
(:func:`incompatibility`) and refuses a combination the update cannot run before any model loads.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, ContextManager, Optional

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
    dataset: Any = None                           # the OfflineDataset a dataset-consuming update reads


class Update:
    """Base of every update: ``Update(ctx, options)``; ``__call__(rollout, it) -> (stats, info)``.

    Subclasses set ``Options`` (a dataclass validated in ``__post_init__``: the update's knobs,
    ``train.loss_options``) and the declarations below, and may keep state across iterations;
    :meth:`state_dict` / :meth:`load_state_dict` carry it through checkpoints (saved as the
    checkpoint's ``extra`` tensors).
    """

    @dataclass
    class Options:
        pass

    # what the update needs (read by config validation, :func:`incompatibility`)
    consumes: ClassVar[str] = "rollout"         # "rollout": a sampler's rollout per iteration (train.mode online);
    #                                             "dataset": optimizer steps over an offline dataset (train.mode offline)
    needs_transitions: ClassVar[bool] = False   # trains on stored stochastic transitions (their log-probs)
    kl_term: ClassVar[bool] = False             # adds train.beta_kl x a KL to the reference
    per_reward: ClassVar[bool] = False          # normalises each reward apart (reward.aggregate: per_reward)
    keeps_old_policy: ClassVar[bool] = False    # keeps its own decayed copy of the trained tensors (checkpointed)

    @classmethod
    def needs_reference(cls, train) -> bool:
        """Whether the update evaluates the frozen reference (the trainer keeps one only then)."""
        return cls.kl_term and train.beta_kl > 0

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
    """The ``Options`` of update class ``cls`` from a TrainConfig's ``train.loss_options``. An unknown key
    is a ``ValueError`` naming it (and the closest valid one); the dataclass checks the values."""
    valid = [f.name for f in dataclasses.fields(cls.Options)]
    given = dict(getattr(train, "loss_options", None) or {})
    for k in given:
        if k not in valid:
            close = difflib.get_close_matches(k, valid, n=1)
            hint = f" Did you mean {where}.{close[0]}?" if close else ""
            raise ValueError(f"{where}.{k}: not an option of train.loss={train.loss!r}.{hint} "
                             f"Valid: {', '.join(valid) or '(none)'} (the options belong to the loss: after changing "
                             f"train.loss, set its own, e.g. {where}={{}} for its defaults)")
    return cls.Options(**given)


def incompatibility(cls: type, loss: str, *, mode: str, sampler: str, stores_transitions: bool, beta_kl: float,
                    aggregate: str, inner_epochs: int, alternatives: dict[str, list[str]]) -> Optional[str]:
    """Why update class ``cls`` (``train.loss=loss``) cannot run with these settings, in one line with the
    fix, or None. ``alternatives``: update names by what they consume (``rollout``, ``dataset``)."""
    others = lambda kind: ", ".join(n for n in alternatives.get(kind, []) if n != loss)  # noqa: E731
    if cls.consumes == "dataset" and mode != "offline":
        return (f"train.loss={loss} trains on a dataset from `flowrl generate-offline`: set train.mode=offline "
                f"(and offline.dataset), or choose an online loss ({others('rollout')})")
    if cls.consumes == "rollout" and mode == "offline":
        return (f"train.mode=offline trains on a dataset, and train.loss={loss} trains on rollouts: use "
                f"train.loss={others('dataset')} (or train.mode=online)")
    if mode == "online" and cls.needs_transitions and not stores_transitions:
        return (f"the {sampler!r} sampler (as configured) stores no stochastic transitions, so train.loss={loss} would "
                f"have nothing to train on; use train.loss=nft, dpo or gdro (they train on finished samples), or a "
                f"stochastic sampler (group, branch, tempflow, sol with regen: group)")
    if beta_kl > 0 and not cls.kl_term:
        return (f"train.beta_kl={beta_kl} has no effect with train.loss={loss}, which has no KL term (its implicit "
                f"reward already compares with the reference); set train.beta_kl=0")
    if aggregate == "per_reward" and not cls.per_reward:
        return (f"reward.aggregate=per_reward has no effect with train.loss={loss}, which trains on the weighted "
                f"sum of the rewards; set reward.aggregate=sum")
    if mode == "offline" and inner_epochs != 1:
        return (f"train.inner_epochs={inner_epochs} has no effect in offline mode (a step makes one pass over its "
                f"groups; offline.epochs counts passes over the dataset); set train.inner_epochs=1")
    return None


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
