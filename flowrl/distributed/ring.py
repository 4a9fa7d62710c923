"""Ring attention under diffusers' native (SDPA) attention backend, forward and backward.

diffusers' ``TemplatedRingAttention`` passes each rank's key/value chunk around the context-parallel
group and merges the partial outputs by their log-sum-exp; its backward recomputes each chunk's
gradients from the merged output and log-sum-exp. It asks the backend's forward op for that
log-sum-exp, which ``torch.nn.functional.scaled_dot_product_attention`` does not return, so the native
backend (the only one on a CPU; the default on GPUs) raises under ring attention. This module gives
it a pair of plain-torch ops in diffusers' op protocol (``[B, S, H, D]`` tensors) and routes the native
backend's context-parallel calls with a ring degree > 1 to them; every other call (no context
parallelism, Ulysses alone, other backends) is unchanged. The ops materialise one ``[B, H, S_q, S_k]``
score block per key/value chunk (``S / C`` tokens each), in float32: exact, and memory-heavy on long
sequences, where a GPU run should pick a flash backend (``transformer.set_attention_backend``), whose
own ring support needs nothing from here.

Attention masks are refused under ring attention: diffusers passes a rank's mask unchanged to every
key/value chunk, which would mask the wrong keys (Qwen-Image's text padding); such a model runs with a
degree that divides its heads (Ulysses).
"""
from __future__ import annotations

import math

import torch

_ORIGINAL: dict = {}


def _scores(query: torch.Tensor, key: torch.Tensor, scale) -> torch.Tensor:
    """``q k^T * scale`` float32 ``[B, H, S_q, S_k]`` from ``[B, S, H, D]`` inputs."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    return torch.einsum("bqhd,bkhd->bhqk", query.float(), key.float()) * scale


def lse_forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
    """Attention of one key/value chunk -> ``(out [B, S_q, H, D], lse [B, S_q, H] float32)``."""
    if attn_mask is not None or dropout_p or is_causal or enable_gqa:
        raise ValueError("ring attention under the native backend takes no attention mask, dropout, causal mask or "
                         "GQA; use a context-parallel degree that divides the attention heads (Ulysses)")
    if _save_ctx:
        ctx.save_for_backward(query, key, value)
        ctx.flowrl_scale = scale
    s = _scores(query, key, scale)  # [B, H, S_q, S_k]
    lse = torch.logsumexp(s, dim=-1)  # [B, H, S_q]
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse[..., None]), value.float())  # [B, S_q, H, D]
    out = out.to(query.dtype)
    lse = lse.permute(0, 2, 1)  # [B, S_q, H]
    return (out, lse) if return_lse else out


def lse_backward_op(ctx, grad_out, *args, query=None, key=None, value=None, out=None, lse=None, **kwargs):
    """Gradients of one chunk's attention given the merged output and log-sum-exp (softmax over all chunks):
    ``P = exp(q k^T s - lse)``, ``dV = P^T dO``, ``dS = P (dO V^T - rowsum(dO * O))``, ``dQ = dS K s``,
    ``dK = dS^T Q s``."""
    scale = ctx.flowrl_scale
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    p = torch.exp(_scores(query, key, scale) - lse.float().permute(0, 2, 1)[..., None])  # [B, H, S_q, S_k]
    g = grad_out.float()  # [B, S_q, H, D]
    dv = torch.einsum("bhqk,bqhd->bkhd", p, g)  # [B, S_k, H, D]
    dp = torch.einsum("bqhd,bkhd->bhqk", g, value.float())  # [B, H, S_q, S_k]
    rowsum = (g * out.float()).sum(-1).permute(0, 2, 1)[..., None]  # [B, H, S_q, 1]
    ds = p * (dp - rowsum)  # [B, H, S_q, S_k]
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, key.float()) * scale  # [B, S_q, H, D]
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, query.float()) * scale  # [B, S_k, H, D]
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


def _native_or_ring(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False, return_lse=False, _parallel_config=None):
    """diffusers' native backend, with ring attention through :func:`lse_forward_op` / :func:`lse_backward_op`."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _templated_context_parallel_attention

    cp = getattr(_parallel_config, "context_parallel_config", None)
    if cp is None or cp.ring_degree == 1:
        return _ORIGINAL[AttentionBackendName.NATIVE](query, key, value, attn_mask, dropout_p, is_causal, scale,
                                                      enable_gqa, return_lse, _parallel_config)
    return _templated_context_parallel_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                                 return_lse, forward_op=lse_forward_op, backward_op=lse_backward_op,
                                                 _parallel_config=_parallel_config)


def install_native_ring() -> None:
    """Route the native backend's ring-attention calls to the ops above (idempotent; module doc)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    name = AttentionBackendName.NATIVE
    if name not in _ORIGINAL:
        _ORIGINAL[name] = _AttentionBackendRegistry._backends[name]
        _AttentionBackendRegistry._backends[name] = _native_or_ring
