"""Tiny random-weight pipelines, built offline from configs (nothing is downloaded).

``make_tiny(kind, out_dir)`` writes a directory that the pipeline's ``from_pretrained`` (and so
its flowrl adapter) loads like the real model. Which kinds exist, and their components, are
declared by each adapter (``tiny_kinds`` / ``tiny_components``, e.g. ``SD3Policy``: ``sd3``;
``FluxPolicy``: ``flux``, ``flux-schnell``; ``SanaPolicy``: ``sana``); ``make_tiny`` asks the
registry (``flowrl.pipelines.tiny_kinds()``). Every tiny model keeps its real model's component
classes, latent layout and scheduler config at toy widths; sizes mirror diffusers' own fast
tests (``get_dummy_components``): 1-2 transformer layers, 32-wide text encoders.

This module holds the shared offline builders those declarations use:

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

* Qwen: a byte-level BPE ``Qwen2Tokenizer`` (``build_qwen_tokenizer``) with Qwen2's pre-tokenizer,
  byte alphabet and special tokens over a small vocabulary of whole words (the CLIP merges' English
  words); Qwen-Image's template arithmetic holds on it.

* a KL VAE (``kl_vae``) with downsampling 8 and 16 latent channels, as SD3 / FLUX.

A ``flowrl.json`` beside ``model_index.json`` records the tiny image resolution, which the
adapters take as their default (FLUX has no resolution in its configs; its pipeline default,
1024 px, would be wasteful for a toy).
"""
from __future__ import annotations

import gzip
import importlib.util
import math
import os
import string
from pathlib import Path
from typing import Optional

from .base import IMAGE_SIZE

CLIP_MERGES = 2000       # first N merges of CLIP's 48,894 (vocab = 512 + N + 2)
LATENT_CHANNELS = 16     # SD3 / FLUX VAEs have 16 latent channels


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


# Qwen2.5-VL's special tokens (the chat markers the pipeline's prompt template uses, and the vision ones)
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
# the words of the pipeline's system prompt (whole tokens, so the template's prefix is 34 tokens as with Qwen's)
_TEMPLATE_WORDS = ("the", "image", "by", "detailing", "color", "shape", "size", "texture", "quantity", "text",
                   "spatial", "relationships", "of", "objects", "and", "background")
_LINE_START_WORDS = ("system", "user", "assistant", "Describe")  # words that follow a newline in the template


def byte_level_vocab(words, line_start_words=(), num_words: int = 2000) -> tuple[dict, list]:
    """``(vocab, merges)`` of an offline byte-level BPE in which every word is one token, built by a
    left-to-right merge chain over its byte-level spelling (``"Ġcat"``: ``Ġ c -> Ġc``, ``Ġc a -> Ġca``,
    ``Ġca t -> Ġcat``): ``words`` and the English words among the first ``num_words`` CLIP merges, each
    after a space, then ``line_start_words`` without one (their chains last, so they never split a
    space-prefixed word); other text falls back to bytes. Token ids start with the 256 byte characters."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_char = bytes_to_unicode()

    def spell(text: str) -> str:
        return "".join(byte_char[b] for b in text.encode("utf-8"))

    vocab = {c: i for i, c in enumerate(byte_char.values())}
    merges: list[tuple[str, str]] = []

    def chain(word: str) -> None:
        for k in range(2, len(word) + 1):
            if word[:k] not in vocab:
                vocab[word[:k]] = len(vocab)
                merges.append((word[:k - 1], word[k - 1]))

    clip_words = ["".join(m)[:-4] for m in clip_merges(num_words) if "".join(m).endswith("</w>")]
    for w in dict.fromkeys(tuple(words) + tuple(w for w in clip_words if w.isascii() and w.isalpha())):
        chain(spell(" " + w))
    for w in line_start_words:
        chain(spell(w))
    return vocab, merges


# Qwen3's chat template for the messages the FLUX.2 [klein] and Z-Image pipelines build (one user turn, a
# generation prompt; ``enable_thinking=False`` adds the empty thinking block), as Qwen/Qwen3-*'s template renders them
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")


def build_qwen_tokenizer(num_words: int = 2000, model_max_length: int = 32768, *, qwen3: bool = False):
    """An offline byte-level BPE ``Qwen2Tokenizer`` for tiny models (Qwen2's pre-tokenizer, byte
    alphabet and special tokens, a small vocabulary: :func:`byte_level_vocab` over the words of
    ``QwenImagePipeline``'s system prompt and the template's line-start words). So the Qwen-Image
    template's prefix is 34 tokens, as ``prompt_template_encode_start_idx`` assumes. ``qwen3``: also
    Qwen3's ``<think>`` / ``</think>`` tokens and its chat template (:data:`QWEN3_CHAT_TEMPLATE`), for
    the Qwen3 text encoders of FLUX.2 [klein] and Z-Image. Saved and loaded with ``save_pretrained`` /
    ``from_pretrained``.
    """
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab, merges = byte_level_vocab(_TEMPLATE_WORDS, _LINE_START_WORDS, num_words)
    special = QWEN_SPECIAL_TOKENS + (("<think>", "</think>") if qwen3 else ())
    for s in special:
        vocab[s] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length, eos_token="<|im_end|>")
    tok.add_tokens([AddedToken(s, special=True, normalized=False) for s in QWEN_SPECIAL_TOKENS])
    if qwen3:
        tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in ("<think>", "</think>")])
        tok.chat_template = QWEN3_CHAT_TEMPLATE
    return tok


# --- components ----------------------------------------------------------------------------
def clip_config(vocab_size: int, eos_id: int, bos_id: int, hidden: int = 32, projection: int = 32):
    from transformers import CLIPTextConfig

    # diffusers' dummy CLIP (hidden 32, 5 layers, 4 heads, intermediate 37), with real token ids
    return CLIPTextConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=37, num_hidden_layers=2,
                          num_attention_heads=4, projection_dim=projection, max_position_embeddings=77,
                          hidden_act="quick_gelu", layer_norm_eps=1e-5, bos_token_id=bos_id, eos_token_id=eos_id,
                          pad_token_id=eos_id)


def t5_encoder(vocab_size: int, d_model: int):
    from transformers import T5Config, T5EncoderModel

    # like hf-internal-testing/tiny-random-t5 (d_ff 37, d_kv 8, 4 heads), gated-gelu as T5 v1.1
    cfg = T5Config(vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                   relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", pad_token_id=0,
                   eos_token_id=1, decoder_start_token_id=0, is_encoder_decoder=False)
    return T5EncoderModel(cfg)


def qwen3_encoder(model_class: str, tokenizer, num_layers: int, hidden: int = 16):
    """A tiny Qwen3 text encoder (``"Qwen3ForCausalLM"`` for FLUX.2 [klein], ``"Qwen3Model"`` for Z-Image):
    ``num_layers`` layers ``hidden`` wide, 2 query / 1 KV heads of 8, tied embeddings as Qwen3-4B, over
    ``tokenizer`` (``build_qwen_tokenizer(qwen3=True)``); random weights in eval mode."""
    import transformers

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")}
    cfg = transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=2048, rope_theta=1e6,
        tie_word_embeddings=True, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"])
    return getattr(transformers, model_class)(cfg).eval()


def kl_vae(scaling_factor: float, shift_factor: float, image_size: int):
    from diffusers import AutoencoderKL

    # four blocks -> downsampling 8 like the real VAEs; no quant convs (SD3 / FLUX VAEs have none)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8),
                         layers_per_block=1, latent_channels=LATENT_CHANNELS, norm_num_groups=4,
                         sample_size=image_size, use_quant_conv=False, use_post_quant_conv=False,
                         scaling_factor=scaling_factor, shift_factor=shift_factor)


def _adapter(kind: str):
    from . import tiny_kinds

    kinds = tiny_kinds()
    if kind not in kinds:
        raise ValueError(f"unknown tiny pipeline kind {kind!r}; choose one of {', '.join(sorted(kinds))}")
    return kinds[kind]


def tiny_pipeline(kind: str, image_size: int = IMAGE_SIZE, seed: int = 0):
    """An in-memory tiny diffusers pipeline of ``kind`` (a ``tiny_kinds`` entry of an adapter)."""
    from .base import diffusers_attr

    cls = _adapter(kind)
    m = cls.tiny_multiple()
    if image_size % m or image_size < m:
        raise ValueError(f"image_size must be a positive multiple of {m} for {kind}, got {image_size}")
    return diffusers_attr(cls.pipeline_class)(**cls.tiny_components(kind, image_size, seed))


def make_tiny(kind: str, out_dir: str | os.PathLike, *, image_size: Optional[int] = None, seed: int = 0,
              overwrite: bool = False) -> Path:
    """Write a tiny random-weight model of ``kind`` (``flowrl make-tiny`` kinds: every adapter's
    ``tiny_kinds``) to ``out_dir``; returns the directory. Offline and deterministic in ``seed``;
    ``image_size`` (pixels; None = the adapter's tiny default, 64 for the diffusers models) is the
    resolution the adapter defaults to (``flowrl.json``). Written
    into a temporary sibling and renamed, so a crash leaves no half-written model."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass overwrite=True (CLI: --overwrite) to replace it")
    size = {} if image_size is None else {"image_size": image_size}
    return _adapter(kind).make_tiny(kind, out, seed=seed, overwrite=overwrite, **size)
