"""What is trained and how it is referenced: the trained parameters of a transformer (a LoRA via peft,
or every weight), their state by name, the frozen reference (the adapter-disabled model, or a frozen copy),
and exponential moving averages of the trained tensors (EMA, DiffusionNFT's old policy).

:func:`set_up_trainable` is the one place a config's ``train.lora_*`` become trained parameters: the
trainer, ``flowrl sample`` / ``eval`` on a run and ``flowrl plan`` all call it.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Iterator, Optional, Sequence

import torch
from torch import nn

from .types import swapped_transformer
from .utils.sharded import host_copy

DEFAULT_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]


def add_lora(transformer: nn.Module, rank: int, alpha: float, targets: Optional[list[str]] = None) -> None:
    """Freeze ``transformer`` and add a LoRA adapter (peft, Gaussian init so B = 0: the policy
    starts exactly at the base model). The adapter's weights are kept in float32 whatever the base
    model's dtype (peft would create them in the base layer's bf16/fp16; Flow-GRPO's get_peft_model
    and diffusers' cast_training_params upcast them the same way), so small AdamW updates are not
    rounded away; peft casts the layer input to the adapter's dtype and the sum back."""
    from peft import LoraConfig

    transformer.requires_grad_(False)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian",
                     target_modules=list(targets or DEFAULT_LORA_TARGETS))
    try:
        transformer.add_adapter(cfg)
    except ValueError as e:
        raise ValueError(f"LoRA could not adapt modules {cfg.target_modules}: {e}. "
                         f"Set train.lora_targets to module names of this model.") from None
    for p in transformer.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()


def set_up_trainable(transformer: nn.Module, lora_rank: int, lora_alpha: float = 16.0,
                     targets: Optional[list[str]] = None, default_targets: Optional[Sequence[str]] = None,
                     seed: Optional[int] = None) -> nn.Module:
    """Make ``transformer``'s trained parameters as a recipe's ``train`` section asks: a LoRA of rank
    ``lora_rank`` (``lora_alpha``) on ``targets`` (``train.lora_targets``), else on
    ``default_targets`` (the adapter's ``lora_target_modules``), else :data:`DEFAULT_LORA_TARGETS`; or,
    at ``lora_rank == 0``, every weight (full fine-tune). With ``seed`` the LoRA init draws from
    ``torch.manual_seed(seed)`` inside a forked RNG (it depends on ``train.seed`` only and leaves the
    global generator alone). Returns ``transformer`` (changed in place)."""
    if lora_rank > 0:
        chosen = targets or (list(default_targets) if default_targets else None)
        if seed is None:
            add_lora(transformer, lora_rank, lora_alpha, chosen)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                add_lora(transformer, lora_rank, lora_alpha, chosen)
    else:
        transformer.requires_grad_(True)
    return transformer


def has_lora(transformer: nn.Module) -> bool:
    return any("lora_" in n for n, _ in transformer.named_parameters())


def trainable_state(transformer: nn.Module) -> dict[str, torch.Tensor]:
    """The trained tensors by name (LoRA weights, or every parameter in full fine-tuning)."""
    return {n: p.detach().clone() for n, p in transformer.named_parameters() if p.requires_grad}


def load_trainable_state(transformer: nn.Module, state: dict[str, torch.Tensor]) -> None:
    params = dict(transformer.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in state]
    unexpected = [n for n in state if n not in params]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match this model/config: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]} (was it written with another lora_rank or pipeline?)")
    with torch.no_grad():
        for n, t in state.items():
            if params[n].shape != t.shape:
                raise ValueError(f"checkpoint tensor {n} has shape {tuple(t.shape)}, model has {tuple(params[n].shape)}")
            if hasattr(params[n], "to_local") and hasattr(t, "to_local"):  # shards (an EMA in host memory too)
                params[n].to_local().copy_(t.to_local())
            else:
                params[n].copy_(t)


class Reference:
    """The KL reference: the same model with LoRA disabled (no second copy), or a frozen copy
    when fine-tuning all weights."""

    def __init__(self, transformer: nn.Module, need: bool):
        self.transformer = transformer
        self.copy = None
        if need and not has_lora(transformer):
            self.copy = copy.deepcopy(transformer).requires_grad_(False).eval()

    @contextlib.contextmanager
    def active(self, policy) -> Iterator[None]:
        """Inside, ``policy.velocity`` evaluates the reference model."""
        if self.copy is not None:
            with swapped_transformer(policy, self.copy):
                yield
        else:  # LoRA: the same module with its adapters off (a toggle, not a swap)
            self.transformer.disable_adapters()
            try:
                yield
            finally:
                self.transformer.enable_adapters()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s local shard (elementwise updates act shard by shard), anything else as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


class EMA:
    """Exponential moving average of the trained tensors (``ema <- d ema + (1 - d) theta``); with ``host``
    the average lives in host memory (``train.offload.ema``; FSDP shards stay shards)."""

    def __init__(self, transformer: nn.Module, decay: float, host: bool = False):
        self.decay = decay
        self.shadow = trainable_state(transformer)
        if host:
            self.shadow = {n: host_copy(t) for n, t in self.shadow.items()}

    @torch.no_grad()
    def update(self, transformer: nn.Module, decay: Optional[float] = None) -> None:
        d = self.decay if decay is None else decay
        for n, p in transformer.named_parameters():
            if n in self.shadow:
                s = _local(self.shadow[n])
                s.mul_(d).add_(_local(p.detach()).to(s.device), alpha=1 - d)

    @contextlib.contextmanager
    def applied(self, transformer: nn.Module) -> Iterator[None]:
        """Load the EMA weights into ``transformer`` for the duration (evaluation), then restore them
        (the module stays the same object: no transformer swap)."""
        backup = trainable_state(transformer)
        load_trainable_state(transformer, self.shadow)
        try:
            yield
        finally:
            load_trainable_state(transformer, backup)
