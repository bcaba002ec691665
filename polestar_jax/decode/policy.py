"""What a decoding policy of the block program sees and returns (the leaf the policies and the block
program share): the structural configuration (:class:`EngineSpec`), the traced knobs (:class:`Knobs`), the
block context (:class:`BlockCtx`), the policy interface (:class:`Policy`) and the commit writer
(:func:`write_commits`). The block program itself, and the registry of policies, are in
:mod:`polestar_jax.decode.block`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from polestar_jax.config import DecodeConfig, ModelConfig
from polestar_jax.decode.state import DecodeState, PolicyState
from polestar_jax.registry import Registry


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """The structural (compile-time) part of a decode configuration. Float knobs are passed as
    :class:`Knobs` so that changing a threshold does not recompile. ``unroll``: how the layer scans
    unroll (1: a loop; True: fully, which XLA's cost analysis needs to count every layer)."""

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
    own_config: Any = None  # the settings of the policy's own state (PolicyState.config_of: Polestar's PolestarConfig)
    unroll: int | bool = 1
    start_commit: str = "rule"  # DecodeConfig.start_commit
    schedule: str = "even"  # DecodeConfig.schedule (fixed rule)
    rank_by: str = "confidence"  # DecodeConfig.rank_by (fixed rule)
    schedule_eps: float = 1e-3  # DecodeConfig.schedule_eps
    stop_ids: tuple = ()  # early exit: a row stops after a finished block holding one of these (empty: off)
    per_row: bool = False  # rows at different blocks (a running batch with insertion); False: in lockstep
    #: per_row only: when at most this many rows are still active in a step, the step runs on them alone,
    #: gathered into a buffer of this many rows (0: every step runs on every row); see block.compact_width
    compact_rows: int = 0

    @classmethod
    def from_config(cls, mcfg: ModelConfig, dcfg: DecodeConfig, unroll: int | bool = 1,
                    stop_ids: tuple = (), platform: Optional[str] = None) -> "EngineSpec":
        """``stop_ids``: the family's stop tokens; they end a row early when ``dcfg.early_exit``.
        ``platform``: what the program is compiled for (the policy's settings may depend on it)."""
        return cls(model=mcfg, decoder=dcfg.decoder, cache=dcfg.cache, rule=dcfg.rule,
                   gen_length=dcfg.gen_length, block_length=dcfg.block_length,
                   steps_per_block=dcfg.steps_per_block, stochastic=dcfg.temperature > 0,
                   random_remask=dcfg.remasking == "random",
                   step_after_full_pass=dcfg.step_after_full_pass,
                   own_config=None if (own := POLICIES[dcfg.decoder].own) is None else own.config_of(dcfg, platform),
                   unroll=unroll,
                   start_commit=str(dcfg.start_commit), schedule=str(dcfg.schedule), rank_by=str(dcfg.rank_by),
                   schedule_eps=float(dcfg.schedule_eps),
                   stop_ids=tuple(sorted(int(t) for t in stop_ids)) if dcfg.early_exit else ())


class Knobs(NamedTuple):
    """Run-time scalars of a decode configuration (float32 arrays)."""

    threshold: jax.Array
    factor: jax.Array
    temperature: jax.Array

    @classmethod
    def from_config(cls, dcfg: DecodeConfig) -> "Knobs":
        f = lambda v: jnp.float32(0.0 if v is None else v)
        return cls(f(dcfg.threshold), f(dcfg.factor), f(dcfg.temperature))


class BlockCtx(NamedTuple):
    """What every policy function of one block sees (built once per block)."""

    params: Any
    spec: EngineSpec
    knobs: Knobs
    replay: Any  # Polestar decisions from a PyTorch trace, or None
    block_idx: jax.Array  # [] int32
    cs: jax.Array  # [] int32 absolute position of the block's first token
    n_masked0: jax.Array  # [b] int32 masks in the block when it started
    live: jax.Array  # [b] bool rows that decode this block (the others' results are discarded)

    @property
    def block(self) -> int:
        return self.spec.block_length

    @property
    def cfg(self) -> ModelConfig:
        return self.spec.model

    def rows(self, a: jax.Array) -> jax.Array:
        """The block's slice [b, B, ...] of a [b, L, ...] array."""
        return lax.dynamic_slice_in_dim(a, self.cs, self.block, axis=1)

    def masked(self, state: DecodeState) -> jax.Array:
        """[b, B] bool: the block's positions still masked."""
        return self.rows(state.x) == self.cfg.mask_token_id


class Policy(NamedTuple):
    """A decoding policy (see the module docstring)."""

    start: Callable[[BlockCtx, DecodeState], DecodeState]
    active: Callable[[BlockCtx, DecodeState, jax.Array], jax.Array]
    step: Callable[[BlockCtx, DecodeState, jax.Array, jax.Array], tuple[DecodeState, Any]]
    bound: Callable[[BlockCtx], int]
    empty_stats: Callable[[BlockCtx, int], Any]
    #: the hooks of the policy's own part of the decode state (``DecodeState.policy_state``); None: it keeps none
    own: Optional[PolicyState] = None


#: ``DecodeConfig.decoder`` -> its :class:`Policy` (:func:`register_policy` adds one; the block program
#: looks the decoder up here).
POLICIES: Registry[Policy] = Registry("decoder", builtins=("polestar_jax.decode.samplers",
                                                            "polestar_jax.decode.polestar.policy",
                                                            "polestar_jax.decode.polestar_v.policy"))


def register_policy(name: str, policy: Policy) -> Policy:
    """Makes ``policy`` the decoder ``name`` (a :class:`ValueError` if the name is taken); returns it."""
    return POLICIES.register(name, policy)


def block_start_position(state: DecodeState, spec: EngineSpec, block_idx) -> jax.Array:
    """Absolute position of block ``block_idx``'s first token (the prompt slot comes first)."""
    return jnp.asarray((state.x.shape[1] - spec.gen_length) + block_idx * spec.block_length, jnp.int32)


def write_commits(state: DecodeState, transfer: jax.Array, x0: jax.Array, start=None,
                  positions: Optional[jax.Array] = None, count: Optional[jax.Array] = None) -> DecodeState:
    """The commit writer: positions where ``transfer`` [b, T] is True take ``x0`` [b, T] and record the row's
    current forward number as their commit step. The T positions are ``start .. start+T-1`` (a block) or
    ``positions`` [b, T] / [T] (anywhere; out-of-range positions are dropped). ``count`` [b] bool: the rows
    whose forward count this write closes (``nfe += 1``); None leaves ``nfe`` alone."""
    if positions is None:
        t = transfer.shape[1]
        old_x = lax.dynamic_slice_in_dim(state.x, start, t, axis=1)
        old_c = lax.dynamic_slice_in_dim(state.commit_step, start, t, axis=1)
        x = lax.dynamic_update_slice_in_dim(state.x, jnp.where(transfer, x0, old_x), start, axis=1)
        cstep = jnp.where(transfer, state.nfe[:, None], old_c)
        commit_step = lax.dynamic_update_slice_in_dim(state.commit_step, cstep, start, axis=1)
    else:
        idx = jnp.where(transfer, positions, state.x.shape[1])
        bi = jnp.arange(state.x.shape[0])[:, None]
        x = state.x.at[bi, idx].set(x0, mode="drop")
        commit_step = state.commit_step.at[bi, idx].set(jnp.broadcast_to(state.nfe[:, None], idx.shape),
                                                        mode="drop")
    nfe = state.nfe if count is None else state.nfe + count.astype(jnp.int32)
    return state.replace(x=x, commit_step=commit_step, nfe=nfe)


def context(params, state: DecodeState, block_idx, knobs: Knobs, replay, spec: EngineSpec,
            live: Optional[jax.Array] = None) -> BlockCtx:
    """The :class:`BlockCtx` of block ``block_idx`` for ``state`` (as the block program builds it)."""
    cs = block_start_position(state, spec, block_idx)
    n_masked0 = jnp.sum(lax.dynamic_slice_in_dim(state.x, cs, spec.block_length, axis=1)
                        == spec.model.mask_token_id, axis=1).astype(jnp.int32)
    live = jnp.ones(n_masked0.shape, bool) if live is None else live
    return BlockCtx(params, spec, knobs, replay, jnp.asarray(block_idx, jnp.int32), cs, n_masked0, live)


def live_rows(state: DecodeState) -> jax.Array:
    """[b] bool: rows with a block left to decode (not a free slot, not finished, not stopped early)."""
    return (state.block < state.n_blocks) & ~state.stop
