"""The shapes world's model: a tiny text-to-image rectified-flow transformer on :mod:`flowrl.data.shapes`.

Pixel space, 3 x 32 x 32 RGB in [-1, 1] (coloured circles, squares, triangles and diamonds on a light
grey background), a real diffusers ``SD3Transformer2DModel`` at toy size, and a text encoder of its
own that can learn GenEval's compositional prompts (``a photo of a red circle and a blue square``,
``a photo of three diamonds``, ``a photo of a square left of a triangle``): word ids from the
world's vocabulary, position embeddings and two small transformer layers, so a colour binds to its
shape and a relation to the order of its objects. ``flowrl pretrain-shapes`` trains it on the
training prompts' scenes on the CPU in minutes and caches it; the base draws single objects and
colours well and counts and places poorly, so GenEval-rule RL has room (docs/models.md).
"""
from __future__ import annotations

import math
import os
import re
from functools import lru_cache
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from flowrl.data.shapes import IMAGE_SIZE, render, scene_for, shapes_batch, shapes_rows

from .pixel_flow import PixelFlowPolicy, rowwise_linear
from .pretrain_config import PretrainConfig, ShapesPretrainConfig

__all__ = ["VOCAB", "tokenize", "ShapesTextEncoder", "ShapesPolicy", "ShapesPretrainConfig", "pretrain_shapes",
           "tiny_transformer_config", "load_shapes_policy"]

PAD, UNKNOWN = 0, 1  # token ids; the vocabulary's words are 2..


@lru_cache(maxsize=1)
def _vocab() -> tuple[str, ...]:
    words = {w for r in shapes_rows("all") for w in re.findall(r"[a-z]+", r["prompt"])}
    return tuple(sorted(words | {"one"}))


VOCAB = _vocab()  # every word of the shapes prompts (sorted); any other word is UNKNOWN


def tiny_transformer_config() -> dict:
    """Patch 4 (64 image tokens) x 4 layers of width 128: 2.3 M parameters (against patch 2 x width 64, 0.6 M:
    a training step 0.19 s instead of 0.30 s on one thread, and a lower loss at the same step)."""
    return dict(sample_size=IMAGE_SIZE, patch_size=4, in_channels=3, out_channels=3, num_layers=4,
                attention_head_dim=32, num_attention_heads=4, joint_attention_dim=64,
                caption_projection_dim=128, pooled_projection_dim=64, pos_embed_max_size=IMAGE_SIZE // 4)


def tokenize(prompts: list[str], max_len: int) -> torch.Tensor:
    """Word-level ids ``[B, max_len]``: a word of :data:`VOCAB` -> 2.., any other word -> 1, pad 0
    (a prompt longer than ``max_len`` words is cut)."""
    index = {w: i + 2 for i, w in enumerate(VOCAB)}
    out = torch.zeros(len(prompts), max_len, dtype=torch.long)
    for b, p in enumerate(prompts):
        if not isinstance(p, str):
            raise TypeError(f"prompt {b} is {type(p).__name__}, expected str")
        ids = [index.get(w, UNKNOWN) for w in re.findall(r"[a-z0-9]+", p.lower())][:max_len]
        out[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


def _linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``: a GEMM while training (fast), row by row in eval mode
    (:func:`~flowrl.pipelines.pixel_flow.rowwise_linear`: a prompt's conditioning does not depend on its
    batch-mates, as the text-embedding cache needs). x [..., in] -> [..., out]."""
    return layer(x) if layer.training else rowwise_linear(layer, x)


class _Block(nn.Module):
    """A pre-norm transformer encoder layer (self-attention over the prompt's words, then an MLP)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, h: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """h [B, L, D]; keys [B, L] bool (the words a word may attend to) -> [B, L, D]."""
        b, n, d = h.shape
        q, k, v = _linear(self.qkv, self.norm1(h)).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        scores = (q.unsqueeze(2) * k.unsqueeze(1)).sum(-1) / math.sqrt(d // self.heads)  # [B, Lq, Lk, H]
        attn = scores.masked_fill(~keys[:, None, :, None], float("-inf")).softmax(dim=2)  # [B, Lq, Lk, H]
        mixed = (attn.unsqueeze(-1) * v.unsqueeze(1)).sum(2).reshape(b, n, d)  # [B, L, D]
        h = h + _linear(self.out, mixed)
        return h + _linear(self.fc2, F.gelu(_linear(self.fc1, self.norm2(h))))


class ShapesTextEncoder(ModelMixin, ConfigMixin):
    """Word + position embeddings and ``layers`` transformer layers -> SD3-style conditioning.

    Returns ``encoder_hidden_states`` [B, L, joint_dim] (zero at pads) and ``pooled_projections``
    [B, pooled_dim] (mean over words; the empty prompt, used for guidance, maps to a learned null vector).
    """

    @register_to_config
    def __init__(self, vocab_size: int = len(VOCAB) + 2, max_len: int = 12, joint_dim: int = 64,
                 pooled_dim: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, joint_dim)
        self.pos = nn.Parameter(torch.randn(max_len, joint_dim) * 0.02)
        self.blocks = nn.ModuleList(_Block(joint_dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(joint_dim)
        self.pool = nn.Linear(joint_dim, pooled_dim)
        self.null_pooled = nn.Parameter(torch.zeros(pooled_dim))

    def forward(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        ids = tokenize(prompts, self.config.max_len).to(self.pos.device)  # [B, L]
        words = ids != PAD  # [B, L]
        n = words.sum(1, keepdim=True)  # [B, 1]
        keys = words | (n == 0)  # the empty prompt attends to its pads (its outputs are zeroed below)
        h = self.tok(ids) + self.pos  # [B, L, D]
        for block in self.blocks:
            h = block(h, keys)
        mask = words.float().unsqueeze(-1)  # [B, L, 1]
        h = self.norm(h) * mask  # [B, L, D]
        pooled = _linear(self.pool, h.sum(1) / n.clamp(min=1))  # [B, P]
        pooled = torch.where(n > 0, pooled, self.null_pooled.expand_as(pooled))
        return {"encoder_hidden_states": h, "pooled_projections": pooled}


class ShapesPolicy(PixelFlowPolicy):
    """``FlowPolicy`` over the shapes model (:class:`~flowrl.pipelines.pixel_flow.PixelFlowPolicy`: 3 x 32 x 32
    RGB pixels). ``guidance_scale`` 1.0 = no CFG (one pass)."""

    kind, pretrain_verb, base_dir, tiny_kinds = "shapes", "pretrain-shapes", "shapes-base-v2", ("shapes",)
    pretrain_config, report = ShapesPretrainConfig, "flowrl.shapes_report:cached_report"
    text_encoder_class, transformer_config = ShapesTextEncoder, staticmethod(tiny_transformer_config)
    channels, image_size = 3, IMAGE_SIZE

    @classmethod
    def pretrain_data(cls, config: PretrainConfig):
        """Scenes of the training prompts (:func:`flowrl.data.shapes.shapes_batch`, each tag as often),
        from a numpy generator seeded with ``config.seed``."""
        rng = np.random.default_rng(config.seed)

        def draw(g: torch.Generator, n: int) -> tuple[torch.Tensor, list[str]]:
            return shapes_batch(n, rng, "train")  # [n, 3, 32, 32], n prompts
        return draw

    def reference_images(self, prompts: list[str], per_prompt: int) -> Optional[torch.Tensor]:
        """Real renders (fixed seeds) of each prompt's row, ``[len * per_prompt, 3, 32, 32]`` in [0, 1]:
        the real-data values beside which the trainer logs diversity and artifact energy (None when a
        prompt is not a shapes prompt)."""
        rows = {r["prompt"]: r for r in shapes_rows("all")}
        if any(p not in rows for p in prompts):
            return None
        g = np.random.default_rng(0)
        scenes = [scene_for(rows[p], g) for p in prompts for _ in range(per_prompt)]
        return self.decode(render(scenes))


def pretrain_shapes(out_dir: str | os.PathLike, config: Optional[PretrainConfig] = None,
                    progress: bool = True) -> dict:
    """Rectified-flow pretraining of the shapes base on the training prompts' scenes
    (:meth:`PixelFlowPolicy.pretrain`): writes ``out_dir`` atomically, returns the summary dict."""
    return ShapesPolicy.pretrain(out_dir, config, progress)


def load_shapes_policy(path: Optional[str] = None, pretrain_if_missing: bool = True, **kwargs) -> ShapesPolicy:
    """Load the shapes base from ``path`` (default: the cache), pretraining it on first use (under
    :func:`flowrl.pipelines.pixel_flow.base_lock`: one process pretrains, the others wait for it)."""
    return ShapesPolicy.load_base(path, pretrain_if_missing, **kwargs)
