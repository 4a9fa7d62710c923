"""``hpsv3`` and ``videoalign`` (Qwen2-VL reward models) on tiny weights, built from Qwen2-VL's config shrunk,
saved and loaded offline with ``from_pretrained``, equal to the authors' scoring on the same weights and inputs.

Neither authors' package installs beside flowrl's lock (HPSv3 pins deepspeed / trl, VideoAlign is not a
package), so the reference (``helpers_qwen2vl.reference_logits`` and the preprocessing below) is written from
their code's steps: HPSv3's ``prepare_batch`` (an image file read with PIL, ``fetch_image``'s bicubic resize,
the processor with its defaults) and VideoAlign's ``fetch_video`` (uniform frame indices, torchvision's
bicubic antialiased resize of the 8-bit frames, the processor), on the authors' model with the checkpoint
loaded strictly in their layout (VideoAlign: LoRA unmerged, through peft).
"""
from __future__ import annotations

import math

import pytest
import torch
from PIL import Image

from flowrl import rewards
from flowrl.rewards.hpsv3 import hpsv3_text
from flowrl.rewards.videoalign import NORM_MEAN, NORM_STD
from flowrl.rewards.videoalign_prompt import videoalign_text
from helpers_qwen2vl import reference_logits

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread

PX = 56 * 56  # the tests' pixel budget (HPSv3: 256 * 28 * 28; VideoAlign: 100352 to 200704)
PROMPTS = ["a photo of a dog", "a red flower", "a sign that says hi"]


def rand(*shape, seed=0):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed))


def _hpsv3(t, **kw):
    return rewards.build("hpsv3", base=t["base"], checkpoint=t["checkpoint"], pixels=PX, **kw)


def test_hpsv3_equals_the_authors_scoring(tiny_hpsv3, tmp_path):
    t = tiny_hpsv3
    images = rand(3, 3, 40, 52)  # not square, not a multiple of 28: smart_resize -> 56 x 84
    mu, sigma = _hpsv3(t, batch_size=2).mu_sigma(images, PROMPTS)  # two chunks
    pil = []
    for i, x in enumerate(images):  # HPSv3's inference reads image files: fetch_image(PIL) -> resize (bicubic)
        path = tmp_path / f"{i}.png"
        Image.fromarray((x.permute(1, 2, 0) * 255).round().byte().numpy()).save(path)
        pil.append(Image.open(path).convert("RGB").resize((84, 56)))
    msgs = [[{"role": "user", "content": [{"type": "image", "image": im}, {"type": "text", "text": hpsv3_text(p)}]}]
            for im, p in zip(pil, PROMPTS)]
    proc = t["processor"]
    batch = proc(text=proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), images=pil,
                 padding=True, return_tensors="pt")
    ref = reference_logits(t["model"], batch, t["ids"])  # [3, 2]: (mu, log sigma)
    torch.testing.assert_close(mu, ref[:, 0], atol=2e-5, rtol=0)
    torch.testing.assert_close(sigma, ref[:, 1].exp(), atol=2e-5, rtol=1e-5)
    assert mu.std() > 1e-3  # the rows differ
    torch.testing.assert_close(_hpsv3(t)(images, PROMPTS), mu)  # the reward is mu


def test_hpsv3_loads_the_older_key_layout_and_refuses_other_checkpoints(tiny_hpsv3, tmp_path):
    from safetensors.torch import load_file, save_file

    from helpers_qwen2vl import old_layout

    t = tiny_hpsv3
    sd = load_file(t["checkpoint"])
    save_file(old_layout(sd), tmp_path / "old.safetensors")
    x = rand(2, 3, 32, 32, seed=3)
    torch.testing.assert_close(rewards.build("hpsv3", base=t["base"], checkpoint=str(tmp_path / "old.safetensors"),
                                             pixels=PX)(x, PROMPTS[:2]), _hpsv3(t)(x, PROMPTS[:2]))
    save_file({k: v for k, v in sd.items() if not k.startswith("rm_head.3")}, tmp_path / "nohead.safetensors")
    with pytest.raises(ValueError, match="not HPSv3's ranknet head"):
        rewards.build("hpsv3", base=t["base"], checkpoint=str(tmp_path / "nohead.safetensors"))
    save_file({k: v for k, v in sd.items() if "layers.1." not in k}, tmp_path / "short.safetensors")
    with pytest.raises(ValueError, match="does not fit"):
        rewards.build("hpsv3", base=t["base"], checkpoint=str(tmp_path / "short.safetensors"))
    with pytest.raises(ValueError, match=r"^hpsv3 reward: a prompt contains '<\|Reward\|>'"):
        _hpsv3(t)(x, ["a <|Reward|> sign", "a dog"])
    with pytest.raises(FileNotFoundError, match="HPSv3.safetensors"):
        rewards.build("hpsv3", base=t["base"], checkpoint=str(tmp_path / "missing.safetensors"))


def _videoalign(t, **kw):
    return rewards.build("videoalign", base=t["base"], checkpoint=t["checkpoint"], max_pixels=PX, min_pixels=PX,
                         video_fps=8.0, **kw)


def test_videoalign_equals_the_authors_scoring(tiny_videoalign):
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.functional import resize

    t = tiny_videoalign
    videos = rand(3, 3, 9, 40, 52, seed=1)  # [B, 3, F, H, W]: 9 frames at 8 fps
    raw = _videoalign(t, normalize=False, batch_size=2).scores(videos, PROMPTS)
    # fetch_video: smart_nframes(fps 2) = max(9 / 8 * 2, 4) = 4 frames at linspace(0, 8, 4).round(); 8-bit frames
    # resized (bicubic, antialiased) to smart_resize(40, 52, 28, 3136, 3136) = 56 x 84; the processor
    clips = [resize((v.permute(1, 0, 2, 3) * 255).round().to(torch.uint8)[[0, 3, 5, 8]], [56, 84],
                    interpolation=InterpolationMode.BICUBIC, antialias=True).float() for v in videos]
    msgs = [[{"role": "user", "content": [{"type": "video", "video": "v.mp4"},
                                          {"type": "text", "text": videoalign_text(p)}]}] for p in PROMPTS]
    proc = t["processor"]
    batch = proc(text=proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), videos=clips,
                 padding=True, return_tensors="pt", videos_kwargs={"do_rescale": True})
    assert batch["video_grid_thw"].tolist() == [[2, 4, 6]] * 3
    ref = reference_logits(t["model"], batch, t["ids"])  # [3, 3]: VQ, MQ, TA with the LoRA unmerged
    for i, d in enumerate(("VQ", "MQ", "TA")):
        torch.testing.assert_close(raw[d], ref[:, i], atol=2e-5, rtol=0)
    normed = _videoalign(t).scores(videos, PROMPTS)  # VideoAlign's use_norm=True and its Overall
    overall = sum((ref[:, i] - NORM_MEAN[d]) / NORM_STD[d] for i, d in enumerate(("VQ", "MQ", "TA")))
    torch.testing.assert_close(normed["overall"], overall, atol=5e-5, rtol=0)
    torch.testing.assert_close(_videoalign(t, output="MQ")(videos, PROMPTS), normed["MQ"])


def test_videoalign_lora_is_merged_and_images_are_still_clips(tiny_videoalign):
    t = tiny_videoalign
    videos, images = rand(2, 3, 5, 32, 32, seed=2), rand(2, 3, 32, 32, seed=4)
    half = _videoalign(t, lora_scaling=1.0)(videos, PROMPTS[:2])  # the LoRA counts: another scaling, other scores
    assert not torch.allclose(half, _videoalign(t)(videos, PROMPTS[:2]))
    reward = _videoalign(t)
    torch.testing.assert_close(reward(images, PROMPTS[:2]), reward(images[:, :, None].expand(-1, -1, 2, -1, -1),
                                                                   PROMPTS[:2]))
    torch.testing.assert_close(reward(images[:, :, None], PROMPTS[:2]), reward(images, PROMPTS[:2]))  # one frame
    with pytest.raises(ValueError, match=r"videoalign reward .*values in"):
        reward(videos * 2, PROMPTS[:2])
    late = videos.clone()
    late[1, :, 4] = 1.5  # one frame of one video out of range: every frame is checked
    with pytest.raises(ValueError, match=r"videoalign reward .*values in \[.*, 1\.5\]"):
        reward(late, PROMPTS[:2])
    with pytest.raises(ValueError, match="got 2 images but 1 prompts"):  # counted per video, not per frame
        reward(videos, PROMPTS[:1])


def test_lora_merge_and_peft_key_names():
    from flowrl.rewards._qwen2vl_rm import merge_lora, split_checkpoint

    w, a, b = rand(4, 3, seed=7), rand(2, 3, seed=8), rand(4, 2, seed=9)
    sd = {"base_model.model.model.layers.0.mlp.up_proj.base_layer.weight": w.bfloat16(),
          "base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight": a,
          "base_model.model.model.layers.0.mlp.up_proj.lora_B.default.weight": b,
          "base_model.model.visual.merger.mlp.0.weight": w,
          "base_model.model.rm_head.original_module.weight": torch.zeros(1, 4),
          "base_model.model.rm_head.modules_to_save.default.weight": torch.ones(1, 4),
          "base_model.model.lm_head.weight": w}
    backbone, head = split_checkpoint(merge_lora(sd, 2.0))
    torch.testing.assert_close(backbone["language_model.layers.0.mlp.up_proj.weight"], w.bfloat16().float() + 2 * b @ a)
    assert set(backbone) == {"language_model.layers.0.mlp.up_proj.weight", "visual.merger.mlp.0.weight"}
    torch.testing.assert_close(head["weight"], torch.ones(1, 4))  # the trained copy, not the original
    with pytest.raises(ValueError, match="incomplete"):
        merge_lora({k: v for k, v in sd.items() if "lora_B" not in k}, 2.0)


def test_videoalign_takes_whole_videos_inside_a_multireward(tiny_videoalign):
    from flowrl.media import score_per_frame
    from flowrl.scoring import score_images

    va, jpeg = _videoalign(tiny_videoalign), rewards.build("jpeg_compressibility")
    multi = rewards.MultiReward({"videoalign": va, "jpeg_compressibility": jpeg},
                                {"videoalign": 1.0, "jpeg_compressibility": 0.5})
    videos = rand(2, 3, 6, 32, 32, seed=5)
    total, comps = score_images(multi, videos, PROMPTS[:2], frame_stride=2)
    torch.testing.assert_close(comps["videoalign"], va(videos, PROMPTS[:2]))  # the video whole
    torch.testing.assert_close(comps["jpeg_compressibility"], score_per_frame(jpeg, videos, PROMPTS[:2], 2))
    torch.testing.assert_close(total, comps["videoalign"] + 0.5 * comps["jpeg_compressibility"])
    torch.testing.assert_close(multi(videos, PROMPTS[:2]), va(videos, PROMPTS[:2]) + 0.5 * score_per_frame(
        jpeg, videos, PROMPTS[:2], 1))


def test_declared_defaults_are_the_published_ones_and_plan_sizes():
    from flowrl.options import declared
    from flowrl.rewards.hpsv3 import HPSv3
    from flowrl.rewards.videoalign import VideoAlign

    h, v = declared(HPSv3)[0], declared(VideoAlign)[0]
    assert (h["base"].default, h["checkpoint"].default, h["pixels"].default) == \
        ("Qwen/Qwen2-VL-7B-Instruct", "hf://MizzenAI/HPSv3/HPSv3.safetensors", 200704)
    assert (v["base"].default, v["checkpoint"].default, v["fps"].default, v["max_pixels"].default,
            v["lora_scaling"].default) == ("Qwen/Qwen2-VL-2B-Instruct",
                                           "hf://KlingTeam/VideoReward/checkpoint-11352/model.pth", 2.0, 200704, 2.0)
    size, on_gpu, _ = rewards.resident("hpsv3", {"dtype": "bfloat16", "device": "cuda"})
    assert size == 2 * HPSv3.resident_params and on_gpu
    assert rewards.resident("videoalign", {})[0] == 4 * VideoAlign.resident_params


def test_sizes_and_frame_counts_follow_qwen_vl_utils(tiny_hpsv3):
    """smart_resize and HPSv3's image path against ``qwen_vl_utils`` itself (the authors' vendored copies share its
    smart_resize and fetch_image), when installed (in flowrl's lock and test extra); the frame
    counts against VideoAlign's vendored smart_nframes (it rounds to an even count; qwen-vl-utils >= 0.0.11 floors)."""
    from flowrl.rewards._qwen2vl_rm import smart_nframes
    from flowrl.rewards._qwen_vl import smart_resize

    # VideoAlign's vision_process.smart_nframes: round(clamp(total / video_fps * fps, 4, total), 2)
    assert [smart_nframes(t, 16.0, 2.0) for t in (5, 33, 81, 121)] == [4, 4, 10, 16]
    assert smart_nframes(81, 24.0, 2.0) == 6 and smart_nframes(3, 16.0, 2.0) == 2
    qvu = pytest.importorskip("qwen_vl_utils.vision_process", reason="qwen-vl-utils is not installed (flowrl's test extra: "
                              "pip install qwen-vl-utils); flowrl's smart_resize is checked against it when it is")
    for h, w in [(40, 52), (512, 512), (480, 832), (1024, 576), (720, 1280), (33, 700)]:
        for lo, hi in [(200704, 200704), (100352, 200704), (3136, 3136)]:
            assert smart_resize(h, w, 28, lo, hi) == qvu.smart_resize(h, w, 28, lo, hi), (h, w, lo, hi)
    reward = _hpsv3(tiny_hpsv3)
    x = rand(1, 3, 40, 52, seed=6)
    pil = Image.fromarray((x[0].permute(1, 2, 0) * 255).round().byte().numpy())
    ref = qvu.fetch_image({"image": pil, "min_pixels": PX, "max_pixels": PX})
    ours = reward.batch(x, PROMPTS[:1])
    proc = tiny_hpsv3["processor"]
    theirs = proc(text=["<|vision_start|><|image_pad|><|vision_end|>"], images=[ref], return_tensors="pt")
    torch.testing.assert_close(ours["pixel_values"], theirs["pixel_values"])


def test_videoalign_trains_a_video_model_beside_a_per_frame_reward(tiny_model, tiny_videoalign, tmp_path):
    """End to end: recipes/wan_group_ocr.yaml on the tiny Wan with ``reward.weights`` = videoalign (whole videos
    ``[B, 3, 5, H, W]``) + jpeg_compressibility (per frame), one GRPO iteration, both components logged."""
    from flowrl.trainers.config import load_config
    from flowrl.trainers.online import train
    from helpers import ROOT, tiny_overrides, train_records

    t = tiny_videoalign
    opts = f"{{videoalign: {{base: {t['base']}, checkpoint: {t['checkpoint']}, max_pixels: {PX}, min_pixels: {PX}}}}}"
    cfg = load_config(ROOT / "recipes" / "wan_group_ocr.yaml", tiny_overrides(tiny_model("wan"), "group", **{
        "model.options.num_frames": 5, "train.iterations": 1, "reward.weights": "{videoalign: 1.0, "
        "jpeg_compressibility: 0.5}", "reward.options": opts, "reward.heldout": "{}"}))
    summary = train(cfg, tmp_path / "run")
    assert summary["iterations_done"] == 1
    rec = train_records(tmp_path / "run")[0]
    keys = [k for k in rec if "videoalign" in k]
    assert keys and all(math.isfinite(rec[k]) for k in keys), rec
