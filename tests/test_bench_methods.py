"""``flowrl bench methods``: every update on the same prompts, seeds and budget in one run; methods whose
update is not registered are skipped with a line, a failing method is a row, nothing written without --out."""
import json

import pytest

import flowrl.bench.methods as bm
from conftest import tiny_train_overrides
from flowrl.cli import main
from flowrl.errors import BenchError
from flowrl.updates import UPDATES, default_needs

POINT_KEYS = {"train_seconds", "iteration", "samples", "eval_reward", "diversity", "hf_energy"}


def test_the_table_names_every_method_of_the_issue_and_each_runs_on_the_sampler_its_update_needs():
    assert [m.name for m in bm.METHODS] == ["grpo", "grpo_guard", "dppo", "nft", "awm", "dgpo", "gardo_grpo",
                                           "dpo", "gdro"]
    runs, skipped = bm.chosen_runs()
    assert {"grpo", "grpo_guard", "nft", "dpo", "gdro"} <= set(runs)
    assert set(runs) | set(skipped) == set(bm.BY_NAME) and not set(runs) & set(skipped)
    for name, var in runs.items():
        cfg = var.config(bm.RECIPE, [])
        needs = default_needs(cfg.train.loss)
        assert cfg.train.loss == bm.BY_NAME[name].loss
        if needs.transitions:  # the GRPO family: the recipe's group sampler with SDE steps
            assert (cfg.sampler.name, cfg.sampler.options["step"]) == ("group", "sde")
        else:  # on finished samples: deterministic ODE samples, the same count per prompt
            assert needs.clean_samples and cfg.sampler.name == "ode"
        assert cfg.sampler.samples_per_prompt == 8 and cfg.train.batch_size == 80 and cfg.train.seed == 0
    assert runs["grpo_guard"].config(bm.RECIPE, []).train.loss_options["clip_range"] == 1e-3  # GRPO's kept
    assert runs["nft"].config(bm.RECIPE, []).train.loss_options == {}  # the update's own defaults


def test_unregistered_and_unfilled_methods_are_skipped_with_a_line(monkeypatch, capsys):
    monkeypatch.delitem(UPDATES, "gdro")  # as awm / dgpo / dppo are where their update has not landed
    runs, skipped = bm.chosen_runs(["grpo", "gdro", "gardo_grpo"])
    assert list(runs) == ["grpo"] and set(skipped) == {"gdro", "gardo_grpo"}
    assert "update 'gdro' is not registered in this build" in skipped["gdro"]
    assert "not filled in yet" in skipped["gardo_grpo"]
    monkeypatch.setattr(bm, "run_variant", lambda *a, **k: _record([(0, 0.5), (10, 0.6)]))
    res = bm.bench_methods(budget_seconds=1, methods=["grpo", "gdro", "gardo_grpo"])
    printed = capsys.readouterr().out
    assert "[bench methods] gdro: skipped: update 'gdro' is not registered" in printed
    assert "[bench methods] gardo_grpo: skipped: GARDO on GRPO" in printed
    assert res["skipped"].keys() == {"gdro", "gardo_grpo"}
    table = bm.report(res)
    assert any(line.startswith("gdro") and "skipped: update 'gdro'" in line for line in table.splitlines())


def test_a_registered_update_runs_its_row(monkeypatch):
    """When an update lands (here awm stands in as DiffusionNFT's class), its row runs on ODE samples."""
    monkeypatch.setitem(UPDATES, "awm", "flowrl.updates.nft:NFTUpdate")
    runs, skipped = bm.chosen_runs(["awm"])
    assert list(runs) == ["awm"] and not skipped
    assert runs["awm"].config(bm.RECIPE, []).sampler.name == "ode"


def test_subset_and_unknown_names(monkeypatch, capsys, tmp_path):
    with pytest.raises(BenchError, match=r"unknown method\(s\) 'nope'; choose from grpo, grpo_guard, dppo"):
        bm.chosen_runs(["grpo", "nope"])
    with pytest.raises(BenchError, match="in --method-override"):
        bm.chosen_runs(method_overrides={"nope": ["train.lr=1"]})
    with pytest.raises(BenchError, match="method nft: .*not_a_key"):  # configs validated before any model loads
        bm.chosen_runs(["nft"], method_overrides={"nft": ["train.not_a_key=1"]})
    assert main(["bench", "methods", "--methods", "grpo,nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("flowrl bench methods: error: unknown method(s) 'nope'; choose from grpo,")
    assert main(["bench", "methods", "--method-override", "nft"]) == 2
    assert "expected METHOD:VALUE" in capsys.readouterr().err
    runs, _ = bm.chosen_runs(["dpo", "nft"], method_overrides={"nft": ["train.lr=3e-4"]},
                             method_recipes={"dpo": "digits_sol_nft"})
    assert list(runs) == ["nft", "dpo"]  # the table's order
    assert runs["nft"].config(bm.RECIPE, []).train.lr == 3e-4
    assert runs["dpo"].config(bm.RECIPE, []).train.loss == "dpo" and runs["dpo"].recipe.endswith("digits_sol_nft.yaml")


def _record(curve, samples=80):
    """A :func:`run_variant` result with the eval rewards of ``curve`` ``[(seconds, reward)]``, one
    iteration of ``samples`` per point."""
    pts = [{"train_seconds": t, "iteration": i, "samples": i * samples, "eval_reward": r, "diversity": 0.2,
            "hf_energy": 0.005} for i, (t, r) in enumerate(curve)]
    return {"sampler": {"name": "group"}, "seconds_per_iteration": 1.0, "iterations": len(pts) - 1,
            "samples_drawn": pts[-1]["samples"], "final_eval_reward": pts[-1]["eval_reward"],
            "real": {"reward": 1.0, "diversity": 0.22, "hf_energy": 0.006}, "curve": pts}


def test_times_to_grpo_final_reward_and_error_rows(monkeypatch, tmp_path):
    """GRPO ends at 0.8 (first reached at 20 s, 160 samples); nft reaches it at 10 s / 80 samples (2x fewer),
    dpo never; gdro fails while training and is a row, the others still run."""
    curves = {"grpo": [(0, 0.5), (10, 0.7), (20, 0.8), (30, 0.8)], "nft": [(0, 0.5), (10, 0.85)],
              "dpo": [(0, 0.5), (10, 0.6)]}

    def fake(recipe, var, *a, **k):
        loss = next(o.split("=")[1] for o in var.overrides if o.startswith("train.loss="))
        if loss == "gdro":
            raise RuntimeError("loss is nan\nat step 3")
        return _record(curves[loss])

    monkeypatch.setattr(bm, "run_variant", fake)
    res = bm.bench_methods(budget_seconds=30, methods=["grpo", "nft", "dpo", "gdro"], out_dir=str(tmp_path))
    saved = json.loads((tmp_path / "methods.json").read_text())
    assert (tmp_path / "methods.png").stat().st_size > 0
    assert saved["failed"] == {"gdro": "RuntimeError: loss is nan at step 3"} and list(saved["variants"]) == [
        "grpo", "nft", "dpo"]
    assert saved["baseline_final_above_base"] is True
    got = {k: (v["seconds_to_baseline_final_reward"], v["samples_to_baseline_final_reward"], v["speedup_samples"])
           for k, v in saved["variants"].items()}
    assert got == {"grpo": (20, 160, 1.0), "nft": (10, 80, 2.0), "dpo": (None, None, None)}
    assert saved["real"] == {"reward": 1.0, "diversity": 0.22, "hf_energy": 0.006}
    table = bm.report(res).splitlines()
    assert table[0].split()[:3] == ["method", "sampler", "s/iter"]
    nft = next(ln for ln in table if ln.startswith("nft")).split()
    assert nft[-3:] == ["10.0", "80", "2.00"]
    assert next(ln for ln in table if ln.startswith("dpo")).split()[-3:] == ["-", "-", "-"]
    assert any(ln.startswith("gdro") and "FAILED: RuntimeError: loss is nan" in ln for ln in table)
    assert any(ln.startswith("real data") for ln in table)


def test_no_time_to_a_grpo_reward_the_base_already_reaches(monkeypatch):
    monkeypatch.setattr(bm, "run_variant", lambda *a, **k: _record([(0, 0.7), (10, 0.6)]))
    res = bm.bench_methods(budget_seconds=10, methods=["grpo", "nft"])
    assert res["baseline_final_above_base"] is False
    assert all(v["seconds_to_baseline_final_reward"] is None for v in res["variants"].values())
    assert "n/a (0.6000 is not above the base model's 0.7000: the base already reaches it" in bm.report(res)
    res = bm.bench_methods(budget_seconds=10, methods=["nft"])
    assert "baseline_final_above_base" not in res and "grpo was not among the methods run" in bm.report(res)


def test_bench_methods_trains_each_method_from_the_same_base(tiny_digits_dir, tmp_path, monkeypatch):
    """Tiny budget on a tiny digits model: the JSON's schema; every method starts at the same evaluation; the
    samples drawn are the rollouts' sample counts; nothing is written without --out."""
    extra = tiny_train_overrides(tiny_digits_dir, **{"data.eval_prompts": "[a handwritten digit 3]"})
    monkeypatch.chdir(tmp_path)
    res = bm.bench_methods(budget_seconds=0.3, eval_every_seconds=0.3, methods=["grpo", "dpo"], extra=extra)
    assert list(tmp_path.iterdir()) == []  # no --out: nothing written
    assert set(res) >= {"pipeline", "recipe", "budget_seconds", "eval_every_seconds", "baseline", "variants",
                        "skipped", "failed", "real", "machine"}
    grpo, dpo = res["variants"]["grpo"], res["variants"]["dpo"]
    assert (grpo["sampler"]["name"], dpo["sampler"]["name"]) == ("group", "ode")
    assert grpo["curve"][0]["eval_reward"] == dpo["curve"][0]["eval_reward"]  # same base, same evaluation set
    for r in (grpo, dpo):
        assert all(set(p) == POINT_KEYS for p in r["curve"]) and r["iterations"] >= 1
        assert r["samples_drawn"] == r["iterations"] * 16 == r["curve"][-1]["samples"]
        assert r["train_seconds"] >= 0.3
    assert set(res["real"]) >= {"reward", "diversity", "hf_energy"}
    out = tmp_path / "bench"
    assert main(["bench", "methods", "--methods", "grpo", "--budget", "0.2", "--eval-every", "0.2",
                 "--out", str(out), *extra]) == 0
    saved = json.loads((out / "methods.json").read_text())
    assert list(saved["variants"]) == ["grpo"] and (out / "methods.png").is_file()
