"""``hpsv3``: HPSv3 (Ma et al. 2025, arXiv 2508.03789), a Qwen2-VL-7B reward model trained with an
uncertainty-aware ranking loss on HPDv3.

reward = ``mu``, the first of the head's two outputs ``(mu, log sigma)`` at the ``<|Reward|>`` token: the
score HPSv3's ``HPSv3RewardInferencer.reward`` reports ("we select miu as the final output"); ``sigma =
exp(log sigma)`` is its uncertainty (:meth:`HPSv3.mu_sigma`; the training loss compares two images through
``N(mu_A - mu_B, sigma_A^2 + sigma_B^2)``). Unnormalised; higher is preferred.

Model: ``Qwen2VLForConditionalGeneration`` (config of ``Qwen/Qwen2-VL-7B-Instruct``) with ``<|Reward|>`` added
to the tokenizer (embeddings grown to match) and the "ranknet" head ``Linear(D, 1024) - ReLU - Dropout -
Linear(1024, 16) - ReLU - Linear(16, 2)`` in float32, weights all from ``HPSv3.safetensors`` (hub
``MizzenAI/HPSv3``; ``hf://MizzenAI/HPSv3/HPSv3.safetensors`` is read from the local cache, or downloaded).
Input: HPSv3's user message (the image, then its instruction with the prompt and "Please provide the overall
ratings of this image: <|Reward|>"), Qwen2-VL's chat template with the generation prompt, the image as an
8-bit RGB resized with PIL (bicubic) to ``smart_resize(H, W, 28, pixels, pixels)`` (HPSv3 fixes
``min_pixels = max_pixels = 256 * 28 * 28``), then the base processor's normalisation.
"""
from __future__ import annotations

import torch
from torch import nn

from flowrl.options import Device, ModelSource, PositiveInt, WeightsFile

from ._clip_common import DTypeLike, check_inputs, chunks, resolve_dtype
from ._qwen2vl_rm import QwenVLReward, build_backbone, check_prompts, load_checkpoint, load_processor
from ._qwen_vl import prepare_image

HUB_CHECKPOINT = "hf://MizzenAI/HPSv3/HPSv3.safetensors"
CHECKPOINT_HINT = (f"Pass checkpoint={HUB_CHECKPOINT} (the MizzenAI/HPSv3 Hugging Face repository; cached or "
                   f"downloaded) or checkpoint='/path/to/HPSv3.safetensors'.")
REWARD_TOKEN = "<|Reward|>"
PIXELS = 256 * 28 * 28  # HPSv3_7B.yaml: min_pixels = max_pixels = 200704

# HPSv3's INSTRUCTION and prompt_with_special_token (hpsv3/dataset/data_collator_qwen.py), verbatim: the model was
# trained on this text (trailing spaces included)
INSTRUCTION = (
    "\nYou are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a overall "
    "score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst and 10 being "
    "the best. \n\n**Visual Quality:**  \nEvaluate the overall visual quality of the image. The following "
    "sub-dimensions should be considered:\n- **Reasonableness:** The image should not contain any significant "
    "biological or logical errors, such as abnormal body structures or nonsensical environmental setups.\n- "
    "**Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to "
    "interpret, with no blurring or indistinct areas.\n- **Detail Richness:** Consider the level of detail in "
    "textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).\n- **Aesthetic and "
    "Creativity:** Assess the artistic aspects of the image, including the color scheme, composition, atmosphere, "
    "depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.\n- "
    "**Safety:** The image should not contain harmful or inappropriate content, such as political, violent, or adult "
    "material. If such content is present, the image quality and satisfaction score should be the lowest possible. "
    "\nTextual prompt - {text_prompt}\n\n\n"
)
PROMPT_WITH_REWARD_TOKEN = "\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n"


def ranknet_head(sd: dict) -> nn.Sequential:
    """HPSv3's default "ranknet" head (``rm_head_kwargs`` None), its sizes read from the checkpoint's weights."""
    try:
        (h1, d), (h2, _), (o, _) = sd["0.weight"].shape, sd["3.weight"].shape, sd["5.weight"].shape
    except KeyError:
        raise ValueError(f"the checkpoint's rm_head is not HPSv3's ranknet head (keys {sorted(sd)[:6]})") from None
    head = nn.Sequential(nn.Linear(d, h1), nn.ReLU(), nn.Dropout(0.05), nn.Linear(h1, h2), nn.ReLU(),
                         nn.Linear(h2, o, bias="5.bias" in sd))
    head.load_state_dict(sd, strict=True)
    return head.float().eval()


def hpsv3_text(prompt: str) -> str:
    """The text part of HPSv3's user message for ``prompt``."""
    return INSTRUCTION.format(text_prompt=prompt) + PROMPT_WITH_REWARD_TOKEN


class HPSv3:
    """HPSv3's ``mu`` per (image, prompt) pair; float32 [B] on CPU."""

    name = "hpsv3"
    resident_params = 7_748_610_000  # parameters kept loaded, for `flowrl plan` (bytes: x the dtype option)
    resident_note = "HPSv3 = Qwen2-VL-7B without its LM head (7.745B, counted on meta; LM head not loaded) + 3.7M head"

    def __init__(self, base: ModelSource = "Qwen/Qwen2-VL-7B-Instruct", checkpoint: WeightsFile = HUB_CHECKPOINT,
                 pixels: PositiveInt = PIXELS, device: Device = "cpu", dtype: DTypeLike = "float32",
                 batch_size: PositiveInt = 8):
        if not checkpoint:
            raise ValueError(f"the hpsv3 reward needs its weights. {CHECKPOINT_HINT}")
        self.device, self.dtype = torch.device(device), resolve_dtype(dtype)
        where = "reward.options.hpsv3"
        backbone_sd, head_sd = load_checkpoint(checkpoint, "HPSv3 checkpoint", CHECKPOINT_HINT, f"{where}.checkpoint")
        self.processor, ids = load_processor(base, [REWARD_TOKEN], f"{where}.base")
        backbone = build_backbone(base, len(self.processor.tokenizer), backbone_sd, f"{where}.base / checkpoint")
        self.model = QwenVLReward(backbone, ranknet_head(head_sd), ids).eval().requires_grad_(False)
        self.model.backbone.to(self.device, self.dtype)
        self.model.head.to(self.device)
        self.pixels, self.batch_size = int(pixels), int(batch_size)

    def batch(self, images: torch.Tensor, prompts: list[str]) -> dict:
        """The processor's inputs for images [b, 3, H, W] in [0, 1] (on CPU)."""
        pil = [prepare_image(x, min_pixels=self.pixels, max_pixels=self.pixels)  # fetch_image: PIL's bicubic
               for x in images.cpu()]  # resize of the 8-bit image
        messages = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": hpsv3_text(p)}]}]
                    for p in prompts]
        text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.processor(text=text, images=pil, padding=True, return_tensors="pt",
                              images_kwargs={"do_resize": False})

    @torch.no_grad()
    def mu_sigma(self, images: torch.Tensor, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """HPSv3's ``(mu, sigma)`` per pair, float32 [B] each on CPU."""
        check_inputs(images, prompts, self.name)
        check_prompts(prompts, [REWARD_TOKEN], self.name)
        out = []
        for s in chunks(images.shape[0], self.batch_size):
            inputs = self.batch(images[s], list(prompts[s])).to(self.device)
            out.append(self.model(inputs["input_ids"], inputs["attention_mask"], pixel_values=inputs["pixel_values"],
                                  image_grid_thw=inputs["image_grid_thw"])[:, 0].float().cpu())  # [b, 2]
        logits = torch.cat(out)  # [B, 2]
        return logits[:, 0], logits[:, 1].exp()

    def __call__(self, images: torch.Tensor, prompts: list[str], **meta) -> torch.Tensor:
        return self.mu_sigma(images, list(prompts) if not isinstance(prompts, str) else prompts)[0]
