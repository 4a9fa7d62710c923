"""The Qwen-Image-Edit adapter against diffusers' own ``QwenImageEditPlusPipeline`` on the tiny offline model
(``flowrl make-tiny qwen-image-edit``): with one, two and three source images flowrl's deterministic ODE
loop equals the pipeline's loop (the sources through Qwen2.5-VL with the instruction, their VAE tokens
appended, true CFG with the norm rescale, the schedule over the generated tokens), also for 2511's
``zero_cond_t``; a batch mixing source counts gives each row the velocity it has alone; a LoRA written
by ``flowrl export``'s writer loads with ``load_lora_weights``, moves the pipeline's output and still
equals flowrl's loop; and the recipe trains two GRPO iterations on the shipped multi-source set with
rewards that see every source of every row, in order. Shapes, save / load and LoRA targets are in the
contract battery (tests/test_policy_contract.py); every sampler x update in tests/test_model_matrix.py."""
import pytest
import torch

from flowrl.conditions import encode_conditions
from flowrl.data import load_prompts
from flowrl.data.items import PromptItem, row_sources
from flowrl.pipelines.packing import pack_latents, unpack_latents
from flowrl.pipelines.qwen_image_edit import QwenImageEditPolicy
from flowrl.utils.images import to_pil
from helpers import ode_loop
from model_parity import exported_lora

SEED, STEPS, SIZE = 7, 3, 32
AREA = SIZE * SIZE  # the sources at the result's size, for the VAE and the text encoder (the tiny model's)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("qwen-image-edit")  # conftest: one build per session, 32 px (SIZE)


@pytest.fixture(scope="module")
def multi():
    return load_prompts("digits-edit-multi-sample")


@pytest.fixture
def small_areas(monkeypatch):
    """The pipeline's source sizes (module constants) set to the policy's ``condition_area`` / ``source_area``."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus

    monkeypatch.setattr(plus, "CONDITION_IMAGE_SIZE", AREA)
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", AREA)


def _policy(path, **kw) -> QwenImageEditPolicy:
    return QwenImageEditPolicy.from_pretrained(path, **{"condition_area": AREA, "source_area": AREA, **kw})


def _pipeline(pipe, policy, item, output_type="latent") -> torch.Tensor:
    """The pipeline's own loop (one prompt: the pipeline takes one per call) from flowrl's initial noise."""
    out = pipe(image=[to_pil(im) for im in item.images], prompt=item.prompt, negative_prompt=policy.negative_prompt,
               true_cfg_scale=policy.guidance_scale, height=SIZE, width=SIZE, num_inference_steps=STEPS,
               latents=pack_latents(policy.initial_noise([SEED])), output_type=output_type).images
    return unpack_latents(out.float(), 4, 4) if output_type == "latent" else out.float()


def test_ode_matches_the_edit_plus_pipeline(tiny, multi, small_areas, tmp_path):
    policy = _policy(tiny)
    assert policy.latent_shape == (16, 4, 4) and policy.guidance_scale == 4.0 and policy.max_sources == 3
    rows = {n: next(it for it in multi if it.num_sources == n) for n in (1, 2, 3)}
    refs = {}
    for n, item in rows.items():
        ours = ode_loop(policy, [item], [SEED], STEPS)  # [1, 16, 4, 4]
        refs[n] = _pipeline(policy.pipe, policy, item)
        torch.testing.assert_close(ours, refs[n], atol=2e-5, rtol=1e-5)
    assert torch.equal(policy.sigmas(STEPS), policy.pipe.scheduler.sigmas.float())  # over the generated tokens
    # the sources condition the model, in order
    two = rows[2]
    swapped = PromptItem(two.prompt, list(reversed(two.images)))
    assert (ode_loop(policy, [swapped], [SEED], STEPS) - refs[2]).abs().max() > 1e-4

    # a LoRA through flowrl export's writer: loads into the pipeline, moves its output, equals flowrl's loop
    lora_pipe = exported_lora(policy, "qwen-image-edit", str(tiny), tmp_path / "lora")
    ours_lora = ode_loop(policy, [two], [SEED], STEPS)
    ref_lora = _pipeline(lora_pipe, policy, two)
    torch.testing.assert_close(ours_lora, ref_lora, atol=2e-5, rtol=1e-5)
    assert (ref_lora - refs[2]).abs().max() > 1e-2


def test_2511_zero_cond_t_matches_the_pipeline(multi, small_areas, tmp_path):
    from flowrl.pipelines.tiny import make_tiny

    path = make_tiny("qwen-image-edit-2511", tmp_path / "tiny2511", image_size=SIZE)
    policy = _policy(path, guidance_scale=1.0)
    assert policy.transformer.config.zero_cond_t
    item = next(it for it in multi if it.num_sources == 3)
    torch.testing.assert_close(ode_loop(policy, [item], [SEED], STEPS), _pipeline(policy.pipe, policy, item),
                               atol=2e-5, rtol=1e-5)


def test_a_batch_of_mixed_sources_gives_each_row_its_own_velocity(tiny, multi):
    policy = _policy(tiny)
    items = [multi[3], multi[-1], multi[0], multi[5]]  # three, one, two, two sources
    cond = encode_conditions(policy, items)
    assert cond["source_shapes"].device.type == "cpu" and cond["source_shapes"].shape == (4, 3, 2)
    assert [int((s[:, 0] > 0).sum()) for s in cond["source_shapes"]] == [3, 1, 2, 2]
    assert cond["source_latents"].shape == (4, 12, 64) and cond["prompt_embeds"].shape == (4, 1024, 16)
    x, s = policy.initial_noise([1, 2, 3, 4]), torch.tensor([0.9, 0.6, 0.6, 0.3])
    with torch.no_grad():
        v = policy.velocity(x, s, cond)
        alone = torch.cat([policy.velocity(x[i:i + 1], s[i:i + 1], {k: t[i:i + 1] for k, t in cond.items()})
                           for i in range(4)])
    torch.testing.assert_close(v, alone, atol=1e-5, rtol=1e-5)
    text = encode_conditions(policy, [it.prompt for it in items])  # text only: Qwen-Image's conditioning
    assert "source_latents" not in text and set(text) == {"prompt_embeds", "prompt_embeds_mask",
                                                          "negative_prompt_embeds", "negative_prompt_embeds_mask"}
    with pytest.raises(ValueError, match="more than max_sequence_length=8"):
        encode_conditions(_policy(tiny, max_sequence_length=8), items[:1])
    with pytest.raises(ValueError, match="source_area must be an integer >= 1024"):
        _policy(tiny, source_area=10)


def test_the_recipe_trains_on_several_sources_and_the_rewards_see_every_one(tiny_model, multi, tmp_path):
    """Two GRPO iterations of recipes/qwen_image_edit_group_pickscore.yaml shrunk by ``--smoke``'s table on the
    shipped multi-source sample (one, two and three sources per row; instructions that need every source in
    order), rewarded by ``digits_edit`` (NaN without the sources it needs: finite rewards mean they arrived);
    every reward call of the rollouts and the evaluations gets each row's sources, all of them, in order."""
    from flowrl.builders import build_reward
    from flowrl.smoke import smoke_overrides
    from flowrl.trainers.config import load_config
    from flowrl.trainers.online import OnlineTrainer
    from helpers import two_grpo_iterations

    recipe = "recipes/qwen_image_edit_group_pickscore.yaml"
    first = load_config(recipe)
    cfg = load_config(recipe, [*smoke_overrides(first, tiny_model("qwen-image-edit"), tmp_path), "train.iterations=2",
                               "logging.progress=false", "logging.eval_every=1", "train.lr=1e-2"])
    assert cfg.model.pipeline == "qwen-image-edit" and cfg.data.prompts == "digits-edit-multi-sample"
    assert cfg.model.options["source_area"] == AREA and cfg.sampler.options["sde_window"] == 1
    seen, real = [], build_reward(cfg)

    class Recorded:  # the config's digits_edit, recording what each call received
        name, overlap, frame_stride = "recorded", True, 1

        def components(self, images, prompts, **meta):
            seen.append((list(prompts), [row_sources(s) for s in meta["sources"]]))
            return real.components(images, prompts, **meta)

        def combine(self, comps):
            return real.combine(comps)

    trainer = OnlineTrainer(cfg, tmp_path / "run", reward=Recorded())
    assert trainer.train()["iterations_done"] == 2
    recs, w1, w2 = two_grpo_iterations(tmp_path / "run")
    assert all(0 <= r["reward_mean"] <= 1 for r in recs)  # finite: digits_edit saw the sources it needs
    rows = 0
    for prompts, sources in seen:
        for p, srcs in zip(prompts, sources):
            assert any(it.prompt == p and len(it.images) == len(srcs) and
                       all(torch.equal(a, b) for a, b in zip(it.images, srcs)) for it in multi), p
            rows += 1
    # 2 rollouts of 4, 3 evaluations (before, after iteration 0 and the last) of 2 per prompt
    assert rows == 2 * 4 + 3 * 2 * len(multi) and max(len(s) for _, ss in seen for s in ss) == 3
    assert any(".lora_B." in k and v.abs().sum() > 0 for k, v in w1.items())
    assert any(not torch.equal(w1[k], w2[k]) for k in w1)
    assert not any("transformer_blocks.1.txt_mlp." in k for k in w2)  # the last block's unused text stream
