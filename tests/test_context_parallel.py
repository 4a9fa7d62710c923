"""Context parallelism (`train.context_parallel`, flowrl/distributed/context.py) on CPU processes (gloo).

* the tiny Wan and Qwen-Image transformers (and FLUX.1's), split over context-parallel groups (Ulysses, ring
  attention, both, FSDP2 over the same four processes), give the one-process output, loss and gradients
  within float32 round-off (tests/helpers_context_parallel.py, one launch of four processes);
* a tiny Wan GRPO run with context parallelism 2 (two processes: one data-parallel replica) is the
  one-process run (its first iteration's loss, gradient norm and rewards; its weights after a step), and
  its checkpoint resumes on one process (another layout), exactly restored, ending where the split run ends;
* a tiny Qwen-Image run on 2 x 2 (FSDP2 over four processes, two replicas of two) checkpoints and resumes
  on two processes without context parallelism (the same two replicas), ending where it ends;
* the layout, the attention degrees, the errors.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowrl.checkpoints import load_checkpoint
from flowrl.checkpoints.common import list_checkpoints
from flowrl.errors import ConfigError
from flowrl.trainers.config import load_config
from helpers import ROOT, SMOOTH_REWARD, tiny_overrides, train_records

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
SPLIT_CASES = ["wan-auto-2-none", "wan-ring-2-none", "wan-auto-4-none", "qwen-auto-2-none", "flux-auto-2-none",
               "wan-auto-2-fsdp", "qwen-auto-2-fsdp"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(_free_port()), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=ENV, cwd=ROOT)


def _ok(r):
    assert r.returncode == 0, f"{' '.join(map(str, r.args[-6:]))}\n{r.stderr[-3000:]}"


def _train(nproc, recipe, out, overrides, resume=False):
    return _launch(nproc, ["-m", "flowrl", "train", "--config", str(ROOT / "recipes" / f"{recipe}.yaml"),
                           "--output-dir", str(out), *overrides, *(["--resume"] if resume else [])])


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b) and a
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _drift(a: dict, b: dict, start: dict) -> float:
    """``|a - b| / |a - start|`` over all tensors (Frobenius): how far two runs from ``start`` ended apart,
    as a part of how far they went."""
    norm = lambda d: torch.sqrt(sum((v.double() ** 2).sum() for v in d.values())).item()  # noqa: E731
    return norm({k: a[k] - b[k] for k in a}) / norm({k: a[k] - start[k] for k in a})


def test_split_forwards_and_gradients_equal_one_process(tmp_path):
    """Ulysses (2 heads over 2), ring attention (flowrl's ops under the native backend), both (2 heads over
    4: Ulysses 2 x ring 2), Qwen-Image's masked joint attention, FLUX.1's text and image tokens, and FSDP2
    sharding the split model over the four processes (2 x 2): the output, loss and gradients of one process."""
    _ok(_launch(4, ["tests/helpers_context_parallel.py", str(tmp_path), *SPLIT_CASES]))
    for rank in range(4):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name in SPLIT_CASES:
            r = res[name]
            assert r["grads"] == r["grads_expected"] > 60, name  # every parameter got its gradient
            assert r["out"] < 1e-5 and r["loss"] < 1e-6 and r["grad"] < 1e-4, (name, rank, r)


@pytest.fixture(scope="module")
def wan_runs(tiny_model, tmp_path_factory):
    """One process, and two processes as one context-parallel group of 2 (the same single replica)."""
    from flowrl.trainers.online import train

    root = tmp_path_factory.mktemp("cp-wan")
    ov = tiny_overrides(tiny_model("wan"), "group", **{"logging.eval_every": 100, **SMOOTH_REWARD})
    cfg = load_config(ROOT / "recipes" / "wan_group_ocr.yaml", ov)
    train(cfg, root / "one")
    _ok(_train(2, "wan_group_ocr", root / "cp2", ov + ["train.context_parallel=2"]))
    return root, ov


def test_wan_context_parallel_run_is_the_one_process_run(wan_runs):
    root, _ = wan_runs
    one, cp2 = train_records(root / "one"), train_records(root / "cp2")
    assert [r["iteration"] for r in cp2] == [0, 1]
    for k in ("grad_norm", "reward_mean", "samples_gathered", "distinct_seeds_gathered"):
        assert cp2[0][k] == pytest.approx(one[0][k], rel=1e-5, abs=1e-12), k  # one replica, counted once
    # the first step's loss is -mean(A) x ratio 1 = 0 up to the advantages' float32 round-off (|A| <~ 3)
    assert cp2[0]["loss"] == pytest.approx(one[0]["loss"], abs=1e-5)
    a = load_checkpoint(list_checkpoints(root / "one" / "checkpoints")[0])  # after one optimizer step
    b = load_checkpoint(list_checkpoints(root / "cp2" / "checkpoints")[0])
    # AdamW's first step is ~lr * sign(g): round-off in gradients near its eps shows at ~1e-5 of lr=1e-2
    assert _max_diff(a["trainable"], b["trainable"]) < 1e-4
    assert b["state"]["num_processes"] == 2 and b["state"]["data_parallel"] == 1
    summary = json.loads((root / "cp2" / "summary.json").read_text())
    assert summary["ranks_in_sync"] is True and summary["eval_reward_after"] is not None


def test_a_context_parallel_checkpoint_resumes_on_one_process(wan_runs, tmp_path):
    """The split run's first checkpoint, resumed by one process: weights, AdamW moments and counters
    restored exactly; the resumed iteration samples what the split run sampled and ends on its weights
    (within the round-off of the other layout)."""
    from flowrl.trainers.online import OnlineTrainer

    root, ov = wan_runs
    run = tmp_path / "run"
    shutil.copytree(root / "cp2", run)
    ckpts = list_checkpoints(run / "checkpoints")
    shutil.rmtree(ckpts[-1])
    (run / "summary.json").unlink()
    saved = load_checkpoint(ckpts[0])
    tr = OnlineTrainer(load_config(ROOT / "recipes" / "wan_group_ocr.yaml", ov), run, resume=True)
    tr.setup()
    assert tr.start_iteration == 1 and tr.strategy.layout.cp == 1
    mine = {n: p.detach() for n, p in tr.unwrapped.named_parameters() if p.requires_grad}
    assert _max_diff(saved["trainable"], mine) == 0.0
    assert tr.opt.state_dict()["state"].keys() == saved["optimizer"]["state"].keys()
    for i, st in saved["optimizer"]["state"].items():
        assert torch.equal(tr.opt.state_dict()["state"][i]["exp_avg"], st["exp_avg"])
    tr.train()
    split, resumed = train_records(root / "cp2"), train_records(run)
    assert resumed[-1]["iteration"] == 1
    # the same rollout up to the forward's float32 round-off on another layout (any x86 CPU: ~1e-6 relative)
    assert resumed[-1]["reward_mean"] == pytest.approx(split[1]["reward_mean"], rel=1e-4)
    # the gradient through a smooth reward: round-off, amplified by the near-cancelling advantage-weighted sum
    assert resumed[-1]["grad_norm"] == pytest.approx(split[1]["grad_norm"], rel=1e-2)
    # AdamW normalises every element's step (~lr x sign(g)), so the layouts' gradient round-off moves single
    # elements by up to ~1e-3 at lr = 1e-2; the weights as a whole end within 1% of how far the iteration went
    end_split = load_checkpoint(list_checkpoints(root / "cp2" / "checkpoints")[-1])["trainable"]
    end = load_checkpoint(list_checkpoints(run / "checkpoints")[-1])["trainable"]
    assert _drift(end, end_split, saved["trainable"]) < 1e-2


def test_qwen_image_two_by_two_with_fsdp_resumes_without_context_parallelism(tiny_model, tmp_path):
    """Four processes: FSDP2 over all four, two data-parallel replicas of a context-parallel group of two.
    Its first checkpoint resumes on two processes (FSDP2, no context parallelism: the same two replicas), which
    sample the same prompts and noise and end on the four-process run's weights."""
    ov = tiny_overrides(tiny_model("qwen-image"), "group", **{"train.sharding": "fsdp", "logging.eval_every": 100,
                                                             **SMOOTH_REWARD})
    _ok(_train(4, "qwen_image_group_pickscore", tmp_path / "2x2", ov + ["train.context_parallel=2"]))
    recs = train_records(tmp_path / "2x2")
    assert [r["samples_gathered"] for r in recs] == [8, 8]  # 2 replicas x 4 samples: each counted once
    assert all(r["distinct_seeds_gathered"] == 8 for r in recs)
    run = tmp_path / "resumed"
    shutil.copytree(tmp_path / "2x2", run)
    shutil.rmtree(list_checkpoints(run / "checkpoints")[-1])
    (run / "summary.json").unlink()
    _ok(_train(2, "qwen_image_group_pickscore", run, ov, resume=True))
    again = train_records(run)
    assert again[-1]["iteration"] == 1 and again[-1]["samples_gathered"] == 8
    assert again[-1]["reward_mean"] == pytest.approx(recs[1]["reward_mean"], rel=1e-4)
    a = load_checkpoint(list_checkpoints(tmp_path / "2x2" / "checkpoints")[-1])
    b = load_checkpoint(list_checkpoints(run / "checkpoints")[-1])
    assert a["state"]["sharded"]["num_processes"] == 4 and b["state"]["sharded"]["num_processes"] == 2
    start = load_checkpoint(list_checkpoints(run / "checkpoints")[0])["trainable"]
    assert _drift(a["trainable"], b["trainable"], start) < 1e-2


def test_layout_and_attention_degrees():
    from flowrl.distributed.mesh import attention_degrees
    from flowrl.distributed.mesh import ParallelLayout

    lay = ParallelLayout(world=8, rank=5, cp=4)
    assert (lay.dp_size, lay.dp_rank, lay.cp_rank) == (2, 1, 1)
    rows = torch.arange(8).repeat_interleave(3)  # every rank's 3 rows, rank order
    assert lay.replica_rows(rows).tolist() == [0, 0, 0, 4, 4, 4]  # one copy per replica
    assert attention_degrees(40, 8) == (8, 1) and attention_degrees(40, 16) == (8, 2)  # Wan2.1-14B: 40 heads
    assert attention_degrees(24, 8) == (8, 1) and attention_degrees(12, 8) == (4, 2) and attention_degrees(2, 4, "ring") == (1, 4)
    with pytest.raises(ConfigError, match="must divide the number of processes"):
        ParallelLayout(world=6, rank=0, cp=4)
    with pytest.raises(ConfigError, match="do not divide over 8"):
        attention_degrees(12, 8, "ulysses")


def test_one_layout_record_holds_every_degree():
    """ParallelLayout.of: the train settings and the process count checked in one place, every degree in the
    record (data-parallel replicate / shard, context parallel Ulysses x ring once the heads are known); the
    processes' agreement on routed rows follows the layout (module-free rules, no collective without a group)."""
    from flowrl.distributed.mesh import ParallelLayout
    from flowrl.distributed.parallelize import agreement

    train = load_config(ROOT / "recipes" / "wan_group_ocr.yaml", ["train.context_parallel=4"]).train
    ddp = ParallelLayout.of(train, 8, rank=6, heads=12)
    assert (ddp.dp_size, ddp.dp_replicate, ddp.dp_shard, ddp.ulysses, ddp.ring, ddp.dp_rank) == (2, 2, 1, 4, 1, 1)
    train.sharding, train.context_parallel, train.context_parallel_attention = "fsdp", 8, "auto"
    fsdp = ParallelLayout.of(train, 16, heads=12)
    assert (fsdp.dp_replicate, fsdp.dp_shard, fsdp.ulysses, fsdp.ring) == (1, 16, 4, 2)
    with pytest.raises(ConfigError, match="must divide the number of processes"):
        ParallelLayout.of(train, 12)
    need, trained = {"high": True, "low": False}, {"high": True, "low": True}
    assert agreement(ParallelLayout())(need, trained, torch.device("cpu")) == need  # one process: its own rows
    with torch.no_grad():  # DDP sampling: the rows' experts; DDP training: every trained expert too
        assert agreement(ParallelLayout(2, 0))(need, trained, torch.device("cpu")) == need
    assert agreement(ParallelLayout(2, 0))(need, trained, torch.device("cpu")) == {"high": True, "low": True}


def test_context_parallel_settings_fail_clearly(tiny_model):
    from flowrl.distributed.context import enable_context_parallel, emulate_context_parallel
    from flowrl.distributed.mesh import ParallelLayout

    recipe = ROOT / "recipes" / "wan_group_ocr.yaml"
    with pytest.raises(ConfigError, match="train.context_parallel must be a positive integer"):
        load_config(recipe, ["train.context_parallel=0"])
    with pytest.raises(ConfigError, match="context_parallel_attention must be one of auto, ulysses, ring"):
        load_config(recipe, ["train.context_parallel_attention=star"])
    from diffusers import SD3Transformer2DModel

    sd3 = SD3Transformer2DModel(num_layers=1, attention_head_dim=8, num_attention_heads=2, joint_attention_dim=8,
                                caption_projection_dim=16, pooled_projection_dim=8, sample_size=8, pos_embed_max_size=8)
    with pytest.raises(ConfigError, match="declares no context-parallel plan"):
        enable_context_parallel(sd3, ParallelLayout(2, 0, 2), torch.device("cpu"))
    from diffusers import WanTransformer3DModel

    wan = WanTransformer3DModel.from_pretrained(tiny_model("wan"), subfolder="transformer")
    emulate_context_parallel(wan, 3)  # 8 video tokens do not split in 3
    x = torch.randn(1, 16, 2, 4, 4)
    with pytest.raises(ConfigError, match="multiple of train.context_parallel=3"):
        wan(hidden_states=x, timestep=torch.tensor([10.0]), encoder_hidden_states=torch.randn(1, 8, 32))
    emulate_context_parallel(wan, 1)  # removed: the whole sequence again
    assert wan(hidden_states=x, timestep=torch.tensor([10.0]), encoder_hidden_states=torch.randn(1, 8, 32),
               return_dict=False)[0].shape == x.shape
