"""``imagereward``: ImageReward v1.0 (Xu et al., NeurIPS 2023), a BLIP reward model.

reward = ``(MLP(h_CLS) - 0.16717362830052426) / 1.0333394966054072``, where ``h_CLS`` is the
first-token output of BLIP's BERT text encoder cross-attending to the BLIP ViT-L/16 image
tokens; the MLP is the 5-Linear no-activation head. Mean/std are ImageReward's own
normalisation (``ImageReward.py``), so scores are roughly standard-normal over its training
distribution; Flow-GRPO uses them unscaled.

The architecture is rebuilt on transformers' BLIP parts so that the published
``ImageReward.pt`` (Hugging Face ``THUDM/ImageReward``; the hub file ``hf://THUDM/ImageReward/ImageReward.pt``
is read from the local cache, or downloaded) loads without the ``image-reward`` package: ``BlipVisionModel`` (the BLIP ViT; timm key names are mapped) and ``BlipTextModel``
(the BLIP "med" BERT with cross-attention; same key names). Text: ``bert-base-uncased``
tokenizer plus BLIP's ``[DEC]``/``[ENC]`` tokens, padded to 35 tokens, first token ``[CLS]``
(as ImageReward's ``score``, which does not swap in ``[ENC]``). Images: shorter side -> 224
bicubic, centre crop at torchvision's rounded offset, OpenAI CLIP mean/std.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Mapping, Optional, Union

import torch
from torch import nn

from flowrl.options import Device, ModelSource, PositiveInt, WeightsFile

from ._clip_common import CLIP_MEAN, CLIP_STD, DTypeLike, ImageTransform, LinearMLPHead, check_inputs, chunks, \
    from_pretrained, load_weights, require, resolve_dtype

log = logging.getLogger(__name__)

IMAGEREWARD_MEAN = 0.16717362830052426
IMAGEREWARD_STD = 1.0333394966054072
MAX_TEXT_TOKENS = 35
HUB_CHECKPOINT = "hf://THUDM/ImageReward/ImageReward.pt"
CHECKPOINT_HINT = (f"Pass checkpoint={HUB_CHECKPOINT} (the THUDM/ImageReward Hugging Face repository; cached or "
                   f"downloaded) or checkpoint='/path/to/ImageReward.pt'.")

# BLIP ``create_vit('large', 224)``: ViT-L/16, LayerNorm eps 1e-6, exact GELU
DEFAULT_VISION = dict(image_size=224, patch_size=16, hidden_size=1024, intermediate_size=4096,
                      num_hidden_layers=24, num_attention_heads=16, layer_norm_eps=1e-6, hidden_act="gelu")
# ImageReward's ``med_config.json`` (BLIP's BERT-base config with cross-attention)
DEFAULT_MED = dict(vocab_size=30524, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                   intermediate_size=3072, hidden_act="gelu", max_position_embeddings=512, layer_norm_eps=1e-12,
                   pad_token_id=0, encoder_width=768, add_cross_attention=True)
_MED_TO_BLIP_TEXT = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                     "hidden_act", "max_position_embeddings", "layer_norm_eps", "pad_token_id")

# original BLIP ViT (timm naming) -> transformers BlipVisionModel
_VIT_RENAMES = [
    (r"^cls_token$", "embeddings.class_embedding"),
    (r"^pos_embed$", "embeddings.position_embedding"),
    (r"^patch_embed\.proj\.", "embeddings.patch_embedding."),
    (r"^blocks\.(\d+)\.norm1\.", r"encoder.layers.\1.layer_norm1."),
    (r"^blocks\.(\d+)\.norm2\.", r"encoder.layers.\1.layer_norm2."),
    (r"^blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
    (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
    (r"^blocks\.(\d+)\.mlp\.fc(\d)\.", r"encoder.layers.\1.mlp.fc\2."),
    (r"^norm\.", "post_layernorm."),
]
# in ImageReward.pt but unused for scoring (BLIP's contrastive projections, a buffer)
_UNUSED = ("blip.vision_proj.", "blip.text_proj.", "blip.text_encoder.embeddings.position_ids",
           "blip.text_encoder.pooler.")


def rename_vit_key(key: str) -> str:
    """A BLIP ViT key (``blocks.3.attn.qkv.weight``) -> its ``BlipVisionModel`` key."""
    for pattern, repl in _VIT_RENAMES:
        new, n = re.subn(pattern, repl, key)
        if n:
            return new
    raise KeyError(f"unknown BLIP ViT key {key!r}")


def split_checkpoint(sd: Mapping[str, torch.Tensor]) -> tuple[dict, dict, dict, list[str]]:
    """ImageReward.pt -> (vision, text, head) state dicts in this module's naming + unknown keys."""
    vision, text, head, unknown = {}, {}, {}, []
    for k, v in sd.items():
        if k.startswith(_UNUSED):
            continue
        if k.startswith("blip.visual_encoder."):
            vision[rename_vit_key(k[len("blip.visual_encoder."):])] = v
        elif k.startswith("blip.text_encoder."):
            text[k[len("blip.text_encoder."):]] = v
        elif k.startswith("mlp."):
            head[k[len("mlp."):]] = v
        else:
            unknown.append(k)
    return vision, text, head, unknown


def _read_med(med_config: Union[None, str, Path, Mapping]) -> dict:
    if med_config is None:
        return dict(DEFAULT_MED)
    if isinstance(med_config, Mapping):
        return {**DEFAULT_MED, **med_config}
    path = Path(med_config)
    if not path.is_file():
        raise FileNotFoundError(f"med_config: no file at {str(path)!r}; pass ImageReward's med_config.json, a dict, "
                                "or None for the published values")
    return {**DEFAULT_MED, **json.loads(path.read_text())}


def build_configs(med_config=None, vision_config: Optional[Mapping] = None):
    """(BlipVisionConfig, BlipTextConfig) for ImageReward; the text encoder cross-attends to
    ``vision.hidden_size`` (BLIP sets ``encoder_width = vision_width``)."""
    transformers = require("transformers", "transformers")
    vision = transformers.BlipVisionConfig(**{**DEFAULT_VISION, **(vision_config or {})})
    med = _read_med(med_config)
    if not med.get("add_cross_attention", True):
        raise ValueError("med_config must have add_cross_attention=true (ImageReward cross-attends to the image)")
    fits = lambda i: i if i < med["vocab_size"] else None  # noqa: E731  (tiny test vocabularies)
    text = transformers.BlipTextConfig(**{k: med[k] for k in _MED_TO_BLIP_TEXT}, encoder_hidden_size=vision.hidden_size,
                                       bos_token_id=fits(30522), sep_token_id=fits(102),
                                       is_decoder=True,  # builds the cross-attention layers; forward runs as encoder
                                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return vision, text


class ImageRewardModel(nn.Module):
    """BLIP ViT + BLIP text encoder (cross-attention) + MLP head -> raw (unnormalised) reward."""

    def __init__(self, vision_config, text_config):
        super().__init__()
        transformers = require("transformers", "transformers")
        self.vision = transformers.BlipVisionModel(vision_config)
        self.text = transformers.BlipTextModel(text_config, add_pooling_layer=False)
        self.head = LinearMLPHead(text_config.hidden_size)

    def forward(self, pixels: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        image_tokens = self.vision(pixel_values=pixels).last_hidden_state  # [B, 1 + N, Dv], post-LayerNorm
        out = self.text(input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=image_tokens,
                        is_decoder=False)
        cls = out.last_hidden_state[:, 0, :].float()  # [B, Dt]
        return self.head.float()(cls)  # [B]

    def load_imagereward_state_dict(self, sd: Mapping[str, torch.Tensor]) -> None:
        """Load the published ``ImageReward.pt`` (``blip.visual_encoder.*``, ``blip.text_encoder.*``, ``mlp.*``)."""
        vision, text, head, unknown = split_checkpoint(sd)
        if unknown:
            log.warning("ImageReward checkpoint: ignoring %d unexpected keys, e.g. %s", len(unknown), unknown[:5])
        parts = ((vision, self.vision, "vision"), (text, self.text, "text"), (head, self.head, "head"))
        for part, module, name in parts:
            try:
                missing, unexpected = module.load_state_dict(part, strict=False)
            except RuntimeError as e:  # shape mismatches
                raise ValueError(f"ImageReward checkpoint does not fit the {name} tower (check med_config / "
                                 f"vision_config): {e}") from e
            if missing or unexpected:
                raise ValueError(f"ImageReward checkpoint does not fit the {name} tower: missing {missing[:8]}, "
                                 f"unexpected {unexpected[:8]} (check med_config / vision_config)")


class ImageReward:
    """ImageReward score per (image, prompt) pair, ImageReward-normalised; float32 [B] on CPU.

    ``med_config`` (path, dict or None) and ``vision_config`` (``BlipVisionConfig`` kwargs)
    default to the published ImageReward-v1.0 architecture; ``tokenizer`` is a
    ``from_pretrained`` path or cached id of ``bert-base-uncased``.
    """

    name = "imagereward"
    resident_params = 447_000_000  # parameters kept loaded, for `flowrl plan` (bytes: x the dtype option)
    resident_note = "ImageReward: BLIP ViT-L/16 ~303M + BERT-base with cross-attention ~139M + head"

    def __init__(self, checkpoint: WeightsFile, tokenizer: ModelSource = "bert-base-uncased",
                 med_config: Union[None, WeightsFile, Mapping] = None,
                 vision_config: Optional[Mapping] = None, device: Device = "cpu", dtype: DTypeLike = "float32",
                 batch_size: PositiveInt = 16):
        if not checkpoint:
            raise ValueError(f"the imagereward reward needs its weights. {CHECKPOINT_HINT}")
        transformers = require("transformers", "transformers")
        self.device, self.dtype = torch.device(device), resolve_dtype(dtype)
        # fail fast, before building
        sd = load_weights(checkpoint, "ImageReward checkpoint", CHECKPOINT_HINT, "reward.options.imagereward.checkpoint")
        vcfg, tcfg = build_configs(med_config, vision_config)
        model = ImageRewardModel(vcfg, tcfg)
        model.load_imagereward_state_dict(sd)
        self.model = model.eval().requires_grad_(False)
        self.model.vision.to(self.device, self.dtype)
        self.model.text.to(self.device, self.dtype)
        self.model.head.to(self.device)
        self.tokenizer = from_pretrained(transformers.AutoTokenizer.from_pretrained, tokenizer, "BERT tokenizer",
                                         "reward.options.imagereward.tokenizer")
        # BLIP's init_tokenizer: [DEC] as bos, [ENC] as an extra special token (ids 30522, 30523)
        self.tokenizer.add_special_tokens({"bos_token": "[DEC]"})
        self.tokenizer.add_tokens(["[ENC]"], special_tokens=True)
        if len(self.tokenizer) > tcfg.vocab_size:
            raise ValueError(f"tokenizer has {len(self.tokenizer)} tokens but the text encoder only {tcfg.vocab_size}: "
                             "ImageReward uses bert-base-uncased")
        # ImageReward's BLIP val transform: torchvision Resize (bicubic) + CenterCrop (rounded offset) on PIL
        self.transform = ImageTransform(size=vcfg.image_size, crop=(vcfg.image_size, vcfg.image_size),
                                        mean=CLIP_MEAN, std=CLIP_STD, crop_offset="round")
        self.batch_size = int(batch_size)

    @torch.no_grad()
    def raw(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Unnormalised MLP output, float32 [B] on CPU."""
        out = []
        for s in chunks(images.shape[0], self.batch_size):
            pixels = self.transform(images[s].to(self.device)).to(self.dtype)  # [b, 3, 224, 224]
            tok = self.tokenizer(prompts[s], padding="max_length", truncation=True, max_length=MAX_TEXT_TOKENS,
                                 return_tensors="pt").to(self.device)
            out.append(self.model(pixels, tok["input_ids"], tok["attention_mask"]).float().cpu())  # [b]
        return torch.cat(out)

    def __call__(self, images: torch.Tensor, prompts: list[str], **meta) -> torch.Tensor:
        check_inputs(images, prompts, self.name)
        return (self.raw(images, list(prompts)) - IMAGEREWARD_MEAN) / IMAGEREWARD_STD  # [B]
