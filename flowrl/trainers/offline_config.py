"""The ``offline`` section of a recipe: GDRO dataset generation and offline training (docs/algorithms.md §8).

Read by ``flowrl generate-offline`` (dataset, k, sampler, seeds, shards, PNGs) and by
``flowrl train`` when ``train.mode: offline`` (epochs, batches, evaluation, the judge). The GDRO
loss's own knobs (beta, tau, gamma, the t distribution) are the update's options,
``train.loss_options`` of ``train.loss: offline_gdro`` (:mod:`flowrl.updates.offline_gdro`). The rest
of the recipe is shared with online training: ``model`` (the reference model and LoRA targets),
``reward`` (the ranking reward: ``reward.weights`` over the dataset's reward columns),
``train`` (lr, LoRA, grad_accum, checkpoints, seed), ``data.eval_prompts`` and ``logging``.

It imports the shared ``ConfigError`` and field helper from ``config_base.py``, never ``config.py``
(which imports it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .config_base import _h
from ..errors import ConfigError

SAMPLERS = ("euler", "heun")
LATENT_DTYPES = ("float32", "bfloat16", "float16")


def _error(msg: str) -> Exception:
    return ConfigError(msg)


@dataclass
class OfflineConfig:
    # --- the dataset (flowrl generate-offline) -------------------------------------------
    dataset: Optional[str] = _h("dataset directory (index.json + safetensors shards); written by "
                                "`flowrl generate-offline`, read by `flowrl train` in offline mode", None)
    k: int = _h("images per prompt group (GDRO paper: 6)", 6)
    groups_per_prompt: int = _h("groups generated per prompt of data.prompts (each with its own k seeds); "
                                "may be raised later to grow a dataset", 1)
    sampler: str = _h("deterministic sampler of the reference model: 'euler' (ODE) or 'heun' (2nd order)", "euler")
    num_steps: int = _h("sampler steps used to generate the dataset", 20)
    seed: int = _h("seed from which every group's k sample seeds derive (group g: SeedSequence([seed, g]))", 0)
    groups_per_shard: int = _h("groups per safetensors shard (the unit written atomically and resumed)", 64)
    generation_batch: int = _h("images per sampler forward pass during generation (memory)", 256)
    latent_dtype: str = _h("dtype x0 latents are stored in: float32, bfloat16 or float16", "float32")
    save_png: bool = _h("also write every image as PNG under <dataset>/png/", False)
    score_heldout: bool = _h("store reward.heldout rewards as dataset columns too (besides reward.weights)", True)
    # --- offline training (flowrl train, train.mode: offline; the loss's knobs: train.loss_options) ----
    epochs: int = _h("passes over the dataset", 1)
    batch_groups: int = _h("groups per forward/backward pass per process (x k images; train.grad_accum "
                           "passes make one optimizer step)", 8)
    max_steps: Optional[int] = _h("stop after this many optimizer steps (default: epochs x steps per epoch)", None)
    eval_every: int = _h("online evaluation (fixed prompts and seeds, ODE) every N optimizer steps", 10)
    eval_steps: Optional[int] = _h("ODE steps of the evaluation (default: num_steps)", None)
    # --- corrected score (reward hacking, docs/algorithms.md §8) ----------------------------------------
    judge: dict = _h("{reward name: {kwargs}}: a second judge giving quality q in [0, 1]; when set, "
                     "evaluation reports r_corr = r * (u - 3) + 0.2 with u = lo + q * (hi - lo)", factory=dict)
    judge_range: list = _h("[lo, hi]: the quality scale u of the corrected score (paper: 1-5)",
                           factory=lambda: [1.0, 5.0])

    def __post_init__(self):
        pos = ["k", "groups_per_prompt", "num_steps", "groups_per_shard", "generation_batch", "epochs",
               "batch_groups", "eval_every"]
        for name in pos:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise _error(f"offline.{name} must be a positive integer, got {v!r}")
        if self.k < 2:
            raise _error(f"offline.k must be >= 2 (a group of one has no ranking), got {self.k}")
        for name in ("max_steps", "eval_steps"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise _error(f"offline.{name} must be a positive integer or null, got {v!r}")
        if self.sampler not in SAMPLERS:
            raise _error(f"offline.sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}")
        if self.latent_dtype not in LATENT_DTYPES:
            raise _error(f"offline.latent_dtype must be one of {', '.join(LATENT_DTYPES)}, got {self.latent_dtype!r}")
        if not isinstance(self.judge, dict) or len(self.judge) > 1:
            raise _error(f"offline.judge must be empty or one {{reward name: {{kwargs}}}}, got {self.judge!r}")
        if self.judge:
            from flowrl.rewards import REGISTRY

            try:
                REGISTRY.check(next(iter(self.judge)))
            except ValueError as e:
                raise _error(f"offline.judge: {e}") from None
        jr = self.judge_range
        if not (isinstance(jr, list) and len(jr) == 2 and all(isinstance(x, (int, float)) for x in jr) and jr[0] < jr[1]):
            raise _error(f"offline.judge_range must be [lo, hi] with lo < hi, got {jr!r}")

    def check_for_training(self) -> None:
        """Errors that only matter when training (``train.mode: offline``)."""
        if not self.dataset:
            raise _error("train.mode is 'offline' but offline.dataset is not set. Generate a dataset with "
                         "`flowrl generate-offline --config RECIPE --out DIR`, then set offline.dataset=DIR.")
