"""``flowrl train --smoke``: any recipe, checked on a CPU in a minute before GPU hours are spent on it.

The recipe keeps its structure (pipeline, sampler and its step type, loss, guidance, KL, EMA, LoRA
targets, sharding) and :func:`smoke_overrides` shrinks everything else:

- the model: the pipeline's tiny random model (``flowrl make-tiny``, cached in
  ``$FLOWRL_HOME/smoke/``), on the CPU in float32, the recipe's model options shrunk
  (:data:`MODEL_OPTIONS`: 32 px, 8 text tokens, 5 video frames, no gradient checkpointing; a pipeline's own
  values in :data:`PIPELINE_OPTIONS`);
- the sampler: the few steps and samples of its row in :data:`SAMPLERS` (a new sampler adds a row);
  Sol's exploration runs ``int8-dynamic`` (the recipes' NVFP4 needs CUDA);
- training: 1 iteration of 4 samples, one pass, a checkpoint; evaluation on one prompt; one process, so
  ``train.context_parallel`` is 1 (a context-parallel group needs several);
- reward: ``jpeg_compressibility`` (no download; the recipe's reward models need their weights); models an
  update's own options name are replaced as its ``smoke_overrides`` says (GARDO: JPEG rewards for its
  auxiliary ones, a tiny random DINOv2 for its features);
  an editing model (its adapter's ``max_sources``: :func:`editing_data`) edits the shipped
  ``digits-edit-sample`` set (one source per prompt) or ``digits-edit-multi-sample`` (one to three),
  rewarded by ``digits_edit``;
  a prompt set or reward given on the command line (``data.*``, ``reward.*``) is kept instead (a prompt
  set without source images then keeps the JPEG reward: ``digits_edit`` scores only edits);
- offline GDRO recipes (``train.mode: offline``): a dataset of 2 groups x 2 images is generated first.

Before any of that, :func:`check_real_inputs` reads what the real run would read (the recipe's prompt
files, the local files its rewards name) and holds the prompts against the model's and the rewards'
need of source images (:func:`flowrl.conditions.check_sources`): what fails the real run fails the
smoke run, in the same words.

Files besides the run (the dataset, a text-embedding cache) go to a temporary directory removed at
the end, never to the recipe's own cache paths, so the real run finds no stale cache.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Callable, Sequence

SMOKE_PIXELS = 32  # tiny diffusers models: 16 x 4 x 4 latents
PROMPTS = {"digits": ["a handwritten digit 3", "a handwritten digit 7"]}
DEFAULT_PROMPTS = ["a photo of a cat", "a red apple on a table"]
# recipe model.options -> its smoke value (only keys the recipe sets are changed)
MODEL_OPTIONS = {"resolution": SMOKE_PIXELS, "max_sequence_length": 8, "dtype": "float32",
                 "gradient_checkpointing": "false", "decode_batch": "null", "num_frames": 5,
                 "condition_area": SMOKE_PIXELS ** 2, "source_area": SMOKE_PIXELS ** 2}
# pipeline -> its own smoke values of MODEL_OPTIONS keys: FLUX.2 [dev]'s Mistral template opens with a system
# message of 32 tokens (tiny tokenizer), so 48 text tokens keep the prompt in the conditioning. (FLUX.2
# [klein] and Z-Image: Qwen3's template puts 3 tokens before the prompt; 8 keep it.)
PIPELINE_OPTIONS = {"flux2": {"max_sequence_length": 48}}
TRAIN = {"train.iterations": 1, "train.batch_size": 4, "train.minibatch_size": 64, "train.grad_accum": 1,
         "train.mixed_precision": "'no'", "train.checkpoint_every": 1, "train.ema_every": 1,
         "train.context_parallel": 1,
         "data.eval_seeds_per_prompt": 2, "reward.weights": "{jpeg_compressibility: 1.0}", "reward.options": "{}",
         "reward.heldout": "{}", "logging.trackers": "[]", "logging.eval_every": 100, "logging.image_every": 100}
# an editing model's smoke run trains on the shipped digits editing sets (instruction + source image rows),
# scored offline by digits_edit, which needs each row's sources: one per prompt, or one to three
EDITING = {"data.prompts": "digits-edit-sample", "data.eval_prompts": "digits-edit-sample",
           "reward.weights": "{digits_edit: 1.0}"}
MULTI_EDITING = {"data.prompts": "digits-edit-multi-sample", "data.eval_prompts": "digits-edit-multi-sample",
                 "reward.weights": "{digits_edit: 1.0}"}
# sections whose command-line overrides win over the smoke values: the user's own prompt set and reward
# (a reward that needs downloaded weights then fails as it would in the real run, with its message)
USER_SECTIONS = ("data", "reward")
OFFLINE = {"offline.groups_per_prompt": 1, "offline.k": 2, "offline.num_steps": 2, "offline.eval_steps": 2,
           "offline.batch_groups": 2, "offline.epochs": 1, "offline.max_steps": "null", "offline.eval_every": 100,
           "offline.generation_batch": 256, "offline.save_png": "false", "offline.judge": "{}"}


def _group(sampler: dict) -> dict:
    window = {"sde_window": 1, "window_start": 0} if sampler.get("sde_window") else {}  # an SDE window in 2 steps
    return {"group_size": 2, "num_steps": 2, "max_batch": "null", **window}


def _ode(sampler: dict) -> dict:  # 3 steps: a training time after the first (AWM's discrete_wo_init)
    return {**_group(sampler), "num_steps": 3}


def _branch(sampler: dict) -> dict:
    return {"num_steps": 3, "split_steps": "[0, 1]", "window": 2, "window_start": 0, "max_batch": "null"}


def _tempflow(sampler: dict) -> dict:
    return {"num_steps": 3, "branch_steps": "[0, 1]", "branches": 2, "seeds_per_prompt": 1, "max_batch": "null"}


def _sol(sampler: dict) -> dict:
    return {"pool_size": 4, "preview_steps": 2, "keep": 2, "regen_options.num_steps": 2,
            "explore_backend": "int8-dynamic", "explore_batch": "null"}


# sampler name -> its options shrunk (every row keeps train.batch_size = 4 a multiple of its samples per prompt)
SAMPLERS: dict[str, Callable[[dict], dict]] = {"group": _group, "ode": _ode, "branch": _branch,
                                               "tempflow": _tempflow, "sol": _sol}


def tiny_model(pipeline: str) -> Path:
    """The tiny random model of ``pipeline`` for smoke runs (built once, then reused from
    ``$FLOWRL_HOME/smoke/<kind>``; deterministic, seed 0)."""
    from .pipelines import policy_class
    from .pipelines.tiny import make_tiny
    from .errors import ConfigError
    from .utils.io import exclusive
    from .utils.paths import flowrl_home

    kinds = getattr(policy_class(pipeline), "tiny_kinds", ())
    if not kinds:
        raise ConfigError(f"--smoke needs a tiny model of pipeline {pipeline!r}, and its adapter declares none "
                          f"(tiny_kinds in pipelines/base.py)")
    out = flowrl_home() / "smoke" / kinds[0]
    if not (out.is_dir() and any(out.iterdir())):
        # one process builds it; another started at the same time waits, then finds it built
        with exclusive(out.parent / f".{out.name}.lock", f"building the tiny {kinds[0]} model into {out}"):
            if not (out.is_dir() and any(out.iterdir())):
                make_tiny(kinds[0], out, image_size=None if pipeline == "digits" else SMOKE_PIXELS, overwrite=True)
    return out


def editing_data(pipeline: str) -> dict:
    """The smoke data of an editing model, from its adapter's ``max_sources`` (source images per prompt):
    the multi-source sample for a model that takes several, the one-source sample for one, none for a
    text-to-image model."""
    from .pipelines import policy_class

    most = int(getattr(policy_class(pipeline), "max_sources", 0) or 0)
    return MULTI_EDITING if most > 1 else EDITING if most == 1 else {}


def smoke_overrides(cfg, model_dir: Path, scratch: Path, edits: bool = True) -> list[str]:
    """Overrides (applied after the user's) that shrink the recipe ``cfg`` as the module doc says;
    ``scratch`` is a temporary directory for a text-embedding cache; ``edits`` False: an editing model's
    smoke data and reward are left out (the user's prompt set has no source images)."""
    from .errors import ConfigError

    shrink = SAMPLERS.get(cfg.sampler.name)
    if shrink is None:
        raise ConfigError(f"--smoke knows the samplers {', '.join(sorted(SAMPLERS))}, not {cfg.sampler.name!r}: "
                          f"add its row to flowrl/smoke.py (SAMPLERS)")
    prompts = PROMPTS.get(cfg.model.pipeline, DEFAULT_PROMPTS)
    options = {**MODEL_OPTIONS, **PIPELINE_OPTIONS.get(cfg.model.pipeline, {})}
    ov = {"model.path": str(model_dir), "model.device": "cpu",
          **{f"model.options.{k}": v for k, v in options.items() if k in cfg.model.options},
          **{f"sampler.{k}": v for k, v in shrink(cfg.sampler.to_dict()).items()},
          **TRAIN, "data.prompts": f"[{', '.join(prompts)}]", "data.eval_prompts": f"[{prompts[0]}]",
          **(editing_data(cfg.model.pipeline) if edits else {})}
    if cfg.model.text_embedding_cache:  # never the recipe's own (relative, shared) cache directory
        ov["model.text_embedding_cache"] = str(scratch / "text-embeddings")
    if cfg.train.mode == "offline":
        ov.update(OFFLINE)
    ov.update(cfg.train.update_options.smoke_overrides(scratch))  # models the update's own options name
    return [f"{k}={v}" for k, v in ov.items()]


# reward options naming a file of weights or settings (checked to exist: the real run reads them)
MODEL_FILE_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt", ".onnx", ".json", ".yaml")


def smoke_data_hint(pipeline: str) -> str:
    """How to give the smoke run a prompt set of its own: a shipped sample that suits the model (an editing
    set for an editing model, whose smoke data need source images)."""
    edit_set = editing_data(pipeline).get("data.prompts")
    sample = f"{edit_set}, an editing set" if edit_set else "flowgrpo-pickscore-sample"
    return (f"give data.prompts=... data.eval_prompts=... on this command line (e.g. the shipped {sample}): "
            f"--smoke then checks and uses those")


def _names_a_local_file(value) -> bool:
    return isinstance(value, str) and (value.startswith(("/", "./", "../", "~")) or
                                       Path(value).suffix.lower() in MODEL_FILE_SUFFIXES)


def check_real_inputs(cfg) -> None:
    """What the real run of ``cfg`` reads before its first iteration, checked on this machine before the
    smoke sizes replace it (a ``ConfigError`` that says so): the prompt sets (``data.prompts``,
    ``data.eval_prompts``, read by the real loader) and the local files the rewards name
    (``reward.options``, ``reward.heldout``). An offline recipe's ``offline.dataset`` that does not exist
    yet gets a notice (``flowrl generate-offline`` writes it)."""
    from .conditions import check_sources
    from .data.prompts import PromptSetError
    from .errors import ConfigError

    rewards = [n for n, w in cfg.reward.weights.items() if w]
    for key, read in (("data.prompts", cfg.data.train_prompts), ("data.eval_prompts", cfg.data.eval_prompt_set)):
        try:
            prompts = read()
        except (PromptSetError, FileNotFoundError) as e:
            raise ConfigError(f"--smoke checks what the real run reads, and {key} fails: {e}; copy the file there, "
                              f"or {smoke_data_hint(cfg.model.pipeline)}") from None
        check_sources(cfg.model.pipeline, prompts, key, rewards)  # (the trainer says what a text-only run is)
    for section, spec in (("reward.options", cfg.reward.options), ("reward.heldout", cfg.reward.heldout)):
        for name, options in spec.items():
            for key, value in (options or {}).items():
                if _names_a_local_file(value) and not Path(value).expanduser().exists():
                    raise ConfigError(f"--smoke checks what the real run reads: {section}.{name}.{key}={value} is "
                                      f"no file here (building the {name} reward would fail); put the file there "
                                      f"or point the option at it")
    dataset = getattr(cfg.offline, "dataset", None) if cfg.train.mode == "offline" else None
    if dataset and not Path(dataset).is_dir():
        print(f"[flowrl] note: offline.dataset {dataset} does not exist yet; write it with `flowrl generate-offline "
              f"--config RECIPE` before the real run (the smoke run generates a tiny one of its own)",
              file=sys.stderr, flush=True)


def smoke_config(recipe: str, overrides: Sequence[str], scratch: Path) -> tuple:
    """(the smoke-sized config of ``recipe`` with the user's ``overrides``, all the overrides applied).
    The smoke sizes apply after the user's overrides, except in :data:`USER_SECTIONS`: a prompt set or
    reward given on the command line is what the smoke run uses (that is what it should check)."""
    from .conditions import has_items
    from .trainers.config import load_config
    from .trainers.config_text import override_key

    first = load_config(recipe, list(overrides))
    check_real_inputs(first)
    mine = {override_key(o) for o in overrides if override_key(o).split(".")[0] in USER_SECTIONS}
    # an editing model's smoke data and reward, unless the user's own prompt set has no source images
    edits = not _covered("data.prompts", mine) or has_items(first.data.train_prompts())
    ov = [*overrides, *(o for o in smoke_overrides(first, tiny_model(first.model.pipeline), scratch, edits)
                        if not _covered(override_key(o), mine))]
    return load_config(recipe, ov), ov


def _covered(key: str, keys: set[str]) -> bool:
    """Whether an override of ``key`` would overwrite (or be part of) one of ``keys``, a section or a key."""
    return any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in keys)


def smoke_run(recipe: str, output_dir: str, overrides: Sequence[str] = (), resume: bool = False) -> dict:
    """``flowrl train --smoke``: train the smoke-sized ``recipe`` into ``output_dir`` (an offline
    GDRO recipe generates its tiny dataset first); returns the run's summary plus ``smoke``."""
    from .trainers.config import load_config

    with tempfile.TemporaryDirectory(prefix="flowrl-smoke-") as tmp:
        scratch = Path(tmp)
        cfg, ov = smoke_config(recipe, overrides, scratch)
        print(f"[flowrl] smoke run of {recipe}: tiny random {cfg.model.pipeline} model ({cfg.model.path}), "
              f"{cfg.sampler.name} sampler shrunk, 1 iteration on the CPU, reward {dict(cfg.reward.weights)} "
              f"(flowrl/smoke.py)", file=sys.stderr, flush=True)
        if cfg.train.mode == "offline":
            from .trainers.offline import generate_offline, train

            generate_offline(cfg, str(scratch / "dataset"), progress=cfg.logging.progress)
            cfg = load_config(recipe, [*ov, f"offline.dataset={scratch / 'dataset'}"])
        else:
            from .trainers.online import train
        summary = train(cfg, output_dir, resume=resume)
    if not summary:  # a process other than the main one
        return summary
    return {**summary, "smoke": {"recipe": str(recipe), "model": cfg.model.path, "sampler": cfg.sampler.name}}
