"""Offline GDRO training (docs/algorithms.md §8): stream reference-model groups from a dataset, rank by reward,
update through implicit rewards; no sampler in the loop.

``flowrl generate-offline`` writes the dataset (:func:`generate_offline`), ``flowrl train`` with
``train.mode: offline`` (``train.loss: offline_gdro``) trains on it (:class:`OfflineTrainer`). The loop,
run directory, checkpoints, resume, metrics and evaluation are the online trainer's
(:class:`flowrl.trainers.trainer.Trainer`, ``flowrl.builders.evaluate_policy``), so runs of both
kinds compare point for point.

Accounting: one *step* is one optimizer step. Each step takes ``offline.batch_groups`` groups
per process per forward/backward pass, ``train.grad_accum`` passes per step, from the epoch's
shuffled group order (``OfflineDataset.epoch_order(train.seed, epoch)``); the groups that do not
fill a last step are left out of that epoch (another order next epoch). A pass's loss is the
mean over its groups of ``PL + gamma * FM(top image)``, divided by ``grad_accum``.
Every random draw (data order, the shared ``(t, eps)`` of each group) depends only on
``(train.seed, step, pass, rank)``: a resumed run continues exactly where it stopped.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Optional

import torch

from ..builders import build_policy_from_config, build_reward, build_rewards
from ..conditions import check_sources
from ..data.embeddings import attach_text_cache
from ..data.group_export import export_images, export_pairs
from ..data.image_sets import open_image_set
from ..data.offline import GenerationSettings, add_reward_column, generate_dataset
from ..data.offline_store import DatasetError, OfflineDataset
from ..errors import ConfigError
from ..rollout.ode import ode_sample
from ..scoring import score_images
from ..utils.paths import resolve_device
from .config import Config
from .trainer import Trainer

# keys that may change between a run and its resume without changing its trajectory
RESUME_FREE = {"train.iterations", "train.checkpoint_every", "train.keep_checkpoints", "logging", "model.device",
               "model.compile",
               "data.source",
               "model.path", "train.max_consecutive_skips", "offline.epochs", "offline.max_steps",
               "offline.eval_every", "offline.eval_steps", "offline.judge", "offline.judge_range", "sampler",
               "offline.dataset", "data.dataset", "offline.generation_batch", "offline.save_png", "offline.score_heldout",
               "reward.heldout", "data.eval_prompts", "data.eval_seeds_per_prompt", "model.text_embedding_cache",
               "model.drop_text_encoders", "data.eval_prompt_split", "train.cpu_offload",
               "train.offload", "train.context_parallel", "train.context_parallel_attention"}


# ---------------------------------------------------------------- dataset generation (CLI glue)
def generation_settings(cfg: Config) -> GenerationSettings:
    o = cfg.offline
    return GenerationSettings(k=o.k, groups_per_prompt=o.groups_per_prompt, sampler=o.sampler, num_steps=o.num_steps,
                              seed=o.seed, groups_per_shard=o.groups_per_shard, generation_batch=o.generation_batch,
                              latent_dtype=o.latent_dtype, save_png=o.save_png)


def dataset_rewards(cfg: Config) -> dict:
    """name -> reward callable for every reward stored at generation: ``reward.weights`` (with
    ``reward.options``) and, with ``offline.score_heldout``, ``reward.heldout``."""
    out = dict(build_reward(cfg).rewards)
    if cfg.offline.score_heldout:
        out.update(build_rewards({k: v for k, v in cfg.reward.heldout.items() if k not in out}))
    return out


def _device(cfg: Config):
    return resolve_device(cfg.model.device)


def model_description(cfg: Config) -> dict:
    return {"pipeline": cfg.model.pipeline, "path": cfg.model.path, "guidance_scale": cfg.model.guidance_scale,
            "options": dict(cfg.model.options)}


def generate_offline(cfg: Config, out: Optional[str] = None, max_new_shards: Optional[int] = None,
                     progress: bool = True, policy=None, rewards: Optional[dict] = None) -> dict:
    """``flowrl generate-offline``: the reference model's groups for ``data.prompts`` into ``out``
    (default ``offline.dataset``); resumes an interrupted dataset. Returns a summary dict."""
    out = out or cfg.offline.dataset
    if not out:
        raise ConfigError("generate-offline needs a dataset directory: --out DIR (or offline.dataset=DIR)")
    prompts = cfg.data.train_prompts()
    note = check_sources(cfg.model.pipeline if policy is None else policy, prompts, "data.prompts",
                         [n for n, w in cfg.reward.weights.items() if w] if rewards is None else [])
    if note:
        print(f"[flowrl] note: {note}", file=sys.stderr, flush=True)
    settings = generation_settings(cfg)
    rewards = rewards if rewards is not None else dataset_rewards(cfg)
    if policy is None:
        policy = build_policy_from_config(cfg, _device(cfg))
        policy = attach_text_cache(policy, cfg.model, prompts, progress=progress)  # model.text_embedding_cache, if set
    policy.transformer.requires_grad_(False)
    idx = generate_dataset(out, policy, prompts, rewards, settings, sample=ode_sample, score=score_images,
                           model=model_description(cfg), max_new_shards=max_new_shards, progress=progress,
                           frame_stride=cfg.reward.frame_stride)
    ds = OfflineDataset(out)
    summary = {"dataset": str(out), "groups": len(ds), "groups_planned": len(prompts) * settings.groups_per_prompt,
               "k": ds.k, "shards": len(idx["shards"]), "rewards": ds.reward_names,
               "generation_seconds": idx["generation_seconds"], "reward_seconds": idx["reward_seconds"],
               "model_evals": idx["model_evals"]}
    for name in ds.reward_names:
        col = ds.column(name)
        fin = col[torch.isfinite(col)]
        summary[f"reward_mean/{name}"] = float(fin.mean()) if len(fin) else float("nan")
    ds.close()
    return summary


def dataset_policy(dataset: str, cfg: Optional[Config] = None):
    """The model that decodes a dataset's latents: ``cfg``'s, or without one the model its index names."""
    from flowrl.pipelines import build_policy

    if cfg is not None:
        return build_policy_from_config(cfg, _device(cfg))
    ds = OfflineDataset(dataset)
    m = ds.spec.get("model") or {}
    ds.close()
    if "pipeline" not in m:
        raise ConfigError(f"{dataset}: the index does not name its model; pass --config RECIPE to decode latents")
    return build_policy(m["pipeline"], m.get("path"), guidance_scale=m.get("guidance_scale", 1.0),
                        device=resolve_device("auto"), **(m.get("options") or {}))


def make_pairs(dataset: str, out: str, reward: str, cfg: Optional[Config] = None, keep_ties: bool = False) -> dict:
    """``flowrl make-pairs``: ``out/pairs.jsonl`` for ``train.loss: dpo_offline`` from a ``generate-offline``
    dataset, each group's best vs worst image by its column ``reward`` (:func:`flowrl.data.group_export.export_pairs`)."""
    policy = dataset_policy(dataset, cfg)
    dev = getattr(policy, "device", torch.device("cpu"))
    with torch.no_grad():
        return export_pairs(dataset, out, reward, lambda x: policy.decode(x.to(dev)).float().cpu(),
                            keep_ties=keep_ties)


def image_set_from_groups(cfg: Config, dataset: str, out: str) -> str:
    """What ``cfg``'s update reads (``Needs.data``), made from the ``generate-offline`` dataset ``dataset``: the
    dataset itself (groups), its pairs by the first reward of ``reward.weights`` (ties kept), or its images,
    written into ``out``; returns the path to give (``--smoke`` trains on it)."""
    kind = cfg.train.update_needs.data
    if kind == "groups":
        return dataset
    if kind == "pairs":
        return make_pairs(dataset, out, next(iter(cfg.reward.weights)), cfg, keep_ties=True)["path"]
    policy = dataset_policy(dataset, cfg)
    with torch.no_grad():
        return export_images(dataset, out, lambda x: policy.decode(x.to(policy.device)).float().cpu())["path"]


def rescore_offline(dataset: str, reward_name: str, options: Optional[dict] = None, cfg: Optional[Config] = None,
                    overwrite: bool = False, progress: bool = True) -> dict:
    """``flowrl rescore-offline``: add column ``reward/<reward_name>`` to a dataset without
    regenerating it. Latents are decoded by the model in ``cfg`` or, without one, the model the
    dataset was generated with (its index)."""
    from flowrl.rewards import build

    policy = dataset_policy(dataset, cfg)
    reward = build(reward_name, **(options or {}))
    dev = getattr(policy, "device", torch.device("cpu"))
    t0 = time.perf_counter()
    add_reward_column(dataset, reward_name, reward, lambda x: policy.decode(x.to(dev)), overwrite=overwrite,
                      progress=progress, frame_stride=cfg.reward.frame_stride if cfg is not None else 1,
                      score=score_images)
    ds = OfflineDataset(dataset)
    col = ds.column(reward_name)
    fin = col[torch.isfinite(col)]
    out = {"dataset": str(dataset), "column": f"reward/{reward_name}", "groups": len(ds),
           "mean": float(fin.mean()) if len(fin) else float("nan"), "seconds": time.perf_counter() - t0}
    ds.close()
    return out


# ---------------------------------------------------------------- evaluation: the corrected score
def corrected_score(r: torch.Tensor, quality: torch.Tensor, judge_range: list) -> torch.Tensor:
    """GDRO's reward-hacking-corrected score (arXiv 2601.02036, docs/algorithms.md §8): ``r * (u - 3) + 0.2``
    with ``u = lo + q * (hi - lo)`` the second judge's quality ``q`` in [0, 1] mapped to
    ``judge_range`` (paper: [1, 5]). ``r``, ``quality`` [N] -> [N]."""
    lo, hi = float(judge_range[0]), float(judge_range[1])
    u = lo + quality.float() * (hi - lo)
    return r.float() * (u - 3.0) + 0.2


# ---------------------------------------------------------------- the trainer
class OfflineTrainer(Trainer):
    """``OfflineTrainer(config, output_dir, resume=False, *, policy=None, reward=None).train()`` -> summary dict.

    The shared loop (:class:`~flowrl.trainers.trainer.Trainer`) over optimizer steps of the dataset
    ``offline.dataset``. The run directory holds what an online run holds (``config.yaml``,
    ``metrics.jsonl``, ``checkpoints/iter_NNNNNN`` by optimizer step, ``samples/eval_*.png``,
    ``reward_curve.png``, ``before_after.png``, ``summary.json``); the summary adds the dataset's
    generation seconds so ``compute_seconds`` is generation + training.
    """

    RESUME_FREE = RESUME_FREE
    unit = "step"
    stop_causes = "train.loss_options.beta too large, "
    progress_desc = "flowrl gdro"
    extend_hint = "raise offline.max_steps (or offline.epochs)"

    def __init__(self, config: Config, output_dir: str | os.PathLike, resume: bool = False, *, policy=None,
                 reward=None):
        if config.train.update_needs.data == "groups":
            config.offline.check_for_training()
        elif not config.data.dataset:
            raise ConfigError(f"train.loss={config.train.loss} trains on data.dataset, which is not set; give a "
                              f".jsonl file or a folder ({config.train.update_needs.data}; docs/algorithms.md)")
        super().__init__(config, output_dir, resume, policy=policy, reward=reward)

    # ---------------------------------------------------------------- the data
    def _open_data(self) -> None:
        cfg = self.cfg
        kind = cfg.train.update_needs.data  # what the update declares it reads
        if kind != "groups":  # images / pairs of data.dataset (flowrl.data.image_sets)
            self.ds = open_image_set(kind, cfg.data.dataset)
            return
        ds = OfflineDataset(cfg.offline.dataset)
        missing = [n for n in cfg.reward.weights if n not in ds.reward_names]
        if missing:
            raise DatasetError(f"the dataset {cfg.offline.dataset} has no reward column {missing[0]!r} that "
                               f"reward.weights trains on (it has {ds.reward_names or 'none'}). Add it without "
                               f"regenerating: `flowrl rescore-offline --dataset {cfg.offline.dataset} "
                               f"--reward {missing[0]}`.")
        if ds.k != cfg.offline.k:
            raise ConfigError(f"offline.k={cfg.offline.k} but the dataset {cfg.offline.dataset} holds groups of "
                              f"k={ds.k}; set offline.k={ds.k}")
        m = ds.spec.get("model", {})
        if m.get("pipeline") not in (None, cfg.model.pipeline):
            raise ConfigError(f"the dataset was generated with pipeline {m.get('pipeline')!r}, the recipe trains "
                              f"{cfg.model.pipeline!r}; GDRO needs the dataset's reference model")
        self.ds = ds

    def _setup_data(self) -> list[str]:
        cfg = self.cfg
        self.per_step = cfg.offline.batch_groups * cfg.train.grad_accum * self.strategy.layout.dp_size
        self.steps_per_epoch = len(self.ds) // self.per_step
        if self.steps_per_epoch == 0:
            raise ConfigError(f"the dataset has {len(self.ds)} groups, fewer than one optimizer step takes "
                              f"(offline.batch_groups={cfg.offline.batch_groups} x train.grad_accum="
                              f"{cfg.train.grad_accum} x {self.strategy.layout.dp_size} data-parallel replicas); lower those or "
                              f"generate more groups (offline.groups_per_prompt)")
        self.total_steps = cfg.offline.epochs * self.steps_per_epoch
        if cfg.offline.max_steps:
            self.total_steps = min(self.total_steps, cfg.offline.max_steps)
        self.judge = build_rewards(cfg.offline.judge)
        self.train_seconds = 0.0
        return list(self.ds.prompts)

    def total_units(self) -> int:
        return self.total_steps

    @property
    def eval_every(self) -> int:
        return self.cfg.offline.eval_every

    @property
    def eval_steps(self) -> int:
        return self.cfg.offline.eval_steps or self.cfg.offline.num_steps

    def checkpoint_state(self) -> dict:
        return {"train_seconds": self.train_seconds, "dataset_groups": len(self.ds)}

    def restore_state(self, ck: dict) -> None:
        st = ck["state"]
        if int(st.get("dataset_groups", len(self.ds))) != len(self.ds):
            raise ConfigError(f"--resume: the dataset {self.cfg.offline.dataset} now holds {len(self.ds)} groups, "
                              f"the run started with {st['dataset_groups']}; its data order would change. "
                              f"Resume with the same dataset or start a new --output-dir.")
        self.train_seconds = float(st.get("train_seconds", 0.0))

    def report_title(self) -> str:
        return f"{self.cfg.model.pipeline} / {self.cfg.train.loss} (offline)"

    def summary_fields(self, last: int) -> dict:
        gen = self.ds.generation_seconds
        return {"steps_done": last, "total_steps": self.total_steps, "steps_per_epoch": self.steps_per_epoch,
                "epochs_done": last / self.steps_per_epoch, "dataset": str(self.ds.root),
                "dataset_groups": len(self.ds), "generation_seconds": gen, "train_seconds": self.train_seconds,
                "compute_seconds": gen + self.train_seconds}

    def progress_postfix(self, met: dict) -> dict:
        return {"loss": f"{met.get('loss', float('nan')):.3f}", "acc": f"{met.get('top1_accuracy', float('nan')):.2f}"}

    def close(self) -> None:
        self.ds.close()

    # ---------------------------------------------------------------- one step
    def step_groups(self, step: int) -> list[torch.Tensor]:
        """This process's group ids for optimizer step ``step``: ``grad_accum`` tensors of
        ``batch_groups`` ids (a deterministic function of (train.seed, step))."""
        epoch, pos = divmod(step, self.steps_per_epoch)
        if getattr(self, "_order", (None,))[0] != epoch:
            self._order = (epoch, self.ds.epoch_order(self.cfg.train.seed, epoch))
        order = self._order[1]
        chunk = order[pos * self.per_step:(pos + 1) * self.per_step]  # [per_step]
        ga, bg = self.cfg.train.grad_accum, self.cfg.offline.batch_groups
        chunk = chunk.view(ga, self.strategy.layout.dp_size, bg)[:, self.strategy.layout.dp_rank]  # [ga, bg]
        return list(chunk)

    def run_unit(self, i: int) -> tuple[dict, None]:
        return self.run_step(i), None

    def run_step(self, step: int) -> dict:
        """One optimizer step (``grad_accum`` passes) -> metrics."""
        t0 = time.perf_counter()
        passes = self.step_groups(step)
        stats, _ = self.train_on(passes, step)
        self.sched.step()
        dt = time.perf_counter() - t0
        self.train_seconds += dt
        return {"iteration": step, **stats, "epoch": step // self.steps_per_epoch, "lr": self.sched.get_last_lr()[0],
                "skipped_steps": self.steps.skipped, "step_seconds": dt, "train_seconds": self.train_seconds,
                "groups_trained": len(passes) * self.cfg.offline.batch_groups * self.strategy.layout.dp_size}

    # ---------------------------------------------------------------- evaluation: the corrected score
    @torch.no_grad()
    def extend_evaluation(self, met: dict, images: torch.Tensor) -> None:
        """With ``offline.judge``: the second judge's quality and the corrected score ``r * (u - 3) + 0.2``;
        and the training seconds so far."""
        o = self.cfg.offline
        for name, judge in self.judge.items():
            k = self.cfg.data.eval_seeds_per_prompt
            prompts = [p for p in self.eval_prompts for _ in range(k)]
            r, _ = score_images(self.reward, images, prompts, frame_stride=self.cfg.reward.frame_stride)
            q, _ = score_images(judge, images, prompts, frame_stride=self.cfg.reward.frame_stride)
            corr = corrected_score(r, q, o.judge_range)
            ok = torch.isfinite(corr)
            met[f"eval/judge/{name}"] = float(q[torch.isfinite(q)].mean()) if torch.isfinite(q).any() else float("nan")
            met["eval/reward_corrected"] = float(corr[ok].mean()) if ok.any() else float("nan")
        met["train_seconds"] = self.train_seconds


def train(config: Config, output_dir: str | os.PathLike, resume: bool = False) -> dict:
    """Run offline GDRO training; returns the summary (also in ``output_dir/summary.json``)."""
    return OfflineTrainer(config, output_dir, resume=resume).train()
