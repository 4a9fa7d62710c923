"""The LTX-2 adapter against diffusers' own ``LTX2Pipeline`` on the tiny offline model (``flowrl make-tiny ltx2``):
one latent tensor carries the video and the audio tokens, ``[B, S_v + S_a, 128]``; flowrl's deterministic ODE loop
(``flowrl.rollout.ode.ode_sample``) equals the pipeline's loop on both streams (its x0-space CFG with separate video and
audio scales and their rescale, the schedule with dynamic shift and shift_terminal), its decoded videos equal the
pipeline's frames and its waveform the pipeline's audio; a LoRA written by ``flowrl export``'s writer loads with
``load_lora_weights``, moves the output and equals flowrl's loop; the recipe trains two GRPO iterations through both
streams (videos saved as GIFs and strips, the audio not scored) and its export is the trained policy; ``flowrl plan``
with the published 19B configs fits 8 GPUs of 80 GiB and ``--suggest`` answers; context parallelism is refused (the
diffusers plan does not run: shown on the tiny transformer). Shapes, save / load and LoRA targets are in the contract
battery (tests/test_policy_contract.py), every other sampler and update in tests/test_model_matrix.py."""
import json

import pytest
import torch

from flowrl.pipelines.ltx2 import LTX2Policy
from flowrl.rollout.ode import ode_sample
from model_parity import assert_export_is_the_trained_policy, exported_lora

PROMPTS = ["a cat walking on grass", "a red car"]
SEEDS, STEPS, SEQ, SIZE, FRAMES = [5, 6], 3, 8, 32, 5
G, GA, R, RA = 3.0, 7.0, 0.7, 0.5  # the pipeline's LTX-2.3 defaults of video / audio guidance and rescale

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("ltx2")  # conftest: one build per session, 32 px, 5 frames


def _policy(path, **kw):
    return LTX2Policy.from_pretrained(path, max_sequence_length=SEQ, **{"guidance_scale": G, "audio_guidance_scale": GA,
                                                                         "guidance_rescale": R,
                                                                         "audio_guidance_rescale": RA, **kw})


def _pipeline(pipe, policy, output_type):
    """The pipeline's own loop from flowrl's initial noise: the video tokens as its packed latents, the audio tokens
    as its packed audio latents (which it normalizes: given denormalized), STG and modality guidance off."""
    x = policy.initial_noise(SEEDS)  # [B, S_v + S_a, 128]
    avae, sv = pipe.audio_vae, policy.video_tokens
    return pipe(PROMPTS, negative_prompt="", latents=x[:, :sv], audio_latents=x[:, sv:] * avae.latents_std +
                avae.latents_mean, num_inference_steps=STEPS, height=SIZE, width=SIZE, num_frames=policy.num_frames,
                frame_rate=policy.frame_rate, guidance_scale=policy.guidance_scale, stg_scale=0.0, modality_scale=1.0,
                guidance_rescale=policy.guidance_rescale, audio_guidance_scale=policy.audio_guidance_scale,
                audio_stg_scale=0.0, audio_modality_scale=1.0, audio_guidance_rescale=policy.audio_guidance_rescale,
                max_sequence_length=SEQ, output_type=output_type)


def _as_pipeline_latents(policy, x):
    """flowrl's latents as the pipeline's ``output_type="latent"`` returns them: the video denormalized
    ``[B, 128, F', h, w]``, the audio denormalized ``[B, 8, S_a, 16]``."""
    vae, avae = policy.pipe.vae, policy.pipe.audio_vae
    video, _ = policy.split(x)
    video = video * vae.latents_std.view(1, -1, 1, 1, 1) / vae.config.scaling_factor + vae.latents_mean.view(
        1, -1, 1, 1, 1)
    audio = x[:, policy.video_tokens:] * avae.latents_std + avae.latents_mean  # [B, S_a, 128]
    return video, audio.unflatten(2, (-1, 16)).transpose(1, 2)


def test_ode_matches_the_ltx2_pipeline(tiny, tmp_path):
    assert json.loads((tiny / "flowrl.json").read_text())["num_frames"] == FRAMES
    policy = _policy(tiny)
    assert policy.video_shape == (2, 4, 4) and policy.audio_frames == 5 and policy.latent_shape == (32 + 5, 128)
    ours, videos = ode_sample(policy, PROMPTS, SEEDS, STEPS)  # [B, 37, 128], [B, 3, 5, 32, 32]
    pipe = policy.pipe
    ref = _pipeline(pipe, policy, "latent")
    assert torch.equal(policy.sigmas(STEPS), pipe.scheduler.sigmas.float())  # dynamic shift, shift_terminal 0.1
    video, audio = _as_pipeline_latents(policy, ours)
    torch.testing.assert_close(video, ref.frames, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(audio, ref.audio, atol=2e-5, rtol=1e-5)
    out = _pipeline(pipe, policy, "pt")  # frames [B, F, 3, H, W] (frame-major) and the vocoder's waveform
    assert videos.shape == (2, 3, FRAMES, SIZE, SIZE) and 0 <= videos.min() <= videos.max() <= 1
    torch.testing.assert_close(videos, out.frames.permute(0, 2, 1, 3, 4), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(policy.decode_audio(ours), out.audio, atol=2e-5, rtol=1e-5)

    # guidance off: one pass, and the samples differ
    plain = _policy(tiny, guidance_scale=1.0, audio_guidance_scale=1.0)
    assert plain.cfg_scale == 1.0 and not plain.uses_negative
    x_plain, _ = ode_sample(plain, PROMPTS, SEEDS, STEPS)
    video_plain, audio_plain = _as_pipeline_latents(plain, x_plain)
    ref_plain = _pipeline(plain.pipe, plain, "latent")
    torch.testing.assert_close(video_plain, ref_plain.frames, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(audio_plain, ref_plain.audio, atol=2e-5, rtol=1e-5)
    assert (x_plain - ours)[:, :32].abs().max() > 1e-3 and (x_plain - ours)[:, 32:].abs().max() > 1e-3

    # a LoRA through flowrl export's writer: loads into the pipeline, moves both streams, equals flowrl's loop
    lora_pipe = exported_lora(policy, "ltx2", str(tiny), tmp_path / "lora")
    ours_lora, _ = ode_sample(policy, PROMPTS, SEEDS, STEPS)
    ref_lora = _pipeline(lora_pipe, policy, "latent")
    video, audio = _as_pipeline_latents(policy, ours_lora)
    torch.testing.assert_close(video, ref_lora.frames, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(audio, ref_lora.audio, atol=2e-5, rtol=1e-5)
    assert (ref_lora.frames - ref.frames).abs().max() > 1e-2 and (ref_lora.audio - ref.audio).abs().max() > 1e-2


def test_one_tensor_carries_both_streams(tiny):
    """The latents are the pipeline's packed video tokens then its packed audio tokens: the split is the pipeline's
    unpacking; the velocity of a row does not depend on its batch-mates; the errors a user can cause are one line."""
    from flowrl.pipelines.ltx2_components import ltx2_guidance

    policy = _policy(tiny)
    pipe = policy.pipe
    x = policy.initial_noise([1, 2, 3])  # [3, 37, 128]
    video, audio = policy.split(x)  # [3, 128, 2, 4, 4], [3, 8, 5, 16]
    torch.testing.assert_close(pipe._pack_latents(video), x[:, :32], atol=0, rtol=0)
    torch.testing.assert_close(pipe._pack_audio_latents(audio), x[:, 32:], atol=0, rtol=0)
    cond = policy.encode_prompts(PROMPTS + ["a third prompt"])
    assert set(cond) == {"prompt_embeds", "audio_prompt_embeds", "prompt_attention_mask", "negative_prompt_embeds",
                         "negative_audio_prompt_embeds", "negative_prompt_attention_mask"}
    with torch.no_grad():
        v = policy.velocity(x, torch.tensor([0.9, 0.5, 0.2]), cond)
        v1 = policy.velocity(x[1:2], torch.tensor([0.5]), {k: t[1:2] for k, t in cond.items()})
    torch.testing.assert_close(v[1:2], v1, atol=1e-5, rtol=1e-5)
    # the guidance without rescale is u + s (c - u) per stream, in velocity space too
    u, c, s = torch.randn(2, 37, 128), torch.randn(2, 37, 128), torch.tensor([0.8, 0.3])
    out = ltx2_guidance(x[:2], s, u, c, 32, (3.0, 7.0), (0.0, 0.0))
    torch.testing.assert_close(out[:, :32], u[:, :32] + 3.0 * (c - u)[:, :32], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out[:, 32:], u[:, 32:] + 7.0 * (c - u)[:, 32:], atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="4 k \\+ 1"):
        LTX2Policy.from_pretrained(tiny, num_frames=8)
    with pytest.raises(ValueError, match="multiple of 4"):
        LTX2Policy.from_pretrained(tiny, max_sequence_length=6)
    with pytest.raises(ValueError, match="guidance_rescale"):
        LTX2Policy.from_pretrained(tiny, guidance_rescale=1.5)


def test_the_stored_transitions_and_their_log_probs_cover_both_streams(tiny):
    """The recipe's sampler (CPS steps, guidance on both streams) stores transitions of the whole ``[S_v + S_a, 128]``
    state; the GRPO update rescores each on policy (ratio 1, KL 0), and a transition whose audio tokens are moved
    scores lower: the log-probability is the joint one of both streams."""
    import contextlib
    from types import SimpleNamespace

    from flowrl.advantages import transition_advantages
    from flowrl.registry import SAMPLERS
    from flowrl.sde import cps_step
    from flowrl.types import index_cond
    from flowrl.updates import UPDATES
    from flowrl.updates.base import UpdateContext, build_options

    policy = _policy(tiny, guidance_rescale=0.0, audio_guidance_rescale=0.0)
    sampler = SAMPLERS.get("group")(group_size=2, num_steps=3, step="cps", noise_level=0.8)
    r = sampler(policy, PROMPTS, lambda frames, prompts, **m: frames.float().flatten(1).mean(1), seed=3)  # per frame
    t = r.transitions
    assert t.latents.shape[1:] == (37, 128) and len(t) == 4 * 3
    ctx = UpdateContext(policy=policy, unwrapped=policy.transformer, device=torch.device("cpu"),
                        autocast=contextlib.nullcontext, reference=contextlib.nullcontext, gather=lambda x: x,
                        train=SimpleNamespace(seed=0))
    adv, _ = transition_advantages(r)
    upd = UPDATES.get("grpo")(ctx, build_options(UPDATES.get("grpo"), "grpo", {"beta_kl": 0.01}))
    _, stats = upd.minibatch_loss(r, r.conditioning(policy), torch.arange(len(t)), adv)
    assert float(stats["approx_kl"]) < 1e-10 and abs(float(stats["ratio_mean"]) - 1) < 1e-5
    cond = index_cond(r.conditioning(policy), t.prompt_index[:1])
    with torch.no_grad():
        v = policy.velocity(t.latents[:1], t.sigma[:1], cond)  # [1, 37, 128]
    step = lambda sample: cps_step(v, t.latents[:1], t.sigma[:1], t.sigma_next[:1], prev_sample=sample,  # noqa: E731
                                   noise_level=0.8).log_prob
    own = step(t.next_latents[:1])
    torch.testing.assert_close(own, t.old_log_prob[:1], atol=1e-5, rtol=1e-5)
    moved = t.next_latents[:1].clone()
    moved[:, 32:] += 0.5  # the audio tokens only
    assert float(step(moved)) < float(own) - 1e-3


def test_diffusers_context_parallel_plan_does_not_run_on_ltx2(tiny):
    """Why ``train.context_parallel > 1`` is refused: diffusers' ``_cp_plan`` splits the video tokens but passes
    LTX-2's 4-dimensional split RoPE whole (its plan expects 3 dimensions), so a split forward fails (emulated on one
    process, as the planner runs it); the refusal is one line when the config loads."""
    from flowrl.distributed.context import emulate_context_parallel
    from flowrl.errors import ConfigError
    from flowrl.trainers.config import load_config
    from helpers import ROOT

    policy = _policy(tiny, guidance_scale=1.0, audio_guidance_scale=1.0)
    x, cond = policy.initial_noise([1]), policy.encode_prompts(PROMPTS[:1])
    kw = LTX2Policy.transformer_inputs(policy.transformer.config, torch.float32, x, torch.tensor([0.5]), cond,
                                       **policy.forward_settings())
    emulate_context_parallel(policy.transformer, 2)
    with pytest.raises(RuntimeError, match="must match the size"):
        policy.transformer(**kw)
    emulate_context_parallel(policy.transformer, 1)
    assert policy.transformer(**kw)[0].shape == (1, 32, 128)
    with pytest.raises(ConfigError, match="train.context_parallel=2: LTX-2's diffusers _cp_plan does not run"):
        load_config(ROOT / "recipes" / "ltx2_group_pickscore.yaml", ["train.context_parallel=2"])


def test_grpo_trains_on_ltx2_through_both_streams(tiny, tmp_path):
    """Two GRPO iterations of the LTX-2 recipe (group sampler, CPS steps, EMA; unsharded here, its FSDP2 in
    tests/test_model_matrix.py) shrunk by the smoke table: the LoRA of the video, audio and cross-modal layers
    changes, samples are saved as animated GIFs and strips; the run's export is the trained policy."""
    from PIL import Image

    from flowrl.smoke import smoke_overrides
    from flowrl.trainers.config import load_config
    from flowrl.trainers.online import train
    from helpers import ROOT, two_grpo_iterations

    path = ROOT / "recipes" / "ltx2_group_pickscore.yaml"
    cfg = load_config(path, [*smoke_overrides(load_config(path), tiny, tmp_path), "train.iterations=2",
                             "train.lr=1e-2", "logging.progress=false", "logging.image_every=2",
                             "train.sharding=none"])
    assert cfg.model.pipeline == "ltx2" and cfg.sampler.options["step"] == "cps"
    assert cfg.model.options["num_frames"] == 5  # the adapter's smoke value (its tiny VAE: 4 k + 1 frames)
    run = tmp_path / "run"
    summary = train(cfg, run)
    assert summary["iterations_done"] == 2 and summary["skipped_steps"] == 0
    recs, w1, w2 = two_grpo_iterations(run)
    changed = {k.split(".lora_")[0].split(".")[-1] for k in w1 if not torch.equal(w1[k], w2[k])}
    assert {"to_q", "proj"} <= changed
    for layer in ("audio_attn1", "audio_to_video_attn", "video_to_audio_attn", "audio_ff"):
        assert any(layer + "." in k and not torch.equal(w1[k], w2[k]) for k in w1), layer
    gif = Image.open(run / "samples" / "train_000002_anim.gif")
    assert gif.n_frames == 5 and Image.open(run / "samples" / "train_000002.png").width > 32
    fresh = LTX2Policy.from_pretrained(tiny, max_sequence_length=SEQ, guidance_scale=1.0)
    assert_export_is_the_trained_policy(run, tmp_path / "export", str(tiny), fresh, cfg, w2)


def test_plan_with_the_published_model_fits_and_suggests(tmp_path, capsys):
    """``flowrl plan`` of the recipe with the published LTX-2 configs (18.88B transformer, Gemma 3 12B, 121 frames of
    512 x 768 and their 126 audio tokens) fits 8 GPUs of 80 GiB under its FSDP (the blocks as units), and
    ``--suggest`` names the smallest setting that fits."""
    from flowrl.cli import main
    from flowrl.plan.core import GiB, plan_memory
    from flowrl.trainers.config import load_config
    from helpers import ROOT

    recipe = str(ROOT / "recipes" / "ltx2_group_pickscore.yaml")
    out = tmp_path / "plan.json"
    assert main(["plan", "--config", recipe, "--gpus", "8", "--suggest", "--max-gpus", "8", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert "FITS in 80.0 GiB" in text and "18.88B transformer params" in text
    fit = res["suggest"]["any"]["fit"]
    assert fit is not None and fit["peak_bytes"] <= 80 * GiB and "train.context_parallel=1" in fit["overrides"]
    plan = plan_memory(load_config(recipe), 8, 80 * GiB, recipe)
    assert plan.fits and 18.8e9 < plan.transformer_params < 18.9e9
    rows = {i.name: i for i in plan.items}
    unsharded = next(i for n, i in rows.items() if n.startswith("FSDP unsharded blocks"))
    assert unsharded.bytes < 2 * GiB  # one block at a time, not the whole transformer
    stored = next(i for n, i in rows.items() if n.startswith("rollout: stored transitions"))
    latents = 16 * 3 * 2 * (6144 + 126) * 128 * 4  # 48 transitions x 2 latents of video and audio tokens (float32)
    assert latents <= stored.bytes < latents + 48 * 64  # and each transition's few scalars
    from flowrl.bench.precision_arch import bench_arch  # `flowrl bench precision --pipeline ltx2-arch`

    bench = bench_arch("ltx2-arch", ["full"], tmp_path / "b.json", resolutions=(32,), batch=1, steps=1, repeats=1,
                       device="cpu", tiny=True, verbose=False, model_options={"num_frames": 9})
    assert bench["backends"]["full"]["resolutions"]["32"]["images_per_second"] > 0
