"""Named seed streams (flowrl.seeding.stream_seed): the legacy formulas, bit for bit, and their bounds."""
import itertools

import numpy as np
import pytest
import torch

from flowrl.seeding import LEGACY_OVERLAPS, PURPOSES, derive_seeds, stream_input, stream_seed, stream_sequence


@pytest.mark.parametrize("seed,it", [(0, 0), (0, 5), (3, 17), (12345, 999)])
def test_purposes_equal_the_legacy_formulas(seed, it):
    for world in (1, 2, 8):
        for rank in range(world):
            assert stream_seed("rollout", seed, it, rank, world) == derive_seeds(seed * 1_000_003 + it, world)[rank]
    for epoch in range(4):
        assert stream_seed("shuffle.grpo", seed, it, epoch) == derive_seeds(seed * 7919 + it, epoch + 1)[-1]
        assert stream_seed("shuffle.nft", seed, it, epoch) == derive_seeds(seed * 7919 + it, epoch + 2)[-1]
        assert stream_seed("shuffle.preference", seed, it, epoch) == derive_seeds(seed * 7919 + it, epoch + 3)[-1]
        assert stream_seed("offline.order", seed, epoch) == int(
            np.random.SeedSequence([seed, epoch, 17]).generate_state(1)[0])
        assert stream_seed("offline.noise", seed, it, epoch, 1) == int(
            np.random.SeedSequence([seed, it, epoch, 1, 5]).generate_state(1)[0])
    assert stream_seed("sol.selection", seed) == derive_seeds(seed * 7919 + 17, 1)[0]
    a = np.random.default_rng(stream_sequence("prompts", seed, it, 1)).choice(100, size=5)
    b = np.random.default_rng([seed, it, 1, 1]).choice(100, size=5)
    assert (a == b).all()
    g1 = torch.Generator().manual_seed(stream_seed("shuffle.grpo", seed, it, 0))
    g2 = torch.Generator().manual_seed(int(derive_seeds(seed * 7919 + it, 1)[-1]))
    assert torch.equal(torch.randperm(50, generator=g1), torch.randperm(50, generator=g2))


def _declared(a: str, b: str) -> bool:
    return any({a, b} == {x, y} for x, y, _ in LEGACY_OVERLAPS)


@pytest.mark.parametrize("seed", [0, 1, 7, 2**31 - 1])
def test_distinct_streams_never_share_an_input_for_one_train_seed(seed):
    """Inside the documented key ranges, for one train.seed, no two (purpose, keys) share a generator
    input (SeedSequence entropy, word), except the legacy overlaps declared in LEGACY_OVERLAPS."""
    keys = {"iteration": [0, 1, 2, 17, 7918, 7919, 2**19 - 1], "epoch": [0, 1, 2, 3, 2**10 - 1],
            "rank": [0, 1, 3], "world": [4], "step": [0, 1, 17, 2**31 - 1], "micro": [0, 1, 5]}
    seen: dict = {}
    for name, p in PURPOSES.items():
        if "seed" not in p.keys:
            continue  # sol.selection is keyed by a rollout seed, not train.seed
        grids = [[seed] if k == "seed" else keys[k] for k in p.keys]
        for combo in itertools.product(*grids):
            inp = stream_input(name, *combo)
            inp = (tuple(inp[0]) if isinstance(inp[0], tuple) else ("int", inp[0]), inp[1])
            if inp in seen and seen[inp][0] != name:
                other = seen[inp][0]
                assert _declared(name, other), f"{name}{combo} collides with {other}{seen[inp][1]}"
                if "rollout" in (name, other):
                    assert seed == 0
            else:
                assert inp not in seen or seen[inp] == (name, combo), f"{name}: {combo} and {seen[inp][1]} collide"
            seen.setdefault(inp, (name, combo))


@pytest.mark.parametrize("purpose,keys,match", [
    ("shuffle.grpo", (0, -1, 0), "iteration=-1 is outside"),
    ("shuffle.grpo", (0, 2**19, 0), "iteration=524288 is outside"),
    ("shuffle.nft", (0, 1, 2**10), "epoch=1024 is outside"),
    ("rollout", (0, 1, 2, 2), "rank must be < world"),
    ("rollout", (0, 1, 0), "takes keys"),
    ("shuffle.grpq", (0, 1, 0), "Did you mean 'shuffle.grpo'"),
])
def test_out_of_range_keys_raise(purpose, keys, match):
    with pytest.raises(ValueError, match=match):
        stream_seed(purpose, *keys)
