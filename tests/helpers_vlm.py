"""A tiny Qwen2.5-VL judge for the VLM reward tests (``editscore``, ``unifiedreward``): the published
Qwen2.5-VL-7B config shrunk, over the offline byte-level tokenizer, saved with ``save_pretrained``."""
from __future__ import annotations

import torch

# a Qwen2-VL chat template for one user turn of images and text (the shape of the published one)
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tiny_qwen25_vl(out) -> str:
    """A tiny Qwen2.5-VL judge (model + processor) saved in ``out``: Qwen2.5-VL-7B's published config
    (``pipelines.qwen_family.QWEN25_VL_7B``) with the sizes shrunk, over the offline byte-level tokenizer."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                              Qwen2VLImageProcessor, Qwen2VLVideoProcessor)

    from flowrl.pipelines.qwen_family import QWEN25_VL_7B
    from flowrl.pipelines.tiny import build_qwen_tokenizer

    tok = build_qwen_tokenizer()
    ids = {n: tok.convert_tokens_to_ids(f"<|{n}|>") for n in
           ("image_pad", "video_pad", "vision_start", "vision_end", "endoftext", "im_end")}
    text = {**QWEN25_VL_7B["text_config"], "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "max_window_layers": 2, "vocab_size": len(tok),
            "bos_token_id": ids["endoftext"], "eos_token_id": ids["im_end"], "pad_token_id": ids["endoftext"],
            "rope_scaling": {"type": "default", "rope_type": "default", "mrope_section": [1, 1, 2]}}
    vision = {**QWEN25_VL_7B["vision_config"], "depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
              "out_hidden_size": 16, "fullatt_block_indexes": [0]}
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, vocab_size=len(tok), image_token_id=ids["image_pad"],
        video_token_id=ids["video_pad"], vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"], tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(config).eval().save_pretrained(out)
    Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(patch_size=14, temporal_patch_size=2, merge_size=2),
                        tokenizer=tok, video_processor=Qwen2VLVideoProcessor(),
                        chat_template=CHAT_TEMPLATE).save_pretrained(out)
    return str(out)


def build_tiny_qwen3_vl(out) -> str:
    """A tiny Qwen3-VL judge saved in ``out``: Qwen-Image 2.1's tiny Qwen3-VL (``pipelines.qwen_family.tiny_qwen3_vl``:
    2 layers 16 wide, a 1-block vision tower with patch 16 and 2x2 merge) and its ``Qwen3VLProcessor``."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    from flowrl.pipelines.qwen_family import tiny_qwen3_vl
    from flowrl.pipelines.qwen_image21 import QWEN3_VL_CHAT_TEMPLATE
    from flowrl.pipelines.tiny import build_qwen_tokenizer

    tok = build_qwen_tokenizer()
    torch.manual_seed(0)
    tiny_qwen3_vl("Qwen3VLForConditionalGeneration", tok, 2, tie_word_embeddings=False).save_pretrained(out)
    Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2),
        tokenizer=tok, video_processor=Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2),
        chat_template=QWEN3_VL_CHAT_TEMPLATE).save_pretrained(out)
    return str(out)
