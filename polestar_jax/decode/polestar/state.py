"""Polestar's part of the decode state, and the geometry of a block's refresh window.

The refresh window of a block ``[cs, cs + B)`` is the ``prefix_blocks * B`` rows before it and the
``suffix_blocks * B`` rows after it (``R`` rows in all, prefix first); those rows' layer inputs are stored,
clustered and refreshed (see ``docs/algorithm.md#the-windows``). A full-pass block start may cluster a
window of its own size (``PolestarConfig.full_prefix_rows`` / ``full_suffix_rows``, Dream's fixed 64 / 32);
the store then holds the larger window on each side and the geometry marks which rows a pass uses.
"""
from __future__ import annotations

from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from polestar_jax.decode.polestar import offload
from polestar_jax.decode.polestar.offload import store_shape
from polestar_jax.decode.state import PolicyState, tree_bytes
from polestar_jax.config import ModelConfig, PolestarConfig
from polestar_jax.axes import LAYER_BATCH, axes


@flax.struct.dataclass
class PolestarState:
    """Polestar's part of the decode state (``N`` layers, ``b`` rows, ``R`` refresh rows, ``K`` cluster slots).

    hs          [N, b, R, D]     layer-input hidden states of the refresh rows (prefix rows, then suffix rows),
                                 encoded as ``PolestarConfig.offload_hidden`` says (see :mod:`polestar_jax.decode.polestar.offload`:
                                 model dtype, bf16 or int8; host memory when offloaded)
    hs_scale    [N, b, R] f32    per-row int8 scales (zeros unless int8)
    labels      [N, b, R] int32  cluster of each refresh row (-1: outside the windows)
    centroids   [N, b, K, D]     cluster centroids (shifted by refreshes)
    counts      [N, b, K] f32    cluster sizes
    n_clusters  [N, b] int32     valid cluster slots
    s_prev      [N, b, H, K, L]  proxy attention of the last refresh / block start (float32)
    p_prev      [b, H, B, L]     last layer's block attention rows of the previous forward (float32)
    hist        [b, n, B] f32    token-drift history of this block (oldest first), ``hist_fill`` [b] valid
    counter     [b] int32        commits since the last refresh; ``last_commits`` [b] of the previous forward
    full_pass / windowed / refresh_steps [b, n_blocks] int32: per-block statistics (block started with a full
                pass, with a windowed pass; refresh steps); ``processed`` [b, n_blocks] bool; ``early`` /
                ``suffix`` [b] int32 totals of early and suffix commits.

    The store (``hs``, ``hs_scale``) is not row-selected: a step writes it only for rows that refresh
    (active rows), and a block start rewrites it whole before any step reads it, so the store (possibly in
    host memory) is never touched by a device-side select.
    """

    hs: jax.Array = axes(LAYER_BATCH, select=False)
    hs_scale: jax.Array = axes(LAYER_BATCH, select=False)
    labels: jax.Array = axes(LAYER_BATCH)
    centroids: jax.Array = axes(LAYER_BATCH)
    counts: jax.Array = axes(LAYER_BATCH)
    n_clusters: jax.Array = axes(LAYER_BATCH)
    # (a step changes only its refreshing rows', all active: not selected after a step, where a select would
    # keep the old one alive beside the new, a copy of 512 MiB at LLaDA-8B's batch 32)
    s_prev: jax.Array = axes((None, "data", "model"), select="start")
    p_prev: jax.Array = axes(("data", "model"))
    hist: jax.Array = axes()
    hist_fill: jax.Array = axes()
    counter: jax.Array = axes()
    last_commits: jax.Array = axes()
    full_pass: jax.Array = axes()
    windowed: jax.Array = axes()
    refresh_steps: jax.Array = axes()
    processed: jax.Array = axes()
    early: jax.Array = axes()
    suffix: jax.Array = axes()


#: The per-row statistics the engine reports (``GenerateResult.polestar``, ``RowOutput.polestar``).
STAT_FIELDS = ("full_pass", "windowed", "refresh_steps", "processed", "early", "suffix")


def init_polestar_state(cfg: ModelConfig, pc: PolestarConfig, b: int, length: int, block: int, n_blocks: int,
                        dtype) -> PolestarState:
    """Empty Polestar state for ``b`` rows of total length ``length``."""
    n, d, h, k = cfg.n_layers, cfg.d_model, cfg.n_heads, pc.n_clusters
    r = pc.window_rows(block)
    zi = lambda *s: jnp.zeros(s, jnp.int32)
    return PolestarState(
        hs=jnp.zeros(*store_shape(pc, (n, b, r, d), dtype)), hs_scale=jnp.zeros((n, b, r), jnp.float32),
        labels=jnp.full((n, b, r), -1, jnp.int32),
        centroids=jnp.zeros((n, b, k, d), dtype), counts=jnp.zeros((n, b, k), jnp.float32),
        n_clusters=zi(n, b), s_prev=jnp.zeros((n, b, proxy_heads(cfg, pc), k, length), jnp.float32),
        p_prev=jnp.zeros((b, h, block, length), jnp.float32), hist=jnp.zeros((b, pc.history, block), jnp.float32),
        hist_fill=zi(b), counter=zi(b), last_commits=zi(b), full_pass=zi(b, n_blocks), windowed=zi(b, n_blocks),
        refresh_steps=zi(b, n_blocks), processed=jnp.zeros((b, n_blocks), bool), early=zi(b), suffix=zi(b))


def proxy_heads(cfg: ModelConfig, pc: PolestarConfig) -> int:
    """Heads of the cluster proxy attention ``s_prev``: H (``proxy_score="heads"``) or 1 (``"mean"``)."""
    return 1 if pc.proxy_score == "mean" else cfg.n_heads


class Geometry(NamedTuple):
    """Positions of the block and its refresh rows for one block (shared by all rows of a batch)."""

    cs: jax.Array  # [] block start
    ref_pos: jax.Array  # [R] positions of the refresh rows (may be < 0 or >= L)
    ref_valid: jax.Array  # [b, R] position exists, is not padding and lies within the row's length
    pre_len: jax.Array  # [b] valid prefix rows (the last ones of the prefix part)
    suf_len: jax.Array  # [b] valid suffix rows (the first ones of the suffix part)


def geometry(state, cs, block: int, pc: PolestarConfig, window=None) -> Geometry:
    """The refresh window of the block starting at ``cs``: the store's rows (``pc.prefix_rows`` before the
    block, ``pc.suffix_rows`` after it). ``window`` (rows before, rows after; may be traced) narrows which
    of them are valid (a block start's own window, ``PolestarConfig.pass_window``); default: all."""
    length = state.x.shape[1]
    pre, suf = pc.prefix_rows(block), pc.suffix_rows(block)
    ref_pos = jnp.concatenate([cs - pre + jnp.arange(pre), cs + block + jnp.arange(suf)])
    is_pre = jnp.arange(pre + suf) < pre
    # a row exists where it is a valid key: not left padding, not past the row's own generation length
    ref_valid = rows_at(state.key_valid, ref_pos) & ((ref_pos >= 0) & (ref_pos < length))[None]
    if window is not None:
        ref_valid = ref_valid & jnp.where(is_pre, ref_pos >= cs - window[0], ref_pos < cs + block + window[1])[None]
    pre_len = jnp.sum(ref_valid[:, :pre], axis=1).astype(jnp.int32)
    suf_len = jnp.sum(ref_valid[:, pre:], axis=1).astype(jnp.int32)
    return Geometry(jnp.asarray(cs, jnp.int32), ref_pos, ref_valid, pre_len, suf_len)


def rows_at(a: jax.Array, idx: jax.Array) -> jax.Array:
    """a [b, L, ...] gathered at positions idx [b, T] or [T] (clipped to [0, L))."""
    idx = jnp.broadcast_to(jnp.clip(idx, 0, a.shape[1] - 1), a.shape[:1] + idx.shape[-1:])
    return jnp.take_along_axis(a, idx.reshape(idx.shape + (1,) * (a.ndim - 2)), axis=1)


# ----------------------------------------------------------------------- the hooks of decode.state.PolicyState
def _config_of(dcfg, platform=None) -> PolestarConfig:
    return dcfg.polestar.for_platform(platform)


def _init(layout, b: int, length: int) -> PolestarState:
    return init_polestar_state(layout.model, layout.own_config, b, length, layout.block_length, layout.num_blocks,
                               layout.dtype)


def _place(pol: PolestarState, pc: PolestarConfig, abstract: bool) -> PolestarState:
    """The hidden-state store moved where ``pc.offload_hidden`` keeps it (host memory), outside jit."""
    if pc.offload_hidden == "none":
        return pol
    hs, hs_scale = (offload.abstract_store if abstract else
                    lambda a, s: offload.place_store(a, s, pc))(pol.hs, pol.hs_scale)
    return pol.replace(hs=hs, hs_scale=hs_scale)


def _at_rest(pol: PolestarState, spec) -> PolestarState:
    pc = spec.own_config
    return pol.replace(hs=offload.to_host(pol.hs, pc), hs_scale=offload.to_host(pol.hs_scale, pc))


def _reshape(a: jax.Array, shape: tuple, spec) -> jax.Array:
    return offload.reshape(a, shape, spec.own_config)


def _compactable(spec) -> bool:
    """Rows may be gathered unless the store sits in host memory (for the target: ``offload.uses_host``)."""
    return not offload.uses_host(spec.own_config)


def _stats(pol: PolestarState) -> dict:
    return {k: getattr(pol, k) for k in STAT_FIELDS}


def _memory(pol: PolestarState, batch: int, pc: PolestarConfig) -> dict:
    store = tree_bytes((pol.hs, pol.hs_scale))
    stored, host = store // batch, pc.offload_hidden != "none"
    return {"stored": stored, "other": (tree_bytes(pol) - store) // batch,
            "stored_memory": offload.HOST_MEMORY_KIND if host and offload.host_memory_available() else "device",
            "transient": stored // pol.hs.shape[0] if host else 0}


#: Polestar's state through the generic hooks (``Policy.own``).
POLESTAR_STATE = PolicyState(config_of=_config_of, init=_init, place=_place, at_rest=_at_rest, reshape=_reshape,
                             compactable=_compactable, stats=_stats, memory=_memory)
