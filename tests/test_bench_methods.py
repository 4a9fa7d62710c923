"""``flowrl bench methods``: every update on the same prompts, seeds and budget in one run; a method is a
declaration (its update, its digits recipe when shipped, else overrides on digits.yaml); one whose update is
not registered is a line, a failing method is a row, nothing is written without --out."""
import json

import pytest

import flowrl.bench.methods as bm
from conftest import tiny_train_overrides
from helpers import write_recipe
from flowrl.bench.methods_report import report
from flowrl.cli import main
from flowrl.errors import BenchError
from flowrl.trainers.config_text import read_recipe
from flowrl.updates import UPDATES, default_needs

POINT_KEYS = {"train_seconds", "iteration", "samples", "eval_reward", "diversity", "hf_energy"}


def test_the_table_is_every_registered_update_and_each_runs_on_the_sampler_its_update_needs():
    """A row per registered update, from its declaration alone (summary, digits recipe): nothing in the bench
    names an update; an update on a dataset runs on its recipe (its dataset made first)."""
    assert [m.name for m in bm.METHODS] == list(UPDATES.entries)
    assert all(m.note == UPDATES.get(m.name).summary != "" for m in bm.METHODS)
    for m in bm.METHODS:  # a declared recipe, where this build ships it, trains the method's update
        if m.shipped_recipe() is not None:
            assert read_recipe(m.shipped_recipe())["train"]["loss"] == m.loss, m.name
    runs, skipped = bm.chosen_runs()
    assert {"grpo", "grpo_guard", "nft", "dpo", "gdro", "gardo_nft"} <= set(runs)
    assert set(runs) | set(skipped) == set(bm.BY_NAME) and not set(runs) & set(skipped)
    assert skipped == {} and {"offline_gdro", "sft", "dpo_offline"} <= set(runs)
    for name, var in runs.items():
        cfg, m = var.config(bm.RECIPE, []), bm.BY_NAME[name]
        assert cfg.train.loss == m.loss
        assert (cfg.data.prompts, cfg.data.eval_prompts, cfg.data.eval_seeds_per_prompt, cfg.train.seed) == (
            "digits", "digits", 8, 0)  # the footing
        if m.shipped_recipe() is not None:
            assert var.recipe == str(m.shipped_recipe())
            continue
        needs = default_needs(cfg.train.loss)
        if needs.transitions:  # the GRPO family: the recipe's group sampler with SDE steps
            assert (cfg.sampler.name, cfg.sampler.options["step"]) == ("group", "sde")
        else:  # on finished samples: deterministic ODE samples, the same count per prompt
            assert needs.clean_samples and cfg.sampler.name == "ode"
        assert cfg.sampler.samples_per_prompt == 8 and cfg.train.batch_size == 80
    assert runs["grpo_guard"].config(bm.RECIPE, []).train.loss_options["clip_range"] == 1e-3  # GRPO's kept
    assert runs["nft"].config(bm.RECIPE, []).train.loss_options == {}  # the update's own defaults


def test_a_new_update_is_a_row_and_one_not_registered_is_none(monkeypatch):
    """Registering an update adds its row (its file plus one registry line: the bench learns of it through the
    declaration); removing one removes it, and naming it is the unknown-method error."""
    monkeypatch.setitem(UPDATES, "my_grpo", "flowrl.updates.grpo_guard:GRPOGuardUpdate")
    monkeypatch.delitem(UPDATES, "gdro")
    names = [m.name for m in bm.METHODS]
    assert names[-1] == "my_grpo" and "gdro" not in names
    assert "my_grpo" in bm.chosen_runs(["my_grpo"])[0]
    with pytest.raises(BenchError, match="unknown method"):
        bm.chosen_runs(["gdro"])


def test_a_method_not_in_this_build_is_one_line(monkeypatch, capsys, tmp_path):
    """A method that runs only on its recipe where the recipe is not shipped: a line "not available in this
    build" (printed, in the JSON, in the table); the others run."""
    monkeypatch.setattr(bm, "recipes_dir", lambda: tmp_path)
    runs, skipped = bm.chosen_runs(["grpo", "gardo_grpo"])
    assert list(runs) == ["grpo"]
    why = "not available in this build (it runs on recipes/digits_gardo.yaml, which this build does not ship)"
    assert skipped == {"gardo_grpo": why}
    monkeypatch.setattr(bm, "run_variant", lambda *a, **k: _record([(0, 0.5), (10, 0.6)]))
    res = bm.bench_methods(budget_seconds=1, methods=["grpo", "gardo_grpo"], out_dir=None)
    printed = capsys.readouterr().out.splitlines()
    assert f"[bench methods] gardo_grpo: {why}" in printed
    assert res["skipped"] == skipped and list(res["variants"]) == ["grpo"]
    table = report(res).splitlines()
    assert sum(ln.startswith("gardo_grpo") and ln.endswith(why) for ln in table) == 1
    assert list(tmp_path.iterdir()) == []  # no --out: nothing written


def test_a_shipped_method_recipe_is_used_with_the_bench_footing(monkeypatch, tmp_path):
    """When a method's update declares a digits recipe (here awm as DiffusionNFT's class with a recipe of its
    own), its row runs that recipe as is, with the shared footing forced and a different evaluation reported;
    before the recipe lands, the row is "not available in this build"."""
    from flowrl.updates.nft import NFTUpdate

    monkeypatch.setitem(UPDATES, "awm", type("AWMLike", (NFTUpdate,), {"digits_recipe": "digits_awm.yaml"}))
    monkeypatch.setattr(bm, "recipes_dir", lambda: tmp_path)
    runs, skipped = bm.chosen_runs(["awm"])
    assert not runs and skipped["awm"].startswith("not available in this build (it runs on recipes/digits_awm.yaml")
    write_recipe(tmp_path / "digits_awm.yaml", "digits.yaml", **{"train.loss": "awm", "train.loss_options": {}, "train.seed": 5, "train.lr": 2e-3,
                                             "data.eval_seeds_per_prompt": 3, "sampler.num_steps": 6,
                                             "sampler.group_size": 4})
    runs, skipped = bm.chosen_runs(["awm"])
    cfg = runs["awm"].config(bm.RECIPE, [])
    assert not skipped and runs["awm"].recipe == str(tmp_path / "digits_awm.yaml")
    assert (cfg.train.lr, cfg.sampler.name, cfg.sampler.samples_per_prompt) == (2e-3, "group", 4)  # its own
    assert (cfg.train.seed, cfg.data.eval_seeds_per_prompt) == (0, 8)  # the footing
    assert bm._differences(runs, []) == {"awm": {"sampler.num_steps": [6, 10]}}
    write_recipe(tmp_path / "digits_awm.yaml", "digits.yaml", **{"train.loss": "nft", "train.loss_options": {}})
    with pytest.raises(BenchError, match=r"^method awm: recipes/digits_awm.yaml trains train.loss=nft, not awm; fix "):
        bm.chosen_runs(["awm"])


def test_subset_and_unknown_names(capsys):
    with pytest.raises(BenchError, match=r"unknown method\(s\) 'nope'; choose from grpo, grpo_guard, dppo"):
        bm.chosen_runs(["grpo", "nope"])
    with pytest.raises(BenchError, match="in --method-override"):
        bm.chosen_runs(method_overrides={"nope": ["train.lr=1"]})
    with pytest.raises(BenchError, match="^method nft: .*not_a_key"):  # configs validated before any model loads
        bm.chosen_runs(["nft"], method_overrides={"nft": ["train.not_a_key=1"]})
    for argv, msg in ((["--methods", "grpo,nope"], "unknown method(s) 'nope'; choose from "
                                                   + ", ".join(UPDATES.entries)),
                      (["--method-override", "nft"], "--method-override 'nft': expected METHOD:VALUE")):
        assert main(["bench", "methods", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"flowrl bench methods: error: {msg}"), err
    runs, _ = bm.chosen_runs(["dpo", "nft"], method_overrides={"nft": ["train.lr=3e-4"]},
                             method_recipes={"dpo": "digits_sol_nft"})
    assert list(runs) == ["nft", "dpo"]  # the table's order
    assert runs["nft"].config(bm.RECIPE, []).train.lr == 3e-4
    dpo = runs["dpo"].config(bm.RECIPE, [])
    assert dpo.train.loss == "dpo" and runs["dpo"].recipe.endswith("digits_sol_nft.yaml")


def _record(curve, samples=80):
    """A :func:`run_variant` result with the eval rewards of ``curve`` ``[(seconds, reward)]``, one
    iteration of ``samples`` per point."""
    pts = [{"train_seconds": t, "iteration": i, "samples": i * samples, "eval_reward": r, "diversity": 0.2,
            "hf_energy": 0.005} for i, (t, r) in enumerate(curve)]
    return {"recipe": "digits.yaml", "sampler": {"name": "group"}, "seconds_per_iteration": 1.0,
            "iterations": len(pts) - 1, "samples_drawn": pts[-1]["samples"], "final_eval_reward": pts[-1]["eval_reward"],
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
    table = report(res).splitlines()
    assert table[0].split()[:4] == ["method", "recipe", "sampler", "s/iter"]
    nft = next(ln for ln in table if ln.startswith("nft")).split()
    assert nft[1] == "digits.yaml" and nft[-3:] == ["10.0", "80", "2.00"]
    assert next(ln for ln in table if ln.startswith("dpo")).split()[-3:] == ["-", "-", "-"]
    assert any(ln.startswith("gdro") and "FAILED: RuntimeError: loss is nan" in ln for ln in table)
    assert any(ln.startswith("real data") for ln in table)
    assert table[-1].startswith("to GRPO s / samples: first evaluation at or above GRPO's final eval reward 0.8000")


def test_no_time_to_a_grpo_reward_the_base_already_reaches(monkeypatch):
    monkeypatch.setattr(bm, "run_variant", lambda *a, **k: _record([(0, 0.7), (10, 0.6)]))
    res = bm.bench_methods(budget_seconds=10, methods=["grpo", "nft"])
    assert res["baseline_final_above_base"] is False
    assert all(v["seconds_to_baseline_final_reward"] is None for v in res["variants"].values())
    assert "n/a (0.6000 is not above the base model's 0.7000: the base already reaches it" in report(res)
    res = bm.bench_methods(budget_seconds=10, methods=["nft"])
    assert "baseline_final_above_base" not in res and "grpo was not among the methods run" in report(res)


def test_bench_methods_trains_each_method_from_the_same_base(tiny_digits_dir, tmp_path, capsys):
    """Tiny budget on a tiny digits model, three methods (the GRPO family, DiffusionNFT, online DPO) from the
    command line: the JSON's schema, the PNG, the table printed; every method starts at the same evaluation and
    the samples drawn are the rollouts' sample counts."""
    extra = tiny_train_overrides(tiny_digits_dir, **{"data.eval_prompts": "[a handwritten digit 3]"})
    out = tmp_path / "bench"
    assert main(["bench", "methods", "--methods", "grpo,nft,dpo", "--budget", "0.2", "--eval-every", "0.2",
                 "--out", str(out), *extra]) == 0
    res = json.loads((out / "methods.json").read_text())
    assert (out / "methods.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(res) >= {"pipeline", "recipe", "budget_seconds", "eval_every_seconds", "baseline", "variants",
                        "skipped", "failed", "real", "machine"} and not res["failed"] and not res["skipped"]
    assert list(res["variants"]) == ["grpo", "nft", "dpo"]
    assert [r["sampler"]["name"] for r in res["variants"].values()] == ["group", "ode", "ode"]
    assert len({r["curve"][0]["eval_reward"] for r in res["variants"].values()}) == 1  # same base, same evaluation
    for r in res["variants"].values():
        assert all(set(p) == POINT_KEYS for p in r["curve"]) and r["iterations"] >= 1
        assert r["samples_drawn"] == r["iterations"] * 16 == r["curve"][-1]["samples"]
        assert r["train_seconds"] >= 0.2 and "seconds_to_baseline_final_reward" in r
    assert set(res["real"]) >= {"reward", "diversity", "hf_energy"}
    printed = capsys.readouterr().out.splitlines()
    assert any(ln.startswith("method") and "to GRPO samples" in ln for ln in printed)
    assert [ln.split()[0] for ln in printed if ln.split() and ln.split()[0] in bm.BY_NAME] == ["grpo", "nft", "dpo"]
