"""The SANA adapter against diffusers' own ``SanaPipeline`` loop on the tiny offline model: same
prompts (complex human instruction prefix included), same initial noise, guidance 4.5, Euler on
the same schedule -> the same final latents. This pins the time input (``sigma * 1000``), the
velocity sign and the CFG order."""
import pytest
import torch

from flowrl.pipelines.sana import SanaPolicy
from flowrl.pipelines.tiny import make_tiny
from helpers import PROMPTS, ode_loop

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


def test_ode_matches_sana_pipeline(tmp_path):
    path = make_tiny("sana", tmp_path / "sana", image_size=32)
    policy = SanaPolicy.from_pretrained(path, max_sequence_length=8, guidance_scale=4.5)
    assert policy.latent_shape == (4, 8, 8) and len(policy.complex_human_instruction) > 0
    seeds, steps = [5, 6], 3
    ours = ode_loop(policy, PROMPTS, seeds, steps)  # [B, C, h, w]
    ref = policy.pipe(PROMPTS, latents=policy.initial_noise(seeds), num_inference_steps=steps, guidance_scale=4.5,
                      height=32, width=32, max_sequence_length=8, output_type="latent",
                      use_resolution_binning=False).images
    torch.testing.assert_close(ours, ref.float(), atol=2e-5, rtol=1e-5)
