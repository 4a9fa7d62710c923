"""Image preprocessing of the CLIP-family rewards against the real reference processors, at sizes
where the references' geometry differs (832 x 1216 and 512 x 684 resize to a long side of 327 / 299:
``long - 224`` is 3 mod 4, where a floored and a rounded centre-crop offset are one pixel apart).

References, each built offline from its config values: transformers' ``CLIPImageProcessor`` (both
backends; PickScore, the aesthetic predictor, CLIPScore's ``preprocess="transformers"``),
torchvision ``Resize`` + ``CenterCrop`` on float tensors (Flow-GRPO's CLIPScore, the default),
open_clip's val transform (= ImageReward's BLIP transform: torchvision on PIL) and HPS-v2's
``ResizeMaxSize`` val transform written out with torchvision's functional ops.
"""
import numpy as np
import pytest
import torch

from flowrl.rewards._clip_common import CLIP_MEAN, CLIP_STD, ImageTransform, center_crop

pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = [(832, 1216), (1216, 832), (512, 684), (684, 512)]  # (H, W)
PROCESSOR_CONFIG = dict(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}, resample=3,
                        image_mean=list(CLIP_MEAN), image_std=list(CLIP_STD))


def photos(h, w):
    """scikit-learn's two bundled photographs at ``h x w`` (PIL) and as float tensors [2, 3, h, w]."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    pil = [Image.fromarray(a).resize((w, h), Image.BICUBIC) for a in load_sample_images().images]
    return pil, torch.stack([torch.from_numpy(np.array(p)).permute(2, 0, 1).float() / 255 for p in pil])


def shifted(t: ImageTransform, offset: str) -> ImageTransform:
    return ImageTransform(**{**t.__dict__, "crop_offset": offset})


def test_the_sizes_are_ones_where_floor_and_round_differ():
    x = torch.arange(327.0).view(1, 1, 327).expand(1, 224, 327)  # a 832 x 1216 image's 224 x 327 resize
    assert center_crop(x, 224, 224, "floor")[0, 0, 0] == 51 and center_crop(x, 224, 224, "round")[0, 0, 0] == 52
    with pytest.raises(ValueError, match="crop offset"):
        center_crop(x, 224, 224, "ceil")


@pytest.mark.parametrize("h,w", SIZES)
@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_transformers_clip_processor(h, w, backend):
    """PickScore / aesthetic / clipscore(preprocess="transformers"): transformers' processor on the
    uint8 image, as the peers call it. Left: its 8-bit rounding (mean 0.004 after normalising); a
    one-pixel crop shift would cost 25x that on average and 2.5 at edges."""
    from transformers import CLIPImageProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    proc = (CLIPImageProcessor if backend == "torchvision" else CLIPImageProcessorPil)(**PROCESSOR_CONFIG)
    pil, x = photos(h, w)
    ref = proc(images=pil, return_tensors="pt")["pixel_values"]  # [2, 3, 224, 224]
    ours = ImageTransform.from_hf(proc)
    assert (ours.mode, ours.crop_offset, ours.clamp) == ("bicubic", "floor", True)
    d = (ours(x) - ref).abs()
    assert d.mean() < 0.006 and d.max() < 0.08
    assert (shifted(ours, "round")(x) - ref).abs().mean() > 0.05


@pytest.mark.parametrize("h,w", SIZES)
def test_flow_grpo_clipscore_torchvision(h, w):
    """clipscore's default: Flow-GRPO's clip_scorer builds torchvision Resize(224) (bilinear) +
    CenterCrop(224) + Normalize from the processor's config and runs it on float tensors: equal."""
    import torchvision.transforms as T
    from transformers import CLIPImageProcessor

    _, x = photos(h, w)
    ref = T.Compose([T.Resize(224), T.CenterCrop((224, 224)), T.Normalize(CLIP_MEAN, CLIP_STD)])(x)
    ours = ImageTransform.from_hf(CLIPImageProcessor(**PROCESSOR_CONFIG), "torchvision")
    assert (ours.mode, ours.crop_offset, ours.clamp) == ("bilinear", "round", False)
    torch.testing.assert_close(ours(x), ref, atol=1e-5, rtol=0)
    bicubic_floor = ImageTransform.from_hf(CLIPImageProcessor(**PROCESSOR_CONFIG), "transformers")(x)
    assert (bicubic_floor - ref).abs().max() > 0.5  # what the reward computed before


@pytest.mark.parametrize("h,w", SIZES)
def test_open_clip_val_transform_and_imagereward(h, w):
    """open_clip's val transform (torchvision Resize bicubic + CenterCrop on PIL), which is also
    ImageReward's BLIP transform: the rounded offset; left is PIL's 8-bit resize."""
    import open_clip

    pil, x = photos(h, w)
    ref = torch.stack([open_clip.image_transform(224, is_train=False)(p) for p in pil])  # [2, 3, 224, 224]
    ours = ImageTransform(size=224, crop=(224, 224), crop_offset="round")
    d = (ours(x) - ref).abs()
    assert d.mean() < 0.006 and d.max() < 0.08
    assert (shifted(ours, "floor")(x) - ref).abs().mean() > 0.05


@pytest.mark.parametrize("h,w", SIZES)
def test_hpsv2_resize_max_size(h, w):
    """HPS-v2's val transform: ToTensor, ResizeMaxSize (a float resize, not clamped: the cubic
    kernel overshoots [0, 1] at edges) and the centred zero pad, then Normalize: equal."""
    import torchvision.transforms as T
    import torchvision.transforms.functional as TF

    pil, x = photos(h, w)

    def hpsv2(img):  # [3, H, W] float, HPSv2 hpsv2/src/open_clip/transform.py ResizeMaxSize(224, fill=0)
        scale = 224 / float(max(img.shape[1:]))
        size = tuple(round(d * scale) for d in img.shape[1:])
        img = TF.resize(img, list(size), T.InterpolationMode.BICUBIC)
        ph, pw = 224 - size[0], 224 - size[1]
        return TF.pad(img, padding=[pw // 2, ph // 2, pw - pw // 2, ph - ph // 2], fill=0)

    resized = torch.stack([hpsv2(T.ToTensor()(p)) for p in pil])  # [2, 3, 224, 224]
    assert resized.min() < 0 or resized.max() > 1  # the overshoot a clamp would remove
    ref = TF.normalize(resized, CLIP_MEAN, CLIP_STD)
    torch.testing.assert_close(ImageTransform(size=224, resize="longest_pad")(x), ref, atol=1e-5, rtol=0)
