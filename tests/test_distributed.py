"""Two CPU processes (gloo) through torch.distributed.run: the path `accelerate launch` takes."""
import json
import os
import socket
import subprocess
import sys

import torch

from conftest import tiny_train_overrides


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_two(recipe: str, run, overrides: list[str]) -> list[dict]:
    """``flowrl train`` on two processes (gloo); checks it ended with both ranks in sync -> its iteration records."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), "-m", "flowrl", "train", "--config", recipe, "--output-dir", str(run),
           *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["ranks_in_sync"] is True
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if "reward_mean" in l]


def test_two_processes_train_in_sync(tiny_digits_dir, tmp_path):
    run = tmp_path / "run"
    recs = _train_two("recipes/digits.yaml", run,
                      tiny_train_overrides(tiny_digits_dir, **{"train.lr": 1e-2, "train.iterations": 2}))
    assert [x["iteration"] for x in recs] == [0, 1]  # written once, by the main process
    for x in recs:
        assert x["samples_gathered"] == 2 * 16  # statistics over both ranks' samples
        assert x["distinct_seeds_gathered"] == 2 * 16  # every rank samples different seeds
    assert len(list((run / "checkpoints").iterdir())) == 2  # checkpoint_every=1, keep 2, written once


def test_gardo_two_processes_train_in_sync(tiny_digits_dir, tmp_path):
    """GARDO's collectives (the gate's gathered rewards, the shares summed over processes, the step KL) in the
    same order on both ranks: the run ends, in sync, with the shares and the gate over both ranks' samples."""
    recs = _train_two("recipes/digits_gardo.yaml", tmp_path / "run",
                      tiny_train_overrides(tiny_digits_dir, **{"train.iterations": 2}))
    assert [x["iteration"] for x in recs] == [0, 1]
    for x in recs:
        assert x["samples_gathered"] == 2 * 16 and x["reward/digits/adv_share"] == 1.0  # one reward: all of it
        assert 0 < x["gardo/gated_share"] < 1


def test_offline_gdro_sharded_matches_ddp(tiny_digits_dir, tmp_path):
    """The offline trainer under train.sharding=fsdp (two processes): the DDP run's losses and weights."""
    from flowrl.checkpoints.common import list_checkpoints
    from flowrl.checkpoints import load_checkpoint
    from flowrl.trainers.config import load_config
    from flowrl.trainers.offline import generate_offline

    ov = {"offline.dataset": str(tmp_path / "ds"), "offline.groups_per_prompt": 2, "offline.groups_per_shard": 6,
          "offline.k": 3, "offline.num_steps": 3, "offline.batch_groups": 5, "offline.eval_every": 2,
          "offline.epochs": 2, "train.lr": 1e-2, "train.grad_accum": 2, "train.lora_rank": 4,
          "reward.weights": "{jpeg_compressibility: 1.0}", "data.eval_prompts": "[a handwritten digit 1, a handwritten digit 2]"}
    over = tiny_train_overrides(tiny_digits_dir, **ov)
    generate_offline(load_config("recipes/digits_gdro.yaml", over), progress=False)
    losses, weights = {}, {}
    for sharding in ("none", "fsdp"):
        run = tmp_path / sharding
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(_free_port()), "-m", "flowrl", "train", "--config", "recipes/digits_gdro.yaml",
               "--output-dir", str(run), *over, f"train.sharding={sharding}"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"})
        assert r.returncode == 0, r.stderr[-3000:]
        losses[sharding] = [x["loss"] for x in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in x]
        weights[sharding] = load_checkpoint(list_checkpoints(run / "checkpoints")[-1])["trainable"]
    assert len(losses["fsdp"]) == 2 and losses["fsdp"] == [float(x) for x in losses["none"]]
    for k, v in weights["none"].items():  # reduce-scatter vs all-reduce: the same sums in another order
        assert torch.allclose(weights["fsdp"][k], v, rtol=1e-4, atol=1e-5), k
