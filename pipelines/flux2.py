"""FLUX.2 [dev] (Black Forest Labs 2025, 32B) as a ``FlowPolicy``, over diffusers ``Flux2Pipeline`` components.

The model is the FLUX.2 family's (``pipelines/flux2_family.py``: unpacked ``[B, 32, h, w]`` latents in
the VAE's batch-norm space, 2x2 packing with 4-axis RoPE ids inside ``velocity``, the empirical-``mu``
schedule); this file declares the ``Flux2Pipeline`` adapter. Its text encoder is Mistral Small 3.2
(``Mistral3ForConditionalGeneration``, used as a text encoder: the pipeline's system message and chat
template, the hidden states of layers 10, 20 and 30 stacked per token, ``[B, L, 3 x 5120]``). FLUX.2
[dev] is guidance-distilled: ``guidance_scale`` (default 4.0) enters as an embedding, one forward pass.
"""
from __future__ import annotations

import re

import torch

from .base import IMAGE_SIZE
from .facts import Component, ModelConfigs
from .flux2_family import FLUX2_VAE, Flux2FamilyPolicy

# Published configs (the repository's */config.json; flowrl plan and bench precision build the models from them,
# no download). black-forest-labs/FLUX.2-dev transformer/config.json: diffusers' scripts/convert_flux2_to_diffusers.py
# "flux2-dev" (= black-forest-labs/flux2 src/flux2/model.py Flux2Params): 8 double + 48 single blocks, 48 heads of
# 128 (6144 wide), MLP ratio 3, text features 15360 = 3 x 5120, 4-axis RoPE (32, 32, 32, 32), theta 2000, guidance
# embedding
FLUX2_DEV = dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128,
                 num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256, mlp_ratio=3.0,
                 axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6, guidance_embeds=True)
# text_encoder/config.json: mistralai/Mistral-Small-3.2-24B-Instruct-2506 (Mistral3ForConditionalGeneration; the
# conversion script and black-forest-labs/flux2 text_encoder.py load that repository): the Mistral Small 3.1 / 3.2
# architecture transformers' Mistral3Config documents (40 layers, 5120 wide, 32 heads / 8 KV heads of 128, a
# 24-layer Pixtral vision tower), with its own output head
MISTRAL_SMALL_3_2 = dict(
    text_config=dict(model_type="mistral", vocab_size=131072, hidden_size=5120, intermediate_size=32768,
                     num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=1e9,
                     sliding_window=None, tie_word_embeddings=False),
    vision_config=dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                       num_attention_heads=16, head_dim=64, patch_size=14, image_size=1540, hidden_act="gelu"),
    image_token_index=10, projector_hidden_act="gelu", multimodal_projector_bias=False, spatial_merge_size=2,
    vision_feature_layer=-1, tie_word_embeddings=False)

# the Mistral tokenizer's special tokens the chat template and the processor use
MISTRAL_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                          "[IMG]", "[IMG_BREAK]", "[IMG_END]")
# Mistral Small 3.1's chat template, for the text-only system + user messages Flux2Pipeline builds
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['content'] is string %}"
    "{% set text = message['content'] %}{% else %}"
    "{% set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
    "{% endif %}{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{{ text }}[/INST]{% else %}{{ text }}{{ eos_token }}{% endif %}"
    "{% endfor %}")
TEXT_LAYERS = 30  # the pipeline stacks hidden states 10, 20 and 30: a tiny encoder needs 30 layers


def build_mistral_processor():
    """An offline ``PixtralProcessor`` for tiny models: a byte-level BPE ``PreTrainedTokenizerFast`` whose
    words (``pipelines/tiny.py`` ``byte_level_vocab``) include those of ``Flux2Pipeline``'s system
    message, Mistral's special tokens, Mistral Small's chat template for text messages, and a
    ``PixtralImageProcessor`` (patch 14, merge 2, as the real processor)."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PixtralImageProcessor, PixtralProcessor, PreTrainedTokenizerFast

    from .tiny import byte_level_vocab

    lines = [re.findall(r"[A-Za-z]+", line) for line in SYSTEM_MESSAGE.split("\n")]
    vocab, merges = byte_level_vocab([w for ws in lines for w in ws], [ws[0] for ws in lines if ws])  # + line starts
    for s in MISTRAL_SPECIAL_TOKENS:
        vocab[s] = len(vocab)
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  pad_token="<pad>", model_max_length=131072)
    tok.add_tokens([AddedToken(s, special=True, normalized=False) for s in MISTRAL_SPECIAL_TOKENS])
    return PixtralProcessor(image_processor=PixtralImageProcessor(patch_size=14), tokenizer=tok, patch_size=14,
                            spatial_merge_size=2, chat_template=MISTRAL_CHAT_TEMPLATE)


class Flux2Policy(Flux2FamilyPolicy):
    """``FlowPolicy`` for FLUX.2 [dev]; the arguments are ``Flux2FamilyPolicy``'s (``guidance_scale`` 4.0,
    embedded; ``max_sequence_length`` 512)."""

    kind = "flux2"
    pipeline_class = "Flux2Pipeline"
    tiny_kinds = ("flux2",)
    example_hub_id = "black-forest-labs/FLUX.2-dev"
    published = {example_hub_id: ModelConfigs(
        FLUX2_DEV, {"text_encoder": Component("transformers:Mistral3ForConditionalGeneration", MISTRAL_SMALL_3_2)},
        Component("diffusers:AutoencoderKLFlux2", FLUX2_VAE), example_hub_id, "FLUX.2-dev", "flux2-arch")}

    @classmethod
    def cfg_rows(cls, guidance_scale: float, options: dict) -> int:
        """Embedded guidance: one pass."""
        return 1

    @classmethod
    def tiny_components(cls, kind: str = "flux2", image_size: int = IMAGE_SIZE, seed: int = 0) -> dict:
        """A tiny ``Flux2Pipeline``: ``Flux2FamilyPolicy.tiny_parts`` with a guidance embedding, a
        ``Mistral3ForConditionalGeneration`` of 30 text layers 16 wide (the pipeline reads layers 10, 20,
        30: text features 48) and a 1-layer Pixtral vision tower, over ``build_mistral_processor``."""
        from transformers import Mistral3Config, Mistral3ForConditionalGeneration

        processor = build_mistral_processor()
        tok = processor.tokenizer
        torch.manual_seed(seed + 3)
        text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(
            text_config=dict(model_type="mistral", vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                             num_hidden_layers=TEXT_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                             max_position_embeddings=2048, rope_theta=1e9, sliding_window=None,
                             bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id, tie_word_embeddings=False),
            vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, head_dim=8, patch_size=14, image_size=56),
            image_token_index=tok.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
            tie_word_embeddings=False)).eval()
        return dict(**cls.tiny_parts(image_size, seed, 3 * 16, guidance_embeds=True), text_encoder=text_encoder,
                    tokenizer=processor)


__all__ = ["FLUX2_DEV", "MISTRAL_SMALL_3_2", "Flux2Policy", "build_mistral_processor"]
