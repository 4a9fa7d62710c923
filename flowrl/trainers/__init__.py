"""Trainers: online (rollout -> update, GRPO family and DiffusionNFT) and offline (GDRO)."""
