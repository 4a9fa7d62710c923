"""``flowrl plan``: per-GPU memory of a recipe, from its models built on the meta device (no download).

* :mod:`flowrl.plan.models`: the meta-device transformer (with LoRA), text encoders, VAE, from the
  facts the pipeline's adapter class declares (``pipelines/facts.py``); byte counts;
* :mod:`flowrl.plan.tracker` / :mod:`flowrl.plan.activations`: activation memory measured on meta tensors;
* :mod:`flowrl.plan.budget` / :mod:`flowrl.plan.core`: the items, phases and peak (:func:`plan_memory`);
  reward models count what their classes declare (``resident_params``, or ``resident_for`` when the size follows
  their options);
* :mod:`flowrl.plan.knobs` / :mod:`flowrl.plan.report`: what would make it fit, the table and JSON;
* :mod:`flowrl.plan.measure`: the real peak of the same passes, to check the plan (CPU or CUDA).

See docs/memory.md.
"""
from __future__ import annotations

__all__ = ["plan_memory", "parse_memory"]


def __getattr__(name: str):
    if name == "plan_memory":
        from .core import plan_memory

        return plan_memory
    if name == "parse_memory":
        from .report import parse_memory

        return parse_memory
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
