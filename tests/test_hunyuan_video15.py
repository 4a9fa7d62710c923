"""The HunyuanVideo 1.5 adapter against diffusers' own ``HunyuanVideo15Pipeline`` on the tiny offline model
(``flowrl make-tiny hunyuan-video-1.5``): the chat template's 108-token prefix cut as the pipeline cuts it, the ByT5
glyph stream of quoted text; flowrl's deterministic ODE loop (``flowrl.rollout.ode.ode_sample``) equals the pipeline's
(its guider's CFG, the static-shift schedule, the zero condition / mask channels and image tokens of text-to-video)
and its decoded videos the pipeline's frames; a LoRA written by ``flowrl export``'s writer loads into the pipeline's
transformer with ``load_lora_adapter`` (diffusers gives this pipeline no ``load_lora_weights``), moves the output and
equals flowrl's loop; the recipe trains two GRPO iterations on videos and
its export is the trained policy; ``flowrl plan`` of the published 8.3B model (its data-dependent token reordering
planned on meta tensors) says what it needs and ``--suggest`` answers; context parallelism is refused (no
``_cp_plan``). Shapes, save / load and LoRA targets are in the contract battery (tests/test_policy_contract.py), every
other sampler and update in tests/test_model_matrix.py."""
import json

import pytest
import torch

from flowrl.pipelines.hunyuan_video15 import HunyuanVideo15Policy
from flowrl.rollout.ode import ode_sample
from model_parity import assert_export_is_the_trained_policy, exported_lora

PROMPTS = ["a cat walking on grass", 'a sign that says "hello"']  # the second quotes text: the ByT5 stream
SEEDS, STEPS, SEQ, SIZE, FRAMES = [5, 6], 3, 8, 32, 5

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("hunyuan-video-1.5")  # conftest: one build per session, 32 px, 5 frames


def _pipeline(pipe, policy, output_type):
    """The pipeline's own loop from flowrl's initial noise, its guider at flowrl's scale and its Qwen2.5-VL tokens
    at flowrl's ``max_sequence_length``."""
    from diffusers.guiders import ClassifierFreeGuidance

    pipe.guider = ClassifierFreeGuidance(guidance_scale=policy.guidance_scale)
    pipe.tokenizer_max_length = policy.max_sequence_length
    return pipe(list(PROMPTS), latents=policy.initial_noise(SEEDS), num_inference_steps=STEPS, height=SIZE, width=SIZE,
                num_frames=policy.num_frames, output_type=output_type).frames


def test_template_prefix_and_both_text_streams(tiny):
    policy = HunyuanVideo15Policy.from_pretrained(tiny, max_sequence_length=SEQ, guidance_scale=1.0)
    pipe = policy.pipe
    messages = [{"role": "system", "content": pipe.system_message}, {"role": "user", "content": "X"}]
    text = pipe.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert len(pipe.tokenizer(text.split("X")[0]).input_ids) == pipe.prompt_template_encode_start_idx == 108
    cond = policy.encode_prompts(PROMPTS)
    assert cond["prompt_embeds"].shape == (2, SEQ, 16) and cond["prompt_embeds_mask"].tolist() == [[1] * SEQ] * 2
    alone = policy.encode_prompts(["a dog"])["prompt_embeds"]
    assert (alone - cond["prompt_embeds"][:1]).abs().max() > 1e-3  # the cut leaves the prompt's own tokens
    assert cond["prompt_embeds_2"].shape == (2, 256, 32)
    assert cond["prompt_embeds_mask_2"].sum(1).tolist() == [0, len('Text "hello". ') + 1]  # its bytes and </s>
    assert not cond["prompt_embeds_2"][0].any()  # no quoted text: zeros, as the pipeline gives


def test_ode_matches_the_hunyuan_video15_pipeline(tiny, tmp_path):
    assert json.loads((tiny / "flowrl.json").read_text())["num_frames"] == FRAMES
    policy = HunyuanVideo15Policy.from_pretrained(tiny, max_sequence_length=SEQ)  # the published guider's 6.0
    assert policy.guidance_scale == 6.0 and policy.latent_shape == (32, 2, 2, 2)
    ours, videos = ode_sample(policy, PROMPTS, SEEDS, STEPS)  # [B, 32, 2, 2, 2], [B, 3, 5, 32, 32]
    pipe = policy.pipe
    ref = _pipeline(pipe, policy, "latent")
    assert torch.equal(policy.sigmas(STEPS), pipe.scheduler.sigmas.float())  # static shift 5
    torch.testing.assert_close(ours, ref.float(), atol=2e-5, rtol=1e-5)
    assert videos.shape == (2, 3, FRAMES, SIZE, SIZE) and 0 <= videos.min() <= videos.max() <= 1
    torch.testing.assert_close(videos, _pipeline(pipe, policy, "pt").permute(0, 2, 1, 3, 4), atol=2e-5, rtol=1e-5)
    plain = HunyuanVideo15Policy.from_pretrained(tiny, max_sequence_length=SEQ, guidance_scale=1.0)
    x_plain, _ = ode_sample(plain, PROMPTS, SEEDS, STEPS)
    torch.testing.assert_close(x_plain, _pipeline(plain.pipe, plain, "latent").float(), atol=0, rtol=0)  # bit-equal
    assert (x_plain - ours).abs().max() > 1e-3  # guidance changes the samples

    # the VAE made batch-safe (pipelines.hunyuan_video15.batch_safe) decodes a batch as diffusers' decodes each alone
    from diffusers import AutoencoderKLHunyuanVideo15

    vae = AutoencoderKLHunyuanVideo15.from_pretrained(tiny, subfolder="vae")  # as diffusers has it
    with torch.no_grad():
        alone = torch.cat([vae.decode(z[None] / vae.config.scaling_factor).sample for z in ours])
        with pytest.raises(RuntimeError, match="broadcast"):
            vae.decode(ours / vae.config.scaling_factor)  # diffusers 0.42.1: a batch of two fails
    torch.testing.assert_close(videos, (alone / 2 + 0.5).clamp(0, 1), atol=1e-6, rtol=1e-5)

    lora_pipe = exported_lora(policy, "hunyuan-video-1.5", str(tiny), tmp_path / "lora")
    ours_lora, _ = ode_sample(policy, PROMPTS, SEEDS, STEPS)
    ref_lora = _pipeline(lora_pipe, policy, "latent").float()
    torch.testing.assert_close(ours_lora, ref_lora, atol=2e-5, rtol=1e-5)
    assert (ref_lora - ref).abs().max() > 1e-2


def test_errors_and_refusals(tiny):
    from diffusers.guiders import ClassifierFreeGuidance

    with pytest.raises(ValueError, match="4 k \\+ 1"):
        HunyuanVideo15Policy.from_pretrained(tiny, num_frames=8)
    with pytest.raises(ValueError, match="multiples of 16"):
        HunyuanVideo15Policy.from_pretrained(tiny, resolution=40)
    policy = HunyuanVideo15Policy.from_pretrained(tiny, max_sequence_length=SEQ)
    policy.pipe.guider = ClassifierFreeGuidance(guidance_scale=6.0, guidance_rescale=0.7)
    with pytest.raises(ValueError, match="plain classifier-free guidance only"):
        HunyuanVideo15Policy(policy.pipe)


def test_grpo_trains_on_hunyuan_video15(tiny, tmp_path):
    """Two GRPO iterations of the recipe (group sampler, one SDE step, CFG 6, EMA; unsharded here, its FSDP2 in
    tests/test_model_matrix.py) shrunk by the smoke table; the run's export loads into HunyuanVideo15Pipeline's
    transformer and is the trained policy."""
    from flowrl.smoke import smoke_overrides
    from flowrl.trainers.config import load_config
    from flowrl.trainers.online import train
    from helpers import ROOT, two_grpo_iterations

    path = ROOT / "recipes" / "hunyuan_video15_group_pickscore.yaml"
    cfg = load_config(path, [*smoke_overrides(load_config(path), tiny, tmp_path), "train.iterations=2",
                             "train.lr=1e-2", "logging.progress=false", "train.sharding=none",
                             "logging.image_every=2"])
    assert cfg.model.pipeline == "hunyuan-video-1.5" and cfg.model.guidance_scale == 6.0
    run = tmp_path / "run"
    summary = train(cfg, run)
    assert summary["iterations_done"] == 2 and summary["skipped_steps"] == 0
    recs, w1, w2 = two_grpo_iterations(run)
    assert any("token_refiner" in k for k in w2) and any(not torch.equal(w1[k], w2[k]) for k in w1)
    assert not any(k.startswith("transformer_blocks.1.ff_context") for k in w2)  # the last block's unused outputs
    from PIL import Image

    assert Image.open(run / "samples" / "train_000002_anim.gif").n_frames == 5  # videos as GIFs (Wan's path)
    fresh = HunyuanVideo15Policy.from_pretrained(tiny, max_sequence_length=SEQ)
    assert_export_is_the_trained_policy(run, tmp_path / "export", str(tiny), fresh, cfg, w2)  # into the transformer


def test_plan_of_the_published_model_says_what_it_needs(tmp_path, capsys):
    """``flowrl plan`` of the recipe with the published 480p configs (8.33B transformer, Qwen2.5-VL-7B and ByT5,
    33 frames of 480 x 848): its forward, whose token reordering needs values, runs on meta tensors under
    ``MetaTokenOrder`` at the real shapes; on 8 GPUs of 80 GiB it does not fit as given and names the text-embedding
    cache that makes it fit; ``--suggest`` answers; ``train.context_parallel=2`` is refused (no ``_cp_plan``)."""
    from flowrl.cli import main
    from flowrl.errors import ConfigError
    from flowrl.pipelines.facts import build_component
    from flowrl.pipelines.hunyuan_video15 import HUNYUAN_VIDEO15_480P
    from flowrl.plan.core import GiB, plan_memory
    from flowrl.trainers.config import load_config
    from helpers import ROOT

    # the planned forward on meta tensors has the real forward's output shape; real tensors take diffusers' forward
    config = HunyuanVideo15Policy.shrink_config(HUNYUAN_VIDEO15_480P)
    for device in ("meta", "cpu"):
        tr = build_component(HunyuanVideo15Policy.transformer_component(config, {}), device, torch.float32)
        x = torch.randn(2, 32, 2, 2, 2, device=device)
        cond = {"prompt_embeds": torch.randn(2, 8, 16, device=device),  # the shrunk text widths
                "prompt_embeds_mask": torch.ones(2, 8, dtype=torch.long, device=device),
                "prompt_embeds_2": torch.randn(2, 256, 32, device=device),
                "prompt_embeds_mask_2": torch.zeros(2, 256, dtype=torch.long, device=device)}
        kw = HunyuanVideo15Policy.transformer_inputs(tr.config, torch.float32, x, torch.tensor([0.5, 0.2],
                                                                                             device=device), cond)
        with torch.no_grad():
            assert tr(**kw)[0].shape == x.shape

    recipe = str(ROOT / "recipes" / "hunyuan_video15_group_pickscore.yaml")
    out = tmp_path / "plan.json"
    assert main(["plan", "--config", recipe, "--gpus", "8", "--suggest", "--max-gpus", "8", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "8.33B transformer params" in text and "DOES NOT FIT in 80.0 GiB" in text
    assert "model.text_embedding_cache=cache/text_embeddings model.drop_text_encoders=true" in text
    fit = json.loads(out.read_text())["suggest"]["any"]["fit"]
    assert fit is not None and fit["peak_bytes"] <= 80 * GiB
    cached = plan_memory(load_config(recipe, ["model.text_embedding_cache=cache/text_embeddings",
                                              "model.drop_text_encoders=true"]), 8, 80 * GiB, recipe)
    assert cached.fits and 8.3e9 < cached.transformer_params < 8.4e9
    with pytest.raises(ConfigError, match="declares no context-parallel plan"):
        plan_memory(load_config(recipe, ["train.context_parallel=2"]), 8, 80 * GiB, recipe)
    from flowrl.bench.precision_arch import bench_arch  # `flowrl bench precision --pipeline hunyuan-video-1.5-arch`

    bench = bench_arch("hunyuan-video-1.5-arch", ["full"], tmp_path / "b.json", resolutions=(32,), batch=1, steps=1,
                       repeats=1, device="cpu", tiny=True, verbose=False, model_options={"num_frames": 5})
    assert bench["backends"]["full"]["resolutions"]["32"]["images_per_second"] > 0
