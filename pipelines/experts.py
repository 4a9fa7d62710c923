"""Two transformers chosen by timestep, as one module: Wan2.2 A14B's experts.

diffusers' ``WanPipeline`` with ``transformer_2`` and ``boundary_ratio`` (Wan2.2 T2V-A14B) runs
``transformer`` (the high-noise expert) at every step whose timestep ``t >= boundary_ratio *
num_train_timesteps`` and ``transformer_2`` (the low-noise expert) below it. :class:`TwoExperts` holds
both and routes each row of a batch the same way: a training minibatch that mixes steps of both
experts is split by expert, each expert runs on its own rows, and the outputs are put back in row
order. Everything flowrl does with one transformer (LoRA set-up, the KL reference with adapters
disabled, EMA, checkpoints and resume, DDP / FSDP2, the Sol quantized copy, ``flowrl plan``) sees
one module whose parameters are named ``transformer.*`` and ``transformer_2.*``.

Trained experts: ``train_experts`` (``model.options.train_experts``: ``[high, low]`` by default,
``[high]`` or ``[low]``). ``add_adapter`` puts the LoRA on those only, and ``requires_grad_(True)``
(a full fine-tune) unfreezes those only; the other expert stays frozen.

Distributed runs (more than one process): every process must run the same forwards, and DDP needs a
gradient for every trained parameter in every backward. The module runs no collective and knows no
layout: the run's parallelism tells it how the processes agree on the experts a forward runs
(:meth:`TwoExperts.set_process_agreement`, from :func:`flowrl.distributed.parallelize.parallelize`: the
union over the processes under FSDP2, every trained expert in a DDP backward); an expert that has no
row of its own on a process then runs on one row whose output is added times zero (values unchanged,
gradients zero). Alone (no agreement set) it runs only the experts its rows need.
"""
from __future__ import annotations

import copy
from typing import Iterable, Optional, Union

import torch
from torch import nn

EXPERTS = {"high": "transformer", "low": "transformer_2"}  # train_experts name -> pipeline component
LORA_FILES = {"transformer": "pytorch_lora_weights.safetensors",  # diffusers' LORA_WEIGHT_NAME_SAFE
              "transformer_2": "pytorch_lora_weights_transformer_2.safetensors"}  # must not end like the first
_EXTRA_KEYS = ("boundary_ratio", "num_train_timesteps", "train_experts", "expert_class")


def parse_train_experts(value: Union[str, Iterable[str], None]) -> tuple[str, ...]:
    """``train_experts`` as a tuple in canonical order (``("high", "low")``, ``("high",)``, ``("low",)``)."""
    names = [value] if isinstance(value, str) else list(value or ())
    if not names or any(n not in EXPERTS for n in names):
        raise ValueError(f"model.options.train_experts must be a non-empty list of {list(EXPERTS)} (high: the "
                         f"high-noise transformer, low: the low-noise transformer_2), got {value!r}")
    return tuple(n for n in EXPERTS if n in names)


def high_noise_rows(timestep: torch.Tensor, boundary: float) -> torch.Tensor:
    """Bool ``[B]``: rows whose timestep (``[B]``, or per token ``[B, L]``: its largest) is ``>= boundary``
    (``boundary_ratio * num_train_timesteps``), the rows ``WanPipeline`` gives its ``transformer``."""
    t = timestep if timestep.ndim == 1 else timestep.reshape(timestep.shape[0], -1).amax(1)  # [B]
    return t >= boundary


def split_expert_tensors(tensors: dict[str, torch.Tensor]) -> Optional[dict[str, dict[str, torch.Tensor]]]:
    """Trained tensors of a :class:`TwoExperts` by expert component, names without the component prefix
    (``{"transformer": {...}, "transformer_2": {...}}``, experts without tensors left out); None when no
    name has an expert prefix (a single transformer's tensors)."""
    parts = {c: {k[len(c) + 1:]: v for k, v in tensors.items() if k.startswith(c + ".")} for c in LORA_FILES}
    found = sum(len(p) for p in parts.values())
    if found == 0:
        return None
    if found != len(tensors):
        raise ValueError(f"tensor names mix the experts' prefixes {list(LORA_FILES)} with others "
                         f"(e.g. {sorted(k for k in tensors if not k.startswith(tuple(LORA_FILES)))[:2]})")
    return {c: p for c, p in parts.items() if p}


class TwoExperts(nn.Module):
    """``transformer`` (high noise) and ``transformer_2`` (low noise) as one module (see module doc).

    Args:
        transformer, transformer_2: the two experts (same class and architecture).
        boundary_ratio: the pipeline's ``boundary_ratio``; rows with ``timestep >= boundary_ratio *
            num_train_timesteps`` go to ``transformer``.
        num_train_timesteps: the scheduler's (1000 for Wan).
        train_experts: the experts a LoRA / full fine-tune trains (:func:`parse_train_experts`).
    """

    def __init__(self, transformer: nn.Module, transformer_2: nn.Module, boundary_ratio: float,
                 num_train_timesteps: int = 1000, train_experts: Iterable[str] = ("high", "low")):
        super().__init__()
        if not 0.0 <= float(boundary_ratio) <= 1.0:
            raise ValueError(f"boundary_ratio must be in [0, 1], got {boundary_ratio!r}")
        own = [{k: v for k, v in m.config.items() if not k.startswith("_")} for m in (transformer, transformer_2)]
        if type(transformer) is not type(transformer_2) or own[0] != own[1]:
            diff = sorted(k for k in set(own[0]) | set(own[1]) if own[0].get(k) != own[1].get(k))
            raise ValueError(f"the two experts differ in architecture ({type(transformer).__name__} vs "
                             f"{type(transformer_2).__name__}, config keys {diff[:4]}); TwoExperts needs one")
        self.transformer, self.transformer_2 = transformer, transformer_2
        self.boundary_ratio, self.num_train_timesteps = float(boundary_ratio), int(num_train_timesteps)
        self.boundary = self.boundary_ratio * self.num_train_timesteps  # in timestep units
        self.train_experts = parse_train_experts(train_experts)
        self._agree = None  # the processes' agreement on the experts a forward runs (set_process_agreement)
        self._no_split_modules = tuple(getattr(transformer, "_no_split_modules", None) or ())  # FSDP2 units
        if any(getattr(m, "is_gradient_checkpointing", False) for m in (transformer, transformer_2)):
            self.enable_gradient_checkpointing()  # e.g. the loader turned it on for the first expert
        from diffusers.configuration_utils import FrozenDict

        self._config = FrozenDict({**own[0], "boundary_ratio": self.boundary_ratio,
                                   "num_train_timesteps": self.num_train_timesteps,
                                   "train_experts": list(self.train_experts),
                                   "expert_class": type(transformer).__name__})

    # --- what code written for one diffusers transformer reads ---------------------------------
    @property
    def config(self):
        """The experts' (shared) config plus ``boundary_ratio``, ``num_train_timesteps``, ``train_experts``
        and ``expert_class``: what :meth:`from_config` builds the pair from."""
        return self._config

    @classmethod
    def from_config(cls, config) -> "TwoExperts":
        """Two randomly initialised experts of ``config`` (:attr:`config`'s layout), on the current default device."""
        from .facts import component_class

        config = dict(config)
        extra = {k: config.pop(k) for k in _EXTRA_KEYS if k in config}
        expert = component_class("diffusers:" + extra.get("expert_class", "WanTransformer3DModel"))
        return cls(expert(**config), expert(**config), extra["boundary_ratio"],
                   extra.get("num_train_timesteps", 1000), extra.get("train_experts", tuple(EXPERTS)))

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def plan_note(self) -> str:
        """What ``flowrl plan`` says of the pair."""
        return (f"2 experts (transformer: timestep >= {self.boundary:g}, transformer_2 below), both resident all run; "
                f"trained: {', '.join(EXPERTS[n] for n in self.train_experts)}")

    def experts(self) -> list[tuple[str, nn.Module]]:
        """``[("high", transformer), ("low", transformer_2)]``."""
        return [(n, getattr(self, attr)) for n, attr in EXPERTS.items()]

    def requires_grad_(self, requires_grad: bool = True) -> "TwoExperts":
        """Gradients on for the ``train_experts`` only (a full fine-tune); off for both with False."""
        for name, m in self.experts():
            m.requires_grad_(bool(requires_grad) and name in self.train_experts)
        return self

    # --- peft adapters (flowrl.trainable) -------------------------------------------------------
    def add_adapter(self, adapter_config, adapter_name: str = "default") -> None:
        """A LoRA (one config, one copy per expert) on each of the ``train_experts``."""
        for name, m in self.experts():
            if name in self.train_experts:
                m.add_adapter(copy.deepcopy(adapter_config), adapter_name=adapter_name)

    def _adapted(self) -> list[nn.Module]:
        return [m for _, m in self.experts() if getattr(m, "_hf_peft_config_loaded", False)]

    @property
    def peft_config(self) -> dict:
        adapted = self._adapted()
        return adapted[0].peft_config if adapted else {}

    def disable_adapters(self) -> None:
        for m in self._adapted():
            m.disable_adapters()

    def enable_adapters(self) -> None:
        for m in self._adapted():
            m.enable_adapters()

    def enable_gradient_checkpointing(self) -> None:
        for _, m in self.experts():
            m.enable_gradient_checkpointing()

    def disable_gradient_checkpointing(self) -> None:
        for _, m in self.experts():
            m.disable_gradient_checkpointing()

    # --- the forward --------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, return_dict: bool = True, **kwargs):
        """The routed experts' output for ``hidden_states`` ``[B, ...]`` at ``timestep`` ``[B]`` (or ``[B, L]``);
        every batch-first keyword argument is split with the rows. ``(out,)`` with ``return_dict=False``."""
        kwargs.update(hidden_states=hidden_states, timestep=timestep)
        b = hidden_states.shape[0]
        if timestep.is_meta:  # the planner's shape-only passes: one expert's activations (a trained one)
            out = self._run(self._meta_expert(), kwargs, None, b)
        else:
            high = high_noise_rows(timestep, self.boundary)  # [B]
            rows = {"high": high.nonzero().flatten(), "low": (~high).nonzero().flatten()}
            need = self._needed(rows)
            outs, order, zero = [], [], None
            for name in EXPERTS:
                if len(rows[name]) == b:
                    outs.append(self._run(name, kwargs, None, b))  # every row: no split
                    order.append(rows[name])
                elif len(rows[name]):
                    outs.append(self._run(name, kwargs, rows[name], b))
                    order.append(rows[name])
                elif need[name]:  # see module doc: one row, added times zero
                    extra = self._run(name, kwargs, rows["high" if name == "low" else "low"][:1], b)
                    extra = extra.float().nan_to_num().sum() * 0.0
                    zero = extra if zero is None else zero + extra
            out = outs[0] if len(outs) == 1 else torch.cat(outs).index_select(0, torch.cat(order).argsort())
            if zero is not None:
                out = out + zero.to(out.dtype)
        if return_dict:
            from diffusers.models.modeling_outputs import Transformer2DModelOutput

            return Transformer2DModelOutput(sample=out)
        return (out,)

    def _run(self, name: str, kwargs: dict, index: Optional[torch.Tensor], b: int) -> torch.Tensor:
        """Expert ``name`` on rows ``index`` (None: all) of every batch-first tensor in ``kwargs``."""
        if index is not None:
            kwargs = {k: v.index_select(0, index) if torch.is_tensor(v) and v.ndim and v.shape[0] == b else v
                      for k, v in kwargs.items()}
        return getattr(self, EXPERTS[name])(**kwargs, return_dict=False)[0]

    def _meta_expert(self) -> str:
        trained = [n for n, m in self.experts() if any(p.requires_grad for p in m.parameters())]
        return (trained or ["high"])[0]

    def set_process_agreement(self, agree) -> None:
        """How the run's processes agree on the experts a forward runs: ``agree(need, trained, device)`` with
        ``{expert: its rows here}`` and ``{expert: trained}`` -> ``{expert: runs}`` (set by the run's
        parallelism; module doc)."""
        self._agree = agree

    def _needed(self, rows: dict[str, torch.Tensor]) -> dict[str, bool]:
        """Which experts this forward runs: those its rows need, as the processes agree (module doc)."""
        need = {n: len(r) > 0 for n, r in rows.items()}
        if self._agree is None:
            return need
        trained = {n: any(p.requires_grad for p in m.parameters()) for n, m in self.experts()}
        return self._agree(need, trained, rows["high"].device)


def two_experts(**config) -> TwoExperts:
    """:meth:`TwoExperts.from_config` as a component builder (``flowrl.pipelines.facts.build_component``)."""
    return TwoExperts.from_config(config)


# --- what an adapter over a two-expert pipeline declares with these ---------------------------------
def experts_component(transformer: dict, boundary_ratio: float, expert_class: str, options: dict):
    """The :class:`~flowrl.pipelines.facts.Component` of two ``expert_class`` experts of config ``transformer``
    training ``options['train_experts']`` (default both): what ``flowrl plan`` and the benchmark build."""
    from .facts import Component

    trained = parse_train_experts(options.get("train_experts") or tuple(EXPERTS))
    return Component("flowrl.pipelines.experts:two_experts", {**transformer, "boundary_ratio": boundary_ratio,
                                                               "expert_class": expert_class,
                                                               "train_experts": list(trained)})


def check_second_expert(root, transformer: dict) -> None:
    """A local pipeline directory's ``transformer_2/config.json`` must describe ``transformer``'s architecture."""
    import json
    from pathlib import Path

    second = json.loads((Path(root) / "transformer_2" / "config.json").read_text())
    if {k: v for k, v in second.items() if not k.startswith("_")} != transformer:
        raise ValueError(f"{root}: transformer_2 differs in architecture from transformer (flowrl plans two experts "
                         f"of one architecture)")


def expert_lora_parts(tensors: dict[str, torch.Tensor]) -> list[tuple[str, str, dict[str, torch.Tensor]]]:
    """``[(component, file, tensors)]`` of a run's trained tensors for ``flowrl export``: one per trained expert
    (:func:`split_expert_tensors`), or the one transformer's."""
    parts = split_expert_tensors(tensors) or {"transformer": tensors}
    return [(c, LORA_FILES[c], t) for c, t in parts.items()]


def expert_lora_load_hint(pipeline_class: str, components: Iterable[str]) -> str:
    """How the exported files load: each expert's into its transformer (diffusers' ``WanLoraLoaderMixin``:
    ``load_into_transformer_2=True`` for the second)."""
    calls = ["load_lora_weights(OUT)" if c == "transformer" else
             f"load_lora_weights(OUT, weight_name={LORA_FILES[c]!r}, load_into_{c}=True)" for c in components]
    return f"pipe = {pipeline_class}.from_pretrained(BASE); " + "; ".join(f"pipe.{c}" for c in calls)


__all__ = ["EXPERTS", "LORA_FILES", "TwoExperts", "check_second_expert", "expert_lora_load_hint", "expert_lora_parts",
           "experts_component", "high_noise_rows", "parse_train_experts", "split_expert_tensors", "two_experts"]
