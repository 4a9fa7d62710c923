"""The parts of the LTX-2 adapter (``pipelines/ltx2.py``, ``model.pipeline: ltx2``) that are not its policy: the
published configs of Lightricks/LTX-2's components, the pipeline's schedule shift and audio length, its per-stream
guidance as a pure function, the transformer as flowrl builds it (its blocks as FSDP units) and the tiny offline
components. Kept beside the adapter (the module doc of ``pipelines/ltx2.py`` describes the model) so each file stays
under tests/test_code_shape.py's limit; only the ltx2 adapter imports it.
"""
from __future__ import annotations

import torch

# diffusers 0.42.1's LTX2VideoTransformer3DModel names its blocks in _repeated_blocks but lists no _no_split_modules,
# the transformer blocks flowrl's FSDP2 makes its units (flowrl.distributed.fsdp.block_modules): without them the whole
# 19B transformer would be one unit, gathered at once. The adapter names them on its transformer (and the planner's).
FSDP_UNITS = ["LTX2VideoTransformerBlock"]
DEFAULT_NUM_FRAMES = 121  # LTX2Pipeline's default without a duration head (LTX-2.0 / 2.3)
DEFAULT_RESOLUTION = (512, 768)  # the pipeline's default (H, W)
DEFAULT_FRAME_RATE = 24.0  # the pipeline's default frame_rate
TINY_NUM_FRAMES = 5  # two latent frames of the tiny VAE (temporal factor 4): the tiny model's default (flowrl.json)

# Published configs of Lightricks/LTX-2 (its */config.json as diffusers' scripts/convert_ltx2_to_diffusers.py writes
# them for version "2.0"; flowrl plan builds the models from them, no download). transformer/config.json: 48 blocks,
# video 32 heads of 128 = 4096 wide, audio 32 heads of 64 = 2048 wide, captions of 3840 (Gemma 3 12B)
LTX2_19B = dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
                attention_head_dim=128, cross_attention_dim=4096, vae_scale_factors=(8, 32, 32), pos_embed_max_pos=20,
                base_height=2048, base_width=2048, audio_in_channels=128, audio_out_channels=128, audio_patch_size=1,
                audio_patch_size_t=1, audio_num_attention_heads=32, audio_attention_head_dim=64,
                audio_cross_attention_dim=2048, audio_scale_factor=4, audio_pos_embed_max_pos=20,
                audio_sampling_rate=16000, audio_hop_length=160, num_layers=48, activation_fn="gelu-approximate",
                qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=3840,
                attention_bias=True, attention_out_bias=True, rope_theta=10000.0, rope_double_precision=True,
                causal_offset=1, timestep_scale_multiplier=1000, cross_attn_timestep_scale_multiplier=1000,
                rope_type="split")
# connectors/config.json (LTX2TextConnectors): 49 stacked Gemma layers, 2-block connectors of 30 heads of 128 with 128
# learned registers
LTX2_CONNECTORS = dict(caption_channels=3840, text_proj_in_factor=49, video_connector_num_attention_heads=30,
                       video_connector_attention_head_dim=128, video_connector_num_layers=2,
                       video_connector_num_learnable_registers=128, audio_connector_num_attention_heads=30,
                       audio_connector_attention_head_dim=128, audio_connector_num_layers=2,
                       audio_connector_num_learnable_registers=128, connector_rope_base_seq_len=4096,
                       rope_theta=10000.0, rope_double_precision=True, causal_temporal_positioning=False,
                       rope_type="split")
# vae/config.json (AutoencoderKLLTX2Video): 128 channels, 32x spatial (patch 4 x three 2x stages), 8x temporal
LTX2_VAE = dict(in_channels=3, out_channels=3, latent_channels=128, block_out_channels=[256, 512, 1024, 2048],
                down_block_types=["LTX2VideoDownBlock3D"] * 4, decoder_block_out_channels=[256, 512, 1024],
                layers_per_block=[4, 6, 6, 2, 2], decoder_layers_per_block=[5, 5, 5, 5],
                spatio_temporal_scaling=[True] * 4, decoder_spatio_temporal_scaling=[True] * 3,
                decoder_inject_noise=[False] * 4, downsample_type=["spatial", "temporal", "spatiotemporal",
                                                                   "spatiotemporal"],
                upsample_residual=[True] * 3, upsample_factor=[2, 2, 2], timestep_conditioning=False, patch_size=4,
                patch_size_t=1, resnet_norm_eps=1e-6, encoder_causal=True, decoder_causal=False,
                encoder_spatial_padding_mode="zeros", decoder_spatial_padding_mode="reflect",
                spatial_compression_ratio=32, temporal_compression_ratio=8)
# audio_vae/config.json (AutoencoderKLLTX2Audio): 8 channels over 64 mel bins / 4, 16 kHz, hop 160 (100 mel frames a
# second, 4x temporal: 25 latent frames a second); vocoder/config.json (LTX2Vocoder, 24 kHz stereo)
LTX2_AUDIO_VAE = dict(base_channels=128, output_channels=2, ch_mult=[1, 2, 4], num_res_blocks=2, attn_resolutions=None,
                      in_channels=2, resolution=256, latent_channels=8, norm_type="pixel", causality_axis="height",
                      dropout=0.0, mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True,
                      mel_bins=64, double_z=True)
LTX2_VOCODER = dict(in_channels=128, hidden_channels=1024, out_channels=2, upsample_kernel_sizes=[16, 15, 8, 4, 4],
                    upsample_factors=[6, 5, 2, 2, 2], resnet_kernel_sizes=[3, 7, 11],
                    resnet_dilations=[[1, 3, 5], [1, 3, 5], [1, 3, 5]], leaky_relu_negative_slope=0.1,
                    output_sampling_rate=24000)
# text_encoder/config.json: google/gemma-3-12b-it-qat-q4_0-unquantized (Gemma3ForConditionalGeneration, what the
# conversion script loads): the text model 48 layers 3840 wide, 16 query / 8 KV heads of 256, FFN 15360, sliding window
# 1024 (every sixth layer global), vocabulary 262208; the SigLIP vision tower 27 layers 1152 wide at 896 px, 256 image
# tokens (as MaxText's gemma3-12b and keras-hub's gemma3 presets list them: 11.77B parameters without the vision tower)
GEMMA3_12B = dict(
    text_config=dict(vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
                     sliding_window=1024, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                     rope_scaling={"rope_type": "linear", "factor": 8.0}, max_position_embeddings=131072,
                     rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh"),
    vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                       image_size=896, patch_size=14, vision_use_head=False),
    mm_tokens_per_image=256, boi_token_index=255999, eoi_token_index=256000, image_token_index=262144)


def calculate_shift(seq_len: int, base_seq_len: int = 1024, max_seq_len: int = 4096, base_shift: float = 0.95,
                    max_shift: float = 2.05) -> float:
    """The time shift ``mu`` at ``seq_len`` video tokens: linear from ``base_shift`` at ``base_seq_len`` to
    ``max_shift`` at ``max_seq_len`` (``LTX2Pipeline``'s ``calculate_shift`` with its scheduler's defaults)."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return seq_len * m + base_shift - m * base_seq_len


def audio_frames(num_frames: int, frame_rate: float, sample_rate: int = 16000, hop_length: int = 160,
                 temporal_factor: int = 4) -> int:
    """Latent audio frames of a video of ``num_frames`` at ``frame_rate``: its duration times ``sample_rate /
    hop_length / temporal_factor`` (25 a second at the published 16 kHz, hop 160, 4x), rounded (``LTX2Pipeline``)."""
    return round(num_frames / frame_rate * sample_rate / hop_length / float(temporal_factor))


def rescale(guided: torch.Tensor, cond: torch.Tensor, phi: float) -> torch.Tensor:
    """Guidance rescale (Lin et al. 2024, arXiv 2305.08891, eq. 16; diffusers' ``rescale_noise_cfg``): ``guided``
    scaled to ``cond``'s standard deviation over each row's elements, mixed with itself by ``phi``. [B, ...]."""
    dims = tuple(range(1, guided.ndim))
    scaled = guided * (cond.std(dim=dims, keepdim=True) / guided.std(dim=dims, keepdim=True))
    return phi * scaled + (1 - phi) * guided


def ltx2_guidance(x: torch.Tensor, sigma: torch.Tensor, uncond: torch.Tensor, cond: torch.Tensor, split: int,
                  scales: tuple[float, float], rescales: tuple[float, float]) -> torch.Tensor:
    """``LTX2Pipeline``'s classifier-free guidance of one step, float32 (module doc): per stream (tokens ``[:split]``
    video, ``[split:]`` audio) ``x0 = x - sigma v`` of both halves, ``x0_c + (s - 1) (x0_c - x0_u)``, rescaled to
    ``x0_c``'s std by ``phi`` when ``phi > 0``, and back to ``(x - x0) / sigma``.

    Args: ``x`` latents ``[B, S, C]``; ``sigma`` [B] (> 0); ``uncond`` / ``cond`` the velocities ``[B, S, C]``;
    ``scales`` / ``rescales``: (video, audio). Returns the guided velocity ``[B, S, C]``."""
    x, u, c = x.float(), uncond.float(), cond.float()
    s = sigma.float().view(-1, 1, 1)  # [B, 1, 1]
    out = []
    for part, scale, phi in ((slice(0, split), scales[0], rescales[0]), (slice(split, None), scales[1], rescales[1])):
        xp = x[:, part]  # [B, S_part, C]
        x0_c, x0_u = xp - c[:, part] * s, xp - u[:, part] * s
        x0 = x0_c + (scale - 1) * (x0_c - x0_u)
        if phi > 0:
            x0 = rescale(x0, x0_c, phi)
        out.append((xp - x0) / s)
    return torch.cat(out, dim=1)  # [B, S, C]


def ltx2_transformer(**config):
    """An ``LTX2VideoTransformer3DModel`` of ``config`` whose transformer blocks are its FSDP units
    (:data:`FSDP_UNITS`)."""
    from diffusers import LTX2VideoTransformer3DModel

    model = LTX2VideoTransformer3DModel(**config)
    model._no_split_modules = FSDP_UNITS
    return model


def tiny_gemma_tokenizer():
    """An offline SentencePiece-style BPE ``GemmaTokenizer`` for the tiny model: Gemma's special tokens (``<pad>``
    0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3), the printable ASCII characters, ``"▁"`` and the English words among
    the first 2000 CLIP merges (``pipelines/tiny.py``) as ``"▁word"`` tokens; saved and loaded with
    ``save_pretrained`` / ``from_pretrained``."""
    import string

    from transformers import GemmaTokenizer

    from .tiny import clip_merges

    vocab = {t: i for i, t in enumerate(("<pad>", "<eos>", "<bos>", "<unk>", "<mask>"))}
    merges: list[tuple[str, str]] = []
    for ch in ["\u2581"] + sorted(string.ascii_letters + string.digits + string.punctuation):
        vocab.setdefault(ch, len(vocab))

    def chain(word: str) -> None:
        for k in range(2, len(word) + 1):
            if word[:k] not in vocab:
                vocab[word[:k]] = len(vocab)
                merges.append((word[:k - 1], word[k - 1]))

    words = ["".join(m)[:-4] for m in clip_merges(2000) if "".join(m).endswith("</w>")]
    for w in dict.fromkeys(w for w in words if w.isascii() and w.isalpha()):
        chain("\u2581" + w)
    return GemmaTokenizer(vocab=vocab, merges=merges)


def tiny_ltx2_components(transformer_config: dict, seed: int = 0) -> dict:
    """A tiny ``LTX2Pipeline``: a 2-block ``LTX2VideoTransformer3DModel`` (the published config shrunk: video 2
    heads of 8, audio 2 heads of 4, 128-channel video and audio tokens as the real model; sizes as diffusers'
    LTX-2 fast tests), ``LTX2TextConnectors`` of one block per stream with 4 learned registers, a 2-layer
    ``Gemma3ForConditionalGeneration`` 32 wide (a 1-layer SigLIP tower of one patch) over an offline
    SentencePiece-style BPE ``GemmaTokenizer`` (:func:`tiny_gemma_tokenizer`), an ``AutoencoderKLLTX2Video`` of
    128 latent channels at widths 8 to 16 with factors 8 spatial (patch 4 x 2) and 4 temporal (the published
    32 and 8 would leave a 32 px, 5-frame smoke model one latent pixel, which its reflect padding refuses), an
    ``AutoencoderKLLTX2Audio`` (8 channels x 16 mel bins = 128 wide tokens, 4x temporal, its per-feature statistics
    128 wide: all as published) with one level width,
    a small ``LTX2Vocoder`` and the published scheduler config (dynamic shift 0.95 -> 2.05, shift_terminal 0.1).
    Both VAEs' latent means and standard deviations are random, so decoding checks the denormalization."""
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                           LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tok = tiny_gemma_tokenizer()
    n = len(tok)
    torch.manual_seed(seed)
    text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=dict(vocab_size=n, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=64,
                         pad_token_id=0, eos_token_id=1, bos_token_id=2),
        vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                           image_size=14, patch_size=14),
        mm_tokens_per_image=1, image_token_index=n - 1, boi_token_index=n - 2, eoi_token_index=n - 3)).eval()
    torch.manual_seed(seed + 1)
    connectors = LTX2TextConnectors(**{**LTX2_CONNECTORS, "caption_channels": 32, "text_proj_in_factor": 3,
                                       "video_connector_num_attention_heads": 4,
                                       "video_connector_attention_head_dim": 8, "video_connector_num_layers": 1,
                                       "video_connector_num_learnable_registers": 4,
                                       "audio_connector_num_attention_heads": 4,
                                       "audio_connector_attention_head_dim": 8, "audio_connector_num_layers": 1,
                                       "audio_connector_num_learnable_registers": 4,
                                       "connector_rope_base_seq_len": 32, "rope_double_precision": False}).eval()
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLLTX2Video(**{
        **LTX2_VAE, "block_out_channels": [8, 16], "down_block_types": ["LTX2VideoDownBlock3D"] * 2,
        "decoder_block_out_channels": [8, 16], "layers_per_block": [1, 1, 1], "decoder_layers_per_block": [1, 1, 1],
        "spatio_temporal_scaling": [True, True], "decoder_spatio_temporal_scaling": [True, True],
        "decoder_inject_noise": [False] * 3, "downsample_type": ["temporal", "spatiotemporal"],
        "upsample_type": ["spatiotemporal", "temporal"], "upsample_residual": [True, True],
        "upsample_factor": [2, 2], "spatial_compression_ratio": 8, "temporal_compression_ratio": 4}).eval()
    torch.manual_seed(seed + 3)
    audio_vae = AutoencoderKLLTX2Audio(**{**LTX2_AUDIO_VAE, "ch_mult": [1, 1, 1],
                                          "num_res_blocks": 1}).eval()
    torch.manual_seed(seed + 4)
    vocoder = LTX2Vocoder(**{**LTX2_VOCODER, "hidden_channels": 32, "upsample_kernel_sizes": [4, 4],
                             "upsample_factors": [2, 2], "resnet_kernel_sizes": [3],
                             "resnet_dilations": [[1, 3, 5]]}).eval()
    g = torch.Generator().manual_seed(seed + 6)
    with torch.no_grad():  # random latent statistics, so decoding checks the denormalization
        for m in (vae, audio_vae):
            m.latents_mean.copy_(0.3 * torch.randn(m.latents_mean.shape, generator=g))
            m.latents_std.copy_(0.5 + torch.rand(m.latents_std.shape, generator=g))
    torch.manual_seed(seed + 5)
    transformer = LTX2VideoTransformer3DModel(**transformer_config)
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                                base_image_seq_len=1024, max_image_seq_len=4096,
                                                shift_terminal=0.1)
    return dict(scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=text_encoder, tokenizer=tok,
                connectors=connectors, transformer=transformer, vocoder=vocoder, processor=None,
                prompt_enhancer=None, duration_head=None)


__all__ = ["DEFAULT_FRAME_RATE", "DEFAULT_NUM_FRAMES", "DEFAULT_RESOLUTION", "FSDP_UNITS", "GEMMA3_12B", "LTX2_19B",
           "LTX2_AUDIO_VAE", "LTX2_CONNECTORS", "LTX2_VAE", "LTX2_VOCODER", "TINY_NUM_FRAMES", "audio_frames",
           "calculate_shift", "ltx2_guidance", "ltx2_transformer", "rescale", "tiny_gemma_tokenizer",
           "tiny_ltx2_components"]
