"""``flowrl eval`` as a harness on digits: a base model (``--config``) against a trained run (``--run``)
on the same prompts and seeds; the table, ``eval.json`` with intervals and paired deltas, the HTML
report (opened in a real headless Chromium when one is installed), resume after an interruption, and
the one-line errors."""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import tiny_train_overrides
from flowrl.cli import main

RECIPE = "recipes/digits.yaml"
QUIET = ["logging.trackers=[]", "logging.progress=false"]


@pytest.fixture(scope="module")
def run_and_report(tiny_digits_dir, tmp_path_factory):
    """A 1-iteration run on the tiny digits model, and the harness over base + run with --out."""
    from flowrl.trainers.config import load_config
    from flowrl.trainers.online import train

    root = tmp_path_factory.mktemp("eval-harness")
    run = root / "run"
    train(load_config(RECIPE, tiny_train_overrides(tiny_digits_dir, **{"train.iterations": 1, "train.lr": 0.05})), run)
    out = root / "report"
    argv = ["eval", "--config", f"base={RECIPE}", "--run", str(run), "--suite", "digits", "--rewards",
            "digits,jpeg_compressibility", "--per-prompt", "3", "--steps", "3", "--batch", "12", "--out", str(out),
            f"model.path={tiny_digits_dir}"]
    return root, run, out, argv


@pytest.fixture(scope="module")
def first(run_and_report):
    import contextlib
    import io

    _, _, out, argv = run_and_report
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    return buf.getvalue(), json.loads((out / "eval.json").read_text())


def test_the_table_json_and_report(first, run_and_report):
    stdout, res = first
    _, run, out, _ = run_and_report
    assert stdout.startswith("flowrl eval: suite digits (10 prompts x 3 seeds), 2 model(s), baseline base")
    assert "mean [95% interval] over prompts" in stdout and "against base (same prompts and seeds)" in stdout
    assert [m["label"] for m in res["models"]] == ["base", "run"] and res["baseline"] == "base"
    assert res["models"][1]["trained"] == ["digits"] and res["models"][1]["checkpoint"].endswith("iter_000001")
    for label in ("base", "run"):
        d = res["summary"][label]["rewards"]["digits"]
        assert d["lo"] <= d["mean"] <= d["hi"] and d["n"] == 10 and d["images"] == 30
    p = res["paired"]["run"]["rewards"]["digits"]
    assert p["delta"]["lo"] <= p["delta"]["mean"] <= p["delta"]["hi"] and 0 <= p["win_rate"]["mean"] <= 1
    assert len(res["per_prompt"]) == 10 and set(res["per_prompt"][0]["models"]) == {"base", "run"}
    assert res["hacking"] and res["hacking"][0]["model"] == "run"
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") >= 2 * 10  # the grid: every prompt, both models
    assert "http://" not in page and "https://" not in page  # nothing to fetch: opens offline
    assert "Content-Security-Policy" in page and "Worst and best prompts" in page and "[" in page


def test_same_prompts_and_seeds_for_every_model(first, run_and_report, tiny_digits_dir):
    """The base model's scores equal a one-model evaluation of it alone (the seeds do not depend on
    which models are compared)."""
    _, res = first
    root, _, _, _ = run_and_report
    alone = root / "alone.json"
    assert main(["eval", "--config", RECIPE, "--suite", "digits", "--rewards", "digits,jpeg_compressibility",
                 "--per-prompt", "3", "--steps", "3", "--batch", "12", "--json", str(alone),
                 f"model.path={tiny_digits_dir}"]) == 0
    mine = json.loads(alone.read_text())
    assert [r["models"]["digits"] for r in mine["per_prompt"]] == [r["models"]["base"] for r in res["per_prompt"]]


def test_resume_recomputes_only_what_is_missing(first, run_and_report, capsys):
    _, res = first
    _, _, out, argv = run_and_report
    chunks = sorted((out / "samples" / "run").glob("chunk_*.json"))
    assert len(chunks) == 3  # 10 prompts, 4 per chunk (12 samples of 3 seeds)
    chunks[-1].unlink()  # as if interrupted before the last chunk of the second model
    (out / "eval.json").unlink()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "base: resuming, 3 of 3 chunks" in err and "run: resuming, 2 of 3 chunks" in err
    again = json.loads((out / "eval.json").read_text())
    assert again["per_prompt"] == res["per_prompt"] and again["summary"] == res["summary"]


def test_a_changed_plan_is_not_mixed_into_an_old_one(run_and_report, capsys):
    _, _, _, argv = run_and_report
    changed = [*argv[:argv.index("--steps")], "--steps", "4", *argv[argv.index("--steps") + 2:]]
    assert main(changed) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("flowrl eval: error: ") and "other settings (steps differ)" in err


def dog_detector(images):
    """A stub GenEval detector: one confident dog filling each image."""
    h, w = images.shape[-2:]
    return [{"dog": [(0.0, 0.0, float(w), float(h), 0.95)]} for _ in images]


def test_a_mean_over_tags_is_given_only_when_every_tag_has_scores(tiny_digits_dir, tmp_path, capsys):
    """A reward that scores no prompt of some tag (here: geneval on rows without clauses) gets no mean
    over tags: 'n/a' and the tags in the table, null with the reason in eval.json, one warning line
    on stderr; a reward that scores every tag keeps its mean over tags."""
    rows = [{"prompt": f"a photo of a dog {i}", "tag": "single_object", "include": [{"class": "dog", "count": 1}]}
            for i in range(2)]
    rows += [{"prompt": f"a photo of two dogs {i}", "tag": "counting", "include": [{"class": "dog", "count": 2}]}
             for i in range(2)]
    rows += [{"prompt": f"a handwritten digit {i}", "category": "digits"} for i in range(2)]  # no clauses
    suite = tmp_path / "mixed.jsonl"
    suite.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "report"
    assert main(["eval", "--config", RECIPE, "--suite", str(suite), "--rewards", "geneval,jpeg_compressibility",
                 "--per-prompt", "2", "--steps", "2", "--out", str(out), f"model.path={tiny_digits_dir}",
                 "reward.options.geneval.detector=test_eval_harness:dog_detector"]) == 0
    cap = capsys.readouterr()
    res = json.loads((out / "eval.json").read_text())
    g = res["summary"]["digits"]["rewards"]["geneval"]
    assert g["tag_mean"] is None and g["tags"]["single_object"]["mean"] == 1.0 and g["tags"]["counting"]["mean"] == 0.0
    assert g["tag_mean_unavailable"] == {
        "reason": "no score for tag(s) digits; the mean over tags needs every tag of the suite",
        "tags_scored": ["single_object", "counting"], "tags_unscored": ["digits"], "prompts_scored": 4, "prompts": 6}
    assert res["summary"]["digits"]["rewards"]["jpeg_compressibility"]["tag_mean"]["n"] == 6  # every tag scored
    said = ("geneval: no score for tag(s) digits (4 of 6 prompts scored), so its mean over tags (GenEval's overall "
            "score) is not reported")
    summary = cap.out.split("\n\n")[1]
    assert "n/a (2 of 3 tags)" in summary and said in summary and "0.500" not in summary  # not the mean of 2 tags
    warnings = [ln for ln in cap.err.splitlines() if "WARNING" in ln]
    assert warnings == [f"[flowrl] WARNING: {said}; the per-tag table shows the tags it scored"]
    assert said in (out / "report.html").read_text().replace("&#x27;", "'")


@pytest.mark.parametrize("args, message", [
    (["--suite", "genevel"], r"unknown suite 'genevel'; valid suites: .*geneval"),
    (["--rewards", "digitz"], r"--rewards: unknown reward 'digitz'; valid rewards"),
    (["--config", "recipes/sd3_group_pickscore.yaml"], r"the models are on different pipelines \(.*digits.*sd3"),
])
def test_bad_input_is_one_line(run_and_report, args, message, capsys):
    import re

    _, run, _, _ = run_and_report
    assert main(["eval", "--run", str(run), "--per-prompt", "2", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err


def test_legacy_json_is_unchanged(run_and_report, capsys):
    """``flowrl eval --run R --per-prompt N`` still prints its one-model JSON (README, scripts)."""
    _, run, _, _ = run_and_report
    assert main(["eval", "--run", str(run), "--per-prompt", "2", "--steps", "2"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert {"samples", "steps", "reward_mean", "reward_std", "reward/digits"} <= set(res) and res["samples"] == 20


# ---------------------------------------------------------------- a real browser
CHROMIUM = next((b for b in ("/usr/bin/chromium", shutil.which("chromium") or "", shutil.which("chromium-browser") or "")
                 if b and os.access(b, os.X_OK)), None)


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (Debian: apt-get install chromium; `make setup` "
                                             "installs it as root): the report's browser check is skipped")
def test_report_opens_in_headless_chromium_without_errors(first, run_and_report, tmp_path):
    _, _, out, _ = run_and_report
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
           "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000", "--dump-dom",
           (out / "report.html").resolve().as_uri()]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'data-report-ok="1"' in r.stdout  # the page's script ran to its end
    console = [ln for ln in r.stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln
               or "Refused to" in ln or "net::ERR" in ln]
    assert not console, console  # no script error, no blocked or failed load
    assert r.stdout.count("<img") >= 20
