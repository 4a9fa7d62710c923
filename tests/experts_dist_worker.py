"""One process of tests/test_wan22.py's two-process check of ``TwoExperts`` (run by ``torch.distributed.run``,
gloo on the CPU): process 0 holds a high-noise row, process 1 a low-noise row, so each process alone would
run a different expert. Under DDP and under FSDP2 (laid out by flowrl's ``parallelize``) two training steps and a
``no_grad`` forward must complete (DDP raises on the second step if a trained parameter got no gradient;
FSDP2 hangs if the processes run different experts), and the outputs and averaged gradients must equal a
single-process computation of both rows. Writes ``OUT/<rank>.pt`` with the largest differences."""
import copy
import sys

import torch
import torch.distributed as dist
from diffusers import WanTransformer3DModel

from flowrl.distributed.mesh import ParallelLayout
from flowrl.distributed.parallelize import parallelize
from flowrl.pipelines.experts import TwoExperts
from flowrl.utils.sharded import full_tensor

CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
              text_dim=16, freq_dim=32, ffn_dim=16, num_layers=1, cross_attn_norm=True,
              qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


def pair() -> TwoExperts:
    torch.manual_seed(0)
    high, low = WanTransformer3DModel(**CONFIG), WanTransformer3DModel(**CONFIG)
    return TwoExperts(high, low, 0.5).requires_grad_(True)


def inputs(rank: int) -> dict:
    g = torch.Generator().manual_seed(10 + rank)
    return dict(hidden_states=torch.randn(1, 4, 2, 4, 4, generator=g),
                encoder_hidden_states=torch.randn(1, 3, 16, generator=g),
                timestep=torch.tensor([900.0 if rank == 0 else 100.0]), return_dict=False)


def reference(world: int) -> tuple[list, dict]:
    """Each process's output and the gradient averaged over the processes, on one process."""
    model, outs = pair(), []
    for r in range(world):
        out = model(**inputs(r))[0]
        (out.square().mean() / world).backward()
        outs.append(out.detach())
    return outs, {n: p.grad.clone() for n, p in model.named_parameters()}


def check(model, rank: int, outs: list, grads: dict) -> tuple[float, float]:
    for _ in range(2):  # DDP checks in the second step that every trained parameter had a gradient
        for p in model.parameters():
            p.grad = None
        out = model(**inputs(rank))[0]
        out.square().mean().backward()
    with torch.no_grad():
        again = model(**inputs(rank))[0]  # a no-grad forward (FSDP2: the processes still agree)
    named = dict(model.named_parameters())
    named = {n.removeprefix("module."): p for n, p in named.items()}
    g_diff = max((full_tensor(named[n].grad) - g).abs().max().item() for n, g in grads.items())
    return max((out - outs[rank]).abs().max().item(), (again - outs[rank]).abs().max().item()), g_diff


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    outs, grads = reference(world)
    cpu = torch.device("cpu")
    replicated, sharded = pair(), pair()  # laid out by the trainer's one path (the processes' agreement included)
    parallelize([replicated], ParallelLayout(world, rank), cpu)
    parallelize([sharded], ParallelLayout(world, rank, sharded=True), cpu)
    result = {"ddp": check(torch.nn.parallel.DistributedDataParallel(replicated), rank, outs, grads),
              "fsdp": check(sharded, rank, outs, grads)}
    torch.save(result, f"{out_dir}/{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
