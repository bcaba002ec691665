"""The compiled block decoder: one block of masked tokens per call, as a ``lax.while_loop`` of forwards.

Every sampler is a configuration of the same engine (:class:`EngineSpec`):

* ``llada``: ``steps_per_block`` full forwards per block, a fixed number of commits each (LLaDA
  ``generate``: a ``for`` loop, so the forward count is exact even when the block fills early).
* ``fastdllm``, ``cache="none"``: full forwards until the block has no mask (at least one).
* ``fastdllm``, ``cache="prefix"``: one full forward that caches K/V, then forwards of the positions from
  the block start to the end against the cached prefix K/V; ``cache="dual"``: forwards of the block only,
  against cached prefix *and* suffix K/V (Fast-dLLM's ``replace_position``). Both run the step loop at
  least once after the full forward, as the reference does (that forward counts in NFE).

Per row, a block is "active" while it still has masks (or the first, forced iteration); finished rows of a
batch wait without changing. The mask token is never committed and every loop is bounded.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from polestar_jax import commit as commit_rules
from polestar_jax import model as M
from polestar_jax.config import DecodeConfig, ModelConfig, PolestarConfig
from polestar_jax.state import DecodeState


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """The structural (compile-time) part of a decode configuration. Float knobs are passed as
    :class:`Knobs` so that changing a threshold does not recompile."""

    model: ModelConfig
    decoder: str
    cache: str
    rule: str
    gen_length: int
    block_length: int
    steps_per_block: int
    stochastic: bool  # temperature > 0
    random_remask: bool
    step_after_full_pass: bool = True
    polestar: Optional[PolestarConfig] = None  # set for decoder "polestar"

    @classmethod
    def from_config(cls, mcfg: ModelConfig, dcfg: DecodeConfig) -> "EngineSpec":
        return cls(model=mcfg, decoder=dcfg.decoder, cache=dcfg.cache, rule=dcfg.rule,
                   gen_length=dcfg.gen_length, block_length=dcfg.block_length,
                   steps_per_block=dcfg.steps_per_block, stochastic=dcfg.temperature > 0,
                   random_remask=dcfg.remasking == "random",
                   step_after_full_pass=dcfg.step_after_full_pass,
                   polestar=dcfg.polestar if dcfg.decoder == "polestar" else None)


class Knobs(NamedTuple):
    """Run-time scalars of a decode configuration (float32 arrays)."""

    threshold: jax.Array
    factor: jax.Array
    temperature: jax.Array

    @classmethod
    def from_config(cls, dcfg: DecodeConfig) -> "Knobs":
        f = lambda v: jnp.float32(0.0 if v is None else v)
        return cls(f(dcfg.threshold), f(dcfg.factor), f(dcfg.temperature))


def _blk(a: jax.Array, start, length: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(a, start, length, axis=1)


def full_forward(params, state: DecodeState, spec: EngineSpec, cs, keep_cache: bool):
    """Forward of the whole sequence; returns block logits [b, B, V] and (when ``keep_cache``) the state
    with its K/V cache replaced by this pass's K/V."""
    cfg = spec.model
    out = M.forward(params, state.x, cfg, state.pos, state.pos, state.key_valid)
    logits = M.lm_head(params, _blk(out.h, cs, spec.block_length), cfg)
    if keep_cache:
        state = state.replace(k_cache=out.kv[0], v_cache=out.kv[1])
    return logits, state


def cached_forward(params, state: DecodeState, spec: EngineSpec, cs):
    """One decode-step forward against the K/V cache; returns block logits [b, B, V] and the state."""
    cfg, B = spec.model, spec.block_length
    cache = (state.k_cache, state.v_cache)
    if spec.cache == "dual":
        out = M.forward(params, _blk(state.x, cs, B), cfg, _blk(state.pos, cs, B), state.pos,
                        state.key_valid, cache, start=cs)
        k = lax.dynamic_update_slice_in_dim(state.k_cache, out.kv[0], cs, axis=3)
        v = lax.dynamic_update_slice_in_dim(state.v_cache, out.kv[1], cs, axis=3)
        return M.lm_head(params, out.h, cfg), state.replace(k_cache=k, v_cache=v)
    # prefix cache: recompute every generated position from the block start on against the cached prefix
    # (queries are the whole static generation region; rows before the block keep their cached K/V).
    p0 = state.x.shape[1] - spec.gen_length
    g = jnp.arange(spec.gen_length)
    write = jnp.broadcast_to(g >= cs - p0, (state.x.shape[0], spec.gen_length))
    out = M.forward(params, state.x[:, p0:], cfg, state.pos[:, p0:], state.pos, state.key_valid,
                    cache, start=p0, write=write)
    return M.lm_head(params, _blk(out.h, cs - p0, B), cfg), state


def apply_commits(state: DecodeState, spec: EngineSpec, knobs: Knobs, logits, cs, n_masked0, i, active):
    """Runs the commit rule on the block logits [b, B, V] and writes the committed tokens.

    ``i``: index of this forward within the block (for the fixed schedule); ``active`` [b]: rows that
    take part (a finished row neither commits nor counts a forward). Returns (state, transfer [b, B]).
    """
    cfg, B = spec.model, spec.block_length
    blk_x = _blk(state.x, cs, B)
    masked = blk_x == cfg.mask_token_id
    keys = None
    if spec.stochastic or spec.random_remask:
        keys = jax.vmap(lambda k, n: jax.random.fold_in(jax.random.wrap_key_data(k), n))(state.rng, state.nfe)
        keys = jax.vmap(jax.random.key_data)(keys)
    pred = commit_rules.predict(logits, masked, cfg.mask_token_id, knobs.temperature,
                                keys if spec.stochastic or spec.random_remask else None, spec.random_remask)
    if spec.rule == "fixed":
        transfer = commit_rules.commit_fixed(pred.conf, masked,
                                             commit_rules.fixed_schedule(n_masked0, spec.steps_per_block, i))
    elif spec.rule == "threshold":
        transfer = commit_rules.commit_threshold(pred.conf, masked, knobs.threshold)
    else:
        transfer = commit_rules.commit_factor(pred.conf, masked, knobs.factor)
    transfer = transfer & active[:, None]
    x = lax.dynamic_update_slice_in_dim(state.x, jnp.where(transfer, pred.x0, blk_x), cs, axis=1)
    cstep = jnp.where(transfer, state.nfe[:, None], _blk(state.commit_step, cs, B))
    commit_step = lax.dynamic_update_slice_in_dim(state.commit_step, cstep, cs, axis=1)
    nfe = state.nfe + active.astype(jnp.int32)
    return state.replace(x=x, commit_step=commit_step, nfe=nfe), transfer


def decode_block(params, state: DecodeState, block_idx, knobs: Knobs, spec: EngineSpec) -> DecodeState:
    """Decodes block ``block_idx`` (a traced int32) of every row; pure (jitted through :data:`run_block_jit`)."""
    cfg, B = spec.model, spec.block_length
    cs = (state.x.shape[1] - spec.gen_length) + block_idx * B
    has_mask = lambda s: jnp.any(_blk(s.x, cs, B) == cfg.mask_token_id, axis=1)
    n_masked0 = jnp.sum(_blk(state.x, cs, B) == cfg.mask_token_id, axis=1).astype(jnp.int32)
    b = state.x.shape[0]
    nfe_before = state.nfe
    i0 = 0
    if spec.cache != "none":
        logits, state = full_forward(params, state, spec, cs, keep_cache=True)
        state, _ = apply_commits(state, spec, knobs, logits, cs, n_masked0, jnp.int32(0), jnp.ones((b,), bool))
        i0 = 1

    def active_rows(s, i, force):
        if spec.decoder == "llada":
            return jnp.broadcast_to(i < spec.steps_per_block, (b,))
        return force | has_mask(s)

    bound = spec.steps_per_block if spec.decoder == "llada" else B + 2

    def cond(carry):
        s, i, force = carry
        return jnp.any(active_rows(s, i, force)) & (i < bound)

    def body(carry):
        s, i, force = carry
        active = active_rows(s, i, force)
        if spec.cache == "none":
            logits, s = full_forward(params, s, spec, cs, keep_cache=False)
        else:
            logits, s = cached_forward(params, s, spec, cs)
        s, _ = apply_commits(s, spec, knobs, logits, cs, n_masked0, i, active)
        return s, i + 1, jnp.bool_(False)

    force = spec.step_after_full_pass or spec.cache == "none"
    state, _, _ = lax.while_loop(cond, body, (state, jnp.int32(i0), jnp.bool_(force)))
    block_nfe = state.block_nfe.at[:, block_idx].set(state.nfe - nfe_before)
    return state.replace(block_nfe=block_nfe)


def run_block(params, state: DecodeState, block_idx, knobs: Knobs, replay, spec: EngineSpec):
    """One block for any decoder: returns ``(state, steps)`` where ``steps`` is Polestar's per-step
    :class:`polestar_jax.polestar.StepOut` buffer (None for the other decoders). ``replay``: Polestar
    decisions taken from a PyTorch trace (or None)."""
    if spec.polestar is None:
        return decode_block(params, state, block_idx, knobs, spec), None
    from polestar_jax import polestar

    return polestar.decode_block(params, state, block_idx, knobs.threshold, spec.model, spec.polestar,
                                 spec.block_length, spec.gen_length, replay)


run_block_jit = jax.jit(run_block, static_argnames=("spec",), donate_argnames=("state",))
