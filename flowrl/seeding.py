"""Per-sample randomness: every random draw of a sample depends only on its seed.

So a sample is the same whatever else is in its batch, and "regenerate seed s at full
precision" (Sol-RL) or "resume at step k" reproduce it exactly.
"""
from __future__ import annotations

import numpy as np
import torch


def derive_seeds(seed: int, count: int) -> list[int]:
    """``count`` distinct 31-bit seeds derived from one integer (numpy SeedSequence)."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    return [int(s) & 0x7FFFFFFF for s in np.random.SeedSequence(int(seed)).generate_state(count)]


def seeded_randn(seeds: list[int], shape: tuple[int, ...], stream: int = 0,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """``[len(seeds), *shape]`` float32 standard normal; row i depends only on (seeds[i], stream).

    ``stream`` separates independent draws of one sample (0: initial noise, 1 + i: step i).
    """
    rows = []
    for s in seeds:
        g = torch.Generator(device="cpu").manual_seed((int(s) * 1_000_003 + int(stream) * 7919) % (2**63 - 1))
        rows.append(torch.randn(shape, generator=g, dtype=torch.float32))
    if not rows:
        return torch.zeros((0, *shape), device=device)
    return torch.stack(rows).to(device)  # [B, *shape]
