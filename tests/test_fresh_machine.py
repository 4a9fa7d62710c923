"""A new user's first run: the README's demo path from empty caches, and a non-editable install.

The demo test runs the same CLI verbs and recipe as ``make demo``, shortened only by overrides
(few pretraining steps, 2 iterations), with HOME and every cache pointing at new empty
directories: the digits base, its report and the reward's classifier are all built from nothing.
"""
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path


from conftest import tiny_train_overrides
from flowrl.layers import SOURCE_ROOTS  # source folder -> installed package
from helpers import cli_verbs

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


def clean_copy(dst: Path) -> Path:
    """The files a clone of this checkout holds (tracked, plus new files git does not ignore): no
    ``build/``, ``*.egg-info`` or caches from this machine reach the wheel."""
    r = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                       capture_output=True, text=True, check=True)
    for rel in filter(None, r.stdout.split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    return dst


def test_wheel_from_clean_copy_runs_without_editable_install(tmp_path, tiny_digits_dir):
    """``pip install .`` as a cluster user runs it: a wheel built from a clean copy, installed
    non-editable into a new virtual environment that cannot see this checkout or its editable
    finder (the dependencies come from this environment's site-packages as a plain path). Every
    module of the source tree is in the wheel and imports there; the CLI runs ``--help``,
    ``plan`` and a digits training step from a directory outside the checkout."""
    src = clean_copy(tmp_path / "src")
    wheels = tmp_path / "wheels"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(wheels), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    wheel = next(wheels.glob("flowrl-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {f"{pkg.replace('.', '/')}/{f.relative_to(ROOT / folder).as_posix()}" for folder, pkg in SOURCE_ROOTS.items()
            for f in (ROOT / folder).rglob("*.py") if "__pycache__" not in f.parts}
    assert not want - names, f"modules missing from the wheel: {sorted(want - names)}"
    recipes = {Path(n).name for n in names if n.startswith("flowrl/recipes/") and n.endswith(".yaml")}
    assert recipes == {p.name for p in (ROOT / "recipes").glob("*.yaml")}
    sets_dir = ROOT / "flowrl" / "data" / "prompt_sets"  # shipped prompt sets, editing images in subfolders included
    prompt_sets = {p.relative_to(sets_dir).as_posix() for p in sets_dir.rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts}
    missing = {f"flowrl/data/prompt_sets/{n}" for n in prompt_sets} - names
    assert not missing, f"prompt set files missing from the wheel: {sorted(missing)}"
    assert not any(n.split("/")[0] in ("pipelines", "rewards", "recipes", "tests") for n in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    vpy = venv / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(vpy), "install", "-q", "--no-deps",
                        "--no-index", str(wheel)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    site = Path(subprocess.run([str(vpy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # the dependencies: this environment's site-packages as plain paths (their .pth files, among them
    # the editable finder of this checkout, are not processed)
    deps = {p for p in sys.path if p.endswith("site-packages")}
    (site / "zz_flowrl_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")

    env = fresh_env(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    modules = sorted(n[:-3].replace("/", ".").removesuffix(".__init__") for n in names
                     if n.endswith(".py") and n.startswith("flowrl/") and not n.endswith("__main__.py"))
    probe = ("import importlib, sys; from pathlib import Path; import flowrl; "
             "assert Path(flowrl.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve()), flowrl.__file__; "
             "finders = [repr(f) for f in sys.meta_path if 'editable' in repr(f).lower()]; "
             "assert not finders, finders; "
             "[importlib.import_module(m) for m in sys.argv[2:]]; "
             "from flowrl.trainers.config import load_config; from flowrl.trainers.config_text import shipped_recipes; "
             "names = [p.stem for p in shipped_recipes()]; [load_config(n) for n in names]; "
             "print(len(names), len(load_config('digits').data.train_prompts()))")
    r = subprocess.run([str(vpy), "-c", probe, str(site), *modules], cwd=elsewhere, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    n_recipes, n_prompts = map(int, r.stdout.split())
    assert n_recipes == len(recipes) and n_prompts > 0

    flowrl = [str(venv / "bin" / "flowrl")]
    run = lambda *a: subprocess.run([*flowrl, *a], cwd=elsewhere, env=env, capture_output=True,  # noqa: E731
                                    text=True, timeout=600)
    r = run("--help")
    assert r.returncode == 0 and {"train", "plan"} <= cli_verbs(r.stdout), r.stderr[-3000:]
    r = run("plan", "--config", "sd3_group_pickscore", "--gpus", "8")
    assert r.returncode == 0 and "GiB" in r.stdout, r.stderr[-3000:]
    # a recipe found by name from any directory; a missing model path fails after the recipe loaded
    r = run("train", "--config", "recipes/digits.yaml", "--output-dir", str(tmp_path / "bad"),
            f"model.path={tmp_path / 'missing'}")
    assert r.returncode == 2 and "flowrl pretrain-digits" in r.stderr, r.stderr[-2000:]
    out = tmp_path / "run"
    r = run("train", "--config", "digits", "--output-dir", str(out),
            *tiny_train_overrides(tiny_digits_dir, **{"train.iterations": 1}))
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(rec.get("iteration") == 0 and "loss" in rec for rec in recs), recs
    assert (out / "checkpoints").is_dir() and (out / "summary.json").is_file()


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
