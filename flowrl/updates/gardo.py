"""GARDO on GRPO (``train.loss: gardo_grpo``) and on DiffusionNFT (``train.loss: gardo_nft``): He et al.,
"GARDO", arXiv 2512.24138 (code tinnerhrhe/GARDO); the math is :mod:`flowrl.losses.gardo`, docs/algorithms.md §14.

Each wraps its base update (subclass, no copy) with three parts:

1. **Gated KL.** Over the whole (gathered) batch, the rank disagreement between the trained reward and the
   auxiliary rewards ``aux_rewards`` (read from the rollout's reward components: list them in
   ``reward.weights`` with weight 0) picks the uncertain samples; the KL term averages over their rows only
   (GRPO: the Flow-GRPO step KL, 0 with no gated row; NFT: the velocity KL, every row with none). The
   gated fraction adapts per iteration (``UncertaintyGate``).
2. **Adaptive reference.** The reference is a copy of the trained tensors (``Needs.copies``:
   ``gardo_reference``; for LoRA a copy of the adapter, not the adapter-disabled model), taken at the first
   update (the initial weights) and refreshed from the policy before an iteration's update when an optimizer
   step of an earlier iteration logged a gated KL above ``kl_threshold``, or when more than
   ``refresh_period`` iterations passed (``should_refresh``). GRPO evaluates it once per update before any
   step (its step means, like GRPO-Guard's old means); NFT before each minibatch's trained forward.
3. **Diversity-aware advantages.** ``A = (r - mean_g r) * w``, ``w = d / mean_g d`` for above-mean samples
   (``r``: the weighted sum of the rewards; with ``reward.aggregate: per_reward`` the weighted sum of each reward
   normalised within its group),
   ``d`` the cosine distance to the nearest other sample of the group in the feature space of the model
   ``features`` (``flowrl.rewards.features``: ``dino`` through transformers, ``digits`` on digits),
   clipped to ``+-adv_clip_max``. ``diversity: false`` keeps the base update's advantages.

The gate's state, the refresh bookkeeping and the reference copy are checkpointed (``scalar_state`` and
``state_dict``), so ``--resume`` continues exactly.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from ..advantages.aggregate import weighted
from ..advantages.group import group_normalised
from ..errors import ConfigError
from ..losses import nft_loss
from ..losses.flow_matching import velocity_mse
from ..losses.gardo import (UncertaintyGate, diversity_advantages, gardo_gate, gated_mean, nft_threshold_after_refresh,
                            should_refresh)
from ..rewards.features import FEATURES, check_feature_options, tiny_dino
from ..trainable import EMA
from ..utils.hub import looks_like_hub_id
from .base import Batch, Needs, UpdateOptions, check_number
from .grpo import GRPOOptions, GRPOUpdate
from .nft import NFTOptions, NFTUpdate
from .rewards import aggregated_advantages, rule, share_stats

PAPER_FEATURES = {"path": "facebook/dinov3-vitl16-pretrain-lvd1689m"}  # DINOv3 ViT-L/16, as GARDO's code


@dataclass
class GARDOFields(UpdateOptions):
    """The options GARDO adds to its base update's (``train.loss_options``)."""

    aux_rewards: list = field(default_factory=lambda: ["aesthetic", "imagereward"])  # rewards whose ranks are
    #   compared with the trained reward's (the paper's two); each must be in reward.weights (weight 0: not trained on)
    refresh_period: int = 15  # the reference is copied from the policy at least every this many iterations
    gate_fraction: float = 0.1  # starting share of the uncertain samples regularised (x1.1 / x0.9 per iteration)
    gate_bounds: list = field(default_factory=lambda: [0.02, 0.2])  # the share stays within these
    gate_rate: float = 0.1  # the share's relative change when the uncertainty beats every / none of the last window
    gate_window: int = 20  # iterations of uncertainty means the share is compared with
    diversity: bool = True  # diversity-aware advantages (false: the base update's advantages)
    features: str = "dino"  # feature model of the diversity (flowrl.rewards.features: dino, digits)
    features_options: dict = field(default_factory=lambda: dict(PAPER_FEATURES))  # its keyword arguments (dino: path,
    #   device, dtype, size, batch_size); the device defaults to the training device

    def check_base_options(self, ignored: tuple[str, ...]) -> None:
        """What both bases check: ``kl_threshold`` (each base sets its own default) positive, and none of the
        base update's advantage options ``ignored`` by the diversity-aware advantage set with it."""
        check_number(self, "kl_threshold", strict=True)
        given = [name for name in ignored if getattr(self, name)]
        if self.diversity and given:
            raise ValueError(f"train.loss_options.{' and '.join(given)} {'has' if len(given) == 1 else 'have'} no effect "
                             f"with diversity: true (GARDO's advantage is (r - group mean) x its diversity weight); "
                             f"drop {'it' if len(given) == 1 else 'them'}, or set diversity: false")

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.aux_rewards, list) or not self.aux_rewards or \
                not all(isinstance(n, str) for n in self.aux_rewards):
            raise ValueError(f"train.loss_options.aux_rewards must be a non-empty list of reward names (GARDO's "
                             f"uncertainty compares the trained reward's ranks with theirs), got {self.aux_rewards!r}")
        if isinstance(self.refresh_period, bool) or not isinstance(self.refresh_period, int) or self.refresh_period < 1:
            raise ValueError(f"train.loss_options.refresh_period must be a positive integer, got {self.refresh_period!r}")
        if isinstance(self.gate_window, bool) or not isinstance(self.gate_window, int) or self.gate_window < 1:
            raise ValueError(f"train.loss_options.gate_window must be a positive integer, got {self.gate_window!r}")
        check_number(self, "gate_rate")
        bounds = self.gate_bounds
        if not (isinstance(bounds, list) and len(bounds) == 2 and all(isinstance(b, (int, float)) for b in bounds)
                and 0 < bounds[0] <= self.gate_fraction <= bounds[1] <= 1):
            raise ValueError(f"train.loss_options.gate_bounds must be [low, high] with 0 < low <= gate_fraction "
                             f"({self.gate_fraction!r}) <= high <= 1, got {bounds!r}")
        if not isinstance(self.diversity, bool):
            raise ValueError(f"train.loss_options.diversity must be true or false, got {self.diversity!r}")
        if not isinstance(self.features_options, dict):
            raise ValueError(f"train.loss_options.features_options must be a mapping, got {self.features_options!r}")
        if self.diversity:
            check_feature_options(self.features, self.features_options)
            path = self.features_options.get("path")
            if isinstance(path, str) and not looks_like_hub_id(path) and not Path(path).expanduser().exists():
                raise ValueError(f"train.loss_options.features_options.path={path}: no such directory (the "
                                 f"{self.features!r} feature model loads from it); point it at a save_pretrained "
                                 f"directory or a hub id, or set train.loss_options.diversity=false")

    def gate(self) -> UncertaintyGate:
        """The gate's starting state."""
        return UncertaintyGate(fraction=float(self.gate_fraction), base=float(self.gate_fraction),
                               rate=float(self.gate_rate), low=float(self.gate_bounds[0]),
                               high=float(self.gate_bounds[1]), window=self.gate_window)

    def smoke_overrides(self, scratch) -> dict[str, str]:
        """A smoke run: JPEG (in)compressibility for the rewards, a tiny random DINOv2 for the features."""
        ov = {"reward.weights": "{jpeg_compressibility: 1.0, jpeg_incompressibility: 0.0}",
              "train.loss_options.aux_rewards": "[jpeg_incompressibility]"}
        if self.diversity and self.features == "dino":
            ov["train.loss_options.features_options"] = json.dumps({"path": str(tiny_dino(Path(scratch) / "dino")),
                                                                    "size": 32})
        return ov


def gardo_needs(base: Needs, options) -> Needs:
    """The base update's needs, with GARDO's: its own reference copy (not the frozen one), the auxiliary
    rewards among the rollout's components, the feature model."""
    kl = options.beta_kl > 0
    return dataclasses.replace(
        base, reference=False, reference_in_graph=False, per_reward=base.per_reward,
        flat_groups=base.transitions,  # GRPO's: the gate and the diversity are per finished sample
        copies=base.copies + (("gardo_reference",) if kl else ()), reward_components=tuple(options.aux_rewards),
        models=(FEATURES.entries[options.features],) if options.diversity else ())


class GARDO:
    """What GARDO adds to a base update (a mixin: ``class X(GARDO, BaseUpdate)``). ``when_empty``: the KL of a
    minibatch without gated rows (``"zero"``: GRPO, ``"all"``: NFT)."""

    when_empty: ClassVar[str] = "zero"

    def __init__(self, ctx, options=None):
        super().__init__(ctx, options)
        # inside ctx.reference() the policy evaluates the adaptive reference (its tensors loaded into the trained
        # module: only outside a held graph, as NFT does; GRPO reads its precomputed step means instead)
        self.ctx = dataclasses.replace(ctx, reference=self._reference_weights)
        self.reference = None  # EMA-type copy of the trained tensors, made at the first update or restored
        self.gate_state = self.opts.gate()
        self.last_refresh, self.kl_exceeded, self.kl_threshold = 0, False, float(self.opts.kl_threshold)
        self.refreshes = 0
        self._features = None  # the feature model, built on first use
        self._gate = None  # [N] bool of this call's samples, on the training device
        self._minibatch_kls: list = []
        self._step_kls: list = []

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict:
        out = super().state_dict()
        if self.reference is not None:
            out["gardo_reference"] = self.reference.shadow
        return out

    def load_state_dict(self, extra: dict) -> None:
        super().load_state_dict(extra)
        if "gardo_reference" in extra:
            self.reference = EMA(self.ctx.unwrapped, decay=0.0)
            self.reference.shadow = extra["gardo_reference"]

    def scalar_state(self) -> dict:
        g = self.gate_state
        return {"gate_fraction": g.fraction, "gate_history": list(g.history), "last_refresh": self.last_refresh,
                "kl_exceeded": self.kl_exceeded, "kl_threshold": self.kl_threshold, "refreshes": self.refreshes}

    def load_scalar_state(self, state: dict) -> None:
        if state:
            self.gate_state = dataclasses.replace(self.gate_state, fraction=float(state["gate_fraction"]),
                                                  history=tuple(float(h) for h in state["gate_history"]))
            self.last_refresh, self.kl_exceeded = int(state["last_refresh"]), bool(state["kl_exceeded"])
            self.kl_threshold, self.refreshes = float(state["kl_threshold"]), int(state["refreshes"])

    # ------------------------------------------------------------ the call
    def batch(self, rollout, it: int) -> Batch:
        stats = self._refresh(it) if self.opts.beta_kl > 0 else {}
        self._gate, gate_stats = self._gate_of(rollout)
        b = super().batch(rollout, it)
        b.stats.update({**stats, **gate_stats})
        return b

    def _refresh(self, it: int) -> dict:
        """Copy the policy into the reference when due (and take the first copy); the refresh stats."""
        unwrapped = self.ctx.unwrapped
        if self.reference is None:
            self.reference = EMA(unwrapped, decay=0.0)  # the initial weights (LoRA: B = 0, the base model)
        refreshed = should_refresh(it, self.last_refresh, self.kl_exceeded, period=self.opts.refresh_period)
        if refreshed:
            self.reference = EMA(unwrapped, decay=0.0)
            self.kl_threshold = self.next_threshold(self.kl_threshold, it - self.last_refresh)
            self.last_refresh, self.kl_exceeded, self.refreshes = it, False, self.refreshes + 1
        return {"gardo/refreshed": float(refreshed), "gardo/refreshes": self.refreshes,
                "gardo/kl_threshold": self.kl_threshold}

    def next_threshold(self, threshold: float, gap: int) -> float:
        """The KL threshold after a refresh ``gap`` iterations after the previous one (kept here)."""
        return threshold

    def _gate_of(self, rollout) -> tuple[torch.Tensor, dict]:
        """The gate of this process's samples ``[N]`` bool (on the training device) from the gathered batch's
        trained and auxiliary rewards; advances the gate's state."""
        comps = rollout.reward_components
        missing = [n for n in self.opts.aux_rewards if n not in comps]
        if missing:
            raise ConfigError(f"train.loss_options.aux_rewards names {missing[0]!r}, which the rollout's reward did not "
                              f"score; add it to reward.weights with weight 0 (scored, not trained on)")
        low = lambda r: torch.nan_to_num(r.float(), nan=float("-inf"))  # noqa: E731  NaN ranks last
        main = low(self.ctx.gather(rollout.rewards))  # [N * processes]
        aux = [low(self.ctx.gather(comps[n])) for n in self.opts.aux_rewards]
        gate, self.gate_state, stats = gardo_gate(main, aux, self.gate_state)
        n, rank = rollout.num_samples, self.ctx.process_index
        return gate[rank * n:(rank + 1) * n].to(self.ctx.device), {f"gardo/{k}": v for k, v in stats.items()}

    def _reference_weights(self):
        return self.reference.applied(self.ctx.unwrapped)

    def shaped_advantages(self, rollout) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """GARDO's diversity-aware advantages of the samples: ``(A [N] clipped, zero_var [N] bool, stats)``;
        NaN rewards and groups without reward variance get 0 (and are skipped, as the base update's). The reward
        they centre is the weighted sum, or under ``reward.aggregate: per_reward`` the weighted sum of each reward
        normalised within its group (:func:`flowrl.updates.rewards.sample_advantages`); the stats hold each
        reward's share of them."""
        r, groups = rollout.rewards.float(), rollout.group_index
        per_reward, weights_k = rule(self.ctx)
        norm, zero, _ = aggregated_advantages(self.ctx, rollout)  # which groups carry signal; per_reward: the value
        if per_reward:
            r = norm  # [N] sum_k w_k z_k, centred in every group
        keep = torch.isfinite(r) & ~zero  # [N]
        adv, weights = torch.zeros_like(r), torch.ones_like(r)
        if keep.any():
            if self._features is None:
                opts = {"device": str(self.ctx.device), **self.opts.features_options}
                self._features = FEATURES.get(self.opts.features)(**opts)
            feats = self._features(rollout.images[keep.to(rollout.images.device)])  # [K, D]
            adv[keep], weights[keep] = diversity_advantages(r[keep], feats, groups[keep])
        clip = self.opts.adv_clip_max
        up = keep & (adv > 0)
        stats = {"gardo/diversity_weight": float(weights[up].mean()) if up.any() else 1.0,
                 **share_stats(self.ctx, self._contributions(rollout, per_reward, weights_k, weights), keep)}
        return adv.clamp(-clip, clip), zero, stats

    @staticmethod
    def _contributions(rollout, per_reward: bool, reward_weights, weights: torch.Tensor) -> dict:
        """Each reward's part of the diversity-aware advantage before its clip: its weighted centred score (under
        ``per_reward``: normalised within the group) times the sample's diversity weight, name -> ``[N]``."""
        names, comps = weighted(reward_weights), rollout.reward_components
        if not names or not all(k in comps for k in names):
            return {}
        part = lambda x: group_normalised(x, rollout.group_index)  # noqa: E731
        return {k: reward_weights[k] * (part(comps[k]).advantages(None) if per_reward else part(comps[k]).centred)
                * weights for k in names}

    def record_kl(self, kl: torch.Tensor) -> None:
        """A minibatch's gated KL (unweighted), for the refresh rule (averaged per optimizer step)."""
        self._minibatch_kls.append(kl.detach().float().reshape(()))

    # ------------------------------------------------------------ hooks
    def after_step(self, optimizer_steps: int) -> None:
        super().after_step(optimizer_steps)
        if self._minibatch_kls:
            self._step_kls.append(torch.stack(self._minibatch_kls).mean())
            self._minibatch_kls = []

    def after_update(self, batch: Batch, trained: int, optimizer_steps: int) -> dict:
        stats = super().after_update(batch, trained, optimizer_steps)
        if self._step_kls:  # the step's KL averaged over processes, as the peers log it
            steps = self.ctx.gather(torch.stack(self._step_kls)).float().view(self.ctx.num_processes, -1).mean(dim=0)
            exceeded = bool((steps > self.kl_threshold).any())
            self.kl_exceeded = self.kl_exceeded or exceeded
            stats.update({"gardo/kl_step_max": float(steps.max()), "gardo/kl_exceeded": float(exceeded)})
            self._step_kls = []
        return stats


# ---------------------------------------------------------------- GARDO on GRPO
@dataclass
class GARDOGRPOOptions(GRPOOptions, GARDOFields):
    """``train.loss_options`` of ``gardo_grpo``: GRPO's (GARDO's published ratio clip 1e-4) and GARDO's."""

    clip_range: float = 1e-4  # GARDO's config (its SD3.5-M and FLUX runs)
    beta_kl: float = 0.04  # weight of the gated KL to the adaptive reference (GARDO SD3.5-M OCR; GenEval 0.07)
    kl_threshold: float = 3e-4  # an optimizer step's gated KL above this refreshes the reference next iteration

    def __post_init__(self):
        super().__post_init__()
        self.check_base_options(("global_std", "advantage_options"))


class GARDOGRPOUpdate(GARDO, GRPOUpdate):
    """GARDO on GRPO: flat groups of stored transitions (``group``, ``sol`` with regen: group)."""

    Options = GARDOGRPOOptions
    summary = "GARDO (arXiv 2512.24138) on GRPO: gated KL to an adaptive reference, diversity-aware advantages"
    digits_recipe = "digits_gardo.yaml"
    when_empty = "zero"

    @classmethod
    def needs(cls, options) -> Needs:
        return gardo_needs(GRPOUpdate.needs(options), options)

    def advantages(self, rollout, it: int) -> tuple[torch.Tensor, dict]:
        # config validation refuses the shipped tree samplers (Needs.flat_groups); this catches one that does not declare it
        if rollout.structure != "group" or bool((rollout.transitions.sample_index < 0).any()):
            raise ConfigError(f"train.loss=gardo_grpo trains on flat groups (each transition leads to one sample), and "
                              f"the {self.ctx.sampler_name!r} sampler's rollouts are {rollout.structure!r}; use "
                              f"sampler.name=group (or sol with regen: group), or train.loss=gardo_nft")
        if not self.opts.diversity:
            return super().advantages(rollout, it)
        adv, zero, stats = self.shaped_advantages(rollout)
        idx = rollout.transitions.sample_index
        return adv[idx], {"zero_var": zero[idx], "zero_var_fraction": zero.float().mean().item(), **stats}

    def prepare(self, rollout, cond, trans, rows: torch.Tensor):
        """The transitions' gate, and the reference's step means (before any step: the reference is fixed
        for the call, and evaluating it here keeps the trained module untouched while a graph is held)."""
        out = {"gate": self._gate[trans.sample_index.to(self._gate.device)]}  # [M]
        if self.opts.beta_kl > 0:
            out["ref_mean"] = self.step_means(rollout, cond, trans, rows, weights=self._reference_weights)
        return out

    def reference_mean(self, rollout, step_fn, tr, c, rows: torch.Tensor, extra) -> torch.Tensor:
        return extra["ref_mean"][rows.to(self.ctx.device)]

    def kl_penalty(self, kl: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        value = gated_mean(kl, self._transition_gate(rows), when_empty=self.when_empty)
        self.record_kl(value)
        return value

    def _transition_gate(self, rows: torch.Tensor) -> torch.Tensor:
        return self._batch_gate[rows.to(self._batch_gate.device)]

    def batch(self, rollout, it: int) -> Batch:
        b = super().batch(rollout, it)
        self._batch_gate = b.data["extra"]["gate"]  # [M] bool
        return b


# ---------------------------------------------------------------- GARDO on DiffusionNFT
@dataclass
class GARDONFTOptions(NFTOptions, GARDOFields):
    """``train.loss_options`` of ``gardo_nft``: DiffusionNFT's and GARDO's."""

    beta_kl: float = 0.04  # weight of the gated velocity KL to the adaptive reference (GARDO's SD3.5-M NFT run)
    kl_threshold: float = 0.15  # an optimizer step's gated KL above this refreshes the reference next iteration
    adapt_threshold: bool = True  # move the threshold at each refresh as GARDO's NFT script does

    def __post_init__(self):
        super().__post_init__()
        self.check_base_options(("global_std",))
        if not isinstance(self.adapt_threshold, bool):
            raise ValueError(f"train.loss_options.adapt_threshold must be true or false, got {self.adapt_threshold!r}")


class GARDONFTUpdate(GARDO, NFTUpdate):
    """GARDO on DiffusionNFT: finished samples of any sampler, ODE included."""

    Options = GARDONFTOptions
    summary = "GARDO (arXiv 2512.24138) on DiffusionNFT: gated velocity KL, diversity-aware advantages"
    digits_recipe = "digits_gardo_nft.yaml"
    when_empty = "all"

    @classmethod
    def needs(cls, options) -> Needs:
        return gardo_needs(NFTUpdate.needs(options), options)

    def next_threshold(self, threshold: float, gap: int) -> float:
        return nft_threshold_after_refresh(threshold, gap) if self.opts.adapt_threshold else threshold

    def sample_advantages(self, rollout) -> tuple[torch.Tensor, torch.Tensor, dict]:
        return self.shaped_advantages(rollout) if self.opts.diversity else super().sample_advantages(rollout)

    def objective(self, v, v_old, x_t, x0, t, adv, v_ref, rows: torch.Tensor) -> tuple[torch.Tensor, dict]:
        opts = self.opts
        loss, stats = nft_loss(v, v_old, x_t, x0, t, adv, beta=opts.beta, adv_clip_max=opts.adv_clip_max)
        if v_ref is not None:
            kl = gated_mean(velocity_mse(v, v_ref.detach()), self._gate[rows], when_empty=self.when_empty)
            self.record_kl(kl)
            loss = loss + opts.beta_kl * kl
            stats["kl"] = kl.detach()
        return loss, stats
