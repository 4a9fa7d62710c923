"""DPM-Solver++(2M) for rectified flow and its use after the SDE window (MixGRPO-Flash).

The solver is checked on a 1-D Gaussian data distribution, whose exact velocity is known in
closed form and whose probability-flow ODE maps noise ``eps`` to ``m + c eps`` exactly."""
import pytest
import torch

from flowrl.ode_solvers import compressed_sigmas, data_prediction, dpmpp_2m_step
from flowrl.rollout.group import GroupSampler

M, C = 0.7, 1.0  # data ~ N(M, C^2)


def gaussian_velocity(x: torch.Tensor, s: float) -> torch.Tensor:
    """Exact v = E[eps - x0 | x_s] for x0 ~ N(M, C^2): E[x0 | x] = M + (1-s) C^2 / ((1-s)^2 C^2 + s^2) (x - (1-s) M)."""
    a = 1.0 - s
    x0 = M + a * C * C / (a * a * C * C + s * s) * (x - a * M)
    return (x - x0) / s


def solve(eps: torch.Tensor, steps: int, solver: str) -> torch.Tensor:
    sig = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64).tolist()
    x, x0_prev, s_prev = eps.double(), None, None
    for s, sn in zip(sig[:-1], sig[1:]):
        v = gaussian_velocity(x, s)
        if solver == "euler":
            x = x + (sn - s) * v
        else:
            x0 = x - s * v
            x = dpmpp_2m_step(x, x0, s, sn, x0_prev, s_prev).double()
            x0_prev, s_prev = x0, s
    return x


def test_dpmpp_2m_is_second_order_on_gaussian_data():
    eps = torch.linspace(-2.5, 2.5, 101, dtype=torch.float64)
    exact = M + C * eps  # the 1-D flow preserves quantiles
    err = {(k, n): (solve(eps, n, k) - exact).abs().max().item() for k in ("euler", "dpmpp_2m") for n in (12, 24, 48, 96)}
    # measured: Euler 0.255 / 0.130 / 0.066 / 0.033, 2M 0.0059 / 0.0048 / 0.0015 / 0.0004 (max abs error)
    assert err[("dpmpp_2m", 12)] < 0.2 * err[("euler", 48)]  # a quarter of the evaluations, 5x more accurate
    assert err[("dpmpp_2m", 96)] / err[("dpmpp_2m", 24)] < 0.15  # second order: ~1/16 for 4x the steps
    assert err[("euler", 96)] / err[("euler", 24)] > 0.2  # first order: ~1/4


def test_first_order_step_equals_euler_and_lands_on_x0():
    torch.manual_seed(0)
    x, v = torch.randn(3, 4), torch.randn(3, 4)
    x0 = data_prediction(x, v, 0.6)
    torch.testing.assert_close(dpmpp_2m_step(x, x0, 0.6, 0.45), x + (0.45 - 0.6) * v, rtol=0, atol=1e-6)
    assert torch.equal(dpmpp_2m_step(x, x0, 0.2, 0.0, x0_prev=torch.zeros_like(x), sigma_prev=0.4), x0)
    with pytest.raises(ValueError, match="sigma_next < sigma"):
        dpmpp_2m_step(x, x0, 0.3, 0.5)


def test_compressed_sigmas():
    s = torch.linspace(1, 0, 11)
    assert compressed_sigmas(s, 2, 3) == [2, 5, 7, 10]
    assert compressed_sigmas(s, 2, None) == list(range(2, 11)) == compressed_sigmas(s, 2, 50)


def test_flash_keeps_window_transitions_and_saves_evaluations(tiny_digits_policy, counting):
    prompts = ["a handwritten digit 3", "a handwritten digit 5"]
    base = dict(group_size=2, num_steps=10, step="sde", sde_window=2, window_start=1)
    runs = {}
    for name, extra in {"euler": {}, "flash": {"ode_solver": "dpmpp_2m", "post_window_steps": 3}}.items():
        pol = counting(tiny_digits_policy)
        runs[name] = (GroupSampler(**base, **extra)(pol, prompts, seed=3), pol.rows)
    (a, rows_a), (b, rows_b) = runs["euler"], runs["flash"]
    assert rows_a == 10 * 4 and rows_b == (3 + 3) * 4  # steps 0-2 (window 1-2), then 3 thinned ODE steps
    ta, tb = a.transitions, b.transitions
    assert torch.equal(ta.step, tb.step) and set(ta.step.tolist()) == {1, 2}
    for f in ("latents", "next_latents", "old_log_prob", "sigma", "sigma_next"):
        assert torch.equal(getattr(ta, f), getattr(tb, f)), f
    assert not torch.equal(a.x0, b.x0) and torch.isfinite(b.x0).all()
    assert (a.x0 - b.x0).abs().mean() < 0.5 * a.x0.abs().mean()  # same images, up to the coarser ODE


def test_flash_options_are_checked():
    with pytest.raises(ValueError, match="set sde_window too"):
        GroupSampler(post_window_steps=3)
    with pytest.raises(ValueError, match="ode_solver must be one of"):
        GroupSampler(ode_solver="heun")
