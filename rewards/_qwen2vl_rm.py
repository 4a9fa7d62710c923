"""Qwen2-VL reward models (``hpsv3``, ``videoalign``): a Qwen2-VL backbone, a head on its last hidden state,
read at the special reward tokens the prompt carries.

Both authors' models (HPSv3, arXiv 2508.03789; VideoAlign, arXiv 2501.13918) subclass transformers'
``Qwen2VLForConditionalGeneration`` and replace its forward: the token embeddings with the vision tower's
merged patch features scattered into the image / video pad tokens, then the language model called with
``inputs_embeds`` and no position ids, so positions are the plain sequential ones (``0..L-1`` on all three
M-RoPE axes), not the 3-D M-RoPE of Qwen2-VL's generation. :class:`QwenVLReward` does the same; the LM head
is not built (unused for scoring). Pixels follow ``qwen-vl-utils`` (``_qwen_vl.smart_resize``, ``smart_nframes``),
then the base model's processor normalises and patchifies them (its own resize off: the sizes are already
multiples of 28).
"""
from __future__ import annotations

import math
import re
from typing import Mapping, Sequence

import torch
from torch import nn

from ._clip_common import from_pretrained, load_weights, require

FRAME_FACTOR = 2  # Qwen2-VL's temporal patch: frame counts are even


def smart_nframes(total: int, video_fps: float, fps: float, min_frames: int = 4, max_frames: int = 768) -> int:
    """``qwen-vl-utils``' ``smart_nframes`` (``fps`` mode): ``total / video_fps * fps`` frames, clamped to
    ``[min_frames, min(max_frames, total)]`` and rounded to an even count, at most ``total``."""
    lo = math.ceil(min_frames / FRAME_FACTOR) * FRAME_FACTOR
    hi = math.floor(min(max_frames, total) / FRAME_FACTOR) * FRAME_FACTOR
    n = round(min(max(total / video_fps * fps, lo), hi) / FRAME_FACTOR) * FRAME_FACTOR
    n = min(n, total)
    if not FRAME_FACTOR <= n <= total:
        raise ValueError(f"a video of {total} frames is too short: Qwen2-VL needs at least {FRAME_FACTOR}")
    return n


def uniform_indices(total: int, n: int) -> list[int]:
    """The authors' uniform sampling: ``linspace(0, total - 1, n)`` rounded."""
    return torch.linspace(0, total - 1, n).round().long().tolist()


def check_prompts(prompts: Sequence[str], tokens: Sequence[str], name: str) -> None:
    """A one-line ValueError when a prompt holds a reward token's text (the head reads it where it occurs)."""
    bad = next((t for p in prompts for t in tokens if t in p), None)
    if bad is not None:
        raise ValueError(f"{name} reward: a prompt contains {bad!r}, the reward token the model is read at; "
                         "remove it from the prompt")


# ---------------------------------------------------------------- checkpoints in the authors' layouts
_PEFT = "base_model.model."


def merge_lora(sd: Mapping[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A PEFT state dict (``*.base_layer.weight`` + ``*.lora_A/B.default.weight``) -> plain ``*.weight`` keys with
    ``W = W0 + scaling * B @ A`` (``scaling = lora_alpha / r``); ``modules_to_save`` copies win. A ``base_model.model.``
    prefix stays (:func:`split_checkpoint` removes it)."""
    out, lora = {}, {}
    for k, v in sd.items():
        m = re.match(r"(.*)\.lora_([AB])\.default\.weight$", k)
        if m:
            lora.setdefault(m.group(1), {})[m.group(2)] = v
        elif ".original_module." in k:
            continue
        else:
            out[k.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")] = v
    for name, ab in lora.items():
        if set(ab) != {"A", "B"} or name + ".weight" not in out:
            raise ValueError(f"LoRA weights of {name!r} are incomplete (need base_layer, lora_A and lora_B)")
        w = out[name + ".weight"]
        out[name + ".weight"] = w.float() + scaling * (ab["B"].float() @ ab["A"].float())  # [out, in], float32 until
        # the reward's dtype is applied: a bf16 checkpoint's merged weight is rounded once, to the dtype asked for
    return out


def split_checkpoint(sd: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
    """A reward checkpoint (transformers < 4.52 keys ``model.*`` / ``visual.*``, or newer ``model.language_model.*``
    / ``model.visual.*``; each maybe under PEFT's ``base_model.model.``) -> (``Qwen2VLModel`` state dict, head state
    dict); the LM head is dropped."""
    backbone, head = {}, {}
    for k, v in sd.items():
        k = k[len(_PEFT):] if k.startswith(_PEFT) else k
        if k.startswith("rm_head."):
            head[k[len("rm_head."):]] = v
        elif k.startswith("lm_head."):
            continue
        elif k.startswith(("model.visual.", "model.language_model.")):
            backbone[k[len("model."):]] = v
        elif k.startswith("visual."):
            backbone[k] = v
        elif k.startswith("model."):
            backbone["language_model." + k[len("model."):]] = v
        else:
            raise ValueError(f"unexpected key {k!r} in the reward checkpoint (is it this reward's checkpoint?)")
    return backbone, head


def build_backbone(base: str, vocab_size: int, sd: Mapping[str, torch.Tensor], setting: str):
    """``Qwen2VLModel`` of ``base``'s config (``from_pretrained``: a directory or a cached hub id) with the
    vocabulary grown to ``vocab_size`` (the reward tokens), its weights all from ``sd`` (strict)."""
    transformers = require("transformers", "transformers")
    accelerate = require("accelerate", "accelerate")
    config = from_pretrained(transformers.AutoConfig.from_pretrained, base, "Qwen2-VL config", setting)
    if getattr(config, "model_type", "") != "qwen2_vl":
        raise ValueError(f"{setting}: {base!r} is a {getattr(config, 'model_type', '?')!r} model; this reward's "
                         "backbone is Qwen2-VL (model_type 'qwen2_vl')")
    config.text_config.vocab_size = vocab_size
    config._attn_implementation = config.text_config._attn_implementation = "sdpa"
    config.vision_config._attn_implementation = "sdpa"
    with accelerate.init_empty_weights(include_buffers=False):  # parameters on meta; rotary buffers computed
        model = transformers.Qwen2VLModel(config)
    try:
        model.load_state_dict(dict(sd), strict=True, assign=True)
    except RuntimeError as e:
        detail = " ".join(str(e).split())[:400]
        raise ValueError(f"the checkpoint does not fit {base!r}'s Qwen2-VL (check {setting}): {detail}") from None
    return model


def load_processor(base: str, tokens: Sequence[str], setting: str):
    """The base model's processor (right padding, as the authors') with ``tokens`` added as special tokens;
    returns (processor, their ids)."""
    transformers = require("transformers", "transformers")
    processor = from_pretrained(transformers.AutoProcessor.from_pretrained, base, "Qwen2-VL processor", setting,
                                padding_side="right")
    processor.tokenizer.padding_side = "right"
    processor.tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)})
    return processor, [int(i) for i in processor.tokenizer.convert_tokens_to_ids(list(tokens))]


def load_checkpoint(checkpoint: str, what: str, hint: str, setting: str, lora_scaling: float = 0.0):
    """The reward's state dict, LoRA merged when it is a PEFT one -> (backbone sd, head sd)."""
    sd = load_weights(checkpoint, what, hint, setting)
    if any(".lora_A." in k for k in sd):
        sd = merge_lora(sd, lora_scaling)
    return split_checkpoint(sd)


class QwenVLReward(nn.Module):
    """Backbone + head: ``forward(batch)`` -> the head's outputs at the reward tokens, float32 ``[B, T, O]``
    (``T`` reward tokens per row, in prompt order; ``O`` head outputs)."""

    def __init__(self, backbone: nn.Module, head: nn.Module, token_ids: Sequence[int]):
        super().__init__()
        self.backbone, self.head, self.token_ids = backbone, head, list(token_ids)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **vision) -> torch.Tensor:
        bb = self.backbone
        emb = bb.get_input_embeddings()(input_ids)  # [B, L, D]
        for pixels, grid, token in (("pixel_values", "image_grid_thw", bb.config.image_token_id),
                                    ("pixel_values_videos", "video_grid_thw", bb.config.video_token_id)):
            if vision.get(pixels) is not None:
                feats = bb.visual(vision[pixels].to(bb.visual.dtype), grid_thw=vision[grid]).pooler_output  # [N, D]
                mask = (input_ids == token)[..., None].expand_as(emb)  # [B, L, D]
                emb = emb.masked_scatter(mask, feats.to(emb.dtype))
        b, n = input_ids.shape
        pos = torch.arange(n, device=emb.device).view(1, 1, n).expand(3, b, n)  # [3, B, L]: the authors' 1-D positions
        hidden = bb.language_model(inputs_embeds=emb, attention_mask=attention_mask,
                                   position_ids=pos).last_hidden_state  # [B, L, D]
        at = torch.zeros_like(input_ids, dtype=torch.bool)
        for t in self.token_ids:
            at |= input_ids == t
        counts = at.sum(1)
        if not bool((counts == len(self.token_ids)).all()):
            raise ValueError(f"each row must hold its {len(self.token_ids)} reward tokens once, found "
                             f"{counts.tolist()}: a prompt may not contain the reward tokens' text")
        out = self.head.float()(hidden[at].float())  # [B * T, O]
        return out.view(b, len(self.token_ids), -1)  # [B, T, O]
