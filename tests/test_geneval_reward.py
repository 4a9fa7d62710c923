"""The ``geneval`` reward: clauses from metadata or the shipped table, detectors by ``module:callable``
and their contract, the transformers Mask2Former detector on a tiny random config (nothing
downloaded), and the CLIP colour classifier's crops and transform against open_clip's."""
import numpy as np
import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.rewards import build


def top_left_detector(images):
    """A stub detector: one dog whose score is the top-left pixel's red value, a box of the whole image."""
    h, w = images.shape[-2:]
    return [{"dog": [(0.0, 0.0, float(w), float(h), float(im[0, 0, 0]))]} for im in images]


def wrong_count_detector(images):
    return [{}]  # one dict whatever the batch


def bad_box_detector(images):
    return [{"dog": [(0.0, 0.0, 1.0)]} for _ in images]


def bad_mask_detector(images):
    return [{"dog": [(0, 0, 4, 4, 0.9, np.zeros((3, 3), bool))]} for _ in images]


class Factory:
    """A detector class: built with the options (and the device)."""

    def __init__(self, score: float, device: str = "cpu"):
        self.score, self.device = score, device

    def __call__(self, images):
        return [{"dog": [(0, 0, 4, 4, self.score)]} for _ in images]


def images_with_red(*reds):
    x = torch.zeros(len(reds), 3, 8, 8)
    for i, r in enumerate(reds):
        x[i, 0, 0, 0] = r
    return x


def test_clauses_from_the_shipped_table_and_from_metadata():
    r = build("geneval", detector="test_geneval_reward:top_left_detector")
    prompts = ["a photo of a dog", "a photo of a dog", "a photo of a bench", "a dog (no clauses for this text)"]
    out = r(images_with_red(0.95, 0.2, 0.95, 0.95), prompts)
    assert out[:3].tolist() == [1.0, 0.0, 0.0] and torch.isnan(out[3])
    rows = [None, None, None, {"tag": "single_object", "include": [{"class": "dog", "count": 1}]}]
    assert r(images_with_red(0.95, 0.2, 0.95, 0.95), prompts, metadata=rows)[3] == 1.0  # a suite row's clauses
    assert r.takes_metadata


def test_partial_and_strict_scores_and_the_counting_threshold():
    counting = [{"tag": "counting", "include": [{"class": "dog", "count": 2}], "exclude": [{"class": "dog", "count": 3}]}]
    partial = build("geneval", detector="test_geneval_reward:top_left_detector", score="partial")
    assert partial(images_with_red(0.95), ["two dogs"], metadata=counting).item() == pytest.approx(0.5)
    assert partial(images_with_red(0.85), ["two dogs"], metadata=counting).item() == pytest.approx(0.0)  # < 0.9
    strict = build("geneval", detector="test_geneval_reward:top_left_detector", score="strict")
    assert strict(images_with_red(0.95), ["two dogs"], metadata=counting).item() == 0.0


def test_a_detector_class_gets_its_options_and_the_device():
    r = build("geneval", detector="test_geneval_reward:Factory", detector_options={"score": 0.31})
    assert r.detector.device == "cpu" and r(images_with_red(0.0), ["a photo of a dog"]).item() == 1.0


@pytest.mark.parametrize("detector, match", [
    ("wrong_count_detector", r"returned list of length 1 for 2 images; it must return one dict per image"),
    ("bad_box_detector", r"image 0, class 'dog': a detection must be \(x0, y0, x1, y1, score\[, mask\]\)"),
    ("bad_mask_detector", r"mask must be a boolean \[H, W\] = \[8, 8\] array, got bool \[3, 3\]"),
])
def test_a_detector_of_the_wrong_shape_is_a_one_line_error(detector, match):
    r = build("geneval", detector=f"test_geneval_reward:{detector}")
    with pytest.raises(ConfigError, match=match) as e:
        r(images_with_red(0.9, 0.9), ["a photo of a dog"] * 2)
    assert "\n" not in str(e.value)


def test_bad_settings():
    with pytest.raises(ConfigError, match=r"must be 'module:callable'"):
        build("geneval", detector="nodetector")
    with pytest.raises(ConfigError, match=r"cannot be loaded"):
        build("geneval", detector="no_such_module_xyz:f")
    with pytest.raises(ConfigError, match=r"score must be one of 'official', 'partial', 'strict'"):
        build("geneval", detector="test_geneval_reward:top_left_detector", score="soft")


# ---------------------------------------------------------------- the transformers Mask2Former
@pytest.fixture(scope="module")
def tiny_mask2former(tmp_path_factory):
    """A random Mask2Former (tiny Swin backbone, 80 COCO classes, 12 queries) saved with save_pretrained."""
    from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation, SwinConfig

    torch.manual_seed(0)
    backbone = SwinConfig(embed_dim=8, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1], window_size=4,
                          out_features=["stage1", "stage2", "stage3", "stage4"])
    cfg = Mask2FormerConfig(backbone_config=backbone, feature_size=32, mask_feature_size=32, hidden_dim=32,
                            encoder_feedforward_dim=32, dim_feedforward=32, encoder_layers=1, decoder_layers=2,
                            num_attention_heads=2, num_queries=12, num_labels=80)
    d = tmp_path_factory.mktemp("tiny-mask2former")
    Mask2FormerForUniversalSegmentation(cfg).eval().save_pretrained(d)
    return str(d)


def test_mmdet_resize_rule():
    from flowrl.rewards.geneval_detectors import resized_size

    assert resized_size(512, 512) == (800, 800)
    assert resized_size(512, 768) == (800, 1200)
    assert resized_size(1000, 3000) == (444, 1333)  # the long side binds


def test_instance_postprocess_by_hand():
    from flowrl.rewards.geneval_detectors import instance_postprocess, mask_boxes

    cls = torch.tensor([[2.0, 0.0, 0.0, 1.0], [0.0, 3.0, 0.0, 0.0]])  # [Q=2, C=3 + no-object]
    masks = torch.full((2, 6, 8), -5.0)
    masks[0, 1:3, 2:5] = 4.0  # rows 1-2, columns 2-4
    masks[1, 4:6, 0:2] = 2.0
    labels, boxes, binary = instance_postprocess(cls, masks, max_per_image=2)
    order = boxes[:, 4].argsort(descending=True)
    labels, boxes, binary = labels[order], boxes[order], binary[order]
    p = torch.softmax(cls, -1)
    assert labels.tolist() == [1, 0]
    assert boxes[0, :4].tolist() == [0, 4, 2, 6] and boxes[1, :4].tolist() == [2, 1, 5, 3]  # x_last + 1
    assert boxes[0, 4].item() == pytest.approx(p[1, 1].item() * torch.sigmoid(torch.tensor(2.0)).item(), rel=1e-5)
    assert binary.shape == (2, 6, 8) and binary[1].sum() == 6
    assert mask_boxes(torch.zeros(1, 3, 3, dtype=torch.bool)).tolist() == [[0, 0, 0, 0]]


def test_mask2former_detector_meets_the_contract(tiny_mask2former):
    from flowrl.rewards.geneval_detectors import Mask2FormerDetector, check_detections
    from flowrl.rewards.geneval_rules import COCO_CLASSES

    det = Mask2FormerDetector(tiny_mask2former, batch_size=2, max_per_image=20, short_side=64, long_side=96)
    out = check_detections(det(torch.rand(3, 3, 40, 56)), 3, 40, 56, "tiny")
    for per in out:
        assert set(per) <= set(COCO_CLASSES) and sum(len(v) for v in per.values()) == 20
        for box, mask in (d for v in per.values() for d in v):
            assert mask.shape == (40, 56) and 0 <= box[4] <= 1 and 0 <= box[0] <= box[2] <= 56


def test_default_detector_and_colours_end_to_end(tiny_mask2former, tiny_clip_dir):
    # a random detector's scores are tiny: threshold 0 keeps everything, so colours are asked
    r = build("geneval", detector_options={"model": tiny_mask2former, "batch_size": 2, "short_side": 64},
              clip_model=tiny_clip_dir, threshold=0.0)
    prompts = ["a photo of a blue fire hydrant", "a photo of a cow", "a photo of a pink car", "not a GenEval prompt"]
    out = r(torch.rand(4, 3, 32, 32), prompts)
    assert set(out[:3].tolist()) <= {0.0, 1.0} and torch.isnan(out[3])


# ---------------------------------------------------------------- the colour classifier
def test_openai_transform_equals_open_clip_s():
    open_clip = pytest.importorskip("open_clip", reason="open_clip (flowrl[vision]) compares the transform")
    from PIL import Image

    from flowrl.rewards.geneval_colors import openai_transform

    ref = open_clip.image_transform(224, is_train=False)
    rng = np.random.default_rng(0)
    for w, h in ((97, 61), (40, 300), (224, 224)):
        im = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        mean, std = open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD
        assert torch.equal(openai_transform(im, 224, mean, std), ref(im))


def test_masked_crop_greys_out_the_background():
    from PIL import Image

    from flowrl.rewards.geneval_colors import masked_crop

    im = Image.new("RGB", (10, 8), (255, 0, 0))
    mask = np.zeros((8, 10), bool)
    mask[2:4, 3:5] = True
    crop = np.asarray(masked_crop(im, (2, 1, 6.4, 5.6), mask))  # PIL rounds: columns 2-5, rows 1-5
    assert crop.shape == (5, 4, 3)
    assert (crop[1:3, 1:3] == [255, 0, 0]).all() and (crop[0, 0] == [153, 153, 153]).all()


def test_colour_classifier_is_clip_zero_shot(tiny_clip_dir):
    from flowrl.rewards.geneval_colors import ClipColors
    from flowrl.rewards.geneval_rules import COLORS

    c = ClipColors(tiny_clip_dir)
    w = c.classifier("car")
    assert w.shape[1] == 10 and torch.allclose(w.norm(dim=0), torch.ones(10), atol=1e-5)
    emb = c.clip.embed_texts(["a photo of a red car", "a photo of a red-colored car", "a photo of a red object"])
    ref = emb.mean(0) / emb.mean(0).norm()
    assert torch.allclose(w[:, 0], ref, atol=1e-6)
    image = (np.random.default_rng(1).random((32, 32, 3)) * 255).astype(np.uint8)
    dets = [(np.array([0, 0, 16, 16, 0.9]), None), (np.array([8, 8, 32, 30, 0.8]), np.ones((32, 32), bool))]
    picks = c(image, "car", dets)
    assert len(picks) == 2 and set(picks) <= set(COLORS)


def test_mmdet_results_become_detections():
    """GenEval's own detector (mmdet 2.x, not installed here): its per-class output format maps onto the
    contract, masks kept, classes by COCO index."""
    from flowrl.rewards.geneval_detectors import check_detections
    from flowrl.rewards.geneval_mmdet import mmdet_to_detections
    from flowrl.rewards.geneval_rules import COCO_CLASSES

    bbox = [np.zeros((0, 5), np.float32) for _ in COCO_CLASSES]
    segm = [[] for _ in COCO_CLASSES]
    bbox[16] = np.array([[1, 2, 5, 6, 0.9], [0, 0, 3, 3, 0.2]], np.float32)  # dogs
    segm[16] = [np.ones((8, 8), bool), np.zeros((8, 8), bool)]
    out = mmdet_to_detections((bbox, segm))
    assert list(out) == ["dog"] and out["dog"][0][:5] == (1.0, 2.0, 5.0, 6.0, pytest.approx(0.9))
    checked = check_detections([out], 1, 8, 8, "mmdet")
    assert checked[0]["dog"][0][1].all() and len(mmdet_to_detections(bbox)["dog"][1]) == 5  # boxes only: no mask


def test_served_geneval_gets_each_row_s_metadata():
    """GenEval served by `flowrl serve-reward` (its own environment): the remote reward with
    takes_metadata sends each image's clauses, split with the images into requests."""
    pytest.importorskip("uvicorn", reason="flowrl[serve] (in requirements.lock) serves rewards")
    from flowrl.rewards.server import serve_in_thread

    served = build("geneval", detector="test_geneval_reward:top_left_detector")
    rows = [{"tag": "single_object", "include": [{"class": "dog", "count": 1}]}, None,
            {"tag": "counting", "include": [{"class": "dog", "count": 2}]}]
    with serve_in_thread(served, "geneval") as url:
        remote = build("remote", url=url, batch_size=1, encoding="float32", takes_metadata=True)
        out = remote(images_with_red(0.95, 0.95, 0.95), ["a custom dog", "a photo of a dog", "two dogs"], metadata=rows)
    assert remote.takes_metadata and out.tolist() == [1.0, 1.0, 0.0]
