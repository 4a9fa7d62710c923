"""The Z-Image adapter against diffusers' own ``ZImagePipeline`` on the tiny offline model (``flowrl make-tiny
z-image``): the Qwen3 template and per-prompt token lengths, flowrl's deterministic ODE loop
(``flowrl.rollout.ode.ode_sample``) equals the pipeline's loop (list inputs, time ``(1000 - t) / 1000``, the
negated x0 - noise prediction, the static-shift schedule): bit-equal without guidance, within float32 round-off
with it (flowrl combines ``u + s (c - u)``, the pipeline ``pos + (s - 1) (pos - neg)``); Z-Image-Turbo's published
scheduler (static shift 3) and 8 steps; a LoRA written by ``flowrl export``'s writer loads with
``load_lora_weights``, moves the output and still equals flowrl's loop; the Z-Image-Turbo recipe trains two GRPO
iterations and its export is the trained policy. Shapes, save / load and LoRA targets are in the contract
battery (tests/test_policy_contract.py), every other sampler and update in tests/test_model_matrix.py."""
import pytest
import torch

from flowrl.pipelines.z_image import ZImagePolicy
from flowrl.rollout.ode import ode_sample
from model_parity import assert_export_is_the_trained_policy, exported_lora

PROMPTS = ["a photo of a cat", "a red apple on a table"]
SEEDS, STEPS, SEQ, SIZE = [5, 6], 3, 16, 32

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("z-image")  # conftest: one build per session, 32 px (SIZE)


def _pipeline(pipe, policy, output_type: str, steps: int = STEPS):
    """The pipeline's own loop from flowrl's initial noise; its guidance_scale is flowrl's minus 1. (A fresh
    prompt list: ZImagePipeline.encode_prompt writes the templated prompts into the list it is given.)"""
    return pipe(prompt=list(PROMPTS), latents=policy.initial_noise(SEEDS), num_inference_steps=steps, height=SIZE,
                width=SIZE, max_sequence_length=SEQ, guidance_scale=policy.guidance_scale - 1,
                output_type=output_type).images


def test_template_and_prompt_lengths(tiny):
    policy = ZImagePolicy.from_pretrained(tiny, max_sequence_length=SEQ, guidance_scale=1.0)
    tok = policy.pipe.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], tokenize=False,
                                   add_generation_prompt=True, enable_thinking=True)
    assert text == "<|im_start|>user\na photo of a cat<|im_end|>\n<|im_start|>assistant\n"  # Qwen3's, thinking on
    cond = policy.encode_prompts(PROMPTS)
    assert set(cond) == {"prompt_embeds", "prompt_embeds_mask"} and cond["prompt_embeds"].shape == (2, SEQ, 16)
    assert cond["prompt_embeds_mask"].sum(1).tolist() == [3 + 5 + 5, SEQ]  # template + prompt; the second cut at SEQ
    assert not cond["prompt_embeds"][0, 13:].any()  # zero past the prompt's own tokens


def test_ode_matches_the_z_image_pipeline(tiny, tmp_path):
    policy = ZImagePolicy.from_pretrained(tiny, max_sequence_length=SEQ, guidance_scale=1.0)  # Turbo's: none
    assert policy.latent_shape == (16, 4, 4) and policy.cfg_scale == 1.0
    ours, images = ode_sample(policy, PROMPTS, SEEDS, STEPS)  # [B, 16, 4, 4], [B, 3, 32, 32]
    pipe = policy.pipe
    ref = _pipeline(pipe, policy, "latent")
    assert torch.equal(policy.sigmas(STEPS), pipe.scheduler.sigmas.float())  # Z-Image's static shift 6
    torch.testing.assert_close(ours, ref, atol=0, rtol=0)  # bit-equal
    torch.testing.assert_close(images, _pipeline(pipe, policy, "pt"), atol=0, rtol=0)
    guided = ZImagePolicy.from_pretrained(tiny, max_sequence_length=SEQ, guidance_scale=5.0)  # the pipeline's g = 4
    x_guided, _ = ode_sample(guided, PROMPTS, SEEDS, STEPS)
    torch.testing.assert_close(x_guided, _pipeline(guided.pipe, guided, "latent"), atol=2e-5, rtol=1e-5)
    assert (x_guided - ours).abs().max() > 1e-3  # guidance changes the samples

    lora_pipe = exported_lora(policy, "z-image", str(tiny), tmp_path / "lora")
    ours_lora, _ = ode_sample(policy, PROMPTS, SEEDS, STEPS)
    ref_lora = _pipeline(lora_pipe, policy, "latent")
    torch.testing.assert_close(ours_lora, ref_lora, atol=2e-5, rtol=1e-5)
    assert (ref_lora - ref).abs().max() > 1e-2

    # Z-Image-Turbo: its published scheduler (static shift 3) and 8 steps
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    turbo = ZImagePolicy(pipe, max_sequence_length=SEQ, guidance_scale=1.0, resolution=SIZE)  # LoRA kept
    x_turbo, _ = ode_sample(turbo, PROMPTS, SEEDS, 8)
    ref_turbo = _pipeline(pipe, turbo, "latent", steps=8)
    assert torch.equal(turbo.sigmas(8), pipe.scheduler.sigmas.float()) and len(turbo.sigmas(8)) == 9
    torch.testing.assert_close(x_turbo, ref_turbo, atol=0, rtol=0)


def test_z_image_errors(tiny):
    with pytest.raises(ValueError, match="guidance_scale"):
        ZImagePolicy.from_pretrained(tiny, guidance_scale=0.0)  # the pipeline's 0 is flowrl's 1.0
    with pytest.raises(ValueError, match="multiples of 16"):
        ZImagePolicy.from_pretrained(tiny, resolution=40)


def test_grpo_trains_on_z_image_turbo(tiny, tmp_path):
    """Two GRPO iterations of the Z-Image-Turbo recipe (group sampler, one SDE step, no guidance, EMA) shrunk by
    the smoke table; the run's export loads into ZImagePipeline and is the trained policy."""
    from flowrl.smoke import smoke_overrides
    from flowrl.trainers.config import load_config
    from flowrl.trainers.online import train
    from helpers import ROOT, two_grpo_iterations

    path = ROOT / "recipes" / "z_image_turbo_group_pickscore.yaml"
    cfg = load_config(path, [*smoke_overrides(load_config(path), tiny, tmp_path), "train.iterations=2",
                             "train.lr=1e-2", "logging.progress=false"])
    assert cfg.model.pipeline == "z-image" and cfg.model.guidance_scale == 1.0 and cfg.train.loss == "grpo"
    run = tmp_path / "run"
    summary = train(cfg, run)
    assert summary["iterations_done"] == 2 and summary["skipped_steps"] == 0
    recs, w1, w2 = two_grpo_iterations(run)
    assert any("noise_refiner.0.feed_forward.w1" in k for k in w2) and any("context_refiner.0." in k for k in w2)
    assert any(not torch.equal(w1[k], w2[k]) for k in w1)
    fresh = ZImagePolicy.from_pretrained(tiny, max_sequence_length=8, guidance_scale=1.0)
    assert_export_is_the_trained_policy(run, tmp_path / "export", str(tiny), fresh, cfg, w2)
