"""In-process Qwen-VL judges on transformers (the ``editscore`` and ``unifiedreward`` rewards): loading, the
authors' image preparation, and generation.

Loading: ``AutoModelForImageTextToText.from_pretrained(model)`` (Qwen2-VL, Qwen2.5-VL and Qwen3-VL checkpoints),
an optional peft LoRA adapter merged into it (``lora``: EditScore publishes its judges as LoRA adapters on
Qwen2.5-VL-Instruct, merged with ``merge_and_unload`` as its own loader does), and
``AutoProcessor.from_pretrained(processor or model)``.

Images (:meth:`ChatVLM.image`): ``[3, H, W]`` float in [0, 1] -> uint8 ``round(255 x)`` (how Flow-GRPO hands
images to its judges) -> PIL; for Qwen2-VL and Qwen2.5-VL checkpoints then what qwen-vl-utils' ``fetch_image``
(0.0.14, which both authors' Qwen2.5-VL scripts call through ``process_vision_info``) does to a PIL image
(:func:`prepare_image`): each side rounded to a multiple of 28 (patch 14 x merge 2) with the pixel count kept in
``[4, 16384] x 28^2`` (:func:`smart_resize`), then a PIL bicubic resize. Other checkpoints (Qwen3-VL: EditScore's
``qwen3vl`` backend hands the PIL image to the processor) get the PIL image as it is. The checkpoint's processor
then resizes to its own grid, rescales, normalises and patchifies.

Generation (:meth:`ChatVLM.generate`): requests ``(chat text, [PIL images])`` in batches of ``batch_size``
(left-padded), one ``model.generate`` each with the checkpoint's generation config plus the caller's overrides
(what the authors pass), ``torch.manual_seed(seed)`` before every call (inside ``torch.random.fork_rng``: the
process's random state is restored after it); the new tokens decoded with
``skip_special_tokens=True``. ``batch_size=1`` is the authors' one-request-per-call loop token for token (a
sampled batch draws from one random stream instead of one per request).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from PIL import Image

from flowrl.utils.images import to_pil

from ._clip_common import DTypeLike, from_pretrained, require, resolve_dtype

PATCH_FACTOR = 28  # Qwen2/2.5-VL: 14-pixel patches merged 2 x 2 (qwen-vl-utils: image_patch_size x SPATIAL_MERGE_SIZE)
MIN_TOKENS, MAX_TOKENS = 4, 16384  # qwen-vl-utils' IMAGE_MIN_TOKEN_NUM / IMAGE_MAX_TOKEN_NUM
MAX_RATIO = 200
QWEN_VL_UTILS_FAMILIES = ("qwen2_vl", "qwen2_5_vl")  # checkpoints whose authors' scripts prepare images with it


def smart_resize(height: int, width: int, factor: int = PATCH_FACTOR, min_pixels: Optional[int] = None,
                 max_pixels: Optional[int] = None) -> tuple[int, int]:
    """``(height, width)`` each a multiple of ``factor``, the pixel count in ``[min_pixels, max_pixels]``
    (default ``[4, 16384] x factor^2``) and the aspect ratio kept as closely as that allows (qwen-vl-utils)."""
    min_pixels = MIN_TOKENS * factor ** 2 if min_pixels is None else min_pixels
    max_pixels = MAX_TOKENS * factor ** 2 if max_pixels is None else max_pixels
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(f"image aspect ratio must be under {MAX_RATIO}, got {height}x{width}")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def prepare_image(image: torch.Tensor, resize: Optional[int] = None, min_pixels: Optional[int] = None,
                  max_pixels: Optional[int] = None) -> Image.Image:
    """One image as the judge sees it (module doc); ``resize``: first to ``resize x resize`` (PIL bicubic, as
    Flow-GRPO's UnifiedReward scorer sends 512 x 512); ``min_pixels`` / ``max_pixels``: :func:`smart_resize`'s
    bounds (None: its defaults)."""
    pil = to_pil(image)
    if resize:
        pil = pil.resize((resize, resize), Image.BICUBIC)
    h, w = smart_resize(pil.height, pil.width, min_pixels=min_pixels, max_pixels=max_pixels)
    return pil.resize((w, h), Image.BICUBIC)


class ChatVLM:
    """A Qwen-VL chat model and its processor, loaded once; :meth:`generate` answers requests (module doc).

    Args:
        model: checkpoint (a ``save_pretrained`` directory or a hub id).
        processor: where its processor lives (default: ``model``).
        lora: a peft adapter directory or id merged into the weights (None: none).
        setting: where the user gave these (for errors), e.g. ``reward.options.editscore``.
    """

    def __init__(self, model: str, processor: Optional[str] = None, lora: Optional[str] = None, device: str = "cpu",
                 dtype: DTypeLike = "bfloat16", batch_size: int = 8, setting: str = "the reward's options"):
        transformers = require("transformers", "transformers")
        self.device, self.dtype = torch.device(device), resolve_dtype(dtype)
        self.batch_size = int(batch_size)
        net = from_pretrained(transformers.AutoModelForImageTextToText.from_pretrained, model, "VLM judge",
                              f"{setting}.model", dtype=self.dtype)
        if lora:
            peft = require("peft", "peft")
            net = self._load_lora(peft, net, lora, setting)
        self.model = net.eval().requires_grad_(False).to(self.device)
        self.family = str(getattr(net.config, "model_type", ""))
        self.uses_qwen_vl_utils = self.family in QWEN_VL_UTILS_FAMILIES  # module doc
        self.processor = from_pretrained(transformers.AutoProcessor.from_pretrained, processor or model,
                                         "VLM judge's processor", f"{setting}.{'processor' if processor else 'model'}")
        self.processor.tokenizer.padding_side = "left"  # batched generation continues every row at its end

    @staticmethod
    def _load_lora(peft, net, lora: str, setting: str):
        from flowrl.utils.hub import require_hub_model

        require_hub_model(lora, "the judge's LoRA adapter", f"{setting}.lora")
        try:
            return peft.PeftModel.from_pretrained(net, lora).merge_and_unload()
        except (OSError, ValueError) as e:
            raise OSError(f"could not load the judge's LoRA adapter from {lora!r} ({setting}.lora): pass a peft "
                          f"adapter directory (adapter_config.json + weights) made for this model "
                          f"({(str(e).splitlines() or [type(e).__name__])[0]})") from None

    def image(self, image: torch.Tensor, resize: Optional[int] = None) -> Image.Image:
        """One ``[3, H, W]`` image as this checkpoint's authors hand it to the processor (module doc); ``resize``:
        first to ``resize x resize`` (:func:`prepare_image`)."""
        if self.uses_qwen_vl_utils:
            return prepare_image(image, resize)
        pil = to_pil(image)
        return pil.resize((resize, resize), Image.BICUBIC) if resize else pil

    def chat_text(self, n_images: int, text: str) -> str:
        """The checkpoint's chat template over one user turn of ``n_images`` images then ``text``, with the
        assistant's turn opened (``apply_chat_template(..., add_generation_prompt=True)``)."""
        content = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": text}]
        return self.processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                  add_generation_prompt=True)

    def inputs(self, texts: Sequence[str], images: Sequence[Sequence[Image.Image]]):
        """The processor's batch (``input_ids``, ``attention_mask``, ``pixel_values``, ``image_grid_thw``)."""
        flat = [im for row in images for im in row]
        return self.processor(text=list(texts), images=flat or None, padding=True, return_tensors="pt")

    @torch.no_grad()
    def generate(self, requests: Sequence[tuple[str, Sequence[Image.Image]]], seed: int = 0,
                 **overrides) -> list[str]:
        """The decoded answers to ``requests`` (each ``(chat text, images)``), in order."""
        out: list[str] = []
        for start in range(0, len(requests), self.batch_size):
            part = requests[start:start + self.batch_size]
            batch = self.inputs([t for t, _ in part], [ims for _, ims in part]).to(self.device)
            if "pixel_values" in batch:
                batch["pixel_values"] = batch["pixel_values"].to(self.dtype)
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                torch.manual_seed(seed)  # sampled replies: the authors' seeding; the caller's random state is kept
                ids = self.model.generate(**batch, **overrides)  # [b, prompt + new]
            new = ids[:, batch["input_ids"].shape[1]:]  # [b, new]
            out += self.processor.batch_decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return out
