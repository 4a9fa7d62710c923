"""The command line's one error boundary: every verb, every bad input -> exit code 2, exactly one
stderr line ``flowrl VERB: error: ...`` naming the problem, no traceback, nothing half-written.

Each row of ``CASES`` is (id, verb as printed, argv builder, words the message must hold, paths that
must not exist afterwards). The rows run in this process through ``flowrl.cli.main`` (what the
console script calls); ``test_console_script_*`` checks the same form end to end in a subprocess.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_train_overrides
from flowrl.cli import main

RECIPE = "recipes/digits.yaml"
EDIT_SOURCE = Path(__import__("flowrl.data.prompts", fromlist=["x"]).SETS_DIR) / "digits_edit" / "digit_3.png"
QUIET = ["logging.trackers=[]", "logging.progress=false"]


@pytest.fixture(scope="module")
def env(tiny_digits_dir, tmp_path_factory):
    """Inputs shared by the rows: the tiny model, a finished 1-iteration run (no EMA), an empty run,
    a made model directory, bad prompt files."""
    from flowrl.trainers.config import load_config
    from flowrl.trainers.online import train

    root = tmp_path_factory.mktemp("cli-errors")
    run = root / "run"
    train(load_config(RECIPE, tiny_train_overrides(tiny_digits_dir, **{"train.iterations": 1})), run)
    empty_run = root / "empty_run"
    empty_run.mkdir()
    (empty_run / "config.yaml").write_text((run / "config.yaml").read_text())  # a run that never checkpointed
    (root / "empty.txt").write_text("")
    (root / "blank.txt").write_text("\n   \n\t\n")
    (root / "rows.jsonl").write_text('{"title": "a cat"}\n')
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    made = root / "made"
    made.mkdir()
    (made / "keep.txt").write_text("mine")
    (root / "list.yaml").write_text("- model\n- train\n")
    (root / "string.yaml").write_text("recipes/digits.yaml\n")
    (root / "empty.yaml").write_text("\n# nothing\n")
    broken = root / "broken_run"  # its only checkpoint unreadable (a truncated copy)
    shutil.copytree(run, broken)
    (broken / "checkpoints" / "iter_000001" / "trainable.safetensors").write_bytes(b"\x00" * 10)
    half = root / "half_broken_run"  # a newer checkpoint unreadable, the previous one fine
    shutil.copytree(run, half)
    shutil.copytree(half / "checkpoints" / "iter_000001", half / "checkpoints" / "iter_000002")
    (half / "checkpoints" / "iter_000002" / "trainable.safetensors").write_bytes(b"\x00" * 10)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]  # nothing listens there once closed
    return {"root": root, "model": tiny_digits_dir, "run": run, "empty_run": empty_run, "made": made,
            "broken_run": broken, "half_broken_run": half, "closed_port": closed_port}


def train_args(e, *extra):
    return ["train", "--config", RECIPE, "--output-dir", str(e["root"] / "new_run"), f"model.path={e['model']}",
            *QUIET, *extra]


def sample_args(e, *extra):
    return ["sample", "--run", str(e["run"]), "--prompts", "a handwritten digit 1", "--per-prompt", "1",
            "--steps", "2", "--out", str(e["root"] / "new.png"), *extra]


CASES = [
    # --- train
    ("no such recipe", "train", lambda e: ["train", "--config", "nope.yaml", "--output-dir", str(e["root"] / "new_run")],
     ["recipe 'nope.yaml' not found", "Shipped recipes"], ["new_run"]),
    ("empty prompt file", "train", lambda e: train_args(e, f"data.prompts={e['root'] / 'empty.txt'}"),
     ["is empty", "add at least one prompt"], ["new_run"]),
    ("blank prompt file", "train", lambda e: train_args(e, f"data.prompts={e['root'] / 'blank.txt'}"),
     ["is empty", "add at least one prompt"], ["new_run"]),
    ("jsonl rows without prompt", "train", lambda e: train_args(e, f"data.prompts={e['root'] / 'rows.jsonl'}"),
     ["needs a 'prompt' field", "data.prompt_column"], ["new_run"]),
    ("prompt file not UTF-8", "train", lambda e: train_args(e, f"data.eval_prompts={e['root'] / 'latin1.txt'}"),
     ["not UTF-8", "re-save it as UTF-8"], ["new_run"]),
    ("missing prompt file", "train", lambda e: train_args(e, f"data.prompts={e['root'] / 'none.txt'}"),
     ["not found", ".jsonl"], ["new_run"]),
    # (an editing model or reward without the source images it needs: refused before any model loads)
    ("editing model without source images", "train",
     lambda e: ["train", "--config", "recipes/qwen_image_edit_group_pickscore.yaml", "--output-dir",
                str(e["root"] / "new_run"), "data.prompts=[a cat, a dog]", "data.eval_prompts=[a cat]",
                "model.device=cpu", f"model.path={e['root'] / 'no-model'}", *QUIET],
     ["data.prompts: 2 of 2 prompts carry no source image", "qwen-image-edit is an editing model that cannot generate "
      "without one", "'image' field per row", "digits-edit-sample"], ["new_run"]),
    ("editing reward without source images", "train", lambda e: train_args(e, "reward.weights={digits_edit: 1.0}"),
     ["data.prompts: no prompt carries a source image", "reward digits_edit scores edits against their sources",
      "editing set"], ["new_run"]),
    ("unbalanced YAML override", "train", lambda e: train_args(e, "sampler={name: ode"),
     ["sampler={name: ode", "not valid YAML", "balance its brackets"], ["new_run"]),
    ("unknown key", "train", lambda e: train_args(e, "train.lrr=1"), ["train.lrr", "Did you mean train.lr"], ["new_run"]),
    ("undotted override", "train", lambda e: train_args(e, "lr=1"), ["must be dotted"], ["new_run"]),
    ("unknown option", "train", lambda e: train_args(e, "--lr", "1e-3"), ["unrecognized arguments: --lr"],
     ["new_run"]),
    ("abbreviated option", "train", lambda e: ["train", "--config", RECIPE, "--output", str(e["root"] / "new_run")],
     ["--output-dir"], ["new_run"]),
    ("output dir with unrelated files", "train",
     lambda e: ["train", "--config", RECIPE, "--output-dir", str(e["made"]), f"model.path={e['model']}", *QUIET],
     ["--output-dir", str("made"), "not a flowrl run (keep.txt)", "choose a new or empty directory"], []),
    ("missing model", "train", lambda e: train_args(e, f"model.path={e['root'] / 'no-model'}"),
     ["flowrl pretrain-digits"], ["new_run"]),
    ("resume with other settings", "train", lambda e: ["train", "--config", RECIPE, "--output-dir", str(e["run"]),
                                                       "--resume", *tiny_train_overrides(e["model"],
                                                                                         **{"train.lr": 0.5})],
     ["train.lr", "new --output-dir"], []),
    ("recipe is a YAML list", "train", lambda e: ["train", "--config", str(e["root"] / "list.yaml"), "--output-dir",
                                                  str(e["root"] / "new_run")],
     ["holds a YAML list, not a mapping of sections", "--config digits"], ["new_run"]),
    ("recipe is a plain string", "train", lambda e: ["train", "--config", str(e["root"] / "string.yaml"),
                                                     "--output-dir", str(e["root"] / "new_run")],
     ["holds a plain string"], ["new_run"]),
    ("empty recipe", "train", lambda e: ["train", "--config", str(e["root"] / "empty.yaml"), "--output-dir",
                                         str(e["root"] / "new_run")], ["is empty", "--config digits"], ["new_run"]),
    ("reward server not running", "train",
     lambda e: train_args(e, "reward.weights={remote: 1.0}", "reward.heldout={}",
                          f"reward.options={{remote: {{url: 'http://127.0.0.1:{e['closed_port']}'}}}}"),
     ["/health: connection refused", "serve-reward"], ["new_run"]),
    ("reward model not in the HF cache", "train",
     lambda e: train_args(e, "reward.weights={clipscore: 1.0}", "reward.heldout={}",
                          "reward.options={clipscore: {model: flowrl-test/not-cached}}"),
     ["'flowrl-test/not-cached' (reward.options.clipscore.model)", "nor in the local Hugging Face cache",
      "HF_HUB_OFFLINE is set", "HF_HOME"], ["new_run"]),
    # --- generate-offline / rescore-offline
    ("no dataset directory", "generate-offline", lambda e: ["generate-offline", "--config", "recipes/digits_gdro.yaml",
                                                            f"model.path={e['model']}"],
     ["--out DIR", "offline.dataset"], []),
    ("zero shards", "generate-offline", lambda e: ["generate-offline", "--config", "recipes/digits_gdro.yaml",
                                                   "--max-shards", "0"], ["--max-shards", "positive integer"], []),
    ("misspelt reward", "rescore-offline", lambda e: ["rescore-offline", "--dataset", str(e["root"]), "--reward",
                                                      "pickscor"], ["Did you mean 'pickscore'"], []),
    ("options not YAML", "rescore-offline", lambda e: ["rescore-offline", "--dataset", str(e["root"]), "--reward",
                                                       "pickscore", "--options", "{device: cpu"],
     ["--options '{device: cpu': not YAML", "key=value"], []),
    ("options not a mapping", "rescore-offline", lambda e: ["rescore-offline", "--dataset", str(e["root"]),
                                                            "--reward", "pickscore", "--options", "[1]"],
     ["--options '[1]'", "expected key=value, a YAML (or JSON) mapping"], []),
    ("no such dataset", "rescore-offline", lambda e: ["rescore-offline", "--dataset", str(e["root"] / "nope"),
                                                      "--reward", "pickscore"], ["no such directory"], []),
    # --- make-pairs
    ("pairs from no dataset", "make-pairs", lambda e: ["make-pairs", "--dataset", str(e["root"] / "nope"), "--reward", "digits",
                                                 "--out", str(e["root"] / "pairs")],
     ["--dataset", "no such directory", "generate-offline"], ["pairs"]),
    ("pairs from a non-dataset folder", "make-pairs", lambda e: ["make-pairs", "--dataset", str(e["root"]), "--reward", "digits",
                                               "--out", str(e["root"] / "pairs")],
     ["not a flowrl offline dataset", "flowrl generate-offline"], ["pairs"]),
    # --- pretrain-digits
    ("zero pretraining steps", "pretrain-digits", lambda e: ["pretrain-digits", "--out", str(e["root"] / "base"),
                                                             "--steps", "0"], ["--steps", "positive integer"], ["base"]),
    ("negative learning rate", "pretrain-digits", lambda e: ["pretrain-digits", "--out", str(e["root"] / "base"),
                                                             "--lr", "-1"], ["--lr", "> 0"], ["base"]),
    # --- pretrain-shapes (the same flags, its own base)
    ("zero shapes pretraining steps", "pretrain-shapes", lambda e: ["pretrain-shapes", "--out", str(e["root"] / "sbase"),
                                                                    "--steps", "0"], ["--steps", "positive integer"], ["sbase"]),
    ("zero shapes batch", "pretrain-shapes", lambda e: ["pretrain-shapes", "--out", str(e["root"] / "sbase"),
                                                        "--batch-size", "0"], ["--batch-size", "positive integer"], ["sbase"]),
    ("shapes average decay of 1", "pretrain-shapes", lambda e: ["pretrain-shapes", "--out", str(e["root"] / "sbase"),
                                                                "--ema", "1"], ["--ema", "[0, 1)"], ["sbase"]),
    ("negative warm-up", "pretrain-shapes", lambda e: ["pretrain-shapes", "--out", str(e["root"] / "sbase"),
                                                       "--warmup", "-1"], ["--warmup", ">= 0"], ["sbase"]),
    ("continuing from no base", "pretrain-shapes", lambda e: ["pretrain-shapes", "--out", str(e["root"] / "sbase"),
                                                              "--init", str(e["root"] / "nope"), "--steps", "1"],
     ["init", "neither a saved shapes base", "shapes-base-v2"], ["sbase"]),
    # --- sample / eval
    ("negative per-prompt", "sample", lambda e: sample_args(e, "--per-prompt", "-1"), ["--per-prompt", "got -1"],
     ["new.png"]),
    ("zero steps", "sample", lambda e: sample_args(e, "--steps", "0"), ["--steps", "got 0"], ["new.png"]),
    ("no such run", "sample", lambda e: ["sample", "--run", str(e["root"] / "nope"), "--prompts", "x", "--out",
                                         str(e["root"] / "new.png")], ["not a flowrl run directory"], ["new.png"]),
    ("run without checkpoints", "sample", lambda e: ["sample", "--run", str(e["empty_run"]), "--prompts", "x",
                                                     "--out", str(e["root"] / "new.png")],
     ["has no checkpoint yet"], ["new.png"]),
    ("base model not in the HF cache", "sample",
     lambda e: ["sample", "--config", "recipes/sd3_group_pickscore.yaml", "--prompts", "x", "--out",
                str(e["root"] / "new.png"), "model.device=cpu", "model.path=flowrl-test/not-cached"],
     ["the sd3 base model 'flowrl-test/not-cached' (model.path)", "HF_HUB_OFFLINE is set", "huggingface-cli download",
      "HF_HOME"], ["new.png"]),
    ("base model not in the HF cache", "eval",
     lambda e: ["eval", "--config", "recipes/sd3_group_pickscore.yaml", "--prompts", "x", "model.device=cpu",
                "model.path=flowrl-test/not-cached"], ["'flowrl-test/not-cached' (model.path)", "HF_HOME"], []),
    ("no readable checkpoint", "sample", lambda e: ["sample", "--run", str(e["broken_run"]), "--prompts", "x", "--out",
                                                    str(e["root"] / "new.png")],
     ["no readable checkpoint in", "the newest, iter_000001, is unreadable", "SafetensorError"], ["new.png"]),
    ("no readable checkpoint", "eval", lambda e: ["eval", "--run", str(e["broken_run"]), "--per-prompt", "2"],
     ["no readable checkpoint in", "iter_000001"], []),
    ("named checkpoint unreadable", "sample",
     lambda e: ["sample", "--run", str(e["half_broken_run"]), "--checkpoint", "iter_000002", "--prompts", "x",
                "--out", str(e["root"] / "new.png")],
     ["--checkpoint iter_000002", "is unreadable", "iter_000001, iter_000002"], ["new.png"]),
    ("both config and run", "sample", lambda e: sample_args(e, "--config", RECIPE), ["exactly one of --config"],
     ["new.png"]),
    ("no such checkpoint", "sample", lambda e: sample_args(e, "--checkpoint", "iter_000099"),
     ["--checkpoint iter_000099", "iter_000001"], ["new.png"]),
    ("EMA of a run without one", "sample", lambda e: sample_args(e, "--ema"), ["no EMA weights", "drop --ema"],
     ["new.png"]),
    ("weights flag without a run", "sample", lambda e: ["sample", "--config", RECIPE, "--ema", "--prompts", "x",
                                                        "--out", str(e["root"] / "new.png")], ["--run RUN_DIR"],
     ["new.png"]),
    ("source image for a text-to-image model", "sample", lambda e: sample_args(e, "--source", str(EDIT_SOURCE)),
     ["--source: model.pipeline=digits is a text-to-image model and takes no source image", "drop --source"],
     ["new.png"]),
    ("editing model sampled without a source", "sample",
     lambda e: ["sample", "--config", "recipes/qwen_image_edit_group_pickscore.yaml", "--prompts", "make it red",
                "--out", str(e["root"] / "new.png"), "model.device=cpu", f"model.path={e['root'] / 'no-model'}"],
     ["--prompts: 1 of 1 prompts carry no source image", "qwen-image-edit", "--source PATH"], ["new.png"]),
    ("a source image that is not there", "sample",
     lambda e: ["sample", "--config", "recipes/flux_kontext_edit.yaml", "--prompts", "make it red", "--source",
                str(e["root"] / "none.png"), "--out", str(e["root"] / "new.png"), "model.device=cpu",
                f"model.path={e['root'] / 'no-model'}"], ["--source", "none.png: source image", "not found"],
     ["new.png"]),
    ("editing reward on a text-only suite", "eval",
     lambda e: ["eval", "--run", str(e["run"]), "--suite", "digits", "--rewards", "digits,digits_edit",
                "--per-prompt", "1", "--out", str(e["root"] / "report")],
     ["--suite digits: no prompt carries a source image", "reward digits_edit scores edits", "--suite FILE.jsonl",
      "--suite digits-edit-sample", "leave it out of --rewards"], ["report"]),
    ("a panel reward's option out of its range", "eval",
     lambda e: ["eval", "--run", str(e["run"]), "--rewards", "digits,jpeg_compressibility",
                "reward.options.jpeg_compressibility.quality=101"],
     ["reward.options.jpeg_compressibility.quality must be an integer in [1, 100], got 101"], []),
    ("zero per-prompt", "eval", lambda e: ["eval", "--run", str(e["run"]), "--per-prompt", "0"],
     ["--per-prompt", "got 0"], []),
    ("steps not a number", "eval", lambda e: ["eval", "--run", str(e["run"]), "--steps", "ten"],
     ["--steps", "'ten' is not an integer"], []),
    # --- make-tiny / export
    ("existing directory", "make-tiny", lambda e: ["make-tiny", "digits", str(e["made"])], ["--overwrite"], []),
    ("unknown kind", "make-tiny", lambda e: ["make-tiny", "sdxl", str(e["root"] / "tiny")], ["unknown kind 'sdxl'"],
     ["tiny"]),
    ("export a run without checkpoints", "export", lambda e: ["export", str(e["empty_run"]), str(e["root"] / "x")],
     ["has no checkpoint yet"], ["x"]),
    ("export into a used directory", "export", lambda e: ["export", str(e["run"]), str(e["made"])], ["--overwrite"],
     []),
    ("export a run without a readable checkpoint", "export",
     lambda e: ["export", str(e["broken_run"]), str(e["root"] / "x")], ["no readable checkpoint", "iter_000001"],
     ["x"]),
    ("export EMA without one", "export", lambda e: ["export", str(e["run"]), str(e["root"] / "x"), "--ema"],
     ["export without --ema"], ["x"]),
    # --- bench / plan / the top level
    ("zero budget", "bench offline", lambda e: ["bench", "offline", "--budget", "0"], ["--budget", "> 0"], []),
    ("abbreviated budget", "bench offline", lambda e: ["bench", "offline", "--budget-s", "5"],
     ["unrecognized arguments: --budget-s"], []),
    ("bench on another pipeline", "bench branch", lambda e: ["bench", "branch", "--pipeline", "sd3"],
     ["--pipeline", "invalid choice"], []),
    ("unknown bench variant", "bench sol", lambda e: ["bench", "sol", "--variants", "nope", "--budget", "1"],
     ["unknown variant", "choose from"], []),
    ("unknown bench reward variant", "bench reward", lambda e: ["bench", "reward", "--variants", "bogus"],
     ["unknown variant(s) ['bogus'] of bench reward", "choose from"], []),
    ("architecture flag on a CPU pipeline", "bench precision", lambda e: ["bench", "precision", "--tiny"],
     ["--tiny apply to the architecture pipelines"], []),
    # (where a bench writes is checked before it trains: a result is never measured, then lost)
    ("bench --out is a file", "bench methods", lambda e: ["bench", "methods", "--budget", "1", "--out",
                                                         str(e["root"] / "empty.txt")],
     ["--out", "empty.txt is a file, not a directory", "give a directory"], []),
    ("bench --out under a file", "bench branch", lambda e: ["bench", "branch", "--budget", "1", "--out",
                                                           str(e["root"] / "empty.txt" / "bench")],
     ["--out", "empty.txt is not a directory"], []),
    ("bench --json is a directory", "bench offline", lambda e: ["bench", "offline", "--budget", "1", "--json",
                                                               str(e["root"])], ["--json", "is a directory, not a file"],
     []),
    ("bench --out where nothing can be written", "bench reward",
     lambda e: ["bench", "reward", "--out", "/proc/flowrl-bench/out"], ["--out", "cannot write in /proc"], []),
    ("plan without a recipe", "plan", lambda e: ["plan", "--config", "nope.yaml"], ["not found"], []),
    ("plan a YAML list", "plan", lambda e: ["plan", "--config", str(e["root"] / "list.yaml")],
     ["holds a YAML list"], []),
    ("plan a plain string", "plan", lambda e: ["plan", "--config", str(e["root"] / "string.yaml")],
     ["holds a plain string"], []),
    ("plan an empty recipe", "plan", lambda e: ["plan", "--config", str(e["root"] / "empty.yaml")], ["is empty"], []),
    # the trainer's layout, checked in the same place: a degree that does not divide the processes, a Ulysses
    # degree the model's heads (Wan2.1-1.3B: 12) do not divide
    ("plan a context-parallel degree the GPUs do not divide", "plan",
     lambda e: ["plan", "--config", "wan_group_ocr", "--gpus", "8", "train.context_parallel=3"],
     ["--gpus 8", "train.context_parallel=3 must divide the number of processes"], []),
    ("plan a Ulysses degree the heads do not divide", "plan",
     lambda e: ["plan", "--config", "wan_group_ocr", "--gpus", "8", "train.context_parallel=8",
                "train.context_parallel_attention=ulysses"], ["12 attention heads do not divide over 8"], []),
    # --- serve-reward (fails before it binds a port or loads a model)
    ("serve an unknown reward", "serve-reward", lambda e: ["serve-reward", "pickscor"], ["pickscor"], []),
    ("serve with an option the reward lacks", "serve-reward",
     lambda e: ["serve-reward", "jpeg_compressibility", "--options", "nope=1"], ["--options", "nope"], []),
    ("serve with an unset token variable", "serve-reward",
     lambda e: ["serve-reward", "digits", "--token-env", "FLOWRL_TEST_UNSET_TOKEN"], ["FLOWRL_TEST_UNSET_TOKEN"], []),
    ("unknown verb", "", lambda e: ["trian"], ["invalid choice: 'trian'"], []),
]


def _run(argv, capsys) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse errors leave through SystemExit(2), as in the console script
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.mark.parametrize("name,verb,argv,words,absent", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line(env, capsys, name, verb, argv, words, absent):
    rc, out, err = _run(argv(env), capsys)
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    prefix = f"flowrl {verb}: error: " if verb else "flowrl: error: "
    assert lines[0].startswith(prefix), lines[0]
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert out == ""
    for rel in absent:
        assert not (env["root"] / rel).exists(), rel
    assert (env["made"] / "keep.txt").read_text() == "mine" and sorted(p.name for p in env["made"].iterdir()) == [
        "keep.txt"]


def test_every_bench_verb_checks_where_it_writes(tmp_path, capsys):
    """Each output option of every `flowrl bench` verb is checked before the verb runs (one shared check,
    flowrl.bench.check_outputs); an option that writes but is not declared there fails this test."""
    import flowrl.bench
    from flowrl.cli import build_parser

    bench = next(a for a in build_parser()._actions if a.dest == "command").choices["bench"]
    verbs = next(a for a in bench._actions if a.dest == "bench").choices
    declared = (*flowrl.bench.OUTPUT_DIRS, *flowrl.bench.OUTPUT_FILES)
    afile = tmp_path / "a_file.txt"
    afile.write_text("x")
    checked = set()
    for verb, parser in verbs.items():
        for action in parser._actions:
            writes = any(w in (action.help or "").lower() for w in ("write", "directory for", "chart path", "where"))
            if action.dest == "dataset" or not writes:  # (--dataset may be a finished one, only read)
                continue
            assert action.dest in declared, (verb, action.dest)
            bad = afile if action.dest in flowrl.bench.OUTPUT_DIRS else tmp_path
            rc, out, err = _run(["bench", verb, action.option_strings[0], str(bad)], capsys)
            assert rc == 2 and out == "" and err.count("\n") == 1, (verb, action.dest, err)
            assert err.startswith(f"flowrl bench {verb}: error: {action.option_strings[0]} {bad}"), err
            checked.add((verb, action.dest))
    assert {("methods", "out"), ("sol", "out"), ("offline", "json"), ("offline", "png"), ("host", "profile"),
            ("precision", "json"), ("reward", "out"), ("ocr", "out"), ("offline", "workdir")} <= checked
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file.txt"]  # the probes left nothing behind


def test_every_verb_has_bad_input_rows():
    from flowrl.cli import build_parser

    verbs = set(next(a for a in build_parser()._actions if a.dest == "command").choices)
    covered = {c[1].split()[0] for c in CASES if c[1]}
    assert verbs <= covered, verbs - covered
    assert len(CASES) >= 40


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: device=cuda is valid here")
def test_serving_a_reward_on_a_gpu_that_is_not_there(capsys):
    rc, out, err = _run(["serve-reward", "digits", "--options", "device=cuda:1"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "no CUDA GPU is visible" in err and "--options device" in err
    assert out == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: model.device=cuda is valid here")
def test_cuda_device_without_a_gpu(env, capsys):
    rc, _, err = _run(train_args(env, "model.device=cuda"), capsys)
    assert rc == 2 and err.count("\n") == 1 and "no CUDA GPU is visible" in err and "model.device=auto" in err
    assert not (env["root"] / "new_run").exists()


def test_a_bug_keeps_its_traceback(monkeypatch, capsys):
    """Only the listed user-error types become one line: an unexpected exception propagates (rc 1)."""
    import flowrl.cli as cli

    def broken(a):
        raise ZeroDivisionError("a bug")
    monkeypatch.setattr(cli, "_make_tiny", broken)
    with pytest.raises(ZeroDivisionError):
        cli.main(["make-tiny", "digits", "/nonexistent/x"])


def test_overrides_anywhere_on_the_line(env, capsys):
    """Dotted overrides after an option (even after --prompts' list) are overrides, in order."""
    from flowrl.cli import build_parser
    from flowrl.command_line import split_overrides

    p = build_parser()
    rest, ov = split_overrides(p, ["train", "--config", "x", "train.lr=1", "--resume", "train.loss=dpo",
                                   "--output-dir", "o", "sampler={name: ode}"])
    assert rest == ["train", "--config", "x", "--resume", "--output-dir", "o"]
    assert ov == ["train.lr=1", "train.loss=dpo", "sampler={name: ode}"]
    rest, ov = split_overrides(p, ["sample", "--prompts", "a cat", "train.lr=1", "--out", "x.png"])
    assert rest == ["sample", "--prompts", "a cat", "--out", "x.png"] and ov == ["train.lr=1"]
    # an option's own value stays that option's (bench offline takes overrides as --offline-override values)
    rest, ov = split_overrides(p, ["bench", "offline", "--offline-override", "offline.k=2"])
    assert ov == [] and rest[-1] == "offline.k=2"
    png = env["root"] / "anywhere.png"
    rc, out, err = _run(["sample", "--run", str(env["run"]), "--prompts", "a handwritten digit 1",
                         "model.guidance_scale=1.5", "--per-prompt", "1", "--steps", "2", "--out", str(png)], capsys)
    assert rc == 0 and png.is_file(), err
    assert json.loads(out) == {"samples": 1, "out": str(png), "steps": 2}  # stdout: the result only
    assert "guidance 1.5" in err and "iter_000001 (latest), trained weights" in err  # what was used, on stderr


def test_no_prefix_abbreviations_anywhere():
    from flowrl.cli import build_parser

    def parsers(p):
        yield p
        for a in p._actions:
            if a.dest in ("command", "bench") and a.choices:
                for sub in a.choices.values():
                    yield from parsers(sub)
    assert all(not p.allow_abbrev for p in parsers(build_parser()))


@pytest.mark.parametrize("verb", ["train", "generate-offline", "rescore-offline", "pretrain-digits", "pretrain-shapes",
                                  "sample", "eval",
                                  "make-tiny", "make-pairs", "export", "plan", "bench branch", "bench offline", "bench precision",
                                  "bench host"])
def test_help_has_defaults_and_an_example(verb, capsys):
    with pytest.raises(SystemExit) as e:
        main([*verb.split(), "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "example:\n  flowrl " in out
    if verb not in ("train", "make-tiny", "export"):  # (their options have no default worth printing)
        assert "(default: " in out, out


def test_sample_eval_export_share_the_weights_flags():
    from flowrl.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    flags = {v: {a.dest: (a.default, a.help) for a in sub[v]._actions if a.dest in ("checkpoint", "ema")}
             for v in ("sample", "eval", "export")}
    assert flags["sample"] == flags["eval"] == flags["export"] and set(flags["export"]) == {"checkpoint", "ema"}
    assert flags["export"]["ema"][0] is False  # trained weights by default, everywhere


def test_console_script_prints_one_line(tmp_path):
    """The installed entry point: argparse and boundary errors alike, rc 2, one line, no usage block."""
    script = Path(sys.executable).parent / "flowrl"
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "flowrl"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for args, start in ((["eval", "--config", RECIPE, "--per-prompt", "0"], "flowrl eval: error: argument --per-prompt"),
                        (["make-tiny", "nope", str(tmp_path / "t")], "flowrl make-tiny: error: unknown kind 'nope'")):
        r = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 2 and r.stdout == "" and r.stderr.startswith(start), r.stderr
        assert r.stderr.count("\n") == 1, r.stderr


def test_ctrl_c_is_one_line(monkeypatch, capsys):
    """Ctrl-C outside training (the trainer checkpoints on its own) ends in one line, exit code 130."""
    import flowrl.cli as cli

    def interrupted(a):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "_make_tiny", interrupted)
    rc, out, err = _run(["make-tiny", "digits", "/nonexistent/x"], capsys)
    assert rc == 130 and out == "" and err == "flowrl make-tiny: error: interrupted (Ctrl-C)\n"


def test_unreadable_newest_checkpoint_falls_back_with_a_notice(env, capsys, tmp_path):
    """sample / eval / export of a run whose newest checkpoint is unreadable use the previous readable one,
    as train --resume does, and say so on stderr naming both."""
    run = env["half_broken_run"]
    png = tmp_path / "s.png"
    for argv in (["sample", "--run", str(run), "--prompts", "a handwritten digit 1", "--per-prompt", "1", "--steps",
                  "2", "--out", str(png)],
                 ["eval", "--run", str(run), "--per-prompt", "2", "--steps", "2", "--prompts", "a handwritten digit 1"],
                 ["export", str(run), str(tmp_path / "lora")]):
        rc, out, err = _run(argv, capsys)
        assert rc == 0, err
        assert "the newest checkpoint" in err and "iter_000002 is unreadable (SafetensorError" in err, err
        assert "using the previous readable one, iter_000001" in err and "Traceback" not in err
    assert png.is_file() and json.loads((tmp_path / "lora" / "flowrl_export.json").read_text())["checkpoint"] == \
        "iter_000001"


def test_resume_with_nothing_to_resume_says_so(env, capsys):
    """--resume into a directory without a run starts a new run, and says so (not silently)."""
    out_dir = env["root"] / "resume_into_nothing"
    rc, out, err = _run(["train", "--config", RECIPE, "--output-dir", str(out_dir), "--resume",
                         *tiny_train_overrides(env["model"], **{"train.iterations": 1})], capsys)
    assert rc == 0, err
    assert f"--resume: nothing to resume in {out_dir} (no run there): starting a new run" in err
    assert (out_dir / "checkpoints" / "iter_000001").is_dir()


def test_smoke_with_a_users_reward_missing_from_the_cache(env, capsys):
    """--smoke with the user's own reward whose model is not in the Hugging Face cache: rc 2, the last line
    names the model (after the smoke run's own status line), no traceback, no run written."""
    out_dir = env["root"] / "smoke_run"
    rc, out, err = _run(["train", "--smoke", "--config", RECIPE, "--output-dir", str(out_dir),
                         "reward.weights={pickscore: 1.0}", "reward.options={pickscore: {model: flowrl-test/none, "
                                                            "processor: flowrl-test/none}}"], capsys)
    assert rc == 2 and out == "" and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("flowrl train: error: the CLIP model 'flowrl-test/none' (reward.options.pickscore.model)")
    assert len(err.strip().splitlines()) <= 2 and not out_dir.exists()


def test_reward_options_read_alike_in_both_verbs():
    """rescore-offline and serve-reward take --options in the same forms, with one help text."""
    from flowrl.cli import build_parser
    from flowrl.command_line import reward_options

    assert reward_options(["device=cpu", '{"batch_size": 2}', "{dtype: float32}"]) == {
        "device": "cpu", "batch_size": 2, "dtype": "float32"}
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    helps = {v: next(a for a in sub[v]._actions if a.dest == "options") for v in ("rescore-offline", "serve-reward")}
    assert helps["rescore-offline"].help == helps["serve-reward"].help and \
        helps["rescore-offline"].nargs == helps["serve-reward"].nargs == "*"
