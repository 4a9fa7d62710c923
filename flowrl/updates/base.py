"""The seam between the trainer and one RL method: what an update declares, sees, and gives.

An update says what one call trains on (:meth:`Update.batch` -> :class:`Batch`: the units that carry
signal, how many make a minibatch, the epoch's shuffle and random draws) and gives the loss of one
minibatch with its stats (:meth:`Update.loss`). The trainer owns everything else, in one method
(:meth:`flowrl.trainers.steps.OptimizerSteps.train`): epochs, minibatches, gradient accumulation,
clipping, the optimizer step and the non-finite guard, the same for online and offline training.

Its knobs are its ``Options`` (a dataclass subclassing :class:`UpdateOptions`, set by
``train.loss_options``, built once when the config loads). What it needs is a :class:`Needs` record
computed from those options (:meth:`Update.needs`); config validation (:func:`incompatibility`),
``flowrl plan`` and ``--resume`` read the record, never the update's name.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, ContextManager, Optional

import torch

UNITS = ("transition", "sample", "group", "pair")
DATA_KINDS = {"groups": "offline.dataset", "images": "data.dataset", "pairs": "data.dataset"}  # kind -> its config key


@dataclass(frozen=True)
class Needs:
    """What an update needs (:meth:`Update.needs`), read by config validation, the trainer and ``flowrl plan``."""

    consumes: str = "rollout"         # "rollout": a sampler's rollout per iteration (train.mode online);
    #                                   "dataset": optimizer steps over an offline dataset (train.mode offline)
    transitions: bool = False         # trains on stored stochastic transitions (their log-probs): a sampler that
    #                                   stores none (ode, sol with regen: ode) is refused
    clean_samples: bool = False       # trains on finished samples (x0 + noise drawn per epoch): any sampler
    reference: bool = False           # evaluates the frozen reference model (the trainer keeps one only then)
    reference_in_graph: bool = False  # ... while a training pass's graph is held (plan: activation peak)
    per_reward: bool = False          # normalises each reward apart when reward.aggregate is per_reward
    copies: tuple[str, ...] = ()      # copies of the trained tensors it keeps (old policy, EMA, an adaptive
    #                                   reference), by their key in state_dict(): checkpointed, planned, and a
    #                                   --resume from a checkpoint without them is refused
    unit: str = "transition"          # what train.minibatch_size counts: transition | sample | group | pair
    #                                   (a group: the sampler's samples per prompt; a pair: 2 images)
    rewards: tuple[str, ...] = ()     # reward models it builds and keeps itself (flowrl.rewards names; plan counts them)
    reward_components: tuple[str, ...] = ()  # rewards it reads from each rollout's components: each must be in
    #                                          reward.weights (weight 0: scored and logged, not trained on)
    models: tuple[str, ...] = ()      # other models it builds and keeps ("module:attr" of classes declaring
    #                                   resident_params, e.g. an image-feature model; plan counts them)
    flat_groups: bool = False         # each stored transition must lead to one finished sample (no tree sampler)
    data: str = ""                    # consumes "dataset": which one it reads (DATA_KINDS): "groups", a
    #                                   `flowrl generate-offline` dataset (offline.dataset); "images", images with
    #                                   prompts, or "pairs", preference pairs (data.dataset, flowrl.data.image_sets)
    reward_in_loss: bool = True       # False: the loss reads no reward (on-policy distillation); the rollout is
    #                                   scored for logging and evaluation only (flowrl eval's hacking verdict then
    #                                   counts no reward as trained)
    frozen_models: tuple[tuple[str, Optional[float], bool], ...] = ()  # frozen models it evaluates (on-policy
    #                                   distillation's teachers): (source, guidance or None, offload) each, loaded
    #                                   through UpdateContext.load_frozen (flowrl/trainers/frozen.py); plan counts each

    def __post_init__(self):
        if self.consumes not in ("rollout", "dataset"):
            raise ValueError(f"Needs.consumes must be 'rollout' or 'dataset', got {self.consumes!r}")
        if self.unit not in UNITS:
            raise ValueError(f"Needs.unit must be one of {', '.join(UNITS)}, got {self.unit!r}")
        if self.consumes == "dataset" and self.data not in DATA_KINDS:
            raise ValueError(f"Needs.data must be one of {', '.join(DATA_KINDS)} for an update consuming a dataset, "
                             f"got {self.data!r}")


@dataclass
class UpdateOptions:
    """The options every update takes; an update's ``Options`` subclass this (``train.loss_options``).

    ``moved``: keys recipes took before the update owned them -> the option now (a recipe using one gets an
    error naming the option; a run's saved ``config.yaml`` from before is upgraded)."""

    cfg_uncond_grad: bool = False  # with CFG in a training forward, let the gradient flow through the
    #                                unconditional half too (false: detached, as Flow-GRPO's code)
    moved: ClassVar[dict[str, str]] = {"train.cfg_uncond_grad": "cfg_uncond_grad"}

    def __post_init__(self):
        if not isinstance(self.cfg_uncond_grad, bool):
            raise ValueError(f"train.loss_options.cfg_uncond_grad must be true or false, got {self.cfg_uncond_grad!r}")

    def smoke_overrides(self, scratch) -> dict[str, str]:
        """Dotted config overrides (``key -> YAML value``) a ``flowrl train --smoke`` run adds for this update: models
        its options name that need downloaded weights, replaced by offline ones (``scratch``: a temporary
        directory for files it makes). Default: none."""
        return {}


def moved_keys(options_cls: type) -> dict[str, str]:
    """Every ``moved`` entry of ``options_cls`` and its bases (old key -> option)."""
    out: dict[str, str] = {}
    for c in reversed(options_cls.__mro__):
        out.update(vars(c).get("moved", {}))
    return out


def check_number(options, name: str, *, minimum: float = 0.0, strict: bool = False) -> None:
    """A ``ValueError`` unless option ``name`` is a number ``>= minimum`` (``> minimum`` when ``strict``)."""
    v = getattr(options, name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > minimum if strict else v >= minimum):
        raise ValueError(f"train.loss_options.{name} must be a number {'>' if strict else '>='} {minimum:g}, got {v!r}")


@dataclass
class UpdateContext:
    """What an update may use (built by the trainer once its model is prepared). It holds what the update
    reads, never the training step: the trainer drives epochs, minibatches and optimizer steps."""

    policy: Any                                   # the Policy: velocity(x, sigma, cond), encode_prompts
    unwrapped: torch.nn.Module                    # the trained module unwrapped (its tensors: copies of the policy)
    device: torch.device                          # where training runs
    autocast: Callable[[], ContextManager]        # mixed-precision context for the trained forward
    reference: Callable[[], ContextManager]       # inside it, policy.velocity evaluates the reference model
    gather: Callable[[torch.Tensor], torch.Tensor]  # concatenation over processes (identity on one)
    train: Any                                    # the TrainConfig (seed, minibatch_size, ...)
    reward: Any = None                            # the RewardConfig (aggregate, weights)
    sampler_name: str = ""                        # for error messages
    num_processes: int = 1
    process_index: int = 0
    dataset: Any = None                           # the OfflineDataset a dataset-consuming update reads
    optimizer_steps: Callable[[], int] = lambda: 0  # optimizer steps taken so far (restored on --resume): for a
    #                                               schedule read outside after_step (e.g. in sampling_weights)
    load_frozen: Optional[Callable[[str, Optional[float], bool], Any]] = None  # (source, guidance, offload) -> a
    #                                               frozen policy on the training device (Needs.frozen_models)


@dataclass
class Batch:
    """What one update call trains on (:meth:`Update.batch`); the trainer cuts it into minibatches.

    Per epoch (``train.inner_epochs``) the trainer permutes ``rows`` with a generator seeded by
    ``(shuffle, train.seed, iteration, epoch)`` (``shuffle=None``: the given order), keeps as many as every
    process has, calls ``draws(generator)`` for the epoch's random tensors (after the permutation), and
    splits the rows into minibatches of ``minibatch_size``."""

    rows: torch.Tensor                  # [n] long: ids of the units that carry signal (transitions, samples, groups)
    minibatch_size: int                 # units per minibatch
    shuffle: Optional[str] = "shuffle.update"  # seed purpose of each epoch's permutation (flowrl.seeding.PURPOSES;
    #                                            a new update keeps the default), None: rows in the given order
    draws: Optional[Callable[[torch.Generator], dict]] = None  # an epoch's random tensors (needs a shuffle)
    data: dict = field(default_factory=dict)   # what loss() reads, made once per call (conditioning, advantages, ...)
    stats: dict = field(default_factory=dict)  # figures known before training, logged (trained stats override them)
    info: dict = field(default_factory=dict)   # the advantage info of the call (zero_var_fraction, ...), logged

    def __post_init__(self):
        if self.draws is not None and self.shuffle is None:
            raise ValueError("Batch.draws needs Batch.shuffle: the epoch's random tensors come from its generator")
        if not self.minibatch_size >= 1:
            raise ValueError(f"Batch.minibatch_size must be >= 1, got {self.minibatch_size}")


@dataclass
class Minibatch:
    """One minibatch of a :class:`Batch`, handed to :meth:`Update.loss`."""

    rows: torch.Tensor  # [m] long, a slice of the epoch's order of Batch.rows, on the training device
    index: int          # its position in the epoch (0, 1, ...)
    epoch: int
    draws: dict         # the epoch's random tensors (Batch.draws), indexed by row id


class Update:
    """Base of every update: ``Update(ctx, options)``.

    A subclass sets ``Options`` (a dataclass subclassing :class:`UpdateOptions`, validated in
    ``__post_init__``), :meth:`needs`, :meth:`batch` and :meth:`loss`, and may override the hooks
    (:meth:`after_step`, :meth:`after_update`, :meth:`sampling_weights`) and keep state across calls
    (:meth:`state_dict` / :meth:`load_state_dict`: saved as the checkpoint's ``extra`` tensors).
    """

    Options: ClassVar[type] = UpdateOptions
    # what a user reads about the method (train.loss's help, the bench methods table): one line, its paper
    summary: ClassVar[str] = ""
    # its recipe on the embedded digits model (a shipped recipe's file name) when it needs one of its own (an
    # auxiliary reward, a dataset); None: recipes/digits.yaml with train.loss set to it
    digits_recipe: ClassVar[Optional[str]] = None

    @classmethod
    def needs(cls, options) -> Needs:
        """What the update needs with these options (module doc)."""
        return Needs()

    def __init__(self, ctx: UpdateContext, options: Optional[Any] = None):
        self.ctx = ctx
        self.opts = options if options is not None else self.Options()

    def batch(self, data, it: int) -> Batch:
        """What this call trains on: ``data`` is a rollout (online) or the step's list of ``[groups]`` id
        tensors (offline), ``it`` the iteration (offline: the optimizer step). Runs before any optimizer
        step of the call, in eval mode: the place for no-grad passes under the sampling weights."""
        raise NotImplementedError

    def loss(self, batch: Batch, mb: Minibatch) -> tuple[torch.Tensor, dict]:
        """The loss of one minibatch (a 0-dim tensor; the trainer divides it by the accumulation group's
        size) and its stats (floats or detached 0-dim tensors, averaged over the finite minibatches)."""
        raise NotImplementedError

    def after_step(self, optimizer_steps: int) -> None:
        """After every optimizer step (taken or skipped), with the count of steps taken so far."""

    def after_update(self, batch: Batch, trained: int, optimizer_steps: int) -> dict:
        """Stats to log once the call's steps are done; ``trained``: units trained, summed over epochs."""
        return {}

    def sampling_weights(self) -> ContextManager:
        """Inside it, the rollout samples (default: the policy's own weights; e.g. an EMA copy's)."""
        return contextlib.nullcontext()

    def state_dict(self) -> dict:
        """Tensors to checkpoint (name -> {key: tensor}); every name of ``needs().copies`` among them."""
        return {}

    def load_state_dict(self, extra: dict) -> None:
        """Restore what :meth:`state_dict` saved (``extra``: the checkpoint's extra tensors)."""

    def scalar_state(self) -> dict:
        """JSON values to checkpoint beside the trainer's counters (an adaptive gate's state, the iteration of
        the last reference refresh); floats survive exactly. Default: none."""
        return {}

    def load_scalar_state(self, state: dict) -> None:
        """Restore what :meth:`scalar_state` saved (empty for a checkpoint without any)."""


def build_options(cls: type, loss: str, given: Optional[dict], where: str = "train.loss_options") -> Any:
    """The ``Options`` of update class ``cls`` (``train.loss=loss``) from ``given`` (``train.loss_options``).
    An unknown key is a ``ValueError`` naming it (and the closest valid one); the dataclass checks values."""
    valid = [f.name for f in dataclasses.fields(cls.Options)]
    given = dict(given or {})
    for k in given:
        if k not in valid:
            close = difflib.get_close_matches(k, valid, n=1)
            hint = f" Did you mean {where}.{close[0]}?" if close else ""
            raise ValueError(f"{where}.{k}: not an option of train.loss={loss!r}.{hint} "
                             f"Valid: {', '.join(valid) or '(none)'} (the options belong to the loss: after changing "
                             f"train.loss, set its own, e.g. {where}={{}} for its defaults)")
    return cls.Options(**given)


def _either(names: list[str]) -> str:
    """``a, b or c``."""
    return " or ".join(filter(None, [", ".join(names[:-1]), names[-1] if names else ""]))


def incompatibility(needs: Needs, loss: str, *, mode: str, sampler: str, stores_transitions: bool, aggregate: str,
                    inner_epochs: int, alternatives: dict[str, list[str]],
                    rewards: Optional[tuple[str, ...]] = None, flat_groups: bool = True) -> Optional[str]:
    """Why an update with ``needs`` (``train.loss=loss``) cannot run with these settings, in one line with
    the fix, or None. ``alternatives``: update names by need (:func:`flowrl.updates.updates_by_input`);
    ``rewards``: the names of ``reward.weights`` (None: a reward object, not checked); ``flat_groups``: False for
    a sampler whose transitions branch into trees (its class's ``flat_groups``)."""
    others = lambda kind: ", ".join(n for n in alternatives.get(kind, []) if n != loss)  # noqa: E731
    on_samples = [n for n in alternatives.get("samples", []) if n != loss]
    if needs.consumes == "dataset" and mode != "offline":
        made = " from `flowrl generate-offline`" if needs.data == "groups" else ""
        return (f"train.loss={loss} trains on a dataset{made}: set train.mode=offline (and {DATA_KINDS[needs.data]}), "
                f"or choose an online loss ({others('rollout')})")
    if needs.consumes == "rollout" and mode == "offline":
        return (f"train.mode=offline trains on a dataset, and train.loss={loss} trains on rollouts: use "
                f"train.loss={others('dataset')} (or train.mode=online)")
    if mode == "online" and needs.transitions and not stores_transitions:
        return (f"the {sampler!r} sampler (as configured) stores no stochastic transitions, so train.loss={loss} would "
                f"have nothing to train on; use train.loss={_either(on_samples)} (they train on finished samples), or a "
                f"stochastic sampler (group, branch, tempflow, sol with regen: group)")
    if needs.flat_groups and not flat_groups:
        return (f"train.loss={loss} trains on flat groups (each stored transition leads to one finished sample), and "
                f"the {sampler!r} sampler branches into trees; use sampler.name=group (or sol with regen: group), or "
                f"train.loss={_either(on_samples)} (they train on finished samples)")
    missing = [n for n in needs.reward_components if rewards is not None and n not in rewards]
    if missing:
        return (f"train.loss={loss} reads reward {missing[0]!r} of every rollout, which reward.weights does not score; "
                f"add it there with weight 0 (scored and logged, not trained on), e.g. "
                f"reward.weights.{missing[0]}=0.0, or change train.loss_options")
    if aggregate == "per_reward" and not needs.per_reward:
        return (f"reward.aggregate=per_reward has no effect with train.loss={loss}, which trains on the weighted "
                f"sum of the rewards; set reward.aggregate=sum")
    if mode == "offline" and inner_epochs != 1:
        return (f"train.inner_epochs={inner_epochs} has no effect in offline mode (a step makes one pass over its "
                f"groups; offline.epochs counts passes over the dataset); set train.inner_epochs=1")
    return None
