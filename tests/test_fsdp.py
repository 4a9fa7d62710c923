"""`train.sharding=fsdp` (FSDP2, flowrl/distributed/fsdp.py) under two CPU processes (gloo), against DDP.

The tiny SD3 pipeline through the shipped recipes: the sharded run's losses, rewards, gradient norms,
learning rates and final weights equal the DDP run's; a SIGKILL in the middle of a sharded checkpoint
write, then `--resume`, ends on the uninterrupted run's weights; one process resumes a two-process
checkpoint; `flowrl export` gathers the shards into the same LoRA file as the DDP run's.
"""
import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowrl.pipelines.tiny import make_tiny
from flowrl.checkpoints import load_checkpoint
from flowrl.checkpoints.common import list_checkpoints
from flowrl.checkpoints.sharded import ShardedCheckpoint
from flowrl.errors import ConfigError
from flowrl.trainers.config import load_config
from helpers import SMOOTH_REWARD, tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
# 3 iterations, 2 optimizer steps each (grad_accum 2 over 4 minibatches), warm-up over 2 iterations, EMA kept;
# a smooth reward (helpers.SMOOTH_REWARD): the layouts' round-off moves the later iterations by round-off alone
GROUP = {"train.iterations": 3, "train.minibatch_size": 4, "train.grad_accum": 2, "train.warmup_iterations": 2,
         "logging.eval_every": 2, **SMOOTH_REWARD}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(model, out, recipe="sd3_group_pickscore", sampler="group", nproc=2, fault=None, resume=False, **extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(_free_port()), "-m", "flowrl", "train", "--config",
           str(ROOT / "recipes" / f"{recipe}.yaml"), "--output-dir", str(out),
           *tiny_overrides(model, sampler, **extra), *(["--resume"] if resume else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    env.pop("FLOWRL_FAULT", None)
    if fault:
        env["FLOWRL_FAULT"] = fault
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)


def _ok(r):
    """(A failure names the run's overrides; every rank dumps its Python stacks on a fatal signal.)"""
    assert r.returncode == 0, f"{' '.join(map(str, r.args[-4:]))}\n{r.stderr[-3000:]}"


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "reward_mean" in line]


def _last(run):
    return load_checkpoint(list_checkpoints(run / "checkpoints")[-1])


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b) and a
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory):
    return make_tiny("sd3", tmp_path_factory.mktemp("fsdp-model") / "sd3", image_size=32)


@pytest.fixture(scope="module")
def runs(tiny_sd3, tmp_path_factory):
    """DDP, FSDP, and FSDP killed mid-checkpoint (a copy kept before its resume) then resumed."""
    root = tmp_path_factory.mktemp("fsdp-runs")
    out = {"ddp": root / "ddp", "fsdp": root / "fsdp", "killed": root / "killed", "kept": root / "killed-kept"}
    _ok(_train(tiny_sd3, out["ddp"], **GROUP))
    _ok(_train(tiny_sd3, out["fsdp"], **GROUP, **{"train.sharding": "fsdp"}))
    r = _train(tiny_sd3, out["killed"], fault="checkpoint_mid:2", **GROUP, **{"train.sharding": "fsdp"})
    assert r.returncode != 0  # SIGKILLed while every process was writing its shards of iter_000002
    shutil.copytree(out["killed"], out["kept"])
    _ok(_train(tiny_sd3, out["killed"], resume=True, **GROUP, **{"train.sharding": "fsdp"}))
    return out


def test_fsdp_matches_ddp(runs):
    ddp, fsdp = _records(runs["ddp"]), _records(runs["fsdp"])
    assert [r["iteration"] for r in fsdp] == [0, 1, 2]
    for a, b in zip(ddp, fsdp):
        for k in ("loss", "reward_mean", "grad_norm", "kl", "lr"):
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-9), (k, a["iteration"])
    assert [r["lr"] for r in fsdp] == pytest.approx([5e-3, 1e-2, 1e-2])  # warm-up counts iterations, not processes
    a, b = _last(runs["ddp"]), _last(runs["fsdp"])
    assert _max_diff(a["trainable"], b["trainable"]) < 1e-6 and _max_diff(a["ema"], b["ema"]) < 1e-6
    assert any(".lora_B." in k and v.abs().sum() > 0 for k, v in b["trainable"].items())  # it trained
    ck = list_checkpoints(runs["fsdp"] / "checkpoints")[-1]
    assert sorted(p.name for p in (ck / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    state = json.loads((ck / "trainer_state.json").read_text())
    assert state["sharded"] == {"format": "dcp", "num_processes": 2, "ema": True, "extra": []}
    summary = json.loads((runs["fsdp"] / "summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["eval_reward_after"] is not None


def test_sigkill_mid_sharded_checkpoint_then_resume_ends_on_the_same_weights(runs):
    kept = runs["kept"] / "checkpoints"
    assert [p.name for p in list_checkpoints(kept)] == ["iter_000001"]  # the killed write is not a checkpoint
    assert [p.name for p in kept.glob(".tmp-*")] == [".tmp-iter_000002"]
    a, b = _last(runs["fsdp"]), _last(runs["killed"])
    assert b["state"]["iteration"] == 3
    assert _max_diff(a["trainable"], b["trainable"]) == 0.0 and _max_diff(a["ema"], b["ema"]) == 0.0
    assert [r["loss"] for r in _records(runs["killed"])] == [r["loss"] for r in _records(runs["fsdp"])]


def test_one_process_resumes_a_two_process_checkpoint(runs, tiny_sd3, tmp_path):
    """In this process (a one-process group): the restored shards are the checkpoint's whole tensors,
    the AdamW moments are restored by parameter name, then training runs on to the end."""
    from flowrl.trainers.online import OnlineTrainer
    from flowrl.utils.sharded import full_tensor, is_sharded

    run = tmp_path / "run"
    shutil.copytree(runs["kept"], run)
    cfg = load_config(ROOT / "recipes" / "sd3_group_pickscore.yaml",
                      tiny_overrides(tiny_sd3, "group", **GROUP, **{"train.sharding": "fsdp"}))
    tr = OnlineTrainer(cfg, run, resume=True)
    try:
        tr.setup()
        assert tr.acc.num_processes == 1 and tr.start_iteration == 1 and is_sharded(tr.model)
        ck = list_checkpoints(run / "checkpoints")[-1]
        saved, saved_opt = ShardedCheckpoint.tensors(ck, "trainable"), ShardedCheckpoint.tensors(ck, "optimizer.state")
        trained = {n: p for n, p in tr.model.named_parameters() if p.requires_grad}
        assert _max_diff(saved, {n: full_tensor(p.detach()) for n, p in trained.items()}) == 0.0
        for key in ("exp_avg", "exp_avg_sq"):  # AdamW moments, by parameter name
            mine = {n: full_tensor(tr.opt.state[p][key]) for n, p in trained.items()}
            assert _max_diff({n: saved_opt[f"{n}.{key}"] for n in trained}, mine) == 0.0
        assert any(saved_opt[f"{n}.exp_avg"].abs().sum() > 0 for n in trained)
        summary = tr.train()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert summary["iterations_done"] == 3 and summary["num_processes"] == 1
    assert _last(run)["state"]["iteration"] == 3


def test_export_gathers_the_shards(runs, tmp_path):
    from safetensors.torch import load_file

    from flowrl.export import export_run

    for ema in (False, True):
        files = {}
        for name in ("ddp", "fsdp"):
            out = tmp_path / f"{name}-{ema}"
            export_run(runs[name], out, ema=ema)
            files[name] = load_file(str(out / "pytorch_lora_weights.safetensors"))
        assert _max_diff(files["ddp"], files["fsdp"]) < 1e-6


@pytest.mark.parametrize("case", ["full_finetune_with_reference", "sol_nft", "branch", "tempflow"])
def test_fsdp_matches_ddp_across_samplers_and_updates(tiny_sd3, tmp_path, case):
    """A full fine-tune with the KL reference (a frozen copy, sharded too); the Sol sampler (its int8
    exploration copy gathered whole from the shards) with DiffusionNFT (old policy sharded, checkpointed);
    the BranchGRPO and TempFlow samplers."""
    recipe, sampler, extra = {
        "branch": ("sd3_branch_hps", "branch", {}),
        "tempflow": ("sd3_tempflow_pickscore", "tempflow", {}),
        "full_finetune_with_reference": ("sd3_group_pickscore", "group",
                                         {"train.lora_rank": 0, "train.lr": 1e-4, "train.loss_options.beta_kl": 0.04}),
        "sol_nft": ("sd3_sol_nvfp4", "sol", {"train.minibatch_size": 4,  # with the recipe's text-embedding cache
                                             "model.text_embedding_cache": str(tmp_path / "emb")}),
    }[case]
    for sharding in ("none", "fsdp"):
        _ok(_train(tiny_sd3, tmp_path / sharding, recipe=recipe, sampler=sampler, **extra,
                   **{"train.sharding": sharding}))
    a, b = _records(tmp_path / "none"), _records(tmp_path / "fsdp")
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-5)
    ca, cb = _last(tmp_path / "none"), _last(tmp_path / "fsdp")
    assert _max_diff(ca["trainable"], cb["trainable"]) < 1e-6
    for name in ca["extra"]:  # DiffusionNFT's old policy
        assert _max_diff(ca["extra"][name], cb["extra"][name]) < 1e-6
    if case == "sol_nft":
        assert list(cb["extra"]) == ["old_policy"] and b[0]["sol/explore_model_evals"] > 0
    elif case == "full_finetune_with_reference":
        assert b[-1]["kl"] > 0 and len(cb["trainable"]) > 50  # every parameter trained, the reference used
        from diffusers import SD3Transformer2DModel

        from flowrl.export import export_run

        full = {}
        for sharding in ("none", "fsdp"):  # export gathers the whole transformer from the shards
            export_run(tmp_path / sharding, tmp_path / f"export-{sharding}")
            tr = SD3Transformer2DModel.from_pretrained(tmp_path / f"export-{sharding}", subfolder="transformer")
            full[sharding] = dict(tr.state_dict())
        assert _max_diff(full["none"], full["fsdp"]) < 1e-6


def test_fsdp_units_are_the_blocks_the_models_list(tmp_path):
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    from flowrl.distributed.fsdp import block_modules

    sd3 = SD3Transformer2DModel.from_pretrained(make_tiny("sd3", tmp_path / "sd3", image_size=32), subfolder="transformer")
    assert [type(b).__name__ for b in block_modules(sd3)] == ["JointTransformerBlock"] * sd3.config.num_layers
    flux = FluxTransformer2DModel.from_pretrained(make_tiny("flux", tmp_path / "flux", image_size=32),
                                                  subfolder="transformer")
    names = [type(b).__name__ for b in block_modules(flux)]
    assert names == (["FluxTransformerBlock"] * flux.config.num_layers
                     + ["FluxSingleTransformerBlock"] * flux.config.num_single_layers)


def test_sharding_settings_fail_clearly(tiny_sd3):
    from accelerate.utils import DistributedType

    from flowrl.distributed.fsdp import check_launcher, shard_model

    with pytest.raises(ConfigError, match="train.sharding must be one of none, fsdp"):
        load_config(ROOT / "recipes" / "sd3_group_pickscore.yaml", ["train.sharding=zero3"])
    with pytest.raises(ConfigError, match="cpu_offload=true needs train.sharding=fsdp"):
        load_config(ROOT / "recipes" / "sd3_group_pickscore.yaml", ["train.cpu_offload=true"])
    with pytest.raises(ConfigError, match="set train.sharding=fsdp"):
        check_launcher(DistributedType.FSDP, "none")
    with pytest.raises(ConfigError, match="does not run under DeepSpeed"):
        check_launcher(DistributedType.DEEPSPEED, "fsdp")
    check_launcher(DistributedType.FSDP, "fsdp")
    check_launcher(DistributedType.MULTI_GPU, "none")
    with pytest.raises(ConfigError, match="use bf16"):
        shard_model(torch.nn.Linear(2, 2), torch.device("cpu"), mixed_precision="fp16")


def test_one_process_fsdp_shards_a_full_finetunes_reference(tiny_sd3, tmp_path):
    """No whole second model: the frozen KL reference of a full fine-tune is sharded like the policy,
    and the EMA holds shards; one process (a one-process group) runs the same sharded code."""
    from flowrl.trainers.online import OnlineTrainer
    from flowrl.utils.sharded import is_sharded

    cfg = load_config(ROOT / "recipes" / "sd3_group_pickscore.yaml",
                      tiny_overrides(tiny_sd3, "group", **{"train.sharding": "fsdp", "train.lora_rank": 0,
                                                           "train.loss_options.beta_kl": 0.04, "train.iterations": 1}))
    tr = OnlineTrainer(cfg, tmp_path / "run")
    try:
        tr.setup()
        from torch.distributed.tensor import DTensor

        assert is_sharded(tr.model) and is_sharded(tr.ref.copy)
        assert all(isinstance(p, DTensor) for p in tr.ref.copy.parameters())
        assert all(isinstance(v, DTensor) for v in tr.ema.shadow.values())
        assert tr.train()["iterations_done"] == 1
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert not torch.distributed.is_initialized()


def test_cpu_offload_and_bf16_mixed_precision(runs, tiny_sd3, tmp_path):
    """train.cpu_offload keeps the shards in host memory: the same numbers as without it. Under
    train.mixed_precision=bf16 the units compute with bf16 parameters (FSDP2 MixedPrecisionPolicy, fp32
    gradient reduction): the run trains; its first gradient norm is near the fp32 run's, not equal to it."""
    ref = _records(runs["fsdp"])[:2]
    _ok(_train(tiny_sd3, tmp_path / "offload", **{**GROUP, "train.iterations": 2, "train.sharding": "fsdp",
                                                   "train.cpu_offload": "true"}))
    assert [(r["loss"], r["grad_norm"]) for r in _records(tmp_path / "offload")] == [(r["loss"], r["grad_norm"]) for r in ref]
    _ok(_train(tiny_sd3, tmp_path / "bf16", **{**GROUP, "train.iterations": 2, "train.sharding": "fsdp",
                                                "train.mixed_precision": "bf16"}))
    bf = _records(tmp_path / "bf16")
    a, b = ref[0]["grad_norm"], bf[0]["grad_norm"]
    assert b != a and b == pytest.approx(a, rel=0.05)
    assert len(bf) == 2 and all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in bf)


def test_a_corrupt_shard_falls_back_to_the_previous_checkpoint(runs, tiny_sd3, tmp_path, capsys):
    from flowrl.trainers.online import OnlineTrainer

    run = tmp_path / "run"
    shutil.copytree(runs["fsdp"], run)
    newest = list_checkpoints(run / "checkpoints")[-1]
    shard = newest / "dcp" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # truncated: e.g. a disk that lost the tail of a file
    cfg = load_config(ROOT / "recipes" / "sd3_group_pickscore.yaml",
                      tiny_overrides(tiny_sd3, "group", **GROUP, **{"train.sharding": "fsdp"}))
    tr = OnlineTrainer(cfg, run, resume=True)
    try:
        tr.setup()
        assert tr.start_iteration == 2  # iter_000003 was unreadable: resumed from iter_000002
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert f"sharded checkpoint {newest} is unreadable" in capsys.readouterr().out
