"""The in-process VLM judges `editscore` (EditScore, arXiv 2509.23909) and `unifiedreward` (UnifiedReward, arXiv
2503.05236) on a tiny Qwen2.5-VL built from the published Qwen2.5-VL-7B config shrunk (2 layers 16 wide, a 1-block
vision tower with the real patch 14 and 2x2 merge), saved and loaded with ``from_pretrained``, offline.

What is checked: loading (model, processor, a peft LoRA merged), the image preparation (qwen-vl-utils'
``smart_resize``), batched generation equal to one request at a time, the parsing of the authors' documented
reply formats and the score each gives, the pairwise win rate within groups, edits' sources (locally and through
``serve-reward``). Against the authors' own code (the ``editscore`` 0.2 package and ``qwen-vl-utils`` 0.0.14, in
requirements.lock and the test extra; those tests skip with the reason where they are missing): EditScore's prompts, model inputs,
sampled replies and parser, and UnifiedReward's documented inference steps (``apply_chat_template`` +
``process_vision_info`` + the processor + ``generate(max_new_tokens=512)``).
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from flowrl import rewards
from flowrl.rewards import editscore as es
from flowrl.rewards import unifiedreward as ur
from flowrl.rewards._qwen_vl import prepare_image, smart_resize

pytestmark = pytest.mark.usefixtures("one_thread")

@pytest.fixture(scope="module")
def tiny_vlm(tiny_qwen_vl_dir) -> str:
    return tiny_qwen_vl_dir  # conftest: helpers_vlm.build_tiny_qwen25_vl, once per session


def images(n=4, size=16, seed=0):
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))  # [n, 3, H, W]


FAST = {"dtype": "float32", "max_new_tokens": 6}


# ---------------------------------------------------------------- preparation, loading, generation
def test_smart_resize_is_qwen_vl_utils():
    assert smart_resize(16, 16) == (56, 56)  # under 4 x 28^2 pixels: scaled up to the minimum
    assert smart_resize(512, 512) == (504, 504) and smart_resize(1024, 768) == (1036, 756)  # nearest multiples of 28
    assert smart_resize(8000, 6000) == (4116, 3080)  # over 16384 x 28^2 pixels: scaled down
    assert prepare_image(torch.rand(3, 30, 60)).size == (84, 56)  # PIL: (width, height)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 300)


def test_batched_generation_equals_one_request_at_a_time(tiny_vlm):
    one = rewards.build("unifiedreward", model=tiny_vlm, batch_size=1, **FAST)
    four = rewards.build("unifiedreward", model=tiny_vlm, batch_size=4, **FAST)
    reqs = [(one.vlm.chat_text(k, f"prompt {k}"), [prepare_image(im) for im in images(k, 16 + 8 * k, seed=k)])
            for k in (1, 2, 1)]
    texts = one.vlm.generate(reqs, max_new_tokens=6, do_sample=False)
    assert texts == four.vlm.generate(reqs, max_new_tokens=6, do_sample=False)  # left padding changes nothing
    assert all(isinstance(t, str) and t for t in texts)
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    one.vlm.generate(reqs[:1], seed=7, max_new_tokens=3, do_sample=True)
    assert torch.equal(torch.rand(3), before)  # the judge's seeding leaves the process's random state alone


def test_lora_is_merged(tiny_vlm, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(tiny_vlm)
    peft = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft.save_pretrained(tmp_path / "lora")
    merged = rewards.build("editscore", model=tiny_vlm, lora=str(tmp_path / "lora"), **FAST).vlm.model
    plain = rewards.build("editscore", model=tiny_vlm, lora=None, **FAST).vlm.model
    key = "model.language_model.layers.0.self_attn.q_proj.weight"
    merged_sd, plain_sd = merged.state_dict(), plain.state_dict()
    assert not torch.equal(merged_sd[key], plain_sd[key])
    torch.testing.assert_close(merged_sd[key], peft.merge_and_unload().state_dict()[key])
    with pytest.raises(OSError, match="LoRA adapter"):
        rewards.build("editscore", model=tiny_vlm, lora=str(tmp_path / "nothing-here"), **FAST)


def test_missing_checkpoint_says_what_to_pass(tmp_path):
    with pytest.raises(OSError, match="save_pretrained"):
        rewards.build("unifiedreward", model=str(tmp_path / "none"))


# ---------------------------------------------------------------- EditScore: parsing and scores
DOCUMENTED = '{\n"reasoning" : "The background is now a glass wall; the person is kept.",\n"score" : [20, 23]\n}'


@pytest.mark.parametrize("reply,want", [
    (DOCUMENTED, [20.0, 23.0]),
    ("Sure.\n" + DOCUMENTED + "\nDone.", [20.0, 23.0]),  # text around the JSON
    ("{'reasoning': 'fine', 'score': [7, 9]}", [7.0, 9.0]),  # Python quotes
    ('{"reasoning": "the "glass" wall", "score": [12, 4]}', [12.0, 4.0]),  # unescaped quotes in the reasoning
    ('{reasoning: "ok", score: [3, 5]}', [3.0, 5.0]),  # bare keys
    ('{"reasoning": "ok", "score": 17}', [17.0]),
    ('"score": [8, 6] and nothing else', [8.0, 6.0]),  # no braces: the numbers after "score"
    ("", []),
])
def test_editscore_parses_the_documented_replies(reply, want):
    assert es.parse_scores(reply) == want


def test_editscore_prompts_are_the_authors():
    sc = es.sc_prompt("Adjust the background to a glass wall.", 25)
    assert "From scale 0 to 25" in sc and "A score from 0 to 25 will be given based on the success" in sc
    assert sc.endswith("Editing instruction: Adjust the background to a glass wall.\n") and "10" not in sc
    assert "output score = [naturalness, artifacts]" in es.pq_prompt(25) and "0 to 25" in es.pq_prompt(25)
    text = es.chat_text("P", 2)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                    "<img1>: <|vision_start|><|image_pad|><|vision_end|><img2>: <|vision_start|><|image_pad|>"
                    "<|vision_end|>P<|im_end|>\n<|im_start|>assistant\n")


def canned(replies):
    """A stand-in for ``ChatVLM.generate`` answering each request with ``replies(text, images)``."""
    def generate(requests, seed=0, **kw):
        return [replies(text, ims) for text, ims in requests]
    return generate


def test_editscore_score_is_the_authors_formula(tiny_vlm, monkeypatch):
    """SC = min(SC) / 2.5, PQ = min(PQ) / 2.5 (score_range 25), overall sqrt(SC PQ), reward overall / 10;
    a row without a source NaN; a reply without scores the midpoint; two passes averaged."""
    r = rewards.build("editscore", model=tiny_vlm, lora=None, num_pass=2, **FAST)
    seen = []

    def replies(text, ims):
        seen.append((text.count("<|image_pad|>"), len(ims)))
        if "Editing instruction: broken" in text:
            return "I cannot rate this."
        return '{"reasoning": "r", "score": [20, 15]}' if "Editing instruction" in text else \
            '||V^=^V|| {"reasoning": "r", "score": [25, 10]} ||V^=^V||'

    monkeypatch.setattr(r.vlm, "generate", canned(replies))
    x, src = images(3), images(3, seed=1)
    out = r(x, ["make it red", "make it red", "broken"], sources=[src[0], None, src[2]])
    sc, pq = 15 / 2.5, 10 / 2.5
    assert out[0].item() == pytest.approx(math.sqrt(sc * pq) / 10) and math.isnan(out[1])
    assert out[2].item() == pytest.approx(math.sqrt(5.0 * pq) / 10)  # no SC scores: midpoint 5
    assert (2, 2) in seen and (1, 1) in seen and len(seen) == 2 * 2 * 2  # SC: source + result; PQ: the result
    strict = rewards.build("editscore", model=tiny_vlm, lora=None, on_invalid="raise", **FAST)
    monkeypatch.setattr(strict.vlm, "generate", canned(replies))
    with pytest.raises(ValueError, match="no score in"):
        strict(x[2:], ["broken"], sources=[src[2]])


def test_editscore_on_the_tiny_model(tiny_vlm):
    r = rewards.build("editscore", model=tiny_vlm, lora=None, **FAST)
    out = r(images(2), ["make it red", "make it blue"], sources=list(images(2, seed=1)))
    assert out.shape == (2,) and out.dtype == torch.float32 and bool(((out >= 0) & (out <= 1)).all())
    assert torch.isnan(r(images(1), ["x"])).all()  # no source: not an edit


# ---------------------------------------------------------------- UnifiedReward: pointwise and pairwise
@pytest.mark.parametrize("reply,want", [
    ("man (object): 1\ncat (object): 0\nFinal Score: 4", 0.8),
    ("Final Score: 3.5\n", 0.7),
    ("Final Score: 9", None), ("The image is fine.", None),
])
def test_unifiedreward_point_score(reply, want):
    got = ur.point_score(reply)
    assert got == (pytest.approx(want) if want is not None else None)


@pytest.mark.parametrize("reply,want", [
    ("Image 1 is better.", (1.0, 0.0)), ("Image 2 is better.", (0.0, 1.0)),
    ("Both images are equally good.", (0.5, 0.5)), ("", (0.5, 0.5)),
    ("<think>1. ... Image 1 (9/10)</think>\n<answer>Image 2 is better</answer>", (0.0, 1.0)),
])
def test_unifiedreward_verdicts(reply, want):
    assert ur.verdict(reply, ("image 1 is better", "image 2 is better")) == want


def test_win_rate_within_groups_is_pref_grpos():
    """Pref-GRPO's rule: every pair once, 1 to the winner, 0.5 each on a tie; reward = wins / comparisons."""
    pairs = [(0, 1), (0, 2), (1, 2)]
    assert ur.win_rates(3, pairs, [(1, 0), (1, 0), (0.5, 0.5)]) == [1.0, 0.25, 0.25]
    assert ur.win_rates(3, pairs, [(0, 1), (1, 0), (0, 1)]) == [0.5, 0.5, 0.5]
    assert math.isnan(ur.win_rates(1, [], [])[0])


def test_unifiedreward_pairwise_ranks_each_group(tiny_vlm, monkeypatch):
    r = rewards.build("unifiedreward", model=tiny_vlm, mode="pairwise", **FAST)
    x = images(5)
    shown = set()

    def replies(text, ims):  # the brighter image wins
        a, b = (int(np.asarray(im.convert("L"), dtype=np.int64).sum()) for im in ims[-2:])
        shown.add(len(ims))
        label = "Edited image" if "edited image is better" in text else "Image"
        return f"{label} 1 is better." if a > b else f"{label} 2 is better."

    monkeypatch.setattr(r.vlm, "generate", canned(replies))
    x[0], x[1], x[2] = 0.9, 0.1, 0.5  # group "a": ranks 0 > 2 > 1
    out = r(x, ["a", "a", "a", "b", "c"])
    assert out[:3].tolist() == [1.0, 0.0, 0.5] and math.isnan(out[4])  # "c" alone: NaN
    assert math.isnan(out[3])
    src = images(1, seed=3)[0]
    out = r(x[:2], ["edit", "edit"], sources=[src, src])
    assert out.tolist() == [1.0, 0.0] and 3 in shown  # source + both results


def test_unifiedreward_pointwise_on_the_tiny_model(tiny_vlm, monkeypatch):
    r = rewards.build("unifiedreward", model=tiny_vlm, **FAST)
    out = r(images(2), ["a cat", "a dog"])
    assert out.tolist() == [0.0, 0.0]  # random weights write no "Final Score": Flow-GRPO's 0
    assert math.isnan(rewards.build("unifiedreward", model=tiny_vlm, on_invalid="nan", **FAST)(
        images(1), ["a cat"])[0])
    monkeypatch.setattr(r.vlm, "generate", canned(lambda text, ims: "Final Score: 4" if "[a cat]" in text else
                                                  "Final Score: 2"))
    assert r(images(2), ["a cat", "a dog"]).tolist() == pytest.approx([0.8, 0.4])
    assert math.isnan(r(images(1), ["edit"], sources=[images(1)[0]])[0])  # pointwise edits are not built


UR2_DOCUMENTED = ("Alignment Score (1-5): 2.694700002670288\nCoherence Score (1-5): 2.371500015258789\n"
                  "Style Score (1-5): 2.802500009536743")  # UnifiedReward-2.0's example output


def test_unifiedreward_dimensions_read_as_pref_grpo(tiny_vlm, monkeypatch):
    """UnifiedReward-2.0's per-dimension 1-5 scores: a dimension a reply lacks takes the call's mean of it
    (Pref-GRPO's extract_normalized_rewards); reward = sum_k w_k s_k / (5 sum_k w_k)."""
    got = ur.dimension_scores([UR2_DOCUMENTED, "Alignment Score (1-5): 4", "no scores"], ["Alignment", "Style"])
    assert got[0] == {"Alignment": 2.694700002670288, "Style": 2.802500009536743}
    assert got[1] == {"Alignment": 4.0, "Style": 2.802500009536743}  # Style missing: the mean of those that have it
    assert got[2]["Alignment"] == pytest.approx((2.694700002670288 + 4.0) / 2)
    r = rewards.build("unifiedreward", model=tiny_vlm, mode="dimensions", dimensions={"Alignment": 3.0, "Style": 1.0},
                      **FAST)
    assert "Coherence Score (1-5): Y" in r.templates["point"]
    monkeypatch.setattr(r.vlm, "generate", canned(lambda text, ims: UR2_DOCUMENTED))
    want = (3 * 2.694700002670288 + 2.802500009536743) / (5 * 4)
    assert r(images(2), ["a", "b"]).tolist() == pytest.approx([want, want])
    assert math.isnan(r(images(1), ["edit"], sources=[images(1)[0]])[0])  # as pointwise: edits are not built
    with pytest.raises(ValueError, match="dimensions must map"):
        rewards.build("unifiedreward", model=tiny_vlm, mode="dimensions", dimensions={"Style": -1.0}, **FAST)


def test_bad_options_are_refused(tiny_vlm):
    with pytest.raises(ValueError, match="point_template must contain"):
        rewards.build("unifiedreward", model=tiny_vlm, point_template="no caption")
    with pytest.raises(ValueError, match="2 images but 1 sources"):
        rewards.build("editscore", model=tiny_vlm, lora=None, **FAST)(images(2), ["a", "b"], sources=[None])


# ---------------------------------------------------------------- served
def test_served_editscore_scores_what_the_local_one_does(tiny_vlm, monkeypatch):
    """Through `serve-reward` and the `remote` reward, sources included (a stand-in judge reads them)."""
    from helpers_reward_server import remote_kwargs, served

    local = rewards.build("editscore", model=tiny_vlm, lora=None, **FAST)

    def replies(text, ims):  # SC from the source's brightness, PQ from the result's
        level = float(np.asarray(ims[0].convert("L")).mean()) / 255
        return json.dumps({"reasoning": "r", "score": [round(25 * level), 25]})

    monkeypatch.setattr(local.vlm, "generate", canned(replies))
    x, src = images(3), images(3, seed=1)
    want = local(x, ["a", "b", "c"], sources=list(src))
    assert torch.isfinite(want).all() and len(set(want.tolist())) > 1
    with served(local) as url:
        remote = rewards.build("remote", **remote_kwargs(url, encoding="float32"))
        assert torch.equal(remote(x, ["a", "b", "c"], sources=list(src)), want)


# ---------------------------------------------------------------- against the authors' code
def _authors(module: str):
    return pytest.importorskip(module, reason=f"{module} (the authors' package) is not installed: pip install "
                                              f"editscore==0.2 qwen-vl-utils==0.0.14 json-repair")


@pytest.mark.parametrize("reply", [DOCUMENTED, "{'reasoning': 'fine', 'score': [7, 9]}",
                                   '{"reasoning": "the "glass" wall", "score": [12, 4]}',
                                   '{reasoning: "ok", score: [3, 5]}',
                                   '"score": [8, 6]', "", "no json at all 4 5", '{"reasoning": "r", "score": 17}'])
def test_editscore_parser_equals_the_authors(reply):
    parser = _authors("editscore.json_parser")
    assert es.parse_scores(reply) == parser.parse_vlm_output_to_dict(reply)["score"]


def test_editscore_inputs_and_replies_equal_the_authors(tiny_vlm, monkeypatch):
    """EditScore's Qwen25VL backend (bf16, sampled at temperature 0.7 / top-p 0.9 / top-k 20, seed 42) and ours on
    the same tiny weights, edit and instruction: the same prompts, token ids, pixels and sampled replies."""
    package = _authors("editscore")
    _authors("qwen_vl_utils")
    import transformers

    to = transformers.BatchFeature.to
    monkeypatch.setattr(transformers.BatchFeature, "to", lambda self, *a, **k: to(
        self, *["cpu" if v == "cuda" else v for v in a], **k))  # their prepare_input moves to CUDA
    theirs = package.EditScore(backbone="qwen25vl", model_name_or_path=tiny_vlm, score_range=25, seed=42)
    ours = rewards.build("editscore", model=tiny_vlm, lora=None, batch_size=1)
    src, result = images(2, size=40, seed=5)
    instruction = "Adjust the background to a glass wall."
    assert theirs.SC_prompt.replace("<instruction>", instruction) == es.sc_prompt(instruction)
    assert theirs.PQ_prompt == es.pq_prompt()
    from flowrl.rewards._qwen_vl import to_pil

    for want_images, (text, shown) in zip(([to_pil(src), to_pil(result)], to_pil(result)),
                                          ours.requests(result, [src], instruction)):
        prompt = theirs.SC_prompt.replace("<instruction>", instruction) if len(shown) == 2 else theirs.PQ_prompt
        a = theirs.model.prepare_input(want_images, prompt)
        b = ours.vlm.inputs([text], [shown])
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["image_grid_thw"], b["image_grid_thw"])
        assert torch.equal(a["pixel_values"], b["pixel_values"])
        got = ours.vlm.generate([(text, shown)], seed=42, **ours.generation)
        assert [g.strip() for g in got] == [theirs.model.inference(a, seed=42)]  # they strip; parsing does not care


def test_unifiedreward_inputs_and_replies_equal_the_authors_steps(tiny_vlm):
    """UnifiedReward's documented Qwen inference (qwen_point_score_image_generation.py): the message with the PIL
    image and the prompt, ``apply_chat_template``, ``process_vision_info``, the processor, ``generate(max_new_tokens=
    512)`` with the checkpoint's generation config, decoded without special tokens."""
    qwen_vl_utils = _authors("qwen_vl_utils")
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    from flowrl.rewards._qwen_vl import to_pil

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_vlm, dtype=torch.bfloat16)
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    image, caption = images(1, size=40, seed=7)[0], "a red cube on a blue ball"
    messages = [{"role": "user", "content": [{"type": "image", "image": to_pil(image)},
                                             {"type": "text", "text": ur.POINT_TEMPLATE.replace("{prompt}", caption)}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    image_inputs, video_inputs = qwen_vl_utils.process_vision_info(messages)
    a = processor(text=[text], images=image_inputs, videos=video_inputs, padding=True, return_tensors="pt")
    with torch.no_grad():
        ids = model.generate(**a, max_new_tokens=512)
    want = processor.batch_decode(ids[:, a["input_ids"].shape[1]:], skip_special_tokens=True,
                                  clean_up_tokenization_spaces=False)
    ours = rewards.build("unifiedreward", model=tiny_vlm, batch_size=1)
    chat = (ours.vlm.chat_text(1, ur.POINT_TEMPLATE.replace("{prompt}", caption)), [prepare_image(image)])
    b = ours.vlm.inputs(*zip(chat))
    assert chat[0] == text and torch.equal(a["input_ids"], b["input_ids"])
    assert torch.equal(a["pixel_values"], b["pixel_values"])
    assert ours.vlm.generate([chat], **ours.generation) == want


def test_editscore_on_qwen3_vl_equals_the_authors(tmp_path, monkeypatch):
    """EditScore's qwen3vl backend on a tiny Qwen3-VL: the processor's chat template and the images as they are
    (no qwen-vl-utils), the same token ids, pixels and sampled replies."""
    _authors("editscore")
    from editscore.mllm_tools.qwen3vl import Qwen3VL
    from helpers_vlm import build_tiny_qwen3_vl

    import transformers
    from flowrl.rewards._qwen_vl import to_pil

    path = build_tiny_qwen3_vl(tmp_path / "tiny-qwen3-vl")
    to = transformers.BatchFeature.to
    monkeypatch.setattr(transformers.BatchFeature, "to", lambda self, *a, **k: to(
        self, *["cpu" if v == "cuda" else v for v in a], **k))  # their prepare_input moves to CUDA
    theirs = Qwen3VL(path, temperature=0.7, seed=42)
    ours = rewards.build("editscore", model=path, lora=None, batch_size=1, max_new_tokens=512)
    assert not ours.vlm.uses_qwen_vl_utils
    src, result = images(2, size=40, seed=5)
    instruction = "Adjust the background to a glass wall."
    (text, shown), _ = ours.requests(result, [src], instruction)
    a = theirs.prepare_input([to_pil(src), to_pil(result)], es.sc_prompt(instruction))
    b = ours.vlm.inputs([text], [shown])
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["pixel_values"], b["pixel_values"])
    got = ours.vlm.generate([(text, shown)], seed=42, **ours.generation)
    assert [g.strip() for g in got] == [theirs.inference(a, seed=42)]
