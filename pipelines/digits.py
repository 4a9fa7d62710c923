"""The embedded default: a tiny rectified-flow transformer on scikit-learn's digits.

Pixel space, 1 x 16 x 16 in [-1, 1] (the bundled 8 x 8 digits upsampled bilinearly), a real
diffusers ``SD3Transformer2DModel`` at toy size, and a small text encoder of its own
(no tokenizer download): prompts like ``"a handwritten digit 7"``. ``flowrl pretrain-digits``
trains it on CPU in a few minutes and caches it; at guidance 1.0 its samples are readable
but imperfect, so RL has room to improve (like CFG-free SD3).
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from flowrl.data.digits import DIGIT_WORDS, IMAGE_SIZE, digit_prompt, digits_dataset, parse_digit

from .pixel_flow import PixelFlowPolicy, PretrainConfig
from .pixel_flow import base_lock as pixel_base_lock
from .pixel_flow import rowwise_linear as _rowwise_linear

PAD, OTHER = 0, 11  # token ids; digits are 1..10

# The digits data and prompts are flowrl.data.digits' (shared with the digits reward). The sample
# report (sample_grid_report) is flowrl.digits_report's: it samples with flowrl.rollout, a layer above.
__all__ = ["default_base_path", "tokenize", "DigitTextEncoder", "DigitsPolicy", "PretrainConfig", "pretrain_digits",
           "tiny_transformer_config", "load_digits_policy"]


def tokenize(prompts: list[str], max_len: int) -> torch.Tensor:
    """Word-level ids ``[B, max_len]``: digits (numeral or word) -> 1..10, other words -> 11, pad 0."""
    out = torch.zeros(len(prompts), max_len, dtype=torch.long)
    for b, p in enumerate(prompts):
        if not isinstance(p, str):
            raise TypeError(f"prompt {b} is {type(p).__name__}, expected str")
        ids = []
        for tok in re.findall(r"[a-z0-9]+", p.lower()):
            d = int(tok) if tok.isdigit() and len(tok) == 1 else (DIGIT_WORDS.index(tok) if tok in DIGIT_WORDS else None)
            ids.append(OTHER if d is None else d + 1)
        ids = ids[:max_len]
        out[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


class DigitTextEncoder(ModelMixin, ConfigMixin):
    """Token + position embeddings and a small MLP -> SD3-style conditioning.

    Returns ``encoder_hidden_states`` [B, L, joint_dim] and ``pooled_projections`` [B, pooled_dim]
    (mean over non-pad tokens; the empty prompt, used for guidance, maps to learned null vectors).
    """

    @register_to_config
    def __init__(self, vocab_size: int = 12, max_len: int = 8, joint_dim: int = 32, pooled_dim: int = 32):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, joint_dim)
        self.pos = nn.Parameter(torch.zeros(max_len, joint_dim))
        self.mlp = nn.Sequential(nn.Linear(joint_dim, joint_dim), nn.GELU(), nn.Linear(joint_dim, joint_dim))
        self.pool = nn.Linear(joint_dim, pooled_dim)
        self.null_pooled = nn.Parameter(torch.zeros(pooled_dim))

    def forward(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        ids = tokenize(prompts, self.config.max_len).to(self.pos.device)  # [B, L]
        mask = (ids != PAD).float().unsqueeze(-1)  # [B, L, 1]
        h = self.tok(ids) + self.pos  # [B, L, D]
        fc1, act, fc2 = self.mlp
        h = h + _rowwise_linear(fc2, act(_rowwise_linear(fc1, h)))
        n = mask.sum(1)  # [B, 1]
        pooled = _rowwise_linear(self.pool, (h * mask).sum(1) / n.clamp(min=1))  # [B, P]
        pooled = torch.where(n > 0, pooled, self.null_pooled.expand_as(pooled))
        return {"encoder_hidden_states": h * mask, "pooled_projections": pooled}


def tiny_transformer_config() -> dict:
    return dict(sample_size=IMAGE_SIZE, patch_size=2, in_channels=1, out_channels=1, num_layers=4,
                attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                caption_projection_dim=64, pooled_projection_dim=32, pos_embed_max_size=IMAGE_SIZE // 2)


class DigitsPolicy(PixelFlowPolicy):
    """``FlowPolicy`` over the digits model (:class:`~flowrl.pipelines.pixel_flow.PixelFlowPolicy`: 1 x 16 x 16
    grey pixels). ``guidance_scale`` 1.0 = no CFG (one pass)."""

    kind, pretrain_verb, base_dir, tiny_kinds = "digits", "pretrain-digits", "digits-base-v1", ("digits",)
    text_encoder_class, transformer_config = DigitTextEncoder, staticmethod(tiny_transformer_config)
    channels, image_size, report = 1, IMAGE_SIZE, "flowrl.digits_report:cached_report"

    @classmethod
    def pretrain_data(cls, config: PretrainConfig):
        """All of scikit-learn's digits, drawn uniformly with replacement."""
        x, y = digits_dataset("all")

        def draw(g: torch.Generator, n: int) -> tuple[torch.Tensor, list[str]]:
            idx = torch.randint(0, len(y), (n,), generator=g)
            return x[idx], [digit_prompt(int(label)) for label in y[idx]]  # [n, 1, 16, 16], n prompts
        return draw

    def reference_images(self, prompts: list[str], per_prompt: int) -> Optional[torch.Tensor]:
        """Real digits (held-out split) for each prompt's digit, ``[len * per_prompt, 3, 16, 16]``:
        the real-data values beside which the trainer logs diversity and artifact energy."""
        x, y = digits_dataset("test")
        out = []
        for p in prompts:
            d = parse_digit(p)
            if d is None:
                return None
            out.append(x[y == d][:per_prompt])
        return self.decode(torch.cat(out))


def pretrain_digits(out_dir: str | os.PathLike, config: PretrainConfig = PretrainConfig(),
                    progress: bool = True) -> dict:
    """Rectified-flow pretraining of the digits base on all of scikit-learn's digits
    (:meth:`PixelFlowPolicy.pretrain`): writes ``out_dir`` atomically, returns the summary dict."""
    return DigitsPolicy.pretrain(out_dir, config, progress)


def default_base_path() -> Path:
    return DigitsPolicy.default_base_path()


def base_lock(path: str | os.PathLike):
    """Held while the digits base at ``path`` is pretrained (:func:`flowrl.pipelines.pixel_flow.base_lock`)."""
    return pixel_base_lock(path, "digits")


def load_digits_policy(path: Optional[str] = None, pretrain_if_missing: bool = True, **kwargs) -> DigitsPolicy:
    """Load the digits base from ``path`` (default: the cache), pretraining it on first use (under
    :func:`base_lock`: one process pretrains, the others wait for it)."""
    return DigitsPolicy.load_base(path, pretrain_if_missing, **kwargs)
