import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from flowrl.schedules import flow_sigmas, flux_mu, flux_sigmas


@pytest.mark.parametrize("steps", [1, 2, 10, 20, 28, 50])
@pytest.mark.parametrize("shift", [1.0, 3.0, 0.5, 7.0])
def test_diffusers_schedule_equals_scheduler(steps, shift):
    sch = FlowMatchEulerDiscreteScheduler(shift=shift)
    sch.set_timesteps(steps)
    ours = flow_sigmas(steps, shift)
    assert ours.dtype == torch.float32 and ours.shape == (steps + 1,)
    assert torch.equal(ours, sch.sigmas)


def test_spec_figure_sigma_min_shift3():
    s = flow_sigmas(10, 3.0)
    assert s[-1] == 0 and s[0] == 1
    assert abs(s[-2].item() - 0.0089) < 1e-4  # docs/algorithms.md: 1/1000 shifted twice


def test_linear_schedule():
    s = flow_sigmas(4, 1.0, kind="linear")
    assert torch.allclose(s, torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))
    s3 = flow_sigmas(20, 3.0, kind="linear")
    t = 0.5
    assert abs(s3[10].item() - 3 * t / (1 + 2 * t)) < 1e-6


@pytest.mark.parametrize("steps", [4, 28])
@pytest.mark.parametrize("seq", [64, 1024, 4096])
def test_flux_dynamic_shift_equals_pipeline_schedule(steps, seq):
    sch = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_image_seq_len=256,
                                          max_image_seq_len=4096, base_shift=0.5, max_shift=1.15)
    sch.set_timesteps(steps, sigmas=np.linspace(1.0, 1 / steps, steps), mu=flux_mu(seq))
    assert torch.equal(flux_sigmas(steps, seq), sch.sigmas)


def test_bad_input():
    with pytest.raises(ValueError, match="unknown schedule kind"):
        flow_sigmas(10, kind="cosine")
    with pytest.raises(ValueError, match="positive integer"):
        flow_sigmas(0)
    with pytest.raises(ValueError, match="shift"):
        flow_sigmas(10, shift=0)
