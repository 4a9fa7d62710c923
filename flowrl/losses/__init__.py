"""Losses, one function each, one module per family. Shapes in docstrings; float32 math.

- ``grpo``: clipped-ratio surrogate and Gaussian-step KL (Flow-GRPO, docs/algorithms.md §2-3)
- ``nft``: DiffusionNFT forward-process loss (Sol-RL's trainer, docs/algorithms.md §7)
- ``gdro``: Plackett-Luce group loss, Diffusion-DPO, implicit rewards (docs/algorithms.md §8)
- ``flow_matching``: training-time sampling and helpers shared by AWM and DGPO (docs/algorithms.md §11-12)
- ``awm``: Advantage Weighted Matching (docs/algorithms.md §11)
- ``dgpo``: Direct Group Preference Optimization (docs/algorithms.md §12)
- ``dppo``: Flow-DPPO's KL-masked policy gradient (docs/algorithms.md §13)
- ``gardo``: GARDO's gated KL, reference refresh, diversity-aware advantages (docs/algorithms.md §14)
"""
from .awm import AWMOptions, awm_log_prob, awm_loss
from .dgpo import DGPOOptions, dgpo_loss
from .dppo import dppo_loss, transition_kl
from .flow_matching import TimeSampling, sample_times
from .gdro import dpo_loss, gdro_loss, implicit_rewards
from .grpo import KL_FORMS, grpo_clipped_loss, kl_form_for_step, kl_to_reference
from .nft import nft_loss

__all__ = ["grpo_clipped_loss", "kl_to_reference", "kl_form_for_step", "KL_FORMS", "nft_loss", "gdro_loss", "dpo_loss", "implicit_rewards",
           "AWMOptions", "awm_log_prob", "awm_loss", "DGPOOptions", "dgpo_loss", "dppo_loss", "transition_kl",
           "TimeSampling", "sample_times"]
