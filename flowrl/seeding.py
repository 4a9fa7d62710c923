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

import difflib
from dataclasses import dataclass
from typing import Callable, Sequence

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


# ---------------------------------------------------------------- named streams
# Every seed flowrl derives for a purpose (rollout seeds, update shuffles, offline noise, ...) comes
# from one registered purpose below, which computes exactly the formula that purpose has always used
# (so published numbers reproduce bit for bit). A purpose's keys are range-checked: inside the ranges,
# distinct keys of one purpose give distinct generator inputs (SeedSequence entropy + word), and for
# one train.seed distinct purposes do too, except the legacy overlaps listed in LEGACY_OVERLAPS.

KEY_RANGES = {"seed": (0, 2**42), "iteration": (0, 2**19), "epoch": (0, 2**10), "rank": (0, 2**16),
              "world": (1, 2**16 + 1), "step": (0, 2**31), "micro": (0, 2**16), "rollout_seed": (0, 2**48)}
"""key name -> [low, high) accepted by :func:`stream_seed` (a key outside raises ValueError)."""

_ITER_SALT, _SHUFFLE_SALT = 1_000_003, 7919  # legacy multipliers (rollout seeds / update shuffles)


@dataclass(frozen=True)
class Purpose:
    """A named random stream: ``keys`` (names in :data:`KEY_RANGES`) -> ``source(*keys)`` =
    (SeedSequence entropy, words generated, word used, mask to 31 bits)."""

    keys: tuple
    source: Callable[..., tuple]
    doc: str


PURPOSES: dict[str, Purpose] = {
    "rollout": Purpose(("seed", "iteration", "rank", "world"),
                       lambda s, it, r, w: (s * _ITER_SALT + it, w, r, True),
                       "the sampler seed of process `rank` of `world` at an online iteration"),
    "shuffle.grpo": Purpose(("seed", "iteration", "epoch"),
                            lambda s, it, e: (s * _SHUFFLE_SALT + it, e + 1, e, True),
                            "GRPO update: the epoch's minibatch shuffle"),
    "shuffle.nft": Purpose(("seed", "iteration", "epoch"),
                           lambda s, it, e: (s * _SHUFFLE_SALT + it, e + 2, e + 1, True),
                           "DiffusionNFT update: the epoch's shuffle, times and noise"),
    "shuffle.preference": Purpose(("seed", "iteration", "epoch"),
                                  lambda s, it, e: (s * _SHUFFLE_SALT + it, e + 3, e + 2, True),
                                  "online DPO / GDRO update: the epoch's shuffle, times and noise"),
    "shuffle.update": Purpose(("seed", "iteration", "epoch"), lambda s, it, e: ((s, it, e, 23), 1, 0, False),
                              "any other update (flowrl.updates.base.Batch's default): the epoch's shuffle and "
                              "draws"),
    "update.draws": Purpose(("seed", "iteration", "epoch"), lambda s, it, e: ((s, it, e, 29), 1, 0, False),
                            "an update's random tensors drawn in its batch(), before any optimizer step of the call "
                            "(AWM: the times and noise whose old log-probs need the sampling weights)"),
    "sol.selection": Purpose(("rollout_seed",), lambda s: (s * _SHUFFLE_SALT + 17, 1, 0, True),
                             "Sol-RL: the random pick among the candidate pool"),
    "prompts": Purpose(("seed", "iteration", "rank"), lambda s, it, r: ((s, it, r, 1), 1, 0, False),
                       "an online iteration's prompts (numpy default_rng(stream_sequence(...)))"),
    "offline.noise": Purpose(("seed", "step", "micro", "rank"), lambda s, st, m, r: ((s, st, m, r, 5), 1, 0, False),
                             "offline GDRO: the shared (t, eps) of a pass's groups"),
    "offline.order": Purpose(("seed", "epoch"), lambda s, e: ((s, e, 17), 1, 0, False),
                             "offline dataset: an epoch's group order"),
}

# (purpose a, purpose b, when): their generator inputs coincide, kept for bit-identical legacy values.
LEGACY_OVERLAPS = (
    ("shuffle.grpo", "shuffle.nft", "epoch e+1 of one = epoch e of the other; one train.loss runs per run"),
    ("shuffle.nft", "shuffle.preference", "epoch e+1 of one = epoch e of the other; one train.loss runs per run"),
    ("shuffle.grpo", "shuffle.preference", "epoch e+2 of one = epoch e of the other; one train.loss runs per run"),
    ("rollout", "shuffle.grpo", "train.seed = 0 only: rollout (it, rank r) = grpo (it, epoch r); a sampler seed "
                                "and a permutation seed, never the same draw"),
    ("rollout", "shuffle.nft", "train.seed = 0 only, as above"),
    ("rollout", "shuffle.preference", "train.seed = 0 only, as above"),
)


def _check_keys(purpose: str, keys: tuple) -> Purpose:
    if purpose not in PURPOSES:
        close = difflib.get_close_matches(purpose, PURPOSES, n=1)
        raise ValueError(f"unknown seed purpose {purpose!r}." + (f" Did you mean {close[0]!r}?" if close else "")
                         + f" Registered: {', '.join(sorted(PURPOSES))}")
    p = PURPOSES[purpose]
    if len(keys) != len(p.keys):
        raise ValueError(f"seed purpose {purpose!r} takes keys {p.keys}, got {len(keys)} values")
    for name, v in zip(p.keys, keys):
        lo, hi = KEY_RANGES[name]
        if isinstance(v, bool) or int(v) != v or not lo <= int(v) < hi:
            raise ValueError(f"seed purpose {purpose!r}: {name}={v!r} is outside [{lo}, {hi}), where its streams "
                             f"are guaranteed distinct")
    if "rank" in p.keys and "world" in p.keys and not keys[p.keys.index("rank")] < keys[p.keys.index("world")]:
        raise ValueError(f"seed purpose {purpose!r}: rank must be < world, got {keys}")
    return p


def stream_input(purpose: str, *keys: int) -> tuple:
    """The generator input of ``(purpose, keys)``: (SeedSequence entropy, word index)."""
    entropy, _, word, _ = _check_keys(purpose, keys).source(*(int(k) for k in keys))
    return entropy, word


def stream_sequence(purpose: str, *keys: int) -> np.random.SeedSequence:
    """The numpy SeedSequence of ``(purpose, keys)`` (for ``np.random.default_rng``)."""
    entropy, _, _, _ = _check_keys(purpose, keys).source(*(int(k) for k in keys))
    return np.random.SeedSequence(list(entropy) if isinstance(entropy, tuple) else int(entropy))


def stream_seed(purpose: str, *keys: int) -> int:
    """The integer seed of ``(purpose, keys)``, e.g. ``stream_seed("shuffle.grpo", seed, it, epoch)``:
    exactly the value the purpose's legacy formula gave (see :data:`PURPOSES`)."""
    _, count, word, mask = _check_keys(purpose, keys).source(*(int(k) for k in keys))
    v = int(stream_sequence(purpose, *keys).generate_state(count)[word])
    return v & 0x7FFFFFFF if mask else v
