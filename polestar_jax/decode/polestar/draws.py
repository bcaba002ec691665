"""Polestar's random and tied decisions: the k-means draws of a block start, and their replay.

By default the draws come from a counter-based integer hash of the row's key data and its forward count
(identical on every backend, cheap to compile). For exact replay of the PyTorch code they, the k-means
labels and the per-layer cluster selections come from a :class:`Replay` built from its trace
(:mod:`polestar_jax.decode.polestar.replay`): the reference is not stable under rounding there (docs/differences.md#d3, #d4; the default draws: #d5).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from polestar_jax.decode.polestar.cluster import KMeansDraws
from polestar_jax.config import ModelConfig, PolestarConfig
from polestar_jax.decode.polestar.state import Geometry
from polestar_jax.decode.state import DecodeState


class Replay(NamedTuple):
    """Decisions taken from a PyTorch trace, indexed by row and forward number ``F`` (the row's NFE).

    km_init [b, F, N, 2, K], km_reseed [b, F, N, 2, iters, K]: k-means draws (side 0 prefix, 1 suffix);
    km_labels_pre [b, F, N, iters, Wp], km_labels_suf [b, F, N, iters, Ws]: k-means labels per iteration;
    km_forced [b, F, N, 2] bool: whether labels are given; topk [b, F, N, K] bool: selected clusters of a
    refresh step, topk_forced [b, F, N] bool.
    """

    km_init: jax.Array
    km_reseed: jax.Array
    km_labels_pre: jax.Array
    km_labels_suf: jax.Array
    km_forced: jax.Array
    topk: jax.Array
    topk_forced: jax.Array


def at_forward(replay_field: jax.Array, nfe: jax.Array) -> jax.Array:
    """The entries [b, ...] of a Replay field [b, F, ...] for each row's current forward number ``nfe`` [b]."""
    return jax.vmap(lambda ar, f: ar[jnp.clip(f, 0, ar.shape[0] - 1)])(replay_field, nfe)


def hash32(x: jax.Array) -> jax.Array:
    """A 32-bit integer mixer (lowbias32): the counter-based generator of the default k-means draws.
    Pure integer arithmetic, so the draws are identical on every backend and cost nothing to compile."""
    x = x.astype(jnp.uint32)
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def uniform(seed: jax.Array, counter: jax.Array) -> jax.Array:
    """Uniform floats in [0, 1) for each ``counter`` under ``seed``."""
    return (hash32(hash32(counter) ^ seed) >> 8).astype(jnp.float32) * jnp.float32(2.0 ** -24)


def block_start_draws(state: DecodeState, geo: Geometry, cfg: ModelConfig, pc: PolestarConfig, block: int,
                      replay: Optional[Replay]) -> tuple[KMeansDraws, KMeansDraws]:
    """k-means draws of the block-start pass for every layer and row: ([N, b] prefix, [N, b] suffix)."""
    n, k, it = cfg.n_layers, pc.n_clusters, pc.kmeans_iters
    wp, ws = pc.prefix_rows(block), pc.suffix_rows(block)
    if replay is not None:
        at = lambda a: at_forward(a, state.nfe)
        init, reseed = at(replay.km_init), at(replay.km_reseed)  # [b, N, 2, ...]
        lp, ls, forced = at(replay.km_labels_pre), at(replay.km_labels_suf), at(replay.km_forced)
        sw = lambda a: jnp.swapaxes(a, 0, 1)
        pre = KMeansDraws(sw(init[:, :, 0]), sw(reseed[:, :, 0]), sw(lp), sw(forced[:, :, 0]))
        suf = KMeansDraws(sw(init[:, :, 1]), sw(reseed[:, :, 1]), sw(ls), sw(forced[:, :, 1]))
        return pre, suf

    def row(key, nfe, pre_len, suf_len):
        # counter-based draws hashed from the row's key, its forward count and the slot: a random subset
        # for the initial centroids (argsort of uniforms over the valid points), re-seeds floor(u * n)
        wmax = max(wp, ws, 1)
        seed = hash32(hash32(key[0] ^ hash32(key[1])) ^ nfe.astype(jnp.uint32))
        u_init = uniform(seed, jnp.arange(n * 2 * wmax, dtype=jnp.uint32)).reshape(n, 2, wmax)
        u_res = uniform(seed ^ jnp.uint32(0x9E3779B9),
                         jnp.arange(n * 2 * it * k, dtype=jnp.uint32)).reshape(n, 2, it, k)
        lens = jnp.stack([pre_len, suf_len])  # [2]
        valid = jnp.arange(wmax)[None, None, :] < lens[None, :, None]
        order = jnp.argsort(jnp.where(valid, u_init, 2.0), axis=-1).astype(jnp.int32)
        init = order[..., :k] if wmax >= k else jnp.pad(order, ((0, 0), (0, 0), (0, k - wmax)))
        reseed = jnp.minimum((u_res * lens[None, :, None, None]).astype(jnp.int32),
                             jnp.maximum(lens, 1)[None, :, None, None] - 1)
        return init, reseed

    init, reseed = jax.vmap(row)(state.rng, state.nfe, geo.pre_len, geo.suf_len)  # [b, N, 2, ...]
    b = state.x.shape[0]
    sw = lambda a: jnp.swapaxes(a, 0, 1)
    no = jnp.zeros((n, b), bool)
    pre = KMeansDraws(sw(init[:, :, 0]), sw(reseed[:, :, 0]), jnp.zeros((n, b, it, wp), jnp.int32), no)
    suf = KMeansDraws(sw(init[:, :, 1]), sw(reseed[:, :, 1]), jnp.zeros((n, b, it, ws), jnp.int32), no)
    return pre, suf
