"""Full-size transformer architectures with random weights, for speed and memory only.

Each ``NAME-arch`` pipeline is a published model an adapter class declares (its ``published``
configs with ``arch`` set, ``pipelines/facts.py``): the transformer config is the hub repository's
own ``transformer/config.json`` (copied there, so no download is needed); the weights are diffusers'
random init, built directly on the device in the benchmark dtype. Text conditioning is random
embeddings of the real shapes (the adapter's ``example_conditioning``; no text encoders), the
transformer is called as the adapter calls it (``transformer_inputs``), and ``decode`` is a sigmoid
of three latent channels (no VAE): rewards computed on them are meaningless, so these pipelines
measure speed, memory and the quantized copies' numerics against full precision, never ranking
fidelity.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..pipelines.facts import ModelConfigs, build_component
from ..schedules import flow_sigmas
from ..seeding import seeded_randn
from .precision_policy import prompt_ids

TINY_TEXT_TOKENS = 8  # ``--tiny``: max_sequence_length of the shrunken model


def arch_models() -> dict[str, tuple[type, ModelConfigs]]:
    """``NAME-arch`` -> (adapter class, published configs): the ``published`` entries that name an
    ``arch``, each from the adapter class that declares it (a subclass inheriting them adds none;
    imports every adapter)."""
    from ..pipelines import available, policy_class

    out: dict[str, tuple[type, ModelConfigs]] = {}
    for name in available():
        cls = policy_class(name)
        for model in vars(cls).get("published", {}).values():
            if model.arch in out and out[model.arch][0] is not cls:
                raise ValueError(f"{cls.__name__} and {out[model.arch][0].__name__} both declare {model.arch!r}")
            if model.arch:
                out[model.arch] = (cls, model)
    return out


def arch_model(pipeline: str) -> tuple[type, ModelConfigs]:
    """The adapter class and published configs of ``pipeline`` (an ``arch`` name), or a ValueError naming them."""
    models = arch_models()
    if pipeline not in models:
        raise ValueError(f"unknown architecture {pipeline!r}; valid: {', '.join(sorted(models))}")
    return models[pipeline]


def build_transformer(adapter: type, config: dict, device: torch.device, dtype: torch.dtype, seed: int = 0,
                      options: Optional[dict] = None):
    """A random-init transformer of ``adapter`` (its ``transformer_component``) built on ``device`` in ``dtype``."""
    return build_component(adapter.transformer_component(config, options or {}), device, dtype, seed)


class ArchPolicy:
    """A ``FlowPolicy`` over a random-init full-size transformer (module doc).

    Args:
        pipeline: an architecture name (:func:`arch_models`, e.g. ``sd35m-arch``).
        resolution: image side in pixels (a multiple of the VAE factor x patch size).
        tiny: use the adapter's ``shrink_config`` (tests; the code path, not the size).
        options: ``model.options`` the adapter's geometry reads besides the resolution (a video model's
            ``num_frames``; default: the pipeline's).
    """

    def __init__(self, pipeline: str, resolution: int = 512, device: str | torch.device = "cuda",
                 dtype: torch.dtype = torch.bfloat16, tiny: bool = False, shift: float = 3.0,
                 guidance_scale: float = 3.5, options: Optional[dict] = None):
        self.adapter, self.model = arch_model(pipeline)
        self.config = self.adapter.shrink_config(self.model.transformer) if tiny else dict(self.model.transformer)
        self.options = {**(options or {}), **({"max_sequence_length": TINY_TEXT_TOKENS} if tiny else {})}
        self.device, self.dtype = torch.device(device), dtype
        self.transformer = build_transformer(self.adapter, self.config, self.device, dtype, options=self.options)
        self.shift, self.guidance_scale = shift, guidance_scale
        self.set_resolution(resolution)

    @property
    def family(self) -> str:
        """The adapter's pipeline name (``sd3``, ``flux``, ...)."""
        return self.adapter.kind

    @property
    def configs(self) -> ModelConfigs:
        return ModelConfigs(self.config, self.model.text_encoders, self.model.vae, self.model.source)

    def set_resolution(self, resolution: int) -> None:
        """Image side in pixels (a ValueError unless a multiple of the VAE factor x patch size)."""
        self.geometry = self.adapter.geometry(self.configs, {**self.options, "resolution": int(resolution)})
        self.resolution = int(resolution)
        self.latent_shape = self.geometry.latent_shape
        self.text_tokens = self.geometry.text_tokens

    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Random conditioning of the real shapes (the adapter's ``example_conditioning``), fixed per
        prompt: floating entries standard normal (entry i from seed stream i), masks all ones."""
        ids = prompt_ids(prompts)
        shapes = self.adapter.example_conditioning(self.configs, self.geometry, 1, "meta", self.dtype)
        out = {}
        for i, (k, t) in enumerate(shapes.items()):
            if t.is_floating_point():
                out[k] = seeded_randn(ids, tuple(t.shape[1:]), stream=i, device=self.device).to(self.dtype)  # [B, ...]
            else:
                out[k] = torch.ones(len(ids), *t.shape[1:], dtype=t.dtype, device=self.device)  # [B, ...]
        return out

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        """float32 velocity shaped like ``latents`` ``[B, C, h, w]`` of the transformer (whichever copy
        is swapped in), called as the adapter calls it."""
        b = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(b)  # [B]
        x = latents.to(self.device, self.dtype)  # [B, C, h, w]
        kw = self.adapter.transformer_inputs(self.config, self.dtype, x, sigma, cond,
                                             guidance_scale=self.guidance_scale)
        return self.adapter.transformer_output(self.transformer(**kw)[0], x).float()

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """No VAE: a sigmoid of the first three latent channels, ``[B, 3, h, w]`` in [0, 1]."""
        return torch.sigmoid(latents[:, :3].float())

    def initial_noise(self, seeds: list[int]) -> torch.Tensor:
        return seeded_randn(list(seeds), self.latent_shape, stream=0, device=self.device)  # [B, 16, h, w]

    def sigmas(self, num_steps: int) -> torch.Tensor:
        return flow_sigmas(num_steps, self.shift)

    def parameters_count(self) -> int:
        return sum(p.numel() for p in self.transformer.parameters())
