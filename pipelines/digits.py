"""The embedded default: a tiny rectified-flow transformer on scikit-learn's digits.

Pixel space, 1 x 16 x 16 in [-1, 1] (the bundled 8 x 8 digits upsampled bilinearly), a real
diffusers ``SD3Transformer2DModel`` at toy size, and a small text encoder of its own
(no tokenizer download): prompts like ``"a handwritten digit 7"``. ``flowrl pretrain-digits``
trains it on CPU in a few minutes and caches it; at guidance 1.0 its samples are readable
but imperfect, so RL has room to improve (like CFG-free SD3).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from diffusers import SD3Transformer2DModel
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from flowrl.data.digits import DIGIT_WORDS, IMAGE_SIZE, digit_prompt, digits_dataset, parse_digit
from flowrl.options import Guidance, PositiveFloat, check_value
from flowrl.schedules import flow_sigmas
from flowrl.sde import flow_interpolate
from flowrl.seeding import seeded_randn
from flowrl.utils.io import atomic_dir, exclusive, write_json
from flowrl.utils.paths import default_cache_dir
from flowrl.utils.threads import use_cpu_threads

from .common import Schedule, cfg_combine, cfg_halves, transformer_dtype
from .facts import Component, Geometry, ModelConfigs, ModelFacts
from .mmdit import SD3TransformerFacts

PAD, OTHER = 0, 11  # token ids; digits are 1..10

# The digits data and prompts are flowrl.data.digits' (shared with the digits reward). The sample
# report (sample_grid_report) is flowrl.digits_report's: it samples with flowrl.rollout, a layer above.
__all__ = ["default_base_path", "tokenize", "DigitTextEncoder", "DigitsPolicy", "PretrainConfig", "pretrain_digits",
           "tiny_transformer_config", "load_digits_policy"]


def tokenize(prompts: list[str], max_len: int) -> torch.Tensor:
    """Word-level ids ``[B, max_len]``: digits (numeral or word) -> 1..10, other words -> 11, pad 0."""
    out = torch.zeros(len(prompts), max_len, dtype=torch.long)
    for b, p in enumerate(prompts):
        if not isinstance(p, str):
            raise TypeError(f"prompt {b} is {type(p).__name__}, expected str")
        ids = []
        for tok in re.findall(r"[a-z0-9]+", p.lower()):
            d = int(tok) if tok.isdigit() and len(tok) == 1 else (DIGIT_WORDS.index(tok) if tok in DIGIT_WORDS else None)
            ids.append(OTHER if d is None else d + 1)
        ids = ids[:max_len]
        out[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


def _rowwise_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` computed row by row (broadcast multiply + sum over the input dim), so a prompt's
    embedding does not depend on its batch-mates: a BLAS GEMM picks its blocking by the row count,
    which changes the last bits with the batch size on some CPUs, and the text-embedding cache
    promises bit-identical conditioning. x [..., in] -> [..., out]."""
    return (x.unsqueeze(-2) * layer.weight).sum(-1) + layer.bias  # [..., out]


class DigitTextEncoder(ModelMixin, ConfigMixin):
    """Token + position embeddings and a small MLP -> SD3-style conditioning.

    Returns ``encoder_hidden_states`` [B, L, joint_dim] and ``pooled_projections`` [B, pooled_dim]
    (mean over non-pad tokens; the empty prompt, used for guidance, maps to learned null vectors).
    """

    @register_to_config
    def __init__(self, vocab_size: int = 12, max_len: int = 8, joint_dim: int = 32, pooled_dim: int = 32):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, joint_dim)
        self.pos = nn.Parameter(torch.zeros(max_len, joint_dim))
        self.mlp = nn.Sequential(nn.Linear(joint_dim, joint_dim), nn.GELU(), nn.Linear(joint_dim, joint_dim))
        self.pool = nn.Linear(joint_dim, pooled_dim)
        self.null_pooled = nn.Parameter(torch.zeros(pooled_dim))

    def forward(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        ids = tokenize(prompts, self.config.max_len).to(self.pos.device)  # [B, L]
        mask = (ids != PAD).float().unsqueeze(-1)  # [B, L, 1]
        h = self.tok(ids) + self.pos  # [B, L, D]
        fc1, act, fc2 = self.mlp
        h = h + _rowwise_linear(fc2, act(_rowwise_linear(fc1, h)))
        n = mask.sum(1)  # [B, 1]
        pooled = _rowwise_linear(self.pool, (h * mask).sum(1) / n.clamp(min=1))  # [B, P]
        pooled = torch.where(n > 0, pooled, self.null_pooled.expand_as(pooled))
        return {"encoder_hidden_states": h * mask, "pooled_projections": pooled}


def tiny_transformer_config() -> dict:
    return dict(sample_size=IMAGE_SIZE, patch_size=2, in_channels=1, out_channels=1, num_layers=4,
                attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                caption_projection_dim=64, pooled_projection_dim=32, pos_embed_max_size=IMAGE_SIZE // 2)


class DigitsPolicy(SD3TransformerFacts, ModelFacts):
    """``FlowPolicy`` over the digits model. ``guidance_scale`` 1.0 = no CFG (one pass)."""

    # the adapter declarations of pipelines/base.py (no diffusers pipeline: the LoRA loads into the transformer)
    kind = "digits"
    pipeline_class = ""
    transformer_class = "SD3Transformer2DModel"
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    tiny_kinds = ("digits",)
    cond_keys = ("encoder_hidden_states", "pooled_projections")
    cfg_uncond_grad = True  # CFG in a differentiable forward: gradient through the unconditional half (base.py)

    # --- model facts (pipelines/facts.py): pixel space, no VAE, its own text encoder -----------
    @classmethod
    def model_configs(cls, path: Optional[str]) -> ModelConfigs:
        """The pretrained base's configs (``model.path`` unset or ``digits``: the code's own), or a
        directory's ``transformer/`` and ``text_encoder/`` configs."""
        te = "flowrl.pipelines.digits:DigitTextEncoder"
        if path in (None, "", "digits"):
            return ModelConfigs(tiny_transformer_config(), {"text_encoder": Component(te, {})}, None,
                                "digits base (flowrl pretrain-digits)", "digits")
        root = Path(os.path.expanduser(str(path)))
        if not (root / "transformer" / "config.json").is_file():
            raise ValueError(f"{path} is not a digits model directory (no transformer/config.json)")
        read = lambda d: {k: v for k, v in json.loads((root / d / "config.json").read_text()).items()  # noqa: E731
                          if not k.startswith("_")}
        return ModelConfigs(read("transformer"), {"text_encoder": Component(te, read("text_encoder"))}, None,
                            str(path), root.name)

    @classmethod
    def geometry(cls, configs: ModelConfigs, options: dict) -> Geometry:
        tokens = int(configs.text_encoders["text_encoder"].config.get("max_len", 8))
        return Geometry(IMAGE_SIZE, IMAGE_SIZE, (int(configs.transformer["in_channels"]), IMAGE_SIZE, IMAGE_SIZE),
                        tokens)

    @classmethod
    def example_conditioning(cls, configs, geometry, rows, device, dtype) -> dict[str, torch.Tensor]:
        c = configs.transformer
        return {"encoder_hidden_states": torch.empty(rows, geometry.text_tokens, c["joint_attention_dim"],
                                                     device=device, dtype=dtype),  # [B, L, D]
                "pooled_projections": torch.empty(rows, c["pooled_projection_dim"], device=device, dtype=dtype)}

    @classmethod
    def transformer_inputs(cls, config, dtype, x, sigma, cond, **settings) -> dict:
        """Pixels ``[B, 1, 16, 16]`` (already in the transformer's dtype), ``timestep = sigma * 1000``."""
        return dict(hidden_states=x, encoder_hidden_states=cond["encoder_hidden_states"],
                    pooled_projections=cond["pooled_projections"], timestep=sigma * 1000.0, return_dict=False)

    @classmethod
    def lora_writer(cls):
        from diffusers.loaders import SD3LoraLoaderMixin

        return SD3LoraLoaderMixin

    @classmethod
    def lora_load_hint(cls) -> str:
        return ("SD3Transformer2DModel.from_pretrained(BASE, subfolder='transformer')"
                ".load_lora_adapter(OUT, weight_name='pytorch_lora_weights.safetensors')")

    @classmethod
    def make_tiny(cls, kind: str, out_dir, *, image_size: int = IMAGE_SIZE, seed: int = 0, overwrite: bool = False):
        """A random-init 2-layer digits model (no pretraining: for mechanics, not quality) in ``out_dir``
        (2 layers: a 1-layer model has no text-stream output ``to_add_out``, a default LoRA target)."""
        from .base import write_atomically

        if image_size != IMAGE_SIZE:
            raise ValueError(f"the digits model is {IMAGE_SIZE} x {IMAGE_SIZE} pixels, got image_size={image_size}")
        torch.manual_seed(seed)
        policy = cls(SD3Transformer2DModel(**{**tiny_transformer_config(), "num_layers": 2}), DigitTextEncoder())
        return write_atomically(out_dir, policy.save_pretrained, overwrite=overwrite)

    def __init__(self, transformer: SD3Transformer2DModel, text_encoder: DigitTextEncoder,
                 guidance_scale: Guidance = 1.0, shift: PositiveFloat = 1.0, schedule: Schedule = "diffusers",
                 device: str | torch.device = "cpu"):
        options = type(self).declared_options()
        for name, value in (("guidance_scale", guidance_scale), ("shift", shift), ("schedule", schedule)):
            check_value(name, options[name], value)
        self.transformer = transformer.to(device)
        self.text_encoder = text_encoder.to(device).requires_grad_(False).eval()
        self.guidance_scale = float(guidance_scale)
        self.shift, self.schedule = float(shift), schedule
        self.device = torch.device(device)
        self.latent_shape = (1, IMAGE_SIZE, IMAGE_SIZE)
        self.lora_target_modules = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
                                    "to_add_out"]

    # --- loading -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **kwargs) -> "DigitsPolicy":
        cls.check_options(kwargs, kwargs.get("guidance_scale"), where="")
        path = Path(path)
        if not (path / "transformer").is_dir():
            raise FileNotFoundError(f"{path} is not a digits base model (no transformer/ inside). "
                                    f"Create one with `flowrl pretrain-digits --out {path}`.")
        tr = SD3Transformer2DModel.from_pretrained(path / "transformer")
        te = DigitTextEncoder.from_pretrained(path / "text_encoder")
        return cls(tr, te, **kwargs)

    def save_pretrained(self, path: str | os.PathLike) -> None:
        path = Path(path)
        self.transformer.save_pretrained(path / "transformer")
        self.text_encoder.save_pretrained(path / "text_encoder")

    # --- FlowPolicy ----------------------------------------------------------------------
    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            cond = self.text_encoder(list(prompts))
            if self.guidance_scale > 1.0:
                neg = self.text_encoder([""] * len(prompts))
                cond.update({f"neg_{k}": v for k, v in neg.items()})
        return cond

    def _forward(self, x, sigma, ehs, pooled):
        config = getattr(self.transformer, "module", self.transformer).config  # also under a DDP wrapper
        kw = self.transformer_inputs(config, self.dtype, x, sigma,
                                     {"encoder_hidden_states": ehs, "pooled_projections": pooled})
        return self.transformer(**kw)[0]

    @property
    def dtype(self) -> torch.dtype:
        """The (current) transformer's parameter dtype, read in O(1) (``pipelines.common.transformer_dtype``)."""
        return transformer_dtype(self.transformer)

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        """``v_theta(x_t, sigma)`` [B, 1, 16, 16]; with guidance, ``pipelines.common.cfg_halves``
        (one doubled batch (uncond, cond); the uncond half alone under ``no_grad`` when its gradient is off)."""
        x = latents.to(self.device, self.dtype)  # [B, 1, 16, 16]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).expand(x.shape[0])  # [B]
        if self.guidance_scale == 1.0:
            return self._forward(x, sigma, cond["encoder_hidden_states"], cond["pooled_projections"]).float()
        u, c = cfg_halves(self._forward, (x, sigma, cond["neg_encoder_hidden_states"], cond["neg_pooled_projections"]),
                          (x, sigma, cond["encoder_hidden_states"], cond["pooled_projections"]),
                          uncond_grad=self.cfg_uncond_grad)  # [B, 1, 16, 16] each
        return cfg_combine(u, c, self.guidance_scale, uncond_grad=self.cfg_uncond_grad)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        img = ((latents.float() + 1) / 2).clamp(0, 1)  # [B, 1, 16, 16]
        return img.expand(-1, 3, -1, -1).contiguous()  # [B, 3, 16, 16]

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, 16, 16]`` in [0, 1] -> latents ``[B, 1, 16, 16]`` in [-1, 1]: the grey level (decode's
        inverse), for training on image datasets."""
        if tuple(images.shape[1:]) != (3, IMAGE_SIZE, IMAGE_SIZE):
            raise ValueError(f"the digits model takes {IMAGE_SIZE} x {IMAGE_SIZE} images [B, 3, {IMAGE_SIZE}, "
                             f"{IMAGE_SIZE}], got {tuple(images.shape)}; resize the dataset's images")
        return (images.float().mean(dim=1, keepdim=True) * 2 - 1).to(self.device)  # [B, 1, 16, 16]

    def initial_noise(self, seeds: list[int]) -> torch.Tensor:
        return seeded_randn(list(seeds), self.latent_shape, stream=0, device=self.device)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        return flow_sigmas(num_steps, self.shift, self.schedule)

    def reference_images(self, prompts: list[str], per_prompt: int) -> Optional[torch.Tensor]:
        """Real digits (held-out split) for each prompt's digit, ``[len * per_prompt, 3, 16, 16]``:
        the real-data values beside which the trainer logs diversity and artifact energy."""
        x, y = digits_dataset("test")
        out = []
        for p in prompts:
            d = parse_digit(p)
            if d is None:
                return None
            out.append(x[y == d][:per_prompt])
        return self.decode(torch.cat(out))


# --- pretraining ---------------------------------------------------------------------------
@dataclass
class PretrainConfig:
    steps: int = 600
    batch_size: int = 64
    lr: float = 1e-3
    cond_dropout: float = 0.1
    seed: int = 0
    max_seconds: Optional[float] = None  # stop early after this wall time (a budget, not a target)

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1 or not self.lr > 0:
            raise ValueError(f"steps, batch_size and lr must be positive, got {self}")
        if not 0 <= self.cond_dropout < 1:
            raise ValueError(f"cond_dropout must be in [0, 1), got {self.cond_dropout}")


@torch.inference_mode(False)
@torch.enable_grad()
def pretrain_digits(out_dir: str | os.PathLike, config: PretrainConfig = PretrainConfig(),
                    progress: bool = True) -> dict:
    """Rectified-flow pretraining (``v = eps - x0``, logit-normal t, MSE) of the digits base.

    Gradients are on whatever the caller's mode (the base is pretrained on first use, which
    may happen inside ``torch.no_grad()``).

    Writes ``out_dir/{transformer,text_encoder}`` and ``pretrain.json`` atomically (into a
    temporary sibling, then renamed), and returns the summary dict.
    """
    from flowrl.utils.progress import progress as progress_bar

    torch.manual_seed(config.seed)
    x, y = digits_dataset("all")
    tr = SD3Transformer2DModel(**tiny_transformer_config())
    te = DigitTextEncoder()
    params = list(tr.parameters()) + list(te.parameters())
    use_cpu_threads(sum(p.numel() for p in params))  # under the command line: 1 thread for this small model
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * min(s, config.steps) / config.steps)))
    g = torch.Generator().manual_seed(config.seed)
    t0, losses = time.perf_counter(), []
    bar = progress_bar(range(config.steps), desc="pretrain digits", disable=not progress)
    step = 0
    for step in bar:
        idx = torch.randint(0, len(y), (config.batch_size,), generator=g)
        x0, labels = x[idx], y[idx]  # [B, 1, 16, 16], [B]
        drop = torch.rand(config.batch_size, generator=g) < config.cond_dropout
        prompts = ["" if dr else digit_prompt(int(l)) for l, dr in zip(labels, drop)]
        eps = torch.randn(x0.shape, generator=g)
        t = torch.sigmoid(torch.randn(config.batch_size, generator=g))  # logit-normal(0, 1), SD3
        xt = flow_interpolate(x0, eps, t.view(-1, 1, 1, 1))  # [B, 1, 16, 16]
        c = te(prompts)
        v = tr(hidden_states=xt, encoder_hidden_states=c["encoder_hidden_states"],
               pooled_projections=c["pooled_projections"], timestep=t * 1000.0, return_dict=False)[0]
        loss = F.mse_loss(v, eps - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 50 == 0:
            bar.set_postfix(loss=f"{sum(losses[-50:]) / len(losses[-50:]):.4f}")
        if config.max_seconds and time.perf_counter() - t0 > config.max_seconds:
            break
    summary = {"config": asdict(config), "steps_done": step + 1, "seconds": time.perf_counter() - t0,
               "final_loss": sum(losses[-100:]) / len(losses[-100:])}
    policy = DigitsPolicy(tr.eval(), te.eval())

    def write(tmp: Path) -> None:
        policy.save_pretrained(tmp)
        write_json(summary, tmp / "pretrain.json")

    atomic_dir(out_dir, write)  # the cached base appears whole or not at all
    return summary


def default_base_path() -> Path:
    return default_cache_dir() / "digits-base-v1"


@contextlib.contextmanager
def base_lock(path: str | os.PathLike):
    """Held while the digits base at ``path`` is pretrained (or re-measured): a second command started at
    the same time waits, says so, and then finds the cached base (``.<name>.lock`` beside it)."""
    p = Path(path)
    with exclusive(p.parent / f".{p.name}.lock", f"pretraining the digits base into {p}"):
        yield


def load_digits_policy(path: Optional[str] = None, pretrain_if_missing: bool = True, **kwargs) -> DigitsPolicy:
    """Load the digits base from ``path`` (default: the cache), pretraining it on first use (under
    :func:`base_lock`: one process pretrains, the others wait for it)."""
    p = Path(path) if path else default_base_path()
    if not (p / "transformer").is_dir() and pretrain_if_missing and path in (None, "", "digits"):
        with base_lock(p):
            if not (p / "transformer").is_dir():  # (another process may have written it while this one waited)
                print(f"[flowrl] no digits base model at {p}: pretraining one now (cached for later runs)")
                pretrain_digits(p)
    return DigitsPolicy.from_pretrained(p, **kwargs)
