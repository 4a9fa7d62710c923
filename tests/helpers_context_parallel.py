"""Run under ``torchrun`` by tests/test_context_parallel.py: one transformer forward + backward split over the
processes' context-parallel groups (Ulysses, ring, both, FSDP2 over the same processes) against the same
forward on one process, for the tiny Wan and Qwen-Image transformers.

Each process computes the one-process reference itself (the unsplit model on the whole batch), then the
split one; every data-parallel replica runs the same batch, and the split gradients are averaged over all
processes as DDP does (or reduce-scattered by FSDP2 and gathered back), so they must equal the reference's.
Writes ``OUT/rank{R}.json``: per case the largest relative differences of the output, the loss and the
gradients. ``python -m torch.distributed.run --nproc_per_node N tests/helpers_context_parallel.py OUT CASE...``
"""
from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist


def wan():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    m = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
                              out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2,
                              cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    g = torch.Generator().manual_seed(1)
    kw = dict(hidden_states=torch.randn(2, 16, 2, 4, 4, generator=g), timestep=torch.tensor([500.0, 300.0]),
              encoder_hidden_states=torch.randn(2, 7, 32, generator=g), return_dict=False)  # 8 video tokens
    return m, kw


def qwen():
    """The tiny Qwen-Image transformer with a text mask (the second prompt 2 tokens shorter)."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    m = QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
                                    num_attention_heads=2, joint_attention_dim=16, guidance_embeds=False,
                                    axes_dims_rope=(8, 4, 4))
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    kw = dict(hidden_states=torch.randn(2, 4, 64, generator=g), timestep=torch.tensor([0.5, 0.3]),
              encoder_hidden_states=torch.randn(2, 8, 16, generator=g), encoder_hidden_states_mask=mask,
              img_shapes=[[(1, 2, 2)]] * 2, return_dict=False)  # 4 image tokens, 8 text tokens
    return m, kw


def flux():
    """The tiny FLUX.1 transformer (one double-stream and one single-stream block, guidance-distilled)."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    m = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
                               num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                               guidance_embeds=True, axes_dims_rope=(4, 4, 8))
    g = torch.Generator().manual_seed(1)
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(2.0), torch.arange(2.0), indexing="ij"),
                          -1).reshape(4, 3)  # [S_img, 3]
    kw = dict(hidden_states=torch.randn(2, 4, 64, generator=g), encoder_hidden_states=torch.randn(2, 8, 32, generator=g),
              pooled_projections=torch.randn(2, 32, generator=g), timestep=torch.tensor([0.5, 0.3]),
              guidance=torch.tensor([3.5, 3.5]), img_ids=img_ids, txt_ids=torch.zeros(8, 3),
              return_dict=False)  # 4 image tokens, 8 text tokens
    return m, kw


def loss_and_grads(model, kw):
    out = model(**kw)[0]  # [B, S, C]
    loss = (out.float() ** 2).mean() + out.float().mean()
    loss.backward()
    return out.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def case(build, attention: str, fsdp: bool, layout):
    import dataclasses

    from flowrl.distributed.context import attention_heads
    from flowrl.distributed.parallelize import parallelize
    from flowrl.utils.sharded import full_tensor

    model, kw = build()
    split = copy.deepcopy(model)
    out0, loss0, grads0 = loss_and_grads(model, kw)
    layout = dataclasses.replace(layout, sharded=fsdp, attention=attention).with_attention(attention_heads(split))
    parallelize([split], layout, torch.device("cpu"))  # the trainer's one path: context parallel, then FSDP2
    out, loss, grads = loss_and_grads(split, kw)
    diffs = {}
    for n, g in grads.items():
        g = full_tensor(g)  # FSDP2: reduce-scattered (averaged) shards
        if not fsdp:
            dist.all_reduce(g)
            g = g / layout.world  # as DDP averages
        diffs[n] = rel(g, grads0[n])
    return {"out": rel(out, out0), "loss": rel(loss, loss0), "grad": max(diffs.values()), "grads": len(diffs),
            "grads_expected": len(grads0)}


def main(out_dir: str, cases: list[str]) -> None:
    """``cases``: ``MODEL-ATTENTION-CP-SHARDING``, e.g. ``wan-ring-2-none`` (model wan, qwen or flux, attention auto,
    ulysses or ring, the context-parallel degree, sharding none (DDP's average) or fsdp)."""
    from flowrl.distributed.mesh import ParallelLayout

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    results = {}
    for name in cases:
        model, attention, cp, sharding = name.split("-")
        layout = ParallelLayout(world, rank, int(cp))
        results[name] = case({"wan": wan, "qwen": qwen, "flux": flux}[model], attention, sharding == "fsdp", layout)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
