"""Prompt sets and offline datasets."""
from .prompts import load_prompts

__all__ = ["load_prompts"]
