"""The Wan2.1 text-to-video adapter against diffusers' own ``WanPipeline`` on the tiny offline model
(``flowrl make-tiny wan``): latents ``[B, 16, F', h, w]``, flowrl's deterministic ODE loop
(``flowrl.rollout.ode.ode_sample``) equals the pipeline's loop (CFG, flow shift, time input) and
its decoded videos ``[B, 3, F, H, W]`` equal the pipeline's frames; a LoRA written by ``flowrl
export``'s writer loads into the pipeline, moves its output, and still equals flowrl's loop.
Shapes, save / load and LoRA targets are in the contract battery (tests/test_policy_contract.py)."""
import json
import math

import pytest
import torch

from flowrl.pipelines.base import FLOWRL_JSON
from flowrl.pipelines.wan import TINY_NUM_FRAMES, WanPolicy
from flowrl.rollout.ode import ode_sample
from model_parity import exported_lora

PROMPTS = ["a cat walking on grass", "a red car"]
SEEDS, STEPS, SEQ, SIZE = [5, 6], 3, 8, 32

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("wan")  # conftest: one build per session, 32 px (SIZE)


def _pipeline(pipe, policy, output_type):
    """The pipeline's own loop from flowrl's initial noise."""
    return pipe(PROMPTS, negative_prompt=policy.negative_prompt, guidance_scale=policy.guidance_scale,
                latents=policy.initial_noise(SEEDS), num_inference_steps=STEPS, height=SIZE, width=SIZE,
                num_frames=policy.num_frames, max_sequence_length=SEQ, output_type=output_type).frames


def test_ode_matches_the_wan_pipeline(tiny, tmp_path):
    assert json.loads((tiny / FLOWRL_JSON).read_text())["num_frames"] == TINY_NUM_FRAMES == 5
    policy = WanPolicy.from_pretrained(tiny, max_sequence_length=SEQ, guidance_scale=5.0)
    assert policy.num_frames == 5 and policy.latent_shape == (16, 2, 4, 4)
    ours, videos = ode_sample(policy, PROMPTS, SEEDS, STEPS)  # [B, 16, 2, 4, 4], [B, 3, 5, 32, 32]
    assert videos.shape == (2, 3, 5, SIZE, SIZE) and 0 <= videos.min() <= videos.max() <= 1
    pipe = policy.pipe
    ref = _pipeline(pipe, policy, "latent")  # [B, 16, 2, 4, 4]
    assert torch.equal(policy.sigmas(STEPS), pipe.scheduler.sigmas.float())
    torch.testing.assert_close(ours, ref.float(), atol=2e-5, rtol=1e-5)
    ref_videos = _pipeline(pipe, policy, "pt")  # [B, F, 3, H, W] (the pipeline's frame-major layout)
    torch.testing.assert_close(videos, ref_videos.float().permute(0, 2, 1, 3, 4), atol=2e-5, rtol=1e-5)

    # a LoRA through flowrl export's writer: loads into the pipeline, moves its output, equals flowrl's loop
    lora_pipe = exported_lora(policy, "wan", str(tiny), tmp_path / "lora")
    ours_lora, _ = ode_sample(policy, PROMPTS, SEEDS, STEPS)
    ref_lora = _pipeline(lora_pipe, policy, "latent").float()
    torch.testing.assert_close(ours_lora, ref_lora, atol=2e-5, rtol=1e-5)
    assert (ref_lora - ref).abs().max() > 1e-2


def test_num_frames_option_and_errors(tiny, tmp_path):
    policy = WanPolicy.from_pretrained(tiny, max_sequence_length=SEQ, num_frames=9, resolution=(32, 48))
    assert policy.latent_shape == (16, 3, 4, 6)
    assert policy.decode(policy.initial_noise([0])).shape == (1, 3, 9, 32, 48)
    policy.save_pretrained(tmp_path / "saved")  # the frame count travels with the model, like the resolution
    back = WanPolicy.from_pretrained(tmp_path / "saved", max_sequence_length=SEQ)
    assert back.num_frames == 9 and (back.height, back.width) == (32, 48)
    saved = json.loads((tmp_path / "saved" / "flowrl.json").read_text())  # written once, with every entry
    assert saved == {"kind": "wan", "resolution": [32, 48], "num_frames": 9}
    assert json.loads((tiny / "flowrl.json").read_text())["num_frames"] == TINY_NUM_FRAMES
    with pytest.raises(ValueError, match="4 k \\+ 1"):
        WanPolicy.from_pretrained(tiny, num_frames=8)
    with pytest.raises(ValueError, match="guidance_scale"):
        WanPolicy.from_pretrained(tiny, guidance_scale=0.5)


def test_flow_grpo_wan_step_rollout_rescores_on_policy(tiny):
    """The recipe's sampler (``step: sde_wan``, Flow-GRPO's Wan noise std_t = sigma_1 sigma) on the video
    latents with CFG: the GRPO update recomputes every stored transition's log-prob to the stored one (ratio
    1), and its KL to the reference (the policy itself; ``kl_form: flow_grpo``, the exact form for this
    step) is 0. The recipe's run end to end is the next test."""
    import contextlib
    from types import SimpleNamespace

    from flowrl.advantages import transition_advantages
    from flowrl.registry import SAMPLERS
    from flowrl.trainers.config import load_config
    from flowrl.updates import UPDATES
    from flowrl.updates.base import UpdateContext
    from helpers import ROOT

    cfg = load_config(ROOT / "recipes" / "wan_group_ocr.yaml")
    assert cfg.sampler.options["step"] == "sde_wan" and cfg.sampler.options["noise_level"] == 0.9828
    policy = WanPolicy.from_pretrained(tiny, max_sequence_length=SEQ, guidance_scale=4.5)
    sampler = SAMPLERS.get("group")(group_size=2, num_steps=3, step="sde_wan", noise_level=0.9828)
    r = sampler(policy, PROMPTS, lambda frames, prompts, **m: frames.float().flatten(1).mean(1), seed=3)  # per frame
    assert r.transitions.latents.shape[1:] == (16, 2, 4, 4) and len(r.transitions) == 4 * 3
    ctx = UpdateContext(policy=policy, unwrapped=policy.transformer, device=torch.device("cpu"),
                        autocast=contextlib.nullcontext, reference=contextlib.nullcontext, gather=lambda t: t,
                        train=SimpleNamespace(seed=0))
    adv, _ = transition_advantages(r)
    upd = UPDATES.get("grpo")(ctx, cfg.train.update_options)  # the recipe's: beta_kl 0.004, kl_form flow_grpo
    assert (upd.opts.beta_kl, upd.opts.kl_form) == (0.004, "flow_grpo")
    _, stats = upd.minibatch_loss(r, r.conditioning(policy), torch.arange(len(r.transitions)), adv)
    assert float(stats["approx_kl"]) < 1e-10 and abs(float(stats["ratio_mean"]) - 1) < 1e-5
    assert float(stats["kl"]) == 0.0


def test_video_recipe_trains_and_saves_animated_samples(tiny, tmp_path):
    """recipes/wan_group_ocr.yaml shrunk onto the tiny model: two GRPO iterations on videos ``[B, 3, 5, H,
    W]``, an image reward scored per frame (``reward.frame_stride``), the evaluation's reward-hacking
    watch with temporal consistency, and saved samples animated (GIF, more than one frame) beside a
    PNG frame strip."""
    from PIL import Image

    from flowrl.trainers.config import load_config
    from flowrl.trainers.online import train
    from helpers import ROOT, tiny_overrides, train_records

    cfg = load_config(ROOT / "recipes" / "wan_group_ocr.yaml", tiny_overrides(tiny, "group", **{
        "model.options.num_frames": 5, "reward.frame_stride": 2, "logging.image_every": 2, "logging.eval_every": 2}))
    assert cfg.model.pipeline == "wan" and cfg.sampler.options["step"] == "sde_wan"
    run = tmp_path / "run"
    summary = train(cfg, run)
    assert summary["iterations_done"] == 2 and summary["skipped_steps"] == 0
    recs = train_records(run)
    assert [r["iteration"] for r in recs] == [0, 1] and all(math.isfinite(r["reward_mean"]) for r in recs)
    evals = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if "eval/reward" in l]
    assert evals and all(0 <= e["eval/temporal_consistency"] <= 1 and e["eval/hf_energy"] >= 0 for e in evals)
    strip = Image.open(run / "samples" / "train_000002.png")
    assert strip.width > strip.height  # frames side by side
    gif = Image.open(run / "samples" / "train_000002_anim.gif")
    assert gif.n_frames == 5 and gif.is_animated
    assert (run / "samples" / "eval_000002_anim.gif").is_file()
