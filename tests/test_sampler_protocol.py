"""Every registered sampler satisfies flowrl.types.Sampler with real values (no attribute probing
needed by callers), and every rollout carries a typed structure record."""
import inspect

import pytest

from flowrl.registry import SAMPLERS
from flowrl.types import SAMPLER_MEMBERS, Sampler, check_sampler

# the smallest valid configuration of each sampler (defaults otherwise)
SMALL = {"group": {}, "branch": {}, "tempflow": {}, "ode": {},
         "sol": {"explore_backend": "none", "pool_size": 4, "keep": 2}}


@pytest.mark.parametrize("name", SAMPLERS.names())
def test_registered_sampler_satisfies_protocol(name):
    assert name in SMALL, f"add a small configuration of the new sampler {name!r} to SMALL"
    sampler = SAMPLERS.get(name)(**SMALL[name])
    assert isinstance(sampler, Sampler)
    check_sampler(sampler)
    spp, steps, stores = sampler.samples_per_prompt, sampler.num_steps, sampler.stores_transitions
    assert isinstance(spp, int) and not isinstance(spp, bool) and spp >= 1
    assert isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1
    assert isinstance(stores, bool)
    assert sampler.check_available() is None  # runs here (the CPU backends)
    params = inspect.signature(sampler.__call__).parameters
    assert list(params)[:4] == ["policy", "prompts", "reward", "seed"]
    assert params["reward"].default is None and params["seed"].default == 0
    for kw in ("iteration", "seeds"):
        assert params[kw].kind is inspect.Parameter.KEYWORD_ONLY, (name, kw)


def test_stores_transitions_values():
    values = {n: SAMPLERS.get(n)(**SMALL[n]).stores_transitions for n in SAMPLERS.names()}
    assert values == {"group": True, "branch": True, "tempflow": True, "ode": False, "sol": True}
    assert SAMPLERS.get("sol")(**SMALL["sol"], regen="ode").stores_transitions is False


def test_check_sampler_names_missing_members():
    class Half:
        num_steps = 4

        def __call__(self, policy, prompts, reward=None, seed=0):
            return None

    assert not isinstance(Half(), Sampler)
    with pytest.raises(TypeError, match="lacks \\['samples_per_prompt', 'stores_transitions', 'check_available'\\]"):
        check_sampler(Half())


def test_check_sampler_lists_every_protocol_member():
    """``check_sampler`` probes exactly what the ``Sampler`` Protocol declares: its attributes and
    its methods (a member added to the Protocol but not to ``SAMPLER_MEMBERS`` fails here)."""
    declared = set(Sampler.__annotations__) | {
        n for n, v in vars(Sampler).items() if callable(v) and (n == "__call__" or not n.startswith("_"))}
    assert set(SAMPLER_MEMBERS) == declared and len(SAMPLER_MEMBERS) == len(declared)

