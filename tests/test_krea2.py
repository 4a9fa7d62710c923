"""The Krea 2 adapter against diffusers' own ``Krea2Pipeline`` on the tiny offline model (``flowrl make-tiny krea2``):
the fixed-length text layout (Qwen-Image's template, padding inside it, twelve tapped Qwen3-VL layers); flowrl's
deterministic ODE loop (``flowrl.rollout.ode.ode_sample``) equals the pipeline's (2x2 packing, text at RoPE position
0, the key mask, time ``(1000 sigma) / 1000``, the dynamic-shift schedule, Qwen-Image's VAE): bit-equal without CFG,
within float32 round-off with it (flowrl combines ``u + s (c - u)``, the pipeline ``c + (s - 1) (c - u)``); a
step-distilled pipeline (Krea-2-Turbo: ``is_distilled``, fixed mu 1.15, 8 steps, no guidance) bit-equal too; a LoRA
written by ``flowrl export``'s writer loads with ``load_lora_weights``, moves the output and equals flowrl's loop; the
recipe trains two GRPO iterations and its export is the trained policy; the published models are planned (``plan``,
``plan --suggest``) and their architecture built. Shapes, save / load and LoRA targets are in the contract battery
(tests/test_policy_contract.py), every other sampler and update in tests/test_model_matrix.py."""
import json

import pytest
import torch

from flowrl.pipelines.krea2 import Krea2Policy
from flowrl.pipelines.packing import pack_latents
from flowrl.rollout.ode import ode_sample
from model_parity import assert_export_is_the_trained_policy, exported_lora

PROMPTS = ["a photo of a cat", "a red apple on a table"]
SEEDS, STEPS, SEQ, SIZE = [5, 6], 3, 16, 32
RECIPE = "recipes/krea2_group_pickscore.yaml"

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("krea2")  # conftest: one build per session, 32 px (SIZE)


def _pipeline(pipe, policy, output_type: str, steps: int = STEPS):
    """The pipeline's own loop from flowrl's initial noise (packed, as the pipeline draws its own); its guidance_scale
    is flowrl's minus 1 (Krea's convention)."""
    return pipe(prompt=list(PROMPTS), latents=pack_latents(policy.initial_noise(SEEDS)), num_inference_steps=steps,
                height=SIZE, width=SIZE, max_sequence_length=SEQ, guidance_scale=policy.guidance_scale - 1,
                output_type=output_type).images


def test_ode_matches_the_krea2_pipeline(tiny, tmp_path):
    policy = Krea2Policy.from_pretrained(tiny, max_sequence_length=SEQ, guidance_scale=1.0)
    assert policy.latent_shape == (16, 4, 4) and policy.cfg_scale == 1.0 and not policy.distilled
    cond = policy.encode_prompts(PROMPTS)
    assert set(cond) == {"prompt_embeds", "prompt_embeds_mask"} and cond["prompt_embeds"].shape == (2, SEQ, 12, 16)
    mask = cond["prompt_embeds_mask"]  # [prompt | padding | 5 suffix tokens]: padding inside the template
    assert mask.dtype == torch.bool and mask[:, -5:].all() and mask.sum(1).tolist() == [10, 13]
    ours, images = ode_sample(policy, PROMPTS, SEEDS, STEPS)  # [B, 16, 4, 4], [B, 3, 32, 32]
    pipe = policy.pipe
    ref = _pipeline(pipe, policy, "latent")  # packed [B, 4, 64]
    assert torch.equal(policy.sigmas(STEPS), pipe.scheduler.sigmas.float())  # mu from 4 tokens (max 6400)
    torch.testing.assert_close(pack_latents(ours), ref, atol=0, rtol=0)  # bit-equal
    torch.testing.assert_close(images, _pipeline(pipe, policy, "pt"), atol=0, rtol=0)
    with torch.no_grad():  # a row's velocity alone equals it in its batch
        v = policy.velocity(ours, 0.5, cond)
        torch.testing.assert_close(policy.velocity(ours[1:], 0.5, {k: t[1:] for k, t in cond.items()}), v[1:],
                                   atol=1e-6, rtol=1e-5)

    guided = Krea2Policy(pipe, guidance_scale=5.5, max_sequence_length=SEQ, resolution=SIZE)  # the pipeline's g 4.5
    x_guided, _ = ode_sample(guided, PROMPTS, SEEDS, STEPS)
    torch.testing.assert_close(pack_latents(x_guided), _pipeline(pipe, guided, "latent"), atol=2e-5, rtol=1e-5)
    assert (x_guided - ours).abs().max() > 1e-3  # guidance changes the samples

    lora_pipe = exported_lora(guided, "krea2", str(tiny), tmp_path / "lora")
    ours_lora, _ = ode_sample(guided, PROMPTS, SEEDS, STEPS)
    ref_lora = _pipeline(lora_pipe, guided, "latent")
    torch.testing.assert_close(pack_latents(ours_lora), ref_lora, atol=2e-5, rtol=1e-5)
    assert (pack_latents(ours_lora) - pack_latents(x_guided)).abs().max() > 1e-2

    # Krea-2-Turbo: a step-distilled pipeline (fixed mu 1.15), 8 steps without guidance (LoRA kept, as Krea uses it)
    pipe.register_to_config(is_distilled=True)
    turbo = Krea2Policy(pipe, guidance_scale=1.0, max_sequence_length=SEQ, resolution=SIZE)
    x_turbo, _ = ode_sample(turbo, PROMPTS, SEEDS, 8)
    assert turbo.distilled
    ref_turbo = _pipeline(pipe, turbo, "latent", steps=8)
    assert torch.equal(turbo.sigmas(8), pipe.scheduler.sigmas.float()) and not torch.equal(turbo.sigmas(8),
                                                                                          policy.sigmas(8))
    torch.testing.assert_close(pack_latents(x_turbo), ref_turbo, atol=0, rtol=0)


def test_krea2_errors(tiny):
    with pytest.raises(ValueError, match="guidance_scale"):
        Krea2Policy.from_pretrained(tiny, guidance_scale=0.0)  # the pipeline's 0 is flowrl's 1.0
    with pytest.raises(ValueError, match="multiples of 16"):
        Krea2Policy.from_pretrained(tiny, resolution=40)


def test_grpo_trains_on_krea2(tiny, tmp_path):
    """Two GRPO iterations of the recipe (real CFG at s = 5.5, group sampler, one SDE step, EMA) shrunk by the smoke
    table; the run's export loads into Krea2Pipeline and is the trained policy."""
    from flowrl.smoke import smoke_overrides
    from flowrl.trainers.config import load_config
    from flowrl.trainers.online import train
    from helpers import ROOT, two_grpo_iterations

    path = ROOT / RECIPE
    cfg = load_config(path, [*smoke_overrides(load_config(path), tiny, tmp_path), "train.iterations=2",
                             "train.lr=1e-2", "logging.progress=false"])
    assert cfg.model.pipeline == "krea2" and cfg.model.guidance_scale == 5.5 and cfg.train.loss == "grpo"
    run = tmp_path / "run"
    summary = train(cfg, run)
    assert summary["iterations_done"] == 2 and summary["skipped_steps"] == 0
    recs, w1, w2 = two_grpo_iterations(run)
    assert any("transformer_blocks.0.attn.to_gate" in k for k in w2) and any("text_fusion." in k for k in w2)
    assert any(not torch.equal(w1[k], w2[k]) for k in w1)
    fresh = Krea2Policy.from_pretrained(tiny, max_sequence_length=8, guidance_scale=cfg.model.guidance_scale)
    assert_export_is_the_trained_policy(run, tmp_path / "export", str(tiny), fresh, cfg, w2)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # meta RMSNorms all in bf16
def test_the_published_models_are_planned_and_built(tmp_path, capsys):
    """krea/Krea-2-Raw (and -Turbo: the same architecture) from the published configs (no download): the 12.8B
    transformer, the recipe fits 8 GPUs of 80 GiB, and `plan --suggest` names the smallest setting on 40 GiB GPUs."""
    from flowrl.bench.precision_arch import bench_arch
    from flowrl.bench.precision_arch_models import arch_model, build_transformer
    from flowrl.cli import main

    adapter, model = arch_model("krea2-arch")
    assert adapter is Krea2Policy and model.source == "krea/Krea-2-Raw"
    assert Krea2Policy.published["krea/Krea-2-Turbo"].transformer == model.transformer
    n = sum(p.numel() for p in build_transformer(adapter, model.transformer, torch.device("meta"),
                                                 torch.bfloat16).parameters())
    assert 12.7e9 < n < 12.9e9  # "12B"
    out = tmp_path / "plan.json"
    assert main(["plan", "--config", RECIPE, "--gpus", "8", "--gpu-memory", "80GiB", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["fits"] and plan["transformer_params"] == n
    assert main(["plan", "--config", RECIPE, "--gpus", "1", "--gpu-memory", "40GiB", "--suggest", "--max-gpus", "8",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    answer = json.loads(out.read_text())["suggest"]["any"]
    assert answer["fit"] is not None and answer["fit"]["peak_bytes"] <= 40 * 2 ** 30
    assert f"smallest: {answer['fit']['setting']}" in text
    bench = bench_arch("krea2-arch", ["full"], tmp_path / "arch.json", resolutions=(32,), batch=2, steps=2, repeats=1,
                       device="cpu", tiny=True, verbose=False)  # the architecture benchmark's toy size
    assert bench["arch"]["parameters"] > 0 and bench["backends"]["full"]["resolutions"]["32"]["images_per_second"] > 0
