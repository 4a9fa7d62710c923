"""Several nodes on the loopback interface: two `torchrun --nnodes 2` agents (one process each, a c10d
rendezvous on 127.0.0.1) train the tiny digits model sharded over both "nodes" (FSDP2, gloo) and
checkpoint every iteration; the run then resumes as one node of two processes and ends on the two-node
run's weights, bit for bit. (docs/cluster.md section 4: the SLURM script and the accelerate multi-node
config, run the same way.)"""
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import torch

from conftest import tiny_train_overrides
from flowrl.checkpoints import load_checkpoint
from flowrl.checkpoints.common import list_checkpoints

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(launcher: list[str], run: Path, overrides: list[str], resume: bool = False) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "flowrl", "train", "--config",
            "recipes/digits.yaml", "--output-dir", str(run), *overrides, *(["--resume"] if resume else [])]


def test_two_loopback_nodes_train_then_resume_as_one_node(tiny_digits_dir, tmp_path):
    over = tiny_train_overrides(tiny_digits_dir, **{"train.iterations": 3, "train.sharding": "fsdp",
                                                    "logging.eval_every": 100})
    two, one = tmp_path / "two-nodes", tmp_path / "one-node"
    port = _free_port()
    nodes = [subprocess.Popen(_train(["--nnodes", "2", "--node_rank", str(r), "--nproc_per_node", "1",
                                      "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
                                      "--rdzv_id", "flowrl-loopback"], two, over),
                              cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    for p in nodes:
        _, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-3000:]
    ckpts = list_checkpoints(two / "checkpoints")
    assert [c.name for c in ckpts] == ["iter_000002", "iter_000003"]  # keep 2
    assert sorted(p.name for p in (ckpts[-1] / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    shutil.copytree(two, one)  # the job is requeued on one node: its last iteration is lost and redone
    shutil.rmtree(one / "checkpoints" / "iter_000003")
    (one / "summary.json").unlink()
    r = subprocess.run(_train(["--nnodes", "1", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                               "--master_port", str(_free_port())], one, over, resume=True),
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = load_checkpoint(ckpts[-1]), load_checkpoint(list_checkpoints(one / "checkpoints")[-1])
    assert b["state"]["iteration"] == 3 and b["state"]["num_processes"] == 2
    assert a["trainable"].keys() == b["trainable"].keys()
    assert all(torch.equal(a["trainable"][k], b["trainable"][k]) for k in a["trainable"])
    assert any(v.abs().sum() > 0 for k, v in b["trainable"].items() if ".lora_B." in k)  # it trained


STUBS = {
    # srun: the command (after its options) as two nodes of this machine, SLURM_NODEID 0 and 1; fails if one fails
    "srun": '#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\nSLURM_NODEID=0 "$@" & a=$!\nSLURM_NODEID=1 "$@" & b=$!\n'
            'wait $a && wait $b\n',
    "scontrol": "#!/bin/sh\necho 127.0.0.1\n",  # `scontrol show hostnames LIST`: the first node is this machine
    "accelerate": f"#!/bin/sh\nexec {sys.executable} -m accelerate.commands.accelerate_cli \"$@\"\n",
}


def test_the_slurm_script_on_two_loopback_nodes(tiny_digits_dir, tmp_path):
    """configs/slurm/train.sbatch as SLURM runs it on two nodes (its srun / scontrol stubbed, one process per
    node): accelerate's multi-node config launches a two-process gloo world that trains and checkpoints."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in STUBS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    run = tmp_path / "run"
    over = tiny_train_overrides(tiny_digits_dir, **{"train.iterations": 1, "train.sharding": "fsdp",
                                                    "logging.eval_every": 100, "data.eval_prompts": "[a handwritten digit 1, a handwritten digit 2]"})
    env = {**ENV, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[0-1]",
           "GPUS_PER_NODE": "1", "MASTER_PORT": str(_free_port())}
    r = subprocess.run(["bash", "configs/slurm/train.sbatch", "recipes/digits.yaml", str(run), *over], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    summary = json.loads((run / "summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["ranks_in_sync"] is True and summary["iterations_done"] == 1
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["iter_000001"]
