"""Tiny Qwen2-VL reward models (``hpsv3``, ``videoalign``) for offline tests, and the authors' scoring written
from their published steps (``reference_logits``): their forward (token embeddings, the vision tower's merged
features scattered into the pad tokens, ``Qwen2VLModel`` called with ``inputs_embeds`` and no position ids,
the head at the reward tokens), on a ``Qwen2VLForConditionalGeneration`` that loads the checkpoint in the
authors' layout with ``load_state_dict(strict=True)``, and for VideoAlign the LoRA left unmerged (peft).

The base directory holds what ``from_pretrained`` reads: the shrunk config (Qwen2-VL's, with 2 layers of
width 32), a byte-level BPE Qwen2 tokenizer (:func:`flowrl.pipelines.tiny.build_qwen_tokenizer`) with
Qwen2-VL-Instruct's chat template, and Qwen2-VL's image / video processors.
"""
from __future__ import annotations

from pathlib import Path

import torch

# Qwen2-VL-7B-Instruct's chat_template.json, transcribed (the same in Qwen2-VL-2B-Instruct)
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)


def save_tiny_base(d: Path) -> Path:
    """A tiny Qwen2-VL base (config + processor) at ``d``; returns ``d``."""
    from transformers import Qwen2VLConfig, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    from flowrl.pipelines.tiny import build_qwen_tokenizer

    tok = build_qwen_tokenizer(num_words=400)
    tok.chat_template = QWEN2_VL_CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                     "<|vision_end|>", "<|endoftext|>", "<|im_end|>")}
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8192,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                         pad_token_id=ids["<|endoftext|>"], bos_token_id=None, eos_token_id=ids["<|im_end|>"]),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"], bos_token_id=None,
        eos_token_id=ids["<|im_end|>"])
    cfg.save_pretrained(d)
    size = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}
    proc = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(size=size), tokenizer=tok,
                            video_processor=Qwen2VLVideoProcessor(size=size), chat_template=QWEN2_VL_CHAT_TEMPLATE)
    proc.save_pretrained(d)
    return d


def authors_model(base: Path, reward_tokens: list[str], head: torch.nn.Module, seed: int = 0):
    """The authors' model on the tiny base: ``Qwen2VLForConditionalGeneration`` with the reward tokens added
    (embeddings resized to the tokenizer) and ``rm_head``, random weights spread by ``randomize_``;
    returns (model, processor, reward token ids)."""
    from transformers import AutoProcessor, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from helpers import randomize_

    processor = AutoProcessor.from_pretrained(base, padding_side="right")
    processor.tokenizer.add_special_tokens({"additional_special_tokens": list(reward_tokens)})
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(Qwen2VLConfig.from_pretrained(base))
    model.resize_token_embeddings(len(processor.tokenizer), mean_resizing=False)
    model.rm_head = head
    randomize_(model, 0.2)
    model.config.pad_token_id = processor.tokenizer.pad_token_id
    return model.eval(), processor, processor.tokenizer.convert_tokens_to_ids(list(reward_tokens))


def old_layout(sd: dict, prefix: str = "") -> dict:
    """transformers >= 4.52 keys -> the < 4.52 layout VideoAlign's checkpoint was saved in (``model.*`` and
    ``visual.*`` under ``prefix``, e.g. PEFT's ``base_model.model.``)."""
    out = {}
    for k, v in sd.items():
        rest = k[len(prefix):]
        if rest.startswith("model.visual."):
            k = prefix + rest[len("model."):]
        elif rest.startswith("model.language_model."):
            k = prefix + "model." + rest[len("model.language_model."):]
        out[k] = v
    return out


def with_lora(model, r: int = 4, alpha: int = 8):
    """VideoAlign's PEFT wrapping: LoRA on the language model's linear layers (not the vision tower, LM head,
    reward head or embeddings), its B matrices randomised so the merge is seen."""
    from peft import LoraConfig, get_peft_model

    from helpers import randomize_

    targets = [n for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)
               and not any(x in n for x in ("lm_head", "rm_head", "embed_tokens", "visual"))]
    peft = get_peft_model(model, LoraConfig(target_modules=targets, r=r, lora_alpha=alpha, lora_dropout=0.0,
                                            task_type="CAUSAL_LM", bias="none"))
    for n, p in peft.named_parameters():
        if "lora_B" in n:
            randomize_(torch.nn.ParameterList([p]), 0.2)
    return peft.eval()


@torch.no_grad()
def reference_logits(model, batch: dict, token_ids: list[int]) -> torch.Tensor:
    """The authors' ``Qwen2VLRewardModelBT.forward`` (``reward_token="special"``) on a processor batch -> [B, T * O]."""
    ids = batch["input_ids"]
    emb = model.model.language_model.embed_tokens(ids)
    for px, grid, tok in (("pixel_values", "image_grid_thw", model.config.image_token_id),
                          ("pixel_values_videos", "video_grid_thw", model.config.video_token_id)):
        if batch.get(px) is not None:
            feats = model.model.visual(batch[px], grid_thw=batch[grid]).pooler_output
            emb = emb.masked_scatter((ids == tok).unsqueeze(-1).expand_as(emb), feats)
    hidden = model.model(input_ids=None, position_ids=None, attention_mask=batch["attention_mask"],
                         inputs_embeds=emb)[0]
    logits = model.rm_head(hidden)  # [B, L, O]
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for t in token_ids:
        mask |= ids == t
    return logits[mask].view(ids.shape[0], -1)
