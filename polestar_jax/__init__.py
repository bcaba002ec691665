"""polestar-jax: diffusion-LM decoding in JAX for the LLaDA and Dream model families, with three decoders:
LLaDA's sampler, Fast-dLLM (threshold / factor rules, prefix and dual KV caches) and Polestar (Polestar-Cache
and Polestar-Commit on the dual cache).

Entry points: the text API :mod:`polestar_jax.api`, the commands ``python -m polestar_jax.generate`` /
``.eval`` / ``.crosscheck`` / ``.convert``, and the configs re-exported here (:mod:`polestar_jax.config`).

The package itself imports nothing heavy (the names below load on first use), so ``python -m
polestar_jax.<command>`` reaches its own interrupt handling before JAX is imported (see
:mod:`polestar_jax.cli`).
"""
from __future__ import annotations

import importlib

__all__ = ["DecodeConfig", "ModelConfig", "PolestarConfig", "PolestarError", "CheckpointError", "ConfigError"]
__version__ = "0.1.0"

_WHERE = {"DecodeConfig": "config", "ModelConfig": "config", "PolestarConfig": "config",
          "PolestarError": "errors", "CheckpointError": "errors", "ConfigError": "errors"}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"polestar_jax.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'polestar_jax' has no attribute {name!r}")
