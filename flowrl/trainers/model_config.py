"""The ``model`` section of a recipe: the adapter and its options, the text-embedding cache, ``model.compile``.

It imports the shared field helper from ``config_base.py``, never ``config.py`` (which imports it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError
from ..utils.compile import check_mode
from .config_base import _h


@dataclass
class ModelConfig:
    pipeline: str = _h("a flowrl.pipelines.REGISTRY name, e.g. digits, sd3, flux (an unknown name lists them all)",
                       "digits")
    path: Optional[str] = _h("directory or hub id; digits: empty = the cached base, pretrained on first use; or a "
                             "flowrl run directory: its base with its newest checkpoint's trained weights fused in",
                             None)
    guidance_scale: float = _h("classifier-free guidance inside the policy (1.0 = none)", 1.0)
    device: str = _h("'auto' = the accelerator's device, or cpu / cuda:N", "auto")
    options: dict = _h("the adapter's own options (resolution, dtype, max_sequence_length, ...: each pipeline declares "
                       "its own, with types and ranges; an unknown key lists the valid ones)", factory=dict)
    text_embedding_cache: Optional[str] = _h("encode the fixed prompt sets once: 'memory', or a directory of "
                                             "safetensors shards (reused across runs); empty = encode every batch",
                                             None)
    drop_text_encoders: bool = _h("after caching, remove the text encoders from memory (needs "
                                  "text_embedding_cache; prompts outside the sets are then an error)", False)
    compile: str = _h("torch.compile the transformer forward of every rollout (sampling, Sol-RL's exploration copy "
                      "and regeneration, evaluation, flowrl sample / eval; training's forward and backward stay "
                      "eager): off, default, reduce-overhead (+ CUDA graphs), max-autotune, "
                      "max-autotune-no-cudagraphs. See docs/gpu_benchmark.md", "off")

    def __post_init__(self):
        from flowrl.pipelines import REGISTRY, policy_class

        try:  # (YAML's bare `off` / `on` became a mode when the recipe loaded: Config.from_dict)
            check_mode(self.compile)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.drop_text_encoders and not self.text_embedding_cache:
            raise ConfigError("model.drop_text_encoders=true needs model.text_embedding_cache ('memory' or a "
                              "directory): without cached embeddings the prompts could not be encoded")

        try:
            REGISTRY.check(self.pipeline)
        except ValueError as e:
            raise ConfigError(f"model.pipeline: {e}") from None
        if not self.guidance_scale >= 1.0:
            raise ConfigError(f"model.guidance_scale must be >= 1.0 (1.0 = no guidance), got {self.guidance_scale}")
        adapter = policy_class(self.pipeline)
        if adapter is not None:  # a registered loader that declares no adapter class: its options unchecked
            try:
                adapter.check_options(self.options, self.guidance_scale)
            except ValueError as e:
                raise ConfigError(str(e)) from None


def compile_problem(mode: str, sharding: str, context_parallel: int) -> Optional[str]:
    """Why ``model.compile`` cannot run with the train section's layout (None: it can)."""
    if mode != "off" and (sharding == "fsdp" or context_parallel > 1):
        return (f"model.compile={mode} with train.sharding={sharding}, train.context_parallel={context_parallel}: "
                f"compiling a sharded or token-split forward is not supported yet (untested); set model.compile=off")
    return None
