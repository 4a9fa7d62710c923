"""On-policy distillation (``train.loss: opd``): Diffusion-OPD (Li et al., arXiv 2605.15055; DanceOPD,
arXiv 2606.27377, is a variant; docs/algorithms.md §17).

The student samples its own trajectories with any sampler that stores transitions (group, branch, tempflow, sol
with regen: group); at every state it visited, frozen teachers give their step at that state, and the loss is the
closed-form KL of the student's Gaussian transition to theirs (``flowrl.losses.opd.opd_kl``), weighted over the
teachers. It reads no reward and no advantage: the rollout's rewards are scored for logging and evaluation only
(``reward.weights`` may be any reward, or the one the teachers were trained on, to watch the transfer).

Teachers (``train.loss_options.teachers``, one or several): each a ``source`` (``""``: the run's own base model, a
second frozen copy; a run directory: its newest checkpoint's weights; a recipe; a model path or hub id of
``model.pipeline``; flowrl/trainers/frozen.py), its ``guidance`` (None: the source's own ``model.guidance_scale``),
its ``weight``, whether to ``offload`` it to host memory between forwards, and the ``prompts`` it supervises (a
regular expression; None: all of them). They are loaded once, on the first update call, and their step means at
every stored transition they supervise are computed once per call, before any optimizer step (no grad); a
minibatch then needs one student forward per transition.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..conditions import encode_conditions
from ..data.items import item_texts
from ..errors import ConfigError
from ..losses import KL_FORMS, kl_form_for_step
from ..losses.opd import opd_kl
from ..sde import get_step
from ..types import index_cond
from .base import Batch, Minibatch, Needs, Update, UpdateOptions, check_number

TEACHER_KEYS = ("source", "guidance", "weight", "offload", "prompts")


@dataclass(frozen=True)
class Teacher:
    """One teacher of ``train.loss_options.teachers`` (module doc)."""

    source: str = ""                  # "": the run's base model; a run directory; a recipe; a model path / hub id
    guidance: Optional[float] = None  # its classifier-free guidance scale (None: the source's own)
    weight: float = 1.0               # its share of the KL (weights are normalised to sum 1)
    offload: bool = False             # keep its transformer in host memory, moved in for each forward
    prompts: Optional[str] = None     # a regular expression: it supervises the prompts whose text it matches
    #                                   (re.search; None: every prompt); a prompt no teacher matches is not trained


def parse_teacher(i: int, given) -> Teacher:
    """``teachers[i]`` (a mapping, or a source string) -> :class:`Teacher`; a ``ValueError`` naming the key."""
    where = f"train.loss_options.teachers[{i}]"
    if isinstance(given, str):
        given = {"source": given}
    if not isinstance(given, dict):
        raise ValueError(f"{where} must be a mapping of {', '.join(TEACHER_KEYS)} (or a source string), got {given!r}")
    for k in given:
        if k not in TEACHER_KEYS:
            raise ValueError(f"{where}.{k}: not a teacher option. Valid: {', '.join(TEACHER_KEYS)}")
    t = Teacher(**given)
    if t.source is None or not isinstance(t.source, str):
        raise ValueError(f"{where}.source must be a string (\"\": the run's base model, a run directory, a recipe or "
                         f"a model path), got {t.source!r}")
    if t.guidance is not None and (isinstance(t.guidance, bool) or not isinstance(t.guidance, (int, float))
                                   or not t.guidance >= 1.0):
        raise ValueError(f"{where}.guidance must be a number >= 1.0 (1.0: no guidance) or null, got {t.guidance!r}")
    if isinstance(t.weight, bool) or not isinstance(t.weight, (int, float)) or not t.weight > 0:
        raise ValueError(f"{where}.weight must be a number > 0, got {t.weight!r}")
    if not isinstance(t.offload, bool):
        raise ValueError(f"{where}.offload must be true or false, got {t.offload!r}")
    if t.prompts is not None:
        try:
            re.compile(t.prompts)
        except (re.error, TypeError) as e:
            raise ValueError(f"{where}.prompts must be a regular expression (or null: every prompt), got "
                             f"{t.prompts!r} ({e})") from None
    return Teacher(t.source, None if t.guidance is None else float(t.guidance), float(t.weight), t.offload, t.prompts)


@dataclass
class OPDOptions(UpdateOptions):
    """``train.loss_options`` of ``opd``."""

    teachers: list = field(default_factory=lambda: [{"source": "", "guidance": 3.0}])  # each {source, guidance,
    #   weight, offload} (module doc); the default distils the run's own base model at guidance 3.0 (CFG distillation)
    kl_form: str = "exact"  # 'exact': the KL of the two transition Gaussians (Diffusion-OPD's closed form);
    #                         'flow_grpo': Flow-GRPO's denominator 2 s^2 / |dt| (flowrl.losses.grpo.kl_to_reference)

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.teachers, (list, tuple)) or not self.teachers:
            raise ValueError(f"train.loss_options.teachers must be a non-empty list of teachers ({{source, guidance, "
                             f"weight, offload}} each), got {self.teachers!r}")
        self.specs = tuple(parse_teacher(i, t) for i, t in enumerate(self.teachers))
        if self.kl_form not in KL_FORMS:
            raise ValueError(f"train.loss_options.kl_form must be one of {', '.join(KL_FORMS)}, got {self.kl_form!r}")


class OPDUpdate(Update):
    """On-policy distillation on stored transitions (module doc; its knobs: :class:`OPDOptions`)."""

    Options = OPDOptions
    summary = ("Diffusion-OPD (arXiv 2605.15055): on-policy distillation, the closed-form step KL to frozen "
               "teachers at every visited state; no reward")
    digits_recipe = "digits_opd.yaml"

    @classmethod
    def needs(cls, options) -> Needs:
        return Needs(transitions=True, unit="transition", reward_in_loss=False,
                     frozen_models=tuple((t.source, t.guidance, t.offload) for t in options.specs))

    def teachers(self) -> list:
        """The frozen teacher policies, loaded on first use (``UpdateContext.load_frozen``)."""
        if getattr(self, "_teachers", None) is None:
            if self.ctx.load_frozen is None:
                raise ConfigError("train.loss=opd needs its teachers loaded by the trainer (UpdateContext.load_frozen "
                                  "is not set)")
            self._teachers = [self.ctx.load_frozen(t.source, t.guidance, t.offload) for t in self.opts.specs]
        return self._teachers

    def teacher_means(self, teacher, rollout, trans, step_fn, rows: torch.Tensor) -> torch.Tensor:
        """``[M, C, H, W]`` the teacher's step means at stored transitions ``rows`` (no grad, in minibatches; the
        other rows stay 0, never read)."""
        ctx = self.ctx
        out = torch.zeros_like(trans.next_latents)  # [M, C, H, W]
        if not len(rows):  # it supervises none of this rollout's prompts (split would give one empty minibatch)
            return out
        with torch.no_grad():
            cond = encode_conditions(teacher, rollout.prompts)  # its own: its guidance's negative conditioning
            for mb in rows.split(ctx.train.minibatch_size):
                tr = trans.select(mb.to(trans.latents.device))
                with ctx.autocast():
                    v = teacher.velocity(tr.latents, tr.sigma, index_cond(cond, tr.prompt_index))  # [m, C, H, W]
                out[mb.to(out.device)] = step_fn(v.float(), tr.latents, tr.sigma, tr.sigma_next,
                                                 noise_level=rollout.noise_level, prev_sample=tr.next_latents).mean
        return out

    def teacher_weights(self, rollout) -> torch.Tensor:
        """``[K, M]`` each teacher's weight on each stored transition: its ``weight`` where its ``prompts`` match the
        transition's prompt, else 0."""
        texts = item_texts(rollout.prompts)
        match = torch.tensor([[t.prompts is None or re.search(t.prompts, x) is not None for x in texts]
                              for t in self.opts.specs], dtype=torch.float32)  # [K, P]
        w = torch.tensor([t.weight for t in self.opts.specs])[:, None] * match  # [K, P]
        return w[:, rollout.transitions.prompt_index.cpu()]  # [K, M]

    def batch(self, rollout, it: int) -> Batch:
        """The stored transitions some teacher supervises, with each teacher's step means (computed here, before
        any step) and weights."""
        if len(rollout.transitions) == 0:
            raise ConfigError(f"the {self.ctx.sampler_name!r} sampler stored no stochastic transitions, so "
                              f"train.loss=opd has no student step to distil; use a sampler that stores them (group, "
                              f"branch, tempflow, sol with regen: group)")
        ctx = self.ctx
        step_fn = get_step(rollout.step_type)
        trans = rollout.transitions.to(ctx.device)
        w = self.teacher_weights(rollout)  # [K, M]
        means = [self.teacher_means(t, rollout, trans, step_fn, torch.nonzero(w[k] > 0).flatten())
                 for k, t in enumerate(self.teachers())]  # K x [M, C, H, W]
        rows = torch.nonzero(w.sum(dim=0) > 0).flatten()
        data = {"rollout": rollout, "cond": rollout.conditioning(ctx.policy), "transitions": trans, "means": means,
                "weights": w.to(ctx.device), "step_fn": step_fn,
                "form": kl_form_for_step(self.opts.kl_form, rollout.step_type)}
        stats = {"opd_unsupervised_fraction": 1.0 - len(rows) / len(trans)}
        return Batch(rows, ctx.train.minibatch_size, data=data, stats=stats)

    def loss(self, batch: Batch, mb: Minibatch) -> tuple[torch.Tensor, dict]:
        d, ctx = batch.data, self.ctx
        tr = d["transitions"].select(mb.rows)
        with ctx.autocast():
            v = ctx.policy.velocity(tr.latents, tr.sigma, index_cond(d["cond"], tr.prompt_index))  # [m, C, H, W]
        out = d["step_fn"](v, tr.latents, tr.sigma, tr.sigma_next, noise_level=d["rollout"].noise_level,
                           prev_sample=tr.next_latents)
        rows = mb.rows.to(d["means"][0].device)
        kl, per = opd_kl(out.mean, [m[rows] for m in d["means"]], d["weights"][:, rows], out.std,
                         dt=tr.sigma_next - tr.sigma, form=d["form"])  # [m], [K, m]
        loss = (tr.weight * kl).mean()
        stats = {"opd_kl": kl.mean().detach()}
        if len(per) > 1:  # each teacher's KL over the transitions it supervises (NaN-free: 0 when none here)
            on = d["weights"][:, rows] > 0  # [K, m]
            stats.update({f"opd_kl/teacher{k}": (p * on[k]).sum().detach() / on[k].sum().clamp(min=1)
                          for k, p in enumerate(per)})
        return loss, stats

    def after_update(self, batch: Batch, trained: int, optimizer_steps: int) -> dict:
        return {"transitions_trained": trained}
