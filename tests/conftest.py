import os
import tempfile

import pytest
import torch


def _session_home() -> str:
    """A FLOWRL_HOME of this test session's own: one directory shared by every pytest-xdist worker of the
    run (``PYTEST_XDIST_TESTRUNUID`` is the same in each), so the digits base, its reward classifier and
    the tiny models are built once per run (their builders take a lock), not once per worker."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        return tempfile.mkdtemp(prefix="flowrl-test-home-")
    path = os.path.join(tempfile.gettempdir(), f"flowrl-test-home-{run}")
    os.makedirs(path, exist_ok=True)
    return path


def _workers() -> int:
    """pytest-xdist worker processes of this run (1 without xdist)."""
    return max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1))


# Tests never touch the user's cache: a per-session FLOWRL_HOME unless the caller set one.
os.environ.setdefault("FLOWRL_HOME", _session_home())
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# the cores shared by the workers (`make test` runs one per core): more threads only oversubscribe them
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // _workers()))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny-model tests (modules opt in with ``pytestmark``): a
    second thread only adds synchronisation on tiny matrices and oversubscribes shared CI cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def tiny_digits_policy():
    """A random-init digits policy (no pretraining): for mechanics, not quality."""
    from diffusers import SD3Transformer2DModel

    from flowrl.pipelines.digits import DigitsPolicy, DigitTextEncoder, tiny_transformer_config

    torch.manual_seed(0)
    cfg = {**tiny_transformer_config(), "num_layers": 1}
    return DigitsPolicy(SD3Transformer2DModel(**cfg).eval(), DigitTextEncoder().eval())


class CountingPolicy:
    """Wraps a policy and counts the latent rows it evaluates."""

    def __init__(self, policy):
        self.inner, self.rows, self.calls = policy, 0, 0
        self.transformer = policy.transformer

    def velocity(self, latents, sigma, cond):
        self.rows += latents.shape[0]
        self.calls += 1
        return self.inner.velocity(latents, sigma, cond)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture
def counting():
    return CountingPolicy


@pytest.fixture(scope="session")
def tiny_digits_dir(tmp_path_factory):
    """A random-init 1-layer digits model saved with save_pretrained (loaded by path in configs)."""
    from diffusers import SD3Transformer2DModel

    from flowrl.pipelines.digits import DigitsPolicy, DigitTextEncoder, tiny_transformer_config

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-digits")
    DigitsPolicy(SD3Transformer2DModel(**{**tiny_transformer_config(), "num_layers": 1}),
                 DigitTextEncoder()).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model():
    """``tiny_model(pipeline)``: the pipeline's tiny random model at 32 px (``flowrl.smoke.tiny_model``,
    built once per ``FLOWRL_HOME``: every module of a session, ``flowrl train --smoke`` included,
    shares one build per model). Tests read it and never write into it."""
    from flowrl.smoke import tiny_model as build

    return build


def tiny_train_overrides(path, **extra) -> list[str]:
    """Overrides that make the digits recipe run in seconds on a tiny model."""
    base = {"model.path": str(path), "train.iterations": 3, "train.batch_size": 16, "sampler.group_size": 4,
            "sampler.num_steps": 4, "train.minibatch_size": 16, "train.grad_accum": 2, "logging.eval_every": 2,
            "logging.image_every": 2, "data.eval_seeds_per_prompt": 2, "logging.trackers": "[]",
            "logging.progress": "false", "train.checkpoint_every": 1, "reward.heldout": "{}"}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture(scope="session")
def pretrained_digits_base():
    """The real digits base in $FLOWRL_HOME (pretrained once per session, ~1.5 min on 2 idle cores;
    reused when FLOWRL_HOME points at a cache that already has it)."""
    from flowrl.pipelines.digits import default_base_path, pretrain_digits

    path = default_base_path()
    if not (path / "transformer").is_dir():
        pretrain_digits(path, progress=False)
    return path


@pytest.fixture(scope="session")
def pretrained_shapes_base():
    """A shapes base in $FLOWRL_HOME, pretrained SHORT (``SHAPES_TEST_STEPS``) once per session under the
    base's lock (every xdist worker shares it; reused when FLOWRL_HOME already has a base): the end-to-end
    GRPO test needs a base that draws the world's colours, not the full one (``flowrl pretrain-shapes``)."""
    from flowrl.pipelines.pixel_flow import base_lock
    from flowrl.pipelines.pretrain_config import ShapesPretrainConfig
    from flowrl.pipelines.shapes import ShapesPolicy

    path = ShapesPolicy.default_base_path()
    threads = torch.get_num_threads()
    with base_lock(path, "shapes"):
        if not (path / "transformer").is_dir():
            torch.set_num_threads(1)  # (a session fixture runs before the one_thread of a module)
            try:
                ShapesPolicy.pretrain(path, ShapesPretrainConfig(steps=SHAPES_TEST_STEPS), progress=False)
            finally:
                torch.set_num_threads(threads)
    return path


SHAPES_TEST_STEPS = 300  # about 60 s on one thread of a 2-core AMD EPYC (patch 4 x width 128: 0.2 s a step)


# ---------------------------------------------------------------- tiny reward models, built once per session
@pytest.fixture(scope="session")
def tiny_qwen_vl_dir(tmp_path_factory) -> str:
    """A tiny random Qwen2.5-VL judge (model + processor, saved with save_pretrained) for editscore / unifiedreward."""
    from helpers_vlm import build_tiny_qwen25_vl

    return build_tiny_qwen25_vl(tmp_path_factory.mktemp("tiny-qwen25-vl"))


@pytest.fixture(scope="session")
def tiny_clip_dir(tmp_path_factory):
    """A random CLIP (toy size, real vocabulary) saved with save_pretrained: model + processor."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from flowrl.pipelines.tiny import build_clip_tokenizer
    from helpers import TINY_VISION

    torch.manual_seed(0)
    cfg = CLIPConfig(
        text_config=dict(vocab_size=49408, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=77, bos_token_id=49406, eos_token_id=49407,
                         pad_token_id=49407),
        vision_config=dict(TINY_VISION), projection_dim=16)
    d = tmp_path_factory.mktemp("tiny-clip")
    CLIPModel(cfg).eval().save_pretrained(d)
    ip = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    # the real CLIP BPE, all 48,894 merges (vocabulary 49,408)
    CLIPProcessor(image_processor=ip, tokenizer=build_clip_tokenizer(48894)).save_pretrained(d)
    return str(d)


@pytest.fixture(scope="session")
def tiny_aesthetic_head(tmp_path_factory):
    """A LAION-style aesthetic MLP head file for ``tiny_clip_dir``'s 16-d embeddings: (path, head)."""
    from flowrl.rewards._clip_common import LinearMLPHead
    from helpers import randomize_

    head = randomize_(LinearMLPHead(16), 0.3)
    path = tmp_path_factory.mktemp("aesthetic") / "sac+logos+ava1-l14-linearMSE.pth"
    torch.save(head.state_dict(), path)
    return str(path), head.eval()


@pytest.fixture(scope="session")
def tiny_hps(tmp_path_factory):
    """A toy open_clip config registered by name (open_clip's registry is restored after the session)
    and an HPS-style checkpoint {'state_dict': ...}: (checkpoint path, model name)."""
    import json

    import open_clip
    import open_clip.factory as factory

    from helpers import randomize_

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(factory, "_MODEL_CONFIGS", dict(factory._MODEL_CONFIGS))  # add_model_config writes and rebinds
        mp.setattr(factory, "_MODEL_CONFIG_PATHS", list(factory._MODEL_CONFIG_PATHS))  # and appends here
        d = tmp_path_factory.mktemp("hps")
        cfg = {"embed_dim": 16,
               "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
               "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}}
        (d / "flowrl-tiny-hps.json").write_text(json.dumps(cfg))
        open_clip.add_model_config(str(d / "flowrl-tiny-hps.json"))
        torch.manual_seed(0)
        model = randomize_(open_clip.create_model("flowrl-tiny-hps", pretrained=None), 0.1)
        ckpt = d / "HPS_v2.1_compressed.pt"
        torch.save({"state_dict": model.state_dict()}, ckpt)
        yield str(ckpt), "flowrl-tiny-hps"


@pytest.fixture(scope="session")
def tiny_imagereward(tmp_path_factory):
    """An ImageReward.pt in the published layout: the vision part comes from timm's ViT (the
    original BLIP ViT code base), the text part in BLIP-med naming, the MLP as ``mlp.layers.*``
    (sizes ``helpers.TINY_MED`` / ``TINY_BLIP_VISION``)."""
    import functools

    from timm.models.vision_transformer import VisionTransformer
    from transformers import BertTokenizer, BlipTextModel

    from flowrl.rewards._clip_common import LinearMLPHead
    from flowrl.rewards.imagereward import build_configs
    from helpers import BLIP_WORDS, TINY_BLIP_VISION, TINY_MED, randomize_

    d = tmp_path_factory.mktemp("imagereward")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + BLIP_WORDS
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(d / "tokenizer")
    torch.manual_seed(0)
    v = TINY_BLIP_VISION
    vit = VisionTransformer(img_size=v["image_size"], patch_size=v["patch_size"], embed_dim=v["hidden_size"],
                            depth=v["num_hidden_layers"], num_heads=v["num_attention_heads"], mlp_ratio=4,
                            qkv_bias=True, num_classes=0, global_pool="",
                            norm_layer=functools.partial(torch.nn.LayerNorm, eps=1e-6))
    randomize_(vit, 0.15)
    _, tcfg = build_configs(TINY_MED, TINY_BLIP_VISION)
    text = randomize_(BlipTextModel(tcfg, add_pooling_layer=False), 0.15)
    head = randomize_(LinearMLPHead(32), 0.3)
    sd = {**{f"blip.visual_encoder.{k}": t for k, t in vit.state_dict().items()},
          **{f"blip.text_encoder.{k}": t for k, t in text.state_dict().items()},
          "blip.text_encoder.embeddings.position_ids": torch.arange(40)[None],
          "blip.vision_proj.weight": torch.zeros(8, 24), "blip.vision_proj.bias": torch.zeros(8),
          "blip.text_proj.weight": torch.zeros(8, 32), "blip.text_proj.bias": torch.zeros(8),
          **{f"mlp.{k}": t for k, t in head.state_dict().items()}}
    torch.save(sd, d / "ImageReward.pt")
    return dict(ckpt=str(d / "ImageReward.pt"), tokenizer=str(d / "tokenizer"), vit=vit.eval(),
                text_sd=text.state_dict(), head=head.eval())


@pytest.fixture(scope="session")
def tiny_qwen2vl_base(tmp_path_factory):
    """A tiny Qwen2-VL base directory (config + processor with Qwen2-VL's chat template): helpers_qwen2vl."""
    from helpers_qwen2vl import save_tiny_base

    return str(save_tiny_base(tmp_path_factory.mktemp("qwen2vl-base")))


@pytest.fixture(scope="session")
def tiny_hpsv3(tiny_qwen2vl_base, tmp_path_factory):
    """An HPSv3.safetensors of the authors' model on the tiny base (transformers >= 4.52 keys, as published),
    with the authors' model, processor and reward token ids for the reference."""
    from safetensors.torch import save_file
    from torch import nn

    from helpers_qwen2vl import authors_model

    head = nn.Sequential(nn.Linear(32, 1024), nn.ReLU(), nn.Dropout(0.05), nn.Linear(1024, 16), nn.ReLU(),
                         nn.Linear(16, 2))  # HPSv3's "ranknet" rm_head
    model, processor, ids = authors_model(tiny_qwen2vl_base, ["<|Reward|>"], head)
    path = tmp_path_factory.mktemp("hpsv3") / "HPSv3.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    return dict(base=tiny_qwen2vl_base, checkpoint=str(path), model=model, processor=processor, ids=ids)


@pytest.fixture(scope="session")
def tiny_videoalign(tiny_qwen2vl_base, tmp_path_factory):
    """A VideoReward ``model.pth`` of the authors' model on the tiny base: the PEFT model's state dict (LoRA r 4,
    alpha 8: scaling 2 as the published r 64, alpha 128) in the transformers < 4.52 layout, as published."""
    from torch import nn

    from flowrl.rewards.videoalign_prompt import REWARD_TOKENS
    from helpers_qwen2vl import authors_model, old_layout, with_lora

    model, processor, ids = authors_model(tiny_qwen2vl_base, list(REWARD_TOKENS), nn.Linear(32, 1, bias=False))
    peft = with_lora(model)
    path = tmp_path_factory.mktemp("videoalign") / "model.pth"
    torch.save(old_layout(peft.state_dict(), "base_model.model."), path)
    return dict(base=tiny_qwen2vl_base, checkpoint=str(path), model=peft.base_model.model, processor=processor, ids=ids)


@pytest.fixture
def stub():
    """A stub OpenAI-compatible chat server for the VLM judge (``helpers.StubChatHandler``), one per test."""
    from helpers import chat_stub_server

    with chat_stub_server() as server:
        yield server
