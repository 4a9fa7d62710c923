"""Dependency-free helpers: atomic file writes, image files, paths and devices.

This package imports nothing from flowrl outside ``flowrl.utils`` (the bottom layer, see
``flowrl.layers``), so every other part may use it.
"""
from .io import atomic_write, fsync_dir, fsync_file, save_figure, save_png, temp_path, write_json, write_text
from .images import image_grid, save_grid
from .paths import default_cache_dir, flowrl_home, resolve_device

__all__ = ["atomic_write", "fsync_dir", "fsync_file", "save_figure", "save_png", "temp_path", "write_json",
           "write_text", "image_grid", "save_grid", "default_cache_dir", "flowrl_home", "resolve_device"]
