"""Shared plumbing for the model-based rewards (CLIP family, HPS, ImageReward, aesthetic), and the
input check every shipped reward runs first (:func:`check_inputs`).

One job each: lazy imports with install hints, input checks, tensor preprocessing that
mirrors the peers' image processors, weight-file loading, the LAION-style linear MLP head,
and a transformers CLIP wrapper that returns unit-norm image/text embeddings.

Preprocessing runs on tensors on the reward's device (no PIL round trip), so it is batched
and differentiable. Each reward follows its reference's geometry exactly (docs/rewards.md,
"Preprocessing"): transformers' ``CLIPImageProcessor`` floors the centre-crop offset, torchvision's
``CenterCrop`` rounds it; a float (tensor) resize is not clamped, a uint8 (PIL) one saturates to
[0, 1]. What remains is the 8-bit quantisation of the PIL references, which the tests bound.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Callable, Iterator, Literal, Mapping, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from flowrl.options import Device, OneOf, PositiveFloat, PositiveInt
from flowrl.utils.hub import hub_file, is_hub_file, require_hub_model

# OpenAI CLIP statistics (also used by BLIP / ImageReward and open_clip's ViT-H-14)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
               "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
DTypeLike = Union[torch.dtype, Annotated[str, OneOf(tuple(DTYPE_NAMES))]]  # a reward's dtype option


def require(module: str, install: str):
    """Import ``module`` or raise an ImportError saying ``pip install <install>``."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"this reward needs the Python package {module!r}: pip install {install}") from e


def resolve_dtype(dtype: DTypeLike) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = DTYPE_NAMES
    if dtype not in names:
        raise ValueError(f"dtype must be one of {sorted(names)} or a torch.dtype, got {dtype!r}")
    return names[dtype]


def check_inputs(images: torch.Tensor, prompts: Sequence[str], name: str) -> None:
    """The reward contract's inputs, checked before any work (every shipped reward calls this first):
    ``images`` a floating ``[B, 3, H, W]`` tensor, ``B >= 1``, values in [0, 1] and no NaN; ``prompts``
    a list of B strings. Raises a one-line ValueError naming the reward, what is wrong and the fix.

    Reads two scalars of ``images`` (one ``aminmax`` pass; a host sync for GPU tensors)."""
    what = f"{name} reward expects images [B, 3, H, W] float in [0, 1]"
    if not isinstance(images, torch.Tensor):
        raise ValueError(f"{what}, got a {type(images).__name__}: pass a torch.Tensor (torch.stack a list of [3, H, W])")
    if images.ndim != 4 or images.shape[1] != 3:
        fix = ("add the batch dimension with images[None]" if images.ndim == 3 else
               "repeat grey images to RGB with images.expand(-1, 3, -1, -1)" if images.ndim == 4 and images.shape[1] == 1
               else "pass RGB images as [batch, channels=3, height, width]")
        raise ValueError(f"{what}, got shape {tuple(images.shape)}: {fix}")
    if not images.is_floating_point():
        raise ValueError(f"{what}, got dtype {images.dtype}: convert 0-255 integer images with images.float() / 255")
    if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
        got = "one string" if isinstance(prompts, str) else f"{sorted({type(p).__name__ for p in prompts})}"
        raise ValueError(f"{name} reward expects prompts as a list of strings, one per image, got {got}: "
                         "wrap a single prompt in a list ([prompt] * len(images))")
    if images.shape[0] == 0:
        raise ValueError(f"{name} reward got an empty batch (0 images): call it with at least one image")
    if len(prompts) != images.shape[0]:
        raise ValueError(f"{name} reward got {images.shape[0]} images but {len(prompts)} prompts: "
                         "pass one prompt per image, in the images' order")
    lo, hi = (float(v) for v in torch.aminmax(images.detach()))  # NaN anywhere makes both NaN
    if lo != lo or hi != hi:
        raise ValueError(f"{name} reward got images with {int(torch.isnan(images).sum())} NaN pixels: the sampler or "
                         "decoder diverged; check the latents before decoding")
    if lo < 0.0 or hi > 1.0:
        raise ValueError(f"{what}, got values in [{lo:.4g}, {hi:.4g}]: clamp with images.clamp(0, 1), or map "
                         "[-1, 1] images with (images + 1) / 2")


def chunks(n: int, size: int) -> Iterator[slice]:
    """Slices covering ``range(n)`` in pieces of at most ``size``."""
    if size < 1:
        raise ValueError(f"batch_size must be >= 1, got {size}")
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


# ---------------------------------------------------------------- preprocessing on tensors
CROP_OFFSETS = ("floor", "round")  # transformers' CLIPImageProcessor floors, torchvision's CenterCrop rounds


def resize_shortest_edge(images: torch.Tensor, size: int, mode: str = "bicubic", clamp: bool = True) -> torch.Tensor:
    """``[B, 3, H, W]`` -> shorter side ``size``, aspect kept (``int(size * long / short)``, as both
    transformers' ``shortest_edge`` and torchvision's ``Resize(int)`` compute it); antialiased.

    ``clamp``: saturate to [0, 1] as a uint8 (PIL) resize does; a float-tensor reference
    (torchvision ``Resize`` on tensors) keeps the overshoot of the cubic kernel."""
    h, w = images.shape[-2:]
    short, long = (h, w) if h <= w else (w, h)
    new_long = int(size * long / short)
    nh, nw = (size, new_long) if h <= w else (new_long, size)
    if (nh, nw) == (h, w):
        return images
    out = F.interpolate(images, size=(nh, nw), mode=mode, antialias=True, align_corners=False)  # [B, 3, nh, nw]
    return out.clamp(0, 1) if clamp else out


def center_crop(images: torch.Tensor, height: int, width: int, offset: str = "floor") -> torch.Tensor:
    """Centre crop ``[..., H, W]`` -> ``[..., height, width]``; the image must be at least the crop size.

    ``offset="floor"``: ``(H - height) // 2``, transformers' ``CLIPImageProcessor`` (both backends);
    ``"round"``: ``int(round((H - height) / 2))``, torchvision's ``CenterCrop`` (open_clip, BLIP). They
    differ by one pixel when ``H - height`` is 3 mod 4 (a 832 x 1216 image resized to 224 x 327)."""
    if offset not in CROP_OFFSETS:
        raise ValueError(f"crop offset must be one of {CROP_OFFSETS}, got {offset!r}")
    h, w = images.shape[-2:]
    if h < height or w < width:
        raise ValueError(f"cannot center-crop {h}x{w} images to {height}x{width}")
    if offset == "floor":
        top, left = (h - height) // 2, (w - width) // 2
    else:
        top, left = int(round((h - height) / 2.0)), int(round((w - width) / 2.0))
    return images[..., top:top + height, left:left + width]


def resize_longest_pad(images: torch.Tensor, size: int, mode: str = "bicubic", fill: float = 0.0) -> torch.Tensor:
    """HPS-v2's ``ResizeMaxSize`` (its val transform, after ``ToTensor``): longer side -> ``size``
    (float resize, not clamped), then pad (``fill``) to a centred square, the odd pixel at the end."""
    h, w = images.shape[-2:]
    scale = size / float(max(h, w))
    nh, nw = round(h * scale), round(w * scale)
    out = images
    if (nh, nw) != (h, w):
        out = F.interpolate(images, size=(nh, nw), mode=mode, antialias=True, align_corners=False)  # [B, 3, nh, nw]
    ph, pw = size - nh, size - nw
    return F.pad(out, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2), value=fill)


_PIL_RESAMPLE = {2: "bilinear", 3: "bicubic"}  # PIL.Image.Resampling values -> torch modes
PREPROCESS_REFERENCES = ("transformers", "torchvision")  # ImageTransform.from_hf
Preprocess = Literal[PREPROCESS_REFERENCES]  # a reward's preprocess option


@dataclass
class ImageTransform:
    """Resize + crop (or pad) + normalise, on ``[B, 3, H, W]`` tensors in [0, 1].

    ``resize="shortest"``: shorter side -> ``size`` then centre crop ``crop`` (CLIP processors,
    open_clip and BLIP val transforms) with the reference's ``crop_offset`` (:func:`center_crop`);
    ``clamp`` saturates the resized image as a uint8 reference does. ``resize="longest_pad"``:
    HPS-v2's ResizeMaxSize.
    """

    size: int
    crop: Optional[tuple[int, int]] = None
    mean: Sequence[float] = CLIP_MEAN
    std: Sequence[float] = CLIP_STD
    mode: str = "bicubic"
    resize: str = "shortest"
    crop_offset: str = "floor"
    clamp: bool = True

    def __post_init__(self):
        if self.resize not in ("shortest", "longest_pad"):
            raise ValueError(f"resize must be 'shortest' or 'longest_pad', got {self.resize!r}")
        if self.crop_offset not in CROP_OFFSETS:
            raise ValueError(f"crop_offset must be one of {CROP_OFFSETS}, got {self.crop_offset!r}")

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        x = images.float().clamp(0, 1)  # [B, 3, H, W]
        if self.resize == "longest_pad":
            x = resize_longest_pad(x, self.size, self.mode)  # [B, 3, S, S]
        else:
            x = resize_shortest_edge(x, self.size, self.mode, self.clamp)  # [B, 3, >=S, >=S]
            if self.crop is not None:
                x = center_crop(x, *self.crop, offset=self.crop_offset)  # [B, 3, h, w]
        mean = torch.tensor(self.mean, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(self.std, device=x.device).view(1, 3, 1, 1)
        return (x - mean) / std

    @classmethod
    def from_hf(cls, processor, reference: str = "transformers") -> "ImageTransform":
        """From a transformers CLIP-style image processor (``size``, ``crop_size``, mean/std).

        ``reference="transformers"``: the processor itself (its resample, floored crop offset, on
        uint8 images). ``"torchvision"``: the same sizes through torchvision's ``Resize(size)`` (its
        default bilinear) and ``CenterCrop`` on float tensors, as Flow-GRPO's CLIPScore builds it
        from the processor's config (rounded crop offset, no clamp)."""
        if reference not in PREPROCESS_REFERENCES:
            raise ValueError(f"preprocessing reference must be one of {PREPROCESS_REFERENCES}, got {reference!r}")
        size = processor.size
        if "shortest_edge" in size:
            short = int(size["shortest_edge"])
        elif "height" in size and size["height"] == size.get("width"):
            short = int(size["height"])
        else:
            raise ValueError(f"unsupported image processor size {size!r}: expected shortest_edge or a square")
        crop = None
        if getattr(processor, "do_center_crop", False) and getattr(processor, "crop_size", None):
            crop = (int(processor.crop_size["height"]), int(processor.crop_size["width"]))
        mean, std = tuple(processor.image_mean), tuple(processor.image_std)
        if reference == "torchvision":
            return cls(size=short, crop=crop, mean=mean, std=std, mode="bilinear", crop_offset="round", clamp=False)
        resample = getattr(processor, "resample", 3)
        mode = _PIL_RESAMPLE.get(int(resample), "bicubic") if resample is not None else "bicubic"
        return cls(size=short, crop=crop, mean=mean, std=std, mode=mode, crop_offset="floor", clamp=True)


# ---------------------------------------------------------------- weights
def load_weights(path: Union[str, Path], what: str, hint: str,
                 setting: str = "the reward's options") -> dict[str, torch.Tensor]:
    """A state dict from ``.safetensors`` or a torch pickle (``weights_only``), unwrapping
    ``{"state_dict": ...}`` / ``{"model": ...}`` and a DDP ``module.`` prefix. ``path`` is a local file or
    a hub file ``hf://ORG/NAME/FILE`` (read from the local Hugging Face cache, or downloaded:
    :func:`flowrl.utils.hub.hub_file`; ``setting`` names where it was given for its error)."""
    if is_hub_file(str(path)):
        path = hub_file(str(path), setting)
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"{what}: no file at {str(p)!r}. {hint}")
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file

        sd = load_file(str(p))
    else:
        try:
            sd = torch.load(str(p), map_location="cpu", weights_only=True)
        except Exception as e:  # pickle with arbitrary objects: refuse rather than execute it
            raise ValueError(f"{what}: {str(p)!r} is not a plain tensor state dict ({e}); "
                             "re-save it with torch.save(state_dict) or as .safetensors") from e
    for key in ("state_dict", "model"):
        if isinstance(sd, Mapping) and key in sd and isinstance(sd[key], Mapping):
            sd = sd[key]
    if not isinstance(sd, Mapping):
        raise ValueError(f"{what}: {str(p)!r} holds a {type(sd).__name__}, expected a state dict")
    return {(k[len("module."):] if k.startswith("module.") else k): v for k, v in sd.items()}


def from_pretrained(load: Callable, path_or_id: str, what: str, setting: str = "the reward's options", **kwargs):
    """``load(path_or_id)`` with an error that says what to pass when nothing is found; a hub id that is
    not cached and cannot be downloaded fails at once (:func:`flowrl.utils.hub.require_hub_model`),
    ``setting`` naming where it was given."""
    require_hub_model(path_or_id, f"the {what}", setting, kwargs.get("cache_dir"))
    try:
        return load(path_or_id, **kwargs)
    except OSError as e:
        raise OSError(
            f"could not load the {what} from {path_or_id!r}: pass a local directory made with "
            f"save_pretrained(), or a Hugging Face id already in the local cache (downloads are "
            f"off when HF_HUB_OFFLINE=1). Cause: {e}"
        ) from e


# ---------------------------------------------------------------- heads
class LinearMLPHead(nn.Module):
    """The improved-aesthetic-predictor MLP (also ImageReward's): five Linear layers with
    dropout and *no* activations, ``in_dim -> 1024 -> 128 -> 64 -> 16 -> 1``.

    ``layers.{0,2,4,6,7}`` are the Linear indices of the published state dicts.
    """

    def __init__(self, in_dim: int):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(in_dim, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).squeeze(-1)  # [B]

    @classmethod
    def from_state_dict(cls, sd: Mapping[str, torch.Tensor], what: str) -> "LinearMLPHead":
        if "layers.0.weight" not in sd:
            raise ValueError(f"{what}: expected MLP keys 'layers.0.weight' ... 'layers.7.bias', got {sorted(sd)[:6]}")
        head = cls(int(sd["layers.0.weight"].shape[1]))
        head.load_state_dict(dict(sd), strict=True)
        return head


# ---------------------------------------------------------------- transformers CLIP
class HFClip:
    """A transformers ``CLIPModel`` plus its processor's preprocessing, as unit-norm embeddings.

    ``model`` and ``processor`` are ``from_pretrained`` paths or ids (PickScore keeps its
    processor in a different repository than its weights). ``text=False`` skips the tokenizer.
    ``preprocess`` picks the image path's reference (:meth:`ImageTransform.from_hf`). ``setting`` and
    ``model_key``: where the user gave the ids (``reward.options.pickscore`` + ``model``), for errors.
    """

    def __init__(self, model: str, processor: Optional[str] = None, device: str = "cpu",
                 dtype: DTypeLike = "float32", text: bool = True, preprocess: str = "transformers",
                 setting: str = "reward.options.REWARD", model_key: str = "model"):
        transformers = require("transformers", "transformers")
        self.device, self.dtype = torch.device(device), resolve_dtype(dtype)
        src = processor or model
        src_key = f"{setting}.{'processor' if processor else model_key}"
        setting = f"{setting}.{model_key}"
        require_hub_model(model, "the CLIP model", setting)  # both before either loads
        require_hub_model(src, "the CLIP processor", src_key)
        self.model = from_pretrained(transformers.CLIPModel.from_pretrained, model, "CLIP model", setting)
        self.model = self.model.eval().requires_grad_(False).to(self.device, self.dtype)
        image_processor = from_pretrained(transformers.CLIPImageProcessor.from_pretrained, src, "CLIP image processor",
                                          src_key)
        self.transform = ImageTransform.from_hf(image_processor, preprocess)
        self.tokenizer = None
        if text:
            self.tokenizer = from_pretrained(transformers.AutoTokenizer.from_pretrained, src, "CLIP tokenizer", src_key)
        self.max_length = min(int(self.tokenizer.model_max_length) if text else 77,
                              int(self.model.config.text_config.max_position_embeddings))

    @torch.no_grad()
    def embed_images(self, images: torch.Tensor) -> torch.Tensor:
        """``[B, 3, H, W]`` in [0, 1] -> unit image embeddings ``[B, D]`` (on the model device)."""
        pixels = self.transform(images.to(self.device)).to(self.dtype)  # [B, 3, S, S]
        pooled = self.model.vision_model(pixel_values=pixels).pooler_output  # [B, Dv]
        emb = self.model.visual_projection(pooled).float()  # [B, D]
        return F.normalize(emb, dim=-1)

    @torch.no_grad()
    def embed_texts(self, prompts: Sequence[str]) -> torch.Tensor:
        """Prompts -> unit text embeddings ``[B, D]``; truncated to the model's 77 tokens."""
        if self.tokenizer is None:
            raise RuntimeError("this HFClip was built with text=False")
        tok = self.tokenizer(list(prompts), padding=True, truncation=True, max_length=self.max_length,
                             return_tensors="pt").to(self.device)
        out = self.model.text_model(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"])
        emb = self.model.text_projection(out.pooler_output).float()  # [B, D]
        return F.normalize(emb, dim=-1)

    @property
    def logit_scale(self) -> torch.Tensor:
        return self.model.logit_scale.detach().float().exp()


def scaled_cosine(clip: HFClip, images: torch.Tensor, prompts: Sequence[str], batch_size: int) -> torch.Tensor:
    """``logit_scale * cos(image_i, text_i)`` per pair, float32 [B] on CPU (CLIP's logits diagonal)."""
    out = []
    for s in chunks(images.shape[0], batch_size):
        cos = (clip.embed_images(images[s]) * clip.embed_texts(prompts[s])).sum(-1)  # [b]
        out.append((clip.logit_scale * cos).cpu())
    return torch.cat(out).float()


class ScaledCosineReward:
    """CLIP-family reward: ``logit_scale * cos(image, own prompt) / divisor`` per pair, float32 [B]
    on CPU (PickScore, CLIPScore); subclasses set ``name`` and their model defaults."""

    name = "scaled_cosine"

    def __init__(self, model: str, processor: Optional[str] = None, device: Device = "cpu", dtype: DTypeLike = "float32",
                 divisor: PositiveFloat = 1.0, batch_size: PositiveInt = 32, preprocess: Preprocess = "transformers"):
        if divisor <= 0:
            raise ValueError(f"divisor must be > 0, got {divisor}")
        self.clip = HFClip(model, processor, device=device, dtype=dtype, preprocess=preprocess,
                           setting=f"reward.options.{self.name}")
        self.divisor, self.batch_size = float(divisor), int(batch_size)

    def __call__(self, images: torch.Tensor, prompts: list[str], **meta) -> torch.Tensor:
        check_inputs(images, prompts, self.name)
        return scaled_cosine(self.clip, images, list(prompts), self.batch_size) / self.divisor  # [B]
