"""One contract battery for every registered reward (``flowrl.rewards.REGISTRY``), like
tests/test_policy_contract.py for models: each reward, built offline (tiny random models, local files,
a local stub server), is called as the trainer calls it and must return float32 ``[B]`` on the CPU,
NaN exactly where the prompt makes it not applicable, the same scores on a second call, a row's score
whatever its batch-mates, and a one-line ValueError naming the fix on every kind of bad input.

A reward registered later is picked up here and fails until it has an entry in ``CASES`` (how to
build it offline: fixtures come through ``request.getfixturevalue``; a served reward starts its
server in a fixture, as ``vlm_judge`` does).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from flowrl import rewards
from flowrl.types import Reward
from helpers import chat_stub_server
from helpers_reward_server import remote_kwargs, served

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


@pytest.fixture(scope="module")
def chat_server():
    """One stub chat server for the module (the built rewards are cached across tests)."""
    with pytest.MonkeyPatch.context() as mp:
        for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
            mp.delenv(var, raising=False)
        with chat_stub_server() as server:
            yield server


@pytest.fixture(scope="module")
def served_digits():
    """The digits reward served from a thread of this process (``flowrl serve-reward``'s app), for ``remote``."""
    with served("digits") as url:
        yield url


def _remote(request):
    return rewards.build("remote", **remote_kwargs(request.getfixturevalue("served_digits")))


def _clip_similarity(name):
    def build(request):
        d = request.getfixturevalue("tiny_clip_dir")
        return rewards.build(name, model=d, processor=d, batch_size=3)  # batch_size < B: chunks too
    return build


def _aesthetic(request):
    head, _ = request.getfixturevalue("tiny_aesthetic_head")
    return rewards.build("aesthetic", head=head, clip=request.getfixturevalue("tiny_clip_dir"), batch_size=3)


def _hps(request):
    ckpt, model = request.getfixturevalue("tiny_hps")
    return rewards.build("hps", checkpoint=ckpt, model=model, batch_size=3)


def _imagereward(request):
    from helpers import TINY_BLIP_VISION, TINY_MED

    t = request.getfixturevalue("tiny_imagereward")
    return rewards.build("imagereward", checkpoint=t["ckpt"], tokenizer=t["tokenizer"], med_config=TINY_MED,
                         vision_config=TINY_BLIP_VISION, batch_size=3)


def _hpsv3(request):
    t = request.getfixturevalue("tiny_hpsv3")
    return rewards.build("hpsv3", base=t["base"], checkpoint=t["checkpoint"], pixels=56 * 56, batch_size=3)


def _videoalign(request):  # takes videos whole; the battery's images are scored as still 2-frame clips
    t = request.getfixturevalue("tiny_videoalign")
    return rewards.build("videoalign", base=t["base"], checkpoint=t["checkpoint"], max_pixels=56 * 56,
                         min_pixels=56 * 56, batch_size=3)


def _vlm_judge(request):
    server = request.getfixturevalue("chat_server")
    return rewards.build("vlm_judge", url=f"http://127.0.0.1:{server.server_port}/v1", timeout=5.0, retries=0,
                         concurrency=3)


def brightness_detector(images):
    """A stub GenEval detector: one dog and one cat per image, scored by its red and green means."""
    return [{"dog": [(0.0, 0.0, 8.0, 8.0, float(x[0].mean()))], "cat": [(8.0, 8.0, 16.0, 16.0, float(x[1].mean()))]}
            for x in images]


@dataclass
class Case:
    """How to build a reward offline and which prompts it applies to.

    ``build(request)`` returns the reward; ``applies`` are prompts it scores (finite), ``not_applicable``
    prompts it must score NaN (empty: it applies to every prompt, so NaN must never appear)."""

    build: Callable[[pytest.FixtureRequest], object]
    applies: list[str] = field(default_factory=lambda: ["a photo of a dog", "a red flower", "a sign that says hi"])
    not_applicable: list[str] = field(default_factory=list)
    size: int = 32  # image side (pixels) of the battery's images
    meta: Callable[[object, list], dict] = lambda images, prompts: {}  # per-row keyword metadata of a call

    def __call__(self, reward, images, prompts):
        """``reward(images, prompts, **meta)`` as the samplers call it (``meta`` follows the rows)."""
        return reward(images, prompts, **self.meta(images, prompts))


CASES: dict[str, Case] = {
    "digits": Case(lambda r: rewards.build("digits"), applies=["a handwritten digit 3", "a handwritten digit 7"],
                   not_applicable=["a photo of a dog", "a handwritten letter"], size=16),
    "jpeg_compressibility": Case(lambda r: rewards.build("jpeg_compressibility")),
    "jpeg_incompressibility": Case(lambda r: rewards.build("jpeg_incompressibility")),
    "pickscore": Case(_clip_similarity("pickscore")),
    "clipscore": Case(_clip_similarity("clipscore")),
    "aesthetic": Case(_aesthetic),
    "hps": Case(_hps),
    "imagereward": Case(_imagereward),
    "hpsv3": Case(_hpsv3),
    "videoalign": Case(_videoalign),
    "ocr": Case(lambda r: rewards.build("ocr", backend="easyocr"), applies=['a sign that says "hello"', 'the word "FLOW"'],
                not_applicable=["a photo of a dog", "a sign with no quoted text"], size=48),
    "vlm_judge": Case(_vlm_judge),
    # GenEval's rules on a stub detector; prompts outside GenEval's metadata have no clauses
    "geneval": Case(lambda r: rewards.build("geneval", detector="test_reward_contract:brightness_detector"),
                    applies=["a photo of a dog", "a photo of a cat"], not_applicable=["a red flower", "a dog on the moon"]),
    # a served reward (here the digits reward behind flowrl serve-reward's app) scores as the reward itself
    "remote": Case(_remote, applies=["a handwritten digit 3", "a handwritten digit 7"],
                   not_applicable=["a photo of a dog", "a handwritten letter"], size=16),
    # an editing reward: each row's source image comes as metadata (here the row's own image)
    "digits_edit": Case(lambda r: rewards.build("digits_edit"), applies=["turn this 3 into a 7", "make the strokes thicker"],
                        not_applicable=["a photo of a dog"], size=16, meta=lambda x, p: {"sources": list(x)}),
    # the in-process VLM judges on a tiny Qwen2.5-VL (greedy, a few tokens; batch_size < B: batches too)
    "editscore": Case(lambda r: rewards.build("editscore", model=r.getfixturevalue("tiny_qwen_vl_dir"), lora=None,
                                              dtype="float32", temperature=0.0, max_new_tokens=4, batch_size=3),
                      size=16, meta=lambda x, p: {"sources": list(x)}),
    "unifiedreward": Case(lambda r: rewards.build("unifiedreward", model=r.getfixturevalue("tiny_qwen_vl_dir"),
                                                  dtype="float32", max_new_tokens=4, batch_size=3), size=16),
}

NAMES = rewards.available()


@pytest.fixture
def case(name) -> Case:
    if name not in CASES:
        pytest.fail(f"reward {name!r} is registered but has no entry in CASES (tests/test_reward_contract.py): "
                    "add how to build it offline, and its applicable / not-applicable prompts")
    return CASES[name]


@pytest.fixture(scope="module")
def built() -> dict:
    """Rewards built so far in this module, by name (the checks below never change a reward)."""
    return {}


@pytest.fixture
def reward(name, case, built, request):
    if name not in built:
        built[name] = case.build(request)
    return built[name]


def images(n: int, size: int, seed: int = 0) -> torch.Tensor:
    """``n`` distinct images in [0, 1]: smooth random blobs plus noise (so models and JPEG see structure)."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(n, 3, 4, 4, generator=g)  # [n, 3, 4, 4]
    x = torch.nn.functional.interpolate(low, size=(size, size), mode="bilinear", align_corners=False)
    return (0.8 * x + 0.2 * torch.rand(n, 3, size, size, generator=g)).clamp(0, 1)  # [n, 3, size, size]


def mixed_prompts(case: Case, n: int) -> tuple[list[str], torch.Tensor]:
    """``n`` prompts alternating applicable / not-applicable ones (all applicable if the reward always
    applies), and a bool mask [n] of the not-applicable rows."""
    pool = [(p, False) for p in case.applies]
    if case.not_applicable:
        pool = [x for pair in zip(pool, [(p, True) for p in case.not_applicable]) for x in pair]
    rows = [pool[i % len(pool)] for i in range(n)]
    return [p for p, _ in rows], torch.tensor([na for _, na in rows])


def same(a: torch.Tensor, b: torch.Tensor, tol: float = 0.0) -> None:
    torch.testing.assert_close(a, b, rtol=tol, atol=tol, equal_nan=True)


@pytest.mark.parametrize("name", NAMES)
def test_output_is_float32_b_on_cpu_and_nan_only_when_not_applicable(name, case, reward):
    assert isinstance(reward, Reward) and reward.name == name
    prompts, na = mixed_prompts(case, 6)
    s = case(reward, images(6, case.size), prompts)
    assert isinstance(s, torch.Tensor) and s.shape == (6,) and s.dtype == torch.float32 and s.device.type == "cpu"
    assert torch.equal(torch.isnan(s), na), f"NaN rows {torch.isnan(s).tolist()}, not-applicable rows {na.tolist()}"
    assert torch.isfinite(s[~na]).all()
    one = case(reward, images(1, case.size, seed=5), prompts[:1])  # a batch of one is [1], not a scalar
    assert one.shape == (1,) and one.dtype == torch.float32


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_and_row_independent_of_batch_mates(case, reward):
    x = images(5, case.size, seed=1)
    prompts, _ = mixed_prompts(case, 5)
    s = case(reward, x, prompts)
    same(case(reward, x, prompts), s)  # same inputs, same scores
    rev = torch.arange(4, -1, -1)
    same(case(reward, x[rev], [prompts[i] for i in rev.tolist()]), s[rev], 1e-5)  # other order
    alone = torch.cat([case(reward, x[i:i + 1], prompts[i:i + 1]) for i in range(5)])
    same(alone, s, 1e-5)  # each row on its own
    others = images(3, case.size, seed=9)  # row 2 among new batch-mates
    mixed = case(reward, torch.cat([others[:2], x[2:3], others[2:]]), prompts[:2] + prompts[2:3] + prompts[:1])
    same(mixed[2], s[2], 1e-5)


BAD_INPUTS = {  # kind -> (images, prompts) from good (images [2, 3, S, S], prompts [2]), and what the error names
    "rank": (lambda x, p: (x[0], p[:1]), r"\[B, 3, H, W\].*shape \(3, \d+, \d+\): add the batch dimension"),
    "one_channel": (lambda x, p: (x[:, :1], p), r"shape \(2, 1, .*repeat grey images"),
    "four_channels": (lambda x, p: (torch.cat([x, x[:, :1]], 1), p), r"shape \(2, 4, .*RGB"),
    "range": (lambda x, p: (x * 2 - 1, p), r"values in \[-.*clamp"),
    "nan_pixels": (lambda x, p: (x.index_put((torch.tensor([1]),), torch.tensor(float("nan"))), p), r"NaN pixels"),
    "prompt_count": (lambda x, p: (x, p[:1]), r"2 images but 1 prompts: pass one prompt per image"),
    "prompt_string": (lambda x, p: (x, p[0]), r"prompts as a list of strings.*got one string"),
    "empty": (lambda x, p: (x[:0], []), r"empty batch \(0 images\)"),
    "uint8": (lambda x, p: ((x * 255).to(torch.uint8), p), r"dtype torch.uint8: convert .* / 255"),
    "not_a_tensor": (lambda x, p: (x.numpy(), p), r"got a ndarray: pass a torch.Tensor"),
}


@pytest.mark.parametrize("kind", sorted(BAD_INPUTS))
@pytest.mark.parametrize("name", NAMES)
def test_bad_input_is_one_clear_line(name, case, reward, kind, request):
    make, match = BAD_INPUTS[kind]
    x, p = make(images(2, case.size), case.applies[:1] * 2)
    server = request.getfixturevalue("chat_server") if name == "vlm_judge" else None
    sent = len(server.requests) if server else 0
    with pytest.raises(ValueError, match=match) as e:
        case(reward, x, p)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{name} reward"), msg
    if server:  # refused before any request went out
        assert len(server.requests) == sent
