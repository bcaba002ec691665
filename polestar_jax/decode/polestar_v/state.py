"""LLaDA-V's Polestar: its settings (:class:`VConfig`) and its part of the decode state (:class:`VState`).

The official LLaDA-V code keeps, besides the prefix K/V cache of the generic state, the final hidden states
(the output of the LM's last norm) of every position as last computed: k-means clusters them, and the block's
rows between two passes give its drift (``docs/algorithm.md#llada-vs-polestar``).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp

from polestar_jax.axes import axes
from polestar_jax.decode.state import PolicyState, tree_bytes


@dataclasses.dataclass(frozen=True)
class VConfig:
    """The settings of decoder ``polestar_v`` (hashable: part of the compiled program's key), read from the
    ``DecodeConfig.polestar`` fields it shares with the LLaDA path's Polestar (:meth:`from_decode`).

    n_clusters / kmeans_iters: the one k-means (cosine assignment, raw-mean centroids); top_k: clusters a
    refresh selects; back_blocks / ahead_blocks: the window's generated rows before / after the block (in
    block lengths; the whole prompt is always in it); trigger_commits / trigger_accum: a step refreshes when
    the previous step committed more than ``trigger_commits`` tokens or the commits since the last refresh
    exceed ``trigger_accum``; refresh_interval: every this many decode steps of a block without a refresh a
    full pass renews the prefix cache (the official ``prefix_refresh_interval``; not a flag: the official
    preset's ``interval`` never reaches it, docs/differences.md#d39); history, early_threshold, gate_*: the
    early commit as in the LLaDA path (drift here: cosine distance of the block's final hidden states).
    """

    n_clusters: int = 8
    kmeans_iters: int = 5
    top_k: int = 4
    back_blocks: int = 2
    ahead_blocks: int = 1
    trigger_commits: int = 1
    trigger_accum: int = 2
    refresh_interval: int = 32
    history: int = 5
    early_threshold: Optional[float] = 0.7
    gate_center: float = 0.9
    gate_scale: float = 10.0
    gate_max_delta: float = 2.0

    @classmethod
    def from_decode(cls, dcfg) -> "VConfig":
        pc = dcfg.polestar
        return cls(n_clusters=pc.n_clusters, kmeans_iters=pc.kmeans_iters, top_k=pc.top_k,
                   back_blocks=pc.prefix_blocks, ahead_blocks=pc.suffix_blocks, trigger_commits=pc.trigger_commits,
                   trigger_accum=pc.trigger_accum, history=pc.history, early_threshold=pc.early_threshold,
                   gate_center=pc.gate_center, gate_scale=pc.gate_scale, gate_max_delta=pc.gate_max_delta)

    def window_rows(self, prompt_slot: int, block: int) -> int:
        """The static size of the clustered window: the prompt slot and the generated rows around the block."""
        return prompt_slot + (self.back_blocks + self.ahead_blocks) * block


@flax.struct.dataclass
class VState:
    """``polestar_v``'s part of the decode state (``b`` rows of length ``L``, ``n_blocks`` blocks of ``B``).

    hidden      [b, L, D]   final hidden states (after the last norm) of every position, as last computed
                            (not row-selected: a pass writes only its active rows)
    hist        [b, n, B] f32  the block's drift history (oldest first), ``hist_fill`` [b] valid entries
    counter     [b] int32   commits since the last refresh; ``last_commits`` [b] those of the previous pass
    full_pass / windowed / refresh_steps / prefix_refresh [b, n_blocks] int32: per block, a full-pass start
                (always 1), a windowed start (always 0: the names of the LLaDA path's statistics), the
                cluster refreshes and the periodic prefix refreshes; ``processed`` [b, n_blocks] bool;
                ``early`` [b] int32 early commits.
    """

    hidden: jax.Array = axes(select=False)
    hist: jax.Array = axes()
    hist_fill: jax.Array = axes()
    counter: jax.Array = axes()
    last_commits: jax.Array = axes()
    full_pass: jax.Array = axes()
    windowed: jax.Array = axes()
    refresh_steps: jax.Array = axes()
    prefix_refresh: jax.Array = axes()
    processed: jax.Array = axes()
    early: jax.Array = axes()


#: The per-row statistics the engine reports (``GenerateResult.polestar``).
STAT_FIELDS = ("full_pass", "windowed", "refresh_steps", "prefix_refresh", "processed", "early")


def init_state(layout, b: int, length: int) -> VState:
    vc: VConfig = layout.own_config
    n, blk = layout.num_blocks, layout.block_length
    zi = lambda *s: jnp.zeros(s, jnp.int32)
    return VState(hidden=jnp.zeros((b, length, layout.model.d_model), layout.dtype),
                  hist=jnp.zeros((b, vc.history, blk), jnp.float32), hist_fill=zi(b), counter=zi(b),
                  last_commits=zi(b), full_pass=zi(b, n), windowed=zi(b, n), refresh_steps=zi(b, n),
                  prefix_refresh=zi(b, n), processed=jnp.zeros((b, n), bool), early=zi(b))


def _memory(part: VState, batch: int, vc: VConfig) -> dict:
    return {"stored": 0, "other": tree_bytes(part) // batch, "stored_memory": "device", "transient": 0}


#: ``polestar_v``'s state through the generic hooks (``Policy.own``): all in device memory, rows gatherable.
V_STATE = PolicyState(config_of=lambda dcfg, platform=None: VConfig.from_decode(dcfg), init=init_state,
                      place=lambda part, vc, abstract: part, at_rest=lambda part, spec: part,
                      reshape=lambda a, shape, spec: a.reshape(shape), compactable=lambda spec: True,
                      stats=lambda part: {k: getattr(part, k) for k in STAT_FIELDS}, memory=_memory)
