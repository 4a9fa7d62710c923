"""The documentation's commands run as printed, in the order printed.

Every ```bash / ```sh / ```console block of README.md and docs/*.md is run, command after command,
with bash in a fresh working directory per file (and a private, empty ``FLOWRL_HOME``), or is
marked on purpose by an HTML comment on the line before it, which this test reports as a skip:

    <!-- docs-run: gpu-only: why -->     needs a CUDA GPU (or several)
    <!-- docs-run: skip: why -->         needs something else this machine cannot give (the network)

The commands are the documented ones at full size (real budgets, hub models, GPU launchers); the
table ``SUBSTITUTIONS`` below is every change this test makes before running one, each with its
reason: it shrinks sizes and budgets, and never rewrites what a command does (a multi-GPU launch
is marked gpu-only: on a CPU it would start one training process per GPU of its config). A README that says a command writes a file is checked too: the
README's working directory holds exactly what its comments name.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "console"}
MARKER = re.compile(r"^<!--\s*docs-run:\s*(gpu-only|skip)\s*:\s*(.+?)\s*-->\s*$")
FENCE = re.compile(r"^```\s*([\w+-]*)\s*$")

DIGITS_RUN = ("train.batch_size=16 train.minibatch_size=16 sampler.num_steps=4 data.eval_seeds_per_prompt=2 "
              "logging.eval_every=100 logging.progress=false")
GDRO = ("offline.groups_per_prompt=1 offline.k=2 offline.num_steps=2 offline.batch_groups=5 offline.epochs=1 "
        "offline.eval_steps=2 offline.eval_every=100 data.eval_seeds_per_prompt=2 train.grad_accum=1 "
        "logging.progress=false")
SFT_DPO = ("offline.max_steps=1 offline.batch_groups=2 offline.eval_steps=2 offline.eval_every=100 "
           "data.eval_seeds_per_prompt=2 logging.progress=false")
# flat GRPO and the method only, 16 samples per iteration (tempflow: its recipe's 64, one tree per prompt)
BENCH_SHRINK = {"branch": "--variants flat_grpo branch train.batch_size=16",
                "tempflow": "--variants flat_grpo tempflow",
                "sol": "--variants flat_grpo sol_nft_int8 train.batch_size=16",
                "preference": "--variants flat_grpo online_dpo train.batch_size=16"}
OFFLINE_BENCH = " ".join(f"--offline-override {o}" for o in GDRO.split()) + \
    " --online-override data.eval_seeds_per_prompt=2 --online-override train.batch_size=16 " \
    "--online-override sampler.group_size=4 --online-override train.minibatch_size=16"

# (pattern, replacement, why): applied in order to every command; the replacement may be a function
SUBSTITUTIONS = [
    (r"^(flowrl pretrain-digits)$", r"\1 --steps 20", "600 pretraining steps: 20 (the model is a placeholder here)"),
    (r"^(flowrl train (?!.*--smoke).*recipes/digits\.yaml.*?)(\s+#.*)?$",
     lambda m: f"{m.group(1)} {DIGITS_RUN} train.iterations={2 if '--resume' in m.group(1) else 1}",
     "the digits demo: 1 iteration (2 when resumed) of 16 samples, 4 steps, a small evaluation"),
    (r"^(flowrl (?:generate-offline|train) (?!.*--smoke).*recipes/digits_gdro\.yaml.*?)(\s+#.*)?$",
     lambda m: f"{m.group(1)} {GDRO}", "the GDRO dataset: 10 groups of 2 images, 2 steps; 2 GDRO steps"),
    (r"^(flowrl train (?!.*--smoke).*recipes/digits_(?:sft|dpo_offline)\.yaml.*?)(\s+#.*)?$",
     lambda m: f"{m.group(1)} {SFT_DPO}", "SFT / offline DPO: one step of 2 images (pairs), a small evaluation"),
    (r"^(flowrl eval .*)--per-prompt 32", r"\1--per-prompt 2", "32 samples per prompt: 2"),
    (r"^(flowrl bench precision --pipeline sd3-mid .*?)(\s+#.*)?$", r"\1 --batch 1 --steps 1 --repeats 1",
     "one image, one step, one timed round"),
    (r"^flowrl bench (branch|tempflow|sol|preference) (.*?)--budget \d+(.*?)(\s+#.*)?$",
     lambda m: (f"flowrl bench {m.group(1)} {m.group(2)}--budget 1 --eval-every 1{m.group(3)} "
                f"{BENCH_SHRINK[m.group(1)]} data.eval_seeds_per_prompt=2"),
     "1 training second per variant (one iteration), flat GRPO and the method only, a small evaluation"),
    (r"^flowrl bench methods (.*?)--budget \d+(.*?)(\s+#.*)?$",
     lambda m: re.sub(r"--seeds \d+", "--seeds 2", f"flowrl bench methods {m.group(1)}--budget 1 --eval-every 1"
                      f"{m.group(2)} --methods grpo,nft train.batch_size=16 data.eval_seeds_per_prompt=2"),
     "1 training second per method (one iteration), GRPO and DiffusionNFT only, a small evaluation, 2 seeds at most"),
    (r"^flowrl bench aggregate (.*?)--budget \d+(.*?)(\s+#.*)?$",
     lambda m: (f"flowrl bench aggregate {m.group(1)}--budget 1 --eval-every 1{m.group(2)} train.batch_size=16 "
                f"data.eval_seeds_per_prompt=2"),
     "1 training second per rule (one iteration of 16 samples), a small evaluation"),
    (r"^flowrl bench offline (.*?)--budget \d+(.*?)(\s+#.*)?$",
     lambda m: f"flowrl bench offline {m.group(1)}--budget 1 --eval-every 1{m.group(2)} {OFFLINE_BENCH}",
     "1 compute second per method on the tiny GDRO dataset (GDRO then makes no step and says so)"),
    (r"^flowrl bench reward (.*?)(\s+#.*)?$",
     r"flowrl bench reward \1 --iterations 1 --resolution 64 --prompts 2 --group-size 2 --num-steps 2 --max-batch 2 "
     r"--judge-delay 0.05", "one timed iteration per variant of 4 samples at 64 px, 2 steps; a 50 ms judge"),
    (r"^flowrl bench ocr (.*?)(\s+#.*)?$", r"flowrl bench ocr \1 --images 2 --size 128 --backends rapidocr",
     "two rendered images of 128 px, one engine"),
    (r"--checkpoint iter_000020\b", "--checkpoint iter_000001", "the smoke run's only checkpoint"),
    (r"^python -m flowrl\b", f"{sys.executable} -m flowrl", "this test's Python"),
]
# commands not run, with the reason (their block runs the rest)
NOT_RUN = [(r"^make test\b", "the whole suite, which includes this test")]
# a block that activates an environment: it and every later command of its block run in a new shell, PATH
# without this test's environment, with the activation line first (as a user types them after `make demo`)
ACTIVATE = re.compile(r"^source (\S+)/bin/activate(?:\s+#.*)?$")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    marker: Optional[tuple[str, str]]  # (gpu-only | skip, reason)

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def shell_blocks(path: Path) -> list[Block]:
    """The shell blocks of a markdown file, each with the docs-run marker on the line before it."""
    lines, out, i = path.read_text().splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        if m.group(1) in SHELL:
            prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            mk = MARKER.match(prev)
            out.append(Block(path, i + 1, m.group(1), "\n".join(lines[i + 1:end]),
                             (mk.group(1), mk.group(2)) if mk else None))
        i = end + 1
    return out


def commands(block: Block) -> list[str]:
    """One string per command: continuation lines joined, blank and comment lines dropped (``$ ``
    prompts of a console block stripped, its output lines dropped)."""
    text = block.text.replace("\\\n", " ")
    out = []
    for ln in text.splitlines():
        ln = ln.strip()
        if block.lang == "console":
            if not ln.startswith("$ "):
                continue
            ln = ln[2:]
        if ln and not ln.startswith("#"):
            out.append(re.sub(r"\s+", " ", ln))
    return out


def makefile_target(name: str) -> list[str]:
    """The commands of a Makefile target, as a user's shell would run them after the install step."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"{name}:"))
    body = []
    for ln in lines[start + 1:]:
        if not ln.startswith("\t"):
            break
        body.append(ln.strip().replace("$(VENV)/bin/", ""))
    return body


def activation(block: Block, cmd: str) -> Optional[str]:
    """The ``source VENV/bin/activate`` line at or before ``cmd`` in ``block`` (None: the block has none there)."""
    cmds = commands(block)
    return next((c for c in cmds[:cmds.index(cmd) + 1] if ACTIVATE.match(c)), None)


def new_shell(env: dict, wd: Path, venv: str) -> dict:
    """``env`` as a new shell has it: no entry of this test's environment on PATH; ``wd/venv`` is the
    environment ``make demo`` made (a link to this test's)."""
    ours = {str(Path(sys.executable).parent), str(Path(sys.prefix) / "bin")}
    if not (wd / venv).exists():
        (wd / venv).symlink_to(Path(sys.prefix), target_is_directory=True)
    path = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p and p not in ours)
    return {**{k: v for k, v in env.items() if k != "VIRTUAL_ENV"}, "PATH": path}


def prepare(cmd: str) -> tuple[list[str], Optional[str]]:
    """(the commands to run for one documented command, or the reason it is not run)."""
    for pattern, reason in NOT_RUN:
        if re.search(pattern, cmd):
            return [], reason
    if re.match(r"^make demo\b", cmd):  # the demo is the Makefile's commands (the install step is this venv)
        return [c for target in makefile_target("demo") for c in prepare(target)[0]], None
    for pattern, repl, _why in SUBSTITUTIONS:
        cmd = re.sub(pattern, repl, cmd)
    return [cmd], None


BLOCKS = [b for p in DOCS for b in shell_blocks(p)]
# one test per documented command (a marked block: one skip), in the order printed
COMMANDS = [(b, None) if b.marker else (b, cmd) for b in BLOCKS for cmd in ([None] if b.marker else commands(b))]


def test_markers_are_well_formed():
    """A misspelt marker would silently run (or fail) its block: every docs-run comment parses."""
    for p in DOCS:
        for n, ln in enumerate(p.read_text().splitlines(), 1):
            if "docs-run" in ln:
                assert MARKER.match(ln.strip()), f"{p.name}:{n}: {ln}"
    assert len(BLOCKS) >= 15 and sum(b.marker is None for b in BLOCKS) >= 5


def test_readme_commands_need_the_activation_line(workdirs):
    """The README's "Using it" block starts with the activation, and without it a new shell has no flowrl
    (so the block runs only as printed)."""
    dirs, env = workdirs
    block = next(b for b in shell_blocks(ROOT / "README.md") if any(c.startswith("flowrl train") for c in commands(b)))
    first = commands(block)[0]
    assert ACTIVATE.match(first), first
    shell = new_shell(env, dirs[ROOT / "README.md"], ACTIVATE.match(first).group(1))
    r = subprocess.run(["bash", "-c", "flowrl --help"], cwd=dirs[ROOT / "README.md"], env=shell, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 127, "flowrl ran without the activation line: the test would not check it"
    r = subprocess.run(["bash", "-c", f"{first}\nflowrl --help"], cwd=dirs[ROOT / "README.md"], env=shell,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "usage: flowrl" in r.stdout, r.stderr


def test_substitutions_only_shrink():
    """The table changes sizes, budgets and launchers: the verb and the recipe of a command stay."""
    for b in BLOCKS:
        if b.marker is None:
            for cmd in commands(b):
                for run in prepare(cmd)[0]:
                    verb = lambda c: c.split()[:2]  # noqa: E731
                    recipe = lambda c: re.findall(r"recipes/\w+\.yaml", c)  # noqa: E731
                    if not cmd.startswith(("make ", "accelerate ")):
                        assert verb(run) == verb(cmd) or "-m flowrl" in run, (cmd, run)
                        assert recipe(run) == recipe(cmd), (cmd, run)


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    """One working directory per markdown file, and one private FLOWRL_HOME for all of them."""
    root = tmp_path_factory.mktemp("docs-run")
    home = root / "flowrl-home"
    home.mkdir()
    env = {**os.environ, "FLOWRL_HOME": str(home), "HF_HUB_OFFLINE": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("PYTHONPATH", None)
    dirs = {}
    for p in DOCS:
        d = root / p.stem
        d.mkdir()
        dirs[p] = d
    return dirs, env


@pytest.mark.parametrize("block,cmd", COMMANDS, ids=[
    b.id if cmd is None else f"{b.id}#{commands(b).index(cmd) + 1}" for b, cmd in COMMANDS])
def test_command_runs(block, cmd, workdirs):
    if block.marker is not None:
        pytest.skip(f"{block.marker[0]}: {block.marker[1]}")
    runs, reason = prepare(cmd)
    if reason:
        pytest.skip(f"{cmd!r}: {reason}")
    run_commands(block, cmd, runs, workdirs)


def run_commands(block: Block, cmd: str, runs: list[str], workdirs) -> None:
    """Run a documented command's ``runs`` in its file's working directory (in a new shell after the block's
    activation line, when it has one); each must exit 0 without a traceback. Marks the command done, so a
    later test that needs its files does not run it again."""
    dirs, env = workdirs
    act = activation(block, cmd)
    if act is not None:  # the new shell: only the activated environment provides flowrl
        env = new_shell(env, dirs[block.path], ACTIVATE.match(act).group(1))
    else:
        assert shutil.which("flowrl", path=env["PATH"]), "the flowrl console script is not on PATH"
    for documented in runs:
        run = f"{act}\n{documented}" if act is not None and documented != act else documented
        t0 = time.perf_counter()
        r = subprocess.run(["bash", "-c", f"set -euo pipefail\n{run}"], cwd=dirs[block.path], env=env,
                           capture_output=True, text=True, timeout=590)
        print(f"{block.id}: {time.perf_counter() - t0:6.1f} s  {run}")  # (pytest -s shows where time goes)
        assert r.returncode == 0, f"{block.id}: {run}\n--- stderr ---\n{r.stderr[-4000:]}"
        assert "Traceback" not in r.stderr, f"{block.id}: {run}\n{r.stderr[-4000:]}"
        DONE.add((block.id, documented))  # as prepare() gives it (without the activation line)


DONE: set[tuple[str, str]] = set()  # (block id, command) run in this session


def test_readme_writes_only_what_it_says(workdirs):
    """After the README's blocks: the working directory holds what its comments name, nothing else
    (no stray benchmark JSON or PNG in the working directory). The README's commands that have not run
    in this session (this test alone, or a selection without them) run here first, in their order."""
    dirs, _ = workdirs
    wd = dirs[ROOT / "README.md"]
    for block, cmd in COMMANDS:
        if block.path.name == "README.md" and block.marker is None:
            runs, reason = prepare(cmd)
            todo = [r for r in runs if (block.id, r) not in DONE]
            if not reason and todo:
                run_commands(block, cmd, todo, workdirs)
    assert sorted(p.name for p in wd.iterdir() if p.name != ".venv") == ["bench", "data", "lora_out", "runs",
                                                                          "three.png"]
    assert sorted(p.name for p in (wd / "runs").iterdir()) == ["a", "demo", "dpo", "gdro", "sft", "smoke"]
    assert sorted(p.name for p in (wd / "bench").iterdir()) == sorted(
        [f"{k}.{ext}" for k in ("branch", "tempflow", "sol", "preference", "offline", "methods")
         for ext in ("json", "png")]
        + ["reward.json"])
