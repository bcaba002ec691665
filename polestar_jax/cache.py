"""The persistent XLA compilation cache every entry point turns on (the CLIs, :mod:`polestar_jax.api`,
:mod:`polestar_jax.eval`).

``$POLESTAR_JAX_CACHE`` names the folder (default ``~/.cache/polestar_jax/xla``); ``POLESTAR_JAX_CACHE=off``
disables it. With it on, a second process decoding the same shapes loads the executables instead of
compiling them (the bundled model's Polestar block step takes ~12 s to compile).
"""
from __future__ import annotations

import os
from typing import Optional

__all__ = ["enable_compile_cache", "cache_folder"]

OFF = "off"


def cache_folder(path: Optional[str] = None) -> Optional[str]:
    """The folder :func:`enable_compile_cache` would use (None when disabled)."""
    path = path or os.environ.get("POLESTAR_JAX_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "polestar_jax", "xla")
    return None if path.lower() == OFF else path


def enable_compile_cache(path: Optional[str] = None) -> Optional[str]:
    """Turns on JAX's persistent compilation cache (``$POLESTAR_JAX_CACHE``, default
    ``~/.cache/polestar_jax/xla``; ``POLESTAR_JAX_CACHE=off`` disables it), so a second run of the same
    shapes skips compilation. Returns the folder used, or None."""
    import jax

    from polestar_jax import cli

    path = cache_folder(path)
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        cli.guard_compile_cache_writes()
    except OSError:
        return None
    return path
