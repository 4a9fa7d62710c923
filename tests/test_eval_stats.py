"""flowrl.eval's pure parts: the bootstrap statistics, the suites and their errors, the panel's
options from overrides, the hacking verdicts."""
import json

import numpy as np
import pytest

from flowrl.data.prompts import PromptSetError
from flowrl.errors import ConfigError
from flowrl.eval import stats
from flowrl.eval.command import split_panel_overrides
from flowrl.eval.hacking import hacking_verdicts
from flowrl.eval.suites import load_suite


# ---------------------------------------------------------------- statistics
def test_bootstrap_mean_and_interval():
    i = stats.bootstrap_mean([0.5] * 20)
    assert (i.mean, i.lo, i.hi, i.n) == (0.5, 0.5, 0.5, 20)  # no spread, no width
    x = np.random.default_rng(0).normal(1.0, 1.0, 200)
    i = stats.bootstrap_mean(x)
    assert i.lo < x.mean() < i.hi and i.mean == pytest.approx(x.mean())
    assert i.hi - i.lo == pytest.approx(2 * 1.96 / np.sqrt(200), rel=0.2)  # ~ the normal interval's width
    assert stats.bootstrap_mean(x) == i  # seeded: reproducible
    assert stats.bootstrap_mean([np.nan, 1.0, 3.0]).mean == 2.0  # NaN prompts are left out
    assert stats.bootstrap_mean([np.nan]).n == 0 and stats.bootstrap_mean([np.nan]).to_dict()["mean"] is None


def test_bootstrap_interval_covers_the_true_mean_about_95_percent():
    rng = np.random.default_rng(1)
    covered = 0
    for k in range(200):
        i = stats.bootstrap_mean(rng.exponential(1.0, 60), n_boot=400, seed=k)
        covered += i.lo < 1.0 < i.hi
    assert 0.88 <= covered / 200 <= 0.99


def test_prompt_means_and_the_mean_over_tags():
    scores = np.array([[1.0, 0.0], [1.0, np.nan], [np.nan, np.nan]])
    assert stats.prompt_means(scores)[:2].tolist() == [0.5, 1.0] and np.isnan(stats.prompt_means(scores)[2])
    v, tags = [1.0, 1.0, 1.0, 0.0], ["a", "a", "a", "b"]
    i = stats.bootstrap_mean(v, strata=tags)
    assert i.mean == 0.5 and i.lo == i.hi == 0.5  # (1 + 0) / 2, not 3/4; each tag constant: no spread
    per = stats.by_tag(v, tags)
    assert list(per) == ["a", "b"] and per["a"].mean == 1.0 and per["b"].n == 1


def test_no_mean_over_tags_without_a_score_in_every_tag():
    v = [1.0, 0.0, np.nan, np.nan, 0.5]
    tags = ["a", "a", "b", "b", "c"]
    assert stats.tag_coverage(v, tags) == {"tags_scored": ["a", "c"], "tags_unscored": ["b"], "prompts_scored": 3,
                                           "prompts": 5}
    assert stats.bootstrap_mean(v, strata=tags, n_boot=50) == stats.NAN  # not the mean of a and c
    assert stats.bootstrap_mean(v, strata=["a", "a", "c", "c", "c"], n_boot=50).mean == pytest.approx(0.5)


def test_paired_delta_and_win_rate():
    rng = np.random.default_rng(2)
    a = rng.random((30, 4))
    b = a + 0.1
    d, w = stats.paired(a, b)
    assert d.mean == pytest.approx(0.1) and d.excludes_zero() and w.mean == 1.0
    d, w = stats.paired(a, a)
    assert d.mean == 0 and w.mean == 0.5  # ties are half a win
    b = a.copy()
    b[:, 0] = np.nan  # a pair counts only where both scored
    d, w = stats.paired(a, b)
    assert d.mean == 0 and w.n == 30
    with pytest.raises(ValueError, match="same prompts and seeds"):
        stats.paired(a, a[:, :2])


# ---------------------------------------------------------------- suites
def test_shipped_suites():
    g = load_suite("geneval")
    assert len(g.items) == 553 and set(g.tags) == {"single_object", "two_object", "counting", "colors", "position",
                                                   "color_attr"}
    assert g.items[0].meta["include"] and "exclude" in g.items[0].meta
    assert len(load_suite("ocr").items) == 1018 and len(load_suite("digits").items) == 10
    assert load_suite("digits").tags == ["all"] * 10


def test_unknown_and_unshipped_suites_say_what_to_do():
    with pytest.raises(ConfigError, match=r"unknown suite 'genevel'; valid suites: .*digits.*geneval.*ocr"):
        load_suite("genevel")
    with pytest.raises(ConfigError, match=r"DrawBench is not shipped.*--suite DrawBench\.csv"):
        load_suite("drawbench")


def test_user_files(tmp_path):
    (tmp_path / "s.csv").write_text("Prompts,Category\nA red colored car.,Colors\nA tiny elephant.,Rare\n")
    s = load_suite(str(tmp_path / "s.csv"))
    assert [it.text for it in s.items] == ["A red colored car.", "A tiny elephant."] and s.tags == ["Colors", "Rare"]
    rows = [{"prompt": "a photo of a cat", "tag": "single_object", "include": [{"class": "cat", "count": 1}]},
            {"prompt": "an essay", "category": "misc", "source": "me"}]
    (tmp_path / "s.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    s = load_suite(str(tmp_path / "s.jsonl"))
    assert s.tags == ["single_object", "misc"] and s.items[1].meta["source"] == "me"
    (tmp_path / "s.txt").write_text("one\ntwo\n")
    assert [it.text for it in load_suite(str(tmp_path / "s.txt")).items] == ["one", "two"]
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(PromptSetError, match="is empty"):
        load_suite(str(tmp_path / "e.jsonl"))


def test_the_suffix_says_how_a_file_is_read(tmp_path):
    """A .txt (or a name without a suffix) is one prompt per line, also when its first line reads like a
    CSV header: nothing is guessed from the contents (the same for data.prompts files)."""
    from flowrl.data.prompts import load_prompts

    for name in ("s.txt", "s.TXT", "s"):
        (tmp_path / name).write_text("prompt,tag\na cat,animals\n")
        assert [it.text for it in load_suite(str(tmp_path / name)).items] == ["prompt,tag", "a cat,animals"]
        assert load_prompts(str(tmp_path / name)) == ["prompt,tag", "a cat,animals"]
    (tmp_path / "s.csv").write_text("prompt,tag\na cat,animals\n")
    assert [(it.text, it.tag) for it in load_suite(str(tmp_path / "s.csv")).items] == [("a cat", "animals")]


def test_a_metadata_row_without_its_clauses_names_the_line(tmp_path):
    p = tmp_path / "g.jsonl"
    p.write_text(json.dumps({"prompt": "a photo of a cat", "tag": "single_object", "include": [{"class": "cat",
                                                                                               "count": 1}]})
                 + "\n" + json.dumps({"prompt": "two clocks", "tag": "counting"}) + "\n")
    with pytest.raises(ConfigError, match=r"g\.jsonl:2: tag 'counting' without its 'include' clauses"):
        load_suite(str(p))


# ---------------------------------------------------------------- panel options
def test_panel_options_from_overrides():
    keep, opts = split_panel_overrides(["model.path=x", "reward.options.geneval.detector=m:f",
                                        "reward.options.geneval.detector_options.model=/w",
                                        "reward.options.digits.device=cpu"], ["geneval"])
    assert keep == ["model.path=x", "reward.options.digits.device=cpu"]  # digits is not in the panel
    assert opts == {"geneval": {"detector": "m:f", "detector_options": {"model": "/w"}}}


# ---------------------------------------------------------------- hacking
def _result(trained_delta, heldout_delta, diversity_delta):
    iv = lambda m, lo, hi: {"mean": m, "lo": lo, "hi": hi, "n": 10}  # noqa: E731
    summ = {"rewards": {"digits": iv(0.5, 0.4, 0.6), "jpeg": iv(0.1, 0.0, 0.2)}, "watch": {"diversity": iv(0.3, .2, .4)}}
    return {"models": [{"label": "base", "kind": "config"}, {"label": "run", "kind": "run", "trained": ["digits"]}],
            "rewards": {"digits": {}, "jpeg": {}}, "baseline": "base", "summary": {"base": summ, "run": summ},
            "paired": {"run": {"rewards": {"digits": {"delta": iv(*trained_delta)}, "jpeg": {"delta": iv(*heldout_delta)}},
                               "watch": {"diversity": {"delta": iv(*diversity_delta)}}}}}


def test_hacking_says_plainly_when_the_trained_reward_rose_while_others_fell():
    v = hacking_verdicts(_result((0.2, 0.1, 0.3), (-0.05, -0.08, -0.02), (-0.1, -0.15, -0.05)))
    assert v[0]["level"] == "warning"
    assert "the trained reward rose while others fell: digits rose by +0.2" in v[0]["message"]
    assert "the held-out jpeg fell by -0.05" in v[0]["message"] and "the diversity fell by -0.1" in v[0]["message"]
    ok = hacking_verdicts(_result((0.2, 0.1, 0.3), (-0.01, -0.05, 0.03), (0.0, -0.01, 0.01)))[0]
    assert ok["level"] == "ok" and "nothing held out fell measurably" in ok["message"]
    flat = hacking_verdicts(_result((0.01, -0.02, 0.04), (-0.05, -0.08, -0.02), (0.0, -0.01, 0.01)))[0]
    assert flat["level"] == "info" and "did not rise measurably" in flat["message"]
