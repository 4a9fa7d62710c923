"""The FLUX.1 Kontext adapter against diffusers' own ``FluxKontextPipeline`` on the tiny offline model
(``flowrl make-tiny flux-kontext``): with prompt items (instruction + source image) flowrl's deterministic
ODE loop equals the pipeline's loop given the same sources (source latents appended to the packed
sequence with offset ids, velocity over the generated tokens only, the schedule over the generated
token count); with plain text prompts it equals the pipeline without an image; a LoRA written by
``flowrl export``'s writer loads into the pipeline, moves its output, and still equals flowrl's
loop. Shapes, save / load and LoRA targets are in the contract battery (tests/test_policy_contract.py)."""
import pytest
import torch

from flowrl.conditions import encode_conditions
from flowrl.data.items import PromptItem
from flowrl.pipelines.packing import pack_latents, unpack_latents
from flowrl.pipelines.flux_kontext import FluxKontextPolicy
from helpers import ode_loop
from model_parity import exported_lora

PROMPTS = ["make the cat red", "add a hat"]
SEEDS, STEPS, SEQ, SIZE = [5, 6], 3, 8, 32

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("flux-kontext")  # conftest: one build per session, 32 px (SIZE)


def _sources(size=(SIZE, SIZE)) -> list[torch.Tensor]:
    """Two fixed source images, float [3, H, W] in [0, 1]."""
    g = torch.Generator().manual_seed(3)
    ramp = torch.linspace(0, 1, size[1]).expand(3, *size)  # [3, H, W]
    return [(0.7 * ramp + 0.3 * torch.rand(3, *size, generator=g)).clamp(0, 1), torch.rand(3, *size, generator=g)]


def _ours(policy, items) -> torch.Tensor:
    return ode_loop(policy, items, SEEDS, STEPS)  # [B, 16, 4, 4]


def _pipeline(pipe, policy, image) -> torch.Tensor:
    """The pipeline's own loop from flowrl's initial noise (packed), unpacked to [B, 16, h, w]."""
    out = pipe(image=image, prompt=PROMPTS, height=SIZE, width=SIZE, max_area=SIZE * SIZE, _auto_resize=False,
               guidance_scale=policy.guidance_scale, num_inference_steps=STEPS, max_sequence_length=SEQ,
               latents=pack_latents(policy.initial_noise(SEEDS)), output_type="latent").images
    return unpack_latents(out.float(), 4, 4)


def test_edit_and_text_loops_match_the_kontext_pipeline(tiny, tmp_path):
    policy = FluxKontextPolicy.from_pretrained(tiny, max_sequence_length=SEQ)
    sources = _sources()
    items = [PromptItem(p, im) for p, im in zip(PROMPTS, sources)]
    cond = encode_conditions(policy, items)
    assert cond["image_latents"].shape == (2, 16, 4, 4) and cond["image_latents"].dtype == torch.float32
    ours = _ours(policy, items)
    ref = _pipeline(policy.pipe, policy, torch.stack(sources))
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-5)
    # text only: the pipeline without an image (FLUX's velocity, no source tokens)
    ours_text = _ours(policy, PROMPTS)
    torch.testing.assert_close(ours_text, _pipeline(policy.pipe, policy, None), atol=2e-5, rtol=1e-5)
    assert (ours_text - ours).abs().max() > 1e-3  # the source image conditions the samples

    # a LoRA through flowrl export's writer: loads into the pipeline, moves its output, equals flowrl's loop
    lora_pipe = exported_lora(policy, "flux-kontext", str(tiny), tmp_path / "lora")
    ours_lora = _ours(policy, items)
    ref_lora = _pipeline(lora_pipe, policy, torch.stack(sources))
    torch.testing.assert_close(ours_lora, ref_lora, atol=2e-5, rtol=1e-5)
    assert (ref_lora - ref).abs().max() > 1e-2


def test_source_rows_true_cfg_and_errors(tiny):
    policy = FluxKontextPolicy.from_pretrained(tiny, max_sequence_length=SEQ, true_cfg_scale=2.0)
    big = _sources((48, 40))  # resized to the policy's resolution
    cond = encode_conditions(policy, [PromptItem(p, im) for p, im in zip(PROMPTS, big)])
    assert cond["image_latents"].shape == (2, 16, 4, 4) and "negative_prompt_embeds" in cond
    x = policy.initial_noise(SEEDS)
    with torch.no_grad():
        v = policy.velocity(x, 0.6, cond)
        v_one = policy.velocity(x[1:], 0.6, {k: t[1:] for k, t in cond.items()})
        v_text = policy.velocity(x, 0.6, {k: t for k, t in cond.items() if k != "image_latents"})
    assert v.shape == x.shape and torch.isfinite(v).all()
    torch.testing.assert_close(v[1:], v_one, atol=1e-5, rtol=1e-5)  # a row does not depend on its batch-mate
    assert (v - v_text).abs().max() > 1e-3
    with pytest.raises(ValueError, match="1 of 2 prompts carry a source image"):  # all edits or all text
        encode_conditions(policy, [PromptItem("a", big[0]), "b"])
    with pytest.raises(ValueError, match="takes at most 1 per prompt"):  # the pipeline takes one image
        encode_conditions(policy, [PromptItem("a", [big[0], big[1]])])


def test_editing_recipe_trains_on_the_tiny_model(tiny, tmp_path):
    """Two GRPO iterations of recipes/flux_kontext_edit.yaml on the tiny model and the shipped digits
    editing set (instruction + source image rows), scored by ``digits_edit`` (NaN for a row without
    its source: finite rewards mean the sources reached the reward), the text embeddings cached and
    the text encoders dropped (the sources are encoded per batch); LoRA on FLUX's targets + proj_mlp."""
    from flowrl.checkpoints.common import list_checkpoints
    from flowrl.trainers.config import load_config
    from flowrl.trainers.online import train
    from helpers import ROOT, lora_weights, tiny_overrides, train_records

    cfg = load_config(ROOT / "recipes" / "flux_kontext_edit.yaml", tiny_overrides(tiny, "group", **{
        "data.prompts": "digits-edit-sample", "data.eval_prompts": "digits-edit-sample",
        "reward.weights": "{digits_edit: 1.0}",
        "model.text_embedding_cache": "memory", "model.drop_text_encoders": "true"}))
    assert cfg.model.pipeline == "flux-kontext" and cfg.model.guidance_scale == 2.5 and cfg.train.ema
    summary = train(cfg, tmp_path / "run")
    assert summary["iterations_done"] == 2 and summary["skipped_steps"] == 0
    recs = train_records(tmp_path / "run")
    assert [r["iteration"] for r in recs] == [0, 1]
    assert all(0 <= r["reward_mean"] <= 1 for r in recs)  # finite: digits_edit saw every source
    weights = lora_weights(list_checkpoints(tmp_path / "run" / "checkpoints")[-1])
    assert any(".proj_mlp.lora_B." in k and v.abs().sum() > 0 for k, v in weights.items())


def test_prompt_items_condition_through_the_text_cache(tiny):
    """``flowrl.conditions.encode_conditions`` on :class:`PromptItem` s hands the adapter texts and sources
    separately: the text's conditioning plus the sources', also with the text served by the cache and
    the encoders dropped (the cache holds the text part only)."""
    from flowrl.data.embeddings import TextEmbeddingCache

    policy = FluxKontextPolicy.from_pretrained(tiny, max_sequence_length=SEQ)
    items = [PromptItem(p, im) for p, im in zip(PROMPTS, _sources())]
    want = {**policy.encode_prompts(PROMPTS), **policy.source_conditioning(PROMPTS, [(it.image,) for it in items])}
    got = encode_conditions(policy, items)
    assert set(got) == set(want) and "image_latents" in got
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-6)
    cache = TextEmbeddingCache.build(policy, PROMPTS)
    cached = cache.wrap(policy, drop_encoders=True)
    assert cache.prompts == PROMPTS and "image_latents" not in cache.keys
    served = encode_conditions(cached, items)
    for k in want:
        torch.testing.assert_close(served[k], want[k], atol=1e-6, rtol=1e-6)


def test_sample_gives_kontext_its_source_or_says_it_runs_text_only(tiny, tmp_path, capsys):
    """``flowrl sample --source PATH`` edits that image (the grid shows it beside the results); without
    it, Kontext samples text-to-image, as its pipeline does without an image, and says so on stderr."""
    import json

    from flowrl.cli import main
    from flowrl.data.prompts import SETS_DIR

    line = ["sample", "--config", "recipes/flux_kontext_edit.yaml", "--prompts", "turn it into a 7", "--per-prompt",
            "1", "--steps", "1", f"model.path={tiny}", "model.device=cpu", f"model.options.resolution={SIZE}",
            "model.options.dtype=float32", f"model.options.max_sequence_length={SEQ}"]
    source = SETS_DIR / "digits_edit" / "digit_3.png"
    assert main([*line, "--source", str(source), "--out", str(tmp_path / "edit.png")]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["samples"] == 1 and "no source images" not in cap.err
    assert main([*line, "--out", str(tmp_path / "text.png")]) == 0
    err = capsys.readouterr().err
    assert "[flowrl] note: --prompts has no source images: flux-kontext is an editing model and generates from the " \
           "text alone (text-to-image); to edit images, give the source image(s) with --source PATH" in err
    from PIL import Image

    with Image.open(tmp_path / "edit.png") as a, Image.open(tmp_path / "text.png") as b:
        assert a.width > b.width  # the edit's grid has the source column
