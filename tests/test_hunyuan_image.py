"""The HunyuanImage 2.1 adapter against diffusers' own ``HunyuanImagePipeline`` on the tiny offline models (``flowrl
make-tiny hunyuan-image`` and ``hunyuan-image-distilled``): flowrl's deterministic ODE loop
(``flowrl.rollout.ode.ode_sample``) equals the pipeline's, latents and decoded images, within float32 round-off (the
pipeline pads both texts, flowrl cuts them to the batch's longest; its guider runs the two CFG halves as two passes),
for the base model under its published guider (CFG at 3.5 for the first steps; a prompt that quotes text takes the
ByT5 and OCR-guider path) and without guidance, and for the distilled model with its embedded guidance and MeanFlow
end times (:func:`meanflow_end` exactly the pipeline's next timesteps); the distilled model trains without CFG and
its KL reference sees the policy's guidance; ``load_exported_lora`` (the pipeline has no ``load_lora_weights``)
loads a ``flowrl export`` LoRA into the pipeline's transformer, which moves the output and equals flowrl's loop; the
recipe trains two GRPO iterations on the distilled model and its export is the trained policy; gradient
checkpointing runs (diffusers' own checkpointing function fails on this transformer); ``flowrl plan`` fits the
published model and ``--suggest`` answers. Shapes, save / load and LoRA targets are in the contract battery
(tests/test_policy_contract.py), every other sampler and update in tests/test_model_matrix.py."""
import json

import pytest
import torch

from flowrl.pipelines.hunyuan_image import HunyuanImagePolicy, meanflow_end
from flowrl.rollout.ode import ode_sample
from model_parity import assert_export_is_the_trained_policy, exported_lora

PROMPTS = ["a photo of a cat", 'a red apple on a table with a sign that says "hello"']
SEEDS, STEPS, SEQ, SIZE = [5, 6], 3, 16, 32
RECIPE = "recipes/hunyuan_image_group_pickscore.yaml"

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("hunyuan-image")  # conftest: one build per session, 32 px (SIZE): the base model's layout


@pytest.fixture(scope="module")
def tiny_distilled(tmp_path_factory):
    return HunyuanImagePolicy.make_tiny("hunyuan-image-distilled", tmp_path_factory.mktemp("hy") / "distilled",
                                        image_size=SIZE)


def _pipeline(pipe, policy, output_type: str, **kw):
    """The pipeline's own loop from flowrl's initial noise (its latents are flowrl's)."""
    return pipe(prompt=list(PROMPTS), latents=policy.initial_noise(SEEDS), num_inference_steps=STEPS, height=SIZE,
                width=SIZE, output_type=output_type, **kw).images


def test_meanflow_end_is_the_next_step_of_the_schedule():
    grid = torch.tensor([1.0, 0.8, 0.5, 0.0])  # a 3-step schedule
    r = meanflow_end(torch.tensor([1.0, 0.8, 0.5, 0.65, 0.25]), grid)
    torch.testing.assert_close(r, torch.tensor([0.8, 0.5, 0.0, 0.25, 0.0]), atol=0, rtol=1e-6)  # on the grid: exact


def test_ode_matches_the_base_pipeline_and_its_lora_loads(tiny, tmp_path):
    policy = HunyuanImagePolicy.from_pretrained(tiny, max_sequence_length=SEQ, guidance_scale=3.5)  # the guider's
    pipe = policy.pipe
    assert not policy.guidance_embeds and policy.cfg_scale == 3.5 and policy.latent_shape == (64, 4, 4)
    published = pipe.guider.config  # the published guider: its APG starts after the test's steps (CFG only here)
    assert published.guidance_scale == 3.5 and published.adaptive_projected_guidance_start_step >= STEPS
    cond = policy.encode_prompts(PROMPTS)
    assert cond["prompt_embeds_mask"].sum(1).tolist() == [6, SEQ] and cond["prompt_embeds_mask_2"].sum(1)[0] == 0
    assert cond["prompt_embeds_mask_2"][1].sum() > 0  # the quoted "hello" reaches ByT5
    ours, images = ode_sample(policy, PROMPTS, SEEDS, STEPS)  # [B, 64, 4, 4], [B, 3, 32, 32]
    ref = _pipeline(pipe, policy, "latent")
    assert torch.equal(policy.sigmas(STEPS), pipe.scheduler.sigmas.float())  # static shift 5
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(images, _pipeline(pipe, policy, "pt"), atol=2e-5, rtol=1e-5)
    plain = HunyuanImagePolicy(pipe, max_sequence_length=SEQ, guidance_scale=1.0, resolution=SIZE)
    x_plain, _ = ode_sample(plain, PROMPTS, SEEDS, STEPS)
    guider, ocr = pipe.guider, pipe.ocr_guider
    pipe.guider, pipe.ocr_guider = guider.new(guidance_scale=1.0), ocr.new(guidance_scale=1.0)  # the guider off
    torch.testing.assert_close(x_plain, _pipeline(pipe, plain, "latent"), atol=2e-5, rtol=1e-5)
    assert (x_plain - ours).abs().max() > 1e-3  # guidance changes the samples
    pipe.guider, pipe.ocr_guider = guider, ocr

    lora_pipe = exported_lora(policy, "hunyuan-image", str(tiny), tmp_path / "lora")  # load_exported_lora
    assert not hasattr(lora_pipe, "load_lora_weights")  # diffusers 0.42.1: the transformer loads it
    lora_pipe.tokenizer_max_length = SEQ  # as the adapter sets its own pipeline's (max_sequence_length)
    ours_lora, _ = ode_sample(policy, PROMPTS, SEEDS, STEPS)
    ref_lora = _pipeline(lora_pipe, policy, "latent")
    torch.testing.assert_close(ours_lora, ref_lora, atol=2e-5, rtol=1e-5)
    assert (ref_lora - ref).abs().max() > 1e-2  # the loaded LoRA moves the pipeline's output


def test_ode_matches_the_distilled_pipeline(tiny_distilled):
    """Embedded guidance (1000 x 3.25, one pass per step) and MeanFlow's end time: the pipeline's next timestep."""
    policy = HunyuanImagePolicy.from_pretrained(tiny_distilled, max_sequence_length=SEQ, guidance_scale=3.25,
                                                meanflow_steps=STEPS)
    pipe = policy.pipe
    assert policy.guidance_embeds and policy.meanflow and policy.cfg_scale == 1.0
    seen = []
    pipe.transformer.register_forward_pre_hook(
        lambda m, a, kw: seen.append((kw["timestep"].clone(), kw["timestep_r"].clone(), kw["guidance"].clone())),
        with_kwargs=True)
    ours, _ = ode_sample(policy, PROMPTS, SEEDS, STEPS)
    ours_t = [(t, r, g) for t, r, g in seen]
    seen.clear()
    ref = _pipeline(pipe, policy, "latent", distilled_guidance_scale=3.25)
    assert len(ours_t) == len(seen) == STEPS  # one pass per step
    for (t, r, g), (t_ref, r_ref, g_ref) in zip(ours_t, seen):
        assert torch.equal(t, t_ref) and torch.equal(r, r_ref) and torch.equal(g, g_ref) and g[0] == 3250.0
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-5)
    weaker, _ = ode_sample(HunyuanImagePolicy(pipe, max_sequence_length=SEQ, guidance_scale=1.5,
                                              meanflow_steps=STEPS, resolution=SIZE), PROMPTS, SEEDS, STEPS)
    assert (weaker - ours).abs().max() > 1e-3  # the embedded guidance changes the samples


def test_the_distilled_model_trains_without_cfg_and_its_reference_sees_the_same_guidance(tiny_distilled):
    """At guidance 3.25 a distilled model's velocity is one pass with the guidance embedded, in a differentiable
    forward as in sampling, and the KL reference (the LoRA-disabled model) gets the same embedding and rows."""
    from flowrl.trainable import Reference, add_lora

    policy = HunyuanImagePolicy.from_pretrained(tiny_distilled, max_sequence_length=SEQ, guidance_scale=3.25)
    add_lora(policy.transformer, 2, 8, policy.lora_target_modules)
    cond = policy.encode_prompts(PROMPTS)
    assert not any(k.startswith("negative_") for k in cond)  # no unconditional half to run
    seen = []
    policy.transformer.register_forward_pre_hook(
        lambda m, a, kw: seen.append((kw["hidden_states"].shape[0], kw["guidance"].clone())), with_kwargs=True)
    x, sigma = policy.initial_noise(SEEDS), torch.tensor([0.9, 0.5])
    policy.velocity(x, sigma, cond).square().mean().backward()  # the training forward
    with torch.no_grad(), Reference(policy.transformer, need=True).active(policy):
        policy.velocity(x, sigma, cond)  # the KL reference
    assert len(seen) == 2 and all(rows == 2 for rows, _ in seen)  # one pass each, no doubled batch
    assert torch.equal(seen[0][1], seen[1][1]) and seen[0][1].tolist() == [3250.0, 3250.0]


def test_gradient_checkpointing_and_errors(tiny):
    plain = HunyuanImagePolicy.from_pretrained(tiny, max_sequence_length=SEQ, guidance_scale=1.0)
    ckpt = HunyuanImagePolicy.from_pretrained(tiny, max_sequence_length=SEQ, guidance_scale=1.0,
                                              gradient_checkpointing=True)
    x, cond = plain.initial_noise(SEEDS), plain.encode_prompts(PROMPTS)
    grads = []
    for policy in (plain, ckpt):
        policy.transformer.train()
        policy.velocity(x, torch.tensor([0.9, 0.5]), cond).square().mean().backward()
        grads.append(policy.transformer.proj_out.weight.grad)
    assert ckpt.transformer.gradient_checkpointing and grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="multiples of 8"):  # the tiny VAE's factor (the published one: 32)
        HunyuanImagePolicy.from_pretrained(tiny, resolution=36)
    with pytest.raises(ValueError, match="meanflow_steps"):
        HunyuanImagePolicy.from_pretrained(tiny, meanflow_steps=0)


def test_grpo_trains_on_the_distilled_model(tiny_distilled, tmp_path):
    """Two GRPO iterations of the recipe (the distilled model: embedded guidance 3.25, one SDE step, EMA) shrunk by
    the smoke table, with the KL term on (the reference runs); the run's export loads into the pipeline's
    transformer and is the trained policy."""
    from flowrl.smoke import smoke_overrides
    from flowrl.trainers.config import load_config
    from flowrl.trainers.online import train
    from helpers import ROOT, two_grpo_iterations

    path = ROOT / RECIPE
    cfg = load_config(path, [*smoke_overrides(load_config(path), tiny_distilled, tmp_path), "train.iterations=2",
                             "train.lr=1e-2", "train.loss_options.beta_kl=0.01", "logging.progress=false"])
    assert cfg.model.pipeline == "hunyuan-image" and cfg.model.guidance_scale == 3.25 and cfg.train.loss == "grpo"
    run = tmp_path / "run"
    summary = train(cfg, run)
    assert summary["iterations_done"] == 2 and summary["skipped_steps"] == 0
    recs, w1, w2 = two_grpo_iterations(run)
    assert all(r["kl"] >= 0 for r in recs) and any("single_transformer_blocks.0.proj_mlp" in k for k in w2)
    assert any(not torch.equal(w1[k], w2[k]) for k in w1)
    fresh = HunyuanImagePolicy.from_pretrained(tiny_distilled, max_sequence_length=8, guidance_scale=3.25)
    assert_export_is_the_trained_policy(run, tmp_path / "export", str(tiny_distilled), fresh, cfg, w2)


def test_plan_fits_and_suggests(tmp_path, capsys):
    """The recipe on the published distilled model (17.45B transformer parameters, Qwen2.5-VL-7B and ByT5) fits 80
    GiB GPUs as shipped (LoRA, gradient checkpointing: one GPU holds what each of the 8 processes does); a full
    fine-tune does not fit one, and --suggest names a setting that does."""
    from flowrl.cli import main
    from flowrl.plan.core import GiB

    out = tmp_path / "plan.json"
    assert main(["plan", "--config", RECIPE, "--gpus", "1", "--json", str(out), "--suggest", "--max-gpus", "2",
                 "train.lora_rank=0"]) == 0
    text = capsys.readouterr().out
    plan = json.loads(out.read_text())
    assert "17.45B transformer params" in text and not plan["fits"]
    fit = plan["suggest"]["any"]["fit"]
    assert fit["peak_bytes"] <= 80 * GiB and "train.sharding=fsdp" in fit["overrides"]
    assert main(["plan", "--config", RECIPE, "--gpus", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["fits"]  # the LoRA recipe as shipped (DDP: each GPU holds as much)
