"""flowrl: reinforcement-learning alignment of flow-matching image models."""
__version__ = "0.1.0"
