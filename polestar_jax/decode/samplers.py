"""The LLaDA and Fast-dLLM decoding policies of the block program (:mod:`polestar_jax.decode.block`).

* ``llada``: ``steps_per_block`` full forwards per block, a fixed number of commits each (LLaDA
  ``generate``: a ``for`` loop, so the forward count is exact even when the block fills early).
* ``fastdllm``, ``cache="none"``: full forwards until the block has no mask (at least one).
* ``fastdllm``, ``cache="prefix"``: a start forward of the whole sequence caches K/V, then forwards of the
  positions from the block start to the end against the cached prefix K/V; ``cache="dual"``: forwards of
  the block only, against cached prefix *and* suffix K/V (Fast-dLLM's ``replace_position``). With
  ``step_after_full_pass`` (the reference) the step loop runs at least once after the start forward, even
  when that forward filled the block (it counts in NFE).

The commit rules are those of :mod:`polestar_jax.decode.commit`; the mask token is never committed. Policy
parameters for other reference loops (Dream's, ``docs/algorithm.md#dream``): ``start_commit="first"`` (the
start forward commits only the block's first position), the fixed rule's ``schedule="timesteps"`` and
``rank_by="neg_entropy"``. The logit alignment is the model family's (``Family.head_at``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from polestar_jax.decode import commit as commit_rules
from polestar_jax.decode.policy import BlockCtx, EngineSpec, Policy, register_policy, write_commits
from polestar_jax.models.family import family_of
from polestar_jax.decode.state import DecodeState


def full_forward(params, state: DecodeState, spec: EngineSpec, cs, keep_cache: bool):
    """Forward of the whole sequence; returns block logits [b, B, V] and (when ``keep_cache``) the state
    with its K/V cache replaced by this pass's K/V. The Fast-dLLM caches hold rotated keys (rotated once,
    where they are written: ``llada.layer``'s ``rotated_cache``), so a cached step rotates only its rows."""
    cfg = spec.model
    fam = family_of(cfg)
    out = fam.forward(params, state.x, cfg, state.pos, state.pos, state.key_valid, unroll=spec.unroll,
                      into=(state.k_cache, state.v_cache) if keep_cache else None, rotated_cache=keep_cache)
    if keep_cache:
        state = state.replace(k_cache=out.kv[0], v_cache=out.kv[1])
    return fam.head_at(params, out.h, cfg, cs, spec.block_length), state


def cached_forward(params, state: DecodeState, spec: EngineSpec, cs):
    """One decode-step forward against the K/V cache; returns block logits [b, B, V] and the state."""
    cfg, B = spec.model, spec.block_length
    fam = family_of(cfg)
    cache = (state.k_cache, state.v_cache)
    blk = lambda a: jax.lax.dynamic_slice_in_dim(a, cs, B, axis=1)
    if spec.cache == "dual":
        out = fam.forward(params, blk(state.x), cfg, blk(state.pos), state.pos, state.key_valid, cache, start=cs,
                          unroll=spec.unroll, rotated_cache=True)
        return fam.head_at(params, out.h, cfg, 0, B), state.replace(k_cache=out.kv[0], v_cache=out.kv[1])
    # prefix cache: recompute every generated position from the block start on against the cached prefix
    # (queries are the whole static generation region; rows before the block keep their cached K/V; the
    # rows from the block on take this step's K/V, which no pass reads before another rewrites them: keeping
    # the start forward's cache instead would copy the whole cache at every step).
    p0 = state.x.shape[1] - spec.gen_length
    write = jnp.broadcast_to(jnp.arange(spec.gen_length) >= cs - p0, (state.x.shape[0], spec.gen_length))
    out = fam.forward(params, state.x[:, p0:], cfg, state.pos[:, p0:], state.pos, state.key_valid, cache,
                      start=p0, write=write, unroll=spec.unroll, rotated_cache=True)
    return fam.head_at(params, out.h, cfg, cs - p0, B), state.replace(k_cache=out.kv[0], v_cache=out.kv[1])


def commit(ctx: BlockCtx, state: DecodeState, logits, i, active, first_only: bool = False) -> DecodeState:
    """The commit rule on the block logits [b, B, V] for the ``i``-th forward of the block (the fixed
    schedule's index); ``active`` [b]: rows that take part (a finished row neither commits nor counts).
    ``first_only``: commit the block's first position (if masked) and nothing else (``start_commit="first"``)."""
    spec, cfg = ctx.spec, ctx.cfg
    masked = ctx.masked(state)
    keys = commit_rules.noise_keys(state.rng, state.nfe) if spec.stochastic or spec.random_remask else None
    pred = commit_rules.predict(logits, masked, cfg.mask_token_id, ctx.knobs.temperature, keys,
                                spec.random_remask)
    if first_only:
        transfer = masked & (jnp.arange(masked.shape[1]) == 0)[None]
    elif spec.rule == "fixed":
        if spec.schedule == "timesteps":
            k = commit_rules.timestep_schedule(jnp.sum(masked, axis=1).astype(jnp.int32), spec.steps_per_block,
                                               i, spec.schedule_eps)
        else:
            k = commit_rules.fixed_schedule(ctx.n_masked0, spec.steps_per_block, i)
        score = pred.conf
        if spec.rank_by == "neg_entropy":
            score = jnp.where(masked, commit_rules.neg_entropy(logits), -jnp.inf)
        transfer = commit_rules.commit_fixed(score, masked, k)
    elif spec.rule == "threshold":
        transfer = commit_rules.commit_threshold(pred.conf, masked, ctx.knobs.threshold)
    else:
        transfer = commit_rules.commit_factor(pred.conf, masked, ctx.knobs.factor)
    return write_commits(state, transfer & active[:, None], pred.x0, start=ctx.cs, count=active)


def _cached(spec: EngineSpec) -> bool:
    return spec.cache != "none"


def start(ctx: BlockCtx, state: DecodeState) -> DecodeState:
    """Cached variants: the full forward that fills the cache, and its commits (every row)."""
    if not _cached(ctx.spec):
        return state
    logits, state = full_forward(ctx.params, state, ctx.spec, ctx.cs, keep_cache=True)
    return commit(ctx, state, logits, jnp.int32(0), jnp.ones((state.x.shape[0],), bool),
                  first_only=ctx.spec.start_commit == "first")


def active(ctx: BlockCtx, state: DecodeState, i) -> jax.Array:
    b = state.x.shape[0]
    if ctx.spec.decoder == "llada":
        return jnp.broadcast_to(i < ctx.spec.steps_per_block, (b,))
    forced = (ctx.spec.step_after_full_pass or not _cached(ctx.spec)) & (i == 0)
    return forced | jnp.any(ctx.masked(state), axis=1)


def step(ctx: BlockCtx, state: DecodeState, i, act):
    if _cached(ctx.spec):
        logits, state = cached_forward(ctx.params, state, ctx.spec, ctx.cs)
    else:
        logits, state = full_forward(ctx.params, state, ctx.spec, ctx.cs, keep_cache=False)
    return commit(ctx, state, logits, i + _cached(ctx.spec), act), None


def bound(ctx: BlockCtx) -> int:
    """LLaDA: its steps per block; Fast-dLLM: B + 2 forwards per block in all (every forward commits)."""
    if ctx.spec.decoder == "llada":
        return ctx.spec.steps_per_block
    if ctx.spec.schedule == "timesteps":  # may commit nothing in some steps; fills at its last step
        return max(ctx.block + 2, ctx.spec.steps_per_block + 1) - _cached(ctx.spec)
    return ctx.block + 2 - _cached(ctx.spec)


POLICY = Policy(start=start, active=active, step=step, bound=bound, empty_stats=lambda ctx, n: None)
register_policy("llada", POLICY)
register_policy("fastdllm", POLICY)
