"""A prompt's condition on its way to the policy and the reward: text, or text plus a source image.

Samplers, evaluation and the offline dataset hold prompts as plain strings or as
:class:`flowrl.data.items.PromptItem` (an instruction with a source image to edit) and never look
inside them; the two seams that do are here:

* :func:`encode_conditions` (policy side): the text goes through ``policy.encode_prompts`` (so the
  text-embedding cache serves it, keyed by the text alone), and a policy that is conditioned on
  source images declares ``source_conditioning(images) -> {name: [B, ...]}`` (FLUX.1 Kontext: the
  source latents), whose entries are added. A text-to-image policy has no such method: the sources
  do not reach the model, only the rewards.
* :func:`reward_inputs` (reward side): the texts the reward reads as ``prompts`` and, when any item
  has a source, ``sources=[[3, H, W] or None per row]`` beside the caller's other metadata.

A batch of plain strings passes both unchanged, so text-only runs are what they were.
"""
from __future__ import annotations

import sys
from typing import Sequence, Union

import torch

from .data.items import PromptItem, as_items, item_sources, item_texts

Prompt = Union[str, PromptItem]

__all__ = ["Prompt", "encode_conditions", "reward_inputs", "has_items"]


def has_items(prompts: Sequence[Prompt]) -> bool:
    """Whether any prompt is a :class:`PromptItem` (else all are plain strings)."""
    return any(isinstance(p, PromptItem) for p in prompts)


def encode_conditions(policy, prompts: Sequence[Prompt]) -> dict[str, torch.Tensor]:
    """The policy's conditioning of ``prompts`` (batch-first ``[B, ...]``): ``encode_prompts`` of the
    texts, plus ``policy.source_conditioning(sources)`` when the items carry sources and the policy
    takes them (module doc). A batch mixing items with and without a source is an error for such a
    policy (one transformer call cannot condition some rows on a source and not others)."""
    if not has_items(prompts):
        return policy.encode_prompts(list(prompts))
    items = as_items(prompts)
    cond = dict(policy.encode_prompts([it.prompt for it in items]))
    take = getattr(policy, "source_conditioning", None)
    with_source = [it.has_source for it in items]
    if not any(with_source):
        return cond
    if take is None:
        _notice_sources_unused(policy)
        return cond
    if not all(with_source):
        raise ValueError(f"{sum(with_source)} of {len(items)} prompts carry a source image; a policy conditioned on "
                         f"sources needs all or none of a batch's prompts with one (split the prompt set)")
    cond.update(take([it.image for it in items]))
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
              f"model.pipeline=flux-kontext to edit them)", file=sys.stderr, flush=True)


def reward_inputs(prompts: Sequence[Prompt], meta: dict) -> tuple[list[str], dict]:
    """``(texts, meta)`` for a reward call on rows with ``prompts``: the texts, and ``meta`` with
    ``sources`` (each row's source ``[3, H, W]`` in [0, 1], or None) added when any row has a source
    and the caller gave none."""
    if not has_items(prompts):
        return list(prompts), meta
    if "sources" not in meta and any(isinstance(p, PromptItem) and p.has_source for p in prompts):
        meta = {**meta, "sources": item_sources(prompts)}
    return item_texts(prompts), meta
