"""Model facts of diffusers' ``SD3Transformer2DModel`` (the MMDiT of SD3 / SD3.5), shared by the adapters
built on it (``sd3``, ``digits``): its block types for the planner's reduced-depth probes."""
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


__all__ = ["SD3TransformerFacts"]
