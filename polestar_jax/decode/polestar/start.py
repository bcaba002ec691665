"""Polestar's block-start forward: a full pass (or, every ``windowed_period``-th block, a pass over the
refresh window only) that writes the K/V cache, stores and clusters every layer's refresh-window inputs,
and keeps the proxy attention of the centroids (``s_prev``) and the last layer's block attention rows
(``p_prev``) for the drift of the next step (see ``docs/algorithm.md#block-start``)."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from polestar_jax.decode.polestar import offload
from polestar_jax.decode.polestar.cluster import Clusters, KMeansDraws, cluster_windows
from polestar_jax.config import ModelConfig, PolestarConfig
from polestar_jax.decode.polestar.drift import proxy_attention
from polestar_jax.models import kv_quant
from polestar_jax.models.family import family_of
from polestar_jax.kernels.refresh import scatter_kv_rows
from polestar_jax.models.llada import Rope, attention_exact, layer_scan, own_rows
from polestar_jax.decode.polestar.state import Geometry, rows_at
from polestar_jax.decode.state import DecodeState


class PassOut(NamedTuple):
    """What a block-start pass computes (:func:`start_pass`); :func:`cluster_layers` clusters its rows."""

    k: jax.Array  # [N, b, KV, L, hd]
    v: jax.Array
    hs: jax.Array  # [N, b, R, D] encoded (see polestar_jax.decode.polestar.offload), host memory when offloaded
    hs_scale: jax.Array  # [N, b, R]
    rows: jax.Array  # [N, b, R, D] every layer's refresh-window inputs as computed (what is clustered)
    p_prev: jax.Array  # [b, H, B, L]
    logits: jax.Array  # [b, B, V]


class StartOut(NamedTuple):
    k: jax.Array  # [N, b, KV, L, hd]
    v: jax.Array
    hs: jax.Array  # [N, b, R, D] encoded (see polestar_jax.decode.polestar.offload), host memory when offloaded
    hs_scale: jax.Array  # [N, b, R]
    clusters: Clusters  # leaves [N, b, ...]
    s_prev: jax.Array  # [N, b, H, K, L] (H = 1 with proxy_score "mean")
    p_prev: jax.Array  # [b, H, B, L]
    logits: jax.Array  # [b, B, V]


class PassRows(NamedTuple):
    """Which rows a block-start pass computes (the full sequence, or the window)."""

    ids: jax.Array  # [b, T] tokens of the query rows
    q_pos: jax.Array  # [b, T] their RoPE positions
    block_offset: jax.Array  # [] where the block starts among the query rows
    store_rows: jax.Array  # [R] query-row index of each refresh row
    write_idx: jax.Array  # [b, T] cache positions of the query rows (windowed pass)
    write_valid: jax.Array  # [b, T] which of them exist


def pass_rows(state: DecodeState, geo: Geometry, pc: PolestarConfig, block: int, windowed: bool) -> PassRows:
    length, b = state.x.shape[1], state.x.shape[0]
    if not windowed:
        q_abs = jnp.arange(length)
        none = jnp.zeros((b, length), bool)
        return PassRows(state.x, rows_at(state.pos, q_abs), geo.cs, geo.ref_pos, none.astype(jnp.int32), none)
    pre, suf = pc.pass_window(block, True)
    q_abs = geo.cs - pre + jnp.arange(pre + block + suf)  # window positions
    pad = -state.pos[:, 0]
    valid = (q_abs[None] >= pad[:, None]) & ((q_abs >= 0) & (q_abs < length))[None]
    # query row of each store row (store rows outside this pass's window are not valid in ``geo``)
    store_rows = jnp.clip(geo.ref_pos - (geo.cs - pre), 0, pre + block + suf - 1)
    return PassRows(rows_at(state.x, q_abs), rows_at(state.pos, q_abs), jnp.int32(pre), store_rows,
                    jnp.broadcast_to(q_abs, valid.shape).astype(jnp.int32), valid)


def kept_outside_window(state: DecodeState, geo: Geometry, pc: PolestarConfig, block: int, keep) -> jax.Array:
    """[b, L] bool: the cache positions a full-length pass keeps as cached, for the rows of ``keep`` ([b] or
    [] bool) that take a windowed block start: those outside the windowed pass's window and those the
    windowed pass would not write (padding, past the sequence)."""
    b, length = state.x.shape
    pre, suf = pc.pass_window(block, True)
    pos = jnp.arange(length)
    cs = jnp.reshape(geo.cs, (-1, 1))  # [] or [b] -> [1 | b, 1]
    written = (pos[None] >= cs - pre) & (pos[None] < cs + block + suf) & (pos[None] >= -state.pos[:, :1])
    return jnp.broadcast_to(jnp.reshape(keep, (-1, 1)), (b, length)) & ~written


class StartWrite:
    """A block-start pass's :func:`~polestar_jax.models.llada.layer` ``write`` into the layer's K/V ``old``
    (read before the layer writes it): ``put(old, new, backend)`` places the rows' fresh K/V ``new`` [b, KV,
    T, hd] into the layer's ``old`` [b, KV, L, hd] (a select of the kept entries, a row scatter with the
    kernels ``backend``). With a float cache the layer attends to what is written and stores it. With an
    int8 cache the layer attends to float K/V (the cached entries dequantized, the fresh ones as computed:
    as the full pass of a fresh cache does) and ``stored`` holds the layer the cache keeps: the fresh rows
    quantized, the kept entries' int8 values and scales as they were (re-quantizing their dequantized
    values would move them)."""

    def __init__(self, old, put, backend: str = "reference"):
        self.old, self.put, self.backend, self.stored = old, put, backend, None

    def __call__(self, k, v):
        if kv_quant.is_int8(self.old[0]):  # (the int8 parts written with jnp: a kernel takes float rows)
            stored = jax.tree.map(lambda o, n: self.put(o, n, "reference"), self.old,
                                  kv_quant.stored_like(self.old, (k, v)))
            # the layer's new buffers made once, before anything else reads them: every read of the old
            # layer then precedes its in-place write (else XLA copied the whole int8 cache, K and V, values and
            # scales, every layer); the attention's float K/V are the written ones with the fresh rows unrounded
            self.stored = lax.optimization_barrier(stored)
            return tuple(self.put(kv_quant.read(o), n, self.backend) for o, n in zip(self.stored, (k, v)))
        return tuple(self.put(o, n, self.backend) for o, n in zip(self.old, (k, v)))


def start_pass(params, state: DecodeState, geo: Geometry, cfg: ModelConfig, pc: PolestarConfig, block: int,
               windowed: bool, unroll: int | bool = 1, keep=None, skip=None) -> PassOut:
    """The block-start forward: full sequence (``windowed=False``) or the window only (``windowed=True``,
    keys outside the window stay as cached). Its window rows are clustered afterwards
    (:func:`cluster_layers`), once for both kinds of pass.

    ``keep`` ([b] or [] bool, full passes only): rows that take a windowed start inside this full-length
    pass: their K/V outside the window stay as cached, so their window rows compute what the windowed
    pass computes (a running batch whose rows need both kinds runs this one pass instead of two).

    ``skip`` ([b] bool): rows whose K/V cache the pass leaves as it is (a row whose block start does not
    happen: their other outputs are dropped by the caller). Kept inside each layer's write, the cache is
    updated in place; a select of the whole new cache against the old one after the pass would keep both
    alive (a second K/V cache in the program's temporaries)."""
    b, length = state.x.shape
    rows = pass_rows(state, geo, pc, block, windowed)
    fam = family_of(cfg)
    q_rope, k_rope = Rope.at(rows.q_pos, cfg), Rope.at(state.pos, cfg)
    kept = None if keep is None else kept_outside_window(state, geo, pc, block, keep)[:, None, :, None]
    if skip is not None and not windowed:
        kept = (skip[:, None, None, None] if kept is None else kept | skip[:, None, None, None])
    write_valid = rows.write_valid if skip is None else rows.write_valid & ~skip[:, None]

    def layer(carry, lp, slot):
        h, _ = carry
        kv = slot.layer()  # (a block start writes every row of the layer: the slot takes it whole)
        hs = rows_at(h, rows.store_rows)  # [b, R, D]
        write = None
        if kept is not None:  # (the K/V cache rides in the scan's carry: model.layer_scan)
            write = StartWrite(kv, lambda old, new, backend: jnp.where(kept, old, new))
        if windowed:
            # (the K/V cache rides in the scan's carry: model.layer_scan)
            write = StartWrite(kv, lambda old, new, backend: scatter_kv_rows(old, new, rows.write_idx, write_valid,
                                                                             backend=backend), pc.kernels)
        # (no [T, L] probabilities: the pass's attention is the one a plain forward runs, fused where the
        # platform has it; the drift needs the last layer's block rows only: their queries ride in the carry)
        out = fam.layer(lp, h, cfg, q_rope, k_rope, state.key_valid, write=write)
        q_blk = lax.dynamic_slice_in_dim(out.q_rot, rows.block_offset, block, axis=2)
        stored, scale = offload.encode(hs, pc)
        return (out.h, q_blk), (offload.to_host(stored, pc), offload.to_host(scale, pc), hs), \
            (out.keys.k, out.keys.v) if write is None or write.stored is None else write.stored

    h0 = fam.embed(params, rows.ids)
    q0 = jnp.zeros((b, cfg.n_heads, block, cfg.head_dim), h0.dtype)
    # (a full pass overwrites every layer's K/V in place, a windowed one its window's rows)
    (h, q_blk), (hs, hs_sc, raw), (kk, vv) = layer_scan(layer, (h0, q0), params["blocks"],
                                                        (state.k_cache, state.v_cache), unroll=unroll)
    # the token drift's baseline: the last layer's attention of the block rows [b, H, B, L], once, the exact way,
    # against that layer's keys and values as the pass wrote them (the cache keeps Polestar's keys un-rotated)
    # (an int8 cache: the keys dequantized before RoPE, the values read in the attention)
    k_last, v_last = (jax.tree.map(lambda a: own_rows(a[-1]), c) for c in (kk, vv))
    p_blk = attention_exact(q_blk, k_rope.rotate(kv_quant.read(k_last)), v_last, state.key_valid,
                            return_probs=True)[1]
    logits = fam.head_at(params, h, cfg, rows.block_offset, block)
    return PassOut(kk, vv, hs, hs_sc, raw, p_blk, logits)


def cluster_layers(params, out: PassOut, state: DecodeState, geo: Geometry, cfg: ModelConfig, pc: PolestarConfig,
                   block: int, draws: tuple[KMeansDraws, KMeansDraws], unroll: int | bool = 1) -> StartOut:
    """Every layer's refresh-window inputs of a block-start pass clustered (k-means over the prefix and
    suffix windows, :func:`polestar_jax.decode.polestar.cluster.cluster_windows`), and the proxy attention of the centroids
    against the layer's new keys (``s_prev``). Run once after whichever pass ran, so the program holds one
    copy of it."""
    pre = pc.prefix_rows(block)

    def layer(_, xs):
        lp, hs, k, d_pre, d_suf = xs
        k = jax.tree.map(own_rows, k)  # (a running batch's rows share the cache: llada.CacheSlot)
        cl = jax.vmap(lambda xp, pl, xs_, sl, a, c: cluster_windows(xp, pl, xs_, sl, a, c, pc.n_clusters,
                                                                    pc.kmeans_iters))(
            hs[:, :pre], geo.pre_len, hs[:, pre:], geo.suf_len, d_pre, d_suf)
        return None, (cl, proxy_attention(lp, cl.centroids, k, cfg, state.key_valid, pc.proxy_score))

    _, (cl, s) = lax.scan(layer, None, (params["blocks"], out.rows, out.k, *draws), unroll=unroll)
    return StartOut(out.k, out.v, out.hs, out.hs_scale, cl, s, out.p_prev, out.logits)


def block_start_forward(params, state: DecodeState, geo: Geometry, cfg: ModelConfig, pc: PolestarConfig,
                        block: int, windowed: bool, draws: tuple[KMeansDraws, KMeansDraws],
                        unroll: int | bool = 1) -> StartOut:
    """One kind of block-start pass and its clustering (:func:`start_pass`, then :func:`cluster_layers`)."""
    out = start_pass(params, state, geo, cfg, pc, block, windowed, unroll)
    return cluster_layers(params, out, state, geo, cfg, pc, block, draws, unroll)
