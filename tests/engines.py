"""The suite's engines: one :class:`polestar_jax.engine.engine.Engine` per model configuration, parameter shapes and
mesh, shared by the tests of a process, so that a decode shape compiles once per process.

The package keeps no module-level cache of executables (an engine owns its own); this cache of engines is the
test suite's. :func:`generate` decodes a fixed batch with the reference's accounting (every block decoded,
``early_exit=False``), which is what the golden data and most tests compare; pass ``early_exit=True`` to
keep the config's early exit.
"""
from __future__ import annotations

import dataclasses

import jax

from polestar_jax.engine.engine import Engine, GenerateResult

_ENGINES: dict = {}


def release_all() -> None:
    """Drops every shared engine (their compiled programs go with them; the next test compiles again)."""
    for eng in _ENGINES.values():
        eng.clear()
    _ENGINES.clear()


def _shapes(params) -> tuple:
    leaves, treedef = jax.tree.flatten(params)
    return treedef, tuple((tuple(a.shape), str(a.dtype)) for a in leaves)


def engine_for(params, cfg, mesh=None) -> Engine:
    """The shared engine for ``cfg``, parameters of these shapes and ``mesh``."""
    key = (cfg, _shapes(params), mesh)
    if key not in _ENGINES:
        _ENGINES[key] = Engine(params, cfg, mesh=mesh)
    return _ENGINES[key]


def generate(params, cfg, prompts, dcfg, seed: int = 0, rows=None, pad_multiple: int = 16, prompt_slot=None,
             replay=None, mesh=None, early_exit: bool = False, images=None) -> GenerateResult:
    """One fixed batch on the shared engine (see :meth:`Engine.run`; ``images``: per prompt, its image rows)."""
    eng = engine_for(params, cfg, mesh)
    if not early_exit:
        dcfg = dataclasses.replace(dcfg, early_exit=False)
    if prompt_slot is None and len(prompts) and all(len(p) for p in prompts):
        prompt_slot = eng.prompt_slot([len(p) for p in prompts], pad_multiple)
    return eng.run(prompts, dcfg, seed=seed, rows=rows, prompt_slot=prompt_slot, replay=replay, params=params,
                   images=images)
