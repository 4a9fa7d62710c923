"""``flowrl train --smoke``: any recipe, checked on a CPU in a minute before GPU hours are spent on it.

The recipe keeps its structure (pipeline, sampler and its step type, loss, guidance, KL, EMA, LoRA
targets, sharding) and :func:`smoke_overrides` shrinks everything else:

- the model: the pipeline's tiny random model (``flowrl make-tiny``, cached in
  ``$FLOWRL_HOME/smoke/``), on the CPU in float32, the recipe's model options shrunk
  (:data:`MODEL_OPTIONS`: 32 px, 8 text tokens, 5 video frames, no gradient checkpointing; an adapter's own
  values in its ``smoke_model_options``);
- the sampler: the few steps and samples its ``smoke_options`` declares (``flowrl/rollout/base.py``; Sol's
  exploration runs ``int8-dynamic``: the recipes' NVFP4 needs CUDA);
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
- offline recipes (``train.mode: offline`` / ``sft``): a dataset of 2 groups x 2 images is generated first (for
  ``sft`` / ``dpo_offline``, its images or its pairs become ``data.dataset``).

Before any of that, :func:`check_real_inputs` reads what the real run would read (the recipe's prompt
files, the files its rewards name) and holds the prompts against the model's and the rewards' need of
source images (:func:`flowrl.conditions.check_sources`): what fails the real run fails the smoke run, in
the same words, except the data a recipe says it cannot ship (``data.source``: where to get it), which gets
one note. So every shipped recipe's ``--smoke`` runs from a fresh clone: their reward weights are hub files
(``hf://...``, downloaded by the real run), and their prompt files are a shipped set or say where to get them.

Files besides the run (the dataset, a text-embedding cache) go to a temporary directory removed at
the end, never to the recipe's own cache paths, so the real run finds no stale cache.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Collection, Sequence

from .utils.hub import is_hub_file

SMOKE_PIXELS = 32  # tiny diffusers models: 16 x 4 x 4 latents
PROMPTS = {"digits": ["a handwritten digit 3", "a handwritten digit 7"],
           "shapes": ["a photo of a red circle and a blue square", "a photo of two triangles"]}
DEFAULT_PROMPTS = ["a photo of a cat", "a red apple on a table"]
# recipe model.options -> its smoke value (only keys the recipe sets are changed; an adapter's own values of these
# keys: its smoke_model_options, e.g. FLUX.2 [dev]'s 48 text tokens)
MODEL_OPTIONS = {"resolution": SMOKE_PIXELS, "max_sequence_length": 8, "dtype": "float32",
                 "gradient_checkpointing": "false", "decode_batch": "null", "num_frames": 5,
                 "condition_area": SMOKE_PIXELS ** 2, "source_area": SMOKE_PIXELS ** 2}
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


def yaml_value(value) -> str:
    """A Python value as the YAML of a dotted override (JSON is YAML: ``null``, ``[0, 1]``, ``true``)."""
    return json.dumps(value)


def sampler_smoke_options(sampler) -> dict[str, str]:
    """``KEY -> YAML`` that shrink ``sampler``: a built sampler (its ``smoke_options`` declaration), or a
    registered sampler's name (built with its defaults)."""
    if isinstance(sampler, str):
        from .registry import SAMPLERS

        sampler = SAMPLERS.get(sampler)()
    return {k: yaml_value(v) for k, v in sampler.smoke_options().items()}


def tiny_model(pipeline: str) -> Path:
    """The tiny random model of ``pipeline`` for smoke runs (built once, then reused from
    ``$FLOWRL_HOME/smoke/<kind>``; deterministic, seed 0)."""
    from .pipelines import policy_class
    from .pipelines.tiny import make_tiny
    from .errors import ConfigError
    from .utils.io import exclusive
    from .utils.paths import flowrl_home

    cls = policy_class(pipeline)
    kinds = getattr(cls, "tiny_kinds", ())
    if not kinds:
        raise ConfigError(f"--smoke needs a tiny model of pipeline {pipeline!r}, and its adapter declares none "
                          f"(tiny_kinds in pipelines/base.py)")
    out = flowrl_home() / "smoke" / kinds[0]
    if not (out.is_dir() and any(out.iterdir())):
        # one process builds it; another started at the same time waits, then finds it built
        with exclusive(out.parent / f".{out.name}.lock", f"building the tiny {kinds[0]} model into {out}"):
            if not (out.is_dir() and any(out.iterdir())):
                make_tiny(kinds[0], out, image_size=cls.tiny_image_size(SMOKE_PIXELS), overwrite=True)
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
    from .pipelines import policy_class

    prompts = PROMPTS.get(cfg.model.pipeline, DEFAULT_PROMPTS)
    options = {**MODEL_OPTIONS, **getattr(policy_class(cfg.model.pipeline), "smoke_model_options", {})}
    ov = {"model.path": str(model_dir), "model.device": "cpu",
          **{f"model.options.{k}": v for k, v in options.items() if k in cfg.model.options},
          **{f"sampler.{k}": v for k, v in sampler_smoke_options(cfg.sampler.build()).items()},
          **TRAIN, "data.prompts": f"[{', '.join(prompts)}]", "data.eval_prompts": f"[{prompts[0]}]",
          **(editing_data(cfg.model.pipeline) if edits else {})}
    if cfg.model.text_embedding_cache:  # never the recipe's own (relative, shared) cache directory
        ov["model.text_embedding_cache"] = str(scratch / "text-embeddings")
    if cfg.train.mode == "offline":
        ov.update(OFFLINE)
    ov.update(cfg.train.update_options.smoke_overrides(scratch))  # models the update's own options name
    return [f"{k}={v}" for k, v in ov.items()]


def smoke_data_hint(pipeline: str) -> str:
    """How to give the smoke run a prompt set of its own: a shipped sample that suits the model (an editing
    set for an editing model, whose smoke data need source images)."""
    edit_set = editing_data(pipeline).get("data.prompts")
    sample = f"{edit_set}, an editing set" if edit_set else "flowgrpo-pickscore-sample"
    return (f"give data.prompts=... data.eval_prompts=... on this command line (e.g. the shipped {sample}): "
            f"--smoke then checks and uses those")


def _note(text: str) -> None:
    print(f"[flowrl] note: {text}", file=sys.stderr, flush=True)


def check_real_inputs(cfg, given: Collection[str] = ()) -> None:
    """What the real run of ``cfg`` reads before its first iteration, checked on this machine before the
    smoke sizes replace it (a ``ConfigError`` that says so): the prompt sets (``data.prompts``,
    ``data.eval_prompts``, read by the real loader) and the files the rewards name (``reward.options``,
    ``reward.heldout``). ``given`` holds the keys set on the command line (``data.prompts``, ``reward``, ...).

    A prompt file the recipe names that is missing here fails, unless the recipe says where to get it
    (``data.source``: data flowrl cannot ship) and the file was not given on the command line: then one note
    names it and the source, and the smoke run goes on with its own prompts. A prompt set it reads is held
    against the model's and the rewards' need of source images. A reward's hub file
    (``hf://...``) must be well formed; one that is not cached while downloads are off gets a note. An
    offline recipe's ``offline.dataset`` that does not exist yet gets a notice (``flowrl generate-offline``
    writes it)."""
    _check_prompt_sets(cfg, given)
    for section, spec in (("reward.options", cfg.reward.options), ("reward.heldout", cfg.reward.heldout)):
        for name, options in spec.items():
            _check_reward_files(section, name, options or {})
    kind = cfg.train.update_needs.data
    if kind not in ("", "groups") and cfg.data.dataset not in (None, "digits") and not Path(cfg.data.dataset).exists():
        _note(f"data.dataset {cfg.data.dataset} does not exist yet; the real run reads its {kind} (the smoke run "
              f"makes a tiny set of its own)")
    dataset = getattr(cfg.offline, "dataset", None) if kind == "groups" else None
    if dataset and not Path(dataset).is_dir():
        _note(f"offline.dataset {dataset} does not exist yet; write it with `flowrl generate-offline --config "
              f"RECIPE` before the real run (the smoke run generates a tiny one of its own)")


def _check_prompt_sets(cfg, given: Collection[str]) -> None:
    from .conditions import check_sources
    from .data.prompts import PromptSetError
    from .errors import ConfigError

    elsewhere = []  # the recipe's files that are not here, with data.source saying where to get them
    rewards = [n for n, w in cfg.reward.weights.items() if w]
    for key, read in (("data.prompts", cfg.data.train_prompts), ("data.eval_prompts", cfg.data.eval_prompt_set)):
        try:
            check_sources(cfg.model.pipeline, read(), key, rewards)  # (the trainer says what a text-only run is)
        except FileNotFoundError as e:
            if not (cfg.data.source and not _covered(key, set(given))):
                raise ConfigError(f"--smoke checks what the real run reads, and {key} fails: {e}; copy the file "
                                  f"there, or {smoke_data_hint(cfg.model.pipeline)}") from None
            elsewhere.append(f"{key} {getattr(cfg.data, key.split('.')[1])}")
        except PromptSetError as e:
            raise ConfigError(f"--smoke checks what the real run reads, and {key} fails: {e}; fix the file, or "
                              f"{smoke_data_hint(cfg.model.pipeline)}") from None
    if elsewhere:
        one = len(elsewhere) == 1
        _note(f"{' and '.join(elsewhere)} {'is' if one else 'are'} not on this machine and the real run reads "
              f"{'it' if one else 'them'}; get {'it' if one else 'them'} from: {cfg.data.source} (the smoke run goes "
              f"on with its own prompts)")


def _check_reward_files(section: str, reward: str, options: dict) -> None:
    """The options reward ``reward`` declares as read from disk or a hub (:class:`flowrl.options.Reads`), as
    ``options`` give them: a local file or directory must be there, a hub file (``hf://...``) well formed (a note
    when it is not cached and downloads are off); a hub id (``org/name``) is left to the real run."""
    from .options import reads, reads_names
    from .rewards import declared_options

    declared, _ = declared_options(reward)
    for key, value in options.items():
        kind = reads(declared[key]) if key in declared else None
        names = reads_names(declared[key]) if kind else ()
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            if kind and isinstance(v, str) and v not in names:
                _check_read(f"{section}.{reward}.{key}", v, kind, reward)


def _check_read(setting: str, value: str, kind: str, reward: str) -> None:
    from .errors import ConfigError
    from .utils.hub import cached_hub_file, hub_offline, parse_hub_file

    if is_hub_file(value):
        try:
            ref = parse_hub_file(value)
        except ValueError as e:
            raise ConfigError(f"{setting}: {e}") from None
        if hub_offline() and cached_hub_file(value) is None:
            _note(f"{setting}={value} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: the real "
                  f"run fails on it unless you run `{ref.download_command()}` first (or it runs with downloads on)")
        return
    p = Path(value).expanduser()
    hub_id = kind == "model" and not value.startswith((".", "/", "~")) and value.count("/") == 1
    if not hub_id and not p.exists():
        raise ConfigError(f"--smoke checks what the real run reads: {setting}={value} is no "
                          f"{'file' if kind == 'file' else 'directory'} here (building the {reward} reward would "
                          f"fail); put it there or point the option at it")


def smoke_config(recipe: str, overrides: Sequence[str], scratch: Path) -> tuple:
    """(the smoke-sized config of ``recipe`` with the user's ``overrides``, all the overrides applied).
    The smoke sizes apply after the user's overrides, except in :data:`USER_SECTIONS`: a prompt set or
    reward given on the command line is what the smoke run uses (that is what it should check)."""
    from .conditions import has_items
    from .trainers.config import load_config
    from .trainers.config_text import override_key

    first = load_config(recipe, list(overrides))
    check_real_inputs(first, {override_key(o) for o in overrides})
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

            from .trainers.offline import image_set_from_groups

            generate_offline(cfg, str(scratch / "dataset"), progress=cfg.logging.progress)
            data = image_set_from_groups(cfg, str(scratch / "dataset"), str(scratch / "data"))  # what the update reads
            cfg = load_config(recipe, [*ov, f"offline.dataset={scratch / 'dataset'}",
                                       *([f"data.dataset={data}"] if cfg.train.update_needs.data != "groups" else [])])
        else:
            from .trainers.online import train
        summary = train(cfg, output_dir, resume=resume)
    if not summary:  # a process other than the main one
        return summary
    return {**summary, "smoke": {"recipe": str(recipe), "model": cfg.model.path, "sampler": cfg.sampler.name}}
