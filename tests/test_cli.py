import re
import subprocess
import sys

import pytest

from helpers import cli_verbs


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "flowrl", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("override,match", [
    ("train.lrr=1", "Did you mean train.lr"),
    ("sampler.name=nope", "unknown sampler"),
    ("reward.weights={nope: 1}", "unknown reward"),
])
def test_bad_input_fails_fast_with_clear_message(tmp_path, override, match):
    # model.path points nowhere: the error must come from the config, before any model loads
    r = run("train", "--config", "recipes/digits.yaml", "--output-dir", str(tmp_path / "run"),
            f"model.path={tmp_path / 'missing'}", override)
    assert r.returncode == 2, r.stderr
    assert match in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


def test_missing_model_path(tmp_path):
    r = run("train", "--config", "recipes/digits.yaml", "--output-dir", str(tmp_path / "run"),
            f"model.path={tmp_path / 'missing'}", "logging.trackers=[]")
    assert r.returncode == 2 and "flowrl pretrain-digits" in r.stderr
    assert not (tmp_path / "run" / "config.yaml").exists()  # a failed start claims no run dir


def test_help_lists_verbs():
    r = run("--help")
    assert r.returncode == 0, r.stderr
    verbs = cli_verbs(r.stdout)  # exact names: "train" is not found inside "pretrain-digits"
    assert {"train", "pretrain-digits", "sample", "eval", "make-tiny", "export", "bench", "plan"} <= verbs, verbs
    for verb in verbs:  # each listed with its description (on the next line when the name is long)
        assert re.search(rf"^ +{re.escape(verb)}( +\S|\n {{8,}}\S)", r.stdout, re.M), f"no description for {verb!r}"


@pytest.mark.parametrize("args,match", [
    (["--pipeline", "sd35m-arch"], "needs a CUDA GPU"),
    (["--pipeline", "sd3-mid", "--backends", "fp8"], "int8-dynamic"),
])
def test_missing_hardware_is_one_clear_line(args, match):
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA: the hardware is not missing")
    r = run("bench", "precision", *args)
    assert r.returncode == 2 and match in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
