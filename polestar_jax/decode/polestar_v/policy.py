"""``polestar_v``: the official LLaDA-V code's Polestar as a policy of the block program
(:mod:`polestar_jax.decode.block`; ``docs/algorithm.md#llada-vs-polestar``).

1. **Block start** (:func:`start`): a full pass over the whole sequence fills the prefix K/V cache and the
   store of final hidden states (:class:`~polestar_jax.decode.polestar_v.state.VState`), and the threshold
   rule commits (no early commit).
2. **Decode steps** (:func:`step`) while the block has a mask, each one pass:

   * a *refresh* when the previous pass committed more than ``trigger_commits`` tokens or the commits since
     the last refresh exceed ``trigger_accum`` and the selection (:mod:`polestar_jax.decode.polestar_v.select`)
     names rows: the rows from the smallest selected position ``s`` to the end are recomputed attending
     only to each other (a fresh cache, as the official code's), and the cache keeps its rows before ``s``;
   * else, every ``refresh_interval``-th step of a block, a full pass renews the cache;
   * else a prefix-cache step: the block and everything after it against the cached prefix.

   The pass's final hidden states replace the stored ones from its first row on; the block's cosine drift
   ``d = 1 - cos`` against its rows before the pass, less the mean of the block's last ``history`` drifts,
   gates the early commit of middling-confidence tokens (as Polestar-Commit of the LLaDA path).

A batch runs one program: when any active row needs a fresh pass every row takes one full-length pass in
which the others keep their cached prefix (so each row computes what it computes alone); else every row
takes the cheaper prefix-cache pass over the generated region only.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from polestar_jax.decode.commit import commit_threshold, noise_keys, predict
from polestar_jax.decode.policy import BlockCtx, Policy, register_policy, write_commits
from polestar_jax.decode.polestar.drift import drift_delta, push_history
from polestar_jax.decode.polestar_v.select import Selection, select, unit
from polestar_jax.decode.polestar_v.state import V_STATE, VConfig, VState
from polestar_jax.decode.rows import batch_any
from polestar_jax.decode.state import DecodeState, select_rows
from polestar_jax.models.family import family_of
from polestar_jax.models.llada import rms_norm


class VStepOut(NamedTuple):
    """What one decode step decided, per row: ``active``, ``refresh`` (a cluster refresh), ``prefix`` (the
    periodic full pass) [b] bool; ``start`` [b] int32 the first recomputed index; ``drift``, ``delta``
    [b, B] f32; ``clusters`` / ``own`` [b, K] bool the selected clusters (injected in a replay) and this
    implementation's choice; ``labels_differ`` [b] int32; ``commit_threshold`` / ``commit_early`` [b, B]."""

    active: jax.Array
    refresh: jax.Array
    prefix: jax.Array
    start: jax.Array
    drift: jax.Array
    delta: jax.Array
    clusters: jax.Array
    own: jax.Array
    labels_differ: jax.Array
    commit_threshold: jax.Array
    commit_early: jax.Array


class Pass(NamedTuple):
    """One forward's results: ``hidden`` [b, L, D] the stored final hidden states with the pass's rows
    written, ``logits`` [b, B, V] of the block, ``k`` / ``v`` the cache after the pass."""

    hidden: jax.Array
    logits: jax.Array
    k: jax.Array
    v: jax.Array


def _prompt_slot(ctx: BlockCtx, state: DecodeState) -> int:
    return state.x.shape[1] - ctx.spec.gen_length


def full_length_pass(ctx: BlockCtx, state: DecodeState, write_from: jax.Array, keys_from: jax.Array,
                     rows: jax.Array) -> Pass:
    """A pass with every position as a query: per row, the K/V from index ``write_from`` [b] on are this
    pass's (before it the cache's), keys before ``keys_from`` [b] are hidden, and the hidden states from
    ``write_from`` on are stored; ``rows`` [b] bool: rows whose cache and store it may write."""
    cfg, fam = ctx.cfg, family_of(ctx.cfg)
    idx = jnp.arange(state.x.shape[1])[None]
    write = (idx >= write_from[:, None]) & rows[:, None]
    keys = state.key_valid & (idx >= keys_from[:, None])
    out = fam.forward(ctx.params, state.x, cfg, state.pos, state.pos, keys, (state.k_cache, state.v_cache),
                      start=0, write=write, unroll=ctx.spec.unroll, rotated_cache=True)
    final = rms_norm(out.h, ctx.params["ln_f"], cfg.rms_norm_eps).astype(state.policy_state.hidden.dtype)
    hidden = jnp.where(write[..., None], final, state.policy_state.hidden)
    return Pass(hidden, fam.head_at(ctx.params, out.h, cfg, ctx.cs, ctx.block), *out.kv)


def prefix_pass(ctx: BlockCtx, state: DecodeState, rows: jax.Array) -> Pass:
    """The prefix-cache step: the generated region as queries (the block and every row after it take this
    pass's K/V, the rows before the block the cache's); stores the hidden states from the block on. The
    cache it returns holds this pass's rows from the block on (no pass reads them before another rewrites
    them; keeping the old cache instead would make XLA copy the whole cache at every step)."""
    cfg, fam = ctx.cfg, family_of(ctx.cfg)
    p0 = _prompt_slot(ctx, state)
    g = jnp.arange(state.x.shape[1] - p0)
    write = jnp.broadcast_to(g >= ctx.cs - p0, (state.x.shape[0], g.shape[0]))
    out = fam.forward(ctx.params, state.x[:, p0:], cfg, state.pos[:, p0:], state.pos, state.key_valid,
                      (state.k_cache, state.v_cache), start=p0, write=write, unroll=ctx.spec.unroll,
                      rotated_cache=True)
    old = state.policy_state.hidden
    final = rms_norm(out.h, ctx.params["ln_f"], cfg.rms_norm_eps).astype(old.dtype)
    region = jnp.where((write & rows[:, None])[..., None], final, old[:, p0:])
    hidden = lax.dynamic_update_slice_in_dim(old, region, p0, axis=1)
    return Pass(hidden, fam.head_at(ctx.params, out.h, cfg, ctx.cs - p0, ctx.block), *out.kv)


def _predict(ctx: BlockCtx, state: DecodeState, logits, masked):
    if not ctx.spec.stochastic:
        return predict(logits, masked, ctx.cfg.mask_token_id)
    return predict(logits, masked, ctx.cfg.mask_token_id, ctx.knobs.temperature, noise_keys(state.rng, state.nfe))


def start(ctx: BlockCtx, state: DecodeState) -> DecodeState:
    """The block start: a full pass (cache, stored hidden states) and the threshold commit."""
    live = ctx.live
    zero = jnp.zeros_like(live, jnp.int32)
    p = full_length_pass(ctx, state, zero, zero, live)
    masked = ctx.masked(state)
    pred = _predict(ctx, state, p.logits, masked)
    transfer = commit_threshold(pred.conf, masked, ctx.knobs.threshold) & live[:, None]
    new = write_commits(state, transfer, pred.x0, start=ctx.cs, count=live)
    pol: VState = state.policy_state
    bi = ctx.block_idx
    pol = pol.replace(hidden=p.hidden, hist=jnp.zeros_like(pol.hist), hist_fill=jnp.zeros_like(pol.hist_fill),
                      counter=jnp.zeros_like(pol.counter), last_commits=jnp.sum(transfer, axis=1).astype(jnp.int32),
                      full_pass=pol.full_pass.at[:, bi].set(1), processed=pol.processed.at[:, bi].set(True))
    new = new.replace(k_cache=p.k, v_cache=p.v, policy_state=pol)
    return select_rows(live, new, state)


def _no_selection(ctx: BlockCtx, b: int) -> Selection:
    k = ctx.spec.own_config.n_clusters
    return Selection(jnp.full((b,), ctx.cs, jnp.int32), jnp.zeros((b,), bool), jnp.zeros((b, k), bool),
                     jnp.zeros((b, k), bool), jnp.zeros((b, k), jnp.float32), jnp.zeros((b,), jnp.int32))


def _early(vc: VConfig, ctx: BlockCtx, conf, masked, delta):
    """The early commit: ``early_threshold < conf < threshold`` and ``gate <= delta < gate_max_delta``."""
    if vc.early_threshold is None:
        return jnp.zeros_like(masked)
    gate = vc.gate_scale * jnp.square(jnp.maximum(vc.gate_center - conf, 0.0))
    return (masked & (conf > vc.early_threshold) & (conf < ctx.knobs.threshold) & (delta >= gate)
            & (delta < vc.gate_max_delta))


def step(ctx: BlockCtx, state: DecodeState, i, active) -> tuple[DecodeState, VStepOut]:
    """One decode step (one pass) of every active row."""
    vc: VConfig = ctx.spec.own_config
    pol: VState = state.policy_state
    b = state.x.shape[0]
    prev = ctx.rows(pol.hidden)  # [b, B, D] the block's final hidden states before the pass
    trigger = active & ((pol.last_commits > vc.trigger_commits) | (pol.counter > vc.trigger_accum))
    sel = lax.cond(batch_any(trigger),
                   lambda: select(pol.hidden, state.key_valid, prev, state.rng, state.nfe - 1, ctx.cs, ctx.block,
                                  _prompt_slot(ctx, state), vc, ctx.replay),
                   lambda: _no_selection(ctx, b))
    refresh = trigger & sel.any
    prefix = active & ~refresh & ((i + 1) % vc.refresh_interval == 0)
    fresh = refresh | prefix
    first = jnp.where(refresh, sel.start, 0).astype(jnp.int32)
    write_from = jnp.where(fresh, first, ctx.cs).astype(jnp.int32)
    p = lax.cond(batch_any(fresh),
                 lambda: full_length_pass(ctx, state, write_from, jnp.where(fresh, first, 0), active),
                 lambda: prefix_pass(ctx, state, active))
    d = 1.0 - jnp.sum(unit(ctx.rows(p.hidden)) * unit(prev), axis=-1)  # [b, B]
    delta = drift_delta(d, pol.hist, pol.hist_fill)
    hist, fill = push_history(pol.hist, pol.hist_fill, d)
    masked = ctx.masked(state)
    pred = _predict(ctx, state, p.logits, masked)
    thr = commit_threshold(pred.conf, masked, ctx.knobs.threshold) & active[:, None]
    early = _early(vc, ctx, pred.conf, masked, delta) & active[:, None]
    commit = thr | early
    n = jnp.sum(commit, axis=1).astype(jnp.int32)
    new = write_commits(state, commit, pred.x0, start=ctx.cs, count=active)
    bi = ctx.block_idx
    new_pol = pol.replace(
        hidden=p.hidden, hist=hist, hist_fill=fill, counter=jnp.where(refresh, 0, pol.counter) + n, last_commits=n,
        refresh_steps=pol.refresh_steps.at[:, bi].add(refresh.astype(jnp.int32)),
        prefix_refresh=pol.prefix_refresh.at[:, bi].add(prefix.astype(jnp.int32)),
        early=pol.early + jnp.sum(early & ~thr, axis=1).astype(jnp.int32))
    new = new.replace(k_cache=p.k, v_cache=p.v, policy_state=new_pol)
    out = VStepOut(active, refresh, prefix, write_from, d, delta, sel.clusters & refresh[:, None],
                   sel.own & refresh[:, None], jnp.where(refresh, sel.labels_differ, 0), thr, early & ~thr)
    return select_rows(active, new, state), out


def empty_steps(ctx: BlockCtx, n_steps: int) -> VStepOut:
    """A zero buffer for ``n_steps`` :class:`VStepOut` (leading axis: the step within the block)."""
    b, blk, k = ctx.n_masked0.shape[0], ctx.block, ctx.spec.own_config.n_clusters
    z = lambda *s, dt=jnp.float32: jnp.zeros((n_steps,) + s, dt)
    return VStepOut(z(b, dt=bool), z(b, dt=bool), z(b, dt=bool), z(b, dt=jnp.int32), z(b, blk), z(b, blk),
                    z(b, k, dt=bool), z(b, k, dt=bool), z(b, dt=jnp.int32), z(b, blk, dt=bool), z(b, blk, dt=bool))


POLICY = Policy(start=start, active=lambda ctx, state, i: jnp.any(ctx.masked(state), axis=1), step=step,
                bound=lambda ctx: ctx.block, empty_stats=empty_steps, own=V_STATE)
register_policy("polestar_v", POLICY)
