"""GRPO-Guard (arXiv 2510.22319): the regulated-clipping surrogate by hand, and a short digits run."""
import json
import math

import pytest
import torch

from conftest import tiny_train_overrides
from flowrl.losses import grpo_clipped_loss
from flowrl.trainers.config import load_config
from flowrl.errors import ConfigError
from flowrl.trainers.online import train
from flowrl.updates.grpo_guard import guard_clipped_loss

# two transitions, two elements each
LP, OLD = torch.tensor([-1.5, 0.2]), torch.tensor([0.0, 0.0])  # log r = logp - logp_old
MEAN, OLD_MEAN = torch.tensor([[1.0, 1.0], [0.3, -0.2]]), torch.tensor([[0.0, 0.0], [0.3, -0.2]])
STD, DT, ADV = torch.tensor([0.5, 0.1]), torch.tensor([-0.5, -0.25]), torch.tensor([1.0, -1.0])


def test_guard_loss_by_hand():
    loss, st = guard_clipped_loss(LP, OLD, MEAN, OLD_MEAN, STD, DT, ADV, clip_range=0.2)
    # row 0: b = mean(1, 1) / (2 * 0.25) = 2; r_hat = exp(0.5 * (-1.5 + 2)) = e^0.25 = 1.284 > 1.2:
    #        A = 1 -> max(-1.284, -1.2) = -1.2; / |dt| = 0.5 -> -2.4
    # row 1: b = 0; r_hat = exp(0.1 * 0.2) = e^0.02; A = -1 -> e^0.02 (inside the clip); / 0.25 -> 4 e^0.02
    want = (-2.4 + 4 * math.exp(0.02)) / 2
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert st["ratio_bias"].item() == pytest.approx(1.0)  # mean(2, 0)
    assert st["clip_fraction"].item() == pytest.approx(0.5)
    assert st["ratio_mean"].item() == pytest.approx((math.exp(0.25) + math.exp(0.02)) / 2, rel=1e-6)


def test_guard_parts_switch_off():
    no_rw, _ = guard_clipped_loss(LP, OLD, MEAN, OLD_MEAN, STD, DT, ADV, 0.2, reweight=False)
    assert no_rw.item() == pytest.approx((-1.2 + math.exp(0.02)) / 2, rel=1e-6)
    plain, _ = guard_clipped_loss(LP, OLD, MEAN, OLD_MEAN, STD, DT, ADV, 0.2, ratio_norm=False, reweight=False)
    grpo, _ = grpo_clipped_loss(LP, OLD, ADV, 0.2)
    assert plain.item() == pytest.approx(grpo.item(), rel=1e-7)  # both off: Flow-GRPO's clipped ratio


def test_normalised_ratio_is_the_noise_projection():
    """With x' = mu_old + s eps, s (log r + b) = mean(eps (mu - mu_old)) exactly: the left shift is gone."""
    g = torch.Generator().manual_seed(0)
    mu_old, mu, eps = (torch.randn(3, 8, generator=g) for _ in range(3))
    s = torch.tensor([0.3, 0.05, 1.0])
    x = mu_old + s[:, None] * eps

    def logp(m):
        return (-((x - m) ** 2) / (2 * s[:, None] ** 2) - torch.log(s[:, None]) - 0.5 * math.log(2 * math.pi)).mean(1)

    _, st = guard_clipped_loss(logp(mu), logp(mu_old), mu, mu_old, s, torch.full((3,), -0.1), torch.zeros(3), 0.2)
    want = torch.exp((eps * (mu - mu_old)).mean(1)).mean()
    assert st["ratio_mean"].item() == pytest.approx(want.item(), rel=1e-5)


def test_deterministic_rows_have_ratio_one():
    loss, st = guard_clipped_loss(torch.zeros(1), torch.zeros(1), torch.ones(1, 2), torch.zeros(1, 2), torch.zeros(1),
                                  torch.tensor([-0.1]), torch.ones(1), 0.2, reweight=False)
    assert st["ratio_mean"].item() == 1.0 and loss.item() == -1.0


def test_grpo_guard_trains_digits(tiny_digits_dir, tmp_path):
    run = tmp_path / "run"
    cfg = load_config("recipes/digits.yaml", tiny_train_overrides(
        tiny_digits_dir, **{"train.loss": "grpo_guard", "train.lr": 1e-2, "train.iterations": 2}))
    train(cfg, run)
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    tr = [r for r in recs if "reward_mean" in r]
    assert [r["iteration"] for r in tr] == [0, 1]
    assert all(math.isfinite(r["loss"]) and "ratio_bias" in r for r in tr)
    assert 0 <= tr[0]["ratio_bias"] < 1e-2  # the first update starts at new == old policy (bias 0)


def test_grpo_guard_options_are_checked():
    with pytest.raises(ConfigError, match="Did you mean train.loss_options.reweight"):
        load_config("recipes/digits.yaml", ["train.loss=grpo_guard", "train.loss_options={reweigth: false}"])
