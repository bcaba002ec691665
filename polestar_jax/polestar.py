"""Polestar: drift-guided sparse cache refresh and early commit on top of the dual-cache block decoder.

Per block (see ``POLESTAR_SPEC.md`` sections B-G):

1. **Block start** (:func:`start_pass`): a full forward (or, every ``windowed_period``-th block, a forward of
   the window ``[cs - 2B, ce + B)`` only) that writes the K/V cache, stores every layer's input hidden
   states of the prefix/suffix windows (the *refresh rows*), clusters them per layer, stores the proxy
   attention of the centroids (``s_prev``) and the last layer's block attention rows (``p_prev``), and
   commits by the threshold rule.
2. **Decode steps** (:func:`decode_step`) until the block has no mask, each one pure function of the state:
   one forward of the block against the cache. When the previous step committed more than one token (or the
   commits since the last refresh exceed two) the step *refreshes*: in every layer the rows the previous
   layer recomputed (the *packet*) patch this layer's stored hidden states, K/V and centroids, the
   centroids' proxy attention is compared with ``s_prev`` (cluster drift), and the rows of the top clusters
   go through the layer with the block rows, becoming the next layer's packet. Token drift of the last
   layer drives early commits; refreshed suffix rows of the last layer may commit ahead of their block.

The packet is carried between layers at full width ``R`` (window rows) with a validity mask, so no selected
row is ever dropped; inside a layer each stage works on the selected rows compacted to a static width
(:mod:`polestar_jax.refresh`), and only those rows are read from the store.

Randomness (k-means draws) is an input: from a ``jax.random`` key by default, or, for exact replay of the
PyTorch code, from a :class:`Replay` of its trace, together with its k-means labels and cluster selections
(the reference itself is not stable under rounding there, spec J14).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from polestar_jax import cluster as C
from polestar_jax import commit as R
from polestar_jax import drift as Dr
from polestar_jax import model as M
from polestar_jax import offload as OF
from polestar_jax import refresh as RF
from polestar_jax.config import ModelConfig, PolestarConfig
from polestar_jax.kernels.kl_drift import kl_drift
from polestar_jax.kernels.refresh import centroid_shift, scatter_kv_rows
from polestar_jax.state import DecodeState

_LAYER_MAJOR = ("hs", "hs_scale", "labels", "centroids", "counts", "n_clusters", "s_prev")


@flax.struct.dataclass
class PolestarCache:
    """Polestar's part of the decode state (``N`` layers, ``b`` rows, ``R`` refresh rows, ``K`` cluster slots).

    hs          [N, b, R, D]     layer-input hidden states of the refresh rows (prefix rows, then suffix rows),
                                 encoded as ``PolestarConfig.offload_hidden`` says (see :mod:`polestar_jax.offload`:
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
    block0 / efficient / cluster_steps [b, n_blocks] int32: per-block stats (full pass, windowed pass,
                refresh steps); ``processed`` [b, n_blocks] bool; ``early`` / ``suffix`` [b] int32 totals of
                early and suffix commits.
    """

    hs: jax.Array
    hs_scale: jax.Array
    labels: jax.Array
    centroids: jax.Array
    counts: jax.Array
    n_clusters: jax.Array
    s_prev: jax.Array
    p_prev: jax.Array
    hist: jax.Array
    hist_fill: jax.Array
    counter: jax.Array
    last_commits: jax.Array
    block0: jax.Array
    efficient: jax.Array
    cluster_steps: jax.Array
    processed: jax.Array
    early: jax.Array
    suffix: jax.Array


def init_cache(cfg: ModelConfig, pc: PolestarConfig, b: int, length: int, block: int, n_blocks: int,
               dtype) -> PolestarCache:
    """Empty Polestar state for ``b`` rows of total length ``length``."""
    n, d, h, k = cfg.n_layers, cfg.d_model, cfg.n_heads, pc.n_clusters
    r = (pc.prefix_blocks + pc.suffix_blocks) * block
    zi = lambda *s: jnp.zeros(s, jnp.int32)
    return PolestarCache(
        hs=jnp.zeros((n, b, r, d), OF.store_dtype(pc, dtype)), hs_scale=jnp.zeros((n, b, r), jnp.float32),
        labels=jnp.full((n, b, r), -1, jnp.int32),
        centroids=jnp.zeros((n, b, k, d), dtype), counts=jnp.zeros((n, b, k), jnp.float32),
        n_clusters=zi(n, b), s_prev=jnp.zeros((n, b, h, k, length), jnp.float32),
        p_prev=jnp.zeros((b, h, block, length), jnp.float32), hist=jnp.zeros((b, pc.history, block), jnp.float32),
        hist_fill=zi(b), counter=zi(b), last_commits=zi(b), block0=zi(b, n_blocks), efficient=zi(b, n_blocks),
        cluster_steps=zi(b, n_blocks), processed=jnp.zeros((b, n_blocks), bool), early=zi(b), suffix=zi(b))


def select_rows(active: jax.Array, new: DecodeState, old: DecodeState) -> DecodeState:
    """Per batch row: ``new`` where ``active`` [b], else ``old`` (a finished row waits unchanged)."""

    def sel(axis):
        def f(n, o):
            shape = [1] * n.ndim
            shape[axis] = active.shape[0]
            return jnp.where(active.reshape(shape), n, o)
        return f

    pol_new, pol_old = new.polestar, old.polestar
    base = jax.tree.map(sel(0), new.replace(polestar=None, k_cache=None, v_cache=None),
                        old.replace(polestar=None, k_cache=None, v_cache=None))
    kv = jax.tree.map(sel(1), (new.k_cache, new.v_cache), (old.k_cache, old.v_cache))
    fields = {}
    for name in PolestarCache.__dataclass_fields__:
        if name in ("hs", "hs_scale"):
            # taken as is (no select): a step patches only rows with `cluster_rows` (active rows), and a
            # block start rewrites the whole store before any step reads it; so the store (possibly in host
            # memory) is never touched by a device-side select
            fields[name] = getattr(pol_new, name)
            continue
        axis = 1 if name in _LAYER_MAJOR else 0
        fields[name] = sel(axis)(getattr(pol_new, name), getattr(pol_old, name))
    return base.replace(k_cache=kv[0], v_cache=kv[1], polestar=PolestarCache(**fields))


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


class StepOut(NamedTuple):
    """What one decode step computed, per row: the drift statistics and the commit masks.

    active/cluster [b] bool; token_drift, delta [b, B]; cluster_scores [b, N, K] (-inf on invalid slots);
    selected [b, N, K] clusters refreshed; own_selected [b, N, K] what this implementation would have chosen
    (differs from ``selected`` only in replay); refreshed_rows [b, N] rows recomputed; moved_rows [b, N]
    stored rows read in the refresh (the compact widths of :mod:`polestar_jax.refresh`: what moves from a host
    store to the device); commit_threshold, commit_early [b, B]; commit_suffix [b, Ws].
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


class Geometry(NamedTuple):
    """Positions of the block and its refresh rows for one block (shared by all rows of a batch)."""

    cs: jax.Array  # [] block start
    ref_pos: jax.Array  # [R] positions of the refresh rows (may be < 0 or >= L)
    ref_valid: jax.Array  # [b, R] position exists and is not padding
    pre_len: jax.Array  # [b] valid prefix rows (the last ones of the prefix part)
    suf_len: jax.Array  # [b] valid suffix rows (the first ones of the suffix part)


def geometry(state: DecodeState, cs, block: int, pc: PolestarConfig) -> Geometry:
    length = state.x.shape[1]
    pre, suf = pc.prefix_blocks * block, pc.suffix_blocks * block
    pad = -state.pos[:, 0]  # first real position of every row
    ref_pos = jnp.concatenate([cs - pre + jnp.arange(pre), cs + block + jnp.arange(suf)])
    is_pre = jnp.arange(pre + suf) < pre
    ref_valid = jnp.where(is_pre[None], ref_pos[None] >= pad[:, None], (ref_pos < length)[None])
    ref_valid = ref_valid & (ref_pos[None] >= 0)
    pre_len = jnp.sum(ref_valid[:, :pre], axis=1).astype(jnp.int32)
    suf_len = jnp.sum(ref_valid[:, pre:], axis=1).astype(jnp.int32)
    return Geometry(jnp.asarray(cs, jnp.int32), ref_pos, ref_valid, pre_len, suf_len)


def _clip_pos(pos, length):
    return jnp.clip(pos, 0, length - 1)


def _rows_at(a: jax.Array, idx: jax.Array) -> jax.Array:
    """a [b, L, ...] gathered at positions idx [b, T] or [T] (clipped)."""
    idx = jnp.broadcast_to(_clip_pos(idx, a.shape[1]), a.shape[:1] + idx.shape[-1:])
    return jnp.take_along_axis(a, idx.reshape(idx.shape + (1,) * (a.ndim - 2)), axis=1)


# ------------------------------------------------------------------------------------ draws and replay
def _hash32(x: jax.Array) -> jax.Array:
    """A 32-bit integer mixer (lowbias32): the counter-based generator of the default k-means draws.
    Pure integer arithmetic, so the draws are identical on every backend and cost nothing to compile."""
    x = x.astype(jnp.uint32)
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _uniform(seed: jax.Array, counter: jax.Array) -> jax.Array:
    """Uniform floats in [0, 1) for each ``counter`` under ``seed``."""
    return (_hash32(_hash32(counter) ^ seed) >> 8).astype(jnp.float32) * jnp.float32(2.0 ** -24)


def block_start_draws(state: DecodeState, geo: Geometry, cfg: ModelConfig, pc: PolestarConfig, block: int,
                      replay: Optional[Replay]) -> tuple[C.KMeansDraws, C.KMeansDraws]:
    """k-means draws of the block-start pass for every layer and row: ([N, b] prefix, [N, b] suffix)."""
    n, k, it = cfg.n_layers, pc.n_clusters, pc.kmeans_iters
    wp, ws = pc.prefix_blocks * block, pc.suffix_blocks * block
    if replay is not None:
        at = lambda a: jax.vmap(lambda ar, f: ar[jnp.clip(f, 0, ar.shape[0] - 1)])(a, state.nfe)
        init, reseed = at(replay.km_init), at(replay.km_reseed)  # [b, N, 2, ...]
        lp, ls, forced = at(replay.km_labels_pre), at(replay.km_labels_suf), at(replay.km_forced)
        sw = lambda a: jnp.swapaxes(a, 0, 1)
        pre = C.KMeansDraws(sw(init[:, :, 0]), sw(reseed[:, :, 0]), sw(lp), sw(forced[:, :, 0]))
        suf = C.KMeansDraws(sw(init[:, :, 1]), sw(reseed[:, :, 1]), sw(ls), sw(forced[:, :, 1]))
        return pre, suf

    def row(key, nfe, pre_len, suf_len):
        # counter-based draws hashed from the row's key, its forward count and the slot: a random subset
        # for the initial centroids (argsort of uniforms over the valid points), re-seeds floor(u * n)
        wmax = max(wp, ws, 1)
        seed = _hash32(_hash32(key[0] ^ _hash32(key[1])) ^ nfe.astype(jnp.uint32))
        u_init = _uniform(seed, jnp.arange(n * 2 * wmax, dtype=jnp.uint32)).reshape(n, 2, wmax)
        u_res = _uniform(seed ^ jnp.uint32(0x9E3779B9),
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
    pre = C.KMeansDraws(sw(init[:, :, 0]), sw(reseed[:, :, 0]), jnp.zeros((n, b, it, wp), jnp.int32), no)
    suf = C.KMeansDraws(sw(init[:, :, 1]), sw(reseed[:, :, 1]), jnp.zeros((n, b, it, ws), jnp.int32), no)
    return pre, suf


# ------------------------------------------------------------------------------------------- the passes
class StartOut(NamedTuple):
    k: jax.Array  # [N, b, KV, L, hd]
    v: jax.Array
    hs: jax.Array  # [N, b, R, D] encoded (see polestar_jax.offload), host memory when offloaded
    hs_scale: jax.Array  # [N, b, R]
    clusters: C.Clusters  # leaves [N, b, ...]
    s_prev: jax.Array  # [N, b, H, K, L]
    p_prev: jax.Array  # [b, H, B, L]
    logits: jax.Array  # [b, B, V]


def start_pass(params, state: DecodeState, geo: Geometry, cfg: ModelConfig, pc: PolestarConfig, block: int,
               windowed: bool, draws: tuple[C.KMeansDraws, C.KMeansDraws]) -> StartOut:
    """The block-start forward: full sequence (``windowed=False``) or the window only (``windowed=True``,
    keys outside the window stay as cached)."""
    length = state.x.shape[1]
    pre, suf = pc.prefix_blocks * block, pc.suffix_blocks * block
    b = state.x.shape[0]
    if windowed:
        q_pos_abs = geo.cs - pre + jnp.arange(pre + block + suf)  # window positions
        valid = jnp.concatenate([geo.ref_valid[:, :pre], jnp.ones((b, block), bool), geo.ref_valid[:, pre:]], 1)
        write_idx = jnp.broadcast_to(q_pos_abs, valid.shape).astype(jnp.int32)
        ids = _rows_at(state.x, q_pos_abs)
        blk_off = pre
        hs_rows = jnp.concatenate([jnp.arange(pre), pre + block + jnp.arange(suf)])
        k0, v0 = state.k_cache, state.v_cache
    else:
        q_pos_abs = jnp.arange(length)
        ids = state.x
        blk_off = geo.cs
        hs_rows = geo.ref_pos
        k0 = v0 = None
    q_pos = _rows_at(state.pos, q_pos_abs)
    qc, qs = M.rope_tables(q_pos, cfg.head_dim, cfg.rope_theta)
    kc, ks = M.rope_tables(state.pos, cfg.head_dim, cfg.rope_theta)
    h0 = M.embed(params, ids)

    def layer(carry, xs):
        h, _ = carry
        lp, kcache, vcache, dpre, dsuf = xs
        hs = _rows_at(h, hs_rows)  # [b, R, D]
        cl = jax.vmap(lambda xp, pl, xs_, sl, a, c: C.cluster_windows(xp, pl, xs_, sl, a, c, pc.n_clusters,
                                                                      pc.kmeans_iters))(
            hs[:, :pre], geo.pre_len, hs[:, pre:], geo.suf_len, dpre, dsuf)
        q, k, v = M.project_qkv(lp, h, cfg)
        if kcache is None:
            kk, vv = k, v
        else:
            kk = scatter_kv_rows(kcache, k, write_idx, valid, backend=pc.kernels)
            vv = scatter_kv_rows(vcache, v, write_idx, valid, backend=pc.kernels)
        qr = M.apply_rope(q, qc, qs)
        kr = M.apply_rope(kk, kc, ks)
        a, p = M.attention(qr, kr, vv, state.key_valid, return_probs=True)
        p_blk = lax.dynamic_slice_in_dim(p, blk_off, block, axis=2)  # kept from the last layer
        out = M.finish_layer(lp, h, a, cfg)
        s = Dr.proxy_attention(lp, cl.centroids, kk, cfg, state.key_valid)
        stored, scale = OF.encode(hs, pc)
        return (out, p_blk), (kk, vv, OF.to_host(stored, pc), OF.to_host(scale, pc), cl, s)

    p0 = jnp.zeros((b, cfg.n_heads, block, length), jnp.float32)
    (h, p_blk), (kk, vv, hs, hs_sc, cl, s) = lax.scan(layer, (h0, p0), (params["blocks"], k0, v0) + tuple(draws))
    logits = M.lm_head(params, lax.dynamic_slice_in_dim(h, blk_off, block, axis=1), cfg)
    return StartOut(kk, vv, hs, hs_sc, cl, s, p_blk, logits)


class StepFwd(NamedTuple):
    k: jax.Array
    v: jax.Array
    hs: jax.Array
    hs_scale: jax.Array
    centroids: jax.Array
    s_prev: jax.Array
    p_blk: jax.Array  # [b, H, B, L]
    drift: jax.Array  # [b, B]
    logits: jax.Array  # [b, B, V]
    logits_suf: jax.Array  # [b, Ws, V]
    sel_suf: jax.Array  # [b, Ws] bool rows of the last layer's packet in the suffix window
    scores: jax.Array  # [N, b, K]
    selected: jax.Array  # [N, b, K]
    own: jax.Array  # [N, b, K]
    n_rows: jax.Array  # [N, b]
    moved_rows: jax.Array  # [N, b] store rows moved to the device (stage widths 1 + 2; 0 without refresh)


#: Low mantissa bits dropped from cluster scores before ranking: scores are compared at a relative
#: precision of 2**-15 (~3e-5).
SCORE_ROUND_BITS = 8


def round_scores(scores: jax.Array, bits: int = SCORE_ROUND_BITS) -> jax.Array:
    """float32 ``scores`` rounded to nearest with the ``bits`` lowest mantissa bits cleared (infinities kept).

    Clusters made of identical rows (e.g. all-[MASK] suffix rows at layer 0) have mathematically equal drift
    scores, but float rounding makes them differ in the last bits, and *how* depends on the shapes XLA
    blocks the matmuls for (batch size, backend): without this, a row's refresh choice -- and so its tokens
    -- could change with the batch it is decoded in (spec J14). Within one rounding bucket the lowest index
    wins, as for exact ties."""
    x = scores.astype(jnp.float32)
    u = lax.bitcast_convert_type(x, jnp.uint32)
    half, mask = jnp.uint32(1 << (bits - 1)), jnp.uint32((0xFFFFFFFF >> bits) << bits)
    r = lax.bitcast_convert_type((u + half) & mask, jnp.float32)
    return jnp.where(jnp.isfinite(x), r, x)


def top_clusters(scores: jax.Array, n_valid: jax.Array, m: int) -> jax.Array:
    """The ``min(m, n_valid)`` highest scores [b, K] as a mask; scores are compared after
    :func:`round_scores`, and ties go to the lowest index."""
    k = scores.shape[-1]
    valid = jnp.arange(k)[None, :] < n_valid[:, None]
    sc = jnp.where(valid, round_scores(scores), -jnp.inf)
    rank = R.rank_desc(sc)
    return valid & (rank < jnp.minimum(m, n_valid)[:, None])


def step_forward(params, state: DecodeState, geo: Geometry, cfg: ModelConfig, pc: PolestarConfig, block: int,
                 refresh: bool, cluster_rows: jax.Array, forced: Optional[tuple[jax.Array, jax.Array]]) -> StepFwd:
    """One decode-step forward of the block against the cache; with ``refresh`` the sparse refresh of
    the rows of the top-drift clusters runs in the same layer pass (for rows with ``cluster_rows`` [b]).

    A refreshing layer runs in three stages, each over the compacted rows it needs, at the smallest compiled
    width that holds them (see :mod:`polestar_jax.refresh`):

    1. the *packet* (rows the previous layer recomputed, ``pk_valid``): their stored inputs are read (for the
       centroid shift) and overwritten with the new ones, and their K/V are projected with the block's and
       written into the cache (only the store traffic is compacted here);
    2. the cluster drift of the shifted centroids against that cache selects the top clusters; the stored
       inputs of the selected rows that are not in the packet are read;
    3. the block rows and the selected rows go through the rest of the layer (Q, attention, MLP); the
       selected rows' outputs are the next layer's packet.

    Every weight matrix is read once per layer; only the rows of stages 1 and 2 move from the store.
    """
    pol = state.polestar
    pre, suf = pc.prefix_blocks * block, pc.suffix_blocks * block
    r_rows = pre + suf
    b = state.x.shape[0]
    blk_pos_abs = geo.cs + jnp.arange(block)
    ref_idx = jnp.broadcast_to(geo.ref_pos, geo.ref_valid.shape).astype(jnp.int32)  # [b, R]
    ref_qpos = _rows_at(state.pos, geo.ref_pos)  # [b, R] rotary positions of the window rows
    kb = pc.kernels
    blk_qpos = _rows_at(state.pos, blk_pos_abs)
    kc, ks = M.rope_tables(state.pos, cfg.head_dim, cfg.rope_theta)
    h_blk0 = M.embed(params, _rows_at(state.x, blk_pos_abs))
    dt = h_blk0.dtype
    n_layers = cfg.n_layers
    kdim = pc.n_clusters
    ws = RF.widths(pc, r_rows)

    def write_block(kcache, vcache, k, v):
        return (lax.dynamic_update_slice_in_dim(kcache, k, geo.cs, axis=2),
                lax.dynamic_update_slice_in_dim(vcache, v, geo.cs, axis=2))

    def layer(carry, xs):
        h_blk, pk_h, pk_valid, _ = carry
        lp, kcache, vcache, store, labels, cent, counts, n_cl, s_prev, fsel, fhas, li = xs
        if not refresh:  # the block rows only
            kk, vv = write_block(kcache, vcache, *M.project_kv(lp, h_blk, cfg))
            qc, qs = M.rope_tables(blk_qpos, cfg.head_dim, cfg.rope_theta)
            qr, kr = M.apply_rope(M.project_q(lp, h_blk, cfg), qc, qs), M.apply_rope(kk, kc, ks)
            out = M.finish_layer(lp, h_blk, M.attention(qr, kr, vv, state.key_valid), cfg)
            zeros_k = jnp.zeros((b, kdim), bool)
            stats = (jnp.full((b, kdim), -jnp.inf), zeros_k, zeros_k, jnp.zeros((b,), jnp.int32),
                     jnp.int32(0), jnp.int32(0))
            return (out, pk_h, pk_valid, (qr, kr)), ((kk, vv, (), cent, s_prev), stats)

        # stage 1: the packet rows. Their stored inputs are read (old values: the centroid shift) and replaced
        # by the new ones where clustered here, and their K/V join the block's in the cache (spec J8). Only
        # the store traffic is compacted: the K/V projection and the shift run over all R rows, masked, so
        # each width branch is small (each stage-1 branch compiled the layer's K/V path otherwise)
        patch = pk_valid & (labels >= 0)

        def stage1(w):
            def run():
                if w == 0:
                    return store, jnp.zeros_like(pk_h), jnp.zeros_like(pk_valid)
                idx, val = RF.compact(pk_valid, w)
                ones = jnp.ones_like(val)
                # the w rows move whole (padding rows too: they are distinct real rows), and stage 2 reuses them
                got = OF.fetch_rows(store[0], store[1], idx, ones, pc, dt)
                new_store = OF.write_rows(store[0], store[1], idx, RF.take_rows(patch, idx) & val,
                                          RF.take_rows(pk_h, idx), pc)
                return new_store, RF.spread_rows(got, idx, ones, r_rows), RF.spread_rows(ones, idx, ones, r_rows)
            return run

        n_pk = jnp.sum(pk_valid, axis=1)
        store_new, got_rows, have = RF.by_width(n_pk, ws, stage1)
        n_read = RF.chosen_width(n_pk, ws)
        # (with an int8 store the old rows are the dequantised ones: the shift carries their rounding)
        old = jnp.where(patch[..., None], got_rows, jnp.zeros((), dt))
        cent = centroid_shift(cent, labels, counts, patch, old, pk_h, backend=kb)
        k, v = M.project_kv(lp, jnp.concatenate([h_blk, pk_h], axis=1), cfg)
        kk, vv = write_block(kcache, vcache, k[:, :, :block], v[:, :, :block])
        wvalid = pk_valid & geo.ref_valid
        kk = scatter_kv_rows(kk, k[:, :, block:], ref_idx, wvalid, backend=kb)
        vv = scatter_kv_rows(vv, v[:, :, block:], ref_idx, wvalid, backend=kb)

        # the cluster drift of the (shifted) centroids against the updated cache selects the clusters
        qc_ = Dr.proxy_queries(lp, cent, cfg)
        score, s = kl_drift(qc_, kk, state.key_valid, s_prev, mode="cluster", backend=kb)
        score = jnp.where(jnp.arange(kdim)[None] < n_cl[:, None], score, -jnp.inf)
        m = jnp.where(li == n_layers - 1, pc.top_k_last, pc.top_k)
        own = top_clusters(score, n_cl, m)
        sel_c = jnp.where(fhas[:, None], fsel, own) & cluster_rows[:, None]
        sel = (labels >= 0) & jnp.take_along_axis(sel_c, jnp.clip(labels, 0, kdim - 1), axis=1)  # [b, R]
        s_prev = jnp.where(cluster_rows[:, None, None, None], s, s_prev)

        # stage 2: stored inputs of the selected rows that are neither in the packet (theirs are pk_h) nor
        # among the rows stage 1 moved. At most R - w1 rows are missing (w1 = stage 1's width), and that is a
        # width here too, so the two stages never move more than R rows per layer
        need = sel & ~pk_valid & ~have

        def stage2(w):
            def run():
                if w == 0:
                    return jnp.zeros_like(pk_h)
                idx, val = RF.compact(need, w)
                rows = OF.fetch_rows(store[0], store[1], idx, val, pc, dt)
                return RF.spread_rows(rows, idx, val, r_rows)
            return run

        n_need, ws2 = jnp.sum(need, axis=1), RF.complement_widths(ws, r_rows)
        fetched, n_fetch = RF.by_width(n_need, ws2, stage2), RF.chosen_width(n_need, ws2)
        inputs = jnp.where(pk_valid[..., None], pk_h, jnp.where(have[..., None], got_rows, fetched))  # [b, R, D]

        # stage 3: the rest of the layer for the block rows and the selected rows
        def stage3(w):
            def run():
                idx, val = RF.compact(sel, w)
                rows = jnp.concatenate([h_blk, RF.take_rows(inputs, idx)], axis=1)
                qc, qs = M.rope_tables(jnp.concatenate([blk_qpos, RF.take_rows(ref_qpos, idx)], axis=1),
                                       cfg.head_dim, cfg.rope_theta)
                qr = M.apply_rope(M.project_q(lp, rows, cfg), qc, qs)
                out = M.finish_layer(lp, rows, M.attention(qr, kr, vv, state.key_valid), cfg)
                return out[:, :block], RF.spread_rows(out[:, block:], idx, val, r_rows), qr[:, :, :block]
            return run

        # (no width-0 branch here: a layer that selects nothing in the whole batch is rare, and each branch of
        # this stage compiles the whole attention + MLP)
        kr = M.apply_rope(kk, kc, ks)  # (once, outside the branches)
        out_blk, pk_out, q_blk = RF.by_width(jnp.sum(sel, axis=1), ws[1:], stage3)
        carry = (out_blk, pk_out, sel, (q_blk, kr))
        stats = (score, sel_c, own & cluster_rows[:, None], jnp.sum(sel, axis=1).astype(jnp.int32),
                 n_read, n_fetch)
        return carry, ((kk, vv, store_new, cent, s_prev), stats)

    qk0 = (jnp.zeros((b, cfg.n_heads, block, cfg.head_dim), dt), jnp.zeros_like(state.k_cache[0]))
    carry0 = (h_blk0, jnp.zeros((b, r_rows, cfg.d_model), dt), jnp.zeros((b, r_rows), bool), qk0)
    if forced is None:
        fsel_all = jnp.zeros((n_layers, b, kdim), bool)
        fhas_all = jnp.zeros((n_layers, b), bool)
    else:
        fsel_all, fhas_all = forced
    # the store enters the layer scan only when it is read (a step without refresh leaves it where it is)
    store = (pol.hs, pol.hs_scale) if refresh else ()
    xs = (params["blocks"], state.k_cache, state.v_cache, store, pol.labels, pol.centroids, pol.counts,
          pol.n_clusters, pol.s_prev, fsel_all, fhas_all, jnp.arange(n_layers))
    carry, ((kk, vv, store, cent, s_prev), stats) = lax.scan(layer, carry0, xs)
    score, sel_c, own, n_rows, n_read, n_fetch = stats
    hs, hs_scale = store if refresh else (pol.hs, pol.hs_scale)
    h_blk, pk_h, pk_valid, (q_last, k_last) = carry
    drift, p_blk = kl_drift(q_last, k_last, state.key_valid, pol.p_prev, mode="token", backend=kb)
    logits = M.lm_head(params, h_blk, cfg)
    if refresh and suf:
        logits_suf = M.lm_head(params, pk_h[:, pre:], cfg)
        sel_suf = pk_valid[:, pre:]
    else:
        logits_suf = jnp.zeros((b, suf, logits.shape[-1]), jnp.float32)
        sel_suf = jnp.zeros((b, suf), bool)
    moved = jnp.where(cluster_rows[None, :], (n_read + n_fetch)[:, None], 0).astype(jnp.int32)  # [N, b]
    return StepFwd(kk, vv, hs, hs_scale, cent, s_prev, p_blk, drift, logits, logits_suf, sel_suf, score, sel_c,
                   own, n_rows, moved)


# ------------------------------------------------------------------------------------------ the block
def _blk(a, start, length):
    return lax.dynamic_slice_in_dim(a, start, length, axis=1)


def _commit_block(state: DecodeState, cs, block: int, transfer: jax.Array, x0: jax.Array) -> DecodeState:
    blk_x = _blk(state.x, cs, block)
    x = lax.dynamic_update_slice_in_dim(state.x, jnp.where(transfer, x0, blk_x), cs, axis=1)
    cstep = jnp.where(transfer, state.nfe[:, None], _blk(state.commit_step, cs, block))
    return state.replace(x=x, commit_step=lax.dynamic_update_slice_in_dim(state.commit_step, cstep, cs, axis=1))


def block_start(params, state: DecodeState, block_idx, threshold, cfg: ModelConfig, pc: PolestarConfig,
                block: int, gen_length: int, replay: Optional[Replay]) -> DecodeState:
    """Start of block ``block_idx``: the full or windowed pass and the threshold commit (rows whose block
    is already filled skip it: no forward, no stats)."""
    length = state.x.shape[1]
    cs = (length - gen_length) + block_idx * block
    geo = geometry(state, cs, block, pc)
    draws = block_start_draws(state, geo, cfg, pc, block, replay)
    period = pc.windowed_period
    windowed = (period > 0) & (block_idx % max(period, 1) == period - 1) if period else jnp.bool_(False)
    run = lambda w: (lambda: start_pass(params, state, geo, cfg, pc, block, w, draws))
    out = lax.cond(windowed, run(True), run(False)) if period else run(False)()
    pol = state.polestar
    # (the windowed pass keeps the K/V outside the window; the refresh rows are all inside it)
    new_pol = pol.replace(hs=out.hs, hs_scale=out.hs_scale, labels=out.clusters.labels,
                          centroids=out.clusters.centroids,
                          counts=out.clusters.counts, n_clusters=out.clusters.n, s_prev=out.s_prev,
                          p_prev=out.p_prev, hist=jnp.zeros_like(pol.hist), hist_fill=jnp.zeros_like(pol.hist_fill),
                          counter=jnp.zeros_like(pol.counter))
    masked = _blk(state.x, cs, block) == cfg.mask_token_id
    active = jnp.any(masked, axis=1)
    pred = R.predict(out.logits, masked, cfg.mask_token_id)
    transfer = R.commit_threshold(pred.conf, masked, threshold) & active[:, None]
    new = _commit_block(state.replace(k_cache=out.k, v_cache=out.v), cs, block, transfer, pred.x0)
    bi = block_idx
    new_pol = new_pol.replace(
        last_commits=jnp.sum(transfer, axis=1).astype(jnp.int32),
        block0=new_pol.block0.at[:, bi].set(jnp.where(windowed, 0, 1)),
        efficient=new_pol.efficient.at[:, bi].set(jnp.where(windowed, 1, 0)),
        processed=new_pol.processed.at[:, bi].set(True))
    new = new.replace(nfe=new.nfe + 1, polestar=new_pol)
    new = new.replace(block_nfe=new.block_nfe.at[:, bi].set(1))
    return select_rows(active, new, state)


def decode_step(params, state: DecodeState, block_idx, threshold, cfg: ModelConfig, pc: PolestarConfig,
                block: int, gen_length: int, replay: Optional[Replay]) -> tuple[DecodeState, StepOut]:
    """One Polestar decode step of block ``block_idx`` for every row that still has masks in it."""
    length = state.x.shape[1]
    cs = (length - gen_length) + block_idx * block
    geo = geometry(state, cs, block, pc)
    pol = state.polestar
    masked = _blk(state.x, cs, block) == cfg.mask_token_id
    active = jnp.any(masked, axis=1)
    counter = pol.counter + pol.last_commits
    cluster = active & ((pol.last_commits > pc.trigger_commits) | (counter > pc.trigger_accum))
    counter = jnp.where(cluster, 0, counter)
    forced = None
    if replay is not None:
        at = lambda a: jax.vmap(lambda ar, f: ar[jnp.clip(f, 0, ar.shape[0] - 1)])(a, state.nfe)
        forced = (jnp.swapaxes(at(replay.topk), 0, 1), jnp.swapaxes(at(replay.topk_forced), 0, 1))
    fwd = lambda r: (lambda: step_forward(params, state, geo, cfg, pc, block, r, cluster, forced))
    out = lax.cond(jnp.any(cluster), fwd(True), fwd(False))
    delta = Dr.drift_delta(out.drift, pol.hist, pol.hist_fill)
    hist, fill = Dr.push_history(pol.hist, pol.hist_fill, out.drift)

    pred = R.predict(out.logits, masked, cfg.mask_token_id)
    thr = R.commit_threshold(pred.conf, masked, threshold) & active[:, None]
    early = jnp.zeros_like(thr)
    if pc.early_threshold is not None:
        conf = pred.conf
        gate = pc.gate_scale * jnp.square(jnp.maximum(pc.gate_center - conf, 0.0))
        early = (masked & (conf > pc.early_threshold) & (conf < threshold) & (delta >= gate)
                 & (delta < pc.gate_max_delta) & active[:, None])
    transfer = thr | early
    new = _commit_block(state, cs, block, transfer, pred.x0)

    suf = pc.suffix_blocks * block
    commit_suf = jnp.zeros((state.x.shape[0], suf), bool)
    if pc.suffix_precommit and suf:
        suf_pos = cs + block + jnp.arange(suf)
        cur = _rows_at(new.x, suf_pos)
        cand = out.sel_suf & (cur == cfg.mask_token_id) & geo.ref_valid[:, -suf:] & (cluster & active)[:, None]
        sp = R.predict(out.logits_suf, cand, cfg.mask_token_id)
        commit_suf = cand & (sp.conf >= threshold)
        idx = jnp.where(commit_suf, suf_pos[None], length)
        bi = jnp.arange(state.x.shape[0])[:, None]
        new = new.replace(x=new.x.at[bi, idx].set(sp.x0, mode="drop"),
                          commit_step=new.commit_step.at[bi, idx].set(
                              jnp.broadcast_to(state.nfe[:, None], idx.shape), mode="drop"))

    n_commit = jnp.sum(transfer, axis=1).astype(jnp.int32)
    new_pol = pol.replace(
        hs=out.hs, hs_scale=out.hs_scale, centroids=out.centroids, s_prev=out.s_prev, p_prev=out.p_blk,
        hist=hist, hist_fill=fill,
        counter=counter, last_commits=n_commit,
        cluster_steps=pol.cluster_steps.at[:, block_idx].add(cluster.astype(jnp.int32)),
        early=pol.early + jnp.sum(early & ~thr, axis=1).astype(jnp.int32),
        suffix=pol.suffix + jnp.sum(commit_suf, axis=1).astype(jnp.int32))
    new = new.replace(k_cache=out.k, v_cache=out.v, polestar=new_pol, nfe=state.nfe + 1,
                      block_nfe=state.block_nfe.at[:, block_idx].add(1))
    new = select_rows(active, new, state)
    sw = lambda a: jnp.swapaxes(a, 0, 1)
    step = StepOut(active, cluster, out.drift, delta, sw(out.scores), sw(out.selected), sw(out.own),
                   sw(out.n_rows), sw(out.moved_rows), thr, early & ~thr, commit_suf)
    return new, step


def empty_steps(n_steps: int, b: int, cfg: ModelConfig, pc: PolestarConfig, block: int) -> StepOut:
    """A zero buffer for ``n_steps`` StepOuts (leading axis = step within the block)."""
    n, k, suf = cfg.n_layers, pc.n_clusters, pc.suffix_blocks * block
    z = lambda *s, dt=jnp.float32: jnp.zeros((n_steps,) + s, dt)
    return StepOut(z(b, dt=bool), z(b, dt=bool), z(b, block), z(b, block),
                   z(b, n, k), z(b, n, k, dt=bool), z(b, n, k, dt=bool), z(b, n, dt=jnp.int32), z(b, n, dt=jnp.int32),
                   z(b, block, dt=bool), z(b, block, dt=bool), z(b, suf, dt=bool))


def decode_block(params, state: DecodeState, block_idx, threshold, cfg: ModelConfig, pc: PolestarConfig,
                 block: int, gen_length: int, replay: Optional[Replay]) -> tuple[DecodeState, StepOut]:
    """A whole Polestar block: the block-start pass, then decode steps in a ``lax.while_loop`` (bounded
    by ``block + 1`` steps: every step commits at least one token). Returns the state and the StepOut of
    every step ([block + 1, ...], inactive entries zero)."""
    state = block_start(params, state, block_idx, threshold, cfg, pc, block, gen_length, replay)
    length = state.x.shape[1]
    cs = (length - gen_length) + block_idx * block
    b = state.x.shape[0]
    n_steps = block + 1
    trace0 = empty_steps(n_steps, b, cfg, pc, block)

    def cond(c):
        s, i, _ = c
        return jnp.any(_blk(s.x, cs, block) == cfg.mask_token_id) & (i < n_steps)

    def body(c):
        s, i, tr = c
        s, so = decode_step(params, s, block_idx, threshold, cfg, pc, block, gen_length, replay)
        tr = jax.tree.map(lambda buf, v: buf.at[i].set(v), tr, so)
        return s, i + 1, tr

    state, _, trace = lax.while_loop(cond, body, (state, jnp.int32(0), trace0))
    return state, trace
