"""Image-feature models: ``images [B, 3, H, W] in [0, 1] -> features [B, D] float32``, for measures that
compare samples with each other (GARDO's diversity-aware advantages, arXiv 2512.24138).

``FEATURES`` names them (a recipe picks one with ``train.loss_options.features``; its constructor's keyword
arguments are ``train.loss_options.features_options``):

- ``digits``: flowrl's digits classifier (``rewards/digits.py``) up to its hidden layer, on the same 8 x 8
  view the reward sees: the 256 pre-activations (no download; trained and cached on first use).
- ``dino``: a DINO-family vision transformer through transformers (``AutoModel.from_pretrained(path)``:
  DINOv2, DINOv3 ViT, any model whose output has ``pooler_output``), its pooled output; images resized to
  ``size`` x ``size`` and normalised with ImageNet statistics. GARDO uses DINOv3 ViT-L/16.

Each class declares ``resident_params`` / ``resident_note`` for ``flowrl plan``, as rewards do.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch
import torch.nn.functional as F

from flowrl.registry import Registry

from ._clip_common import DTypeLike, chunks, from_pretrained, resolve_dtype

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

FEATURES = Registry("feature model", {
    "digits": "flowrl.rewards.features:DigitsFeatures",
    "dino": "flowrl.rewards.features:DinoFeatures",
})


def check_feature_options(name: str, options: dict, where: str = "train.loss_options.features_options") -> None:
    """A ``ValueError`` (one line) unless ``name`` is a feature model and ``options`` are keyword arguments of
    its constructor that it requires (no model is loaded)."""
    try:
        FEATURES.check(name)
    except ValueError as e:
        raise ValueError(f"{where.rsplit('_options', 1)[0]}: {e}") from None
    params = inspect.signature(FEATURES.get(name).__init__).parameters
    valid = [p for p in params if p != "self"]
    for k in options:
        if k not in valid:
            raise ValueError(f"{where}.{k}: not an option of the {name!r} feature model; valid: {', '.join(valid)}")
    for p, spec in params.items():
        if p != "self" and spec.default is inspect.Parameter.empty and options.get(p) in (None, ""):
            raise ValueError(f"the {name!r} feature model needs {where}.{p} (e.g. a save_pretrained directory or a "
                             f"hub id such as facebook/dinov2-large); set it, or choose features: digits")


class DigitsFeatures:
    """The digits classifier's hidden layer (256 pre-activations) on the 8 x 8 view -> ``[B, 256]``."""

    name = "digits"
    resident_params = 16_640  # the first layer of flowrl's digits classifier (64 x 256 + 256)
    resident_note = "flowrl's digits classifier, first layer (64 -> 256)"

    def __init__(self, device: str = "cpu", cache_dir: Optional[str] = None):
        from pathlib import Path

        from .digits import load_classifier

        self.device = torch.device(device)
        self.layer = load_classifier(Path(cache_dir) if cache_dir else None)[0].to(self.device)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        from .digits import to_8x8

        return self.layer(to_8x8(images.to(self.device))).float().cpu()  # [B, 256]


class DinoFeatures:
    """A DINO-family transformer's pooled output (``AutoModel.from_pretrained(path)``) -> ``[B, D]``.

    Args:
        path: a ``save_pretrained`` directory or a hub id (DINOv3 ViT-L/16 for GARDO's setting).
        device, dtype: where and in which precision the model runs.
        size: the square input side in pixels (images are resized, bicubic, antialiased).
        batch_size: images per forward pass.
    """

    name = "dino"
    resident_params = 303_100_000  # DINOv3 ViT-L/16 (GARDO's); a ViT-B is 86M, a ViT-g 1.1B
    resident_note = "DINOv3 ViT-L/16 (0.3B parameters; other sizes differ)"

    def __init__(self, path: str, device: str = "cpu", dtype: DTypeLike = "float32", size: int = 224,
                 batch_size: int = 32):
        from transformers import AutoModel

        if not isinstance(size, int) or size < 1:
            raise ValueError(f"the dino feature model's size must be a positive integer, got {size!r}")
        self.device, self.dtype, self.size, self.batch_size = torch.device(device), resolve_dtype(dtype), size, batch_size
        model = from_pretrained(AutoModel.from_pretrained, path, "DINO feature model",
                                "train.loss_options.features_options.path")
        self.model = model.to(self.device, self.dtype).eval().requires_grad_(False)
        mean, std = torch.tensor(IMAGENET_MEAN), torch.tensor(IMAGENET_STD)
        self.mean, self.std = mean.view(1, 3, 1, 1).to(self.device), std.view(1, 3, 1, 1).to(self.device)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        out = []
        for sl in chunks(images.shape[0], self.batch_size):
            x = images[sl].to(self.device).float()  # [b, 3, H, W] in [0, 1]
            x = F.interpolate(x, size=(self.size, self.size), mode="bicubic", antialias=True, align_corners=False)
            x = ((x - self.mean) / self.std).to(self.dtype)  # [b, 3, size, size]
            res = self.model(pixel_values=x)
            pooled = getattr(res, "pooler_output", None)
            out.append((pooled if pooled is not None else res.last_hidden_state[:, 0]).float().cpu())  # [b, D]
        return torch.cat(out)


def tiny_dino(directory, image_size: int = 32, seed: int = 0):
    """Write a tiny random DINOv2 (transformers ``Dinov2Model`` from a config, nothing downloaded) to
    ``directory`` with ``save_pretrained``; for tests and ``flowrl train --smoke``. Returns the path."""
    from pathlib import Path

    from transformers import Dinov2Config, Dinov2Model

    from flowrl.utils.io import atomic_dir

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=64, image_size=image_size, patch_size=8))
        atomic_dir(directory, model.save_pretrained)
    return directory
