"""Losses, one function each, one module per family. Shapes in docstrings; float32 math.

- ``grpo``: clipped-ratio surrogate and Gaussian-step KL (Flow-GRPO, docs/algorithms.md §2-3)
- ``nft``: DiffusionNFT forward-process loss (Sol-RL's trainer, docs/algorithms.md §7)
- ``gdro``: Plackett-Luce group loss, Diffusion-DPO, implicit rewards (docs/algorithms.md §8)
"""
from .gdro import dpo_loss, gdro_loss, implicit_rewards
from .grpo import KL_FORMS, grpo_clipped_loss, kl_form_for_step, kl_to_reference
from .nft import nft_loss

__all__ = ["grpo_clipped_loss", "kl_to_reference", "kl_form_for_step", "KL_FORMS", "nft_loss", "gdro_loss", "dpo_loss", "implicit_rewards"]
