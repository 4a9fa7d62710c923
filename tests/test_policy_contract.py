"""One contract battery for every registered policy (``flowrl.pipelines.REGISTRY``), like diffusers'
``PipelineTesterMixin``: each adapter's tiny offline model (its declared ``tiny_kinds`` /
``make_tiny``) goes through the same checks. A new model registered in ``pipelines/__init__.py``
is covered without touching this file.
"""
import inspect

import pytest
import torch

from flowrl.export import LORA_WEIGHT_NAME, write_lora
from flowrl.pipelines import available, build_policy, policy_class
from flowrl.pipelines.base import DiffusersPolicy, diffusers_attr
from flowrl.trainable import add_lora, trainable_state
from flowrl.types import FlowPolicy
from helpers import PROMPTS, fixed_velocity

NAMES = available()
RANK, ALPHA = 2, 8  # scaling 4: lost if the export dropped alpha


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


def _accepts(cls, arg: str) -> bool:
    sig = inspect.signature(cls.__init__).parameters
    return arg in sig


def _options(cls, **extra) -> dict:
    """Loader options that keep the tiny models fast (short text sequences where the model has them; a model
    whose text encoder reads the source images keeps its default: its rows hold the pictures' tokens)."""
    short = _accepts(cls, "max_sequence_length") and not getattr(cls, "text_reads_sources", False)
    opts = {"max_sequence_length": 8} if short else {}
    return {**opts, **extra}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("contract")
    out = {}
    for name in NAMES:
        cls = policy_class(name)
        kind = cls.tiny_kinds[0]
        size = {"image_size": 32} if _accepts(cls, "resolution") else {}
        out[name] = cls.make_tiny(kind, root / kind, **size)
    return out


def load(tiny_dirs, name, **kw):
    return build_policy(name, str(tiny_dirs[name]), **_options(policy_class(name), **kw))


@pytest.mark.parametrize("name", NAMES)
def test_declarations(name):
    cls = policy_class(name)
    assert cls is not None and cls.kind == name
    assert cls.tiny_kinds and cls.lora_target_modules
    assert isinstance(diffusers_attr(cls.transformer_class), type)
    assert hasattr(cls.lora_writer(), "save_lora_weights")
    assert "OUT" in cls.lora_load_hint() and "BASE" in cls.lora_load_hint()
    if cls.pipeline_class:  # the declared pipeline is the one that loads the export (or the adapter says how)
        assert hasattr(diffusers_attr(cls.pipeline_class), "load_lora_weights") or (
            cls.load_exported_lora.__func__ is not DiffusersPolicy.load_exported_lora.__func__)


@pytest.mark.parametrize("name", NAMES)
def test_save_load_round_trip(tiny_dirs, name, tmp_path):
    cls = policy_class(name)
    m = getattr(cls, "tiny_multiple", lambda: 16)()  # pixels a side must be a multiple of (16; Qwen-Image 2.1: 32)
    res = {"resolution": (2 * m, 3 * m)} if _accepts(cls, "resolution") else {}
    policy = load(tiny_dirs, name, **res)
    assert isinstance(policy, FlowPolicy)
    policy.save_pretrained(tmp_path / "saved")
    back = build_policy(name, str(tmp_path / "saved"), **_options(cls))
    if res:  # the resolution travels with the saved model (flowrl.json)
        assert (back.height, back.width) == (2 * m, 3 * m) and back.latent_shape == policy.latent_shape
    x, s = policy.initial_noise([0]), torch.tensor([0.5])
    cond = policy.encode_prompts(PROMPTS[:1])
    with torch.no_grad():
        torch.testing.assert_close(back.velocity(x, s, cond), policy.velocity(x, s, cond))


@pytest.mark.parametrize("name", NAMES)
def test_encode_velocity_noise_sigmas_decode(tiny_dirs, name):
    policy = load(tiny_dirs, name)
    cond = policy.encode_prompts(PROMPTS + ["a third prompt"])
    assert cond and all(v.shape[0] == 3 for v in cond.values())  # batch-first
    one = policy.encode_prompts(PROMPTS[:1])
    assert one.keys() == cond.keys() and all(one[k].shape[1:] == cond[k].shape[1:] for k in cond)
    # initial noise: per-seed deterministic, independent of the batch
    x = policy.initial_noise([1, 2, 3])  # [3, C, h, w]
    assert x.dtype == torch.float32 and x.shape[1:] == tuple(policy.latent_shape)
    assert torch.equal(x, policy.initial_noise([1, 2, 3])) and torch.equal(x[1:2], policy.initial_noise([2]))
    assert not torch.equal(x[0], x[1])
    with torch.no_grad():
        v = policy.velocity(x, torch.tensor([0.9, 0.5, 0.1]), cond)
        v_scalar = policy.velocity(x, 0.5, cond)
    assert v.dtype == torch.float32 and v.shape == x.shape and torch.isfinite(v).all()
    assert v_scalar.shape == x.shape
    sig = policy.sigmas(4)
    assert sig.shape == (5,) and sig.dtype == torch.float32
    assert abs(float(sig[0]) - 1.0) < 1e-6 and float(sig[-1]) == 0.0 and (sig[1:] <= sig[:-1]).all()
    img = policy.decode(x[:2])  # images [2, 3, H, W]; a video model's (num_frames) videos [2, 3, F, H, W]
    frames = getattr(policy, "num_frames", None)
    assert img.dtype == torch.float32 and img.shape[:2] == (2, 3)
    assert (img.ndim == 4) if frames is None else (img.ndim == 5 and img.shape[2] == frames)
    if hasattr(policy, "height"):
        assert img.shape[-2:] == (policy.height, policy.width)
    assert 0.0 <= img.min() <= img.max() <= 1.0


@pytest.mark.parametrize("name", NAMES)
def test_lora_targets_exist_and_train(tiny_dirs, name):
    policy = load(tiny_dirs, name)
    modules = [n for n, _ in policy.transformer.named_modules()]
    missing = [t for t in policy.lora_target_modules if not any(n == t or n.endswith("." + t) for n in modules)]
    assert not missing, f"{name}: LoRA targets matching no module: {missing}"
    add_lora(policy.transformer, RANK, ALPHA, policy.lora_target_modules)
    # an early and a late step in one batch: a model with one transformer per noise level (Wan2.2's two
    # experts, switched at timestep 875) trains both
    v = policy.velocity(policy.initial_noise([0, 1]), torch.tensor([0.9, 0.45]), policy.encode_prompts(PROMPTS[:2]))
    v.square().mean().backward()
    grads = [p.grad for n, p in policy.transformer.named_parameters() if "lora" in n]
    assert grads and all(g is not None for g in grads)


@pytest.mark.parametrize("name", NAMES)
def test_export_loads_with_the_declared_diffusers_class(tiny_dirs, name, tmp_path):
    """The export writer the adapter declares writes a file its diffusers pipeline loads with
    ``load_lora_weights`` (the adapter's ``load_exported_lora``: ``load_lora_adapter`` on the pipeline's
    transformer where the pipeline has no LoRA loader; on the bare transformer for pipeline-less models), and
    the loaded model's velocity equals the policy's with the LoRA."""
    cls, base = policy_class(name), str(tiny_dirs[name])
    policy = load(tiny_dirs, name)
    base_transformer = policy.transformer
    trained = load(tiny_dirs, name).transformer
    add_lora(trained, RANK, ALPHA, policy.lora_target_modules)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in trained.named_parameters():
            if ".lora_B." in n:  # B starts at 0: make the LoRA move the model
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    info = write_lora(name, trainable_state(trained), tmp_path, base, RANK, ALPHA)
    assert info["scaling"] == ALPHA / RANK and (tmp_path / LORA_WEIGHT_NAME).is_file()
    if cls.pipeline_class:
        pipe = diffusers_attr(cls.pipeline_class).from_pretrained(base)
        for component, weight in info["files"].items():  # one file per trained transformer (Wan2.2: two experts)
            cls.load_exported_lora(pipe, tmp_path, weight, component)
        loaded = type(policy)(pipe, **_options(cls)).transformer  # the pipeline as the policy sees it
    else:
        loaded = diffusers_attr(cls.transformer_class).from_pretrained(base, subfolder="transformer")
        loaded.load_lora_adapter(tmp_path, weight_name=LORA_WEIGHT_NAME)
    v_trained = fixed_velocity(policy, trained.eval())
    v_loaded = fixed_velocity(policy, loaded.eval())
    v_base = fixed_velocity(policy, base_transformer)
    torch.testing.assert_close(v_loaded, v_trained, rtol=1e-5, atol=1e-6)
    assert (v_trained - v_base).abs().max() > 1e-4  # the LoRA really moved the model
