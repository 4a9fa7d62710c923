"""The remote reward in training: a server that goes away mid-run stops the run at the iteration
boundary; restarted, `--resume` ends on the weights of an uninterrupted run. Two DDP ranks (gloo,
through torch.distributed.run) sharing one server each get their own scores."""
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import tiny_train_overrides
from helpers_reward_server import free_port, served

from flowrl.rewards.server_process import spawn


def test_server_gone_mid_run_then_resume_ends_where_an_uninterrupted_run_ends(tiny_digits_dir, tmp_path, monkeypatch):
    from flowrl.trainers import online
    from flowrl.checkpoints import load_checkpoint
    from flowrl.checkpoints.common import list_checkpoints
    from flowrl.trainers.config import load_config
    from flowrl.trainers.online import train
    from flowrl.trainers.steps import TrainingStopped

    port = free_port()
    server = spawn("digits", port=port)
    url = server.url
    over = tiny_train_overrides(tiny_digits_dir, **{
        "train.iterations": 4, "logging.eval_every": 100, "reward.weights": "{remote: 1.0}",
        "reward.options": "{remote: {url: '%s', timeout: 10, retries: 1, backoff: 0.05}}" % url})
    cfg = load_config("recipes/digits.yaml", over)
    try:
        train(cfg, tmp_path / "whole")

        def fault(point, it):  # the server dies right after iteration 1's update
            if point == "after_update" and it == 1:
                server.stop(kill=True)

        monkeypatch.setattr(online, "maybe_fault", fault)
        with pytest.raises(TrainingStopped) as stop:
            train(cfg, tmp_path / "cut")
        msg = str(stop.value)
        assert url in msg and "failed after 2 attempts" in msg and "iteration 2, before its update" in msg
        assert "--resume" in msg
        ckpts = list_checkpoints(tmp_path / "cut" / "checkpoints")
        assert ckpts[-1].name.endswith("2")  # iterations 0 and 1 done and checkpointed, nothing of 2
        monkeypatch.setattr(online, "maybe_fault", lambda point, it: None)
        server = spawn("digits", port=port)  # back, at the same URL
        train(load_config("recipes/digits.yaml", over), tmp_path / "cut", resume=True)
    finally:
        server.stop()
    whole = load_checkpoint(list_checkpoints(tmp_path / "whole" / "checkpoints")[-1])
    cut = load_checkpoint(list_checkpoints(tmp_path / "cut" / "checkpoints")[-1])
    assert whole["state"]["iteration"] == cut["state"]["iteration"] == 4
    for k, v in whole["trainable"].items():
        assert torch.equal(v, cut["trainable"][k]), k
    rec = lambda d: {m["iteration"]: m["reward_mean"] for m in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
                     if "reward_mean" in m}  # noqa: E731
    assert rec(tmp_path / "whole") == rec(tmp_path / "cut")


RANK_SCRIPT = """
import os, sys, json, torch, torch.distributed as dist
from flowrl import rewards
dist.init_process_group("gloo")
rank = dist.get_rank()
images = torch.rand(6, 3, 16, 16, generator=torch.Generator().manual_seed(100 + rank))
prompts = [f"a handwritten digit {(d + rank) % 10}" for d in range(6)]
remote = rewards.build("remote", url=os.environ["REWARD_URL"], encoding="float32", timeout=30, retries=1)
dist.barrier()  # both ranks ask at once
got = remote(images, prompts)
want = rewards.build("digits")(images, prompts)
json.dump({"rank": rank, "equal": bool(torch.equal(got, want)), "got": got.tolist()},
          open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w"))
dist.destroy_process_group()
"""


def test_two_ranks_share_one_server_and_get_their_own_scores(tiny_digits_dir, tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    with served("digits", max_wait=1.0) as url:
        env = {**os.environ, "REWARD_URL": url, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), str(script), str(tmp_path)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        import urllib.request

        stats = json.loads(urllib.request.urlopen(url + "/health", timeout=10).read())
    out = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1)]
    assert all(o["equal"] for o in out) and out[0]["got"] != out[1]["got"]
    assert stats["requests"] == 2 and stats["reward_calls"] == 1 and stats["largest_call"] == 12  # one merged call
