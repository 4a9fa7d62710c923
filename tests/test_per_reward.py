"""``reward.aggregate: per_reward`` for every update and every sampler's structure (issue 42, item 2).

Two rewards, ``a`` of scale 1 and ``b`` of scale 100: under ``sum`` the advantage (or ranking) is that of
``a + b``, in which ``b`` drowns ``a``; under ``per_reward`` each reward is normalised within its group before
the weighted sum, so both count. Hand checks on tensors built here (group, tree, ranking, Sol's kept subset,
the shares), then every update x every sampler that stores what it needs on one fixed rollout each.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from flowrl.advantages.aggregate import variance_shares
from flowrl.advantages.group import group_advantages, group_structure
from flowrl.advantages.ranking import ranking_values
from flowrl.advantages.tree import branch_structure
from flowrl.registry import SAMPLERS
from flowrl.structures import TreeStructure
from flowrl.trainers.config import load_config
from flowrl.updates import UPDATES, default_needs, updates_by_input
from flowrl.updates.base import UpdateContext, incompatibility

pytestmark = pytest.mark.usefixtures("one_thread")

A, B = "digits", "jpeg_compressibility"  # reward names the config knows; their scores are made here
BOTH = {A: 1.0, B: 1.0}
EPS = 1e-4


def _view(a: torch.Tensor, b: torch.Tensor, groups: torch.Tensor) -> SimpleNamespace:
    """A flat group rollout of samples with scores ``a`` and ``b`` (one transition per sample)."""
    return SimpleNamespace(structure="group", rewards=a + b, group_index=groups, reward_components={A: a, B: b},
                           transitions=SimpleNamespace(sample_index=torch.arange(len(a))))


# ---------------------------------------------------------------- the math, by hand
def test_group_advantages_by_hand_one_reward_100x_the_other():
    a = torch.tensor([0.0, 1.0, 0.0, 1.0])  # centred +-0.5, population std 0.5
    b = torch.tensor([0.0, 0.0, 100.0, 100.0])  # centred +-50, population std 50
    ro = _view(a, b, torch.zeros(4, dtype=torch.long))
    summed, info_s = group_structure(ro, reward_weights=BOTH)
    per, info_p = group_structure(ro, per_reward_weights=BOTH, reward_weights=BOTH)
    # sum: a + b = [0, 1, 100, 101], centred [-50.5, -49.5, 49.5, 50.5], population std sqrt(2500.25)
    std = 2500.25 ** 0.5
    assert torch.allclose(summed, torch.tensor([-50.5, -49.5, 49.5, 50.5]) / (std + EPS))  # b alone, nearly
    # per_reward: z_a + z_b = 0.5 / (0.5 + eps) (+-1) + 50 / (50 + eps) (+-1): a decides rows 1 and 2
    za, zb = 0.5 / (0.5 + EPS), 50 / (50 + EPS)
    assert torch.allclose(per, torch.tensor([-za - zb, za - zb, zb - za, za + zb]), atol=1e-6)
    assert per[1].abs() < 1e-3 and per[2].abs() < 1e-3 and summed[1] < -0.98 and summed[2] > 0.98
    # each reward's share of the advantage's variance: b's ~1 under sum, half each under per_reward
    sh_s, sh_p = variance_shares(info_s["contributions"]), variance_shares(info_p["contributions"])
    assert sh_s[B] > 0.999 and abs(sh_s[A]) < 1e-3 and sh_s[A] + sh_s[B] == pytest.approx(1.0)
    assert sh_p == pytest.approx({A: 0.5, B: 0.5}, abs=1e-4)


def _star_tree(a: torch.Tensor, b: torch.Tensor) -> SimpleNamespace:
    """One root with a leaf child per score (a BranchGRPO tree of one split): leaf ``i`` scores ``a[i]``, ``b[i]``."""
    n = len(a)
    parent = torch.tensor([-1] + [0] * n)  # [nodes]
    leaves = torch.arange(1, n + 1)  # [L]
    layout = TreeStructure.from_tree(parent, (parent >= 0).long(), torch.zeros(n + 1).long(), torch.zeros(n + 1),
                                     torch.cat([torch.tensor([-1]), leaves - 1]), leaves, n, tree_seeds=[0],
                                     split_steps=[0], branch_factor=n, num_steps=1, sde_steps=[0])
    return SimpleNamespace(structure="branch", rewards=a + b, layout=layout, reward_components={A: a, B: b},
                           transitions=SimpleNamespace(step=torch.zeros(n).long(), sample_index=leaves - 1))


def test_tree_fusion_per_reward_by_hand():
    ro = _star_tree(torch.tensor([0.0, 1.0, 0.0, 1.0]), torch.tensor([0.0, 0.0, 100.0, 100.0]))
    summed, _ = branch_structure(ro, reward_weights=BOTH)
    per, info = branch_structure(ro, per_reward_weights=BOTH)
    # BranchGRPO's depth normalisation: unbiased std + 1e-8; a: sqrt(1/3), b: 100 sqrt(1/3), a + b: sqrt(10001/3)
    za, zb = 0.5 / 3 ** -0.5, 50 / (100 * 3 ** -0.5)
    assert torch.allclose(per, torch.tensor([-za - zb, za - zb, zb - za, za + zb]), atol=1e-5)
    assert torch.allclose(summed, torch.tensor([-50.5, -49.5, 49.5, 50.5]) / (10001 / 3) ** 0.5, atol=1e-5)
    assert variance_shares(info["contributions"]) == pytest.approx({A: 0.5, B: 0.5}, abs=1e-6)


# a says sample 3 is best; b (100x) says sample 1; both say sample 0 is worst
RANK_A, RANK_B = torch.tensor([[0.0, 0.0, 0.0, 1.0]]), torch.tensor([[0.0, 100.0, 99.0, 0.0]])


def test_ranking_value_by_hand():
    cols = {A: RANK_A, B: RANK_B}
    assert torch.equal(ranking_values(cols, BOTH, per_reward=False), RANK_A + RANK_B)
    z = lambda r: (r - r.mean()) / (r.std() + EPS)  # noqa: E731  unbiased std, as offline GDRO
    v = ranking_values(cols, BOTH, per_reward=True)
    assert torch.allclose(v, z(RANK_A) + z(RANK_B))
    assert int(v.argmax()) == 3 and int((RANK_A + RANK_B).argmax()) == 1 and int(v.argmin()) == 0
    assert torch.isnan(ranking_values({A: torch.tensor([[0.0, float("nan")]]), B: torch.zeros(1, 2)}, BOTH,
                                      per_reward=True)).all()  # a group with a NaN score has no ranking


class QueuedScores:
    """A two-reward ``MultiReward`` stand-in whose calls return queued scores in order (no model)."""

    name, overlap = "queued", False

    def __init__(self, queue: list[tuple[torch.Tensor, torch.Tensor]], aggregate: str):
        self.queue, self.weights, self.aggregate = list(queue), dict(BOTH), aggregate

    def components(self, images, prompts, **meta):
        a, b = self.queue.pop(0)
        assert len(a) == images.shape[0]
        return {A: a, B: b}

    def combine(self, comps):
        return comps[A] + comps[B]


@pytest.mark.parametrize("aggregate, kept", [("sum", [0, 1]), ("per_reward", [0, 3])])
def test_sol_keeps_the_best_and_worst_by_the_rule(tiny_digits_policy, aggregate, kept):
    sampler = SAMPLERS.get("sol")(explore_backend="none", pool_size=4, keep=2, preview_steps=2, regen="ode",
                                  regen_options={"num_steps": 2})
    reward = QueuedScores([(RANK_A[0], RANK_B[0]), (torch.zeros(2), torch.zeros(2))], aggregate)
    r = sampler(tiny_digits_policy, ["a handwritten digit 3"], reward, seed=0)
    assert r.layout.selected.tolist() == kept  # sum: b's best (1); per_reward: the z-sum's best (3)


class Brightness:
    """100 x the mean pixel value: a local reward of another scale than JPEG's kB (no model)."""

    name = "brightness"

    def __call__(self, images, prompts, **meta):
        return 100 * images.float().mean(dim=(1, 2, 3))  # [B]


def test_a_served_reward_arrives_apart_from_the_local_ones(tiny_digits_policy):
    """A reward served by ``flowrl serve-reward`` (``remote``) beside a local one, scored overlapped in chunks:
    the rollout holds each reward's scores apart (the served ones equal to the reward's own on the same images),
    and ``per_reward`` normalises each apart."""
    from helpers_reward_server import remote_kwargs, served

    from flowrl.advantages.group import group_advantages
    from flowrl.rewards import MultiReward, build
    from flowrl.rewards.compress import jpeg_kilobytes

    with served("jpeg_compressibility") as url:
        reward = MultiReward({"remote": build("remote", **remote_kwargs(url)), "brightness": Brightness()},
                             {"remote": 1.0, "brightness": 1.0}, overlap=True, aggregate="per_reward")
        r = SAMPLERS.get("group")(group_size=4, num_steps=2, max_batch=3)(tiny_digits_policy, PROMPTS, reward, seed=0)
    comps = r.reward_components
    assert set(comps) == {"remote", "brightness"}
    assert torch.equal(comps["remote"], -jpeg_kilobytes(r.images))  # uint8 on the wire: what JPEG encodes anyway
    assert torch.allclose(comps["brightness"], Brightness()(r.images, PROMPTS))
    adv, _ = group_structure(r, per_reward_weights=reward.weights)
    z = [group_advantages(comps[k], r.group_index)[0] for k in ("remote", "brightness")]
    assert torch.allclose(adv, (z[0] + z[1]).clamp(-5, 5)[r.transitions.sample_index], atol=1e-6)


def _on_rewards(name: str) -> bool:
    """Whether update ``name`` turns rewards into advantages or rankings (its declaration: a reward in its loss, and
    online or on scored groups; OPD reads no reward, SFT and offline DPO read images and pairs)."""
    needs = default_needs(name)
    return needs.reward_in_loss and needs.data in ("", "groups")


def test_every_update_on_rewards_declares_per_reward():
    on_rewards = {n for n in UPDATES.entries if _on_rewards(n)}
    assert {"grpo", "nft", "awm", "dgpo", "dpo", "gdro", "offline_gdro"} <= on_rewards
    assert {n for n in UPDATES.entries if default_needs(n).per_reward} == on_rewards


# ---------------------------------------------------------------- every update x every sampler
SAMPLER_CASES = {  # small sizes with groups of 4 (tree: 4 leaves; tempflow: 4 branches per cell); AWM's training
    #                times need 4 steps
    "group": {"name": "group", "group_size": 4, "num_steps": 4},
    "branch": {"name": "branch", "num_steps": 3, "split_steps": [0, 1], "window": 2, "window_start": 0},
    "tempflow": {"name": "tempflow", "num_steps": 3, "branch_steps": [0, 1], "branches": 4, "seeds_per_prompt": 1},
    "sol_group": {"name": "sol", "explore_backend": "none", "pool_size": 6, "keep": 4, "preview_steps": 2,
                  "regen_options": {"num_steps": 4}},
    "sol_ode": {"name": "sol", "explore_backend": "none", "pool_size": 6, "keep": 4, "preview_steps": 2,
                "regen": "ode", "regen_options": {"num_steps": 4}},
    "ode": {"name": "ode", "group_size": 4, "num_steps": 4},
}
PROMPTS = ["a handwritten digit 3", "a handwritten digit 7"]


def _sampler(case: str):
    opts = {k: v for k, v in SAMPLER_CASES[case].items() if k != "name"}
    return SAMPLERS.get(SAMPLER_CASES[case]["name"])(**opts)


def _pairs() -> list:
    """Every online update x every sampler case whose rollouts it can train on (reward.aggregate aside)."""
    out = []
    for loss in filter(_on_rewards, updates_by_input()["rollout"]):
        for case in SAMPLER_CASES:
            s = _sampler(case)
            why = incompatibility(default_needs(loss), loss, mode="online", sampler=case, aggregate="sum",
                                  stores_transitions=s.stores_transitions, inner_epochs=1, alternatives={},
                                  flat_groups=bool(getattr(s, "flat_groups", True)))
            if why is None:
                out.append(pytest.param(loss, case, id=f"{loss}-{case}"))
    return out


def test_the_cases_cover_every_sampler():
    assert {c["name"] for c in SAMPLER_CASES.values()} == set(SAMPLERS.names())


def _spread(groups: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Within each group, ``linspace(-1, 1, k)`` in a random order: every group spreads the same."""
    out = torch.zeros(len(groups))
    for gid in torch.unique(groups):
        rows = torch.nonzero(groups == gid).flatten()
        out[rows] = torch.linspace(-1, 1, len(rows))[torch.randperm(len(rows), generator=g)]
    return out


def _tree_spread(layout: TreeStructure, g: torch.Generator) -> torch.Tensor:
    """Leaf scores whose mean over every node's leaves spreads at every depth: siblings get distinct steps
    (``linspace(-1, 1, K)`` in a random order) of size 2^-depth, a leaf scores the sum along its path."""
    parent, depth = layout.node_parent, layout.node_depth
    step = torch.zeros(len(parent))
    for p in torch.unique(parent[parent >= 0]):
        kids = torch.nonzero(parent == p).flatten()
        step[kids] = torch.linspace(-1, 1, len(kids))[torch.randperm(len(kids), generator=g)] * 2.0 ** -depth[kids]
    out, node = torch.zeros(len(layout.leaf_node)), layout.leaf_node.clone()
    while (node >= 0).any():
        live = node >= 0
        out[live] += step[node[live]]
        node[live] = parent[node[live]]
    return out


@pytest.fixture(scope="module")
def rollouts():
    """One rollout per sampler case on the 1-layer digits model, its scores replaced by ``a`` (scale 1) and
    ``b`` (scale 100), drawn independently and spread alike within every normalisation group."""
    from diffusers import SD3Transformer2DModel

    from flowrl.pipelines.digits import DigitsPolicy, DigitTextEncoder, tiny_transformer_config

    torch.manual_seed(0)  # as conftest's tiny_digits_policy, once for the module
    policy = DigitsPolicy(SD3Transformer2DModel(**{**tiny_transformer_config(), "num_layers": 1}).eval(),
                          DigitTextEncoder().eval())
    g = torch.Generator().manual_seed(0)
    out = {}
    for case in SAMPLER_CASES:
        r = _sampler(case)(policy, PROMPTS, None, seed=1)
        draw = (lambda: _tree_spread(r.layout, g)) if r.structure == "branch" else (lambda: _spread(r.group_index, g))
        a, b = draw(), 100 * draw()
        out[case] = dataclasses.replace(r, rewards=a + b, reward_components={A: a, B: b})
    return policy, out


def _batch(loss: str, case: str, policy, rollout, weights: dict, aggregate: str):
    """``update.batch(rollout)`` of a fresh update as ``flowrl train`` would make it for ``case``."""
    recipe = UPDATES.get(loss).digits_recipe or "digits"
    per = rollout.num_samples // len(PROMPTS)
    cfg = load_config(recipe, [f"train.loss={loss}", f"sampler={json.dumps(SAMPLER_CASES[case])}",
                               f"reward.weights={json.dumps(weights)}", f"reward.aggregate={aggregate}",
                               f"train.batch_size={per * len(PROMPTS)}"])  # per_reward: accepted
    ctx = UpdateContext(policy=policy, unwrapped=policy.transformer, device=torch.device("cpu"),
                        autocast=contextlib.nullcontext, reference=contextlib.nullcontext, gather=lambda t: t,
                        train=cfg.train, reward=cfg.reward, sampler_name=case)
    upd = UPDATES.get(loss)(ctx, cfg.train.update_options)
    if getattr(upd.opts, "diversity", False):
        upd._features = lambda images: images.flatten(1)  # GARDO's feature model: the pixels (no classifier)
    b = upd.batch(rollout, 0)
    shares = {k.split("/")[1]: v for k, v in {**b.stats, **b.info}.items() if k.endswith("/adv_share")}
    return b, upd, shares


@pytest.mark.parametrize("loss", ["gardo_grpo", "gardo_nft"])
def test_gardo_sums_the_shares_once(rollouts, loss, monkeypatch):
    """GARDO's shares are those of its diversity-weighted advantages: summed (and, over processes, gathered) once
    per batch, not a second time for the plain advantages it reshapes."""
    from flowrl.updates import rewards as reward_rules

    calls, real = [], reward_rules.share_sums
    monkeypatch.setattr(reward_rules, "share_sums", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    policy, ros = rollouts
    _, _, shares = _batch(loss, "group", policy, ros["group"], BOTH, "per_reward")
    assert len(calls) == 1 and set(shares) == {A, B}


@pytest.mark.parametrize("loss, case", _pairs())
def test_per_reward_for_every_update_and_sampler(rollouts, loss, case):
    policy, ros = rollouts
    ro = ros[case]
    summed, _, sh_sum = _batch(loss, case, policy, ro, BOTH, "sum")
    per, upd, sh_per = _batch(loss, case, policy, ro, BOTH, "per_reward")
    # under sum, b (100x) drives what trains; under per_reward both rewards count about equally
    assert sh_sum[B] > 0.97 and abs(sh_sum[A]) < 0.03, sh_sum
    assert 0.3 < sh_per[A] < 0.7 and 0.3 < sh_per[B] < 0.7, sh_per
    if "adv" not in per.data:  # a ranking (online DPO / GDRO): the z-sum of each reward within the group
        rows = per.data["rows"]  # [G, 2] DPO's best and worst, [G, k] GDRO's group
        z = {k: (lambda r: (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + EPS))(
            v[rows if rows.shape[1] > 2 else _groups(ro)]) for k, v in ro.reward_components.items()}
        value = z[A] + z[B]  # [G, k]
        if rows.shape[1] == 2:  # the best and worst by that value (under sum: by a + b)
            pick = lambda v: _groups(ro).gather(1, torch.stack([v.argmax(1), v.argmin(1)], 1))  # noqa: E731
            assert torch.equal(rows, pick(value)) and torch.equal(summed.data["rows"], pick(ro.rewards[_groups(ro)]))
        else:
            assert torch.allclose(per.data["r"], value, atol=1e-5)
        return
    got = per.data["adv"]  # [M] transitions or [N] samples
    if getattr(upd.opts, "diversity", False):  # GARDO: the z-sum (centred) times a positive diversity weight
        z = {k: group_advantages(v, ro.group_index, clip=None)[0] for k, v in ro.reward_components.items()}
        value = z[A] + z[B]  # [N]
        if "transitions" in per.data:
            value = value[ro.transitions.sample_index]  # [M]
        keep = value.abs() > 1e-3
        assert keep.any() and torch.equal(torch.sign(got)[keep], torch.sign(value)[keep])
        return
    a_alone, _, _ = _batch(loss, case, policy, ro, {A: 1.0, B: 0.0}, "per_reward")
    b_alone, _, _ = _batch(loss, case, policy, ro, {A: 0.0, B: 1.0}, "per_reward")
    ea, eb = a_alone.data["adv"], b_alone.data["adv"]
    clip = upd.opts.adv_clip_max if "transitions" in per.data else None  # (samples: the loss clips)
    want = ea + eb if clip is None else (ea + eb).clamp(-clip, clip)
    assert torch.allclose(got, want, atol=1e-5)  # each reward normalised apart, then weighted and summed
    assert not torch.allclose(summed.data["adv"], want, atol=0.1)


def _groups(ro) -> torch.Tensor:
    from flowrl.updates.preference import grouped

    return grouped(ro)


# ---------------------------------------------------------------- the metrics and the bench
def test_bench_aggregate_trains_both_rules_and_logs_each_reward(tiny_digits_dir, tmp_path, capsys):
    """``flowrl bench aggregate`` on the tiny digits model: both rules from the same base, each reward's
    evaluation mean per curve point, and per iteration the trainer's ``reward/NAME/mean`` and
    ``reward/NAME/adv_share`` (the shares of an iteration add up to 1); the JSON, the PNG and the table."""
    from conftest import tiny_train_overrides
    from flowrl.cli import main

    extra = [o for o in tiny_train_overrides(tiny_digits_dir, **{"data.eval_prompts": "[a handwritten digit 3]"})
             if not o.startswith("reward.")]
    out = tmp_path / "bench"
    assert main(["bench", "aggregate", "--budget", "0.2", "--eval-every", "0.2", "--out", str(out), *extra]) == 0
    res = json.loads((out / "aggregate.json").read_text())
    assert (out / "aggregate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert res["recipe"] == "digits_two_rewards.yaml" and res["rewards"] == [A, B] and res["machine"]["cpu"]
    assert list(res["variants"]) == ["sum", "per_reward"]
    first = {rule: r["curve"][0]["rewards"] for rule, r in res["variants"].items()}
    assert first["sum"] == first["per_reward"] and set(first["sum"]) == {A, B}  # same base, same evaluation
    for rule, r in res["variants"].items():
        assert r["iterations"] >= 1 and len(r["iterations_log"]) == r["iterations"]
        for e in r["iterations_log"]:
            assert {f"reward/{n}/{m}" for n in (A, B) for m in ("mean", "adv_share")} <= set(e)
            assert e[f"reward/{A}/adv_share"] + e[f"reward/{B}/adv_share"] == pytest.approx(1.0, abs=1e-4)
        m = res["movement"][rule]
        for n in (A, B):
            assert m[n]["change"] == pytest.approx(r["curve"][-1]["rewards"][n] - r["curve"][0]["rewards"][n])
    table = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in table if ln.split() and ln.split()[0] in ("sum", "per_reward")] == \
        ["sum", "per_reward"]
