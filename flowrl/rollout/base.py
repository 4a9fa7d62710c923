"""What every sampler returns: a flat set of stochastic transitions plus the finished samples.

docs/design.md: each method differs only in how its sampler fills these tensors and how
``flowrl.advantages`` turns rewards + structure into one advantage per transition; the
GRPO-family update needs nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Annotated, Optional

import torch

from ..conditions import encode_conditions
from ..options import AtLeast
from ..structures import GroupStructure, Structure


GroupSize = Annotated[int, AtLeast(2, why="a group of one has no advantage signal")]  # samples compared per prompt


@dataclass
class Transitions:
    """M stored stochastic transitions ``latents -> next_latents`` (the trained ones).

    The float fields stay where the sampler made them (the policy's device: no copy to the host
    per step, none back per minibatch); the long index fields are small host-side metadata for
    the advantage functions. :meth:`to` moves everything to one device (the trainer does, once
    per update).
    """

    latents: torch.Tensor        # [M, C, H, W] float32, x at sigma
    next_latents: torch.Tensor   # [M, C, H, W] float32, the sampled x at sigma_next
    sigma: torch.Tensor          # [M] float32
    sigma_next: torch.Tensor     # [M] float32
    prompt_index: torch.Tensor   # [M] long, row of Rollout.prompts
    sample_index: torch.Tensor   # [M] long, finished sample this transition leads to (-1: several)
    step: torch.Tensor           # [M] long, step index i of sigma_i
    old_log_prob: torch.Tensor   # [M] float32, log-prob under the sampling policy (see flowrl.sde)
    weight: torch.Tensor         # [M] float32, per-transition loss weight (noise-aware, else 1)

    def __len__(self) -> int:
        return self.latents.shape[0]

    def select(self, index: torch.Tensor) -> "Transitions":
        """Rows ``index`` [K] of every field (the index is moved once per device the fields live on)."""
        on: dict[torch.device, torch.Tensor] = {}
        out = {}
        for f in fields(self):
            t = getattr(self, f.name)
            if t.device not in on:
                on[t.device] = index.to(t.device)
            out[f.name] = t[on[t.device]]
        return Transitions(**out)

    def to(self, device: torch.device | str) -> "Transitions":
        """Every field on ``device`` (fields already there are shared, not copied)."""
        return Transitions(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    @staticmethod
    def concat(parts: list["Transitions"]) -> "Transitions":
        return Transitions(**{f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in fields(Transitions)})

    @staticmethod
    def empty(latent_shape: tuple[int, ...]) -> "Transitions":
        z = torch.zeros(0)
        zl = torch.zeros(0, dtype=torch.long)
        return Transitions(torch.zeros((0, *latent_shape)), torch.zeros((0, *latent_shape)), z, z.clone(),
                           zl, zl.clone(), zl.clone(), z.clone(), z.clone())


@dataclass
class Rollout:
    """Finished samples, their rewards, and the transitions to train on.

    ``layout`` is the typed structure record (:mod:`flowrl.structures`): what the advantage
    function needs beyond the common fields (tree links for BranchGRPO, ...); its ``name``,
    also ``rollout.structure``, keys ``flowrl.advantages.ADVANTAGES``.

    Devices: ``x0``, ``cond`` and the transitions' float fields may live on the policy's device
    (a GPU); ``images``, ``rewards``, the index tensors and ``layout`` are on the CPU.
    """

    prompts: list                      # the P distinct prompts (str, or PromptItem with a source image)
    prompt_index: torch.Tensor         # [N] long, prompt of each finished sample
    seeds: torch.Tensor                # [N] long, seed of each sample's initial noise
    group_index: torch.Tensor          # [N] long, advantage-normalisation group
    x0: torch.Tensor                   # [N, C, H, W] final latents
    images: torch.Tensor               # [N, 3, H, W] in [0, 1]
    rewards: torch.Tensor              # [N] float32 (weighted total when several rewards)
    transitions: Transitions           # M trained transitions
    sigmas: torch.Tensor               # [T + 1] schedule used
    step_type: str                     # name in flowrl.sde.STEPS used for the stored transitions
    noise_level: float
    layout: Structure = field(default_factory=GroupStructure)  # the structure record
    reward_components: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [N]
    stats: dict[str, float] = field(default_factory=dict)  # model_evals, seconds, ...
    # the sampler's text conditioning of ``prompts`` (batch-first [P, ...]); None: not kept
    cond: Optional[dict[str, torch.Tensor]] = None

    @property
    def structure(self) -> str:
        """Key of ``flowrl.advantages.ADVANTAGES`` for this rollout (``layout.name``)."""
        return self.layout.name

    @property
    def num_samples(self) -> int:
        return self.x0.shape[0]

    def conditioning(self, policy) -> dict[str, torch.Tensor]:
        """Conditioning of ``prompts`` [P, ...]: the one the rollout was sampled with (no second
        ``encode_prompts``), or :func:`flowrl.conditions.encode_conditions` of them when it kept none."""
        if self.cond is not None:
            return dict(self.cond)
        with torch.no_grad():
            return dict(encode_conditions(policy, self.prompts))


@dataclass(frozen=True)
class Exploration:
    """A pass a sampler makes before the rollout it trains on (Sol-RL's quantized exploration), as ``flowrl
    plan`` counts it: ``seeds`` samples per process and iteration, ``rows`` latent rows per velocity call, by
    a copy of the transformer quantized with ``backend`` (a ``flowrl.quant`` spec) and its ``options``."""

    seeds: int
    rows: int
    backend: str
    options: dict


class SamplerDeclarations:
    """What the rest of flowrl asks a sampler besides sampling (``flowrl train --smoke``, ``flowrl plan``),
    with the defaults of a flat sampler; every registered sampler inherits it and overrides what differs.
    A sampler's options are its dataclass fields (types and ranges declared on them, checked when the config
    loads: :mod:`flowrl.options`)."""

    def smoke_options(self) -> dict:
        """``{option: value}`` (dotted for a nested option: ``regen_options.num_steps``) that shrink this
        sampler, as configured, for ``flowrl train --smoke``: a few steps, 2 samples per prompt (``train.batch_size``
        4 stays a multiple), every chunk in one call."""
        raise NotImplementedError(f"{type(self).__name__} declares no smoke_options (flowrl/rollout/base.py)")

    def forward_rows_option(self, batch_size: int) -> tuple[str, int]:
        """``(option, rows)``: the option that caps the rows of one sampling forward, and the rows it gives now
        for ``batch_size`` samples per process (``flowrl plan --suggest`` halves it)."""
        return "max_batch", int(getattr(self, "max_batch", None) or batch_size)

    def exploration(self, batch_size: int) -> Optional[Exploration]:
        """The pass before the trained rollout for ``batch_size`` trained samples per process, or None."""
        return None

    @property
    def trained_sampler(self):
        """The sampler whose rollout is trained on (its transitions, steps and chunks): itself, or Sol-RL's
        regeneration sampler."""
        return self
