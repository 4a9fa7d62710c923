"""A prompt's condition on its way to the policy and the reward: text, or text plus source images.

Samplers, evaluation and the offline dataset hold prompts as plain strings or as
:class:`flowrl.data.items.PromptItem` (an instruction with one to three source images to edit) and
never look inside them. This module is the one place that splits them into texts and sources
(:func:`prompt_parts`), for the two seams:

* :func:`encode_conditions` (policy side): the texts go through ``policy.encode_prompts(texts)`` (so
  the text-embedding cache serves them, keyed by the text alone). A policy conditioned on source
  images declares ``max_sources`` (how many per prompt it takes) and
  ``source_conditioning(texts, sources) -> {name: [B, ...]}`` (``sources``: one tuple of ``[3, H, W]``
  per row, in order, ``()`` for a row without one); its entries are added to the text's. A policy
  whose text encoder reads the source images (Qwen-Image-Edit: the instruction and the pictures go
  through Qwen2.5-VL together) also declares ``text_reads_sources = True``: its
  ``source_conditioning`` then makes the whole conditioning, text included, and ``encode_prompts``
  is not called for that batch. A text-to-image policy declares neither: the sources do not reach
  the model, only the rewards.
* :func:`reward_inputs` (reward side): the texts the reward reads as ``prompts`` and, when any row
  has a source, ``sources=[entry per row]`` beside the caller's other metadata, each entry None, the
  source ``[3, H, W]`` (one) or a tuple of them (several, in order; ``flowrl.data.items.row_sources``).

A batch of plain strings passes both unchanged, so text-only runs are what they were.

Before a model loads, :func:`check_sources` holds a prompt set against what the model and the rewards
declare they need: a model with ``needs_sources = True`` (it cannot generate without a source:
Qwen-Image-Edit) refuses prompts without one; a reward with ``needs_sources = True`` (it scores an
edit against its source and is NaN without one: ``digits_edit``) refuses a set in which no prompt has
one; an editing model that can run without (FLUX.1 Kontext, as its pipeline with ``image=None``) runs
text-to-image on such a set, and the caller says so.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence, Union

import torch

from .data.items import PromptItem, as_items, item_sources, item_texts

Prompt = Union[str, PromptItem]

__all__ = ["Prompt", "encode_conditions", "reward_inputs", "has_items", "prompt_parts", "check_sources",
           "EDIT_SET_HINT"]

# how to give source images in a prompt set (data.prompts, --suite); flowrl sample says --source instead
EDIT_SET_HINT = ("give an editing set: a .jsonl file with a 'prompt' and an 'image' field per row (the image's "
                 "path relative to the file, or a list of paths for several sources; flowrl/data/items.py), e.g. "
                 "the shipped digits-edit-sample")


def has_items(prompts: Sequence[Prompt]) -> bool:
    """Whether any prompt is a :class:`PromptItem` (else all are plain strings)."""
    return any(isinstance(p, PromptItem) for p in prompts)


def prompt_parts(prompts: Sequence[Prompt]) -> tuple[list[str], list[tuple[torch.Tensor, ...]]]:
    """``(texts, sources)`` of ``prompts``: each row's text, and each row's source images as a tuple of
    float ``[3, H, W]`` in [0, 1], in order (``()`` for a plain string or a text-only item)."""
    items = as_items(prompts)
    return [it.prompt for it in items], [it.images for it in items]


def encode_conditions(policy, prompts: Sequence[Prompt]) -> dict[str, torch.Tensor]:
    """The policy's conditioning of ``prompts`` (batch-first ``[B, ...]``): ``encode_prompts`` of the
    texts, plus (or, with ``text_reads_sources``, instead) ``policy.source_conditioning(texts,
    sources)`` when rows carry sources and the policy takes them (module doc). A row with more
    sources than the policy's ``max_sources`` is an error naming both."""
    if not has_items(prompts):
        return policy.encode_prompts(list(prompts))
    texts, sources = prompt_parts(prompts)
    if not any(sources):
        return policy.encode_prompts(texts)
    limit = int(getattr(policy, "max_sources", 0) or 0)
    if limit == 0 or not hasattr(policy, "source_conditioning"):
        _notice_sources_unused(policy)
        return policy.encode_prompts(texts)
    most = max(len(s) for s in sources)
    if most > limit:
        raise ValueError(f"a prompt carries {most} source images but {type(policy).__name__} takes at most {limit} "
                         f"per prompt (use a model that takes several, such as model.pipeline=qwen-image-edit, or "
                         f"split the prompt set)")
    cond = {} if getattr(policy, "text_reads_sources", False) else dict(policy.encode_prompts(texts))
    cond.update(policy.source_conditioning(texts, sources))
    return cond


_NOTICED: set[str] = set()


def _notice_sources_unused(policy) -> None:
    """Once per policy class: an editing prompt set on a text-to-image model is allowed (the rewards
    still see the sources) but is most often a mix-up of recipe and prompt set, so say so."""
    name = type(policy).__name__
    if name not in _NOTICED:
        _NOTICED.add(name)
        print(f"[flowrl] the prompts carry source images but {name} is a text-to-image model: it sees only "
              f"the instructions, the rewards see the sources (use an editing model such as "
              f"model.pipeline=flux-kontext or qwen-image-edit to edit them)", file=sys.stderr, flush=True)


def reward_inputs(prompts: Sequence[Prompt], meta: dict) -> tuple[list[str], dict]:
    """``(texts, meta)`` for a reward call on rows with ``prompts``: the texts, and ``meta`` with
    ``sources`` (each row's :attr:`PromptItem.image`: None, ``[3, H, W]`` in [0, 1], or a tuple of
    them for several sources, in order) added when any row has a source and the caller gave none."""
    if not has_items(prompts):
        return list(prompts), meta
    if "sources" not in meta and any(isinstance(p, PromptItem) and p.has_source for p in prompts):
        meta = {**meta, "sources": item_sources(prompts)}
    return item_texts(prompts), meta


def _has_source(p: Prompt) -> bool:
    return isinstance(p, PromptItem) and p.has_source


def check_sources(model, prompts: Sequence[Prompt], setting: str, rewards: Sequence[str] = (),
                  how: str = EDIT_SET_HINT, other_reward: str = "use another reward") -> Optional[str]:
    """Before a model loads: whether ``prompts`` (given by the user as ``setting``, e.g. ``data.prompts``)
    carry the source images that ``model`` (a pipeline name, adapter class or policy) and the rewards named
    ``rewards`` need (module doc). A :class:`~flowrl.errors.ConfigError` naming ``setting`` and ``how`` (how
    to give sources; for a reward also ``other_reward``) when they cannot run on them; for an editing model
    that runs on them text-to-image, the note to print (None: nothing to say)."""
    from .errors import ConfigError

    if isinstance(model, str):
        from .pipelines import policy_class

        model = policy_class(model)
    name = getattr(model, "kind", None) or (model.__name__ if isinstance(model, type) else type(model).__name__)
    with_source = sum(_has_source(p) for p in prompts)
    if getattr(model, "needs_sources", False) and with_source < len(prompts):
        raise ConfigError(f"{setting}: {len(prompts) - with_source} of {len(prompts)} prompts carry no source image, "
                          f"and {name} is an editing model that cannot generate without one; {how}")
    if with_source:
        return None
    for reward in rewards:
        if getattr(_reward_target(reward), "needs_sources", False):
            raise ConfigError(f"{setting}: no prompt carries a source image, and reward {reward} scores edits "
                              f"against their sources (every score would be NaN); {how}, or {other_reward}")
    if int(getattr(model, "max_sources", 0) or 0) > 0:
        return (f"{setting} has no source images: {name} is an editing model and generates from the text alone "
                f"(text-to-image); to edit images, {how}")
    return None


def _reward_target(name: str):
    """The registered builder of reward ``name`` (a class declares ``needs_sources``), or None."""
    from .rewards import REGISTRY

    try:
        return REGISTRY.get(name)
    except (ValueError, KeyError, ImportError, AttributeError):
        return None
