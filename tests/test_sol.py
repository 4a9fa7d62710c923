"""Sol-RL sampler (flowrl.rollout.sol): selection, exact full-precision regeneration, re-sync, training."""
import json

import pytest
import torch
import yaml

from flowrl.rollout.group import GroupSampler
from flowrl.rollout.sol import SolSampler, select_indices
from flowrl.seeding import derive_seeds
from flowrl.structures import SolStructure

PROMPTS = ["a handwritten digit 3", "a handwritten digit 7"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


class BrightnessReward:
    """Mean image brightness: cheap, deterministic, no classifier to train."""

    name = "brightness"

    def __call__(self, images, prompts, **meta):
        return images.float().mean(dim=(1, 2, 3))


def _sol(**kw):
    opts = dict(explore_backend="none", pool_size=8, keep=4, preview_steps=3, regen="group",
                regen_options={"num_steps": 4})
    opts.update(kw)
    return SolSampler(**opts)


# ------------------------------------------------------------------ selection
def test_select_modes():
    r = torch.tensor([0.5, 0.95, 0.1, 0.7, 0.3, float("nan"), 0.8, 0.2])
    assert select_indices(r, 4, "best_worst").tolist() == [1, 2, 5, 6]  # top 0.95, 0.8; bottom NaN, 0.1
    assert select_indices(r, 3, "best_worst").tolist() == [1, 2, 5]  # 1 best + 2 worst (Sol-RL's split)
    assert select_indices(r, 2, "mean_deviation").tolist() == [1, 5]  # NaN first, then |0.95 - 0.507|
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    a, b = select_indices(r, 5, "random", g()), select_indices(r, 5, "random", g())
    assert torch.equal(a, b) and len(set(a.tolist())) == 5
    e = select_indices(r, 4, "extremes_random", g()).tolist()
    assert 1 in e and 5 in e and len(set(e)) == 4
    with pytest.raises(ValueError, match="keep must be in"):
        select_indices(r, 9, "best_worst")
    with pytest.raises(ValueError, match="unknown select mode"):
        select_indices(r, 2, "top")


def test_validation_names_the_fix():
    with pytest.raises(ValueError, match="exceeds pool_size"):
        _sol(keep=16)
    with pytest.raises(ValueError, match="keep must be an integer >= 2"):
        _sol(keep=1)
    with pytest.raises(ValueError, match="regen must be one of 'ode', 'group'"):
        _sol(regen="branch")
    with pytest.raises(ValueError, match="must equal keep"):
        _sol(regen_options={"group_size": 8})
    with pytest.raises(ValueError, match="select must be one of"):
        _sol(select="best")
    with pytest.raises(ValueError, match="unknown quantization backend 'int4'"):
        _sol(explore_backend="int4")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="work on this machine: .*int8-dynamic"):
            _sol(explore_backend="nvfp4").check_available()  # constructing it is fine: recipes load anywhere
    s = _sol(explore_backend="int8-dynamic:activation=per_tensor")
    assert s.quantizer.activation == "per_tensor" and s.samples_per_prompt == 4 and s.num_steps == 4


# ------------------------------------------------------------------ exact regeneration
@pytest.mark.parametrize("backend", ["none", "int8-dynamic"])
def test_regenerated_samples_equal_full_precision_rollout(tiny_digits_policy, backend):
    """Regeneration runs the full-precision policy on exactly the selected seeds: the same tensors
    as a plain group rollout of those seeds (whatever explored them)."""
    pol, reward = tiny_digits_policy, BrightnessReward()
    sol = _sol(explore_backend=backend)
    out = sol(pol, PROMPTS, reward, seed=11)
    pool = derive_seeds(11, 2 * 8)
    chosen = out.layout.selected
    assert out.structure == "group" and isinstance(out.layout, SolStructure)
    assert out.seeds.tolist() == [pool[i] for i in chosen.tolist()]
    assert all(i // 8 == p for i, p in zip(chosen.tolist(), out.prompt_index.tolist()))  # within its prompt
    ref = GroupSampler(group_size=4, num_steps=4)(pol, PROMPTS, reward, seeds=out.seeds.tolist())
    for f in ("x0", "images", "rewards", "prompt_index", "group_index"):
        assert torch.equal(getattr(out, f), getattr(ref, f)), f
    for f in ("latents", "next_latents", "old_log_prob", "sigma", "step"):
        assert torch.equal(getattr(out.transitions, f), getattr(ref.transitions, f)), f
    assert out.step_type == "sde" and len(out.transitions) == 2 * 4 * 4


def test_ode_regen_with_none_backend_reproduces_exploration(tiny_digits_policy):
    pol, reward = tiny_digits_policy, BrightnessReward()
    sol = _sol(regen="ode", regen_options={"num_steps": 3}, audit_every=1)
    out = sol(pol, PROMPTS, reward, seed=2)
    r_explore = out.layout.explore_rewards[out.layout.selected]
    # same policy, same ODE, same seeds; only the batch size differs (16 explored, 8 regenerated),
    # which changes fp32 GEMM blocking in the last bits
    assert torch.allclose(out.rewards, r_explore, atol=1e-5, rtol=0)
    st = out.stats
    assert st["sol/kendall_tau"] == 1.0 and st["sol/spearman"] == 1.0 and st["sol/topk_hit_rate"] == 1.0
    assert st["sol/audit_kendall_tau"] == 1.0
    assert len(out.transitions) == 0 and out.step_type == "ode" and out.x0.shape == (8, 1, 16, 16)
    # best_worst: the 2 best and 2 worst exploration rewards of each prompt's pool
    for p in range(2):
        pool_r = out.layout.explore_rewards[p * 8:(p + 1) * 8]
        kept = r_explore[p * 4:(p + 1) * 4]
        order = pool_r.sort(descending=True).values
        assert sorted(kept.tolist()) == sorted(order[:2].tolist() + order[-2:].tolist())


# ------------------------------------------------------------------ re-sync after updates
def test_exploration_copy_follows_updates(tiny_digits_policy):
    from flowrl.trainable import add_lora

    pol, reward = tiny_digits_policy, BrightnessReward()
    add_lora(pol.transformer, 4, 8)
    sol = _sol(explore_backend="nvfp4-emulated:engine=torch", regen="ode", regen_options={"num_steps": 3})
    first = sol(pol, PROMPTS, reward, seed=1)
    assert first.stats["sol/syncs"] == 1 and first.stats["sol/sync_seconds"] > 0
    again = sol(pol, PROMPTS, reward, seed=1)
    assert again.stats["sol/syncs"] == 1 and again.stats["sol/sync_seconds"] == 0.0
    assert torch.equal(again.layout.explore_rewards, first.layout.explore_rewards)
    params = [p for p in pol.transformer.parameters() if p.requires_grad]
    with torch.no_grad():
        for p in params:
            if p.ndim == 2 and p.shape[0] < p.shape[1]:
                continue  # lora_A: keep
            p.normal_(0, 0.5)  # lora_B: a large "update"
    after = sol(pol, PROMPTS, reward, seed=1)
    assert after.stats["sol/syncs"] == 2 and after.stats["sol/sync_seconds"] > 0
    assert not torch.equal(after.layout.explore_rewards, first.layout.explore_rewards)
    # the quantized copy holds no LoRA and shares no tensor with the trained model
    copy = sol.exploration_copy.module
    assert not any("lora" in n for n, _ in copy.named_parameters())
    ptrs = {t.data_ptr() for t in pol.transformer.parameters()}
    assert not any(t.data_ptr() in ptrs for t in list(copy.parameters()) + list(copy.buffers()))


def test_seeds_override_and_errors(tiny_digits_policy):
    sol = _sol(regen="ode", regen_options={"num_steps": 2}, preview_steps=2)
    pool = list(range(100, 116))
    out = sol(tiny_digits_policy, PROMPTS, BrightnessReward(), seeds=pool)
    assert set(out.seeds.tolist()) <= set(pool)
    with pytest.raises(ValueError, match="pass len\\(prompts\\) \\* pool_size"):
        sol(tiny_digits_policy, PROMPTS, BrightnessReward(), seeds=pool[:5])
    with pytest.raises(ValueError, match="prompts is empty"):
        sol(tiny_digits_policy, [], BrightnessReward())


# ------------------------------------------------------------------ through the trainer
def test_sol_sampler_trains_through_the_online_trainer(tiny_digits_dir, tmp_path):
    from conftest import tiny_train_overrides
    from flowrl.trainers.config import load_config
    from flowrl.trainers.online import train

    recipe = yaml.safe_load(open("recipes/digits.yaml"))
    recipe["sampler"] = {"name": "sol", "explore_backend": "int8-dynamic", "pool_size": 6, "keep": 4,
                         "preview_steps": 2, "regen": "group", "regen_options": {"num_steps": 3}}
    path = tmp_path / "sol.yaml"
    path.write_text(yaml.safe_dump(recipe))
    ov = [o for o in tiny_train_overrides(tiny_digits_dir, **{"train.lr": 1e-2, "train.iterations": 2,
                                                              "train.batch_size": 8})
          if not o.startswith("sampler.")]
    cfg = load_config(path, ov)
    assert cfg.prompts_per_iteration == 2
    run = tmp_path / "run"
    train(cfg, run)
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if "reward_mean" in l]
    assert len(recs) == 2 and all(r["transitions_trained"] > 0 for r in recs)


def test_gpu_recipe_loads_on_cpu_but_refuses_to_run(tiny_digits_dir, tmp_path):
    import torch

    from flowrl.trainers.config import load_config
    from flowrl.errors import ConfigError
    from flowrl.trainers.online import OnlineTrainer

    for recipe in ("flux_sol_nvfp4", "sd35l_sol_nvfp4", "sd3_sol_nvfp4"):  # the paper's pool 96, 6 steps, 12+12
        cfg = load_config(f"recipes/{recipe}.yaml")
        o = cfg.sampler.options
        assert (o["explore_backend"], o["pool_size"], o["preview_steps"], o["keep"]) == ("nvfp4", 96, 6, 24), recipe
        assert cfg.train.loss == "nft" and cfg.prompts_per_iteration == 2, recipe
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: nvfp4 may run here")
    cfg = load_config("recipes/digits_sol.yaml", [f"model.path={tiny_digits_dir}", "sampler.explore_backend=nvfp4",
                                                  "logging.trackers=[]"])
    with pytest.raises(ConfigError, match="Backends that work on this machine: .*int8-dynamic"):
        OnlineTrainer(cfg, tmp_path / "run").setup()
    assert not (tmp_path / "run" / "config.yaml").exists()
