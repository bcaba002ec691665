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
per-block NFE. The policies live in :mod:`polestar_jax.decode.samplers` (LLaDA, Fast-dLLM) and
:mod:`polestar_jax.decode.polestar.policy` (Polestar); a new policy is one new module that calls
:func:`~polestar_jax.decode.policy.register_policy`.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from polestar_jax.config import GPU_PLATFORMS
from polestar_jax.decode.policy import (POLICIES, BlockCtx, EngineSpec, Knobs, Policy,  # noqa: F401 (re-exported)
                                        block_start_position, context, live_rows, write_commits)
from polestar_jax.decode.rows import ROWS, batch_any
from polestar_jax.decode.state import DecodeState, axes_of, select_rows
from polestar_jax.models.llada import chunk_entries

def policy_for(decoder: str) -> Policy:
    """The :class:`Policy` registered for ``decoder`` (:func:`~polestar_jax.decode.policy.register_policy`);
    a one-line ConfigError naming the registered decoders otherwise."""
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

    def skip(s):  # no live row: the state as it is (the policy's part where it lives between blocks)
        if s.policy_state is not None and policy.own is not None:
            s = s.replace(policy_state=policy.own.at_rest(s.policy_state, spec))
        return s, policy.empty_stats(ctx, bound)

    new, stats = lax.cond(batch_any(live), run, skip, state)
    return _end_block(spec, ctx.cs, live, new, state), stats


def _end_block(spec: EngineSpec, cs, live, new: DecodeState, old: DecodeState) -> DecodeState:
    """After a block: rows that were not live keep ``old``; the live rows' block counters advance, and a live
    row stops when its finished block holds a stop token (early exit: a finished block never changes, and the
    response ends at its first stop token)."""
    new = select_rows(live, new, old)
    stop = old.stop
    if spec.stop_ids:
        blk = lax.dynamic_slice_in_dim(new.x, cs, spec.block_length, axis=1)
        hit = jnp.any(jnp.isin(blk, jnp.asarray(spec.stop_ids, blk.dtype)), axis=1)
        stop = stop | (live & hit & ~jnp.any(blk == spec.model.mask_token_id, axis=1))
    return new.replace(block=old.block + live.astype(jnp.int32), stop=stop)


def compact_width(batch: int, spec: EngineSpec, sharded: bool = False, platform: Optional[str] = None) -> int:
    """The step chunk of a running batch of ``batch`` rows (:attr:`EngineSpec.compact_rows`): an eighth of
    the batch, at least 8 rows (a chunk's forward stays wide enough to keep an accelerator's matmul units
    busy), from 16 rows up; 0 (off) for smaller batches, for a batch sharded over devices (gathering rows
    would move them between devices) and for a policy whose state cannot be gathered (Polestar's store
    offloaded to host memory: :attr:`PolicyState.compactable`), and on a GPU (``platform``): there a step
    is bound by its weight reads, and every chunk would read all the weights again."""
    own = policy_for(spec.decoder).own
    if batch < 16 or sharded or platform in GPU_PLATFORMS or (own is not None and not own.compactable(spec)):
        return 0
    return max(8, batch // 8)


class _RowCtx(NamedTuple):
    """The per-row arrays of a :class:`BlockCtx`, carried through the compacted step loop ([b] or [b, 1])."""

    block_idx: jax.Array
    cs: jax.Array
    n_masked0: jax.Array
    live: jax.Array


def _take(tree, axes, idx):
    """The rows ``idx`` [w] (distinct, in range: :func:`_chunked`) of every leaf along its batch axis."""
    return jax.tree.map(lambda a, ax: a if ax is None else a.at[(slice(None),) * ax + (idx,)].get(
        mode="promise_in_bounds", unique_indices=True), tree, axes)


def _put(tree, axes, idx, sub):
    """Every leaf with ``sub``'s rows written at ``idx`` [w] (distinct, in range) along its batch axis."""
    return jax.tree.map(lambda a, ax, v: a if ax is None else a.at[(slice(None),) * ax + (idx,)].set(
        v, mode="promise_in_bounds", unique_indices=True), tree, axes, sub)


def _chunked(carry, mask: jax.Array, w: int, fn):
    """``carry = fn(carry, idx, on)`` over the rows where ``mask`` [b, 1] holds, ``w`` rows at a time:
    ``idx`` [w] the chunk's rows (the masked rows first, then the others, padded to whole chunks with the
    first rows again, so a chunk's rows stay distinct), ``on`` [w, 1] whether a position is one of the
    masked rows (a position at or past their count takes part as inactive: ``fn`` must leave it as is)."""
    b = mask.shape[0]
    n = jnp.sum(mask)
    order = jnp.argsort(~mask[:, 0], stable=True)
    order = jnp.concatenate([order, order[: -(-b // w) * w - b]])

    def chunk(j, carry):
        idx = lax.dynamic_slice_in_dim(order, j * w, w)
        return fn(carry, idx, mask[idx] & (j * w + jnp.arange(w) < n)[:, None])

    return lax.fori_loop(0, (n + w - 1) // w, chunk, carry)


def _compacted_block(params, state: DecodeState, knobs: Knobs, replay, spec: EngineSpec):
    """:func:`row_block` for every row of a running batch (``spec.per_row``), its start on the live rows
    only and each step on the rows still active only, gathered in chunks of ``spec.compact_rows`` rows
    (:func:`_chunked`) and scattered back but for the K/V cache, whose own entries they read and write in place
    (``llada.chunk_entries``): a row computes what it computes in a full-width call (its values are functions
    of its own state); free slots cost no block start, and finished rows no step."""
    policy = policy_for(spec.decoder)
    b, w = state.x.shape[0], spec.compact_rows
    st_axes = axes_of(state)
    s_ax = _shared_cache(jax.tree.map(lambda ax: ax.batch, st_axes))  # (its rows' entries: llada.chunk_entries)
    r_ax = None if replay is None else jax.tree.map(lambda ax: ax.batch, axes_of(replay))
    k_ax = jax.tree.map(lambda a: 0 if jnp.ndim(a) else None, knobs)
    c_ax = _RowCtx(0, 0, 0, 0)
    rows = lambda f, in_axes, out_axes: jax.vmap(f, in_axes=in_axes, out_axes=out_axes, axis_name=ROWS)
    old = _split_rows(state, st_axes, b, shared=True)
    rep = None if replay is None else _split_rows(replay, axes_of(replay), b)

    def ctx_of(rc: _RowCtx, k, r) -> BlockCtx:
        return BlockCtx(params, spec, k, r, rc.block_idx, rc.cs, rc.n_masked0, rc.live)

    def row_ctx(s, k, r):
        live = live_rows(s)
        ctx = context(params, s, jnp.max(s.block), k, r, spec, live)
        return _RowCtx(ctx.block_idx, ctx.cs, ctx.n_masked0, live)

    rc = rows(row_ctx, (s_ax, k_ax, r_ax), c_ax)(old, knobs, rep)

    def on_chunk(f, s, idx, on, out_axes):  # f(s, c, k, r, on) over the chunk's rows, the K/V cache shared
        with chunk_entries(idx, on, b):
            return rows(f, (s_ax, c_ax, k_ax, r_ax, 0), out_axes)(_take_chunk(s, s_ax, idx), _take(rc, c_ax, idx),
                                                                  _take(knobs, k_ax, idx), _take(rep, r_ax, idx), on)

    def begin(s, c, k, r, on):  # the block start of the rows ``on`` of a chunk; the others as they were
        ctx = ctx_of(c._replace(live=c.live & on), k, r)
        new = lax.cond(batch_any(on), lambda s: policy.start(ctx, s), lambda s: s, s)
        # (the shared cache as written: a row that is not ``on`` wrote nothing there)
        keep = lambda n, o: jnp.where(on.reshape((1,) * n.ndim), n, o)
        return jax.tree.map(keep, _no_cache(new), _no_cache(s)).replace(k_cache=new.k_cache, v_cache=new.v_cache)

    s = _chunked(old, rc.live, w, lambda s, idx, on: _put_chunk(s, s_ax, idx, on_chunk(begin, s, idx, on, s_ax)))
    bound = policy.bound(context(params, state, 0, knobs, replay, spec))
    stats = rows(lambda c, k, r: policy.empty_stats(ctx_of(c, k, r), bound), (c_ax, k_ax, r_ax), 1)(rc, knobs, rep)

    def active(s, i):  # [b, 1]
        return rows(lambda s, c, k, r: policy.active(ctx_of(c, k, r), s, i) & c.live,
                    (s_ax, c_ax, k_ax, r_ax), 0)(s, rc, knobs, rep)

    def cond(carry):
        s, i, _ = carry
        return jnp.any(active(s, i)) & (i < bound)

    def body(carry):
        s, i, buf = carry
        a = active(s, i)

        def chunk(carry, idx, on):
            s, st_all = carry
            sub, st = on_chunk(lambda s, c, k, r, a: policy.step(ctx_of(c, k, r), s, i, a), s, idx, on, (s_ax, 0))
            if st is not None:  # (a position that took part as inactive keeps what an earlier chunk recorded)
                zero = jax.tree.map(lambda _: 0, st)
                keep = lambda v, old: jnp.where(on.reshape(on.shape + (1,) * (v.ndim - 2)), v, old)
                st_all = _put(st_all, zero, idx, jax.tree.map(keep, st, _take(st_all, zero, idx)))
            return _put_chunk(s, s_ax, idx, sub), st_all

        st0 = None if buf is None else jax.tree.map(lambda v: jnp.zeros(v.shape[1:], v.dtype), buf)
        s, st = _chunked((s, st0), a, w, chunk)
        if buf is not None:  # a row that is not active records nothing (as when it decodes alone)
            st = jax.tree.map(lambda v: jnp.where(a.reshape(a.shape + (1,) * (v.ndim - 2)), v, jnp.zeros_like(v)), st)
            buf = jax.tree.map(lambda bb, v: bb.at[i].set(v), buf, st)
        return s, i + 1, buf

    s, _, stats = lax.while_loop(cond, body, (s, jnp.int32(0), stats))

    def end(new, o, c):
        new = new.replace(block_nfe=new.block_nfe.at[:, c.block_idx].set(new.nfe - o.nfe, mode="drop"))
        return _end_block(spec, c.cs, c.live, new, o)

    out = rows(end, (s_ax, s_ax, c_ax), s_ax)(s, old, rc)
    stats = None if stats is None else jax.tree.map(lambda a: a.reshape(a.shape[:1] + (b,) + a.shape[3:]), stats)
    return _merge_rows(out, st_axes, b, shared=True), stats


def _no_cache(s: DecodeState) -> DecodeState:
    return s.replace(k_cache=None, v_cache=None)


def _take_chunk(s: DecodeState, s_ax, idx) -> DecodeState:
    """:func:`_take` of a state's rows ``idx``, with the whole K/V cache the rows share (not gathered)."""
    return _take(_no_cache(s), s_ax, idx).replace(k_cache=s.k_cache, v_cache=s.v_cache)


def _put_chunk(s: DecodeState, s_ax, idx, sub: DecodeState) -> DecodeState:
    """:func:`_put` of a chunk's state; its K/V cache is the rows' shared one as the chunk wrote it."""
    return _put(_no_cache(s), s_ax, idx, _no_cache(sub)).replace(k_cache=sub.k_cache, v_cache=sub.v_cache)


def _reshape_rows(tree, axes_tree, shape_of, spec: Optional[EngineSpec] = None, shared: bool = False):
    """Every leaf reshaped to ``shape_of(leaf, ax)``; the leaves of a policy's own state that it keeps apart
    (declared ``select=False``: Polestar's store, which may live in host memory) through the policy's
    ``reshape`` hook, where they live (``spec``: None for a tree that holds no policy state, a replay);
    ``shared``: the K/V cache, which the rows share (:func:`_shared_cache`), as it is."""
    own = None if spec is None else policy_for(spec.decoder).own
    plain = lambda a, ax: a.reshape(shape_of(a, ax))
    if not isinstance(tree, DecodeState):
        return jax.tree.map(plain, tree, axes_tree)
    cut = dict(policy_state=None, **(dict(k_cache=None, v_cache=None) if shared else {}))
    out = jax.tree.map(plain, tree.replace(**cut), axes_tree.replace(**cut))
    if shared:
        out = out.replace(k_cache=tree.k_cache, v_cache=tree.v_cache)
    if own is None or tree.policy_state is None:
        return out.replace(policy_state=None if tree.policy_state is None else jax.tree.map(
            plain, tree.policy_state, axes_tree.policy_state))
    kept = lambda a, ax: plain(a, ax) if ax.select else own.reshape(a, shape_of(a, ax), spec)
    return out.replace(policy_state=jax.tree.map(kept, tree.policy_state, axes_tree.policy_state))


def _shared_cache(in_axes: DecodeState) -> DecodeState:
    """The per-row ``vmap``'s axes of a state (``in_axes``: each leaf's batch axis) with the K/V cache not
    mapped: the rows share it, each reading and writing its own entries on the cache's batch axis
    (:class:`polestar_jax.models.llada.CacheSlot`), so that inside the rows' loops the cache keeps its layer
    axis first and a layer's K/V is one contiguous slice (a mapped cache has the rows axis first there: each
    layer's K/V would be copied out before attention reads it)."""
    return in_axes.replace(k_cache=None, v_cache=None)


def _split_rows(tree, axes_tree, b: int, spec: Optional[EngineSpec] = None, shared: bool = False):
    """Every leaf's batch axis ``ax`` split into (b, 1), so a per-row function sees a batch of one
    (``shared``: but the K/V cache's)."""
    return _reshape_rows(tree, axes_tree, lambda a, ax: a.shape[:ax.batch] + (b, 1) + a.shape[ax.batch + 1:], spec,
                         shared)


def _merge_rows(tree, axes_tree, b: int, spec: Optional[EngineSpec] = None, shared: bool = False):
    return _reshape_rows(tree, axes_tree, lambda a, ax: a.shape[:ax.batch] + (b,) + a.shape[ax.batch + 2:], spec,
                         shared)


def decode_block(params, state: DecodeState, knobs: Knobs, replay, spec: EngineSpec):
    """The block program: one block of every live row, each row at its own block (``state.block``).

    With ``spec.per_row`` (a running batch that takes rows at any block boundary): a ``jax.vmap`` of
    :func:`row_block` over the rows (axis :data:`polestar_jax.decode.rows.ROWS`): a row computes what it would alone,
    whatever block the other rows are at; the few batch-wide branch decisions (:mod:`polestar_jax.decode.rows`) keep
    real branches. Without it (a fixed batch whose rows start together): :func:`row_block` over the whole
    batch, which compiles faster; the rows compute the same. ``knobs`` leaves are scalars (shared) or [b] (per row).
    Returns ``(state, stats)``; ``stats`` leaves [steps, b, ...] (None for policies that record none)."""
    if not spec.per_row:  # a batch in lockstep: one program over the whole batch (a shorter compile)
        return row_block(params, state, knobs, replay, spec)
    b = state.x.shape[0]
    if 0 < spec.compact_rows < b:
        return _compacted_block(params, state, knobs, replay, spec)
    st_axes, rp_axes = axes_of(state), (None if replay is None else axes_of(replay))
    knob_axes = jax.tree.map(lambda a: 0 if jnp.ndim(a) else None, knobs)

    def one(s, k, r):
        return row_block(params, s, k, r, spec)

    in_axes = (_shared_cache(jax.tree.map(lambda ax: ax.batch, st_axes)), knob_axes,
               None if replay is None else jax.tree.map(lambda ax: ax.batch, rp_axes))
    out_st, stats = jax.vmap(one, in_axes=(in_axes[0], in_axes[1], in_axes[2]),
                             out_axes=(in_axes[0], 1), axis_name=ROWS)(
        _split_rows(state, st_axes, b, spec, shared=True), knobs,
        None if replay is None else _split_rows(replay, rp_axes, b))
    stats = None if stats is None else jax.tree.map(lambda a: a.reshape(a.shape[:1] + (b,) + a.shape[3:]), stats)
    return _merge_rows(out_st, st_axes, b, spec, shared=True), stats

