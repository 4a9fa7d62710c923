"""Samplers: each returns a :class:`Rollout` of finished samples and trained transitions."""
from .base import Rollout, Transitions, score_images
from .group import GroupSampler

__all__ = ["Rollout", "Transitions", "score_images", "GroupSampler"]
