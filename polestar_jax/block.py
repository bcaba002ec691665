"""The block program: one compiled call decodes one block of masked tokens of every batch row.

Every decoder is a *policy* plugged into the same program (:func:`decode_block`):

* ``start(ctx, state)``: what happens before the step loop (Fast-dLLM's cached variants and Polestar: a
  full or windowed forward that writes the cache and commits; LLaDA: nothing);
* ``active(ctx, state, i)``: which rows take part in step ``i`` (a row whose block is done waits);
* ``step(ctx, state, i, active)``: one forward of the block and its commits; returns the new state and
  the step's statistics (None, or a pytree recorded per step);
* ``bound(ctx)`` (the most steps a block may take: every loop is bounded) and ``empty_stats(ctx, n)``.

Written once, here: the block geometry (:class:`BlockCtx`), the commit writer (:func:`write_commits`,
which also counts the forward), the bounded ``lax.while_loop``, the per-step statistics buffer and the
per-block NFE. The policies live in :mod:`polestar_jax.samplers` (LLaDA, Fast-dLLM) and
:mod:`polestar_jax.polestar` (Polestar); a new policy is one new module and one line in :data:`POLICIES`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from polestar_jax import offload, polestar, samplers
from polestar_jax.policy import (BlockCtx, EngineSpec, Knobs, Policy, block_start_position,  # noqa: F401 (re-exported)
                                 context, live_rows, write_commits)
from polestar_jax.rows import ROWS, batch_any
from polestar_jax.state import DecodeState, axes_of, select_rows

#: decoder name -> its :class:`Policy` (a new policy: one module and one entry here).
POLICIES: dict[str, Policy] = {**samplers.POLICIES, **polestar.POLICIES}


def policy_for(decoder: str) -> Policy:
    """The :class:`Policy` of ``decoder`` (a key of :data:`POLICIES`)."""
    return POLICIES[decoder]


def row_block(params, state: DecodeState, knobs: Knobs, replay, spec: EngineSpec):
    """Decodes the next block (``state.block``) of the rows of ``state`` that are live (:func:`live_rows`)
    with ``spec.decoder``'s policy: its start, then its steps in a bounded ``lax.while_loop`` while any row
    is active; then advances the rows' block counters and marks a row stopped when the finished block holds
    one of ``spec.stop_ids`` (early exit). Every live row of ``state`` sits at the same block (the block
    program calls this once per row, or once for a batch in lockstep: :func:`decode_block`). Returns ``(state, stats)``: ``stats`` holds the
    policy's per-step statistics with a leading step axis (None for policies that record none); the
    state's ``block_nfe`` gets the forwards each row spent on the block."""
    policy = policy_for(spec.decoder)
    live = live_rows(state)
    # every live row sits at the same block (one row per call, or a batch in lockstep: rows that stopped early
    # or ended lag behind, and are not live)
    ctx = context(params, state, jnp.max(state.block), knobs, replay, spec, live)
    bound = policy.bound(ctx)

    def run(state):
        nfe_before = state.nfe
        state = policy.start(ctx, state)

        def cond(carry):
            s, i, _ = carry
            # batch-wide (a row that is done waits unchanged: the policies select per row), so that no
            # per-row select of the whole carry (the Polestar store may live in host memory) is needed
            return batch_any(policy.active(ctx, s, i) & live) & (i < bound)

        def body(carry):
            s, i, stats = carry
            s, st = policy.step(ctx, s, i, policy.active(ctx, s, i) & live)
            if stats is not None:
                stats = jax.tree.map(lambda buf, v: buf.at[i].set(v), stats, st)
            return s, i + 1, stats

        state, _, stats = lax.while_loop(cond, body, (state, jnp.int32(0), policy.empty_stats(ctx, bound)))
        block_nfe = state.block_nfe.at[:, ctx.block_idx].set(state.nfe - nfe_before, mode="drop")
        return state.replace(block_nfe=block_nfe), stats

    def skip(s):  # no live row: the state as it is (Polestar's store where the decode keeps it: host memory)
        if s.polestar is not None and spec.polestar is not None:
            pol = s.polestar
            s = s.replace(polestar=pol.replace(hs=offload.to_host(pol.hs, spec.polestar),
                                               hs_scale=offload.to_host(pol.hs_scale, spec.polestar)))
        return s, policy.empty_stats(ctx, bound)

    new, stats = lax.cond(batch_any(live), run, skip, state)
    new = select_rows(live, new, state)
    stop = state.stop
    if spec.stop_ids:  # early exit: a finished block never changes, and the response ends at its first stop token
        blk = ctx.rows(new.x)
        hit = jnp.any(jnp.isin(blk, jnp.asarray(spec.stop_ids, blk.dtype)), axis=1)
        stop = stop | (live & hit & ~jnp.any(blk == spec.model.mask_token_id, axis=1))
    return new.replace(block=state.block + live.astype(jnp.int32), stop=stop), stats


def _split_rows(tree, axes_tree, b: int, pc=None):
    """Every leaf's batch axis ``ax`` split into (b, 1), so a per-row function sees a batch of one. (Leaves
    declared ``select=False``, Polestar's store, are reshaped where they live: host memory when offloaded.)"""
    def split(a, ax):
        return offload.reshape(a, a.shape[:ax.batch] + (b, 1) + a.shape[ax.batch + 1:], None if ax.select else pc)

    return jax.tree.map(split, tree, axes_tree)


def _merge_rows(tree, axes_tree, b: int, pc=None):
    def merge(a, ax):
        return offload.reshape(a, a.shape[:ax.batch] + (b,) + a.shape[ax.batch + 2:], None if ax.select else pc)

    return jax.tree.map(merge, tree, axes_tree)


def decode_block(params, state: DecodeState, knobs: Knobs, replay, spec: EngineSpec):
    """The block program: one block of every live row, each row at its own block (``state.block``).

    With ``spec.per_row`` (a running batch that takes rows at any block boundary): a ``jax.vmap`` of
    :func:`row_block` over the rows (axis :data:`polestar_jax.rows.ROWS`): a row computes what it would alone,
    whatever block the other rows are at; the few batch-wide branch decisions (:mod:`polestar_jax.rows`) keep
    real branches. Without it (a fixed batch whose rows start together): :func:`row_block` over the whole
    batch, which compiles faster; the rows compute the same. ``knobs`` leaves are scalars (shared) or [b] (per row).
    Returns ``(state, stats)``; ``stats`` leaves [steps, b, ...] (None for policies that record none)."""
    if not spec.per_row:  # a batch in lockstep: one program over the whole batch (a shorter compile)
        return row_block(params, state, knobs, replay, spec)
    b = state.x.shape[0]
    st_axes, rp_axes = axes_of(state), (None if replay is None else axes_of(replay))
    knob_axes = jax.tree.map(lambda a: 0 if jnp.ndim(a) else None, knobs)

    def one(s, k, r):
        return row_block(params, s, k, r, spec)

    in_axes = (jax.tree.map(lambda ax: ax.batch, st_axes), knob_axes,
               None if replay is None else jax.tree.map(lambda ax: ax.batch, rp_axes))
    out_st, stats = jax.vmap(one, in_axes=(in_axes[0], in_axes[1], in_axes[2]),
                             out_axes=(in_axes[0], 1), axis_name=ROWS)(
        _split_rows(state, st_axes, b, spec.polestar), knobs,
        None if replay is None else _split_rows(replay, rp_axes, b))
    stats = None if stats is None else jax.tree.map(lambda a: a.reshape(a.shape[:1] + (b,) + a.shape[3:]), stats)
    return _merge_rows(out_st, st_axes, b, spec.polestar), stats


run_block_jit = jax.jit(decode_block, static_argnames=("spec",), donate_argnames=("state",))
