"""CLIP-family rewards (pickscore, clipscore, aesthetic, hps, imagereward) on tiny random models.

Each model is built from a config at toy size, saved, and loaded back through the reward's real
loading path (``from_pretrained(dir)`` or the checkpoint file). Scores are compared against an
independent reference computed the peers' way (PIL image + the library's own processor/transform).
"""
import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from flowrl import rewards
from helpers import TINY_BLIP_VISION, TINY_MED

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


# ---------------------------------------------------------------- real images (tiny models: conftest.py)
def photos(size):
    """Four real photographs (scikit-learn's bundled samples and their mirror images) as PIL."""
    from sklearn.datasets import load_sample_images

    pil = [Image.fromarray(a).resize(size, Image.BICUBIC) for a in load_sample_images().images]
    return pil + [p.transpose(Image.FLIP_LEFT_RIGHT) for p in pil]


def to_tensor(pil):
    return torch.stack([torch.from_numpy(np.array(p)).permute(2, 0, 1).float() / 255 for p in pil])  # [B, 3, H, W]


PROMPTS = ["a chinese temple in the hills", "a red flower", "a photo of a dog", "the word HELLO on a sign"]


@functools.lru_cache(maxsize=None)
def _clip_reference(d):
    from transformers import CLIPModel, CLIPProcessor

    return CLIPModel.from_pretrained(d).eval(), CLIPProcessor.from_pretrained(d)


def check_common(reward, images, prompts):
    """Shape, dtype, CPU output, batch invariance; returns the batch scores."""
    s = reward(images, prompts)
    assert s.shape == (images.shape[0],) and s.dtype == torch.float32 and s.device.type == "cpu"
    assert torch.isfinite(s).all()
    one = torch.cat([reward(images[i:i + 1], prompts[i:i + 1]) for i in range(images.shape[0])])
    torch.testing.assert_close(s, one, atol=1e-5, rtol=1e-5)
    return s


def check_pairing(reward, images, prompts):
    """Scores depend on which prompt goes with which image, and on the image for a fixed prompt."""
    s = reward(images, prompts)
    rolled = reward(images, prompts[1:] + prompts[:1])
    assert (s - rolled).abs().max() > 1e-3
    same_prompt = reward(images, [prompts[0]] * len(prompts))
    assert same_prompt.max() - same_prompt.min() > 1e-3


# ---------------------------------------------------------------- PickScore / CLIPScore
@pytest.mark.parametrize("name,divisor", [("pickscore", 26.0), ("clipscore", 30.0)])
def test_clip_similarity_rewards_match_reference(tiny_clip_dir, name, divisor):
    import torchvision.transforms as T

    pil = photos((96, 64))  # not square: exercises shortest-edge resize + centre crop
    images = to_tensor(pil)
    reward = rewards.build(name, model=tiny_clip_dir, processor=tiny_clip_dir, batch_size=3)
    assert reward.name == name
    s = check_common(reward, images, PROMPTS)
    check_pairing(reward, images, PROMPTS)

    model, proc = _clip_reference(tiny_clip_dir)
    inp = proc(text=PROMPTS, images=pil, return_tensors="pt", padding=True)
    if name == "clipscore":  # Flow-GRPO's clip_scorer: torchvision Resize + CenterCrop from the processor's config
        ip = proc.image_processor
        tf = T.Compose([T.Resize(ip.size["shortest_edge"]), T.CenterCrop((ip.crop_size["height"], ip.crop_size["width"])),
                        T.Normalize(ip.image_mean, ip.image_std)])
        inp["pixel_values"] = tf(images)
        torch.testing.assert_close(reward.clip.transform(images), inp["pixel_values"], atol=1e-5, rtol=0)
    else:  # PickScore's own path: PIL -> CLIPProcessor
        assert (reward.clip.transform(images) - inp["pixel_values"]).abs().max() < 0.1  # 8-bit rounding only
    with torch.no_grad():
        ref = model(**inp).logits_per_image.diag() / divisor
    torch.testing.assert_close(s, ref, atol=5e-3 if name == "pickscore" else 1e-4, rtol=0)


def test_each_reward_uses_its_references_geometry(tiny_clip_dir, tiny_aesthetic_head):
    """transformers' processor floors the crop offset (PickScore, aesthetic, clipscore's
    preprocess="transformers"); Flow-GRPO's CLIPScore is torchvision's bilinear Resize + rounded crop."""
    geometry = lambda r: (r.clip.transform.mode, r.clip.transform.crop_offset, r.clip.transform.clamp)  # noqa: E731
    assert geometry(rewards.build("pickscore", model=tiny_clip_dir, processor=tiny_clip_dir)) == ("bicubic", "floor", True)
    assert geometry(rewards.build("aesthetic", head=tiny_aesthetic_head[0], clip=tiny_clip_dir)) == ("bicubic", "floor", True)
    assert geometry(rewards.build("clipscore", model=tiny_clip_dir)) == ("bilinear", "round", False)
    assert geometry(rewards.build("clipscore", model=tiny_clip_dir, preprocess="transformers")) == ("bicubic", "floor", True)
    with pytest.raises(ValueError, match="preprocess must be one of"):
        rewards.build("clipscore", model=tiny_clip_dir, preprocess="pil")


def test_pickscore_defaults_are_the_published_ones():
    import inspect

    from flowrl.rewards.pickscore import PickScore

    sig = inspect.signature(PickScore.__init__).parameters
    assert sig["model"].default == "yuvalkirstain/PickScore_v1"
    assert sig["processor"].default == "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
    assert sig["divisor"].default == 26.0


def test_missing_model_dir_says_what_to_pass(tmp_path):
    with pytest.raises(OSError, match="save_pretrained"):
        rewards.build("clipscore", model=str(tmp_path / "nope"))


def test_wrong_inputs_are_rejected(tiny_clip_dir):
    reward = rewards.build("clipscore", model=tiny_clip_dir)
    with pytest.raises(ValueError, match="2 images but 1 prompts"):
        reward(torch.rand(2, 3, 32, 32), ["a"])
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        reward(torch.rand(2, 32, 32), ["a", "b"])


# ---------------------------------------------------------------- LAION aesthetic
def test_aesthetic_matches_reference(tiny_clip_dir, tiny_aesthetic_head):
    path, head = tiny_aesthetic_head
    pil = photos((96, 64))
    images = to_tensor(pil)
    reward = rewards.build("aesthetic", head=path, clip=tiny_clip_dir, batch_size=3)
    s = check_common(reward, images, PROMPTS)
    # image-only reward: the prompt does not matter, the image does
    torch.testing.assert_close(reward(images, ["x"] * 4), s)
    assert s.max() - s.min() > 1e-3
    # peers' path (improved-aesthetic-predictor): processor -> image features -> unit norm -> MLP
    model, proc = _clip_reference(tiny_clip_dir)
    with torch.no_grad():
        pix = proc(images=pil, return_tensors="pt")["pixel_values"]
        emb = model.visual_projection(model.vision_model(pixel_values=pix).pooler_output)
        ref = head(F.normalize(emb, dim=-1))
    # the head's gain magnifies preprocessing differences: compare relative to the spread of scores
    assert (s - ref).abs().max() < 0.02 * (ref.max() - ref.min())


def test_aesthetic_head_errors(tiny_clip_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="sac\\+logos\\+ava1-l14-linearMSE.pth"):
        rewards.build("aesthetic", head=str(tmp_path / "missing.pth"), clip=tiny_clip_dir)
    from flowrl.rewards._clip_common import LinearMLPHead

    torch.save(LinearMLPHead(768).state_dict(), tmp_path / "l14.pth")  # ViT-L/14 head on a 16-d CLIP
    with pytest.raises(ValueError, match="768-d"):
        rewards.build("aesthetic", head=str(tmp_path / "l14.pth"), clip=tiny_clip_dir)


def test_aesthetic_head_from_a_hub_file(tiny_clip_dir, tiny_aesthetic_head, tmp_path, monkeypatch):
    """The recipes name the head as a hub file (hf://...): read from the local Hugging Face cache offline,
    the same scores as the local path; not cached and offline, one line naming the option and the download."""
    from huggingface_hub import constants

    from flowrl.rewards.aesthetic import HUB_HEAD
    from helpers import fake_hub_cache

    path, _ = tiny_aesthetic_head
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(FileNotFoundError, match=r"^reward\.options\.aesthetic\.head=hf://trl-lib/ddpo-aesthetic-"
                                                r"predictor/aesthetic-model\.pth .*`hf download trl-lib/ddpo-aesthetic-"
                                                r"predictor aesthetic-model\.pth`"):
        rewards.build("aesthetic", head=HUB_HEAD, clip=tiny_clip_dir)
    fake_hub_cache(tmp_path / "hub", "trl-lib/ddpo-aesthetic-predictor", {"aesthetic-model.pth": path})
    images = to_tensor(photos((64, 64)))
    torch.testing.assert_close(rewards.build("aesthetic", head=HUB_HEAD, clip=tiny_clip_dir)(images, PROMPTS),
                               rewards.build("aesthetic", head=path, clip=tiny_clip_dir)(images, PROMPTS))


# ---------------------------------------------------------------- HPS-v2.1 (open_clip)
def test_hps_matches_open_clip_reference(tiny_hps):
    import open_clip

    ckpt, name = tiny_hps
    pil = photos((64, 64))  # square: HPS's longest-side pad and open_clip's crop agree
    images = to_tensor(pil)
    reward = rewards.build("hps", checkpoint=ckpt, model=name, batch_size=3)
    s = check_common(reward, images, PROMPTS)
    check_pairing(reward, images, PROMPTS)
    # HPSv2 img_score.py: open_clip preprocess_val on PIL, output_dict features, diag(img @ txt.T)
    model, _, preprocess = open_clip.create_model_and_transforms(name, pretrained=None, output_dict=True)
    model.load_state_dict(torch.load(ckpt, weights_only=True)["state_dict"])
    with torch.no_grad():
        out = model(torch.stack([preprocess(p) for p in pil]), open_clip.get_tokenizer(name)(PROMPTS))
        ref = (out["image_features"] @ out["text_features"].T).diag()
    torch.testing.assert_close(s, ref, atol=5e-3, rtol=0)


def test_hps_pads_non_square_images_like_hpsv2():
    from flowrl.rewards._clip_common import resize_longest_pad

    x = torch.rand(2, 3, 40, 80)
    y = resize_longest_pad(x, 32)  # longer side 80 -> 32, shorter 40 -> 16, padded by 8 top and bottom
    assert y.shape == (2, 3, 32, 32)
    assert (y[:, :, :8] == 0).all() and (y[:, :, -8:] == 0).all() and y[:, :, 8:24].abs().sum() > 0


def test_hps_checkpoint_errors(tiny_hps, tmp_path):
    _, name = tiny_hps
    with pytest.raises(FileNotFoundError, match="HPS_v2.1_compressed.pt"):
        rewards.build("hps", checkpoint=str(tmp_path / "missing.pt"), model=name)
    torch.save({"state_dict": {"foo": torch.zeros(1)}}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="does not match open_clip"):
        rewards.build("hps", checkpoint=str(tmp_path / "bad.pt"), model=name)
    with pytest.raises(ValueError, match="add_model_config"):
        rewards.build("hps", checkpoint=str(tmp_path / "bad.pt"), model="no-such-model")


def test_missing_optional_dependency_says_what_to_install(monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "open_clip", None)  # makes `import open_clip` fail
    with pytest.raises(ImportError, match="pip install open-clip-torch"):
        rewards.build("hps", checkpoint=str(tmp_path / "x.pt"))


# ---------------------------------------------------------------- ImageReward (BLIP)
def med_text_encoder(sd, ids, mask, image_tokens, heads, eps=1e-12):
    """BLIP ``med.BertModel`` (mode='multimodal') written out from its source: embeddings, then per
    layer self-attention, cross-attention to the image tokens, feed-forward; post-LN residuals."""
    lin = lambda x, p: F.linear(x, sd[p + ".weight"], sd[p + ".bias"])  # noqa: E731
    ln = lambda x, p: F.layer_norm(x, x.shape[-1:], sd[p + ".weight"], sd[p + ".bias"], eps)  # noqa: E731

    def attention(x, kv, p, add_mask):
        b, t, h = x.shape
        split = lambda y: y.view(b, -1, heads, h // heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(lin(x, p + ".self.query")), split(lin(kv, p + ".self.key")), split(lin(kv, p + ".self.value"))
        scores = q @ k.transpose(-1, -2) / (h // heads) ** 0.5 + add_mask
        ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, h)
        return ln(lin(ctx, p + ".output.dense") + x, p + ".output.LayerNorm")

    x = sd["embeddings.word_embeddings.weight"][ids] + sd["embeddings.position_embeddings.weight"][: ids.shape[1]]
    x = ln(x, "embeddings.LayerNorm")
    self_mask = (1.0 - mask[:, None, None, :].float()) * -10000.0
    n_layers = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("encoder.layer."))
    for i in range(n_layers):
        p = f"encoder.layer.{i}"
        x = attention(x, x, p + ".attention", self_mask)
        x = attention(x, image_tokens, p + ".crossattention", 0.0)
        x = ln(lin(F.gelu(lin(x, p + ".intermediate.dense")), p + ".output.dense") + x, p + ".output.LayerNorm")
    return x[:, 0]  # [B, H]


def test_imagereward_matches_original_architecture(tiny_imagereward):
    from torchvision import transforms as T
    from transformers import AutoTokenizer

    from flowrl.rewards.imagereward import IMAGEREWARD_MEAN, IMAGEREWARD_STD

    t = tiny_imagereward
    pil = photos((48, 64))
    images = to_tensor(pil)
    reward = rewards.build("imagereward", checkpoint=t["ckpt"], tokenizer=t["tokenizer"], med_config=TINY_MED,
                           vision_config=TINY_BLIP_VISION, batch_size=3)
    s = check_common(reward, images, PROMPTS)
    check_pairing(reward, images, PROMPTS)
    assert reward.transform.crop_offset == "round"  # torchvision's CenterCrop, as BLIP's transform

    # ImageReward.score(): torchvision PIL transform -> BLIP ViT (timm) -> med BERT [CLS] -> MLP -> normalise
    tf = T.Compose([T.Resize(32, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(32), T.ToTensor(),
                    T.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))])
    tok = AutoTokenizer.from_pretrained(t["tokenizer"])(PROMPTS, padding="max_length", truncation=True,
                                                        max_length=35, return_tensors="pt")
    with torch.no_grad():
        image_tokens = t["vit"].forward_features(torch.stack([tf(p) for p in pil]))  # [B, 17, 24]
        cls = med_text_encoder(t["text_sd"], tok["input_ids"], tok["attention_mask"], image_tokens, heads=2)
        ref = (t["head"](cls) - IMAGEREWARD_MEAN) / IMAGEREWARD_STD
    assert (s - ref).abs().max() < 0.02 * (ref.max() - ref.min())  # preprocessing differences only

    # exact: the same image tokens through our text tower and the written-out med BERT
    with torch.no_grad():
        ours = reward.model.text(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"],
                                 encoder_hidden_states=image_tokens).last_hidden_state[:, 0]
    torch.testing.assert_close(ours, cls, atol=1e-5, rtol=1e-5)


def test_imagereward_vit_key_mapping_is_exact(tiny_imagereward):
    """Same pixels in, same image tokens out: BLIP/timm ViT vs BlipVisionModel after renaming."""
    t = tiny_imagereward
    reward = rewards.build("imagereward", checkpoint=t["ckpt"], tokenizer=t["tokenizer"], med_config=TINY_MED,
                           vision_config=TINY_BLIP_VISION)
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ours = reward.model.vision(pixel_values=pixels).last_hidden_state
        torch.testing.assert_close(ours, t["vit"].forward_features(pixels), atol=1e-5, rtol=1e-5)


def test_imagereward_checkpoint_errors(tiny_imagereward, tmp_path):
    t = tiny_imagereward
    with pytest.raises(FileNotFoundError, match="ImageReward.pt"):
        rewards.build("imagereward", checkpoint=str(tmp_path / "missing.pt"), tokenizer=t["tokenizer"])
    # an architecture that does not fit the file: a clear error, not silently random weights
    with pytest.raises(ValueError, match="does not fit the vision tower"):
        rewards.build("imagereward", checkpoint=t["ckpt"], tokenizer=t["tokenizer"], med_config=TINY_MED,
                      vision_config={**TINY_BLIP_VISION, "num_hidden_layers": 3})
    with pytest.raises(ValueError, match="does not fit the text tower"):
        rewards.build("imagereward", checkpoint=t["ckpt"], tokenizer=t["tokenizer"],
                      med_config={**TINY_MED, "intermediate_size": 48}, vision_config=TINY_BLIP_VISION)


def test_registry_lists_the_zoo():
    names = set(rewards.available())
    assert {"pickscore", "hps", "imagereward", "clipscore", "aesthetic", "ocr", "vlm_judge"} <= names

