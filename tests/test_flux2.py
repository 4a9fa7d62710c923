"""The FLUX.2 adapters against diffusers' own pipelines on the tiny offline models (``flowrl make-tiny flux2``,
``flux2-klein``): flowrl's deterministic ODE loop (``flowrl.rollout.ode.ode_sample``) equals ``Flux2Pipeline``'s
(embedded guidance; bit-equal latents and images) and ``Flux2KleinPipeline``'s (real CFG: within float32
round-off, the pipeline runs the two halves as two passes, flowrl as one doubled batch; without CFG and for a
step-distilled pipeline: bit-equal), with FLUX.2's empirical-mu schedule bit-equal to the scheduler's and its
batch-norm latent space decoded as the pipelines decode; a LoRA written by ``flowrl export``'s writer loads
with ``load_lora_weights``, moves the output and still equals flowrl's loop; each model's recipe trains two
GRPO iterations and its export is the trained policy. Shapes, save / load and LoRA targets are in the
contract battery (tests/test_policy_contract.py), every other sampler and update in tests/test_model_matrix.py."""
import pytest
import torch

from flowrl.pipelines.flux2 import Flux2Policy
from flowrl.pipelines.flux2_family import patchify, unpatchify
from flowrl.pipelines.flux2_klein import Flux2KleinPolicy
from flowrl.pipelines.packing import pack_latents
from flowrl.rollout.ode import ode_sample
from model_parity import assert_export_is_the_trained_policy, exported_lora

PROMPTS = ["a photo of a cat", "a red apple on a table"]
SEEDS, STEPS, SIZE = [5, 6], 3, 32
SEQ = {"flux2": 48, "flux2-klein": 16}  # the dev template's system message is 32 tiny tokens

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


def _pipeline(pipe, policy, output_type: str, guidance_scale: float):
    """The pipeline's own loop from flowrl's initial noise (patchified, as the pipelines draw theirs)."""
    return pipe(prompt=list(PROMPTS), latents=patchify(policy.initial_noise(SEEDS)), num_inference_steps=STEPS,
                height=SIZE, width=SIZE, max_sequence_length=policy.max_sequence_length,
                guidance_scale=guidance_scale, output_type=output_type).images


def _vae_space(policy, latents: torch.Tensor) -> torch.Tensor:
    """flowrl's normalized latents ``[B, 32, h, w]`` in the VAE's space (what Flux2KleinPipeline returns as latents)."""
    bn = policy.vae.bn
    std = torch.sqrt(bn.running_var + policy.vae.config.batch_norm_eps).view(1, -1, 1, 1)
    return unpatchify(patchify(latents) * std + bn.running_mean.view(1, -1, 1, 1))


def test_ode_matches_the_flux2_pipeline(tiny_model, tmp_path):
    tiny = tiny_model("flux2")
    policy = Flux2Policy.from_pretrained(tiny, max_sequence_length=SEQ["flux2"])
    assert policy.latent_shape == (32, 4, 4) and policy.guidance_embeds and policy.cfg_scale == 1.0
    cond = policy.encode_prompts(PROMPTS)
    assert set(cond) == {"prompt_embeds"} and cond["prompt_embeds"].shape == (2, 48, 48)  # 3 layers x 16, padded
    assert not torch.equal(cond["prompt_embeds"][0], cond["prompt_embeds"][1])  # the prompt is inside 48 tokens
    ours, images = ode_sample(policy, PROMPTS, SEEDS, STEPS)  # [B, 32, 4, 4], [B, 3, 32, 32]
    pipe = policy.pipe
    ref = _pipeline(pipe, policy, "latent", policy.guidance_scale)  # packed [B, 4, 128]
    assert torch.equal(policy.sigmas(STEPS), pipe.scheduler.sigmas.float())  # empirical mu for 3 steps, 4 tokens
    torch.testing.assert_close(pack_latents(ours), ref, atol=0, rtol=0)  # bit-equal
    torch.testing.assert_close(images, _pipeline(pipe, policy, "pt", policy.guidance_scale), atol=0, rtol=0)
    weaker, _ = ode_sample(Flux2Policy(pipe, guidance_scale=1.5, max_sequence_length=SEQ["flux2"], resolution=SIZE),
                           PROMPTS, SEEDS, STEPS)
    assert (weaker - ours).abs().max() > 1e-3  # the embedded guidance changes the samples

    lora_pipe = exported_lora(policy, "flux2", str(tiny), tmp_path / "lora")
    ours_lora, _ = ode_sample(policy, PROMPTS, SEEDS, STEPS)
    ref_lora = _pipeline(lora_pipe, policy, "latent", policy.guidance_scale)
    torch.testing.assert_close(pack_latents(ours_lora), ref_lora, atol=2e-5, rtol=1e-5)
    assert (ref_lora - ref).abs().max() > 1e-2


def test_ode_matches_the_flux2_klein_pipeline(tiny_model, tmp_path):
    tiny = tiny_model("flux2-klein")  # the base models' layout: real CFG
    policy = Flux2KleinPolicy.from_pretrained(tiny, max_sequence_length=SEQ["flux2-klein"], guidance_scale=4.0)
    assert not policy.guidance_embeds and not policy.distilled and policy.cfg_scale == 4.0
    assert set(policy.encode_prompts(PROMPTS)) == {"prompt_embeds", "negative_prompt_embeds"}
    ours, images = ode_sample(policy, PROMPTS, SEEDS, STEPS)
    pipe = policy.pipe
    ref = _pipeline(pipe, policy, "latent", 4.0)  # unpatchified, denormalized [B, 32, 4, 4]
    assert torch.equal(policy.sigmas(STEPS), pipe.scheduler.sigmas.float())
    torch.testing.assert_close(_vae_space(policy, ours), ref, atol=2e-5, rtol=1e-5)  # CFG: fp32 round-off
    torch.testing.assert_close(images, _pipeline(pipe, policy, "pt", 4.0), atol=2e-5, rtol=1e-5)
    plain = Flux2KleinPolicy(pipe, guidance_scale=1.0, max_sequence_length=SEQ["flux2-klein"], resolution=SIZE)
    x_plain, _ = ode_sample(plain, PROMPTS, SEEDS, STEPS)
    torch.testing.assert_close(_vae_space(plain, x_plain), _pipeline(pipe, plain, "latent", 1.0), atol=0, rtol=0)
    assert (x_plain - ours).abs().max() > 1e-3  # guidance changes the samples

    lora_pipe = exported_lora(policy, "flux2-klein", str(tiny), tmp_path / "lora")
    ours_lora, _ = ode_sample(policy, PROMPTS, SEEDS, STEPS)
    ref_lora = _pipeline(lora_pipe, policy, "latent", 4.0)
    torch.testing.assert_close(_vae_space(policy, ours_lora), ref_lora, atol=2e-5, rtol=1e-5)
    assert (ref_lora - ref).abs().max() > 1e-2

    # a step-distilled pipeline (FLUX.2-klein-4B / 9B) ignores the guidance scale, as flowrl does
    pipe.register_to_config(is_distilled=True)
    distilled = Flux2KleinPolicy(pipe, guidance_scale=4.0, max_sequence_length=SEQ["flux2-klein"], resolution=SIZE)
    assert distilled.cfg_scale == 1.0 and set(distilled.encode_prompts(PROMPTS)) == {"prompt_embeds"}
    x_dist, _ = ode_sample(distilled, PROMPTS, SEEDS, STEPS)
    torch.testing.assert_close(_vae_space(distilled, x_dist), _pipeline(pipe, distilled, "latent", 4.0), atol=0, rtol=0)


def test_flux2_errors(tiny_model):
    tiny = tiny_model("flux2-klein")
    with pytest.raises(ValueError, match="guidance_scale"):
        Flux2KleinPolicy.from_pretrained(tiny, guidance_scale=-1.0)
    with pytest.raises(ValueError, match="multiples of 16"):
        Flux2KleinPolicy.from_pretrained(tiny, resolution=40)


@pytest.mark.parametrize("pipeline,recipe", [("flux2", "flux2_group_pickscore"),
                                             ("flux2-klein", "flux2_klein_group_pickscore")])
def test_grpo_trains_on_flux2(tiny_model, tmp_path, pipeline, recipe):
    """Two GRPO iterations of the model's recipe (group sampler, one SDE step, EMA; FLUX.2 [dev]: text
    embeddings cached and the Mistral encoder dropped) shrunk by the smoke table, unsharded; the run's
    export loads into the pipeline and is the trained policy."""
    from flowrl.smoke import smoke_overrides
    from flowrl.trainers.config import load_config
    from flowrl.trainers.online import train
    from helpers import ROOT, two_grpo_iterations

    path = ROOT / "recipes" / f"{recipe}.yaml"
    first = load_config(path)
    cfg = load_config(path, [*smoke_overrides(first, tiny_model(pipeline), tmp_path), "train.iterations=2",
                             "train.sharding=none", "train.lr=1e-2", "logging.progress=false"])
    assert cfg.model.pipeline == pipeline and cfg.sampler.name == "group" and cfg.train.loss == "grpo"
    run = tmp_path / "run"
    summary = train(cfg, run)
    assert summary["iterations_done"] == 2 and summary["skipped_steps"] == 0
    recs, w1, w2 = two_grpo_iterations(run)
    assert any("single_transformer_blocks.0.attn.to_qkv_mlp_proj" in k for k in w2)
    assert any(not torch.equal(w1[k], w2[k]) for k in w1)
    cls = {"flux2": Flux2Policy, "flux2-klein": Flux2KleinPolicy}[pipeline]
    fresh = cls.from_pretrained(cfg.model.path, max_sequence_length=SEQ[pipeline], guidance_scale=cfg.model.guidance_scale)
    assert_export_is_the_trained_policy(run, tmp_path / "export", cfg.model.path, fresh, cfg, w2)
