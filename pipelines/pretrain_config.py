"""The embedded worlds' pretraining settings (``flowrl pretrain-digits`` / ``pretrain-shapes``): plain
dataclasses, importable without torch (the command line prints their defaults in ``--help``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["PretrainConfig", "ShapesPretrainConfig"]


@dataclass
class PretrainConfig:
    """The digits base's pretraining (and every world's fields): AdamW steps of ``batch_size`` images,
    ``warmup`` warm-up steps then cosine decay from ``lr``, the prompt dropped with ``cond_dropout`` (for CFG);
    ``ema``: the decay of an exponential moving average of the weights, which is the saved base (0: the last
    weights; the average's decay warms up as ``min(ema, (1 + step) / (10 + step))``); ``t_mean``: the mean of the
    logit-normal training times (SD3's 0; below 0 trains more at low noise, where a small image's edges form);
    ``init``: continue from a saved base instead of random weights (a directory holding one, or the folder name of
    a cached base of the world, e.g. ``shapes-base-v2``, pretrained into the cache first when missing)."""

    steps: int = 600
    batch_size: int = 64
    lr: float = 1e-3
    cond_dropout: float = 0.1
    seed: int = 0
    max_seconds: Optional[float] = None  # stop early after this wall time (a budget, not a target)
    ema: float = 0.0
    t_mean: float = 0.0
    warmup: int = 100
    init: Optional[str] = None

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1 or not self.lr > 0:
            raise ValueError(f"steps, batch_size and lr must be positive, got {self}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0 steps, got {self.warmup}")
        if not 0 <= self.cond_dropout < 1:
            raise ValueError(f"cond_dropout must be in [0, 1), got {self.cond_dropout}")
        if not 0 <= self.ema < 1:
            raise ValueError(f"ema must be in [0, 1) (0: no average), got {self.ema}")


@dataclass
class ShapesPretrainConfig(PretrainConfig):
    """The shapes base's pretraining (docs/models.md: what it measures)."""

    steps: int = 6000
    batch_size: int = 32
    ema: float = 0.999
    t_mean: float = -1.0
