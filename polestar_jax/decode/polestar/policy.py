"""Polestar: drift-guided sparse cache refresh and early commit, as a policy of the block program
(:mod:`polestar_jax.decode.block`) on top of the dual-cache decoder (``docs/algorithm.md#polestar``).

1. **Block start** (:func:`start`): the full or windowed forward of :mod:`polestar_jax.decode.polestar.start`
   (cache, stored and clustered refresh rows, ``s_prev``, ``p_prev``) and the threshold commit. A row
   whose block is already filled (by suffix commits) skips it: no forward, no statistics.
2. **Decode steps** (:func:`step`) until the block has no mask: one forward of the block against the
   cache (:mod:`polestar_jax.decode.polestar.step`). When the previous step committed more than
   ``trigger_commits`` tokens (or the commits since the last refresh exceed ``trigger_accum``) the step
   *refreshes* the top-drift clusters of the window. The token drift of the last layer drives early
   commits (Polestar-Commit); refreshed suffix rows of the last layer may commit ahead of their block.

The state lives in :class:`polestar_jax.decode.polestar.state.PolestarState`; the random and tied decisions
(k-means draws, cluster selections) in :mod:`polestar_jax.decode.polestar.draws`.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from polestar_jax.decode.policy import BlockCtx, Policy, register_policy, write_commits
from polestar_jax.decode.commit import Prediction, commit_threshold, gumbel_noise, noise_keys, predict
from polestar_jax.decode.polestar.draws import at_forward, block_start_draws
from polestar_jax.decode.polestar.drift import drift_delta, push_history
from polestar_jax.models.family import family_of
from polestar_jax.decode.polestar.start import cluster_layers, start_pass
from polestar_jax.decode.polestar.state import POLESTAR_STATE, geometry, rows_at
from polestar_jax.decode.polestar.step import StepForwardOut, step_layers, step_tail
from polestar_jax.decode.rows import batch_any
from polestar_jax.decode.state import DecodeState, select_rows


class StepOut(NamedTuple):
    """What one decode step computed, per row: the drift statistics and the commit masks.

    active/cluster [b] bool; token_drift, delta [b, B]; cluster_scores [b, N, K] (-inf on invalid slots);
    selected [b, N, K] clusters refreshed; own_selected [b, N, K] what this implementation would have chosen
    (differs from ``selected`` only in replay); refreshed_rows [b, N] rows recomputed; moved_rows [b, N]
    stored rows read in the refresh (the compact widths of :mod:`polestar_jax.decode.polestar.compaction`: what moves from a
    host store to the device; R on every refreshing layer for a store in device memory, read whole);
    commit_threshold, commit_early [b, B]; commit_suffix [b, Ws].
    """

    active: jax.Array
    cluster: jax.Array
    token_drift: jax.Array
    delta: jax.Array
    cluster_scores: jax.Array
    selected: jax.Array
    own_selected: jax.Array
    refreshed_rows: jax.Array
    moved_rows: jax.Array
    commit_threshold: jax.Array
    commit_early: jax.Array
    commit_suffix: jax.Array


def _predict(ctx: BlockCtx, state: DecodeState, logits, cand, salt: int = 0) -> Prediction:
    """The commit rules' prediction; with a temperature (``spec.stochastic``) the argmax is over
    Gumbel-perturbed logits keyed by the row and its forward count, as for the other decoders."""
    cfg = ctx.cfg
    if not ctx.spec.stochastic:
        return predict(logits, cand, cfg.mask_token_id)
    return predict(logits, cand, cfg.mask_token_id, ctx.knobs.temperature,
                   noise_keys(state.rng, state.nfe, salt))


#: the salt of each part of a step's scored rows (:func:`_score`): the suffix rows draw their own noise
_SALTS = {"block": 0, "suffix": 2}


def _score(ctx: BlockCtx, state: DecodeState):
    """The step's scoring (:data:`polestar_jax.decode.polestar.step.Score`): :func:`_predict` of every row, the
    block's and the suffix's in one pass over the logits (each part with its own noise), conf unmasked."""
    def score(logits, parts) -> Prediction:
        every = jnp.ones(logits.shape[:2], bool)
        if not ctx.spec.stochastic:
            return predict(logits, every, ctx.cfg.mask_token_id)
        noise = jnp.concatenate([gumbel_noise(noise_keys(state.rng, state.nfe, _SALTS[name]), (n,) + logits.shape[2:])
                                 for name, n in parts], axis=1)
        return predict(logits, every, ctx.cfg.mask_token_id, ctx.knobs.temperature, noise=noise)
    return score


def _masked(pred: Prediction, cand: jax.Array) -> Prediction:
    """``pred`` (conf on every row) with conf -inf where ``cand`` is False, as :func:`predict` masks it."""
    return Prediction(pred.x0, jnp.where(cand, pred.conf, -jnp.inf))


def _windowed(ctx: BlockCtx):
    period = ctx.spec.own_config.windowed_period
    if not period:
        return jnp.bool_(False)
    return ctx.block_idx % period == period - 1


def start(ctx: BlockCtx, state: DecodeState) -> DecodeState:
    """The block-start pass and its threshold commit."""
    pc, block, spec = ctx.spec.own_config, ctx.block, ctx.spec
    windowed = _windowed(ctx)
    # the rows this block start clusters: its own window (a full pass's may differ from the windowed one)
    geo = geometry(state, ctx.cs, block, pc, window=pc.pass_window(block, False))
    if pc.windowed_period and pc.pass_window(block, True) != pc.pass_window(block, False):
        geo_w = geometry(state, ctx.cs, block, pc, window=pc.pass_window(block, True))
        geo = jax.tree.map(lambda w, f: jnp.where(windowed, w, f), geo_w, geo)
    draws = block_start_draws(state, geo, ctx.cfg, pc, block, ctx.replay)
    masked = ctx.masked(state)
    active = jnp.any(masked, axis=1)
    # a row whose block has no mask left (pre-committed whole) skips the block: its start never happens, its
    # cache included (the pass leaves that row's K/V as they are, in place; once a block: the decode steps
    # write K/V for their active rows only)
    run = lambda w: (lambda: start_pass(ctx.params, state, geo, ctx.cfg, pc, block, w, spec.unroll, skip=~active))
    if not pc.windowed_period:
        out = run(False)()
    elif not spec.per_row:  # every row at the same block: one pass or the other
        out = lax.cond(windowed, run(True), run(False))
    else:  # rows at different blocks may need different passes: the windowed pass when every live row takes
        # one; else one full-length pass in which the windowed rows keep their cached K/V outside their window
        # (their window rows compute what the windowed pass computes: one pass, not two, for a mixed batch)
        only_w = ~batch_any(~windowed & ctx.live)
        mixed = lambda: start_pass(ctx.params, state, geo, ctx.cfg, pc, block, False, spec.unroll, keep=windowed,
                                   skip=~active)
        out = lax.cond(only_w, run(True), mixed)
    out = cluster_layers(ctx.params, out, state, geo, ctx.cfg, pc, block, draws, spec.unroll)
    pol = state.policy_state
    pred = _predict(ctx, state, out.logits, masked)
    transfer = commit_threshold(pred.conf, masked, ctx.knobs.threshold) & active[:, None]
    bi = ctx.block_idx
    new_pol = pol.replace(
        hs=out.hs, hs_scale=out.hs_scale, labels=out.clusters.labels, centroids=out.clusters.centroids,
        counts=out.clusters.counts, n_clusters=out.clusters.n, s_prev=out.s_prev, p_prev=out.p_prev,
        hist=jnp.zeros_like(pol.hist), hist_fill=jnp.zeros_like(pol.hist_fill), counter=jnp.zeros_like(pol.counter),
        last_commits=jnp.sum(transfer, axis=1).astype(jnp.int32),
        full_pass=pol.full_pass.at[:, bi].set(jnp.where(windowed, 0, 1)),
        windowed=pol.windowed.at[:, bi].set(jnp.where(windowed, 1, 0)),
        processed=pol.processed.at[:, bi].set(True))
    # (the windowed pass keeps the K/V outside the window; the refresh rows are all inside it)
    new = write_commits(state.replace(k_cache=out.k, v_cache=out.v, policy_state=new_pol), transfer, pred.x0,
                        start=ctx.cs, count=jnp.ones_like(active))
    return select_rows(active, new, state)


def _refresh_rows(ctx: BlockCtx, state: DecodeState, active):
    """Which rows refresh in this step, and the commit counter after the decision."""
    pc, pol = ctx.spec.own_config, state.policy_state
    counter = pol.counter + pol.last_commits
    cluster = active & ((pol.last_commits > pc.trigger_commits) | (counter > pc.trigger_accum)) & pc.refresh
    return cluster, jnp.where(cluster, 0, counter)


def _forward(ctx: BlockCtx, state: DecodeState, geo, cluster, active) -> StepForwardOut:
    pc = ctx.spec.own_config
    forced = None
    if ctx.replay is not None:
        at = lambda a: jnp.swapaxes(at_forward(a, state.nfe), 0, 1)
        forced = (at(ctx.replay.topk), at(ctx.replay.topk_forced))
    # (the logits are scored inside each layer pass: no logits leave the branch between them)
    fwd = lambda r: (lambda: step_layers(ctx.params, state, geo, ctx.cfg, pc, ctx.block, r, cluster, forced,
                                         ctx.spec.unroll, write_rows=active, score=_score(ctx, state)))
    lay = lax.cond(batch_any(cluster), fwd(True), fwd(False)) if pc.refresh else fwd(False)()
    return step_tail(ctx.params, state, ctx.cfg, pc, ctx.block, lay)  # (once, after either layer pass)


def _early(ctx: BlockCtx, conf, masked, delta, active):
    """Polestar-Commit: middling-confidence tokens whose drift rose past the gate."""
    pc = ctx.spec.own_config
    if pc.early_threshold is None:
        return jnp.zeros_like(masked)
    gate = pc.gate_scale * jnp.square(jnp.maximum(pc.gate_center - conf, 0.0))
    return (masked & (conf > pc.early_threshold) & (conf < ctx.knobs.threshold) & (delta >= gate)
            & (delta < pc.gate_max_delta) & active[:, None])


def _suffix(ctx: BlockCtx, state: DecodeState, new: DecodeState, out: StepForwardOut, geo, cluster, active):
    """Refreshed suffix rows of the last layer's packet that are confident commit ahead of their block.
    Returns (state, commit mask [b, Ws])."""
    pc, block = ctx.spec.own_config, ctx.block
    suf = pc.suffix_rows(block)
    if not (pc.suffix_precommit and suf):
        return new, jnp.zeros((state.x.shape[0], suf), bool)
    # a refreshed row predicts the position its family's logit shift says (LLaDA its own, Dream the next)
    suf_pos = ctx.cs + block + jnp.arange(suf) + family_of(ctx.cfg).logit_shift
    cand = (out.sel_suf & (rows_at(new.x, suf_pos) == ctx.cfg.mask_token_id) & geo.ref_valid[:, -suf:]
            & (suf_pos < state.x.shape[1])[None] & rows_at(new.key_valid, suf_pos)
            & (cluster & active)[:, None])
    sp = _masked(out.pred_suf, cand)
    commit = cand & (sp.conf >= ctx.knobs.threshold)
    return write_commits(new, commit, sp.x0, positions=suf_pos[None]), commit


def _tie_order(ctx: BlockCtx):
    """The decode step's tie-break order of the block positions (``PolestarConfig.tie_break``): None (the
    lower position first), or, with ``"shared_row"`` for a family whose logits are shifted, positions 1 and
    0 swapped: in a block-only forward both are predicted from the span's first row, so they tie exactly
    whenever both are masked, and the official Dream code's ``torch.topk`` commits position 1
    (docs/differences.md#d27)."""
    if ctx.spec.own_config.tie_break != "shared_row" or not family_of(ctx.cfg).logit_shift or ctx.block < 2:
        return None
    return np.concatenate([[1, 0], np.arange(2, ctx.block)])


def step(ctx: BlockCtx, state: DecodeState, i, active) -> tuple[DecodeState, StepOut]:
    """One Polestar decode step for every row that still has masks in its block."""
    pc, pol = ctx.spec.own_config, state.policy_state
    geo = geometry(state, ctx.cs, ctx.block, pc)
    cluster, counter = _refresh_rows(ctx, state, active)
    out = _forward(ctx, state, geo, cluster, active)
    delta = drift_delta(out.drift, pol.hist, pol.hist_fill)
    hist, fill = push_history(pol.hist, pol.hist_fill, out.drift)
    masked = ctx.masked(state)
    pred = _masked(out.pred, masked)
    thr = commit_threshold(pred.conf, masked, ctx.knobs.threshold, _tie_order(ctx)) & active[:, None]
    early = _early(ctx, pred.conf, masked, delta, active)
    new = write_commits(state, thr | early, pred.x0, start=ctx.cs)
    new, commit_suf = _suffix(ctx, state, new, out, geo, cluster, active)
    new_pol = pol.replace(
        hs=out.hs, hs_scale=out.hs_scale, centroids=out.centroids, s_prev=out.s_prev, p_prev=out.p_blk,
        hist=hist, hist_fill=fill, counter=counter, last_commits=jnp.sum(thr | early, axis=1).astype(jnp.int32),
        refresh_steps=pol.refresh_steps.at[:, ctx.block_idx].add(cluster.astype(jnp.int32)),
        early=pol.early + jnp.sum(early & ~thr, axis=1).astype(jnp.int32),
        suffix=pol.suffix + jnp.sum(commit_suf, axis=1).astype(jnp.int32))
    new = new.replace(k_cache=out.k, v_cache=out.v, policy_state=new_pol, nfe=state.nfe + 1)
    sw = lambda a: jnp.swapaxes(a, 0, 1)
    stats = StepOut(active, cluster, out.drift, delta, sw(out.scores), sw(out.selected), sw(out.own),
                    sw(out.n_rows), sw(out.moved_rows), thr, early & ~thr, commit_suf)
    return select_rows(active, new, state, in_step=True), stats


def empty_steps(ctx: BlockCtx, n_steps: int, b: Optional[int] = None) -> StepOut:
    """A zero buffer for ``n_steps`` StepOuts (leading axis = step within the block)."""
    cfg, pc, block = ctx.cfg, ctx.spec.own_config, ctx.block
    b = ctx.n_masked0.shape[0] if b is None else b
    n, k, suf = cfg.n_layers, pc.n_clusters, pc.suffix_rows(block)
    z = lambda *s, dt=jnp.float32: jnp.zeros((n_steps,) + s, dt)
    return StepOut(z(b, dt=bool), z(b, dt=bool), z(b, block), z(b, block),
                   z(b, n, k), z(b, n, k, dt=bool), z(b, n, k, dt=bool), z(b, n, dt=jnp.int32), z(b, n, dt=jnp.int32),
                   z(b, block, dt=bool), z(b, block, dt=bool), z(b, suf, dt=bool))


def active_rows(ctx: BlockCtx, state: DecodeState, i) -> jax.Array:
    return jnp.any(ctx.masked(state), axis=1)


POLICY = Policy(start=start, active=active_rows, step=step, bound=lambda ctx: ctx.block + 1,
                empty_stats=lambda ctx, n: empty_steps(ctx, n), own=POLESTAR_STATE)
register_policy("polestar", POLICY)


def block_start(params, state: DecodeState, block_idx, mcfg, dcfg) -> DecodeState:
    """Polestar's block start for ``dcfg`` outside the block program (tests, benches, step timing)."""
    from polestar_jax.decode.policy import EngineSpec, Knobs, context

    spec = EngineSpec.from_config(mcfg, dcfg)
    return start(context(params, state, block_idx, Knobs.from_config(dcfg), None, spec), state)
