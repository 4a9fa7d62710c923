"""Published configs of the frozen components several adapters share: text encoders and VAEs.

Each is the keyword config of a hub repository's ``*/config.json`` (the repository named beside it),
so ``flowrl plan`` and ``flowrl bench precision --pipeline NAME-arch`` build the models on the meta
device or with random weights without a download (``pipelines/facts.py``: ``Component``). An
adapter's own components stay in its file; a config lives here when more than one adapter declares
it, so no adapter imports another.
"""
from __future__ import annotations

# stabilityai/stable-diffusion-3.5-medium text_encoder/config.json (CLIPTextModelWithProjection, OpenAI CLIP ViT-L/14
# text tower); FLUX.1-dev's text_encoder/config.json is the same tower as a CLIPTextModel (no projection)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu")
# stabilityai/stable-diffusion-3.5-medium text_encoder_3/config.json and black-forest-labs/FLUX.1-dev
# text_encoder_2/config.json (T5EncoderModel, google/t5-v1_1-xxl encoder)
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
              is_encoder_decoder=False, use_cache=False)
# stabilityai/stable-diffusion-3.5-medium vae/config.json (AutoencoderKL, 16 latent channels)
SD3_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[128, 256, 512, 512],
               layers_per_block=2, norm_num_groups=32, act_fn="silu", down_block_types=["DownEncoderBlock2D"] * 4,
               up_block_types=["UpDecoderBlock2D"] * 4, use_quant_conv=False, use_post_quant_conv=False,
               sample_size=1024, scaling_factor=1.5305, shift_factor=0.0609)
# black-forest-labs/FLUX.1-dev vae/config.json: SD3's AutoencoderKL layout with FLUX's scaling / shift factors (also
# FLUX.1 Kontext's, and Tongyi-MAI/Z-Image(-Turbo)'s vae/config.json)
FLUX_VAE = dict(SD3_VAE, scaling_factor=0.3611, shift_factor=0.1159)
# Wan-AI/Wan2.1-T2V-*-Diffusers vae/config.json: AutoencoderKLWan with its defaults (diffusers'
# scripts/convert_wan_to_diffusers.py builds AutoencoderKLWan() for Wan2.1_VAE.pth): causal 3D convolutions, 8x
# spatial and 4x temporal downsampling, 16 latent channels, its latent mean / std. Qwen/Qwen-Image's
# vae/config.json (AutoencoderKLQwenImage) holds the same values.
WAN21_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                 temperal_downsample=[False, True, True], dropout=0.0,
                 latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715,
                               0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
                 latents_std=[2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652,
                              1.5579, 1.6382, 1.1253, 2.8251, 1.916])

# Qwen/Qwen3-4B config.json (Qwen3: 36 layers, 2560 wide, 32 query / 8 KV heads of 128, tied embeddings): the text
# encoder of black-forest-labs/FLUX.2-klein-4B (text_encoder/config.json, a Qwen3ForCausalLM) and of
# Tongyi-MAI/Z-Image(-Turbo) (text_encoder/config.json, a Qwen3Model)
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6,
                rope_theta=1000000.0, attention_bias=False, tie_word_embeddings=True, bos_token_id=151643,
                eos_token_id=151645)

__all__ = ["CLIP_L", "FLUX_VAE", "QWEN3_4B", "SD3_VAE", "T5_XXL", "WAN21_VAE"]
