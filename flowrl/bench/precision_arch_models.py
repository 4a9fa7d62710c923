"""Full-size SD3.5 / FLUX transformer architectures with random weights, for speed and memory only.

The configs are the published ones (each model's ``transformer/config.json`` on the Hugging Face
hub, repeated here so no download is needed); the weights are diffusers' random init, built
directly on the device in the benchmark dtype. Text conditioning is random embeddings of the
real shapes (no text encoders), and ``decode`` is a sigmoid of three latent channels (no VAE):
rewards computed on them are meaningless, so these pipelines measure speed, memory and the
quantized copies' numerics against full precision, never ranking fidelity.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from ..schedules import flow_sigmas
from ..seeding import seeded_randn
from .precision_policy import prompt_ids

ARCH_PIPELINES = ("sd35m-arch", "sd35l-arch", "flux-arch")

# stabilityai/stable-diffusion-3.5-medium, transformer/config.json: 24 MMDiT-X blocks, the first 13 with a
# second (image-only) attention
SD35_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                   attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                   caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
                   dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")
# stabilityai/stable-diffusion-3.5-large, transformer/config.json: 38 blocks, 38 heads of 64 (2432 wide)
SD35_LARGE = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=38,
                  attention_head_dim=64, num_attention_heads=38, joint_attention_dim=4096,
                  caption_projection_dim=2432, pooled_projection_dim=2048, pos_embed_max_size=192,
                  qk_norm="rms_norm")
# black-forest-labs/FLUX.1-dev, transformer/config.json: 19 double + 38 single blocks, 24 heads of 128
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))


@dataclass(frozen=True)
class ArchSpec:
    """One architecture: diffusers class family, published config, text tokens, guidance."""

    title: str
    family: str  # "sd3" or "flux"
    config: dict
    text_tokens: int  # SD3: 77 CLIP + 256 T5 (the pipeline default); FLUX: 512 T5 (FLUX.1-dev default)
    source: str


ARCHS = {
    "sd35m-arch": ArchSpec("SD3.5-Medium", "sd3", SD35_MEDIUM, 77 + 256,
                           "stabilityai/stable-diffusion-3.5-medium transformer/config.json"),
    "sd35l-arch": ArchSpec("SD3.5-Large", "sd3", SD35_LARGE, 77 + 256,
                           "stabilityai/stable-diffusion-3.5-large transformer/config.json"),
    "flux-arch": ArchSpec("FLUX.1-dev", "flux", FLUX_DEV, 512, "black-forest-labs/FLUX.1-dev transformer/config.json"),
}


def tiny_config(pipeline: str) -> tuple[dict, int]:
    """A shrunken config of the same family (a CPU test hook: seconds in fp32) and its text tokens."""
    spec = ARCHS[pipeline]
    if spec.family == "flux":
        return dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
                    num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
                    guidance_embeds=True, axes_dims_rope=(4, 6, 6)), 8
    cfg = dict(sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
               num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=16,
               pos_embed_max_size=64, qk_norm="rms_norm")
    if "dual_attention_layers" in spec.config:
        cfg["dual_attention_layers"] = (0,)
    return cfg, 8


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def build_transformer(family: str, config: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random-init diffusers transformer built directly on ``device`` in ``dtype`` (no fp32 copy
    on the way: a 12B FLUX in bf16 needs 24 GB, in fp32 48 GB)."""
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    cls = SD3Transformer2DModel if family == "sd3" else FluxTransformer2DModel
    torch.manual_seed(seed)
    cfg = {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}
    with torch.device(device), _default_dtype(dtype):
        model = cls(**cfg)
    for m in model.modules():  # tensors created with an explicit fp32 dtype (e.g. the sin-cos position table)
        for store in (m._parameters, m._buffers):
            for k, t in store.items():
                if t is not None and t.is_floating_point() and t.dtype != dtype:
                    t.data = t.data.to(dtype)
    return model.eval().requires_grad_(False)


class ArchPolicy:
    """A ``FlowPolicy`` over a random-init full-size transformer (module doc).

    Args:
        pipeline: one of :data:`ARCH_PIPELINES`.
        resolution: image side in pixels (latents are ``resolution / 8`` a side, 16 channels).
        tiny: use :func:`tiny_config` (tests; the code path, not the size).
    """

    def __init__(self, pipeline: str, resolution: int = 512, device: str | torch.device = "cuda",
                 dtype: torch.dtype = torch.bfloat16, tiny: bool = False, shift: float = 3.0,
                 guidance_scale: float = 3.5):
        if pipeline not in ARCHS:
            raise ValueError(f"unknown architecture {pipeline!r}; valid: {', '.join(ARCH_PIPELINES)}")
        self.spec = ARCHS[pipeline]
        self.config, self.text_tokens = tiny_config(pipeline) if tiny else (dict(self.spec.config),
                                                                             self.spec.text_tokens)
        self.device, self.dtype = torch.device(device), dtype
        self.transformer = build_transformer(self.spec.family, self.config, self.device, dtype)
        self.shift, self.guidance_scale = shift, guidance_scale
        self.set_resolution(resolution)

    @property
    def family(self) -> str:
        return self.spec.family

    def set_resolution(self, resolution: int) -> None:
        """Image side in pixels: a multiple of 16 (8x VAE, 2x2 patches)."""
        if resolution % 16 or resolution < 16:
            raise ValueError(f"resolution must be a positive multiple of 16 pixels, got {resolution}")
        self.resolution = int(resolution)
        side = resolution // 8
        self.latent_shape = (16, side, side)
        self._img_ids: Optional[torch.Tensor] = None

    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Random embeddings of the real shapes, fixed per prompt: ``[B, L, joint_attention_dim]``, ``[B, P]``."""
        ids = prompt_ids(prompts)
        ehs = seeded_randn(ids, (self.text_tokens, self.config["joint_attention_dim"]), stream=0,
                           device=self.device)  # [B, L, D]
        pooled = seeded_randn(ids, (self.config["pooled_projection_dim"],), stream=1, device=self.device)  # [B, P]
        return {"encoder_hidden_states": ehs.to(self.dtype), "pooled_projections": pooled.to(self.dtype)}

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        """float32 ``[B, 16, h, w]`` velocity of the transformer (whichever copy is swapped in)."""
        b = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(b)  # [B]
        x = latents.to(self.device, self.dtype)  # [B, 16, h, w]
        ehs, pooled = cond["encoder_hidden_states"].to(self.dtype), cond["pooled_projections"].to(self.dtype)
        if self.family == "sd3":
            return self.transformer(hidden_states=x, timestep=sigma * 1000.0, encoder_hidden_states=ehs,
                                    pooled_projections=pooled, return_dict=False)[0].float()
        from ..pipelines.flux import latent_image_ids, pack_latents, unpack_latents

        h, w = x.shape[-2:]
        if self._img_ids is None or self._img_ids.shape[0] != (h // 2) * (w // 2):
            self._img_ids = latent_image_ids(h, w, self.device, self.dtype)  # [(h/2)(w/2), 3]
        txt_ids = torch.zeros(ehs.shape[1], 3, device=self.device, dtype=self.dtype)  # [L, 3]
        guidance = torch.full((b,), self.guidance_scale, dtype=torch.float32, device=self.device)  # [B]
        v = self.transformer(hidden_states=pack_latents(x), timestep=sigma, guidance=guidance,
                             pooled_projections=pooled, encoder_hidden_states=ehs, txt_ids=txt_ids,
                             img_ids=self._img_ids, return_dict=False)[0]  # [B, (h/2)(w/2), 64]
        return unpack_latents(v.float(), h, w)  # [B, 16, h, w]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """No VAE: a sigmoid of the first three latent channels, ``[B, 3, h, w]`` in [0, 1]."""
        return torch.sigmoid(latents[:, :3].float())

    def initial_noise(self, seeds: list[int]) -> torch.Tensor:
        return seeded_randn(list(seeds), self.latent_shape, stream=0, device=self.device)  # [B, 16, h, w]

    def sigmas(self, num_steps: int) -> torch.Tensor:
        return flow_sigmas(num_steps, self.shift)

    def parameters_count(self) -> int:
        return sum(p.numel() for p in self.transformer.parameters())
