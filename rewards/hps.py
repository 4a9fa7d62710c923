"""``hps``: Human Preference Score v2.1 (Wu et al. 2023), an open_clip ViT-H-14 fine-tuned on HPD v2.

reward = ``cos(image, text)`` of HPS's unit embeddings (the diagonal of
``image_features @ text_features.T``), unscaled, as in HPSv2's ``img_score.py`` and Flow-GRPO's
``hpsv2_scorer.py``; typical values 0.25-0.35.

Architecture: ``open_clip.create_model("ViT-H-14")`` with no pretrained tag, then the
``HPS_v2.1_compressed.pt`` state dict (Hugging Face ``xswu/HPSv2``) passed as ``checkpoint``: a local
path or the hub file ``hf://xswu/HPSv2/HPS_v2.1_compressed.pt`` (the recipes' value: read from the local
Hugging Face cache, or downloaded).
Images are preprocessed like HPSv2's val transform (longer side -> 224, zero-pad to square,
OpenAI mean/std), on tensors.
"""
from __future__ import annotations

import torch

from flowrl.options import Device, PositiveInt, WeightsFile

from ._clip_common import CLIP_MEAN, CLIP_STD, DTypeLike, ImageTransform, check_inputs, chunks, load_weights, \
    require, resolve_dtype

HUB_CHECKPOINT = "hf://xswu/HPSv2/HPS_v2.1_compressed.pt"
CHECKPOINT_HINT = (f"Pass checkpoint={HUB_CHECKPOINT} (the xswu/HPSv2 Hugging Face repository; cached or downloaded) "
                   f"or checkpoint='/path/to/HPS_v2.1_compressed.pt'.")


class HPSv21:
    """HPS-v2.1 score per (image, prompt) pair; float32 [B] on CPU.

    ``model`` is an open_clip model name (``"ViT-H-14"`` for the published checkpoint; a name
    registered with ``open_clip.add_model_config`` for custom or tiny configs).
    """

    name = "hps"
    resident_params = 986_100_000  # parameters kept loaded, for `flowrl plan` (bytes: x the dtype option)
    resident_note = "HPS v2.1 = open_clip ViT-H-14 (open_clip profile: 986.1M)"

    def __init__(self, checkpoint: WeightsFile, model: str = "ViT-H-14", device: Device = "cpu", dtype: DTypeLike = "float32",
                 batch_size: PositiveInt = 32):
        if not checkpoint:
            raise ValueError(f"the hps reward needs its weights. {CHECKPOINT_HINT}")
        open_clip = require("open_clip", "open-clip-torch")
        self.device, self.dtype = torch.device(device), resolve_dtype(dtype)
        if model not in open_clip.list_models():
            raise ValueError(f"unknown open_clip model {model!r}: use 'ViT-H-14' for HPS-v2.1, or register a config "
                             "with open_clip.add_model_config(path)")
        # fail fast, before building
        sd = load_weights(checkpoint, "HPS-v2.1 checkpoint", CHECKPOINT_HINT, "reward.options.hps.checkpoint")
        net = open_clip.create_model(model, pretrained=None, precision="fp32", device="cpu", output_dict=True)
        try:
            net.load_state_dict(sd, strict=True)
        except RuntimeError as e:
            raise ValueError(f"{checkpoint!r} does not match open_clip {model!r} (is it an HPS-v2 checkpoint for "
                             f"this architecture?): {e}") from e
        self.model = net.eval().requires_grad_(False).to(self.device, self.dtype)
        self.tokenizer = open_clip.get_tokenizer(model)
        size = net.visual.image_size
        size = size[0] if isinstance(size, (tuple, list)) else size
        self.transform = ImageTransform(size=int(size), mean=getattr(net.visual, "image_mean", None) or CLIP_MEAN,
                                        std=getattr(net.visual, "image_std", None) or CLIP_STD, resize="longest_pad")
        self.batch_size = int(batch_size)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str], **meta) -> torch.Tensor:
        check_inputs(images, prompts, self.name)
        prompts, out = list(prompts), []
        for s in chunks(images.shape[0], self.batch_size):
            pixels = self.transform(images[s].to(self.device)).to(self.dtype)  # [b, 3, 224, 224]
            img = self.model.encode_image(pixels, normalize=True).float()  # [b, D]
            txt = self.model.encode_text(self.tokenizer(prompts[s]).to(self.device), normalize=True).float()  # [b, D]
            out.append((img * txt).sum(-1).cpu())  # [b]
        return torch.cat(out).float()
