"""A run's life as the command line sees it: a finished run is immutable to ``--resume`` (raising
``train.iterations`` extends it), summaries and plots tie "before" / "after" to their iterations,
SIGTERM and Ctrl-C checkpoint and say how to continue, reward-health warnings, the world-size note,
text-embedding caches of different model settings side by side, logs without carriage returns."""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_train_overrides
from flowrl.checkpoints.common import list_checkpoints
from flowrl.cli import main

RECIPE = "recipes/digits.yaml"


def _hashes(run: Path) -> dict:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file()}


def _train_argv(run, model, *extra, **over):
    return ["train", "--config", RECIPE, "--output-dir", str(run), *extra, *tiny_train_overrides(model, **over)]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def test_resume_of_a_finished_run_touches_nothing_and_more_iterations_extend_it(tiny_digits_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(_train_argv(run, tiny_digits_dir)) == 0  # 3 iterations, evaluations at 0, 2 and 3
    capsys.readouterr()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval_before_iteration"] == 0 and summary["eval_after_iteration"] == 3
    assert summary["eval_reward_after"] == next(r["eval/reward"] for r in _metrics(run)
                                                if r["iteration"] == 3 and "eval/reward" in r)
    before = _hashes(run)
    assert {"metrics.jsonl", "summary.json", "reward_curve.png", "before_after.png", "config.yaml"} <= set(before)

    assert main(_train_argv(run, tiny_digits_dir, "--resume")) == 0
    out, err = capsys.readouterr()
    assert "is finished (iteration 3 of 3)" in err and "nothing changed" in err and "train.iterations" in err
    assert json.loads(out) == summary
    assert _hashes(run) == before  # byte for byte, every file

    assert main(_train_argv(run, tiny_digits_dir, "--resume", **{"train.iterations": 4})) == 0
    capsys.readouterr()
    recs = _metrics(run)
    evals = [r["iteration"] for r in recs if "eval/reward" in r]
    assert evals == [0, 2, 3, 4]  # the evaluation at the resumed checkpoint (3) is kept, 4 is new
    assert [r["iteration"] for r in recs if "reward_mean" in r] == [0, 1, 2, 3]
    extended = json.loads((run / "summary.json").read_text())
    assert extended["iterations_done"] == 4 and extended["eval_after_iteration"] == 4
    state = json.loads((list_checkpoints(run / "checkpoints")[-1] / "trainer_state.json").read_text())
    assert state["num_processes"] == 1  # the world size the checkpoint was written by


class _Signalling:
    """An OnlineTrainer that sends itself ``sig`` during iteration 0."""

    @staticmethod
    def make(sig):
        from flowrl.trainers.online import OnlineTrainer

        class T(OnlineTrainer):
            def run_unit(self, i):
                out = super().run_unit(i)
                if i == 0:
                    os.kill(os.getpid(), sig)
                return out
        return T


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_with_a_checkpoint_and_no_after_from_iteration_zero(tiny_digits_dir, tmp_path, sig):
    from flowrl.trainers.config import load_config

    run = tmp_path / "run"
    old = signal.getsignal(sig)
    cfg = load_config(RECIPE, tiny_train_overrides(tiny_digits_dir, **{"train.iterations": 5,
                                                                        "train.checkpoint_every": 100}))
    summary = _Signalling.make(sig)(cfg, run).train()
    assert signal.getsignal(sig) is old  # the handler is given back
    assert summary["stopped_early"] is True and summary["stopped_by"] == sig.name
    assert [c.name for c in list_checkpoints(run / "checkpoints")] == ["iter_000001"]
    # the only evaluation is iteration 0's: no "after" claimed, no plot of iteration 0 against itself
    assert summary["eval_before_iteration"] == 0 and "eval_after_iteration" not in summary
    assert "eval_reward_after" not in summary and summary["eval_reward_before"] is not None
    assert not (run / "before_after.png").exists()


def test_ctrl_c_in_a_subprocess_checkpoints_and_prints_the_resume_command(tiny_digits_dir, tmp_path):
    run = tmp_path / "run"
    argv = _train_argv(run, tiny_digits_dir, **{"train.iterations": 50, "train.checkpoint_every": 100,
                                                 "logging.progress": "true"})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "flowrl", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None and not (
            (run / "metrics.jsonl").exists() and "reward_mean" in (run / "metrics.jsonl").read_text()):
        time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "\r" not in err  # a redirected log: plain progress lines
    assert "Ctrl-C: finishing this iteration" in err
    resume = [ln for ln in err.splitlines() if "continue with:" in ln]
    assert len(resume) == 1 and resume[0].endswith(shlex.join(["flowrl", "train", "--resume", *argv[1:]])), resume
    assert json.loads(out)["stopped_by"] == "SIGINT"
    ck = list_checkpoints(run / "checkpoints")
    assert len(ck) == 1 and 1 <= int(ck[0].name.split("_")[1]) < 50


def test_ctrl_c_before_training_says_whether_there_is_a_checkpoint(monkeypatch, tmp_path, capsys):
    import flowrl.trainers.online as online

    def interrupted(cfg, out, resume=False):
        raise KeyboardInterrupt
    monkeypatch.setattr(online, "train", interrupted)
    argv = ["train", "--config", RECIPE, "--output-dir", str(tmp_path / "r"), "logging.trackers=[]"]
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "before a checkpoint was written" in err
    (tmp_path / "r" / "checkpoints" / "iter_000002").mkdir(parents=True)
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "iter_000002" in err and "continue with: flowrl train --resume --config" in err


def _stub(weights=None, main_process=True):
    return SimpleNamespace(acc=SimpleNamespace(is_main_process=main_process, num_processes=1), unit="iteration",
                           cfg=SimpleNamespace(reward=SimpleNamespace(weights=weights or {"digits": 1.0})),
                           _warned=set())


def test_reward_health_warns_once_each(capsys):
    from flowrl.trainers.online import OnlineTrainer

    t = _stub()
    healthy = {"iteration": 0, "nonfinite_rewards": 1, "samples_gathered": 80, "zero_var_fraction": 0.1}
    OnlineTrainer._warn_reward_health(t, healthy)
    assert capsys.readouterr().err == ""
    sick = {"iteration": 1, "nonfinite_rewards": 64, "samples_gathered": 80, "zero_var_fraction": 0.8}
    OnlineTrainer._warn_reward_health(t, sick)
    OnlineTrainer._warn_reward_health(t, {**sick, "iteration": 2})
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    assert "64 of 80 rewards are NaN/inf" in lines[0] and "data.prompts" in lines[0]
    assert "80% of the groups" in lines[1] and "zero variance" in lines[1]


def test_iterations_without_a_finite_reward_stop_the_run():
    """The first iteration with no finite reward stops a run that never had one; after finite rewards, only
    train.max_consecutive_skips such iterations in a row do (an unlucky batch of prompts goes on)."""
    import torch

    from flowrl.trainers.online import OnlineTrainer
    from flowrl.trainers.steps import TrainingStopped

    nan, ok = torch.full((8,), float("nan")), torch.tensor([0.5, float("nan")] * 4)
    t = _stub()
    t.cfg.train, t._given_reward, t._scored_any, t._unscored_in_a_row = SimpleNamespace(max_consecutive_skips=3), \
        None, False, 0
    with pytest.raises(TrainingStopped, match=r"iteration 0: all 8 rewards are NaN/inf \(from the first iteration "
                                              r"on\): reward digits scored no sample"):
        OnlineTrainer._require_scores(t, nan, 0)
    t._unscored_in_a_row = 0
    OnlineTrainer._require_scores(t, ok, 1)  # a finite reward: later all-NaN iterations are counted
    OnlineTrainer._require_scores(t, nan, 2)
    OnlineTrainer._require_scores(t, nan, 3)
    OnlineTrainer._require_scores(t, ok, 4)  # the count starts again
    OnlineTrainer._require_scores(t, nan, 5)
    OnlineTrainer._require_scores(t, nan, 6)
    with pytest.raises(TrainingStopped, match=r"iteration 7: all 8 rewards are NaN/inf \(3 iterations in a row\)"):
        OnlineTrainer._require_scores(t, nan, 7)


def test_resuming_on_another_number_of_processes_is_noted(capsys):
    from flowrl.trainers.trainer import Trainer

    t = _stub()
    t.strategy = SimpleNamespace(layout=SimpleNamespace(dp_size=1))  # one data-parallel replica now
    Trainer._note_world_size(t, 1)
    Trainer._note_world_size(t, None)  # a checkpoint from before the count was recorded
    assert capsys.readouterr().err == ""
    Trainer._note_world_size(t, 2)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "written by 2 data-parallel replica(s) and resumes on 1" in err and "per replica" in err


def test_reward_curve_and_before_after_name_what_they_show(tiny_digits_dir, tmp_path, monkeypatch):
    import flowrl.trainers.reporting as reporting
    from flowrl.trainers.run_dir import RunDirectory
    from flowrl.trainers.config import load_config

    figures = []
    monkeypatch.setattr(reporting, "save_figure", lambda fig, path, dpi=110: figures.append((Path(path).name, fig)))
    cfg = load_config(RECIPE, tiny_train_overrides(tiny_digits_dir, **{"reward.weights": "{digits: 0.7, "
                                                                                          "jpeg_compressibility: 0.3}"}))
    run = tmp_path / "run"
    (run / "samples").mkdir(parents=True)
    recs = [{"iteration": 0, "eval/reward": 0.5}, {"iteration": 0, "reward_mean": 0.4},
            {"iteration": 1, "reward_mean": 0.6}, {"iteration": 2, "eval/reward": 0.7}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    from flowrl.utils.io import save_png
    import numpy as np

    for i in (0, 2):
        save_png(np.zeros((8, 8, 3), np.uint8), run / "samples" / f"eval_{i:06d}.png")
    out = RunDirectory(run, cfg, resume=True, resume_free=set()).report("digits / group")
    assert out["eval_before_iteration"] == 0 and out["eval_after_iteration"] == 2
    names = dict(figures)
    curve = names["reward_curve.png"]
    assert "0.7 x digits + 0.3 x jpeg_compressibility" in curve.axes[0].get_title()
    for ax in curve.axes:
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert [ax.get_title() for ax in names["before_after.png"].axes] == ["before (iteration 0)", "after (iteration 2)"]


def test_text_caches_of_two_model_settings_live_side_by_side(tiny_digits_dir, tmp_path):
    """A test on one model, then the real one, in the same model.text_embedding_cache directory (the
    recipes' relative ``cache/NAME``): each gets its cache, neither refuses the other."""
    from flowrl.data.embeddings import INDEX, attach_text_cache, model_fingerprint
    from flowrl.pipelines.digits import DigitsPolicy

    where = tmp_path / "cache"
    prompts = ["a handwritten digit 1", "a handwritten digit 2"]
    fps = []
    for guidance in (1.0, 3.0):  # two model settings (the fingerprint covers path, guidance, options)
        mc = SimpleNamespace(text_embedding_cache=str(where), pipeline="digits", path=str(tiny_digits_dir),
                             guidance_scale=guidance, options={}, drop_text_encoders=False)
        fps.append(model_fingerprint({"pipeline": "digits", "path": str(tiny_digits_dir), "guidance_scale": guidance,
                                      "options": {}}))
        pol = DigitsPolicy.from_pretrained(tiny_digits_dir, guidance_scale=guidance)
        cached = attach_text_cache(pol, mc, prompts)
        assert len(cached.text_embedding_cache) == 2
    assert json.loads((where / INDEX).read_text())["fingerprint"] == fps[0]
    assert json.loads((where / fps[1] / INDEX).read_text())["fingerprint"] == fps[1]
    # and the first setting still opens its own
    mc = SimpleNamespace(text_embedding_cache=str(where), pipeline="digits", path=str(tiny_digits_dir),
                         guidance_scale=1.0, options={}, drop_text_encoders=False)
    assert attach_text_cache(DigitsPolicy.from_pretrained(tiny_digits_dir), mc, prompts).text_embedding_cache.directory == where


def test_a_redirected_log_turns_off_the_diffusers_bars(capsys):
    """stderr not a terminal (a log): diffusers' "Loading pipeline components..." bars are off."""
    import diffusers.utils.logging as dl

    dl.enable_progress_bar()
    try:
        assert main(["train", "--config", "nope.yaml", "--output-dir", "x"]) == 2  # the setting comes first
        assert not dl.is_progress_bar_enabled()
    finally:
        dl.enable_progress_bar()


def test_digits_on_text_prompts_stops_at_the_first_iteration(tiny_digits_dir, tmp_path):
    """The digits reward scores only "a handwritten digit N": on other prompts every reward is NaN, so the
    run stops at its first iteration saying which reward scored nothing and why."""
    from flowrl.trainers.config import load_config
    from flowrl.trainers.online import train
    from flowrl.trainers.steps import TrainingStopped

    with pytest.raises(TrainingStopped, match="all 16 rewards are NaN/inf .*reward digits scored no sample"):
        train(load_config(RECIPE, tiny_train_overrides(tiny_digits_dir, **{
            "train.iterations": 1, "data.prompts": "[a photo of a cat, a red apple on a table]"})), tmp_path / "run")


def test_training_grid_has_a_row_per_prompt_with_its_text_and_sources():
    """The training sample grid (samples/train_*.png): a row per prompt, as long as the shortest, labelled
    with its text and, for an edit, led by its source; at most 8 x 8."""
    from flowrl.data.items import PromptItem
    from flowrl.trainers.reporting import rollout_rows

    src = torch.zeros(3, 4, 4)
    prompts = ["a 1", PromptItem("turn it into a 2", source=src), "a 3"]
    images = torch.arange(7.0).view(7, 1, 1, 1).expand(7, 3, 4, 4)  # sample n has value n
    idx = torch.tensor([1, 0, 1, 0, 1, 2, 2])  # prompt 1 first in sampling order
    grid, ncol, labels, sources = rollout_rows(images, idx, prompts)
    assert ncol == 2 and labels == ["turn it into a 2", "a 1", "a 3"]
    assert [v.item() for v in grid[:, 0, 0, 0]] == [0, 2, 1, 3, 5, 6]
    assert sources[0] is not None and sources[0].shape == (3, 4, 4) and sources[1] is None and sources[2] is None
    many = torch.arange(100).repeat_interleave(10)  # 100 prompts x 10 samples
    grid, ncol, labels, _ = rollout_rows(torch.rand(1000, 3, 2, 2), many, [f"p{i}" for i in range(100)])
    assert grid.shape[0] == 64 and ncol == 8 and labels == [f"p{i}" for i in range(8)]
