"""Per-sample randomness: every random draw of a sample depends only on its seed.

So a sample is the same whatever else is in its batch, and "regenerate seed s at full
precision" (Sol-RL) or "resume at step k" reproduce it exactly.

Where the draws are made: on the CPU for CPU tensors (the values flowrl has always produced), on
the target device otherwise (``device="cuda"``: one CUDA generator per row, no host-side draw and
no host-to-device copy). A CUDA draw differs from the CPU draw of the same seed but still depends
only on (seed, stream, shape) on a given GPU model: torch's CUDA Philox generator lays its draws
out by the launch grid, which follows the GPU's multiprocessor count.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

_SEED_MUL, _STREAM_MUL, _SEED_MOD = 1_000_003, 7919, 2**63 - 1


def derive_seeds(seed: int, count: int) -> list[int]:
    """``count`` distinct 31-bit seeds derived from one integer (numpy SeedSequence)."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    return [int(s) & 0x7FFFFFFF for s in np.random.SeedSequence(int(seed)).generate_state(count)]


def row_generator_seed(seed: int, stream: int) -> int:
    """The generator seed of one (sample seed, stream) pair (a 63-bit integer)."""
    return (int(seed) * _SEED_MUL + int(stream) * _STREAM_MUL) % _SEED_MOD


def seeded_randn_rows(seeds: Sequence[int], streams: Sequence[int], shape: tuple[int, ...],
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """``[len(seeds), *shape]`` float32 standard normal; row i depends only on (seeds[i], streams[i]).

    Each row is drawn by its own generator straight into the output (no stacking copy), on the
    CPU for a CPU ``device`` and on ``device`` itself otherwise (module doc).
    """
    if len(seeds) != len(streams):
        raise ValueError(f"got {len(seeds)} seeds but {len(streams)} streams; pass one stream per seed")
    dev = torch.device(device)
    out = torch.empty((len(seeds), *shape), dtype=torch.float32, device=dev)  # [B, *shape]
    for i, (s, st) in enumerate(zip(seeds, streams)):
        g = torch.Generator(device=dev).manual_seed(row_generator_seed(s, st))
        out[i].normal_(generator=g)  # = torch.randn(shape, generator=g) for this row
    return out


def seeded_randn(seeds: list[int], shape: tuple[int, ...], stream: int = 0,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """``[len(seeds), *shape]`` float32 standard normal; row i depends only on (seeds[i], stream).

    ``stream`` separates independent draws of one sample (0: initial noise, 1 + i: step i).
    """
    return seeded_randn_rows(list(seeds), [stream] * len(seeds), shape, device)  # [B, *shape]
