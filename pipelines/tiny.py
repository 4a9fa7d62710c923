"""Tiny random-weight SD3 / FLUX pipelines, built offline from configs (nothing is downloaded).

``make_tiny("sd3" | "flux" | "flux-schnell", out_dir)`` writes a directory that
``StableDiffusion3Pipeline.from_pretrained`` / ``FluxPipeline.from_pretrained`` (and so
``SD3Policy`` / ``FluxPolicy``) load like the real models: the same component classes, the
same latent layout (16 channels, VAE downsampling 8, SD3 patch 2 / FLUX 2x2 packing), the
same scheduler configs (SD3 shift 3; FLUX-dev dynamic shifting), toy widths. Sizes mirror
diffusers' own fast tests (``get_dummy_components`` in tests/pipelines/stable_diffusion_3 and
tests/pipelines/flux): 1-2 transformer layers, 32-wide text encoders.

Tokenizers are real, built from files already installed:

* CLIP: the BPE merges that ship inside the open-clip-torch wheel
  (``open_clip/bpe_simple_vocab_16e6.txt.gz``), assembled the way open_clip's
  ``SimpleTokenizer`` does (byte-level alphabet, byte + ``</w>`` alphabet, merged tokens,
  then the two special tokens), truncated to the first ``CLIP_MERGES`` merges. Ids of the
  kept tokens equal the real CLIP ids (``"a</w>"`` = 320, ``"photo</w>"`` = 1125); the start
  and end tokens sit right after the kept merges.
* T5: a ``tokenizers`` Unigram model whose pieces are the ASCII characters plus the same
  CLIP merges re-spelled SentencePiece-style (``"cat</w>"`` -> ``"▁cat"``), wrapped in
  ``T5TokenizerFast`` (``<pad>`` = 0, ``</s>`` = 1, ``<unk>`` = 2 as in T5).

A ``flowrl.json`` beside ``model_index.json`` records the tiny image resolution, which the
adapters take as their default (FLUX has no resolution in its configs; its pipeline default,
1024 px, would be wasteful for a toy).
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import math
import os
import shutil
import string
from pathlib import Path

import torch

KINDS = ("sd3", "flux", "flux-schnell")
CLIP_MERGES = 2000       # first N merges of CLIP's 48,894 (vocab = 512 + N + 2)
IMAGE_SIZE = 64          # pixels; latents 16 x 8 x 8
LATENT_CHANNELS = 16     # SD3 / FLUX VAEs have 16 latent channels
FLOWRL_JSON = "flowrl.json"


# --- tokenizers ----------------------------------------------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP byte -> printable unicode character table (open_clip ``bytes_to_unicode``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def clip_bpe_path() -> Path:
    """Path of CLIP's BPE merges file inside the installed open-clip-torch wheel."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("open-clip-torch is not installed; it ships the CLIP BPE vocabulary that tiny "
                          "pipelines use (pip install open-clip-torch)")
    path = Path(list(spec.submodule_search_locations)[0]) / "bpe_simple_vocab_16e6.txt.gz"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the open_clip package")
    return path


def clip_merges(num_merges: int = CLIP_MERGES) -> list[tuple[str, str]]:
    """The first ``num_merges`` CLIP BPE merges (line 0 of the file is a header)."""
    lines = gzip.open(clip_bpe_path()).read().decode("utf-8").split("\n")
    if not 1 <= num_merges <= 49152 - 256 - 2:
        raise ValueError(f"num_merges must be in [1, 48894], got {num_merges}")
    return [tuple(line.split()) for line in lines[1: 1 + num_merges]]  # type: ignore[misc]


def build_clip_tokenizer(num_merges: int = CLIP_MERGES):
    """A ``CLIPTokenizer`` over the (truncated) real CLIP BPE; ``len(tok)`` = 512 + num_merges + 2."""
    from transformers import CLIPTokenizer

    merges = clip_merges(num_merges)
    alphabet = list(_bytes_to_unicode().values())
    tokens = alphabet + [c + "</w>" for c in alphabet] + ["".join(m) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(tokens)}
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)


def build_t5_tokenizer(num_merges: int = CLIP_MERGES, model_max_length: int = 512):
    """A ``T5TokenizerFast`` (Unigram) whose pieces come from the CLIP merges; see module doc."""
    from transformers import T5TokenizerFast

    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    seen = {p for p, _ in pieces}

    def add(piece: str, score: float) -> None:
        if piece not in seen:
            seen.add(piece)
            pieces.append((piece, score))

    printable = set(string.ascii_letters + string.digits + string.punctuation)
    for c in sorted(printable):
        add(c, -8.0)
        add("▁" + c, -8.5)
    for rank, merge in enumerate(clip_merges(num_merges)):
        tok = "".join(merge)
        word = tok[:-4] if tok.endswith("</w>") else tok
        if word and set(word) <= printable:
            add("▁" + word if tok.endswith("</w>") else word, -3.0 - math.log(rank + 2) / 4)
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


# --- components ----------------------------------------------------------------------------
def _clip_config(vocab_size: int, eos_id: int, bos_id: int, hidden: int = 32, projection: int = 32):
    from transformers import CLIPTextConfig

    # diffusers' dummy CLIP (hidden 32, 5 layers, 4 heads, intermediate 37), with real token ids
    return CLIPTextConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=37, num_hidden_layers=2,
                          num_attention_heads=4, projection_dim=projection, max_position_embeddings=77,
                          hidden_act="quick_gelu", layer_norm_eps=1e-5, bos_token_id=bos_id, eos_token_id=eos_id,
                          pad_token_id=eos_id)


def _t5_encoder(vocab_size: int, d_model: int):
    from transformers import T5Config, T5EncoderModel

    # like hf-internal-testing/tiny-random-t5 (d_ff 37, d_kv 8, 4 heads), gated-gelu as T5 v1.1
    cfg = T5Config(vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                   relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", pad_token_id=0,
                   eos_token_id=1, decoder_start_token_id=0, is_encoder_decoder=False)
    return T5EncoderModel(cfg)


def _vae(scaling_factor: float, shift_factor: float, image_size: int):
    from diffusers import AutoencoderKL

    # four blocks -> downsampling 8 like the real VAEs; no quant convs (SD3 / FLUX VAEs have none)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8),
                         layers_per_block=1, latent_channels=LATENT_CHANNELS, norm_num_groups=4,
                         sample_size=image_size, use_quant_conv=False, use_post_quant_conv=False,
                         scaling_factor=scaling_factor, shift_factor=shift_factor)


def tiny_sd3_components(image_size: int = IMAGE_SIZE, seed: int = 0) -> dict:
    """Components of a tiny ``StableDiffusion3Pipeline`` (SD3.5-style qk RMSNorm, one dual-attention layer)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection

    tok = build_clip_tokenizer()
    tok3 = build_t5_tokenizer(model_max_length=512)
    eos, bos = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|startoftext|>")
    clip_hidden, t5_dim = 32, 64  # clip prompt embeds: 32 + 32 = 64 wide, padded to the T5 width
    torch.manual_seed(seed)
    te1 = CLIPTextModelWithProjection(_clip_config(len(tok), eos, bos, clip_hidden, 32))
    torch.manual_seed(seed + 1)
    te2 = CLIPTextModelWithProjection(_clip_config(len(tok), eos, bos, clip_hidden, 32))
    torch.manual_seed(seed + 2)
    te3 = _t5_encoder(len(tok3), t5_dim)
    torch.manual_seed(seed + 3)
    transformer = SD3Transformer2DModel(
        sample_size=image_size // 8, patch_size=2, in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS,
        num_layers=2, attention_head_dim=8, num_attention_heads=4, joint_attention_dim=t5_dim,
        caption_projection_dim=32, pooled_projection_dim=64, pos_embed_max_size=32,
        dual_attention_layers=(0,), qk_norm="rms_norm")
    torch.manual_seed(seed + 4)
    vae = _vae(1.5305, 0.0609, image_size)  # SD3's VAE scaling / shift factors
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)  # SD3 / SD3.5 config
    return dict(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=te1, tokenizer=tok,
                text_encoder_2=te2, tokenizer_2=build_clip_tokenizer(), text_encoder_3=te3, tokenizer_3=tok3,
                image_encoder=None, feature_extractor=None)


def tiny_flux_components(image_size: int = IMAGE_SIZE, seed: int = 0, guidance_embeds: bool = True) -> dict:
    """Components of a tiny ``FluxPipeline``: FLUX-dev-like (guidance embedding, dynamic shift) or,
    with ``guidance_embeds=False``, schnell-like (no guidance embedding, static shift 1)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel

    tok = build_clip_tokenizer()
    tok2 = build_t5_tokenizer(model_max_length=512)
    eos, bos = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|startoftext|>")
    torch.manual_seed(seed)
    te1 = CLIPTextModel(_clip_config(len(tok), eos, bos, 32, 32))
    torch.manual_seed(seed + 1)
    te2 = _t5_encoder(len(tok2), 32)
    torch.manual_seed(seed + 2)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=LATENT_CHANNELS * 4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 4, 8))
    torch.manual_seed(seed + 3)
    vae = _vae(0.3611, 0.1159, image_size)  # FLUX's VAE scaling / shift factors
    if guidance_embeds:  # FLUX.1-dev scheduler config
        scheduler = FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096)
    else:  # FLUX.1-schnell scheduler config
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False,
                                                    base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                                    max_image_seq_len=4096)
    return dict(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=te1, tokenizer=tok,
                text_encoder_2=te2, tokenizer_2=tok2, image_encoder=None, feature_extractor=None)


def tiny_pipeline(kind: str, image_size: int = IMAGE_SIZE, seed: int = 0):
    """An in-memory tiny diffusers pipeline of ``kind`` (one of ``KINDS``)."""
    if image_size % 16 or image_size < 16:
        raise ValueError(f"image_size must be a positive multiple of 16 (VAE 8 x patch 2), got {image_size}")
    if kind == "sd3":
        from diffusers import StableDiffusion3Pipeline

        return StableDiffusion3Pipeline(**tiny_sd3_components(image_size, seed))
    if kind in ("flux", "flux-schnell"):
        from diffusers import FluxPipeline

        return FluxPipeline(**tiny_flux_components(image_size, seed, guidance_embeds=kind == "flux"))
    raise ValueError(f"unknown tiny pipeline kind {kind!r}; choose one of {', '.join(KINDS)}")


def make_tiny(kind: str, out_dir: str | os.PathLike, *, image_size: int = IMAGE_SIZE, seed: int = 0,
              overwrite: bool = False) -> Path:
    """Write a tiny random-weight ``kind`` pipeline (``"sd3"``, ``"flux"`` = FLUX-dev-like,
    ``"flux-schnell"``) to ``out_dir`` with ``save_pretrained``; returns the directory.

    Offline and deterministic in ``seed``. ``image_size`` (pixels, multiple of 16) is the
    resolution the adapters default to (recorded in ``flowrl.json``). Written into a temporary
    sibling and renamed, so a crash leaves no half-written model.
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass overwrite=True (CLI: --overwrite) to replace it")
    pipe = tiny_pipeline(kind, image_size, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    pipe.save_pretrained(tmp)
    (tmp / FLOWRL_JSON).write_text(json.dumps({"kind": kind, "resolution": image_size, "tiny": True}, indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def read_flowrl_json(path: str | os.PathLike) -> dict:
    """The optional ``flowrl.json`` defaults of a local model directory ({} if absent)."""
    p = Path(os.path.expanduser(str(path))) / FLOWRL_JSON
    if p.is_file():
        return json.loads(p.read_text())
    return {}
