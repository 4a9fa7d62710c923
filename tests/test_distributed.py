"""Two CPU processes (gloo) through torch.distributed.run: the path `accelerate launch` takes."""
import json
import os
import socket
import subprocess
import sys

from conftest import tiny_train_overrides


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_train_in_sync(tiny_digits_dir, tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), "-m", "flowrl", "train", "--config", "recipes/digits.yaml",
           "--output-dir", str(run), *tiny_train_overrides(tiny_digits_dir, **{"train.lr": 1e-2, "train.iterations": 2})]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["ranks_in_sync"] is True
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if "reward_mean" in l]
    assert [x["iteration"] for x in recs] == [0, 1]  # written once, by the main process
    for x in recs:
        assert x["samples_gathered"] == 2 * 16  # statistics over both ranks' samples
        assert x["distinct_seeds_gathered"] == 2 * 16  # every rank samples different seeds
    assert len(list((run / "checkpoints").iterdir())) == 2  # checkpoint_every=1, keep 2, written once
