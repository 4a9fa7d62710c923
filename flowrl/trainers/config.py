"""Run configuration: nested dataclasses validated on construction, YAML + dotted overrides.

``load_config("recipes/digits.yaml", ["train.lr=3e-4", "sampler.group_size=8"])`` -> :class:`Config`.
Every error names the offending key and says how to fix it, before any model is loaded.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional, Union

import yaml

from ..distributed.mesh import check_parallel_settings, cp_refusal
from ..distributed.strategy import SHARDINGS
from ..errors import ConfigError
from ..options import check_value, declared
from ..registry import SAMPLERS
from ..updates import DEFAULT_LOSS, MODE_ALIASES, UPDATES, loss_help, updates_by_input
from ..updates.base import build_options, incompatibility
from .config_base import SECTION_NAMES, _h
from .config_text import (_fix_floats, apply_overrides, keep_loss_options_of_new_loss, moved_key_hint, read_recipe,
                          upgrade_saved_config)
from .model_config import ModelConfig, compile_problem
from .offline_config import OfflineConfig

__all__ = ["Config", "ModelConfig", "SamplerConfig", "RewardConfig", "TrainConfig", "DataConfig", "LoggingConfig",
           "SECTIONS", "load_config", "load_run_config", "dump_config", "samples_per_prompt"]


@dataclass
class SamplerConfig:
    """``name`` plus the sampler's own keyword arguments (flat in YAML)."""

    name: str = _h("flowrl sampler: group, branch, tempflow, sol, ode (flat ODE groups: no stored transitions, so "
                   "an update on finished samples)", "group")
    options: dict = _h("keyword arguments of the sampler class", factory=dict)

    def __post_init__(self):
        try:
            SAMPLERS.check(self.name)
        except ValueError as e:
            raise ConfigError(f"sampler.name: {e}") from None
        sampler = self.build()  # validates the options now, before any model loads
        # what validation and batch accounting read, kept from this one build (not a config field)
        self.samples_per_prompt = int(sampler.samples_per_prompt)
        self.stores_transitions = bool(sampler.stores_transitions)
        self.flat_groups = bool(getattr(sampler, "flat_groups", True))  # False: a tree (branch, tempflow)

    def build(self):
        """The sampler, its options first held against its declaration (:func:`flowrl.options.check_options`:
        the dataclass fields' types and ranges), then its own cross-option checks (``__post_init__``)."""
        from flowrl.options import check_options, declared

        cls = SAMPLERS.get(self.name)
        options, is_open = declared(cls)
        try:
            check_options("sampler", f"the {self.name!r} sampler", options, self.options, open=is_open)
            return cls(**self.options)
        except (TypeError, ValueError) as e:
            msg = str(e)
            raise ConfigError(msg if msg.startswith("sampler.") else f"sampler ({self.name}): {msg}") from None

    @classmethod
    def from_dict(cls, d: dict) -> "SamplerConfig":
        d = dict(d)
        name = d.pop("name", "group")
        opts = dict(d.pop("options", {}) or {})
        opts.update(d)
        return cls(name=name, options=opts)

    def to_dict(self) -> dict:
        return {"name": self.name, **self.options}


@dataclass
class RewardConfig:
    weights: dict = _h("{reward name: weight} trained on (weighted sum)", factory=lambda: {"digits": 1.0})
    options: dict = _h("{reward name: {kwargs}} for the rewards' constructors", factory=dict)
    aggregate: str = _h("'sum': advantages (and rankings) of the weighted sum; 'per_reward': normalise each "
                        "reward within its group, then weight (MixGRPO advantage_aggr; every update and sampler, "
                        "docs/algorithms.md section 9)", "sum")
    heldout: dict = _h("{reward name: {kwargs}} logged on the evaluation set, never trained on; NAME@LABEL takes a "
                       "reward a second time with other options (geneval@official)", factory=dict)
    overlap: bool = _h("score each finished chunk of samples (sampler.max_batch) while the next one samples; "
                       "false: score after sampling, on the training thread (same rewards either way)", True)
    frame_stride: int = _h("videos: every image reward scores every n-th frame and averages per video", 1)

    def __post_init__(self):
        from flowrl.rewards import check_name
        from flowrl.rewards import check_options as check_reward_options

        if not isinstance(self.frame_stride, int) or isinstance(self.frame_stride, bool) or self.frame_stride < 1:
            raise ConfigError(f"reward.frame_stride must be a positive integer (score every n-th frame of a video), "
                              f"got {self.frame_stride!r}")

        if isinstance(self.weights, str):
            self.weights = {self.weights: 1.0}
        if not isinstance(self.weights, dict) or not self.weights:
            raise ConfigError("reward.weights must be a non-empty mapping {reward name: weight}, e.g. {digits: 1.0}")
        for where, names in (("reward.weights", self.weights), ("reward.heldout", self.heldout),
                             ("reward.options", self.options)):
            for n in names:
                try:
                    check_name(n)
                except ValueError as e:
                    raise ConfigError(f"{where}: {e}") from None
        for n, w in self.weights.items():
            if not isinstance(w, (int, float)) or isinstance(w, bool):
                raise ConfigError(f"reward.weights.{n} must be a number, got {w!r}")
        unused = [n for n in self.options if n not in self.weights]
        if unused:
            raise ConfigError(f"reward.options.{unused[0]}: {unused[0]!r} is not in reward.weights, so its options "
                              f"would be unused; add it to reward.weights (held-out rewards take theirs in "
                              f"reward.heldout) or drop the options")
        for where, spec in (("reward.options", {n: self.options.get(n) for n in self.weights}),
                            ("reward.heldout", self.heldout)):
            for n, opts in spec.items():  # each reward's declared options (flowrl.rewards.check_options)
                try:
                    check_reward_options(n, opts, f"{where}.{n}")
                except ValueError as e:
                    raise ConfigError(str(e)) from None
        if self.aggregate not in ("sum", "per_reward"):
            raise ConfigError(f"reward.aggregate must be 'sum' or 'per_reward', got {self.aggregate!r}")


@dataclass
class TrainConfig:
    """The ``train`` section. An update's own knobs are its ``Options`` (``train.loss_options``, see
    ``flowrl/updates/``), built once here (``update_options``, with what the update needs:
    ``update_needs``); the fields are shared by every update, grouped as below."""

    # --- what is trained on, and how long
    mode: str = _h("'online' (rollouts of the sampler section, section sampler), 'offline' (a dataset: from "
                   "`flowrl generate-offline`, section offline, or data.dataset) or 'sft' (offline with train.loss "
                   "sft: supervised flow matching on data.dataset)", "online")
    loss: Optional[str] = _h(loss_help(), None)  # every registered update, from its declaration
    loss_options: dict = _h("the update's own options (its Options dataclass in flowrl/updates/): e.g. "
                            "{clip_range: 1.0e-3, beta_kl: 0.04, kl_form: exact} for grpo, {beta: 1.0} for nft, "
                            "{beta: 12.0, tau: 0.05} for gdro; every update takes cfg_uncond_grad. See "
                            "docs/algorithms.md", factory=dict)
    iterations: int = _h("rollout -> update iterations (online)", 60)
    batch_size: int = _h("samples per iteration per process (per data-parallel replica under "
                         "train.context_parallel); a multiple of the sampler's samples per prompt", 64)
    seed: int = _h("seed of every random draw (prompts, noise, shuffles)", 0)
    # --- the optimizer and its accounting
    lr: float = _h("AdamW learning rate", 3e-4)
    weight_decay: float = _h("AdamW weight decay", 1e-4)
    warmup_iterations: int = _h("linear learning-rate warm-up, in iterations", 0)
    max_grad_norm: float = _h("gradient clipping (total L2 norm)", 1.0)
    minibatch_size: int = _h("transitions (samples) per forward/backward pass", 64)
    grad_accum: int = _h("minibatches per optimizer step", 1)
    inner_epochs: int = _h("passes over one iteration's transitions (online)", 1)
    mixed_precision: str = _h("'no', 'bf16' or 'fp16' (accelerate); CPU runs use 'no'", "no")
    # --- what is trained
    lora_rank: int = _h("LoRA rank; 0 = full fine-tune", 8)
    lora_alpha: float = _h("LoRA alpha", 16.0)
    lora_targets: Optional[list] = _h("module names LoRA adapts; empty = the pipeline's default", None)
    ema: bool = _h("keep an EMA of the trained weights, used for evaluation", False)
    ema_decay: float = _h("EMA decay per update", 0.9)
    ema_every: int = _h("EMA update interval in optimizer steps", 1)
    # --- distribution over processes
    sharding: str = _h("'none' (DDP: every process holds the whole model) or 'fsdp' (FSDP2: parameters, gradients "
                       "and optimizer states sharded per transformer block over the processes; checkpoints through "
                       "torch.distributed.checkpoint). See docs/cluster.md", "none")
    cpu_offload: bool = _h("= train.offload.fsdp: with sharding=fsdp, the shards, gradients and AdamW states in "
                           "CPU memory (FSDP2 CPUOffloadPolicy; for the largest models, at a speed cost)", False)
    context_parallel: int = _h("processes splitting every transformer forward's tokens (sampling and training; a "
                               "diffusers _cp_plan: FLUX, FLUX.2, Qwen-Image, Wan); processes / context_parallel "
                               "data-parallel replicas; 1 = off. See docs/cluster.md", 1)
    context_parallel_attention: str = _h("'auto' (Ulysses over gcd(heads, context_parallel), ring attention over "
                                         "the rest), 'ulysses' or 'ring'", "auto")
    offload: dict = _h("kept in host memory, each true/false: {fsdp, text_encoders, vae, reference, ema} "
                       "(flowrl/distributed/offload.py, docs/cluster.md)", factory=dict)
    # --- checkpoints and guards
    checkpoint_every: int = _h("write a checkpoint every N iterations (and at the end)", 20)
    keep_checkpoints: int = _h("keep the newest N checkpoints", 2)
    max_consecutive_skips: int = _h("stop after this many non-finite steps in a row", 5)

    def __post_init__(self):
        pos = ["iterations", "batch_size", "minibatch_size", "grad_accum", "inner_epochs", "checkpoint_every",
               "keep_checkpoints", "max_consecutive_skips", "ema_every"]
        for k in pos:
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"train.{k} must be a positive integer, got {v!r}")
        for k in ["lr", "max_grad_norm"]:
            v = getattr(self, k)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ConfigError(f"train.{k} must be a positive number, got {v!r}")
        if not isinstance(self.weight_decay, (int, float)) or self.weight_decay < 0:
            raise ConfigError(f"train.weight_decay must be a number >= 0, got {self.weight_decay!r}")
        if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ConfigError(f"train.lora_rank must be an integer >= 0 (0 = full fine-tune), got {self.lora_rank!r}")
        if self.lora_targets and self.lora_rank == 0:
            raise ConfigError("train.lora_targets names LoRA targets, but train.lora_rank=0 trains every weight "
                              "(no LoRA); set train.lora_rank > 0 or drop train.lora_targets")
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            raise ConfigError(f"train.mixed_precision must be 'no', 'bf16' or 'fp16', got {self.mixed_precision!r}")
        if not 0 <= self.ema_decay < 1:
            raise ConfigError(f"train.ema_decay must be in [0, 1), got {self.ema_decay}")
        if self.sharding not in SHARDINGS:
            raise ConfigError(f"train.sharding must be one of {', '.join(SHARDINGS)}, got {self.sharding!r}")
        if self.cpu_offload and self.sharding != "fsdp":
            raise ConfigError("train.cpu_offload=true needs train.sharding=fsdp (it offloads the FSDP shards)")
        check_parallel_settings(self)  # train.context_parallel*, train.offload (flowrl/distributed/)
        if self.sharding == "fsdp" and self.mixed_precision == "fp16":
            raise ConfigError("train.sharding=fsdp supports train.mixed_precision 'no' or 'bf16' (fp16 would need a "
                              "sharded GradScaler); use bf16")
        if self.mode not in DEFAULT_LOSS:
            raise ConfigError(f"train.mode must be one of {', '.join(DEFAULT_LOSS)}, got {self.mode!r}")
        if self.mode in MODE_ALIASES:  # a shorthand (sft: offline with train.loss sft)
            if self.loss not in (None, DEFAULT_LOSS[self.mode]):
                raise ConfigError(f"train.mode={self.mode} trains train.loss={DEFAULT_LOSS[self.mode]}; drop "
                                  f"train.loss={self.loss}, or set train.mode={MODE_ALIASES[self.mode]}")
            self.mode, self.loss = MODE_ALIASES[self.mode], DEFAULT_LOSS[self.mode]
        if self.warmup_iterations < 0:
            raise ConfigError(f"train.warmup_iterations must be >= 0, got {self.warmup_iterations}")
        if self.loss is None:
            self.loss = DEFAULT_LOSS[self.mode]
        try:
            UPDATES.check(self.loss)
        except ValueError as e:
            raise ConfigError(f"train.loss: {e}") from None
        cls = UPDATES.get(self.loss)
        try:  # the update's options, built once and checked before any model loads (not config fields)
            self.update_options = build_options(cls, self.loss, self.loss_options)
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e)) from None
        self.update_needs = cls.needs(self.update_options)  # what it needs: validation, the trainer and plan read it

    @property
    def update_class(self) -> type:
        """The ``Update`` class ``train.loss`` names."""
        return UPDATES.get(self.loss)


@dataclass
class DataConfig:
    prompts: Union[str, list] = _h("training prompts: a list, a .txt/.jsonl file, a saved Hugging Face dataset "
                                   "directory, or a shipped set (digits, flowgrpo-ocr-sample, "
                                   "flowgrpo-pickscore-sample, geneval-sample)", "digits")
    eval_prompts: Union[str, list] = _h("held-out evaluation prompts (same forms); fixed with fixed seeds", "digits")
    eval_seeds_per_prompt: int = _h("samples per evaluation prompt", 8)
    prompt_column: Optional[str] = _h("prompt field of a .jsonl file or Hugging Face dataset; empty = the first of "
                                      "prompt, caption, text", None)
    prompt_split: Optional[str] = _h("split of a saved Hugging Face DatasetDict for training prompts (default train)", None)
    eval_prompt_split: Optional[str] = _h("split of a saved DatasetDict for evaluation prompts (default train)", None)
    dataset: Optional[str] = _h("images with prompts (train.loss sft) or preference pairs (dpo_offline): a .jsonl "
                                "file or a folder (flowrl/data/image_sets.py), or 'digits' (scikit-learn's real "
                                "digits, training split)", None)
    source: str = _h("where to get the prompt files named here that flowrl cannot ship (free text); a missing "
                     "file's error quotes it, and --smoke notes it and goes on instead of failing", "")

    def __post_init__(self):
        if self.eval_seeds_per_prompt < 2:
            raise ConfigError(f"data.eval_seeds_per_prompt must be >= 2 (diversity needs pairs), got {self.eval_seeds_per_prompt}")

    def train_prompts(self) -> list[str]:
        """The training prompt set (``data.prompts``, read with the column/split options)."""
        return self._read(self.prompts, self.prompt_split)

    def eval_prompt_set(self) -> list[str]:
        """The evaluation prompt set (``data.eval_prompts``)."""
        return self._read(self.eval_prompts, self.eval_prompt_split)

    def eval_prompt_tags(self) -> Optional[list[str]]:
        """Each evaluation prompt's tag, in :meth:`eval_prompt_set`'s order (the same rows), when
        ``data.eval_prompts`` carries tags (a ``.jsonl`` set with a ``tag`` field, e.g. GenEval's), else None
        (:func:`flowrl.data.prompts.load_prompt_tags`)."""
        from flowrl.data.prompts import load_prompt_tags

        return None if self.eval_prompt_split else load_prompt_tags(self.eval_prompts)

    def _read(self, prompts, split) -> list[str]:
        from flowrl.data import load_prompts

        try:
            return load_prompts(prompts, self.prompt_column, split)
        except FileNotFoundError as e:
            if not self.source:
                raise
            raise FileNotFoundError(f"{e}. The recipe's prompt files come from (data.source): {self.source}") from None


@dataclass
class LoggingConfig:
    log_every: int = _h("metrics every N iterations", 1)
    eval_every: int = _h("evaluation set (rewards, diversity, artifacts) every N iterations", 10)
    image_every: int = _h("sample grid PNG every N iterations", 10)
    trackers: list = _h("accelerate trackers: tensorboard, wandb; [] = metrics.jsonl only", factory=lambda: ["tensorboard"])
    project: str = _h("tracker project name", "flowrl")
    progress: bool = _h("tqdm progress bar", True)

    def __post_init__(self):
        for k in ("log_every", "eval_every", "image_every"):
            if not isinstance(getattr(self, k), int) or getattr(self, k) < 1:
                raise ConfigError(f"logging.{k} must be a positive integer, got {getattr(self, k)!r}")
        bad = set(self.trackers) - {"tensorboard", "wandb"}
        if bad:
            raise ConfigError(f"logging.trackers: unknown {sorted(bad)}; valid: tensorboard, wandb")


SECTIONS = {"model": ModelConfig, "sampler": SamplerConfig, "reward": RewardConfig, "train": TrainConfig,
            "data": DataConfig, "logging": LoggingConfig, "offline": OfflineConfig}
if tuple(SECTIONS) != SECTION_NAMES:
    raise RuntimeError("flowrl.trainers.config_base.SECTION_NAMES must list the sections of Config, in order")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    offline: OfflineConfig = field(default_factory=OfflineConfig)

    def __post_init__(self):
        """Cross-section rules: what the update (``train.loss``) declares it needs against the mode, the
        sampler and the other settings (:func:`flowrl.updates.base.incompatibility`), and batch accounting."""
        t = self.train
        reason = incompatibility(t.update_needs, t.loss, mode=t.mode, sampler=self.sampler.name,
                                 stores_transitions=self.sampler.stores_transitions,
                                 aggregate=self.reward.aggregate, inner_epochs=t.inner_epochs,
                                 alternatives=updates_by_input(), rewards=tuple(self.reward.weights),
                                 flat_groups=self.sampler.flat_groups) or cp_refusal(self.model.pipeline, t)
        reason = reason or compile_problem(self.model.compile, t.sharding, t.context_parallel)
        if reason:
            raise ConfigError(reason)
        spp = self.sampler.samples_per_prompt
        if t.mode == "online" and t.batch_size % spp:
            raise ConfigError(f"train.batch_size={t.batch_size} is not a multiple of the sampler's "
                              f"{spp} samples per prompt (group size); use e.g. {max(1, t.batch_size // spp) * spp}")

    @property
    def prompts_per_iteration(self) -> int:
        """Prompts each process samples per iteration (online): ``train.batch_size`` over the sampler's
        samples per prompt (read from the sampler built at validation; nothing is rebuilt)."""
        return self.train.batch_size // self.sampler.samples_per_prompt

    def effective_loss_options(self) -> dict:
        """``train.loss_options`` with the update's defaults filled in (what training uses)."""
        return dataclasses.asdict(self.train.update_options)

    def to_dict(self) -> dict:
        out = {}
        for name in SECTIONS:
            sec = getattr(self, name)
            out[name] = sec.to_dict() if isinstance(sec, SamplerConfig) else dataclasses.asdict(sec)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        if not isinstance(d, dict):
            raise ConfigError(f"a recipe must be a mapping of sections {sorted(SECTIONS)}, got {type(d).__name__}")
        bad = set(d) - set(SECTIONS)
        if bad:
            k = sorted(bad)[0]
            close = difflib.get_close_matches(k, SECTIONS, n=1)
            raise ConfigError(f"unknown section {k!r}." + (f" Did you mean {close[0]!r}?" if close else "") +
                              f" Sections: {', '.join(SECTIONS)}")
        kw = {}
        for name, sec_cls in SECTIONS.items():
            raw = d.get(name) or {}
            if not isinstance(raw, dict):
                raise ConfigError(f"section {name!r} must be a mapping, got {raw!r}")
            if sec_cls is SamplerConfig:
                kw[name] = SamplerConfig.from_dict(raw)
                continue
            valid = {f.name for f in fields(sec_cls)}
            for k in raw:
                if k not in valid:
                    moved = moved_key_hint(f"{name}.{k}")
                    if moved:
                        raise ConfigError(f"unknown key {name}.{k}.{moved}")
                    close = difflib.get_close_matches(k, valid, n=1)
                    raise ConfigError(f"unknown key {name}.{k}." + (f" Did you mean {name}.{close[0]}?" if close else "")
                                      + f" Valid keys: {', '.join(sorted(valid))}")
            if name == "train" and raw.get("mixed_precision") is False:  # YAML reads a bare `no` as False
                raw = {**raw, "mixed_precision": "no"}
            if name == "model" and isinstance(raw.get("compile"), bool):  # YAML reads a bare `off` / `on` as a bool
                raw = {**raw, "compile": "default" if raw["compile"] else "off"}
            _check_types(name, sec_cls, raw)
            kw[name] = sec_cls(**raw)
        return cls(**kw)


def samples_per_prompt(sampler) -> int:
    """Finished samples a sampler makes per prompt (its group size)."""
    return int(sampler.samples_per_prompt)


def _check_types(section: str, cls, raw: dict) -> None:
    """A recipe value of the wrong type for its field (a string where a number belongs, ...): one line
    (the section's fields are its declaration, :mod:`flowrl.options`; null is left to the section's checks)."""
    declared_fields, _ = declared(cls)
    for k, v in raw.items():
        if v is not None:
            try:
                check_value(f"{section}.{k}", declared_fields[k], v)
            except ValueError as e:
                raise ConfigError(str(e)) from None


def load_config(path: Optional[Union[str, Path]] = None, overrides: Optional[list[str]] = None) -> Config:
    """Recipe YAML (or defaults when ``path`` is None) + dotted overrides -> validated Config.

    ``path`` is a YAML file, or the name of a shipped recipe (``digits``, ``digits.yaml`` or
    ``recipes/digits.yaml`` from any directory, also when flowrl is installed from a wheel).
    """
    d: dict = read_recipe(path) if path is not None else {}
    recipe_train = d.get("train") if isinstance(d.get("train"), dict) else {}
    recipe_loss = recipe_train.get("loss") or DEFAULT_LOSS.get(recipe_train.get("mode", "online"))  # before overrides
    d = _fix_floats(apply_overrides(d, overrides or []))
    keep_loss_options_of_new_loss(d, recipe_loss, overrides or [])
    return Config.from_dict(d)


def load_run_config(path: Union[str, Path], overrides: Optional[list[str]] = None) -> Config:
    """A run directory's saved ``config.yaml`` (``--resume``, ``flowrl sample --run``, ``flowrl export``),
    written by this or an earlier flowrl (:func:`flowrl.trainers.config_text.upgrade_saved_config`), plus
    dotted overrides -> validated Config."""
    try:
        d = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path} is not a flowrl config (a mapping of sections)")
    return Config.from_dict(_fix_floats(apply_overrides(upgrade_saved_config(d), overrides or [])))


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
