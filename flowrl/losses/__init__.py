"""Losses, one function each, one module per family. Shapes in docstrings; float32 math.

- ``grpo``: clipped-ratio surrogate and Gaussian-step KL (Flow-GRPO, SPEC 2-3)
- ``nft``: DiffusionNFT forward-process loss (Sol-RL's trainer, SPEC 6)
- ``gdro``: Plackett-Luce group loss, Diffusion-DPO, implicit rewards (SPEC 7)
"""
from .gdro import dpo_loss, gdro_loss, implicit_rewards
from .grpo import grpo_clipped_loss, kl_to_reference
from .nft import nft_loss

__all__ = ["grpo_clipped_loss", "kl_to_reference", "nft_loss", "gdro_loss", "dpo_loss", "implicit_rewards"]
