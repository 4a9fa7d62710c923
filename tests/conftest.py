import os
import tempfile

import pytest
import torch

# Tests never touch the user's cache: a per-session FLOWRL_HOME unless the caller set one.
os.environ.setdefault("FLOWRL_HOME", tempfile.mkdtemp(prefix="flowrl-test-home-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny-model tests (modules opt in with ``pytestmark``): a
    second thread only adds synchronisation on tiny matrices and oversubscribes shared CI cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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


@pytest.fixture(scope="session")
def tiny_digits_dir(tmp_path_factory):
    """A random-init 1-layer digits model saved with save_pretrained (loaded by path in configs)."""
    from diffusers import SD3Transformer2DModel

    from flowrl.pipelines.digits import DigitsPolicy, DigitTextEncoder, tiny_transformer_config

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-digits")
    DigitsPolicy(SD3Transformer2DModel(**{**tiny_transformer_config(), "num_layers": 1}),
                 DigitTextEncoder()).save_pretrained(path)
    return path


def tiny_train_overrides(path, **extra) -> list[str]:
    """Overrides that make the digits recipe run in seconds on a tiny model."""
    base = {"model.path": str(path), "train.iterations": 3, "train.batch_size": 16, "sampler.group_size": 4,
            "sampler.num_steps": 4, "train.minibatch_size": 16, "train.grad_accum": 2, "logging.eval_every": 2,
            "logging.image_every": 2, "data.eval_seeds_per_prompt": 2, "logging.trackers": "[]",
            "logging.progress": "false", "train.checkpoint_every": 1, "reward.heldout": "{}"}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture(scope="session")
def pretrained_digits_base():
    """The real digits base in $FLOWRL_HOME (pretrained once per session, ~1.5 min on 2 idle cores;
    reused when FLOWRL_HOME points at a cache that already has it)."""
    from flowrl.pipelines.digits import default_base_path, pretrain_digits

    path = default_base_path()
    if not (path / "transformer").is_dir():
        pretrain_digits(path, progress=False)
    return path
