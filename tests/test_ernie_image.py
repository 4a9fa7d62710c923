"""The ERNIE-Image adapter against diffusers' own ``ErnieImagePipeline`` on the tiny offline model (``flowrl make-tiny
ernie-image``): each prompt's own token count (the pipeline pads to the batch's longest, flowrl to
``max_sequence_length`` and cuts back), flowrl's deterministic ODE loop (``flowrl.rollout.ode.ode_sample``) equals
the pipeline's loop bit for bit with CFG (one doubled batch, unconditional first, in both) and without, latents and
decoded images (the batch-norm denormalization with the pipeline's eps and the unpatchify), the static-shift
schedule; a LoRA written by ``flowrl export``'s writer loads with ``load_lora_weights``, moves the output and equals
flowrl's loop; the recipe trains two GRPO iterations and its export is the trained policy; ``flowrl plan`` fits the
published model and ``--suggest`` answers for a full fine-tune. Shapes, save / load and LoRA targets are in the
contract battery (tests/test_policy_contract.py), every other sampler and update in tests/test_model_matrix.py."""
import json

import pytest
import torch

from flowrl.pipelines.ernie_image import ErnieImagePolicy
from flowrl.rollout.ode import ode_sample
from model_parity import assert_export_is_the_trained_policy, exported_lora

PROMPTS = ["a photo of a cat", "a red apple on a table"]
SEEDS, STEPS, SEQ, SIZE = [5, 6], 3, 16, 32
RECIPE = "recipes/ernie_image_group_pickscore.yaml"

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("ernie-image")  # conftest: one build per session, 32 px (SIZE)


def _pipeline(pipe, policy, output_type: str):
    """The pipeline's own loop from flowrl's initial noise (its latents are flowrl's: patchified, normalized)."""
    return pipe(prompt=list(PROMPTS), latents=policy.initial_noise(SEEDS), num_inference_steps=STEPS, height=SIZE,
                width=SIZE, guidance_scale=policy.guidance_scale, use_pe=False, output_type=output_type).images


def test_prompt_lengths_and_errors(tiny):
    policy = ErnieImagePolicy.from_pretrained(tiny, max_sequence_length=SEQ, guidance_scale=1.0)
    assert policy.pipe.pe is None and policy.latent_shape == (128, 2, 2)  # no prompt enhancer loaded
    cond = policy.encode_prompts(PROMPTS + [" ".join(["cat"] * 40)])
    assert set(cond) == {"prompt_embeds", "prompt_embeds_mask"} and cond["prompt_embeds"].shape == (3, SEQ, 16)
    assert cond["prompt_embeds_mask"].sum(1).tolist() == [1 + 5, 1 + 6, SEQ]  # <s> + words; the third cut at SEQ
    assert not cond["prompt_embeds"][0, 6:].any()  # zero past the prompt's own tokens
    ref = policy.pipe.encode_prompt(PROMPTS[:1], "cpu")[0]  # [6, D]: the pipeline's own hidden states
    torch.testing.assert_close(cond["prompt_embeds"][0, :6], ref, atol=0, rtol=0)
    with pytest.raises(ValueError, match="multiples of 16"):
        ErnieImagePolicy.from_pretrained(tiny, resolution=40)
    with pytest.raises(ValueError, match="guidance_scale"):
        ErnieImagePolicy.from_pretrained(tiny, guidance_scale=0.5)
    from diffusers import FlowMatchEulerDiscreteScheduler

    policy.pipe.scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    with pytest.raises(ValueError, match="shifts dynamically.*pass shift="):
        ErnieImagePolicy(policy.pipe, resolution=SIZE)


def test_ode_matches_the_ernie_image_pipeline(tiny, tmp_path):
    policy = ErnieImagePolicy.from_pretrained(tiny, max_sequence_length=SEQ, guidance_scale=4.0)  # the pipeline's
    assert policy.cfg_scale == 4.0 and "negative_prompt_embeds" in policy.encode_prompts(PROMPTS)
    ours, images = ode_sample(policy, PROMPTS, SEEDS, STEPS)  # [B, 128, 2, 2], [B, 3, 32, 32]
    pipe = policy.pipe
    ref = _pipeline(pipe, policy, "latent")
    assert torch.equal(policy.sigmas(STEPS), pipe.scheduler.sigmas.float())  # static shift 4
    torch.testing.assert_close(ours, ref, atol=0, rtol=0)  # bit-equal: the same doubled batch
    torch.testing.assert_close(images, _pipeline(pipe, policy, "pt"), atol=0, rtol=0)
    plain = ErnieImagePolicy(pipe, max_sequence_length=SEQ, guidance_scale=1.0, resolution=SIZE)  # Turbo's setting
    x_plain, _ = ode_sample(plain, PROMPTS, SEEDS, STEPS)
    torch.testing.assert_close(x_plain, _pipeline(pipe, plain, "latent"), atol=0, rtol=0)
    assert (x_plain - ours).abs().max() > 1e-3  # guidance changes the samples

    lora_pipe = exported_lora(policy, "ernie-image", str(tiny), tmp_path / "lora")
    ours_lora, _ = ode_sample(policy, PROMPTS, SEEDS, STEPS)
    ref_lora = _pipeline(lora_pipe, policy, "latent")
    torch.testing.assert_close(ours_lora, ref_lora, atol=2e-5, rtol=1e-5)
    assert (ref_lora - ref).abs().max() > 1e-2  # the loaded LoRA moves the pipeline's output


def test_grpo_trains_on_ernie_image(tiny, tmp_path):
    """Two GRPO iterations of the recipe (group sampler, one SDE step, CFG 4.0, EMA) shrunk by the smoke table;
    the run's export loads into ErnieImagePipeline and is the trained policy."""
    from flowrl.smoke import smoke_overrides
    from flowrl.trainers.config import load_config
    from flowrl.trainers.online import train
    from helpers import ROOT, two_grpo_iterations

    path = ROOT / RECIPE
    cfg = load_config(path, [*smoke_overrides(load_config(path), tiny, tmp_path), "train.iterations=2",
                             "train.lr=1e-2", "logging.progress=false"])
    assert cfg.model.pipeline == "ernie-image" and cfg.model.guidance_scale == 4.0 and cfg.train.loss == "grpo"
    run = tmp_path / "run"
    summary = train(cfg, run)
    assert summary["iterations_done"] == 2 and summary["skipped_steps"] == 0
    recs, w1, w2 = two_grpo_iterations(run)
    assert any("layers.0.mlp.gate_proj" in k for k in w2) and any("self_attention.to_out.0" in k for k in w2)
    assert any(not torch.equal(w1[k], w2[k]) for k in w1)
    fresh = ErnieImagePolicy.from_pretrained(tiny, max_sequence_length=8, guidance_scale=4.0)
    assert_export_is_the_trained_policy(run, tmp_path / "export", str(tiny), fresh, cfg, w2)


def test_plan_fits_and_suggests(tmp_path, capsys):
    """The recipe on the published 8B model (8.03B transformer parameters, the Ministral 3 encoder) fits 80 GiB
    GPUs as shipped (LoRA: one GPU holds what each of the 8 processes does); a full fine-tune does not fit one,
    and --suggest names a setting that does."""
    from flowrl.cli import main
    from flowrl.plan.core import GiB

    out = tmp_path / "plan.json"
    assert main(["plan", "--config", RECIPE, "--gpus", "1", "--json", str(out), "--suggest", "--max-gpus", "2",
                 "train.lora_rank=0"]) == 0
    text = capsys.readouterr().out
    plan = json.loads(out.read_text())
    assert "8.03B transformer params" in text and not plan["fits"]  # full fine-tune, one GPU
    fit = plan["suggest"]["any"]["fit"]
    assert fit["peak_bytes"] <= 80 * GiB and "train.sharding=fsdp" in fit["overrides"]
    assert main(["plan", "--config", RECIPE, "--gpus", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["fits"]  # the LoRA recipe as shipped (DDP: each GPU holds as much)
