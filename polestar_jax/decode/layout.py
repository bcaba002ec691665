"""A decoder's whole decode state: the generic fields of :mod:`polestar_jax.decode.state` and the policy's
own part, built through the policy's :class:`~polestar_jax.decode.state.PolicyState` hooks.

:func:`state_layout` says what a decode configuration's state holds; :func:`init_decode_state` builds it
(the engine, the memory planner and every bench build states here). Neither names a policy: the policy
registered for ``DecodeConfig.decoder`` (:data:`polestar_jax.decode.policy.POLICIES`) brings its hooks.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from polestar_jax.config import DecodeConfig, ModelConfig
from polestar_jax.decode.policy import POLICIES
from polestar_jax.decode.state import (DecodeState, PolicyState, StateLayout, build_sharded, build_state, prompt_fields,
                                       row_key_data)


def own_state(decoder: str) -> Optional[PolicyState]:
    """The hooks of ``decoder``'s own state (None: its policy keeps none)."""
    return POLICIES[decoder].own


def state_layout(mcfg: ModelConfig, dcfg: DecodeConfig, dtype) -> StateLayout:
    """What ``dcfg``'s decode state holds beside the prompts (hashable: one compiled builder per layout)."""
    own = own_state(dcfg.decoder)
    return StateLayout(mcfg, dcfg.num_blocks, dcfg.cache != "none", np.dtype(dtype), dcfg.block_length, own,
                       None if own is None else own.config_of(dcfg), str(dcfg.kv_cache))


def place_own(state: DecodeState, layout: StateLayout, abstract: bool = False) -> DecodeState:
    """Outside jit: the policy's part of ``state`` moved where it lives (e.g. Polestar's offloaded store in
    host memory); ``abstract`` for a state of ``jax.ShapeDtypeStruct`` leaves."""
    if layout.own is None:
        return state
    return state.replace(policy_state=layout.own.place(state.policy_state, layout.own_config, abstract))


def init_decode_state(
    mcfg: ModelConfig,
    dcfg: DecodeConfig,
    prompts: Sequence[Sequence[int]],
    prompt_slot: int,
    seed: int = 0,
    rows: Optional[Sequence[int]] = None,
    dtype=jnp.float32,
    abstract: bool = False,
    mesh=None,
    gen_lengths: Optional[Sequence[int]] = None,
    builders: Optional[dict] = None,
) -> DecodeState:
    """The whole decode state of ``dcfg``'s decoder for ``prompts`` (left-padded into ``prompt_slot``): the
    generic fields, the policy's own part, placed where the policy keeps it. ``rows``: each prompt's index in
    its job (its random key is ``(seed, row)``; default 0..n-1). ``abstract=True`` returns
    ``jax.ShapeDtypeStruct`` leaves only (memory planning, ahead-of-time compiles; with ``mesh``, sharded). ``mesh`` (a
    ``jax.sharding.Mesh``): the state is built already sharded over it (:func:`build_sharded`, its builder
    kept in ``builders`` when given)."""
    rows = list(range(len(prompts))) if rows is None else list(rows)
    fields = prompt_fields(prompts, mcfg, dcfg.gen_length, prompt_slot, [row_key_data(seed, r) for r in rows],
                           dcfg.block_length, gen_lengths)
    layout = state_layout(mcfg, dcfg, dtype)
    if abstract:
        state = jax.eval_shape(functools.partial(build_state, layout=layout), fields)
        if mesh is not None:  # (the shardings build_sharded gives the state)
            from polestar_jax.sharding import shard, state_shardings

            state = shard(state, state_shardings(state, mesh))
        return place_own(state, layout, True)
    state = build_state(fields, layout) if mesh is None else build_sharded(fields, layout, mesh, builders)
    return place_own(state, layout)
