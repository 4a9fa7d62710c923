"""Published component configs of the hub models the shipped recipes name, so planning needs no download.

Keyed by hub id (``model.path``). The transformer configs are those of
:mod:`flowrl.bench.precision_arch_models` (each model's ``transformer/config.json``); the text encoder
and VAE values below are copied from the same repositories' ``text_encoder*/config.json`` and
``vae/config.json`` (sources named per entry). Reward-model parameter counts are in
:data:`REWARD_PARAMS` with their sources. A local diffusers directory (``model_index.json``) is read
from disk instead (:func:`flowrl.plan.models.local_components`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..bench.precision_arch_models import FLUX_DEV, SD35_LARGE, SD35_MEDIUM

# stabilityai/stable-diffusion-3.5-medium text_encoder/config.json (CLIPTextModelWithProjection, OpenAI CLIP ViT-L/14
# text tower); FLUX.1-dev text_encoder/config.json is the same tower as a CLIPTextModel (no projection)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu")
# stabilityai/stable-diffusion-3.5-medium text_encoder_2/config.json (CLIPTextModelWithProjection, OpenCLIP bigG text)
CLIP_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
              max_position_embeddings=77, projection_dim=1280, hidden_act="gelu")
# stabilityai/stable-diffusion-3.5-medium text_encoder_3/config.json and black-forest-labs/FLUX.1-dev
# text_encoder_2/config.json (T5EncoderModel, google/t5-v1_1-xxl encoder)
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
              is_encoder_decoder=False, use_cache=False)
_VAE_BLOCKS = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[128, 256, 512, 512],
                   layers_per_block=2, norm_num_groups=32, act_fn="silu",
                   down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                   use_quant_conv=False, use_post_quant_conv=False)
# stabilityai/stable-diffusion-3.5-medium vae/config.json (AutoencoderKL, 16 latent channels)
SD3_VAE = dict(_VAE_BLOCKS, sample_size=1024, scaling_factor=1.5305, shift_factor=0.0609)
# black-forest-labs/FLUX.1-dev vae/config.json (AutoencoderKL, 16 latent channels)
FLUX_VAE = dict(_VAE_BLOCKS, sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159)


@dataclass(frozen=True)
class TextEncoderSpec:
    """One frozen text encoder: transformers class name (``CLIPTextModelWithProjection``,
    ``CLIPTextModel``, ``T5EncoderModel``), its config class and values."""

    cls: str
    config_cls: str
    config: dict


@dataclass(frozen=True)
class ModelSpec:
    """The components of one hub model: transformer family (``sd3`` / ``flux``) and config, text
    encoders by pipeline attribute, VAE config."""

    family: str
    transformer: dict
    text_encoders: dict = field(default_factory=dict)
    vae: dict = field(default_factory=dict)
    source: str = ""


_SD3_TE = {"text_encoder": TextEncoderSpec("CLIPTextModelWithProjection", "CLIPTextConfig", CLIP_L),
           "text_encoder_2": TextEncoderSpec("CLIPTextModelWithProjection", "CLIPTextConfig", CLIP_G),
           "text_encoder_3": TextEncoderSpec("T5EncoderModel", "T5Config", T5_XXL)}
_FLUX_TE = {"text_encoder": TextEncoderSpec("CLIPTextModel", "CLIPTextConfig", CLIP_L),
            "text_encoder_2": TextEncoderSpec("T5EncoderModel", "T5Config", T5_XXL)}

HUB_MODELS: dict[str, ModelSpec] = {
    "stabilityai/stable-diffusion-3.5-medium": ModelSpec("sd3", SD35_MEDIUM, _SD3_TE, SD3_VAE,
                                                         "stabilityai/stable-diffusion-3.5-medium"),
    "stabilityai/stable-diffusion-3.5-large": ModelSpec("sd3", SD35_LARGE, _SD3_TE, SD3_VAE,
                                                        "stabilityai/stable-diffusion-3.5-large"),
    "black-forest-labs/FLUX.1-dev": ModelSpec("flux", FLUX_DEV, _FLUX_TE, FLUX_VAE, "black-forest-labs/FLUX.1-dev"),
}

# Reward models: parameters (millions) and the source of the figure. The model is loaded in
# reward.options.<name>.dtype (default float32) on reward.options.<name>.device.
REWARD_PARAMS: dict[str, tuple[float, str]] = {
    # open_clip model profile table, ViT-H-14: 986.1M (PickScore_v1 fine-tunes it, the processor names
    # laion/CLIP-ViT-H-14-laion2B-s32B-b79K)
    "pickscore": (986.1, "yuvalkirstain/PickScore_v1 = CLIP ViT-H-14 (open_clip profile: 986.1M)"),
    "hps": (986.1, "HPS v2.1 = open_clip ViT-H-14 (open_clip profile: 986.1M)"),
    # openai/clip-vit-large-patch14: 427.6M (transformers CLIPModel parameter count)
    "clipscore": (427.6, "openai/clip-vit-large-patch14 CLIPModel: 427.6M"),
    "aesthetic": (428.5, "CLIP ViT-L/14 427.6M + LAION aesthetic MLP head 0.9M"),
    # BLIP ViT-L/16 (303M) + BLIP's BERT-base text encoder with cross-attention (~139M) + MLP head
    "imagereward": (447.0, "ImageReward: BLIP ViT-L/16 ~303M + BERT-base with cross-attention ~139M + head"),
    # EasyOCR: CRAFT detector 20.8M + CRNN recognizer (english_g2) 3.8M
    "ocr": (24.6, "EasyOCR CRAFT 20.8M + CRNN english_g2 3.8M"),
    "vlm_judge": (0.0, "an external chat-completions server: no local weights"),
    "digits": (0.1, "flowrl's digits classifier (a small CNN)"),
    "jpeg_compressibility": (0.0, "no model"),
    "jpeg_incompressibility": (0.0, "no model"),
}
