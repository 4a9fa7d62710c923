"""``flowrl bench methods --pipeline WORLD``: a world is a declaration (its base recipe; a method's recipe
``<world>_<x>.yaml`` from its declared ``digits_<x>.yaml``), and when the evaluation prompts carry tags (the
shapes world's GenEval tags) every row has its final evaluation reward per tag, in the tables and the picture."""
import json
import math

import pytest
import torch

import flowrl.bench.methods as bm
import flowrl.bench.worlds as bw
from conftest import tiny_train_overrides
from helpers import write_recipe
from flowrl.bench.methods_report import markdown, report
from flowrl.builders import tag_means
from flowrl.cli import main
from flowrl.data.prompts import load_prompt_tags
from flowrl.errors import BenchError
from flowrl.trainers.config_text import recipes_dir


def test_the_worlds_are_declarations_and_a_method_recipe_follows_its_digits_one():
    assert bw.WORLDS["digits"].recipe == bm.RECIPE == "digits.yaml" and bw.WORLDS["shapes"].recipe == "shapes.yaml"
    shapes = bw.world("shapes")
    assert shapes.method_recipe("digits_gardo.yaml") == "shapes_gardo.yaml"
    assert shapes.method_recipe("digits_dpo_offline.yaml") == "shapes_dpo_offline.yaml"
    assert shapes.method_recipe(None) is None and bw.world("digits").method_recipe("digits_awm.yaml") == "digits_awm.yaml"
    with pytest.raises(BenchError, match=r"^a method's digits_recipe must be named digits_<x>.yaml \(got 'awm.yaml'\)"):
        shapes.method_recipe("awm.yaml")
    with pytest.raises(BenchError, match=r"^bench methods runs on the offline worlds digits, shapes \(got 'sd3'\)"):
        bm.chosen_runs(["grpo"], pipeline="sd3")
    digits = {m.name: m for m in bm.all_methods()}
    assert all(m.in_world(bw.world("digits")) == m for m in digits.values())  # digits unchanged
    assert digits["gardo_grpo"].in_world(shapes).recipe == "shapes_gardo.yaml"


def test_a_world_whose_base_recipe_is_not_shipped_is_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bw, "recipes_dir", lambda: tmp_path)
    with pytest.raises(BenchError, match=r"^bench methods --pipeline shapes: this build does not ship "
                                         r"recipes/shapes.yaml"):
        bm.chosen_runs(["grpo"], pipeline="shapes")
    assert main(["bench", "methods", "--pipeline", "shapes", "--methods", "grpo", "--budget", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not ship recipes/shapes.yaml" in err[0]


def test_a_world_resolves_its_own_recipes_and_falls_back_as_on_digits(monkeypatch, tmp_path):
    """A stub world "stub" (one entry): its base recipe is every method's footing; dppo runs on stub_dppo.yaml,
    a method without its world's recipe falls back to the base recipe with its overrides (nft: ON_SAMPLES), one
    that runs only on its recipe (gardo_grpo) is "not available in this build"."""
    base = write_recipe(tmp_path / "stub.yaml", "digits.yaml", **{"train.seed": 7, "data.eval_seeds_per_prompt": 4,
                                                            "train.lr": 5e-4})
    monkeypatch.setitem(bw.WORLDS, "stub", bw.World("stub", str(base)))
    monkeypatch.setattr(bm, "recipes_dir", lambda: tmp_path)
    write_recipe(tmp_path / "stub_dppo.yaml", "digits_dppo.yaml", **{"train.seed": 1, "train.lr": 2e-3,
                                                                "sampler.num_steps": 6})
    runs, skipped = bm.chosen_runs(["grpo", "dppo", "nft", "gardo_grpo"], pipeline="stub")
    assert list(runs) == ["grpo", "dppo", "nft"]
    assert skipped == {"gardo_grpo": "not available in this build (it runs on recipes/stub_gardo.yaml, which this "
                                     "build does not ship)"}
    cfgs = {name: var.config(str(base), []) for name, var in runs.items()}
    assert runs["dppo"].recipe == str(tmp_path / "stub_dppo.yaml") and runs["grpo"].recipe is None
    assert cfgs["dppo"].train.lr == 2e-3 and cfgs["grpo"].train.lr == 5e-4  # its own recipe; the base one
    assert {(c.train.seed, c.data.eval_seeds_per_prompt) for c in cfgs.values()} == {(7, 4)}  # the world's footing
    assert set(bm.ON_SAMPLES) <= set(runs["nft"].overrides) and cfgs["nft"].sampler.name == "ode"
    assert bm._differences(runs, [], str(base)) == {"dppo": {"sampler.num_steps": [6, 10]}}


def test_tags_of_a_prompt_set(tmp_path):
    rows = [{"prompt": "a handwritten digit 1", "tag": "odd"}, {"prompt": "a handwritten digit 2", "tag": "even"},
            {"prompt": "a handwritten digit 3"}]
    f = tmp_path / "tagged.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    assert load_prompt_tags(str(f)) == ["odd", "even", "all"]
    f.write_text("\n".join(json.dumps({"prompt": r["prompt"]}) for r in rows))
    assert load_prompt_tags(str(f)) is None
    assert load_prompt_tags("digits") is None and load_prompt_tags(["a", "b"]) is None
    got = load_prompt_tags("geneval")
    assert len(got) == 553 and set(got) == {"single_object", "two_object", "counting", "colors", "position",
                                            "color_attr"}


def test_tag_means_are_the_finite_means_of_each_tags_samples():
    r = torch.tensor([1.0, 0.0, 0.5, float("nan"), 0.2, 0.4])  # 3 prompts x 2 seeds
    got = tag_means(r, ["a", "b", "a"], 2)
    assert list(got) == ["a", "b"] and got["a"] == pytest.approx((1.0 + 0.0 + 0.2 + 0.4) / 4)
    assert got["b"] == pytest.approx(0.5)
    assert math.isnan(tag_means(torch.tensor([float("nan")] * 2), ["c"], 2)["c"])


def _record(curve, tags, real_tags=None):
    """A run result with eval rewards ``curve`` [(seconds, reward)] and, at each point, ``tags(i)``."""
    pts = [{"train_seconds": t, "iteration": i, "samples": i * 80, "eval_reward": r, "diversity": 0.2,
            "hf_energy": 0.005, "tags": tags(i)} for i, (t, r) in enumerate(curve)]
    return {"recipe": "digits.yaml", "sampler": {"name": "group"}, "loss": "grpo", "seconds_per_iteration": 1.0,
            "iterations": len(pts) - 1, "samples_drawn": pts[-1]["samples"], "final_eval_reward": pts[-1]["eval_reward"],
            "real": {"reward": 0.9, "diversity": 0.22, "hf_energy": 0.006, "tags": real_tags or {"odd": 0.95, "even": 0.85}},
            "curve": pts}


def _fake(final: dict):
    """A ``run_variant`` stand-in: method -> train.seed -> its final per-tag rewards."""
    def run(recipe, var, *a, **k):
        loss = next(o.split("=")[1] for o in var.overrides if o.startswith("train.loss="))
        seed = int([o.split("=")[1] for o in var.overrides if o.startswith("train.seed=")][-1])  # the last wins
        end = final[loss][seed]
        return _record([(0, 0.5), (10, 0.6)], lambda i: end if i else {"odd": 0.5, "even": 0.5})
    return run


def test_per_tag_columns_of_one_seed(monkeypatch, tmp_path):
    monkeypatch.setattr(bm, "run_variant", _fake({"grpo": {0: {"odd": 0.7, "even": 0.6}},
                                                  "nft": {0: {"odd": 0.8, "even": float("nan")}}}))
    res = bm.bench_methods(budget_seconds=10, methods=["grpo", "nft"], out_dir=str(tmp_path), progress=False)
    saved = json.loads((tmp_path / "methods.json").read_text())
    assert saved["tags"] == ["odd", "even"]
    assert saved["variants"]["grpo"]["final_tags"] == {"odd": 0.7, "even": 0.6}
    assert saved["variants"]["nft"]["final_tags"] == {"odd": 0.8, "even": None}  # no finite reward: None
    assert (tmp_path / "methods.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = report(res).splitlines()
    at = table.index("final eval reward per tag:")
    assert table[at + 1].split() == ["method", "odd", "even"]
    assert table[at + 2].split() == ["grpo", "0.7000", "0.6000"] and table[at + 3].split() == ["nft", "0.8000", "-"]
    assert table[at + 4].split() == ["real", "data", "0.9500", "0.8500"]
    md = markdown(res).splitlines()
    at = md.index("Final evaluation reward per tag:")
    assert md[at + 2:] == ["| method | odd | even |", "|---|---|---|", "| grpo | 0.700 | 0.600 |",
                           "| nft | 0.800 | - |", "| real data | 0.950 | 0.850 |"]


def test_per_tag_columns_of_several_seeds_have_intervals(monkeypatch, tmp_path):
    monkeypatch.setattr(bm, "run_variant", _fake({"grpo": {0: {"odd": 0.6, "even": 0.4}, 1: {"odd": 0.8, "even": 0.4}},
                                                  "nft": {0: {"odd": 0.5, "even": 0.5}, 1: {"odd": 0.5, "even": 0.7}}}))
    res = bm.bench_methods(budget_seconds=10, methods=["grpo", "nft"], out_dir=str(tmp_path), seeds=2, progress=False)
    grpo, nft = (res["variants"][m]["final_tags"] for m in ("grpo", "nft"))
    assert grpo["odd"][0] == pytest.approx(0.7) and grpo["odd"][1] >= 0.6 - 1e-12 and grpo["odd"][2] <= 0.8 + 1e-12
    assert grpo["odd"][1] < grpo["odd"][2] and grpo["even"] == pytest.approx([0.4, 0.4, 0.4])
    assert nft["odd"] == pytest.approx([0.5, 0.5, 0.5]) and nft["even"][0] == pytest.approx(0.6)
    table = report(res)
    assert "grpo" in table and f"0.7000 [{grpo['odd'][1]:.4f}, {grpo['odd'][2]:.4f}]" in table
    assert "| grpo | 0.700 [" in markdown(res)
    assert (tmp_path / "methods.png").stat().st_size > 0


def test_a_result_without_tags_is_unchanged(monkeypatch):
    monkeypatch.setattr(bm, "run_variant", lambda *a, **k: {**_record([(0, 0.5), (10, 0.6)], lambda i: {}),
                                                            "real": {"reward": 1.0, "diversity": 0.2, "hf_energy": 0.1}})
    res = bm.bench_methods(budget_seconds=10, methods=["grpo"], progress=False)
    assert "tags" not in res and "final_tags" not in res["variants"]["grpo"]
    assert "per tag" not in report(res) and "per tag" not in markdown(res)


def test_bench_methods_on_a_tagged_evaluation_set_ranked_by_a_heldout_reward(tiny_digits_dir, tmp_path, monkeypatch):
    """One tiny run on digits with a tagged evaluation set, the world ranking by a held-out reward (its
    ``headline``, as the shapes world ranks by GenEval's official verdict): each evaluation holds that reward and
    its value per tag, the mean of the tags' values weighted by their prompts is the evaluation reward, the
    trained reward is kept beside it, the real data has both, and the table says what the evaluation reward is."""
    from dataclasses import replace

    monkeypatch.setitem(bw.WORLDS, "digits", replace(bw.WORLDS["digits"], headline="jpeg_compressibility",
                                                     headline_about="eval reward = JPEG compressibility"))
    suite = tmp_path / "tagged.jsonl"
    suite.write_text("\n".join(json.dumps({"prompt": f"a handwritten digit {d}", "tag": "odd" if d % 2 else "even"})
                               for d in (3, 4, 7)))
    extra = tiny_train_overrides(tiny_digits_dir, **{"data.eval_prompts": str(suite),
                                                     "reward.heldout": "{jpeg_compressibility: {}}"})
    out = tmp_path / "bench"
    assert main(["bench", "methods", "--methods", "grpo", "--budget", "0.2", "--eval-every", "0.2",
                 "--out", str(out), *extra]) == 0
    res = json.loads((out / "methods.json").read_text())
    assert res["tags"] == ["odd", "even"] and res["headline"] == "jpeg_compressibility"
    for p in res["variants"]["grpo"]["curve"]:
        assert set(p["tags"]) == set(p["trained_tags"]) == {"odd", "even"}
        assert (2 * p["tags"]["odd"] + p["tags"]["even"]) / 3 == pytest.approx(p["eval_reward"], rel=1e-5)
        assert (2 * p["trained_tags"]["odd"] + p["trained_tags"]["even"]) / 3 == pytest.approx(p["trained_reward"],
                                                                                           rel=1e-5)
        assert abs(p["eval_reward"] - p["trained_reward"]) > 1e-3  # two rewards, not one twice
    assert res["variants"]["grpo"]["final_tags"] == res["variants"]["grpo"]["curve"][-1]["tags"]
    assert set(res["real"]["tags"]) == {"odd", "even"} and 0 < res["real"]["trained_reward"] <= 1
    assert res["real"]["reward"] != res["real"]["trained_reward"]
    trained = res["variants"]["grpo"]["curve"][-1]["trained_reward"]
    for text in (report(res), markdown(res)):
        assert "eval reward = JPEG compressibility." in text and f"final trained reward: grpo {trained:.3f}" in text


def test_the_shapes_world_runs_on_its_recipes_with_geneval_tags():
    """The shipped shapes world: recipes/shapes.yaml is every method's footing (its prompts, its held-out
    evaluation set of 21 tagged prompts, its held-out rewards: the bench ranks by GenEval's official verdict), a
    method with a shapes recipe runs on it, sft (its digits recipe only, no shapes image set) is "not available
    in this build"."""
    runs, skipped = bm.chosen_runs(pipeline="shapes")
    headline = bw.world("shapes").headline
    for name, var in runs.items():
        cfg = var.config("shapes.yaml", [])
        assert (cfg.model.pipeline, cfg.data.prompts, cfg.data.eval_prompts, cfg.data.eval_seeds_per_prompt) == (
            "shapes", "shapes-train", "shapes", 16), name
        assert cfg.reward.heldout[headline]["score"] == "official", name
        declared = bm.BY_NAME[name].recipe
        assert var.recipe == (str(recipes_dir() / declared.replace("digits_", "shapes_")) if declared else None)
    assert {"grpo", "nft", "dppo", "gardo_grpo", "opd"} <= set(runs)
    assert skipped == {"sft": "not available in this build (it runs on recipes/shapes_sft.yaml, which this build "
                              "does not ship)"}
    tags = load_prompt_tags("shapes")
    assert len(tags) == 21 and set(tags) == {"single_object", "two_object", "counting", "colors", "position",
                                             "color_attr"}


def test_several_seeds_keep_the_trained_reward_beside_a_headline(monkeypatch):
    """With a headline the seeded rows also average the trained reward (``final.trained_reward``: mean with its
    interval over the seeds) and the table prints it; without one nothing is added."""
    def run(recipe, var, *a, **k):
        seed = int([o.split("=")[1] for o in var.overrides if o.startswith("train.seed=")][-1])
        rec = _record([(0, 0.1), (10, 0.2 + 0.1 * seed)], lambda i: {})
        for p in rec["curve"] if k["headline"] else ():  # the world's headline reaches the run
            p["trained_reward"] = 0.5 + 0.1 * seed * p["iteration"]
        return rec
    monkeypatch.setattr(bm, "run_variant", run)
    monkeypatch.setitem(bw.WORLDS, "digits", bw.World("digits", "digits.yaml", headline="jpeg_compressibility",
                                                      headline_about="eval reward = a held-out reward"))
    res = bm.bench_methods(budget_seconds=10, methods=["grpo"], seeds=2, progress=False)
    f = res["variants"]["grpo"]["final"]
    assert f["eval_reward"][0] == pytest.approx(0.25) and f["trained_reward"][0] == pytest.approx(0.55)
    assert f["trained_reward"][1] < f["trained_reward"][2]
    assert f"final trained reward: grpo 0.550 [{f['trained_reward'][1]:.3f}, " in report(res)
    monkeypatch.setitem(bw.WORLDS, "digits", bw.World("digits", "digits.yaml"))
    res = bm.bench_methods(budget_seconds=10, methods=["grpo"], seeds=2, progress=False)
    assert "trained_reward" not in res["variants"]["grpo"]["final"] and "trained reward" not in report(res)


def test_runs_split_across_processes_merge_into_one_table(monkeypatch, tmp_path, capsys):
    """`bench methods --merge`: two parts of one bench (each method in one part) make the table of all their rows,
    the time to GRPO's final reward computed across the parts; parts of different benches, or naming a method
    twice, are refused in one line."""
    monkeypatch.setattr(bm, "run_variant", _fake({"grpo": {0: {"odd": 0.6, "even": 0.4}, 1: {"odd": 0.8, "even": 0.4}},
                                                  "nft": {0: {"odd": 0.5, "even": 0.5}, 1: {"odd": 0.5, "even": 0.7}}}))
    whole = bm.bench_methods(budget_seconds=10, methods=["grpo", "nft"], seeds=2, progress=False)
    for name in ("grpo", "nft"):
        bm.bench_methods(budget_seconds=10, methods=[name], seeds=2, progress=False, out_dir=str(tmp_path / name))
    parts = [str(tmp_path / n / "methods.json") for n in ("grpo", "nft")]
    assert main(["bench", "methods", "--merge", *parts, "--out", str(tmp_path / "all")]) == 0
    merged = json.loads((tmp_path / "all" / "methods.json").read_text())
    assert list(merged["variants"]) == ["grpo", "nft"] and merged["merged_from"] == 2
    for key in ("speedup_samples", "speedup_samples_interval", "seconds_to_baseline_final_reward"):
        assert merged["variants"]["nft"][key] == pytest.approx(whole["variants"]["nft"][key]), key
    assert json.dumps(merged["variants"]["nft"]["final_tags"]) == json.dumps(whole["variants"]["nft"]["final_tags"])
    assert (tmp_path / "all" / "methods.png").stat().st_size > 0 and "nft" in capsys.readouterr().out
    with pytest.raises(BenchError, match=r"method 'grpo' is in two parts"):
        bm.merge_results([merged, json.loads(open(parts[0]).read())])
    other = {**json.loads(open(parts[1]).read()), "budget_seconds": 20}
    with pytest.raises(BenchError, match=r"part 2 has budget_seconds=20, part 1 10"):
        bm.merge_results([json.loads(open(parts[0]).read()), other])
