"""``digits``: probability, under a small classifier of flowrl's own, of the digit the prompt names.

The classifier is an MLP on the 8 x 8 view (2 x 2 average pool of the 16 x 16 image, the
resolution scikit-learn's digits come in), trained on the bundled digits' training split in
a few seconds and cached. It cannot see 2-pixel patterns, which is why the trainer also logs
high-frequency energy (reward-hacking watch). Prompts naming no digit score NaN.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from flowrl.data.digits import digits_dataset, parse_digit
from flowrl.options import Device
from flowrl.utils.paths import default_cache_dir
from flowrl.utils.io import atomic_write

from ._clip_common import check_inputs

CLASSIFIER_FILE = "digits-classifier-v1.safetensors"


def to_8x8(images: torch.Tensor) -> torch.Tensor:
    """``[B, 3, 16, 16]`` in [0, 1] -> ``[B, 64]`` grey 8 x 8 view in [0, 1]."""
    grey = images.float().mean(dim=1, keepdim=True)  # [B, 1, H, W]
    return F.adaptive_avg_pool2d(grey, 8).flatten(1)  # [B, 64]


def _classifier() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Dropout(0.2), nn.Linear(256, 10))


def train_classifier(seed: int = 0, epochs: int = 400) -> tuple[nn.Module, float]:
    """Full-batch Adam on the train split; returns (model, test accuracy).

    Gradients are switched on here: the classifier is trained on first use, which may happen
    inside a caller's ``torch.no_grad()`` / ``inference_mode()`` (an evaluation or a report).
    """
    with torch.inference_mode(False), torch.enable_grad():
        return _train_classifier(seed, epochs)


def _train_classifier(seed: int, epochs: int) -> tuple[nn.Module, float]:
    torch.manual_seed(seed)
    xtr, ytr = digits_dataset("train")
    xte, yte = digits_dataset("test")
    f = lambda x: to_8x8(((x + 1) / 2).expand(-1, 3, -1, -1))  # noqa: E731
    xtr, xte = f(xtr), f(xte)
    model = _classifier()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3, weight_decay=1e-4)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        model.train()
        noisy = (xtr + 0.05 * torch.randn(xtr.shape, generator=g)).clamp(0, 1)
        loss = F.cross_entropy(model(noisy), ytr)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        acc = (model(xte).argmax(1) == yte).float().mean().item()
    return model, acc


def load_classifier(cache_dir: Optional[Path] = None) -> nn.Module:
    from safetensors.torch import load_file, save_file

    path = Path(cache_dir or default_cache_dir()) / CLASSIFIER_FILE
    model = _classifier()
    if path.is_file():
        model.load_state_dict(load_file(str(path)))
    else:
        model, _ = train_classifier()
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        atomic_write(path, lambda tmp: save_file(state, str(tmp)))
    return model.eval().requires_grad_(False)


class DigitsReward:
    """``p(digit named in the prompt | image)`` in [0, 1], float32 [B]; NaN if no digit is named."""

    name = "digits"
    resident_params = 19_210  # parameters kept loaded, for `flowrl plan` (bytes: x the dtype option)
    resident_note = "flowrl's digits classifier (an MLP 64-256-10: 19.2K)"

    def __init__(self, device: Device = "cpu", cache_dir: Optional[str] = None):
        self.device = torch.device(device)
        self.model = load_classifier(Path(cache_dir) if cache_dir else None).to(self.device)

    @torch.no_grad()
    def probs(self, images: torch.Tensor) -> torch.Tensor:
        """Class probabilities ``[B, 10]``."""
        return self.model(to_8x8(images.to(self.device))).softmax(-1).cpu()

    def __call__(self, images: torch.Tensor, prompts: list[str], **meta) -> torch.Tensor:
        check_inputs(images, prompts, self.name)
        p = self.probs(images)  # [B, 10]
        out = torch.full((len(prompts),), float("nan"))
        for i, pr in enumerate(prompts):
            d = parse_digit(pr)
            if d is not None:
                out[i] = p[i, d]
        return out
