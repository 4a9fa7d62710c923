"""A new user's first run: the README's demo path from empty caches, and a non-editable install.

The demo test runs the same CLI verbs and recipe as ``make demo``, shortened only by overrides
(few pretraining steps, 2 iterations), with HOME and every cache pointing at new empty
directories: the digits base, its report and the reward's classifier are all built from nothing.
"""
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def fresh_env(tmp_path: Path) -> dict:
    env = dict(os.environ)
    for var in ("HOME", "FLOWRL_HOME", "HF_HOME", "XDG_CACHE_HOME"):
        d = tmp_path / var.lower()
        d.mkdir()
        env[var] = str(d)
    env["HF_HUB_OFFLINE"] = "1"
    env.pop("PYTHONPATH", None)
    return env


def flowrl_cmd() -> list[str]:
    script = Path(sys.executable).parent / "flowrl"  # the console script `make demo` calls
    return [str(script)] if script.is_file() else [sys.executable, "-m", "flowrl"]


def test_demo_path_from_empty_caches(tmp_path):
    env = fresh_env(tmp_path)
    run = lambda *a: subprocess.run([*flowrl_cmd(), *a], cwd=ROOT, env=env, capture_output=True,  # noqa: E731
                                    text=True, timeout=600)
    r = run("pretrain-digits", "--steps", "20")
    assert r.returncode == 0, r.stderr[-3000:]
    home = Path(env["FLOWRL_HOME"])
    report = json.loads(r.stdout[r.stdout.rindex("{\n  \"guidance_"):])  # the sample-grid report
    assert set(report) >= {"guidance_1", "guidance_3", "grid"}
    assert (home / "digits-base-v1" / "samples.png").is_file()
    assert (home / "digits-classifier-v1.safetensors").is_file()  # trained from nothing, inside no_grad
    out = tmp_path / "runs" / "demo"
    r = run("train", "--config", "recipes/digits.yaml", "--output-dir", str(out), "--resume",
            "train.iterations=2")
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(rec.get("iteration", -1) for rec in recs) >= 1


def test_wheel_install_finds_shipped_recipes_and_prompt_sets(tmp_path):
    pip = [sys.executable, "-m", "pip"]
    if subprocess.run([*pip, "--version"], capture_output=True).returncode != 0:
        pytest.fail("pip is needed to build the wheel")
    wheels = tmp_path / "wheels"
    r = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(ROOT)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    wheel = next(wheels.glob("flowrl-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    recipes = {Path(n).name for n in names if n.startswith("flowrl/recipes/") and n.endswith(".yaml")}
    assert recipes == {p.name for p in (ROOT / "recipes").glob("*.yaml")}
    assert "flowrl/data/prompt_sets/flowgrpo_ocr_sample.txt" in names
    target = tmp_path / "site"
    r = subprocess.run([*pip, "install", "-q", "--no-deps", "--no-compile", "--target", str(target), str(wheel)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    env = fresh_env(tmp_path)
    env["PYTHONPATH"] = str(target)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = ("import flowrl, sys; from pathlib import Path; "
             "assert Path(flowrl.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve()), flowrl.__file__; "
             "from flowrl.trainers.config import load_config, shipped_recipes; "
             "names = [p.stem for p in shipped_recipes()]; [load_config(n) for n in names]; "
             "cfg = load_config('recipes/sd3_gdro_ocr.yaml'); "
             "cfg = load_config('digits'); print(len(names), len(cfg.data.train_prompts()))")
    r = subprocess.run([sys.executable, "-c", probe, str(target)], cwd=elsewhere, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    n_recipes, n_prompts = map(int, r.stdout.split())
    assert n_recipes == len(recipes) and n_prompts > 0
    # the CLI finds the recipe from any directory: it fails on the model path, after the recipe loaded
    r = subprocess.run([sys.executable, "-m", "flowrl", "train", "--config", "recipes/digits.yaml", "--output-dir",
                        str(tmp_path / "run"), f"model.path={tmp_path / 'missing'}"], cwd=elsewhere, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "flowrl pretrain-digits" in r.stderr, r.stderr[-2000:]


def test_first_use_builds_inside_no_grad(tmp_path):
    """The classifier and the base are trained on first use, also inside no_grad / inference_mode."""
    import torch

    from flowrl.pipelines.digits import PretrainConfig, pretrain_digits
    from flowrl.rewards.digits import CLASSIFIER_FILE, load_classifier

    with torch.no_grad():
        load_classifier(tmp_path)
    assert (tmp_path / CLASSIFIER_FILE).is_file()
    with torch.inference_mode():
        pretrain_digits(tmp_path / "base", PretrainConfig(steps=2, batch_size=4), progress=False)
    assert (tmp_path / "base" / "transformer").is_dir()
