"""Rewards scored while the next chunk samples (flowrl.scoring): the same values in the
same order as the serial path, for every sampler; the overlap is real (a causal check, no timing);
a reward that raises stops the rollout with its own error; metrics and the config key."""
import threading

import pytest
import torch

from flowrl.advantages import transition_advantages
from flowrl.rewards import MultiReward
from flowrl.rollout import BranchSampler, ChunkScorer, GroupSampler, SolSampler, TempFlowSampler
from flowrl.rollout.ode import ODEGroupSampler, ode_generate

P = ["a handwritten digit 3", "a handwritten digit 7", "a handwritten digit 1"]


class MatmulReward:
    """A reward with real float work (a GEMM over the pixels and a reduction): enough for thread
    counts or batch shapes to show in the low bits if the two paths differed."""

    name = "matmul"

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.w = torch.randn(3 * 16 * 16, 96, generator=g)  # [768, 96]
        self.threads, self.grad = [], []

    def __call__(self, images, prompts, **meta):
        self.threads.append((threading.current_thread().name, torch.get_num_threads()))
        self.grad.append(torch.is_grad_enabled())
        return torch.tanh(images.flatten(1) @ self.w).mean(1)  # [B]


def reward(overlap: bool) -> MultiReward:
    return MultiReward({"a": MatmulReward(0), "b": MatmulReward(1)}, {"a": 1.0, "b": 0.5}, overlap=overlap)


SAMPLERS = {
    "group": lambda: GroupSampler(group_size=4, num_steps=3, max_batch=5),
    "branch": lambda: BranchSampler(num_steps=4, split_steps=(0, 2), branch_factor=2, max_batch=4),
    "tempflow": lambda: TempFlowSampler(num_steps=4, branch_steps=[1, 2], branches=2, seeds_per_prompt=2,
                                        finish_main=True, max_batch=4),
    "ode": lambda: ODEGroupSampler(group_size=4, num_steps=3, max_batch=5),
    "sol_group": lambda: SolSampler(explore_backend="none", pool_size=6, preview_steps=2, keep=4, explore_batch=5,
                                    regen="group", regen_options={"num_steps": 3, "max_batch": 3}),
    "sol_ode": lambda: SolSampler(explore_backend="none", pool_size=6, preview_steps=2, keep=4, explore_batch=4,
                                  regen="ode", regen_options={"num_steps": 3, "max_batch": 3}),
}


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_overlapped_scores_are_the_serial_ones_bit_for_bit(tiny_digits_policy, name):
    runs = {}
    for overlap in (False, True):
        rew = reward(overlap)
        runs[overlap] = (SAMPLERS[name]()(tiny_digits_policy, P, rew, seed=5), rew)
    (serial, rs), (over, ro) = runs[False], runs[True]
    assert torch.equal(serial.rewards, over.rewards) and torch.isfinite(over.rewards).all()
    assert serial.reward_components.keys() == over.reward_components.keys() == {"a", "b"}
    for k in serial.reward_components:
        assert torch.equal(serial.reward_components[k], over.reward_components[k])
    assert torch.equal(serial.x0, over.x0) and torch.equal(serial.images, over.images)
    if len(serial.transitions):
        a_s, _ = transition_advantages(serial)
        a_o, _ = transition_advantages(over)
        assert torch.equal(a_s, a_o) and torch.equal(serial.transitions.weight, over.transitions.weight)
        assert torch.equal(serial.transitions.old_log_prob, over.transitions.old_log_prob)
    if name == "tempflow":  # the main trajectories' own scores (finish_main) too
        assert torch.equal(serial.layout.main_rewards, over.layout.main_rewards)
    if name.startswith("sol"):  # the exploration pool, scored in chunks of explore_batch
        assert torch.equal(serial.layout.explore_rewards, over.layout.explore_rewards)
        assert torch.equal(serial.layout.selected, over.layout.selected)
    # several chunks were scored, on the worker thread when overlapped, with the caller's thread count
    calls = ro.rewards["a"].threads
    assert len(calls) >= 2 and {t for t, _ in calls} == {"flowrl-reward_0"}
    assert {n for _, n in calls} == {torch.get_num_threads()} and not any(ro.rewards["a"].grad)
    assert {t for t, _ in rs.rewards["a"].threads} == {threading.current_thread().name}
    for r in (serial, over):
        assert r.stats["reward_seconds"] > 0 and 0 <= r.stats["reward_wait_seconds"]
    assert serial.stats["reward_wait_seconds"] == pytest.approx(serial.stats["reward_seconds"])


def test_a_chunk_is_scored_while_the_next_one_samples(tiny_digits_policy):
    """Causal: scoring chunk 0 waits until chunk 1 is being sampled. Serial scoring could not
    get there (the reward would time out and say so)."""
    second_chunk = threading.Event()

    class Watch:
        def __init__(self, policy):
            self.inner, self.transformer = policy, policy.transformer

        def velocity(self, x, sigma, cond):
            if x.shape[0] == 2:  # 6 samples in chunks of 4: the second chunk has 2 rows
                second_chunk.set()
            return self.inner.velocity(x, sigma, cond)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    def waits_for_chunk_1(images, prompts, **meta):
        if images.shape[0] == 4 and not second_chunk.wait(timeout=30):
            raise AssertionError("chunk 0 was scored before chunk 1 started sampling: no overlap")
        return images.mean(dim=(1, 2, 3))

    ro = GroupSampler(group_size=3, num_steps=2, max_batch=4)(Watch(tiny_digits_policy), P[:2], waits_for_chunk_1)
    assert ro.rewards.shape == (6,) and second_chunk.is_set()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_reward_that_raises_stops_the_rollout_with_its_message(tiny_digits_policy, overlap):
    calls = []

    class Broken:
        name = "broken"

        def __init__(self):
            self.overlap = overlap

        def __call__(self, images, prompts, **meta):
            calls.append(images.shape[0])
            raise ValueError("broken reward: the judge said no")

    with pytest.raises(ValueError, match="the judge said no"):
        GroupSampler(group_size=4, num_steps=2, max_batch=2)(tiny_digits_policy, P, Broken())
    assert 1 <= len(calls) < 6  # it stopped: not every chunk was scored


def test_chunk_scorer_orders_by_submission_and_cancels_after_an_error():
    import time

    seen = []

    def slow_then_fail(images, prompts):
        seen.append(int(images[0, 0, 0, 0]))
        if int(images[0, 0, 0, 0]) == 1:
            raise RuntimeError("chunk 1 failed")
        time.sleep(0.01 * (3 - int(images[0, 0, 0, 0])))
        return images[:, 0, 0, 0], {}

    def chunk(v, n=2):
        return torch.full((n, 3, 1, 1), float(v))

    with ChunkScorer(None, score=lambda im, pr: (im[:, 0, 0, 0] * 2, {"x": im[:, 0, 0, 0]})) as s:
        for v in (3, 1, 2):
            s.submit(chunk(v), ["p"] * 2)
        out = s.result()
    assert out.rewards.tolist() == [6, 6, 2, 2, 4, 4] and out.components["x"].tolist() == [3, 3, 1, 1, 2, 2]
    with pytest.raises(RuntimeError, match="chunk 1 failed"):
        with ChunkScorer(None, score=slow_then_fail) as s:
            for v in range(6):
                s.submit(chunk(v), ["p"] * 2)
                time.sleep(0.005)
            s.result()
    assert 1 in seen and len(seen) < 6  # the chunks queued behind the failure were cancelled
    empty = ChunkScorer(None)
    empty.submit(chunk(0, 3), ["p"] * 3)
    assert torch.isnan(empty.result().rewards).all()


def test_evaluation_scores_in_chunks_with_the_heldout_rewards(tiny_digits_policy):
    from flowrl.builders import evaluate_policy

    heldout = {"h": MatmulReward(2)}
    m1, im1 = evaluate_policy(tiny_digits_policy, reward(False), heldout, P, 3, 2, 0)
    m2, im2 = evaluate_policy(tiny_digits_policy, reward(True), heldout, P, 3, 2, 0, max_batch=4)
    assert len(heldout["h"].threads) == 1 + 3  # unchunked, then 9 samples in chunks of 4
    for k in ("eval/reward", "eval/reward/a", "eval/reward/b", "eval/heldout/h"):
        assert m1[k] == pytest.approx(m2[k], abs=1e-6)
    x0, images, scores = ode_generate(tiny_digits_policy, P, [1, 2, 3], 2, reward(True), max_batch=2)
    assert scores.rewards.shape == (3,) and images.shape[0] == 3 and x0.shape[0] == 3


def test_reward_overlap_is_a_validated_config_key(tiny_digits_dir):
    from flowrl.builders import build_reward
    from flowrl.errors import ConfigError
    from flowrl.trainers.config import load_config

    assert load_config("recipes/digits.yaml").reward.overlap is True
    cfg = load_config("recipes/digits.yaml", ["reward.overlap=false"])
    assert cfg.reward.overlap is False and build_reward(cfg).overlap is False
    with pytest.raises(ConfigError, match="reward.overlap must be"):
        load_config("recipes/digits.yaml", ["reward.overlap=sometimes"])


def test_training_with_and_without_overlap_ends_on_the_same_weights(tiny_digits_dir, tmp_path):
    """Rewards, advantages and so the trained weights: bit for bit (two iterations, 3 chunks each)."""
    import json

    from conftest import tiny_train_overrides
    from flowrl.checkpoints import load_checkpoint
    from flowrl.checkpoints.common import list_checkpoints
    from flowrl.trainers.config import load_config
    from flowrl.trainers.online import train

    weights, metrics = {}, {}
    for overlap in (False, True):
        over = tiny_train_overrides(tiny_digits_dir, **{"train.iterations": 2, "sampler.max_batch": 6,
                                                        "reward.overlap": str(overlap).lower()})
        run = tmp_path / str(overlap)
        train(load_config("recipes/digits.yaml", over), run)
        weights[overlap] = load_checkpoint(list_checkpoints(run / "checkpoints")[-1])["trainable"]
        metrics[overlap] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for k, v in weights[False].items():
        assert torch.equal(v, weights[True][k]), k
    for a, b in zip(metrics[False], metrics[True]):
        for k in ("reward_mean", "reward_std", "eval/reward"):
            assert a.get(k) == b.get(k), k
    it = [m for m in metrics[True] if "reward_mean" in m]
    assert it and all(m["reward_wait_seconds"] >= 0 and m["reward_seconds"] > 0 for m in it)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs: the worker must score on the caller's "
                                                           "current device, not GPU 0")
def test_the_worker_scores_on_the_callers_cuda_device():
    seen = []

    def device_of(images, prompts):
        seen.append(torch.cuda.current_device())
        return images.mean(dim=(1, 2, 3)), {}

    prev = torch.cuda.current_device()
    torch.cuda.set_device(1)
    try:
        with ChunkScorer(None, score=device_of, overlap=True) as s:
            s.submit(torch.zeros(2, 3, 4, 4), ["a", "b"])
            s.result()
    finally:
        torch.cuda.set_device(prev)
    assert seen == [1]
