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
    assert flat["seconds_to_flat_final_reward"] <= flat["train_seconds"]
    t = sol["seconds_to_flat_final_reward"]
    assert t is None or t == time_to_reach(sol["curve"], flat["final_eval_reward"])
    assert sol["samples_per_iteration"] == 40 and flat["samples_per_iteration"] == 80
    assert (tmp_path / "sol.png").exists() and out["variants"].keys() == saved["variants"].keys()
    assert "reaches flat GRPO's final eval reward" in report(out)


def test_bench_rejects_unknown_variant_and_pipeline(tmp_path):
    with pytest.raises(ValueError, match="choose from"):
        bench_sampler("sol", out_dir=str(tmp_path), variants=["nope"])
    with pytest.raises(ValueError, match="digits pipeline only"):
        bench_sampler("branch", pipeline="sd3", out_dir=str(tmp_path))
    assert set(KINDS) == {"branch", "tempflow", "sol", "preference"}
