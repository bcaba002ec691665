"""Clustering of the cached hidden states around the current block (Polestar-Cache).

Once per block and layer, the layer-input hidden states of the *prefix window* (up to ``prefix_blocks * B``
positions before the block) and of the *suffix window* (up to ``suffix_blocks * B`` positions after it)
are clustered separately with k-means; the ``n_clusters`` budget is split between them. Prefix clusters
take indices ``[0, n_pre)`` and suffix clusters ``[n_pre, n_pre + n_post)``; unused slots up to
``n_clusters`` are invalid.

k-means (as the PyTorch code): cosine assignment (argmax of normalised dot products, first maximum, with
similarities within a rounding tolerance of the maximum tied: :func:`first_near_max`),
raw means as centroids (``sum / (count + 1e-6)``), an empty cluster is re-seeded with a random point of
the window (one draw vector per iteration that has an empty cluster, consumed in order), and a window
with ``n <= k`` points uses the points themselves, tiled. Every random draw is an input
(:class:`KMeansDraws`), so a run can replay the reference's draws, or take them from a ``jax.random`` key.

Window buffers are static: ``W`` rows with the ``n`` valid points first (see :func:`compact`).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

COUNT_EPS = 1e-6
NORM_EPS = 1e-12


class KMeansDraws(NamedTuple):
    """Random inputs of one k-means call (per batch row when batched).

    init      [k_max] int32      initial centroid indices into the valid points (first k used).
    reseed    [iters, k_max] int32  re-seed indices, one vector per iteration *that has an empty cluster*,
                                 consumed in order.
    labels    [iters, W] int32   optional forced assignments per iteration (replay); ignored unless
    forced    [] bool            ``forced`` is True.
    """

    init: jax.Array
    reseed: jax.Array
    labels: jax.Array
    forced: jax.Array


def _normalize(x: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    return xf / jnp.maximum(jnp.linalg.norm(xf, axis=-1, keepdims=True), NORM_EPS)


#: Absolute tolerance, per square root of the feature width, under which two cosine similarities of a point
#: count as tied in the k-means assignment ([D32]): 2^-22 * sqrt(D), about 2e-6 at D = 64 and 1.5e-5 at
#: D = 4096: twice the typical rounding (2^-23 * sqrt(D)) of a D-term float32 dot product of unit vectors,
#: which is what a different blocking of the matmul changes (one ulp in the case that found it).
ASSIGN_TIE_ATOL_PER_SQRT_D = 2.0 ** -22


def first_near_max(sim: jax.Array, atol: float) -> jax.Array:
    """[W] int32: per row of ``sim`` [W, k], the lowest index whose value is within ``atol`` of the row's
    maximum. Similarities that are equal in exact arithmetic (a point against two centroids that are
    proportional, e.g. the means of different numbers of one repeated token's identical rows) differ by
    float rounding that depends on how XLA blocks the matmul for a batch size; within the tolerance they
    tie, and the lowest index wins, as exact arithmetic's first maximum would, wherever the row is decoded."""
    top = jnp.max(sim, axis=-1, keepdims=True)
    return jnp.argmax(sim >= top - atol, axis=-1).astype(jnp.int32)


def kmeans(x: jax.Array, n: jax.Array, k: jax.Array, draws: KMeansDraws, iters: int
           ) -> tuple[jax.Array, jax.Array]:
    """k-means of the first ``n`` rows of ``x`` [W, D] into ``k`` (<= k_max) clusters.

    Returns centroids [k_max, D] (in ``x.dtype``; rows >= k are zero) and labels [W] int32 (-1 for rows >= n).
    """
    w, d = x.shape
    k_max = draws.init.shape[0]
    atol = ASSIGN_TIE_ATOL_PER_SQRT_D * float(d) ** 0.5
    rows = jnp.arange(w)
    row_valid = rows < n
    cl = jnp.arange(k_max)
    cl_valid = cl < k
    xf = x.astype(jnp.float32)
    xn = _normalize(xf)

    # n <= k: the points themselves, tiled to k rows; label i for point i (no random draws).
    tiled = xf[jnp.mod(cl, jnp.maximum(n, 1))]
    small_c = jnp.where(cl_valid[:, None], tiled, 0.0)
    small_l = jnp.where(row_valid, rows, -1)

    def iteration(it, carry):
        c, ptr, _ = carry
        sim = xn @ _normalize(c).T  # [W, k_max]
        sim = jnp.where(cl_valid[None, :], sim, -jnp.inf)
        labels = jnp.where(draws.forced, draws.labels[it], first_near_max(sim, atol))
        onehot = ((labels[:, None] == cl[None, :]) & row_valid[:, None]).astype(jnp.float32)
        counts = jnp.sum(onehot, axis=0)
        new = (onehot.T @ xf) / (counts + COUNT_EPS)[:, None]
        empty = (counts == 0) & cl_valid
        r = draws.reseed[jnp.minimum(ptr, draws.reseed.shape[0] - 1)]
        new = jnp.where(empty[:, None], xf[jnp.clip(r, 0, w - 1)], new)
        return jnp.where(cl_valid[:, None], new, 0.0), ptr + jnp.any(empty).astype(jnp.int32), labels

    init = (xf[jnp.clip(draws.init, 0, w - 1)], jnp.int32(0), jnp.zeros((w,), jnp.int32))
    c, _, labels = lax.fori_loop(0, iters, iteration, init)
    big_l = jnp.where(row_valid, labels, -1)
    small = n <= k
    cent = jnp.where(small, small_c, c).astype(x.dtype)
    return cent, jnp.where(small, small_l, big_l).astype(jnp.int32)


def compact(x: jax.Array, offset: jax.Array, w: int) -> jax.Array:
    """Rows ``offset .. offset + w - 1`` of ``x`` [W, ...] (clipped), i.e. the valid rows moved first."""
    return x[jnp.clip(offset + jnp.arange(w), 0, x.shape[0] - 1)]


def split_budget(pre_len: jax.Array, suf_len: jax.Array, n_clusters: int) -> tuple[jax.Array, jax.Array]:
    """Clusters for the prefix and suffix windows: ``n_pre = min(n-1, max(1, n*pre // (pre+suf)))``
    (0 without a prefix), ``n_post = n - n_pre`` (0 without a suffix). Both windows empty: (0, 0)."""
    total = pre_len + suf_len
    n_pre = jnp.minimum(n_clusters - 1, jnp.maximum(1, (n_clusters * pre_len) // jnp.maximum(total, 1)))
    n_pre = jnp.where(pre_len > 0, n_pre, 0)
    n_post = jnp.where(suf_len > 0, n_clusters - n_pre, 0)
    return n_pre.astype(jnp.int32), n_post.astype(jnp.int32)


class Clusters(NamedTuple):
    """Clusters of one layer and batch row (or batched with a leading batch axis).

    centroids [K, D]; labels [R] int32 over the refresh rows (prefix rows then suffix rows, -1 = not
    clustered); counts [K] float32; n [] int32 number of valid clusters.
    """

    centroids: jax.Array
    labels: jax.Array
    counts: jax.Array
    n: jax.Array


def cluster_windows(
    x_pre: jax.Array, pre_len: jax.Array, x_suf: jax.Array, suf_len: jax.Array,
    draws_pre: KMeansDraws, draws_suf: KMeansDraws, n_clusters: int, iters: int,
) -> Clusters:
    """Clusters the prefix rows ``x_pre`` [Wp, D] (the ``pre_len`` valid rows are the *last* ones) and the
    suffix rows ``x_suf`` [Ws, D] (valid rows first) of one batch row. Labels are returned over the
    concatenated rows [Wp + Ws] with suffix labels offset by ``n_pre``."""
    wp, ws = x_pre.shape[0], x_suf.shape[0]
    w = max(wp, ws)
    n_pre, n_post = split_budget(pre_len, suf_len, n_clusters)
    off = wp - pre_len

    def pad_rows(a, axis=0):
        widths = [(0, 0)] * a.ndim
        widths[axis] = (0, w - a.shape[axis])
        return jnp.pad(a, widths)

    # both windows in one (vmapped) k-means: valid points first, padded to the same buffer length
    xs = jnp.stack([pad_rows(compact(x_pre, off, wp)), pad_rows(x_suf)])
    draws = jax.tree.map(lambda a, b: jnp.stack([a, b]), draws_pre._replace(labels=pad_rows(draws_pre.labels, 1)),
                         draws_suf._replace(labels=pad_rows(draws_suf.labels, 1)))
    cents, labs = jax.vmap(lambda x, n, k, d: kmeans(x, n, k, d, iters))(
        xs, jnp.stack([pre_len, suf_len]), jnp.stack([n_pre, n_post]), draws)
    c_pre, l_pre = cents[0], labs[0][:wp]
    c_suf, l_suf = cents[1], labs[1][:ws]
    # labels back to buffer rows: prefix buffer row r holds compact row r - off
    r = jnp.arange(wp)
    l_pre_rows = jnp.where(r >= off, l_pre[jnp.clip(r - off, 0, wp - 1)], -1)
    l_suf_rows = jnp.where(l_suf >= 0, l_suf + n_pre, -1)
    labels = jnp.concatenate([l_pre_rows, l_suf_rows])
    slot = jnp.arange(n_clusters)
    cent = jnp.where((slot < n_pre)[:, None], c_pre[jnp.clip(slot, 0, c_pre.shape[0] - 1)],
                     c_suf[jnp.clip(slot - n_pre, 0, c_suf.shape[0] - 1)])
    k = n_pre + n_post
    cent = jnp.where((slot < k)[:, None], cent, 0).astype(x_pre.dtype)
    counts = jnp.sum((labels[:, None] == slot[None, :]), axis=0).astype(jnp.float32)
    return Clusters(cent, labels, counts, k)

