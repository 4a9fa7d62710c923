"""Dependency-free helpers: atomic file writes (``io``), image files (``images``), paths and devices
(``paths``), launched workers (``launch``), FSDP2-sharded modules (``sharded``).

This package imports nothing from flowrl outside ``flowrl.utils`` (the bottom layer, see
``flowrl.layers``), so every other part may use it. Import from the module that defines a name.
"""
