"""The Qwen-Image 2.1 adapter against diffusers' own ``QwenImage21Pipeline`` on the tiny offline model (``flowrl
make-tiny qwen-image-2.1``): flowrl's deterministic ODE loop (``flowrl.rollout.ode.ode_sample``) equals the pipeline's
for each prompt (unpatched 64-channel latents as tokens, the joint block-causal sequence, time ``(1000 sigma) / 1000``,
Qwen-Image's dynamic-shift schedule with ``shift_terminal``, the RGBA VAE), without CFG (the model's distilled setting)
and with true CFG, and on a pipeline's fixed ``sample_sigmas`` grid; a row's velocity does not depend on its
batch-mates, where the batched pipeline's does; the KL reference runs the calls the policy runs (the guidance
included); a LoRA written by ``flowrl export``'s writer loads with ``load_lora_weights``, moves the output and equals
flowrl's loop; the recipe trains two GRPO iterations (KL to the reference on: zero before the first step) and its
export is the trained policy; the published model is planned (``plan``, ``plan --suggest``) and its architecture
built. Shapes, save / load and LoRA targets are in the contract battery (tests/test_policy_contract.py), every other
sampler and update in tests/test_model_matrix.py."""
import json

import pytest
import torch

from flowrl.pipelines.qwen_image21 import QwenImage21Policy, flatten_latents
from flowrl.rollout.ode import ode_sample
from model_parity import assert_export_is_the_trained_policy, exported_lora

PROMPTS = ["a photo of a cat", "a red apple on a table"]
SEEDS, STEPS, SEQ, SIZE = [5, 6], 3, 32, 32
RECIPE = "recipes/qwen_image21_group_pickscore.yaml"

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("qwen-image-2.1")  # conftest: one build per session, 32 px (SIZE)


def _pipeline(pipe, policy, rows, output_type: str, **kw):
    """The pipeline's own loop for the prompts ``rows`` (one call) from flowrl's initial noise as its tokens, with true
    CFG at the policy's scale; without its prefix KV cache unless ``kw`` says (flowrl runs the whole sequence)."""
    guided = policy.guidance_scale > 1
    kw = {"use_kv_cache": False, **kw}
    noise = policy.initial_noise([SEEDS[r] for r in rows])  # [b, 64, h, w]
    return pipe(prompt=[PROMPTS[r] for r in rows], latents=flatten_latents(noise),
                num_inference_steps=STEPS, height=SIZE, width=SIZE, true_cfg_scale=policy.guidance_scale,
                negative_prompt=policy.negative_prompt if guided else None, output_type=output_type, **kw).images


def _each(pipe, policy, output_type: str = "latent", **kw) -> torch.Tensor:
    """The pipeline's output for each prompt alone, concatenated (``[B, h w, C]`` latents, or RGBA images)."""
    return torch.cat([_pipeline(pipe, policy, [r], output_type, **kw) for r in range(len(PROMPTS))])


def test_ode_matches_the_qwen_image21_pipeline(tiny, tmp_path):
    policy = QwenImage21Policy.from_pretrained(tiny, max_sequence_length=SEQ)
    assert policy.latent_shape == (64, 2, 2) and policy.image_seq_len == 4 and policy.cfg_scale == 1.0
    cond = policy.encode_prompts(PROMPTS)
    assert set(cond) == {"prompt_embeds", "prompt_embeds_mask"} and cond["prompt_embeds"].shape == (2, SEQ, 16)
    assert cond["prompt_embeds_mask"].sum(1).tolist() == [13, 16]  # user marker + prompt + assistant marker
    ours, images = ode_sample(policy, PROMPTS, SEEDS, STEPS)  # [B, 64, 2, 2], [B, 3, 32, 32]
    pipe = policy.pipe
    ref = _each(pipe, policy)  # [B, 4, 64]
    assert torch.equal(policy.sigmas(STEPS), pipe.scheduler.sigmas.float())  # dynamic shift, shift_terminal 0.02
    torch.testing.assert_close(flatten_latents(ours), ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(flatten_latents(ours), _each(pipe, policy, use_kv_cache=True), atol=2e-5, rtol=1e-5)
    rgba = _each(pipe, policy, "pt")  # [B, 4, 32, 32]: the VAE decodes RGBA
    assert rgba.shape[1] == 4 and images.shape[1] == 3
    torch.testing.assert_close(images, rgba[:, :3], atol=2e-5, rtol=1e-5)
    # diffusers' batched pipeline puts the shorter prompt's image after the longer prompt's padding; flowrl does not
    batched = _pipeline(pipe, policy, [0, 1], "latent")
    assert (batched[0] - ref[0]).abs().max() > 1e-4 and torch.equal(batched[1], ref[1])

    guided = QwenImage21Policy(pipe, guidance_scale=4.0, max_sequence_length=SEQ, resolution=SIZE)  # true CFG
    assert set(guided.encode_prompts(PROMPTS)) == {"prompt_embeds", "prompt_embeds_mask", "negative_prompt_embeds",
                                                    "negative_prompt_embeds_mask"}
    x_guided, _ = ode_sample(guided, PROMPTS, SEEDS, STEPS)
    torch.testing.assert_close(flatten_latents(x_guided), _each(pipe, guided), atol=2e-5, rtol=1e-5)
    assert (x_guided - ours).abs().max() > 1e-3  # CFG changes the samples

    lora_pipe = exported_lora(policy, "qwen-image-2.1", str(tiny), tmp_path / "lora")
    ours_lora, _ = ode_sample(policy, PROMPTS, SEEDS, STEPS)
    ref_lora = _each(lora_pipe, policy)
    torch.testing.assert_close(flatten_latents(ours_lora), ref_lora, atol=2e-5, rtol=1e-5)
    assert (ref_lora - ref).abs().max() > 1e-2

    # a checkpoint whose pipeline config fixes its sampling grid (a distilled one): that grid, that many steps
    default = policy.sigmas(STEPS)
    pipe.register_to_config(sample_sigmas=[1.0, 0.8, 0.4])
    fixed = QwenImage21Policy(pipe, max_sequence_length=SEQ, resolution=SIZE)  # LoRA kept
    x_fixed, _ = ode_sample(fixed, PROMPTS, SEEDS, STEPS)
    torch.testing.assert_close(flatten_latents(x_fixed), _each(pipe, fixed), atol=2e-5, rtol=1e-5)
    assert torch.equal(fixed.sigmas(STEPS), pipe.scheduler.sigmas.float()) and not torch.equal(
        fixed.sigmas(STEPS), default)
    with pytest.raises(ValueError, match="sampler.num_steps=3"):
        fixed.sigmas(4)


def test_rows_are_batch_independent_and_the_reference_sees_the_policy_guidance(tiny):
    """Each row's velocity is its velocity alone (rows of one prompt length share a call). The KL reference (the
    LoRA off, as the trainer evaluates it) makes the calls the policy makes, at the same guidance: without CFG (the
    distilled model's, the recipe's) one call per prompt length and no negative prompt, and it is the base model's
    single pass; with CFG both run the negative prompt's calls too."""
    from flowrl.trainable import Reference, add_lora

    policy = QwenImage21Policy.from_pretrained(tiny, max_sequence_length=SEQ)
    cond = policy.encode_prompts(PROMPTS + [PROMPTS[0]])
    x, sigma = policy.initial_noise([1, 2, 3]), torch.tensor([0.9, 0.5, 0.2])
    with torch.no_grad():
        base = policy.velocity(x, sigma, cond)  # [3, C, h, w]
        for i in range(3):
            alone = policy.velocity(x[i:i + 1], sigma[i:i + 1], {k: v[i:i + 1] for k, v in cond.items()})
            torch.testing.assert_close(alone, base[i:i + 1], atol=1e-6, rtol=1e-5)
    add_lora(policy.transformer, 2, 8, policy.lora_target_modules)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in policy.transformer.named_parameters():
            if ".lora_B." in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    calls = []
    policy.transformer.register_forward_pre_hook(
        lambda m, args, kw: calls.append((kw["hidden_states"].shape[0], kw["encoder_hidden_states"].shape[1])),
        with_kwargs=True)
    reference = Reference(policy.transformer, need=True)
    for scale in (1.0, 4.0):
        policy.guidance_scale = scale
        policy._negative = None
        c = policy.encode_prompts(PROMPTS + [PROMPTS[0]])
        with torch.no_grad():
            calls.clear()
            v_policy = policy.velocity(x, sigma, c)
            seen_policy = list(calls)
            calls.clear()
            with reference.active(policy):
                v_ref = policy.velocity(x, sigma, c)
            seen_ref = list(calls)
        assert seen_ref == seen_policy  # the same calls: rows and text tokens
        assert (v_policy - v_ref).abs().max() > 1e-3  # the LoRA moves the policy, not the reference
        if scale == 1.0:  # one call per prompt length (13 tokens: rows 0 and 2; 16: row 1), no negative prompt
            assert sorted(seen_policy) == [(1, 16), (2, 13)] and not any(k.startswith("negative") for k in c)
            torch.testing.assert_close(v_ref, base, atol=1e-6, rtol=1e-5)  # the base model's single pass
        else:  # true CFG: the negative prompt's call too, for the policy and the reference alike
            assert len(seen_policy) == 3 and any(k.startswith("negative") for k in c)


def test_qwen_image21_errors(tiny):
    with pytest.raises(ValueError, match="multiples of 32"):
        QwenImage21Policy.from_pretrained(tiny, resolution=48)  # the pipeline's 32 px: a vision slot per 2 x 2 tokens
    with pytest.raises(ValueError, match="guidance_scale"):
        QwenImage21Policy.from_pretrained(tiny, guidance_scale=0.5)


def test_grpo_trains_on_qwen_image21(tiny, tmp_path):
    """Two GRPO iterations of the recipe (no CFG, group sampler, one SDE step, EMA) shrunk by the smoke table, with
    the KL to the reference on: before the first step the policy is the reference (same guidance, same calls), so
    the first iteration's KL is 0 and its ratio 1, though its minibatch mixes prompt lengths the rollout ran apart;
    the run's export loads into QwenImage21Pipeline and is the trained policy."""
    from flowrl.smoke import smoke_overrides
    from flowrl.trainers.config import load_config
    from flowrl.trainers.online import train
    from helpers import ROOT, two_grpo_iterations

    path = ROOT / RECIPE
    cfg = load_config(path, [*smoke_overrides(load_config(path), tiny, tmp_path), "train.iterations=2",
                             "train.lr=1e-2", "train.loss_options.beta_kl=0.04", "logging.progress=false"])
    assert cfg.model.pipeline == "qwen-image-2.1" and cfg.model.guidance_scale == 1.0 and cfg.train.loss == "grpo"
    assert cfg.model.options["max_sequence_length"] == 32  # the adapter's smoke value: whole prompts
    run = tmp_path / "run"
    summary = train(cfg, run)
    assert summary["iterations_done"] == 2 and summary["skipped_steps"] == 0
    recs, w1, w2 = two_grpo_iterations(run)
    assert recs[0]["kl"] == 0.0 and recs[1]["kl"] > 0  # policy == reference until the first step
    assert any("transformer_blocks.0.img_mlp.gate_layer" in k for k in w2)
    assert any(not torch.equal(w1[k], w2[k]) for k in w1)
    fresh = QwenImage21Policy.from_pretrained(tiny, max_sequence_length=32)
    assert_export_is_the_trained_policy(run, tmp_path / "export", str(tiny), fresh, cfg, w2)


def test_the_published_model_is_planned_and_built(tmp_path, capsys):
    """Qwen/Qwen-Image-2.1 from its published configs (no download): the 7.1B transformer, the recipe fits 8 GPUs
    of 80 GiB, and `plan --suggest` names the smallest setting on 24 GiB GPUs."""
    from flowrl.bench.precision_arch import bench_arch
    from flowrl.bench.precision_arch_models import arch_model, build_transformer
    from flowrl.cli import main

    adapter, model = arch_model("qwen-image-2.1-arch")
    assert adapter is QwenImage21Policy and model.source == "Qwen/Qwen-Image-2.1"
    n = sum(p.numel() for p in build_transformer(adapter, model.transformer, torch.device("meta"),
                                                 torch.bfloat16).parameters())
    assert 7.0e9 < n < 7.2e9  # "7B"
    out = tmp_path / "plan.json"
    assert main(["plan", "--config", RECIPE, "--gpus", "8", "--gpu-memory", "80GiB", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["fits"] and plan["transformer_params"] == n
    assert main(["plan", "--config", RECIPE, "--gpus", "1", "--gpu-memory", "24GiB", "--suggest", "--max-gpus", "8",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    answer = json.loads(out.read_text())["suggest"]["any"]
    assert answer["fit"] is not None and answer["fit"]["peak_bytes"] <= 24 * 2 ** 30
    assert f"smallest: {answer['fit']['setting']}" in text
    bench = bench_arch("qwen-image-2.1-arch", ["full"], tmp_path / "arch.json", resolutions=(32,), batch=2, steps=2,
                       repeats=1, device="cpu", tiny=True, verbose=False)  # the architecture benchmark's toy size
    assert bench["arch"]["parameters"] > 0 and bench["backends"]["full"]["resolutions"]["32"]["images_per_second"] > 0
