"""``flowrl bench {branch,tempflow,sol}``: every variant trains from the same base in one call, and
the report says when each reached flat GRPO's final eval reward."""
import json

import pytest

from conftest import tiny_train_overrides
from flowrl.bench.samplers import KINDS, bench_sampler, report
from flowrl.bench.training import time_to_reach


def test_time_to_reach():
    curve = [{"train_seconds": 0.0, "eval_reward": 0.5}, {"train_seconds": 10.0, "eval_reward": 0.7},
             {"train_seconds": 20.0, "eval_reward": 0.6}]
    assert time_to_reach(curve, 0.7) == 10.0 and time_to_reach(curve, 0.5) == 0.0
    assert time_to_reach(curve, 0.71) is None


def test_bench_sol_smoke(tiny_digits_dir, tmp_path):
    extra = [o for o in tiny_train_overrides(tiny_digits_dir, **{"data.eval_prompts": "[a handwritten digit 3]"})
             if not o.startswith(("sampler.", "train.batch_size"))]
    out = bench_sampler("sol", budget_seconds=0.5, eval_every_seconds=0.25, out_dir=str(tmp_path),
                        variants=["flat_grpo", "sol_full_precision_explore_keep4"],
                        extra=extra)
    saved = json.loads((tmp_path / "sol.json").read_text())
    assert set(saved["variants"]) == {"flat_grpo", "sol_full_precision_explore_keep4"}
    flat, sol = saved["variants"]["flat_grpo"], saved["variants"]["sol_full_precision_explore_keep4"]
    assert flat["curve"][0]["eval_reward"] == sol["curve"][0]["eval_reward"]  # same base, same evaluation set
    # the first curve point at or above flat GRPO's final eval reward, found here without time_to_reach;
    # flat GRPO reaches its own final reward (at its last point at the latest), so its value is never None
    # (n/a when that reward is not above the base model's: a random tiny model may end below its start)
    target = flat["final_eval_reward"]
    assert saved["flat_final_above_base"] == (target > flat["curve"][0]["eval_reward"])
    for r in (flat, sol):
        reached = [p["train_seconds"] for p in r["curve"] if p["eval_reward"] >= target]
        assert r["seconds_to_flat_final_reward"] == (reached[0] if reached and saved["flat_final_above_base"] else None)
    if saved["flat_final_above_base"]:
        assert flat["seconds_to_flat_final_reward"] is not None
        assert flat["seconds_to_flat_final_reward"] <= flat["curve"][-1]["train_seconds"] <= flat["train_seconds"]
    assert sol["samples_per_iteration"] == 40 and flat["samples_per_iteration"] == 80
    assert (tmp_path / "sol.png").exists() and out["variants"].keys() == saved["variants"].keys()
    assert ("reaches flat GRPO's final eval reward" if saved["flat_final_above_base"] else "n/a") in report(out)


def test_bench_report_times_each_variant_to_flat_final_reward(tmp_path, monkeypatch):
    """The report's ``seconds_to_flat_final_reward`` on fixed curves (the training runs replaced):
    flat GRPO ends at 0.8; the Sol variant first reaches 0.8 at 30 s, the other variant never."""
    import flowrl.bench.samplers as samplers

    def record(curve, samples):
        return {"curve": [{"train_seconds": t, "eval_reward": r} for t, r in curve], "final_eval_reward": curve[-1][1],
                "rollout_seconds_per_iteration": 1.0, "model_evals_per_iteration": 10.0,
                "samples_per_iteration": samples, "train_seconds": curve[-1][0] + 5, "seconds_per_iteration": 2.0,
                "iterations": 3}

    fake = {"variants": {"flat_grpo": record([(0, 0.5), (10, 0.9), (20, 0.8)], 80),
                         "sol_full_precision_explore_keep4": record([(0, 0.5), (15, 0.7), (30, 0.85), (45, 0.8)], 40),
                         "sol_nft_int8": record([(0, 0.5), (25, 0.79)], 40)}}
    monkeypatch.setattr(samplers, "compare", lambda *a, **k: fake)
    out = bench_sampler("sol", out_dir=str(tmp_path))
    times = {k: v["seconds_to_flat_final_reward"] for k, v in out["variants"].items()}
    assert times == {"flat_grpo": 10, "sol_full_precision_explore_keep4": 30, "sol_nft_int8": None}
    saved = json.loads((tmp_path / "sol.json").read_text())
    assert {k: v["seconds_to_flat_final_reward"] for k, v in saved["variants"].items()} == times
    printed = samplers.report(out)
    assert "sol_nft_int8         reaches flat GRPO's final eval reward 0.8000 at never" in printed
    assert "at 30.0 training s" in printed


def test_bench_target_below_the_base_is_not_reached_at_zero_seconds(tmp_path, monkeypatch):
    """Flat GRPO ending below the base model's reward (0.6 < 0.7): no variant "reaches" it at 0.0 s; the
    report says n/a and why."""
    import flowrl.bench.samplers as samplers

    def record(curve):
        return {"curve": [{"train_seconds": t, "eval_reward": r} for t, r in curve], "final_eval_reward": curve[-1][1],
                "rollout_seconds_per_iteration": 1.0, "model_evals_per_iteration": 10.0, "samples_per_iteration": 8,
                "train_seconds": 25, "seconds_per_iteration": 2.0, "iterations": 3}

    fake = {"variants": {"flat_grpo": record([(0, 0.7), (10, 0.65), (20, 0.6)]),
                         "online_dpo": record([(0, 0.7), (10, 0.9)])}}
    monkeypatch.setattr(samplers, "compare", lambda *a, **k: fake)
    out = bench_sampler("preference", out_dir=str(tmp_path))
    assert out["flat_final_above_base"] is False
    assert all(v["seconds_to_flat_final_reward"] is None for v in out["variants"].values())
    printed = samplers.report(out)
    assert "at 0.0" not in printed and "n/a (0.6000 is not above the base model's 0.7000" in printed


def test_bench_rejects_unknown_variant_and_pipeline(tmp_path):
    with pytest.raises(ValueError, match="choose from"):
        bench_sampler("sol", out_dir=str(tmp_path), variants=["nope"])
    with pytest.raises(ValueError, match="digits pipeline only"):
        bench_sampler("branch", pipeline="sd3", out_dir=str(tmp_path))
    assert set(KINDS) == {"branch", "tempflow", "sol", "preference"}
