"""The ``offline`` section of a recipe: GDRO dataset generation and training (docs/algorithms.md §8).

Read by ``flowrl generate-offline`` (dataset, k, sampler, seeds, shards, PNGs) and by
``flowrl train`` when ``train.mode: offline`` (tau, beta, gamma, epochs, t sampling). The rest of
the recipe is shared with online training: ``model`` (the reference model and LoRA targets),
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
T_SAMPLING = ("uniform", "logit_normal")
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
    # --- GDRO training (flowrl train, train.mode: offline) -------------------------------
    tau: float = _h("temperature of the soft ranking targets softmax(r / tau); 0 = hard ranking (paper: 0.05)", 0.05)
    beta: float = _h("implicit-reward scale beta (paper: 12 for OCR, 6 for GenEval)", 12.0)
    gamma: float = _h("weight of the flow-matching regulariser on each group's top image (paper: 0.5 / 1.0)", 0.5)
    epochs: int = _h("passes over the dataset", 1)
    batch_groups: int = _h("groups per forward/backward pass per process (x k images; train.grad_accum "
                           "passes make one optimizer step)", 8)
    max_steps: Optional[int] = _h("stop after this many optimizer steps (default: epochs x steps per epoch)", None)
    t_sampling: str = _h("distribution of the shared noise level t: 'uniform' on [t_min, t_max] or "
                         "'logit_normal' (sigmoid of N(t_mean, t_std), clipped to [t_min, t_max])", "uniform")
    t_min: float = _h("smallest t", 0.02)
    t_max: float = _h("largest t", 0.98)
    t_mean: float = _h("logit-normal location", 0.0)
    t_std: float = _h("logit-normal scale", 1.0)
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
        if self.t_sampling not in T_SAMPLING:
            raise _error(f"offline.t_sampling must be one of {', '.join(T_SAMPLING)}, got {self.t_sampling!r}")
        if self.latent_dtype not in LATENT_DTYPES:
            raise _error(f"offline.latent_dtype must be one of {', '.join(LATENT_DTYPES)}, got {self.latent_dtype!r}")
        for name in ("tau", "beta", "gamma", "t_std"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise _error(f"offline.{name} must be a number >= 0, got {v!r}")
        if not self.beta > 0:
            raise _error(f"offline.beta must be > 0 (it scales the implicit rewards), got {self.beta}")
        if not 0 < self.t_min < self.t_max < 1:
            raise _error(f"offline.t_min / t_max must satisfy 0 < t_min < t_max < 1, got {self.t_min}, {self.t_max}")
        if not isinstance(self.judge, dict) or len(self.judge) > 1:
            raise _error(f"offline.judge must be empty or one {{reward name: {{kwargs}}}}, got {self.judge!r}")
        if self.judge:
            from flowrl.rewards import REGISTRY

            name = next(iter(self.judge))
            if name not in REGISTRY:
                raise _error(f"offline.judge: unknown reward {name!r}; valid rewards: {', '.join(sorted(REGISTRY))}")
        jr = self.judge_range
        if not (isinstance(jr, list) and len(jr) == 2 and all(isinstance(x, (int, float)) for x in jr) and jr[0] < jr[1]):
            raise _error(f"offline.judge_range must be [lo, hi] with lo < hi, got {jr!r}")

    def check_for_training(self) -> None:
        """Errors that only matter when training (``train.mode: offline``)."""
        if not self.dataset:
            raise _error("train.mode is 'offline' but offline.dataset is not set. Generate a dataset with "
                         "`flowrl generate-offline --config RECIPE --out DIR`, then set offline.dataset=DIR.")
