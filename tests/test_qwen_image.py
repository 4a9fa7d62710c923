"""The Qwen-Image adapter against diffusers' own ``QwenImagePipeline`` on the tiny offline model
(``flowrl make-tiny qwen-image``): the offline tokenizer keeps the pipeline's template arithmetic,
flowrl's deterministic ODE loop (``flowrl.rollout.ode.ode_sample``) equals the pipeline's loop
(true CFG with the norm rescale, dynamic shift + shift_terminal schedule, packing, the video VAE's
frame axis), and a LoRA written by ``flowrl export``'s writer loads into the pipeline, moves its
output, and still equals flowrl's loop. Shapes, save / load and LoRA targets are in the contract
battery (tests/test_policy_contract.py)."""
import pytest
import torch

from flowrl.pipelines.packing import pack_latents, unpack_latents
from flowrl.pipelines.qwen_image import QwenImagePolicy
from flowrl.pipelines.tiny import build_qwen_tokenizer
from flowrl.rollout.ode import ode_sample
from model_parity import exported_lora

PROMPTS = ["a photo of a cat", "a red apple on a table"]  # different lengths: padding + masks
SEEDS, STEPS, SEQ, SIZE = [5, 6], 3, 16, 32

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("qwen-image")  # conftest: one build per session, 32 px (SIZE)


def _pipeline(pipe, policy, seeds, output_type):
    """The pipeline's own loop from flowrl's initial noise (packed as the pipeline packs it)."""
    return pipe(PROMPTS, negative_prompt=policy.negative_prompt, true_cfg_scale=policy.guidance_scale,
                latents=pack_latents(policy.initial_noise(seeds)), num_inference_steps=STEPS, height=SIZE,
                width=SIZE, max_sequence_length=SEQ, output_type=output_type).images


def test_tiny_tokenizer_keeps_the_template_arithmetic(tiny):
    from transformers import Qwen2Tokenizer

    tok = Qwen2Tokenizer.from_pretrained(tiny / "tokenizer")  # what the pipeline loads back
    assert tok.get_vocab() == build_qwen_tokenizer().get_vocab()
    policy = QwenImagePolicy.from_pretrained(tiny, max_sequence_length=SEQ)
    template, drop = policy.pipe.prompt_template_encode, policy.pipe.prompt_template_encode_start_idx
    ids = tok(template.format("a photo of a cat")).input_ids
    kept = tok.convert_ids_to_tokens(ids[drop:])
    assert kept[:5] == ["a", "Ġphoto", "Ġof", "Ġa", "Ġcat"]  # exactly the system prefix is dropped
    assert kept[5:] == ["<|im_end|>", "Ċ", "<|im_start|>", "assistant", "Ċ"]
    cond = policy.encode_prompts(PROMPTS)
    assert cond["prompt_embeds"].shape == (2, SEQ, 16)
    lengths = [len(tok(template.format(p)).input_ids) - drop for p in PROMPTS]  # prompt + 5 closing tokens
    assert lengths[0] == 10 and lengths[1] > lengths[0]
    assert cond["prompt_embeds_mask"].sum(1).tolist() == lengths and cond["prompt_embeds_mask"][:, 0].all()
    assert not cond["prompt_embeds"][0, 10:].any()  # zero padding, as the pipeline pads


def test_ode_matches_the_qwen_image_pipeline(tiny, tmp_path):
    policy = QwenImagePolicy.from_pretrained(tiny, max_sequence_length=SEQ, guidance_scale=4.0)
    assert policy.latent_shape == (16, 4, 4) and (policy.height, policy.width) == (SIZE, SIZE)
    ours, images = ode_sample(policy, PROMPTS, SEEDS, STEPS)  # [B, 16, 4, 4], [B, 3, 32, 32]
    pipe = policy.pipe
    ref = unpack_latents(_pipeline(pipe, policy, SEEDS, "latent").float(), 4, 4)  # [B, 16, 4, 4]
    assert torch.equal(policy.sigmas(STEPS), pipe.scheduler.sigmas.float())  # dynamic shift + shift_terminal
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-5)
    ref_images = _pipeline(pipe, policy, SEEDS, "pt")  # [B, 3, 32, 32]
    torch.testing.assert_close(images, ref_images.float(), atol=2e-5, rtol=1e-5)
    # without guidance: one pass, no negative conditioning
    plain = QwenImagePolicy.from_pretrained(tiny, max_sequence_length=SEQ, guidance_scale=1.0)
    assert set(plain.encode_prompts(PROMPTS)) == {"prompt_embeds", "prompt_embeds_mask"}
    x_plain, _ = ode_sample(plain, PROMPTS, SEEDS, STEPS)
    ref_plain = _pipeline(pipe, plain, SEEDS, "latent")
    torch.testing.assert_close(x_plain, unpack_latents(ref_plain.float(), 4, 4), atol=2e-5, rtol=1e-5)
    assert (x_plain - ours).abs().max() > 1e-3  # guidance changes the samples

    # a LoRA through flowrl export's writer: loads into the pipeline, moves its output, equals flowrl's loop
    lora_pipe = exported_lora(policy, "qwen-image", str(tiny), tmp_path / "lora")
    ours_lora, _ = ode_sample(policy, PROMPTS, SEEDS, STEPS)
    ref_lora = unpack_latents(_pipeline(lora_pipe, policy, SEEDS, "latent").float(), 4, 4)
    torch.testing.assert_close(ours_lora, ref_lora, atol=2e-5, rtol=1e-5)
    assert (ref_lora - ref).abs().max() > 1e-2


def test_qwen_image_errors(tiny):
    with pytest.raises(ValueError, match="guidance_scale must be a number >= 1"):
        QwenImagePolicy.from_pretrained(tiny, guidance_scale=0.5)
    with pytest.raises(ValueError, match="1024"):
        QwenImagePolicy.from_pretrained(tiny, max_sequence_length=2048)
    with pytest.raises(ValueError, match="multiples of 16"):
        QwenImagePolicy.from_pretrained(tiny, resolution=40)


def test_grpo_trains_on_qwen_image(tiny, tmp_path):
    """Two GRPO iterations (group sampler, SDE window, true CFG on, KL on) of the Qwen-Image
    Flow-GRPO recipe on the tiny model, unsharded: the current samplers and updates run on it unchanged."""
    from flowrl.trainers.config import load_config
    from flowrl.trainers.online import train
    from helpers import ROOT, tiny_overrides, two_grpo_iterations

    overrides = tiny_overrides(tiny, "group", **{"train.sharding": "none", "train.loss_options.beta_kl": 0.04})
    cfg = load_config(ROOT / "recipes" / "qwen_image_group_pickscore.yaml", overrides)
    assert cfg.model.pipeline == "qwen-image" and cfg.sampler.name == "group" and cfg.train.loss == "grpo"
    assert cfg.model.guidance_scale == 4.0 and cfg.sampler.options["sde_window"] == 2
    run = tmp_path / "run"
    summary = train(cfg, run)
    assert summary["iterations_done"] == 2 and summary["skipped_steps"] == 0
    recs, w1, w2 = two_grpo_iterations(run)
    assert any(".img_mlp.net.2." in k for k in w2) and any("transformer_blocks.0.txt_mlp.net.2." in k for k in w2)
    assert not any("transformer_blocks.1.txt_mlp." in k for k in w2)  # the last block's unused text stream
    assert any(".lora_B." in k and v.abs().sum() > 0 for k, v in w1.items())
    assert any(not torch.equal(w1[k], w2[k]) for k in w1)
    # `flowrl export` of the run loads into QwenImagePipeline and is the trained policy
    from diffusers import QwenImagePipeline

    from flowrl.export import export_run
    from flowrl.trainable import add_lora, load_trainable_state

    export_run(run, tmp_path / "export")
    trained = QwenImagePolicy.from_pretrained(tiny, max_sequence_length=SEQ)
    add_lora(trained.transformer, cfg.train.lora_rank, cfg.train.lora_alpha, trained.lora_target_modules)
    load_trainable_state(trained.transformer, w2)
    pipe = QwenImagePipeline.from_pretrained(tiny)
    pipe.load_lora_weights(tmp_path / "export")
    x, cond = trained.initial_noise(SEEDS), trained.encode_prompts(PROMPTS)
    with torch.no_grad():
        v_trained = trained.velocity(x, 0.7, cond)
        trained.transformer = pipe.transformer
        v_loaded = trained.velocity(x, 0.7, cond)
    torch.testing.assert_close(v_loaded, v_trained, rtol=1e-5, atol=1e-6)
