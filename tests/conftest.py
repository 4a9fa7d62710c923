import os
import tempfile

import pytest
import torch

# Tests never touch the user's cache: a per-session FLOWRL_HOME unless the caller set one.
os.environ.setdefault("FLOWRL_HOME", tempfile.mkdtemp(prefix="flowrl-test-home-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def tiny_digits_policy():
    """A random-init digits policy (no pretraining): for mechanics, not quality."""
    from diffusers import SD3Transformer2DModel

    from flowrl.pipelines.digits import DigitsPolicy, DigitTextEncoder, tiny_transformer_config

    torch.manual_seed(0)
    cfg = {**tiny_transformer_config(), "num_layers": 1}
    return DigitsPolicy(SD3Transformer2DModel(**cfg).eval(), DigitTextEncoder().eval())


class CountingPolicy:
    """Wraps a policy and counts the latent rows it evaluates."""

    def __init__(self, policy):
        self.inner, self.rows, self.calls = policy, 0, 0
        self.transformer = policy.transformer

    def velocity(self, latents, sigma, cond):
        self.rows += latents.shape[0]
        self.calls += 1
        return self.inner.velocity(latents, sigma, cond)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture
def counting():
    return CountingPolicy
