"""``flowrl bench methods --seeds N``: the interval math on known curves (step functions on the seeds' union
grid, the seed-mean crossing of GRPO's seed-mean final reward, its bootstrap over seeds), the seed loop, the
table and picture with intervals, and one tiny run of two methods on two seeds."""
import json
import math
from pathlib import Path

import numpy as np
import pytest

import flowrl.bench.methods as bm
from conftest import tiny_train_overrides
from flowrl.bench.methods_report import markdown, report
from flowrl.bench.seeds import (bootstrap_times, first_reach, mean_intervals, on_grid, outward_interval,
                                times_to_baseline)
from flowrl.bench.training import time_to_reach
from flowrl.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def _curve(points, per_iteration=80):
    """Evaluation points ``[(seconds, reward)]``, one iteration of ``per_iteration`` samples per point."""
    return [{"train_seconds": t, "samples": i * per_iteration, "iteration": i, "eval_reward": r, "diversity": 0.2,
             "hf_energy": 0.005} for i, (t, r) in enumerate(points)]


def _grids(seeds_of):
    """``{method: [curve per seed]}`` -> :func:`times_to_baseline`'s input."""
    out = {}
    for name, curves in seeds_of.items():
        out[name] = {}
        for axis in ("train_seconds", "samples"):
            grid, v = on_grid(curves, axis, ["eval_reward"])
            out[name][axis] = (grid, v["eval_reward"])
    return out


def test_seeds_are_step_functions_on_their_union_grid():
    a, b = _curve([(0, 0.5), (10, 0.75), (20, 1.0)]), _curve([(0, 0.5), (15, 0.25)])
    grid, v = on_grid([a, b], "train_seconds", ["eval_reward", "hf_energy"])
    assert grid.tolist() == [0, 10, 15, 20]
    assert v["eval_reward"].tolist() == [[0.5, 0.75, 0.75, 1.0], [0.5, 0.5, 0.25, 0.25]]  # held after its end too
    assert v["hf_energy"].shape == (2, 4)
    grid, v = on_grid([a, b], "samples", ["eval_reward"])
    assert grid.tolist() == [0, 80, 160] and v["eval_reward"].tolist() == [[0.5, 0.75, 1.0], [0.5, 0.25, 0.25]]
    with pytest.raises(ValueError, match="must share their first point"):
        on_grid([a, _curve([(5, 0.5)])], "train_seconds", ["eval_reward"])


def test_mean_intervals_are_the_eval_harness_bootstrap_over_seeds():
    iv = mean_intervals(np.array([[0.5, 0.0, 2.0], [0.5, 1.0, 2.0]]))
    assert [(i.mean, i.n) for i in iv] == [(0.5, 2), (0.5, 2), (2.0, 2)]
    assert (iv[0].lo, iv[0].hi) == (0.5, 0.5)  # seeds that agree: no spread
    assert (iv[1].lo, iv[1].hi) == (0.0, 1.0)  # 1000 resamples of two seeds: both all-0 and all-1 occur (p 1/4)
    wide, narrow = mean_intervals(np.array([[0.0], [1.0], [2.0], [3.0]]))[0], mean_intervals(
        np.array([[1.4], [1.5], [1.5], [1.6]]))[0]
    assert wide.lo < 1.5 < wide.hi and narrow.hi - narrow.lo < (wide.hi - wide.lo) / 5


def test_one_seed_reaches_as_a_single_run_does():
    """With one seed the crossing is the first evaluation at or above the target (today's ``time_to_reach``)."""
    curve = _curve([(0, 0.5), (7, 0.6), (13, 0.9), (21, 0.8)])
    grid, v = on_grid([curve], "train_seconds", ["eval_reward"])
    for target in (0.55, 0.6, 0.85, 0.95):
        got = first_reach(grid, v["eval_reward"].mean(axis=0), target)
        want = time_to_reach(curve, target)
        assert (got if math.isfinite(got) else None) == want


# GRPO: seeds end at 1.0 and 0.5 -> target 0.75, its mean curve [0.5, 0.625, 0.75] first reaches it at 20 s / 160
# samples; nft: mean 0.75 at 5 s / 80 samples (4x less time, 2x fewer samples); dpo never; exact binary fractions
CURVES = {"grpo": [_curve([(0, 0.5), (10, 0.75), (20, 1.0)]), _curve([(0, 0.5), (10, 0.5), (20, 0.5)])],
          "nft": [_curve([(0, 0.5), (5, 1.0)]), _curve([(0, 0.5), (5, 0.5)])],
          "dpo": [_curve([(0, 0.5), (10, 0.625)]), _curve([(0, 0.5), (10, 0.5)])]}


def test_times_to_grpo_seed_mean_final_reward():
    got = times_to_baseline(_grids(CURVES), "grpo")
    assert got["grpo"] == {"train_seconds": 20, "samples": 160, "speedup_train_seconds": 1.0, "speedup_samples": 1.0}
    assert got["nft"] == {"train_seconds": 5, "samples": 80, "speedup_train_seconds": 4.0, "speedup_samples": 2.0}
    assert got["dpo"]["train_seconds"] == math.inf and got["dpo"]["speedup_samples"] == 0.0
    picks = {"grpo": np.array([0, 0]), "nft": np.array([1, 1]), "dpo": np.array([0, 1])}  # a resample
    got = times_to_baseline(_grids(CURVES), "grpo", picks)  # target 1.0: GRPO at 20 s, nft's seed 1 never
    assert got["grpo"]["train_seconds"] == 20 and got["nft"]["train_seconds"] == math.inf
    flat = {"grpo": [_curve([(0, 0.5), (10, 0.25)])], "nft": [_curve([(0, 0.5), (5, 1.0)])]}
    assert times_to_baseline(_grids(flat), "grpo") is None  # GRPO ends no higher than the base: no target


def test_outward_interval_keeps_never_as_infinity():
    assert outward_interval([1.0] * 90 + [math.inf] * 10) == (1.0, math.inf)
    assert outward_interval([1.0] * 99 + [math.inf] * 1) == (1.0, 1.0)  # under 2.5% of the resamples
    assert outward_interval([float("nan"), 2.0, 3.0], level=0.0) == (2.0, 3.0)  # NaN left out, no interpolation
    assert all(math.isnan(v) for v in outward_interval([float("nan")]))


def test_bootstrap_times_over_seeds():
    got = bootstrap_times(_grids(CURVES), "grpo", n_boot=400)
    assert (got["grpo"]["train_seconds"].mean, got["nft"]["samples"].mean) == (20, 80)  # the point estimates
    assert got["nft"]["train_seconds"].n == 2
    nft = got["nft"]["train_seconds"]
    assert nft.lo == 5 and nft.hi == math.inf  # nft's seed 1 alone never reaches a target above 0.5
    same = {name: [c[0], c[0]] for name, c in CURVES.items()}  # two identical seeds: no spread anywhere
    for r in bootstrap_times(_grids(same), "grpo", n_boot=50).values():
        assert all(iv.lo == iv.hi == iv.mean or math.isnan(iv.mean) for iv in r.values())


def _fake_run(curves_by_loss_and_seed):
    def fake(recipe, var, *a, **k):
        loss = next(o.split("=")[1] for o in var.overrides if o.startswith("train.loss="))
        seed = int(next(o.split("=")[1] for o in reversed(var.overrides) if o.startswith("train.seed=")))
        pts = curves_by_loss_and_seed[loss][seed]
        return {"recipe": "digits.yaml", "sampler": {"name": "group"}, "loss": loss, "seconds_per_iteration": 1.0,
                "iterations": len(pts) - 1, "samples_drawn": pts[-1]["samples"],
                "final_eval_reward": pts[-1]["eval_reward"], "train_seconds": pts[-1]["train_seconds"],
                "real": {"reward": 1.0, "diversity": 0.22, "hf_energy": 0.006}, "curve": pts}
    return fake


def test_seeded_bench_keeps_every_seed_and_reports_intervals(monkeypatch, tmp_path):
    """Seed by seed, every method on train.seed 0 and 1; the JSON keeps every run, the rows are seed means
    with intervals, the table prints them and the picture is written."""
    order = []
    fake = _fake_run(CURVES)
    monkeypatch.setattr(bm, "run_variant", lambda r, var, *a, **k: order.append(var.overrides[-1]) or fake(r, var))
    res = bm.bench_methods(budget_seconds=20, methods=["grpo", "nft", "dpo"], out_dir=str(tmp_path), seeds=2,
                           progress=False)
    assert order == ["train.seed=0"] * 3 + ["train.seed=1"] * 3
    saved = json.loads((tmp_path / "methods.json").read_text())
    assert (tmp_path / "methods.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert saved["train_seeds"] == [0, 1] and saved["baseline_final_above_base"] is True
    nft = saved["variants"]["nft"]
    assert [r["train_seed"] for r in nft["runs"]] == [0, 1]
    assert [r["curve"] for r in nft["runs"]] == CURVES["nft"]  # every seed's raw curve
    assert nft["final_eval_reward"] == 0.75 and nft["final"]["eval_reward"] == [0.75, 0.5, 1.0]
    assert [p["eval_reward"] for p in nft["mean_curves"]["samples"]] == [0.5, 0.75]
    assert (nft["seconds_to_baseline_final_reward"], nft["samples_to_baseline_final_reward"]) == (5, 80)
    assert nft["seconds_to_baseline_final_reward_interval"] == [5, None] and nft["speedup_samples"] == 2.0
    assert saved["variants"]["dpo"]["samples_to_baseline_final_reward"] is None
    table = report(res).splitlines()
    assert "final reward" in table[0] and "x fewer samples" in table[0]
    row = next(ln for ln in table if ln.startswith("nft"))
    assert "0.7500 [0.5000, 1.0000]" in row and "5.0 [5.0, -]" in row and row.rstrip().endswith("]")
    assert next(ln for ln in table if ln.startswith("dpo")).split()[-9:] == [  # never: '-', in every resample too
        "-", "[-,", "-]", "-", "[-,", "-]", "-", "[0.00,", "0.00]"]
    assert any(ln.startswith("real data") for ln in table)
    assert table[-1].startswith("mean over 2 training seeds (train.seed 0, 1) [95% bootstrap interval")
    assert table[-1].endswith(f"measured on {saved['machine']['cpu']}, {saved['machine']['cpus']} cores")
    md = markdown(res).splitlines()
    assert md[0].startswith("| method | recipe |") and len(md) == 2 + 3 + 1  # head, rule, 3 methods, real data
    assert md[3] == ("| nft | digits.yaml | group | 1.00 | 80 | 0.750 [0.500, 1.000] | 0.200 [0.200, 0.200] | "
                     "0.0050 [0.0050, 0.0050] | 5.0 [5.0, -] | 80 [80, -] | 2.00 [0.00, 2.00] |")


def test_a_method_failing_on_a_later_seed_is_a_failed_row(monkeypatch):
    fake = _fake_run(CURVES)

    def flaky(recipe, var, *a, **k):
        if "train.loss=dpo" in var.overrides and var.overrides[-1] == "train.seed=1":
            raise RuntimeError("loss is nan")
        return fake(recipe, var)

    monkeypatch.setattr(bm, "run_variant", flaky)
    res = bm.bench_methods(budget_seconds=20, methods=["grpo", "dpo"], seeds=2, progress=False)
    assert list(res["variants"]) == ["grpo"] and res["failed"] == {"dpo": "train.seed 1: RuntimeError: loss is nan"}
    assert "FAILED: train.seed 1: RuntimeError" in report(res)


def test_seeds_from_the_command_line_on_a_tiny_model(tiny_digits_dir, tmp_path, capsys):
    """Two methods on two seeds for one iteration each: the same base evaluation in every run, the seed's
    ``train.seed`` in each, the seeded table printed."""
    extra = tiny_train_overrides(tiny_digits_dir, **{"data.eval_prompts": "[a handwritten digit 3]"})
    out = tmp_path / "bench"
    assert main(["bench", "methods", "--methods", "grpo,nft", "--seeds", "2", "--budget", "0.1", "--eval-every",
                 "0.1", "--out", str(out), "--markdown", *extra]) == 0
    res = json.loads((out / "methods.json").read_text())
    assert res["train_seeds"] == [0, 1] and not res["failed"]
    runs = [run for r in res["variants"].values() for run in r["runs"]]
    assert len(runs) == 4 and len({run["curve"][0]["eval_reward"] for run in runs}) == 1  # same base, same eval
    for r in res["variants"].values():
        assert [run["train_seed"] for run in r["runs"]] == [0, 1]
        assert r["samples_drawn"] == np.mean([run["samples_drawn"] for run in r["runs"]])
    printed = capsys.readouterr()
    assert "seed 1 (2/2), 2/2 nft" in printed.err
    assert printed.out.splitlines()[2].startswith("| grpo | digits.yaml | group |")  # --markdown: the README's table


def test_one_seed_markdown_is_the_readme_table_before_seeds():
    """The shipped single-seed result (docs/bench_methods_one_seed.json, the README's table before --seeds) in
    markdown: the README's columns and values."""
    res = json.loads((Path(__file__).resolve().parents[1] / "docs" / "bench_methods_one_seed.json").read_text())
    md = markdown(res).splitlines()
    assert md[0] == ("| method | recipe | sampler | s/iter | samples | final reward | diversity | HF energy | "
                     "to GRPO's final: s | samples | x fewer samples |")
    assert "| grpo | digits.yaml | group | 7.40 | 720 | 0.938 | 0.180 | 0.0044 | 66.6 | 720 | 1.00 |" in md
    assert "| awm | digits_awm.yaml | ode | 5.03 | 960 | 0.963 | 0.145 | 0.0058 | 15.2 | 240 | 3.00 |" in md
    assert "| dppo | digits_dppo.yaml | group | 7.36 | 720 | 0.918 | 0.184 | 0.0046 | - | - | - |" in md


@pytest.mark.parametrize("name", ["bench_methods.json", "bench_methods_trainers.json", "bench_shapes_methods.json"])
def test_the_readme_tables_are_the_shipped_results(name):
    """Every row of the README's seeded methods tables is the markdown of the JSON it links (the method's display
    name aside): no number typed by hand."""
    root = Path(__file__).resolve().parents[1]
    res = json.loads((root / "docs" / name).read_text())
    readme = {ln.split(" | ", 1)[1] for ln in (root / "README.md").read_text().splitlines() if ln.startswith("| ")
              and " | " in ln}
    tables = 2 if res.get("tags") else 1  # the methods table, and the per-tag one when the evaluation had tags
    rows = [ln.split(" | ", 1)[1] for ln in markdown(res).splitlines() if ln.startswith("| ") and
            not ln.startswith(("| method |", "|---"))]
    assert len(res["train_seeds"]) == 3 and len(rows) == tables * (len(res["variants"]) + 1)  # + the real data
    missing = [r for r in rows if r not in readme]
    assert not missing, missing
    if res.get("headline"):  # a world ranked by a held-out reward: the trained reward's line too
        trained = next(ln for ln in markdown(res).splitlines() if ln.startswith("final trained reward: "))
        assert trained.removeprefix("final trained reward: ") in (root / "README.md").read_text().replace("\n", " ")
