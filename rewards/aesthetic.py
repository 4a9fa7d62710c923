"""``aesthetic``: the LAION aesthetic predictor v2 (improved-aesthetic-predictor, Schuhmann 2022).

reward = ``MLP(unit CLIP ViT-L/14 image embedding)``, unnormalised, on the LAION 1-10 rating
scale (SD-class images score about 5-6.5), exactly as DDPO and Flow-GRPO's
``aesthetic_scorer.py`` use it. The prompt is ignored.

Weights: CLIP ``openai/clip-vit-large-patch14`` (transformers ``CLIPModel``, ``from_pretrained``
path or cached id) and the head file ``sac+logos+ava1-l14-linearMSE.pth`` from
christophschuhmann/improved-aesthetic-predictor, passed as ``head``: a local path, or the hub file
``hf://trl-lib/ddpo-aesthetic-predictor/aesthetic-model.pth`` (the same file, renamed in TRL's hub copy;
read from the local Hugging Face cache, or downloaded).
"""
from __future__ import annotations

import torch

from flowrl.options import Device, ModelSource, PositiveInt, WeightsFile

from ._clip_common import DTypeLike, HFClip, LinearMLPHead, check_inputs, chunks, load_weights

HUB_HEAD = "hf://trl-lib/ddpo-aesthetic-predictor/aesthetic-model.pth"  # sac+logos+ava1-l14-linearMSE.pth, renamed
HEAD_HINT = (f"Pass head={HUB_HEAD} (the LAION improved-aesthetic-predictor MLP, cached or downloaded) or "
             f"head='/path/to/sac+logos+ava1-l14-linearMSE.pth' (.safetensors works too).")


class LaionAesthetic:
    """Aesthetic score of each image (1-10 scale); float32 [B] on CPU."""

    name = "aesthetic"
    resident_params = 428_500_000  # parameters kept loaded, for `flowrl plan` (bytes: x the dtype option)
    resident_note = "CLIP ViT-L/14 427.6M + LAION aesthetic MLP head 0.9M"

    def __init__(self, head: WeightsFile, clip: ModelSource = "openai/clip-vit-large-patch14", device: Device = "cpu",
                 dtype: DTypeLike = "float32", batch_size: PositiveInt = 32):
        if not head:
            raise ValueError(f"the aesthetic reward needs its MLP head file. {HEAD_HINT}")
        # fail fast, before loading CLIP
        sd = load_weights(head, "aesthetic head", HEAD_HINT, "reward.options.aesthetic.head")
        self.head = LinearMLPHead.from_state_dict(sd, "aesthetic head")
        self.clip = HFClip(clip, device=device, dtype=dtype, text=False, setting="reward.options.aesthetic",
                           model_key="clip")
        dim = self.clip.model.config.projection_dim
        if self.head.layers[0].in_features != dim:
            raise ValueError(f"aesthetic head expects {self.head.layers[0].in_features}-d embeddings but the CLIP "
                             f"model gives {dim}-d: the LAION head goes with CLIP ViT-L/14 (768-d)")
        self.head = self.head.eval().requires_grad_(False).to(self.clip.device)
        self.batch_size = int(batch_size)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str], **meta) -> torch.Tensor:
        check_inputs(images, prompts, self.name)
        out = [self.head(self.clip.embed_images(images[s])).cpu() for s in chunks(images.shape[0], self.batch_size)]
        return torch.cat(out).float()  # [B]
