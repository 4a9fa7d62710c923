"""What the embedded pixel-space worlds share (the ``digits`` and ``shapes`` models).

Each is a real diffusers ``SD3Transformer2DModel`` at toy size over pixels in [-1, 1] and a small
text encoder of its own (no tokenizer download), pretrained on the CPU by ``flowrl pretrain-<world>``
and cached at ``$FLOWRL_HOME/<world>-base-v1`` (under a lock; pretrained on first use). A world
declares its ``kind``, text encoder, pixel shape and transformer config on its subclass of
:class:`PixelFlowPolicy`, and its data as the ``draw`` function of :meth:`PixelFlowPolicy.pretrain`;
saving, loading, the velocity (with CFG), decoding, the tiny model, the model facts and the
pretraining loop are here, once.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from diffusers import SD3Transformer2DModel
from torch import nn

from flowrl.errors import ConfigError
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
from .pretrain_config import PretrainConfig

__all__ = ["rowwise_linear", "PixelFlowPolicy", "PretrainConfig", "base_lock", "LORA_TARGETS"]

LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
# a batch of the world's pretraining data: (generator, rows) -> (pixels [rows, C, S, S] in [-1, 1], prompts)
Draw = Callable[[torch.Generator, int], tuple[torch.Tensor, list[str]]]


def rowwise_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` computed row by row (broadcast multiply + sum over the input dim), so a prompt's
    embedding does not depend on its batch-mates: a BLAS GEMM picks its blocking by the row count,
    which changes the last bits with the batch size on some CPUs, and the text-embedding cache
    promises bit-identical conditioning. x [..., in] -> [..., out]."""
    return (x.unsqueeze(-2) * layer.weight).sum(-1) + layer.bias  # [..., out]


@contextlib.contextmanager
def base_lock(path: str | os.PathLike, kind: str):
    """Held while the ``kind`` base at ``path`` is pretrained (or re-measured): a second command started at
    the same time waits, says so, and then finds the cached base (``.<name>.lock`` beside it)."""
    p = Path(path)
    with exclusive(p.parent / f".{p.name}.lock", f"pretraining the {kind} base into {p}"):
        yield


class PixelFlowPolicy(SD3TransformerFacts, ModelFacts):
    """``FlowPolicy`` over an embedded pixel-space model. ``guidance_scale`` 1.0 = no CFG (one pass).
    A subclass declares ``kind`` (the pipeline and tiny kind), ``pretrain_verb``, ``base_dir``,
    ``text_encoder_class``, ``channels``, ``image_size``, ``pretrain_config``, ``report``,
    :meth:`transformer_config` and :meth:`pretrain_data`."""

    # the adapter declarations of pipelines/base.py (no diffusers pipeline: the LoRA loads into the transformer)
    kind = ""
    pretrain_verb = ""  # flowrl pretrain-<world>
    base_dir = ""  # the cached base's folder under $FLOWRL_HOME
    text_encoder_class: type = nn.Module
    channels, image_size = 1, 16
    pipeline_class = ""
    transformer_class = "SD3Transformer2DModel"
    lora_target_modules = LORA_TARGETS
    cond_keys = ("encoder_hidden_states", "pooled_projections")
    cfg_uncond_grad = True  # CFG in a differentiable forward: gradient through the unconditional half (base.py)

    pretrain_config = PretrainConfig  # its defaults are the world's pretraining
    earlier_bases: dict = {}  # an earlier cached base's folder -> its PretrainConfig (what a pretraining's init may name)
    report = ""  # "module:function(model_dir, force) -> dict": the base's cached sample report (a layer above)
    transformer_config: Callable[[], dict]  # the SD3Transformer2DModel config of the base (staticmethod)

    @classmethod
    def pretrain_data(cls, config: PretrainConfig) -> Draw:
        """The world's pretraining batches: ``draw(generator, rows) -> (pixels [rows, C, S, S], prompts)``."""
        raise NotImplementedError

    # --- model facts (pipelines/facts.py): pixel space, no VAE, its own text encoder -----------
    @classmethod
    def _text_encoder_ref(cls) -> str:
        return f"{cls.text_encoder_class.__module__}:{cls.text_encoder_class.__name__}"

    @classmethod
    def model_configs(cls, path: Optional[str]) -> ModelConfigs:
        """The pretrained base's configs (``model.path`` unset or the kind: the code's own), or a
        directory's ``transformer/`` and ``text_encoder/`` configs."""
        te = cls._text_encoder_ref()
        if path in (None, "", cls.kind):
            return ModelConfigs(cls.transformer_config(), {"text_encoder": Component(te, {})}, None,
                                f"{cls.kind} base (flowrl {cls.pretrain_verb})", cls.kind)
        root = Path(os.path.expanduser(str(path)))
        if not (root / "transformer" / "config.json").is_file():
            raise ValueError(f"{path} is not a {cls.kind} model directory (no transformer/config.json)")
        read = lambda d: {k: v for k, v in json.loads((root / d / "config.json").read_text()).items()  # noqa: E731
                          if not k.startswith("_")}
        return ModelConfigs(read("transformer"), {"text_encoder": Component(te, read("text_encoder"))}, None,
                            str(path), root.name)

    @classmethod
    def geometry(cls, configs: ModelConfigs, options: dict) -> Geometry:
        default = inspect.signature(cls.text_encoder_class.__init__).parameters["max_len"].default
        tokens = int(configs.text_encoders["text_encoder"].config.get("max_len", default))
        size = cls.image_size
        return Geometry(size, size, (int(configs.transformer["in_channels"]), size, size), tokens)

    @classmethod
    def example_conditioning(cls, configs, geometry, rows, device, dtype) -> dict[str, torch.Tensor]:
        c = configs.transformer
        return {"encoder_hidden_states": torch.empty(rows, geometry.text_tokens, c["joint_attention_dim"],
                                                     device=device, dtype=dtype),  # [B, L, D]
                "pooled_projections": torch.empty(rows, c["pooled_projection_dim"], device=device, dtype=dtype)}

    @classmethod
    def transformer_inputs(cls, config, dtype, x, sigma, cond, **settings) -> dict:
        """Pixels ``[B, C, S, S]`` (already in the transformer's dtype), ``timestep = sigma * 1000``."""
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
    def tiny_image_size(cls, default: int) -> int:
        """Pixels per side of the tiny model in a smoke run: the model's own :attr:`image_size` (a pixel model is
        built at one size only; ``default`` is ignored)."""
        return cls.image_size

    @classmethod
    def make_tiny(cls, kind: str, out_dir, *, image_size: Optional[int] = None, seed: int = 0,
                  overwrite: bool = False):
        """A random-init 2-layer model (no pretraining: for mechanics, not quality) in ``out_dir``
        (2 layers: a 1-layer model has no text-stream output ``to_add_out``, a default LoRA target)."""
        from .base import write_atomically

        size = cls.image_size if image_size is None else image_size
        if size != cls.image_size:
            raise ValueError(f"the {cls.kind} model is {cls.image_size} x {cls.image_size} pixels, "
                             f"got image_size={image_size}")
        torch.manual_seed(seed)
        policy = cls(SD3Transformer2DModel(**{**cls.transformer_config(), "num_layers": 2}),
                     cls.text_encoder_class())
        return write_atomically(out_dir, policy.save_pretrained, overwrite=overwrite)

    def __init__(self, transformer: SD3Transformer2DModel, text_encoder: nn.Module,
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
        self.latent_shape = (self.channels, self.image_size, self.image_size)
        self.lora_target_modules = list(LORA_TARGETS)

    # --- loading -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **kwargs) -> "PixelFlowPolicy":
        cls.check_options(kwargs, kwargs.get("guidance_scale"), where="")
        path = Path(path)
        if not (path / "transformer").is_dir():
            raise FileNotFoundError(f"{path} is not a {cls.kind} base model (no transformer/ inside). "
                                    f"Create one with `flowrl {cls.pretrain_verb} --out {path}`.")
        tr = SD3Transformer2DModel.from_pretrained(path / "transformer")
        te = cls.text_encoder_class.from_pretrained(path / "text_encoder")
        return cls(tr, te, **kwargs)

    def save_pretrained(self, path: str | os.PathLike) -> None:
        path = Path(path)
        self.transformer.save_pretrained(path / "transformer")
        self.text_encoder.save_pretrained(path / "text_encoder")

    @classmethod
    def default_base_path(cls) -> Path:
        return default_cache_dir() / cls.base_dir

    @classmethod
    def named_bases(cls) -> dict:
        """The cached bases a pretraining's ``init`` may name: folder -> its :class:`PretrainConfig` (the default
        base's and :attr:`earlier_bases`)."""
        return {cls.base_dir: cls.pretrain_config(), **cls.earlier_bases}

    @classmethod
    def init_path(cls, init: str, progress: bool = True) -> Path:
        """The base a pretraining's ``init`` names: a cached base of this world by its folder name (:meth:`named_bases`,
        pretrained into the cache first when missing, under :func:`base_lock`), else a directory holding a saved
        base (a one-line error otherwise)."""
        named = cls.named_bases()
        if init in named:
            p = default_cache_dir() / init
            cls._pretrain_missing(p, named[init], progress,
                                  f"pretraining the {cls.kind} base {init} into {p} first (continued from)")
            return p
        p = Path(init).expanduser()
        if not (p / "transformer").is_dir():
            known = ", ".join(named)
            raise ConfigError(f"init {init!r} is neither a saved {cls.kind} base (a directory with transformer/ and "
                              f"text_encoder/) nor a cached {cls.kind} base's name ({known}); give one of those")
        return p

    @classmethod
    def load_base(cls, path: Optional[str] = None, pretrain_if_missing: bool = True, **kwargs) -> "PixelFlowPolicy":
        """Load the base from ``path`` (default: the cache), pretraining it (:meth:`pretrain`) on first
        use (under :func:`base_lock`: one process pretrains, the others wait for it)."""
        p = Path(path) if path else cls.default_base_path()
        if pretrain_if_missing and path in (None, "", cls.kind):
            cls._pretrain_missing(p, None, True, f"no {cls.kind} base model at {p}: pretraining one now "
                                                 f"(cached for later runs)")
        return cls.from_pretrained(p, **kwargs)

    @classmethod
    def _pretrain_missing(cls, p: Path, config: Optional[PretrainConfig], progress: bool, note: str) -> None:
        """Pretrain a base into ``p`` with ``config`` (None: the world's) unless one is there, under
        :func:`base_lock`: one process pretrains, the others wait for it, then find it."""
        if (p / "transformer").is_dir():
            return
        with base_lock(p, cls.kind):
            if not (p / "transformer").is_dir():  # (another process may have written it while this one waited)
                print(f"[flowrl] {note}")
                cls.pretrain(p, config, progress)

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
        """``v_theta(x_t, sigma)`` [B, C, S, S]; with guidance, ``pipelines.common.cfg_halves``
        (one doubled batch (uncond, cond); the uncond half alone under ``no_grad`` when its gradient is off)."""
        x = latents.to(self.device, self.dtype)  # [B, C, S, S]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).expand(x.shape[0])  # [B]
        if self.guidance_scale == 1.0:
            return self._forward(x, sigma, cond["encoder_hidden_states"], cond["pooled_projections"]).float()
        u, c = cfg_halves(self._forward, (x, sigma, cond["neg_encoder_hidden_states"], cond["neg_pooled_projections"]),
                          (x, sigma, cond["encoder_hidden_states"], cond["pooled_projections"]),
                          uncond_grad=self.cfg_uncond_grad)  # [B, C, S, S] each
        return cfg_combine(u, c, self.guidance_scale, uncond_grad=self.cfg_uncond_grad)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Pixels ``[B, C, S, S]`` in [-1, 1] -> RGB ``[B, 3, S, S]`` in [0, 1] (grey: one channel repeated)."""
        img = ((latents.float() + 1) / 2).clamp(0, 1)  # [B, C, S, S]
        return img.expand(-1, 3, -1, -1).contiguous()  # [B, 3, S, S]

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, S, S]`` in [0, 1] -> latents ``[B, C, S, S]`` in [-1, 1] (decode's inverse; one
        channel: the grey level), for training on image datasets."""
        s = self.image_size
        if tuple(images.shape[1:]) != (3, s, s):
            raise ValueError(f"the {self.kind} model takes {s} x {s} images [B, 3, {s}, "
                             f"{s}], got {tuple(images.shape)}; resize the dataset's images")
        x = images.float().mean(dim=1, keepdim=True) if self.channels == 1 else images.float()  # [B, C, S, S]
        return (x * 2 - 1).to(self.device)

    def initial_noise(self, seeds: list[int]) -> torch.Tensor:
        return seeded_randn(list(seeds), self.latent_shape, stream=0, device=self.device)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        return flow_sigmas(num_steps, self.shift, self.schedule)

    # --- pretraining ---------------------------------------------------------------------
    @classmethod
    @torch.inference_mode(False)
    @torch.enable_grad()
    def pretrain(cls, out_dir: str | os.PathLike, config: Optional[PretrainConfig] = None, progress: bool = True) -> dict:
        """Rectified-flow pretraining (``v = eps - x0``, logit-normal t, MSE; SD3, arXiv:2403.03206) of
        the base on :meth:`pretrain_data`'s batches, the prompt dropped to ``""`` with ``config.cond_dropout`` (for CFG);
        with ``config.ema`` the weights' moving average is saved.

        Gradients are on whatever the caller's mode (the base is pretrained on first use, which
        may happen inside ``torch.no_grad()``). Writes ``out_dir/{transformer,text_encoder}`` and
        ``pretrain.json`` atomically (into a temporary sibling, then renamed); returns the summary dict.
        """
        from flowrl.utils.progress import progress as progress_bar

        config = config or cls.pretrain_config()
        start = cls.init_path(config.init, progress) if config.init else None  # pretrains an earlier base first
        torch.manual_seed(config.seed)
        draw = cls.pretrain_data(config)
        if start is None:
            tr, te = SD3Transformer2DModel(**cls.transformer_config()), cls.text_encoder_class()
        else:
            base = cls.from_pretrained(start)
            tr, te = base.transformer.train().requires_grad_(True), base.text_encoder.train().requires_grad_(True)
        params = list(tr.parameters()) + list(te.parameters())
        use_cpu_threads(sum(p.numel() for p in params))  # under the command line: 1 thread for a small model
        opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
        average = [p.detach().clone() for p in params] if config.ema else None  # the weights' moving average
        warm = max(config.warmup, 1)
        sched = torch.optim.lr_scheduler.LambdaLR(  # config.warmup warm-up steps, then cosine to 0
            opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, config.steps) / config.steps)))
        g = torch.Generator().manual_seed(config.seed)
        t0, losses = time.perf_counter(), []
        bar = progress_bar(range(config.steps), desc=f"pretrain {cls.kind}", disable=not progress)
        step = 0
        for step in bar:
            x0, prompts = draw(g, config.batch_size)  # [B, C, S, S], B prompts
            drop = torch.rand(config.batch_size, generator=g) < config.cond_dropout
            prompts = ["" if dr else p for p, dr in zip(prompts, drop)]
            eps = torch.randn(x0.shape, generator=g)
            t = torch.sigmoid(torch.randn(config.batch_size, generator=g) + config.t_mean)  # logit-normal(t_mean, 1), SD3
            xt = flow_interpolate(x0, eps, t.view(-1, 1, 1, 1))  # [B, C, S, S]
            c = te(prompts)
            v = tr(hidden_states=xt, encoder_hidden_states=c["encoder_hidden_states"],
                   pooled_projections=c["pooled_projections"], timestep=t * 1000.0, return_dict=False)[0]
            loss = F.mse_loss(v, eps - x0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            if average is not None:
                decay = min(config.ema, (1 + step) / (10 + step))
                with torch.no_grad():
                    for a, p in zip(average, params):
                        a.lerp_(p, 1 - decay)
            losses.append(loss.item())
            if step % 50 == 0:
                bar.set_postfix(loss=f"{sum(losses[-50:]) / len(losses[-50:]):.4f}")
            if config.max_seconds and time.perf_counter() - t0 > config.max_seconds:
                break
        summary = {"config": asdict(config), "steps_done": step + 1, "seconds": time.perf_counter() - t0,
                   "final_loss": sum(losses[-100:]) / len(losses[-100:])}
        if average is not None:  # the saved base is the average (config.ema)
            with torch.no_grad():
                for p, a in zip(params, average):
                    p.copy_(a)
        policy = cls(tr.eval(), te.eval())

        def write(tmp: Path) -> None:
            policy.save_pretrained(tmp)
            write_json(summary, tmp / "pretrain.json")

        atomic_dir(out_dir, write)  # the cached base appears whole or not at all
        return summary
