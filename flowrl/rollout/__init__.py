"""Samplers: each returns a :class:`Rollout` of finished samples and trained transitions."""
from ..structures import GroupStructure, SolStructure, Structure, TempFlowStructure, TreeStructure
from ..scoring import ChunkScorer, Scores, score_images
from .base import Rollout, Transitions
from .branch import BranchSampler
from .group import GroupSampler
from .sol import SolSampler
from .tempflow import TempFlowSampler

__all__ = ["Rollout", "Transitions", "score_images", "ChunkScorer", "Scores", "GroupSampler", "TempFlowSampler",
           "BranchSampler", "SolSampler", "Structure", "GroupStructure", "TreeStructure", "TempFlowStructure", "SolStructure"]
