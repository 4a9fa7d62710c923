"""Model facts of the MMDiT transformers several adapters share: their block types, for the planner's
reduced-depth probes (``pipelines/facts.py``: ``block_counts`` / ``with_block_counts``).

* :class:`SD3TransformerFacts`: diffusers' ``SD3Transformer2DModel`` (SD3 / SD3.5, the digits model);
* :class:`DoubleSingleStreamFacts`: double-stream then single-stream blocks (``num_layers`` /
  ``num_single_layers``): ``FluxTransformer2DModel`` (FLUX.1, FLUX.1 Kontext) and
  ``Flux2Transformer2DModel`` (FLUX.2 [dev], FLUX.2 [klein]).
"""
from __future__ import annotations


class SD3TransformerFacts:
    """``block_counts`` / ``with_block_counts`` of an ``SD3Transformer2DModel`` config (``pipelines/facts.py``)."""

    @classmethod
    def block_counts(cls, transformer: dict) -> dict[str, int]:
        """``dual`` (a second, image-only attention) and ``plain`` MMDiT blocks, plus the last,
        context-pre-only block (always one, counted with neither)."""
        dual = len(transformer.get("dual_attention_layers") or ())
        return {"dual": dual, "plain": int(transformer["num_layers"]) - 1 - dual}

    @classmethod
    def with_block_counts(cls, transformer: dict, counts: dict[str, int]) -> dict:
        return {**transformer, "num_layers": counts["dual"] + counts["plain"] + 1,
                "dual_attention_layers": tuple(range(counts["dual"]))}


class DoubleSingleStreamFacts:
    """Block counts of a FLUX-style transformer: ``num_layers`` double-stream, then ``num_single_layers``
    single-stream blocks."""

    @classmethod
    def block_counts(cls, transformer: dict) -> dict[str, int]:
        """Double-stream then single-stream blocks."""
        return {"double": int(transformer["num_layers"]), "single": int(transformer.get("num_single_layers", 0))}

    @classmethod
    def with_block_counts(cls, transformer: dict, counts: dict[str, int]) -> dict:
        return {**transformer, "num_layers": counts["double"], "num_single_layers": counts["single"]}


__all__ = ["DoubleSingleStreamFacts", "SD3TransformerFacts"]
