"""LLaDA-V's refresh selection: one k-means over the final hidden states of a window, and the clusters the
block drifted from.

The window of a block ``[cs, cs + B)`` is the whole prompt (text and image rows), the ``back_blocks * B``
generated rows before the block and the ``ahead_blocks * B`` after it, in position order (the official
``_build_cluster_state``). Its rows are clustered by :func:`polestar_jax.decode.polestar.cluster.kmeans`
(the same k-means as the LLaDA path's, ``k = min(n_clusters, rows)``). The block's mean final hidden state
before the pass, normalised, scores each centroid by ``1 - cos``; the ``top_k`` highest are selected, and
a refresh recomputes from the smallest position of their rows (at most the block start). The random draws
come from a counter-based hash of the row's key and the pass (:func:`own_draws`), or from a
:class:`VReplay` built from a trace of the official code (:mod:`polestar_jax.decode.polestar_v.replay`),
which may also force the final labels and the selected clusters.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from polestar_jax.decode.polestar.cluster import KMeansDraws, kmeans
from polestar_jax.decode.polestar.draws import at_forward, hash32, uniform
from polestar_jax.decode.polestar_v.state import VConfig

NORM_EPS = 1e-12


class VReplay(NamedTuple):
    """Decisions of the official code, per row and pass ``F`` (the k-means state built after pass ``F``
    chooses the refresh of pass ``F + 1``).

    km_init [b, F, K] int32 initial centroids (window indices); km_reseed [b, F, iters, K] int32 re-seeds,
    one per iteration with an empty cluster, in order; km_labels [b, F, W] int32 final labels (window order);
    km_forced [b, F] bool labels given; topk [b, F, K] bool the clusters selected from that state (for the
    refresh of pass ``F + 1``); topk_forced [b, F] bool.
    """

    km_init: jax.Array
    km_reseed: jax.Array
    km_labels: jax.Array
    km_forced: jax.Array
    topk: jax.Array
    topk_forced: jax.Array


class Selection(NamedTuple):
    """A refresh selection per row: ``start`` [b] int32 the index the refresh recomputes from (the smallest
    selected row, at most the block start), ``any`` [b] bool some row selected, ``clusters`` / ``own``
    [b, K] bool the selected clusters and those this implementation's scores pick (they differ only when a
    replay forces them), ``drift`` [b, K] f32 the cluster scores (-inf on empty slots), ``labels_differ``
    [b] int32 window rows whose own final label differs from a forced one."""

    start: jax.Array
    any: jax.Array
    clusters: jax.Array
    own: jax.Array
    drift: jax.Array
    labels_differ: jax.Array


def window(key_valid: jax.Array, cs, block: int, prompt_slot: int, vc: VConfig, w: int):
    """The window rows of every batch row, valid ones first in position order: (indices [b, w] int32,
    count [b] int32). Members: the prompt, ``back_blocks * B`` rows before the block (not into the
    prompt) and ``ahead_blocks * B`` after it, where they exist (``key_valid`` [b, L])."""
    idx = jnp.arange(key_valid.shape[1])
    back = (idx >= jnp.maximum(prompt_slot, cs - vc.back_blocks * block)) & (idx < cs)
    ahead = (idx >= cs + block) & (idx < cs + block + vc.ahead_blocks * block)
    member = key_valid & ((idx < prompt_slot) | back | ahead)[None]
    order = jnp.argsort(~member, axis=1, stable=True)[:, :w].astype(jnp.int32)
    return order, jnp.sum(member, axis=1).astype(jnp.int32)


def own_draws(rng: jax.Array, forward: jax.Array, n: jax.Array, w: int, vc: VConfig) -> KMeansDraws:
    """k-means draws of one row ([2] key data, its pass number, ``n`` window rows): a random subset of the
    rows as initial centroids (argsort of hashed uniforms), re-seeds ``floor(u * n)``; identical on every
    backend."""
    k, it = vc.n_clusters, vc.kmeans_iters
    seed = hash32(hash32(rng[0] ^ hash32(rng[1])) ^ forward.astype(jnp.uint32) ^ jnp.uint32(0x5EED0F0A))
    u = uniform(seed, jnp.arange(w, dtype=jnp.uint32))
    order = jnp.argsort(jnp.where(jnp.arange(w) < n, u, 2.0)).astype(jnp.int32)
    init = order[:k] if w >= k else jnp.pad(order, (0, k - w))
    u_res = uniform(seed ^ jnp.uint32(0x9E3779B9), jnp.arange(it * k, dtype=jnp.uint32)).reshape(it, k)
    reseed = jnp.minimum((u_res * n).astype(jnp.int32), jnp.maximum(n, 1) - 1)
    return KMeansDraws(init, reseed, jnp.zeros((it, w), jnp.int32), jnp.bool_(False))


def unit(x: jax.Array) -> jax.Array:
    """``x`` in float32 divided by its norm over the last axis (at least 1e-12; PyTorch's ``F.normalize``)."""
    x = x.astype(jnp.float32)
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), NORM_EPS)


def select(hidden: jax.Array, key_valid: jax.Array, prev_block: jax.Array, rng: jax.Array, forward: jax.Array,
           cs, block: int, prompt_slot: int, vc: VConfig, replay: Optional[VReplay]) -> Selection:
    """The refresh selection of every row from its stored final hidden states ``hidden`` [b, L, D] and its
    block's rows ``prev_block`` [b, B, D] before the pass (``forward`` [b]: the pass that built the state,
    the row's NFE minus one; ``rng`` [b, 2] the rows' keys)."""
    w = vc.window_rows(prompt_slot, block)
    k_max = vc.n_clusters
    order, n = window(key_valid, cs, block, prompt_slot, vc, w)
    xw = jnp.take_along_axis(hidden, order[..., None], axis=1)  # [b, w, D]
    k = jnp.minimum(n, k_max)
    draws = jax.vmap(lambda r, f, m: own_draws(r, f, m, w, vc))(rng, forward, n)
    if replay is not None:
        at = lambda a: at_forward(a, forward)
        init, reseed = at(replay.km_init), at(replay.km_reseed)
        draws = draws._replace(init=init[:, :k_max], reseed=reseed)
    cent, own_labels = jax.vmap(lambda x, m, kk, d: kmeans(x, m, kk, d, vc.kmeans_iters))(xw, n, k, draws)
    labels, differ = own_labels, jnp.zeros(n.shape, jnp.int32)
    slot = jnp.arange(k_max)
    valid_rows = jnp.arange(w)[None] < n[:, None]
    if replay is not None:
        forced = at_forward(replay.km_forced, forward)
        given = at_forward(replay.km_labels, forward)[:, :w]
        labels = jnp.where(forced[:, None] & valid_rows, given, own_labels)
        differ = jnp.sum((labels != own_labels) & valid_rows, axis=1).astype(jnp.int32)
    q = unit(jnp.mean(prev_block.astype(jnp.float32), axis=1))  # [b, D]
    sim = jnp.einsum("bkd,bd->bk", unit(cent), q)
    drift = jnp.where(slot[None] < k[:, None], 1.0 - sim, -jnp.inf)
    top = jnp.minimum(vc.top_k, k)
    _, idx = lax.top_k(drift, min(vc.top_k, k_max))
    own = jnp.any((idx[:, :, None] == slot[None, None]) & (jnp.arange(idx.shape[1])[None, :, None]
                                                          < top[:, None, None]), axis=1)
    clusters = own
    if replay is not None:
        fixed = at_forward(replay.topk_forced, forward)
        clusters = jnp.where(fixed[:, None], at_forward(replay.topk, forward), own)
    chosen = jnp.any((labels[:, :, None] == slot[None, None]) & clusters[:, None, :], axis=2) & valid_rows
    first = jnp.min(jnp.where(chosen, order, hidden.shape[1]), axis=1)
    return Selection(jnp.minimum(first, cs).astype(jnp.int32), jnp.any(chosen, axis=1), clusters, own, drift,
                     differ)
