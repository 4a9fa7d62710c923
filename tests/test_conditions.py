"""Conditions beyond text end to end: prompt items with a source image (the shipped digits editing
set) flow unchanged through the prompt loader, every sampler, the text-embedding cache, the
evaluation and the offline dataset, and every reward call receives each row's source as
``sources=`` (in row order); the VLM judge sends source, result and instruction; the remote reward
carries the sources over the wire. The digits model is text-only: the sources reach the rewards,
not the model (FLUX.1 Kontext's source conditioning is in tests/test_flux_kontext.py)."""
import pytest
import torch

from flowrl.conditions import encode_conditions, reward_inputs
from flowrl.data import load_prompts
from flowrl.data.items import PromptItem
from flowrl.registry import SAMPLERS

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread

# sampler -> tiny options (the rows of flowrl/smoke.py; Sol explores with both CPU quantizers)
TINY = {
    "group": ("group", {"group_size": 2, "num_steps": 2}),
    "branch": ("branch", {"num_steps": 3, "split_steps": [0, 1], "window": 2}),
    "tempflow": ("tempflow", {"num_steps": 3, "branch_steps": [0, 1], "branches": 2, "seeds_per_prompt": 1}),
    "sol-int8": ("sol", {"pool_size": 4, "preview_steps": 2, "keep": 2, "regen_options": {"num_steps": 2},
                         "explore_backend": "int8-dynamic"}),
    "sol-nvfp4": ("sol", {"pool_size": 4, "preview_steps": 2, "keep": 2, "regen_options": {"num_steps": 2},
                          "explore_backend": "nvfp4-emulated"}),
    "ode": ("ode", {"group_size": 2, "num_steps": 2}),
}


class Recording:
    """A reward that records what each call received and scores the mean pixel."""

    name = "recording"

    def __init__(self):
        self.calls = []

    def __call__(self, images, prompts, sources=None, **meta):
        self.calls.append((list(prompts), sources))
        return images.float().flatten(1).mean(1)

    def check(self, items):
        """Every call had one source per row, the source of the item whose instruction the row has."""
        by_text = {it.prompt: it.image for it in items}
        assert self.calls and len(by_text) == len(items)  # the sample's instructions are distinct
        for prompts, sources in self.calls:
            assert sources is not None and len(sources) == len(prompts)
            for p, s in zip(prompts, sources):
                assert isinstance(p, str) and torch.equal(s, by_text[p])


@pytest.fixture(scope="module")
def items():
    got = load_prompts("digits-edit-sample")
    assert all(isinstance(it, PromptItem) and it.has_source for it in got)
    return got[:3]


@pytest.mark.parametrize("sampler", list(TINY))
def test_every_sampler_hands_the_rewards_the_sources(tiny_digits_policy, items, sampler):
    name, options = TINY[sampler]
    reward = Recording()
    r = SAMPLERS.get(name)(**options)(tiny_digits_policy, items, reward, seed=1)
    assert r.prompts == items and all(isinstance(p, PromptItem) for p in r.prompts)  # carried unchanged
    reward.check(items)
    if name in ("group", "ode"):  # one call per chunk, rows in sample order: the sources in that order
        (prompts, sources), = reward.calls
        want = [items[i] for i in r.prompt_index.tolist()]
        assert prompts == [it.prompt for it in want] and all(torch.equal(s, it.image) for s, it in zip(sources, want))
    # the update's conditioning of the rollout is the text's (the digits model takes no source)
    torch.testing.assert_close(r.conditioning(tiny_digits_policy),
                               tiny_digits_policy.encode_prompts([it.prompt for it in items]))


def test_text_prompts_pass_unchanged_and_mixed_rows(tiny_digits_policy, items):
    assert reward_inputs(["a", "b"], {"x": 1}) == (["a", "b"], {"x": 1})
    mixed = [items[0], "a handwritten digit 3"]
    texts, meta = reward_inputs(mixed, {})
    assert texts == [items[0].prompt, "a handwritten digit 3"]
    assert torch.equal(meta["sources"][0], items[0].image) and meta["sources"][1] is None
    cond = encode_conditions(tiny_digits_policy, mixed)  # a text-only model: no source conditioning
    torch.testing.assert_close(cond, tiny_digits_policy.encode_prompts(texts))

    class Sourced:  # a policy that takes one source per prompt: texts and sources arrive separately
        max_sources = 1
        encode_prompts = staticmethod(tiny_digits_policy.encode_prompts)

        @staticmethod
        def source_conditioning(texts, sources):
            assert all(isinstance(t, str) for t in texts) and all(isinstance(s, tuple) for s in sources)
            return {"source": torch.stack([s[0] if s else torch.zeros(3, 16, 16) for s in sources])}

    got = encode_conditions(Sourced(), mixed)
    assert got["source"].shape == (2, 3, 16, 16) and torch.equal(got["source"][0], items[0].image)
    assert not got["source"][1].any()  # the text-only row: no source
    two = PromptItem("write the sum of the two digits", [items[0].image, items[1].image])
    with pytest.raises(ValueError, match="carries 2 source images but Sourced takes at most 1"):
        encode_conditions(Sourced(), [two])


def test_an_editing_run_rewards_see_the_sources(tiny_digits_dir, items, tmp_path):
    """`flowrl train` on the shipped editing set (data.prompts: digits-edit-sample, its .jsonl rows with
    images), text embeddings cached: every reward call of the rollouts and of the evaluation gets the
    sources; the digits_edit reward (NaN without a source) scores every sample."""
    from flowrl.trainers.config import load_config
    from flowrl.trainers.online import OnlineTrainer
    from helpers import ROOT, train_records

    overrides = {"model.path": str(tiny_digits_dir), "data.prompts": "digits-edit-sample",
                 "data.eval_prompts": "digits-edit-sample", "data.eval_seeds_per_prompt": 2,
                 "sampler.group_size": 2, "sampler.num_steps": 2, "train.batch_size": 4, "train.iterations": 2,
                 "train.minibatch_size": 16, "train.grad_accum": 1, "logging.eval_every": 1,
                 "logging.image_every": 100, "logging.trackers": "[]", "logging.progress": "false",
                 "reward.heldout": "{}", "reward.weights": "{digits_edit: 1.0}",
                 "model.text_embedding_cache": "memory"}
    cfg = load_config(ROOT / "recipes" / "digits.yaml", [f"{k}={v}" for k, v in overrides.items()])
    from flowrl.builders import build_reward

    recording, real = Recording(), build_reward(cfg)

    class Both:  # the recording reward beside the config's digits_edit
        name, overlap = "both", True

        def components(self, images, prompts, **meta):
            recording(images, prompts, **meta)
            return real.components(images, prompts, **meta)

        def combine(self, comps):
            return real.combine(comps)

    trainer = OnlineTrainer(cfg, tmp_path / "run", reward=Both())
    summary = trainer.train()
    assert summary["iterations_done"] == 2
    every = load_prompts("digits-edit-sample")
    recording.check(every)
    # 2 rollouts of 4, 3 evaluations (iterations 0, 1 and the last) and the real-data reference, 2 per prompt
    assert sum(len(p) for p, _ in recording.calls) == 2 * 4 + (3 + 1) * 2 * len(every)
    recs = train_records(tmp_path / "run")
    assert all(torch.isfinite(torch.tensor(r["reward_mean"])) for r in recs)  # digits_edit saw the sources
    assert trainer.policy.text_embedding_cache.prompts == [it.prompt for it in every]  # the text part only


def test_offline_dataset_keeps_the_sources(tiny_digits_policy, items, tmp_path):
    from flowrl.data.offline import GenerationSettings, add_reward_column, generate_dataset
    from flowrl.data.offline_store import OfflineDataset
    from flowrl.rollout.ode import ode_sample
    from flowrl.scoring import score_images

    reward = Recording()
    settings = GenerationSettings(k=2, groups_per_prompt=1, num_steps=2, groups_per_shard=2, save_png=False)
    generate_dataset(tmp_path / "ds", tiny_digits_policy, items, {"rec": reward}, settings, sample=ode_sample,
                     score=score_images, progress=False)
    reward.check(items)
    ds = OfflineDataset(tmp_path / "ds")
    assert ds.prompts == items and all(torch.equal(a.image, b.image) for a, b in zip(ds.prompts, items))
    batch = ds.read([0, 1, 2])
    assert batch.prompts == [items[int(p)] for p in batch.prompt_index]
    again = Recording()
    add_reward_column(tmp_path / "ds", "again", again, tiny_digits_policy.decode, progress=False, score=score_images)
    again.check(items)  # a rescored column sees the stored groups' sources
    # generating again with the same items resumes (the stored records compare equal)
    generate_dataset(tmp_path / "ds", tiny_digits_policy, items, {"rec": Recording()}, settings, sample=ode_sample,
                     score=score_images, progress=False)
    with pytest.raises(ValueError, match="cannot be stored"):
        generate_dataset(tmp_path / "other", tiny_digits_policy, [PromptItem("x", items[0].image)], {}, settings,
                         sample=ode_sample, score=score_images, progress=False)


def test_vlm_judge_sends_source_result_and_instruction(stub, monkeypatch):
    import base64
    import io

    import numpy as np
    from PIL import Image

    from flowrl import rewards

    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    judge = rewards.build("vlm_judge", url=f"http://127.0.0.1:{stub.server_port}/v1", model="stub", concurrency=2)
    results = torch.stack([torch.full((3, 8, 8), v) for v in (0.3, 0.8, 0.6)])  # [3, 3, 8, 8]
    sources = [torch.full((3, 8, 8), 0.1), None, torch.full((3, 8, 8), 0.9)]
    s = judge(results, ["make it brighter", "a grey square", "make it darker"], sources=sources)
    torch.testing.assert_close(s, torch.tensor([0.3, 0.8, 0.6]), atol=0.01, rtol=0)  # the result is judged
    by_text = {}
    for r in stub.requests:
        parts = r["body"]["messages"][-1]["content"]
        text = next(p["text"] for p in parts if p["type"] == "text")
        pngs = [Image.open(io.BytesIO(base64.b64decode(p["image_url"]["url"].split(",", 1)[1])))
                for p in parts if p["type"] == "image_url"]
        by_text[text] = [float(np.asarray(im.convert("L")).mean() / 255) for im in pngs]
    edit = [t for t in by_text if "Instruction: make it brighter" in t]
    assert len(edit) == 1 and "source image" in edit[0]
    assert by_text[edit[0]] == pytest.approx([0.1, 0.3], abs=0.01)  # source first, then the result
    caption = [t for t in by_text if "Caption: a grey square" in t]
    assert len(caption) == 1 and by_text[caption[0]] == pytest.approx([0.8], abs=0.01)  # no source: one image
    with pytest.raises(ValueError, match="3 images but 2 sources"):
        judge(results, ["a", "b", "c"], sources=sources[:2])


@pytest.mark.parametrize("edit_set", ["digits-edit-sample", "digits-edit-multi-sample"])
def test_remote_reward_carries_the_sources(edit_set):
    """One source per row, or one to three (every source of every row, in order): the served reward scores
    exactly what the local one does."""
    from helpers_reward_server import remote_kwargs, served

    from flowrl import rewards
    from flowrl.conditions import reward_inputs

    items = load_prompts(edit_set)[:3] if edit_set == "digits-edit-sample" else load_prompts(edit_set)
    local = rewards.build("digits_edit")
    results = torch.rand(len(items), 3, 16, 16, generator=torch.Generator().manual_seed(0))
    texts, meta = reward_inputs(items, {})
    want = local(results, texts, **meta)
    assert torch.isfinite(want).all()
    with served("digits_edit") as url:
        remote = rewards.build("remote", **remote_kwargs(url, encoding="float32"))
        assert torch.equal(remote(results, texts, **meta), want)
        with pytest.raises(ValueError, match=f"1 of {len(items)} rows have no image"):
            remote(results, texts, sources=[None, *meta["sources"][1:]])


def test_text_to_image_model_with_sources_says_so_once(tiny_digits_policy, items, capsys, monkeypatch):
    from flowrl import conditions

    monkeypatch.setattr(conditions, "_NOTICED", set())
    encode_conditions(tiny_digits_policy, items)
    encode_conditions(tiny_digits_policy, items)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "text-to-image model" in err[0] and "flux-kontext" in err[0]
    encode_conditions(tiny_digits_policy, ["a handwritten digit 3"])  # plain text: nothing to say
    assert capsys.readouterr().err == ""


def test_frames_are_reduced_in_one_place_with_the_stride_as_an_argument(monkeypatch):
    """Held-out and judge rewards (plain rewards from build_rewards) and the trained MultiReward reduce
    video frames through the one function (flowrl.media.score_per_frame, called by score_images), with
    the stride the caller passes; nothing is set on the reward objects."""
    import flowrl.media
    import flowrl.rewards
    from flowrl.builders import build_rewards
    from flowrl.rewards import MultiReward
    from flowrl.scoring import score_images

    seen, reductions = [], []

    def frame_mean(images, prompts, **meta):  # [B, 3, H, W] per call
        seen.append(images.shape[0])
        return images.flatten(1).mean(1)

    real = flowrl.media.score_per_frame
    counted = lambda *a, **k: reductions.append(a[3]) or real(*a, **k)  # noqa: E731
    monkeypatch.setattr("flowrl.scoring.score_per_frame", counted)  # plain rewards: flowrl.scoring calls it
    monkeypatch.setattr("flowrl.media.score_per_frame", counted)  # MultiReward.video_components calls it there
    monkeypatch.setattr(flowrl.rewards, "build", lambda name, **kw: frame_mean)
    got = build_rewards({"frame_mean_test": {}})["frame_mean_test"]
    assert got is frame_mean and not hasattr(got, "frame_stride")
    video = torch.rand(2, 3, 7, 4, 4)  # [B, C, F, H, W]: frames 0, 3, 6 scored
    total, _ = score_images(got, video, ["a", "b"], frame_stride=3)
    assert seen == [6] and reductions == [3]  # 2 videos x frames 0, 3, 6 in one call
    want = video[:, :, ::3].mean(dim=(1, 3, 4)).mean(1)
    torch.testing.assert_close(total, want)
    multi = MultiReward({"m": frame_mean}, {"m": 1.0}, frame_stride=3)  # the trained reward: its own stride
    total, comps = score_images(multi, video, ["a", "b"])
    assert reductions == [3, 3] and seen == [6, 6]
    torch.testing.assert_close(total, want) and torch.testing.assert_close(comps["m"], want)
    total, _ = score_images(multi, video, ["a", "b"], frame_stride=7)  # the argument wins: frame 0 only
    torch.testing.assert_close(total, video[:, :, 0].mean(dim=(1, 2, 3)))


# ---------------------------------------------------------------- sources a model or reward needs
def test_what_editing_models_and_rewards_need_is_checked_before_loading(capsys):
    """flowrl.conditions.check_sources on the adapters' and rewards' declarations (nothing loads): Qwen-Image-Edit
    cannot generate without a source (refused, per missing row); FLUX.1 Kontext runs text-to-image (a note);
    digits_edit scores nothing without sources (refused, on any model); a text-to-image model on text is fine."""
    from flowrl.conditions import check_sources
    from flowrl.errors import ConfigError

    edits = load_prompts("digits-edit-sample")[:2]
    text = ["a photo of a cat", "a red apple"]
    with pytest.raises(ConfigError, match=r"^data\.prompts: 2 of 2 prompts carry no source image, and qwen-image-edit "
                                          r"is an editing model that cannot generate without one; give an editing "
                                          r"set: a \.jsonl file with a 'prompt' and an 'image' field per row"):
        check_sources("qwen-image-edit", text, "data.prompts")
    with pytest.raises(ConfigError, match=r"1 of 3 prompts carry no source image"):  # every row needs one
        check_sources("qwen-image-edit", [*edits, "a cat"], "data.prompts")
    assert check_sources("qwen-image-edit", edits, "data.prompts", ["digits_edit"]) is None
    note = check_sources("flux-kontext", text, "--prompts", how="give --source PATH")
    assert note == ("--prompts has no source images: flux-kontext is an editing model and generates from the text "
                    "alone (text-to-image); to edit images, give --source PATH")
    for model in ("flux-kontext", "digits"):
        with pytest.raises(ConfigError, match=r"data\.eval_prompts: no prompt carries a source image, and reward "
                                              r"digits_edit scores edits against their sources \(every score would "
                                              r"be NaN\).*, or use another reward"):
            check_sources(model, text, "data.eval_prompts", ["jpeg_compressibility", "digits_edit"])
    assert check_sources("digits", text, "data.prompts", ["digits", "jpeg_compressibility"]) is None
    assert check_sources("flux-kontext", [edits[0], "a cat"], "data.prompts", ["digits_edit"]) is None
    assert capsys.readouterr().err == ""  # the callers print the note


def test_a_training_run_says_once_that_an_editing_model_runs_text_only(capsys):
    from types import SimpleNamespace

    from flowrl.builders import check_run_sources
    from flowrl.errors import ConfigError

    cfg = SimpleNamespace(model=SimpleNamespace(pipeline="flux-kontext"),
                          reward=SimpleNamespace(weights={"jpeg_compressibility": 1.0}))
    check_run_sources(cfg, ["a cat", "a dog"], ["a cat"], acc=SimpleNamespace(is_main_process=True))
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("[flowrl] note: data.prompts has no source images: flux-kontext is an "
                                               "editing model and generates from the text alone")
    check_run_sources(cfg, ["a cat"], ["a cat"], acc=SimpleNamespace(is_main_process=False))
    assert capsys.readouterr().err == ""
    cfg.reward.weights = {"digits_edit": 1.0, "jpeg_compressibility": 0.0}
    with pytest.raises(ConfigError, match=r"data\.prompts: no prompt carries a source image, and reward digits_edit"):
        check_run_sources(cfg, ["a cat"], ["a cat"])
    check_run_sources(cfg, ["a cat"], ["a cat"], reward=object())  # a reward object: its needs are its own
