"""Crash safety: SIGKILL at chosen and random points, SIGTERM, corrupt checkpoints."""
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_train_overrides
from flowrl.checkpoints.common import list_checkpoints

N_ITER = 4


def _cmd(run, model_dir, resume=False, **extra):
    ov = tiny_train_overrides(model_dir, **{"train.lr": 1e-2, "train.iterations": N_ITER, **extra})
    return [sys.executable, "-m", "flowrl", "train", "--config", "recipes/digits.yaml", "--output-dir", str(run),
            *(["--resume"] if resume else []), *ov]


def _env(fault=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("FLOWRL_FAULT", None)
    if fault:
        env["FLOWRL_FAULT"] = fault
    return env


def _final_weights(run):
    return load_file(str(list_checkpoints(run / "checkpoints")[-1] / "trainable.safetensors"))


def _assert_no_half_written(run):
    for d in (run / "checkpoints").iterdir():
        if d.name.startswith("iter_"):  # a visible checkpoint is always complete
            assert {"trainable.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= \
                {f.name for f in d.iterdir()}, d


@pytest.fixture(scope="module")
def reference_weights(tiny_digits_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("ref") / "run"
    r = subprocess.run(_cmd(run, tiny_digits_dir), capture_output=True, text=True, env=_env(), timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return _final_weights(run)


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_kill_points_then_resume_equals_uninterrupted(tiny_digits_dir, tmp_path, reference_weights):
    run = tmp_path / "run"
    kills = 0
    for fault in ("after_rollout:1", "checkpoint_mid:2", "checkpoint_before_rename:3", "after_update:3"):
        r = subprocess.run(_cmd(run, tiny_digits_dir, resume=True), capture_output=True, text=True,
                           env=_env(fault), timeout=600)
        assert r.returncode == -signal.SIGKILL, (fault, r.returncode, r.stderr[-2000:])
        kills += 1
        _assert_no_half_written(run)
    r = subprocess.run(_cmd(run, tiny_digits_dir, resume=True), capture_output=True, text=True, env=_env(), timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert kills == 4 and _equal(_final_weights(run), reference_weights)
    its = [json.loads(l)["iteration"] for l in (run / "metrics.jsonl").read_text().splitlines() if "reward_mean" in l]
    assert its == list(range(N_ITER))  # redone iterations are not logged twice


def _checkpoint_iterations(run):
    ck = run / "checkpoints"
    return [int(c.name.split("_")[1]) for c in list_checkpoints(ck)] if ck.exists() else []


def _wait_for_new_checkpoint(run, p, seen, timeout=300.0):
    """Poll until a checkpoint newer than ``seen`` is visible; False if ``p`` ended or time ran out."""
    deadline = time.time() + timeout
    while time.time() < deadline and p.poll() is None:
        if max(_checkpoint_iterations(run), default=0) > seen:
            return True
        time.sleep(0.05)
    return False


def test_random_sigkill_then_resume(tiny_digits_dir, tmp_path, reference_weights):
    """SIGKILLs at random moments (0-0.5 s) after a new checkpoint appears, then a resume ends on the
    uninterrupted run's weights. The first kill follows the first checkpoint at once (three iterations
    are still to run, so it lands mid-run); later ones may find the run finished (a fast machine), which
    ends the kills; every kill that is sent is checked to have landed before the run's end."""
    run = tmp_path / "run"
    rng = random.Random(1234)
    landed = 0
    for attempt in range(2):
        seen = max(_checkpoint_iterations(run), default=0)
        p = subprocess.Popen(_cmd(run, tiny_digits_dir, resume=True), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env=_env())
        try:
            new = _wait_for_new_checkpoint(run, p, seen)
            assert new or attempt > 0, f"no checkpoint after {seen} (exit code {p.poll()})"
            time.sleep(rng.uniform(0.0, 0.5) if attempt else 0.0)
            if p.poll() is not None:  # finished in the meantime: nothing left to interrupt
                break
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=60)
        assert p.returncode == -signal.SIGKILL
        assert not (run / "summary.json").exists()  # killed before the end of training
        assert seen < max(_checkpoint_iterations(run)) <= N_ITER  # the new checkpoint survived the kill
        _assert_no_half_written(run)
        landed += 1
    assert landed >= 1
    r = subprocess.run(_cmd(run, tiny_digits_dir, resume=True), capture_output=True, text=True, env=_env(), timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert _equal(_final_weights(run), reference_weights)


def test_sigterm_checkpoints_and_exits_zero(tiny_digits_dir, tmp_path):
    run = tmp_path / "run"
    p = subprocess.Popen(_cmd(run, tiny_digits_dir, **{"train.iterations": 50, "train.checkpoint_every": 100}),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env())
    deadline = time.time() + 300
    while time.time() < deadline and not any("reward_mean" in l for l in
                                              ((run / "metrics.jsonl").read_text().splitlines()
                                               if (run / "metrics.jsonl").exists() else [])):
        time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-2000:]
    assert "SIGTERM" in err
    ck = list_checkpoints(run / "checkpoints")
    assert len(ck) == 1 and 1 <= int(ck[0].name.split("_")[1]) < 50  # written at the stop, not at the end
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_early"] is True and summary["stopped_by"] == "SIGTERM"
    # "after" is an evaluation after training, named by its iteration, never iteration 0's again
    assert summary.get("eval_after_iteration", 1) > 0 and summary["eval_before_iteration"] == 0
    assert ("eval_reward_after" in summary) == (run / "before_after.png").exists() == ("eval_after_iteration" in summary)
    assert "continue with: flowrl train --resume --config recipes/digits.yaml" in err


def test_corrupt_newest_checkpoint_falls_back(tiny_digits_dir, tmp_path):
    from flowrl.trainers.config import load_config
    from flowrl.trainers.online import OnlineTrainer, train

    run = tmp_path / "run"
    train(load_config("recipes/digits.yaml", tiny_train_overrides(tiny_digits_dir, **{"train.iterations": 2})), run)
    ck = list_checkpoints(run / "checkpoints")
    assert [c.name for c in ck] == ["iter_000001", "iter_000002"]
    (ck[-1] / "trainable.safetensors").write_bytes(b"garbage")
    t = OnlineTrainer(load_config("recipes/digits.yaml", tiny_train_overrides(tiny_digits_dir, **{"train.iterations": 3})),
                      run, resume=True)
    t.setup()
    assert t.start_iteration == 1  # resumed from the previous, readable checkpoint
    for c in ck:
        (c / "optimizer.pt").write_bytes(b"")
    from flowrl.checkpoints.common import CheckpointError

    with pytest.raises(CheckpointError, match="no readable checkpoint"):
        OnlineTrainer(load_config("recipes/digits.yaml",
                                  tiny_train_overrides(tiny_digits_dir, **{"train.iterations": 3})), run,
                      resume=True).setup()


@pytest.mark.parametrize("launched", [True, False])
def test_finish_flushes_then_skips_finalization_under_a_launcher(tmp_path, launched):
    """`flowrl.utils.launch.finish`: under torchrun / accelerate launch (WORLD_SIZE and RANK set) the exit
    code, buffered standard output and logging survive `os._exit`, and no atexit hook (finalization) runs;
    without a launcher the process exits the ordinary way."""
    code = ("import atexit, logging, sys; from flowrl.utils.launch import finish; "
            "atexit.register(lambda: print('finalized')); logging.basicConfig(filename=sys.argv[1]); "
            "logging.warning('kept'); sys.stdout.write('out'); finish(3)")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    if launched:
        env.update(WORLD_SIZE="2", RANK="1")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "log")], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 3, r.stderr
    assert (tmp_path / "log").read_text().strip().endswith("kept")
    assert r.stdout == ("out" if launched else "outfinalized\n")
