"""Polestar's decode-step forward: the block against the cache, and (on refresh steps) the sparse refresh
of the refresh window's top-drift clusters in the same layer pass.

A refreshing layer runs three stages, each over the compacted rows it needs, at the smallest compiled
width that holds them (:mod:`polestar_jax.decode.polestar.compaction`; stages 1 and 2 compact only a store in host memory,
:func:`polestar_jax.decode.polestar.compaction.store_widths`):

1. :func:`patch_packet`: the *packet* (rows the previous layer recomputed): their stored inputs are read
   (for the centroid shift) and overwritten with the new ones, and their K/V are projected with the block's
   and written into the cache (only the store traffic is compacted here);
2. :func:`select_clusters` + :func:`fetch_selected`: the cluster drift of the shifted centroids against that
   cache selects the top clusters; the stored inputs of the selected rows not yet on the device are read;
3. :func:`refresh_rows`: the block rows and the selected rows go through the rest of the layer (Q,
   attention, MLP); the selected rows' outputs are the next layer's packet.

Every weight matrix is read once per layer; only the rows of stages 1 and 2 move from the store. See
``docs/algorithm.md#the-refresh-step``.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from polestar_jax.decode.commit import Prediction, rank_desc
from polestar_jax.decode.polestar.compaction import (by_width, chosen_width, compact, complement_widths, spread_rows, store_widths,
                                                     take_rows, widths)
from polestar_jax.config import ModelConfig, PolestarConfig
from polestar_jax.decode.polestar.drift import cluster_drift, proxy_inputs
from polestar_jax.models.family import Family, family_of
from polestar_jax.kernels.kl_drift import kl_drift
from polestar_jax.kernels.refresh import centroid_shift, scatter_is_reference, scatter_kv_rows
from polestar_jax.models import kv_quant
from polestar_jax.models.llada import CacheSlot, Keys, Rope, layer_scan, slice_write
from polestar_jax.decode.polestar.offload import encode, fetch_rows, uses_host, write_rows
from polestar_jax.decode.polestar.state import Geometry, rows_at
from polestar_jax.decode.state import DecodeState

#: Relative tolerance under which two cluster scores count as tied (~2.4e-4): ~10x the float32 noise of
#: the structural ties seen so far (identical rows: at most ~2e-5 relative across the batch sizes and mesh
#: partitionings tested on the CPU), well below typical gaps between real drift scores.
SCORE_TIE_RTOL = 2.0 ** -12


def tie_groups(scores: jax.Array, rtol: float = SCORE_TIE_RTOL) -> jax.Array:
    """Tie group of each score [b, K] (int32; 0 = the highest group).

    The scores of a row are sorted in descending order and cut wherever two neighbours differ by more than
    ``rtol`` times the larger magnitude; the runs between cuts are the groups (equal infinities are tied;
    a finite score is never tied with an infinite one). Clusters made of identical rows (e.g. all-[MASK]
    suffix rows at layer 0) have mathematically equal drift scores whose float rounding depends on how XLA
    blocks the matmuls (batch size, backend, mesh); they always land in one group, wherever their values
    lie, so a row's refresh choice -- and its tokens -- do not depend on how it is decoded
    (docs/differences.md#d3)."""
    x = scores.astype(jnp.float32)
    order = jnp.argsort(-x, axis=-1, stable=True)
    xs = jnp.take_along_axis(x, order, axis=-1)  # [b, K] descending
    hi, lo = xs[:, :-1], xs[:, 1:]
    both_finite = jnp.isfinite(hi) & jnp.isfinite(lo)
    close = (hi == lo) | (both_finite & (hi - lo <= rtol * jnp.maximum(jnp.abs(hi), jnp.abs(lo))))
    cuts = jnp.concatenate([jnp.zeros_like(close[:, :1]), ~close], axis=-1)
    group_sorted = jnp.cumsum(cuts.astype(jnp.int32), axis=-1)  # [b, K] along the sorted order
    return jnp.take_along_axis(group_sorted, jnp.argsort(order, axis=-1), axis=-1)


def top_clusters(scores: jax.Array, n_valid: jax.Array, m, rtol: float = SCORE_TIE_RTOL) -> jax.Array:
    """The ``min(m, n_valid)`` highest scores [b, K] as a mask: clusters are ranked by :func:`tie_groups`
    (with ``rtol``), and within a group the lowest index wins, as for exact ties."""
    k = scores.shape[-1]
    valid = jnp.arange(k)[None, :] < n_valid[:, None]
    group = tie_groups(jnp.where(valid, scores, -jnp.inf), rtol)
    rank = rank_desc(-(group * k + jnp.arange(k)[None, :]).astype(jnp.float32))
    return valid & (rank < jnp.minimum(m, n_valid)[:, None])


class StepForwardOut(NamedTuple):
    k: jax.Array
    v: jax.Array
    hs: jax.Array
    hs_scale: jax.Array
    centroids: jax.Array
    s_prev: jax.Array
    p_blk: jax.Array  # [b, H, B, L]
    drift: jax.Array  # [b, B]
    logits: Optional[jax.Array]  # [b, B, V] (None with a ``score``: then ``pred``)
    logits_suf: Optional[jax.Array]  # [b, Ws, V] (None with a ``score``: then ``pred_suf``)
    sel_suf: jax.Array  # [b, Ws] bool rows of the last layer's packet in the suffix window
    scores: jax.Array  # [N, b, K]
    selected: jax.Array  # [N, b, K]
    own: jax.Array  # [N, b, K]
    n_rows: jax.Array  # [N, b]
    moved_rows: jax.Array  # [N, b] store rows read (stage widths 1 + 2: R with a device store; 0 without refresh)
    pred: Optional[Prediction] = None  # [b, B] the block rows scored (with a ``score``; conf on every row)
    pred_suf: Optional[Prediction] = None  # [b, Ws] the suffix rows scored (x0 0 and conf -inf without refresh)


class StepCtx(NamedTuple):
    """What every layer of one step shares (built once per step)."""

    cfg: ModelConfig
    fam: Family
    pc: PolestarConfig
    block: int
    geo: Geometry
    key_valid: jax.Array  # [b, L]
    k_rope: Rope  # all L keys
    blk_pos: jax.Array  # [b, B] RoPE positions of the block rows
    blk_rope: Rope  # their tables
    ref_idx: jax.Array  # [b, R] cache positions of the window rows
    ref_qpos: jax.Array  # [b, R] their RoPE positions
    cluster_rows: jax.Array  # [b] rows that refresh in this step
    write_rows: jax.Array  # [b] rows whose block K/V this step writes (the active ones: others keep their cache)
    widths: tuple  # compiled widths of stage 3 (compaction.widths; its 0 unused)
    store_widths: tuple  # compiled widths of stage 1 (compaction.store_widths)

    @property
    def rows(self) -> int:
        return self.geo.ref_pos.shape[0]


class Carry(NamedTuple):
    """The layer-scan carry: block rows, the packet (rows recomputed by the previous layer), and the last
    layer's block queries and rotated keys (for the token drift)."""

    h_blk: jax.Array  # [b, B, D]
    pk_h: jax.Array  # [b, R, D]
    pk_valid: jax.Array  # [b, R] bool
    q_blk: jax.Array  # [b, H, B, hd]
    k_rot: jax.Array  # [b, KV, L, hd]


class LayerIn(NamedTuple):
    """The layer-scan inputs (leading axis: layers; the K/V cache rides in the scan's carry)."""

    lp: dict
    store: tuple  # (hs [b, R, D], hs_scale [b, R]) on refresh steps, () otherwise
    labels: jax.Array  # [b, R]
    centroids: jax.Array  # [b, K, D]
    counts: jax.Array  # [b, K]
    n_clusters: jax.Array  # [b]
    s_prev: jax.Array  # [b, H, K, L] (H = 1 with proxy_score "mean")
    forced_sel: jax.Array  # [b, K] replayed selections
    forced_has: jax.Array  # [b] whether a selection is replayed
    index: jax.Array  # [] layer number


class LayerOutputs(NamedTuple):
    """What each layer hands to the scan's outputs (leading axis: layers after the scan)."""

    k: jax.Array
    v: jax.Array
    store: tuple
    centroids: jax.Array
    s_prev: jax.Array


class LayerStats(NamedTuple):
    scores: jax.Array  # [b, K] cluster drift (-inf on invalid slots)
    selected: jax.Array  # [b, K] refreshed clusters
    own: jax.Array  # [b, K] what this implementation chose (differs from ``selected`` only in replay)
    n_rows: jax.Array  # [b] rows recomputed
    n_read: jax.Array  # [] stage-1 width
    n_fetch: jax.Array  # [] stage-2 width


def _write_block(ctx: StepCtx, cache):
    """The block rows' K/V write of a step (active rows only) into ``cache``: the layer's (K, V), or the
    layer scan's :class:`~polestar_jax.models.llada.CacheSlot` (written in place)."""
    return slice_write(cache, ctx.geo.cs, mask=ctx.write_rows[:, None])


def plain_layer(ctx: StepCtx, carry: Carry, xs: LayerIn, slot: CacheSlot) -> tuple[Carry, tuple]:
    """A layer of a step without refresh: the block rows only (their K/V written into ``slot`` in place;
    the returned outputs' ``k`` is the updated slot, ``v`` None)."""
    write = _write_block(ctx, slot)
    out = ctx.fam.layer(xs.lp, carry.h_blk, ctx.cfg, ctx.blk_rope, ctx.k_rope, ctx.key_valid, write=write)
    b, kdim = carry.h_blk.shape[0], ctx.pc.n_clusters
    no = jnp.zeros((b, kdim), bool)
    stats = LayerStats(jnp.full((b, kdim), -jnp.inf), no, no, jnp.zeros((b,), jnp.int32), jnp.int32(0), jnp.int32(0))
    return (carry._replace(h_blk=out.h, q_blk=out.q_rot, k_rot=out.keys.k_rot),
            (LayerOutputs(write.slot, None, (), xs.centroids, xs.s_prev), stats))


class Packet(NamedTuple):
    """Stage 1's results."""

    store: tuple  # the layer's store with the packet rows rewritten
    got: jax.Array  # [b, R, D] stored inputs read (on the rows stage 1 moved)
    have: jax.Array  # [b, R] rows stage 1 moved
    centroids: jax.Array  # [b, K, D] shifted centroids
    k: jax.Array  # [b, KV, L, hd] the layer's cache with the block's and the packet's K/V
    v: jax.Array
    slot: CacheSlot  # the stacked cache with them written
    store_slot: Optional[CacheSlot]  # the stacked store with the packet rows rewritten (in place), or None
    n_read: jax.Array  # [] width of the store read


def store_in_place(pc: PolestarConfig, dtype) -> bool:
    """Whether a refresh step writes the hidden-state store's rows into the stacked store in place (a store
    in device memory whose row scatter is XLA's: :func:`~polestar_jax.kernels.refresh.scatter_is_reference`),
    rather than through the layer scan's inputs and outputs (a store in host memory, a scatter kernel)."""
    return not uses_host(pc) and scatter_is_reference(pc.kernels, dtype)


def patch_packet(ctx: StepCtx, carry: Carry, xs: LayerIn, dt, slot: CacheSlot,
                 store_slot: Optional[CacheSlot] = None) -> Packet:
    """Stage 1: the packet rows' stored inputs are read (old values: the centroid shift) and replaced by the
    new ones where clustered here, and their K/V join the block's in the cache ``slot`` (written in place
    where the row scatter is XLA's: :func:`~polestar_jax.kernels.refresh.scatter_is_reference`;
    docs/differences.md#d21). Only the store traffic is compacted: the K/V projection and the shift run over
    all R rows, masked, so each width branch is small. ``store_slot`` (:func:`store_in_place`): the stacked
    store, whose packet rows are written in place after the width branches (the rows written do not depend
    on the width: every packet row clustered here); None: ``xs.store``, the layer's, rewritten."""
    patch = carry.pk_valid & (xs.labels >= 0)
    r_rows, pc = ctx.rows, ctx.pc
    direct = store_slot is not None
    layer_store = store_slot.layer() if direct else xs.store

    def stage(w):
        def run():
            if w == 0:
                return () if direct else layer_store, jnp.zeros_like(carry.pk_h), jnp.zeros_like(carry.pk_valid)
            if w == r_rows:  # every row, in place: nothing to compact
                every = jnp.ones_like(carry.pk_valid)
                idx = jnp.broadcast_to(jnp.arange(r_rows, dtype=jnp.int32), every.shape)
                got = fetch_rows(layer_store[0], layer_store[1], idx, every, pc, dt)
                if direct:
                    return (), got, every
                return write_rows(layer_store[0], layer_store[1], idx, patch, carry.pk_h, pc), got, every
            idx, val = compact(carry.pk_valid, w)
            ones = jnp.ones_like(val)
            # the w rows move whole (padding rows too: they are distinct real rows), and stage 2 reuses them
            got = fetch_rows(layer_store[0], layer_store[1], idx, ones, pc, dt)
            new_store = () if direct else write_rows(layer_store[0], layer_store[1], idx,
                                                     take_rows(patch, idx) & val, take_rows(carry.pk_h, idx), pc)
            return new_store, spread_rows(got, idx, ones, r_rows), spread_rows(ones, idx, ones, r_rows)
        return run

    n_pk = jnp.sum(carry.pk_valid, axis=1)
    store, got, have = by_width(n_pk, ctx.store_widths, stage)
    if direct:  # the packet rows clustered here, encoded, into the stacked store in place
        every = jnp.broadcast_to(jnp.arange(r_rows, dtype=jnp.int32), patch.shape)
        store_slot = store_slot.scatter_rows(encode(carry.pk_h, pc), every, patch, axis=1)
        store = store_slot.layer()
    # (with an int8 store the old rows are the dequantised ones: the shift carries their rounding)
    old = jnp.where(patch[..., None], got, jnp.zeros((), dt))
    cent = centroid_shift(xs.centroids, xs.labels, xs.counts, patch, old, carry.pk_h, backend=pc.kernels)
    if direct:  # stage 3's inputs of the moved rows, read from the store as written: its packet rows take pk_h
        # and the others are unchanged, so the same values; read from the old store, the stacked store would
        # be copied (twice a layer) to outlive its in-place write
        got = fetch_rows(store[0], store[1], every, have, pc, dt)
    k, v = ctx.fam.project_kv(xs.lp, jnp.concatenate([carry.h_blk, carry.pk_h], axis=1), ctx.cfg)
    write = _write_block(ctx, slot)  # (the block rows, in place)
    write(k[:, :, :ctx.block], v[:, :, :ctx.block])
    # K/V of every packet row (LLaDA), or only of those clustered here, as the store patch (Dream)
    wvalid = (patch if pc.patch_kv == "clustered" else carry.pk_valid) & ctx.geo.ref_valid
    pk_k, pk_v = k[:, :, ctx.block:], v[:, :, ctx.block:]
    rows = (write.slot, (pk_k, pk_v), ctx.ref_idx, wvalid)
    if kv_quant.is_int8(slot.buffers[0]):  # (no int8 scatter kernel: XLA's scatter, in the target's best form)
        slot, (kk, vv) = lax.platform_dependent(*rows, tpu=rows_by_layer, default=rows_in_place)
    elif scatter_is_reference(pc.kernels, k.dtype):
        slot, (kk, vv) = rows_in_place(*rows)
    else:  # a row-scatter kernel writes into the layer's cache
        slot, (kk, vv) = rows_by_layer(*rows, backend=pc.kernels)
    return Packet(store, got, have, cent, kk, vv, slot, store_slot, chosen_width(n_pk, ctx.store_widths))


def rows_in_place(slot: CacheSlot, rows: tuple, idx: jax.Array, valid: jax.Array) -> tuple[CacheSlot, tuple]:
    """A refresh's K/V rows ``rows`` (K, V [b, KV, C, hd], float) written at positions ``idx`` [b, C] where
    ``valid`` into layer ``slot.i`` of the stacked cache (quantized first for an int8 cache), by a row scatter
    in place: ``(slot, (k, v))`` with the layer's K/V [b, KV, L, hd] as written. Only the rows move."""
    slot = slot.scatter_rows(rows, idx, valid, axis=2)
    return slot, slot.layer()


def rows_by_layer(slot: CacheSlot, rows: tuple, idx: jax.Array, valid: jax.Array,
                  backend: str = "reference") -> tuple[CacheSlot, tuple]:
    """:func:`rows_in_place`, equal values, by a row scatter into the layer's cache copied out and written
    back whole (:func:`~polestar_jax.kernels.refresh.scatter_kv_rows` with ``backend``, per array of an int8
    cache). The form for a scatter kernel, and an int8 cache's on a TPU: XLA:TPU lays a row scatter into the
    stacked cache out apart from the cache's other users (the sequence axis before the KV heads, (8, 128)
    tiles), so it copied the whole stacked cache around each layer's scatter (LLaDA-8B's Polestar program at
    batch 32 on one v5e chip: 22.5 GiB of HBM, 18.3 GiB this way, ``bench/tpu_proxy.py``)."""
    kk, vv = slot.layer()
    new = kv_quant.stored_like((kk, vv), rows)
    put = lambda cache, r: jax.tree.map(lambda a, u: scatter_kv_rows(a, u, idx, valid, backend=backend), cache, r)
    kk, vv = put(kk, new[0]), put(vv, new[1])
    return slot.put_layer((kk, vv)), (kk, vv)


class Selection(NamedTuple):
    scores: jax.Array  # [b, K]
    s_new: jax.Array  # [b, H, K, L] proxy attention now
    chosen: jax.Array  # [b, K] clusters refreshed (replayed where forced)
    own: jax.Array  # [b, K] this implementation's choice
    rows: jax.Array  # [b, R] refresh rows selected


def select_clusters(ctx: StepCtx, xs: LayerIn, pk: Packet) -> Selection:
    """The cluster drift of the (shifted) centroids against the updated cache, and the top clusters."""
    kdim = ctx.pc.n_clusters
    qc, kc = proxy_inputs(xs.lp, pk.centroids, pk.k, ctx.cfg, ctx.pc.proxy_score)
    score, s = cluster_drift(qc, kc, ctx.key_valid, xs.s_prev, ctx.pc.kernels)
    score = jnp.where(jnp.arange(kdim)[None] < xs.n_clusters[:, None], score, -jnp.inf)
    m = jnp.where(xs.index == ctx.cfg.n_layers - 1, ctx.pc.top_k_last, ctx.pc.top_k)
    own = top_clusters(score, xs.n_clusters, m)
    chosen = jnp.where(xs.forced_has[:, None], xs.forced_sel, own) & ctx.cluster_rows[:, None]
    rows = (xs.labels >= 0) & jnp.take_along_axis(chosen, jnp.clip(xs.labels, 0, kdim - 1), axis=1)
    return Selection(score, s, chosen, own, rows)


def fetch_selected(ctx: StepCtx, carry: Carry, xs: LayerIn, pk: Packet, sel: Selection, dt):
    """Stage 2: the stored inputs of the selected rows that are neither in the packet (theirs are ``pk_h``)
    nor among the rows stage 1 moved. At most R - w1 rows are missing (w1 = stage 1's width), and that is a
    width here too, so the two stages never move more than R rows per layer. Returns (inputs [b, R, D] of
    the selected rows, width read)."""
    need = sel.rows & ~carry.pk_valid & ~pk.have

    def stage(w):
        def run():
            if w == 0:
                return jnp.zeros_like(carry.pk_h)
            idx, val = compact(need, w)
            # (the store as stage 1 left it: the rows read here are not packet rows, which it rewrote)
            rows = fetch_rows(pk.store[0], pk.store[1], idx, val, ctx.pc, dt)
            return spread_rows(rows, idx, val, ctx.rows)
        return run

    n_need, ws2 = jnp.sum(need, axis=1), complement_widths(ctx.store_widths, ctx.rows)
    fetched = by_width(n_need, ws2, stage)
    inputs = jnp.where(carry.pk_valid[..., None], carry.pk_h,
                       jnp.where(pk.have[..., None], pk.got, fetched))
    return inputs, chosen_width(n_need, ws2)


def refresh_rows(ctx: StepCtx, xs: LayerIn, h_blk, inputs, sel_rows, keys: Keys):
    """Stage 3: the rest of the layer for the block rows and the selected rows (compacted). Returns the
    block rows' output [b, B, D], the selected rows' output spread to [b, R, D], the block queries."""

    def stage(w):
        def run():
            idx, val = compact(sel_rows, w)
            rows = jnp.concatenate([h_blk, take_rows(inputs, idx)], axis=1)
            q_rope = Rope.at(jnp.concatenate([ctx.blk_pos, take_rows(ctx.ref_qpos, idx)], axis=1), ctx.cfg)
            out = ctx.fam.layer(xs.lp, rows, ctx.cfg, q_rope, ctx.k_rope, ctx.key_valid, keys=keys)
            return out.h[:, :ctx.block], spread_rows(out.h[:, ctx.block:], idx, val, ctx.rows), \
                out.q_rot[:, :, :ctx.block]
        return run

    # (no width-0 branch here: a layer that selects nothing in the whole batch is rare, and each branch of
    # this stage compiles the whole attention + MLP)
    return by_width(jnp.sum(sel_rows, axis=1), ctx.widths[1:], stage)


def refresh_layer(ctx: StepCtx, carry: Carry, xs: LayerIn, dt, slot: CacheSlot,
                  store_slot: Optional[CacheSlot] = None) -> tuple[Carry, tuple]:
    """A layer of a refresh step: stages 1-3 (see the module docstring); the K/V writes go into ``slot``
    (the returned outputs' ``k`` is the updated slot, ``v`` the updated ``store_slot`` (see
    :func:`patch_packet`; its ``store`` then empty)."""
    pk = patch_packet(ctx, carry, xs, dt, slot, store_slot)
    sel = select_clusters(ctx, xs, pk)
    s_prev = jnp.where(ctx.cluster_rows[:, None, None, None], sel.s_new, xs.s_prev)
    inputs, n_fetch = fetch_selected(ctx, carry, xs, pk, sel, dt)
    # (rotated once, outside the stage branches; an int8 cache's keys dequantized first)
    keys = Keys(pk.k, pk.v, ctx.k_rope.rotate(kv_quant.read(pk.k)))
    out_blk, pk_out, q_blk = refresh_rows(ctx, xs, carry.h_blk, inputs, sel.rows, keys)
    stats = LayerStats(sel.scores, sel.chosen, sel.own & ctx.cluster_rows[:, None],
                       jnp.sum(sel.rows, axis=1).astype(jnp.int32), pk.n_read, n_fetch)
    return (Carry(out_blk, pk_out, sel.rows, q_blk, keys.k_rot),
            (LayerOutputs(pk.slot, pk.store_slot, () if store_slot is not None else pk.store, pk.centroids,
                          s_prev), stats))


def step_ctx(state: DecodeState, geo: Geometry, cfg: ModelConfig, pc: PolestarConfig, block: int,
             cluster_rows: jax.Array, write_rows: Optional[jax.Array] = None) -> StepCtx:
    blk_pos = rows_at(state.pos, geo.cs + jnp.arange(block))
    write_rows = jnp.ones(state.x.shape[:1], bool) if write_rows is None else write_rows
    return StepCtx(cfg, family_of(cfg), pc, block, geo, state.key_valid, Rope.at(state.pos, cfg), blk_pos,
                   Rope.at(blk_pos, cfg),
                   jnp.broadcast_to(geo.ref_pos, geo.ref_valid.shape).astype(jnp.int32),
                   rows_at(state.pos, geo.ref_pos), cluster_rows, write_rows, widths(pc, pc.window_rows(block)),
                   store_widths(pc, pc.window_rows(block), uses_host(pc)))


class StepLayers(NamedTuple):
    """What the layer pass of a decode step hands to its tail (:func:`step_layers`, then :func:`step_tail`):
    the last layer's block rows, queries and rotated keys, and the step's outputs without the token drift and
    the block attention rows (``None`` until the tail)."""

    h_blk: jax.Array  # [b, B, D]
    q_blk: jax.Array  # [b, H, B, hd]
    k_rot: jax.Array  # [b, KV, L, hd]
    out: StepForwardOut


#: ``score(logits [b, T, V], parts) -> Prediction`` [b, T]: the commit rule's scoring of a step's logits, whose
#: rows are ``parts`` (``("block", B)``, then ``("suffix", Ws)`` on a refresh step), conf on every row
Score = Callable[[jax.Array, tuple], Prediction]


def _scored(fam: Family, logits: jax.Array, block: int, suf: int, score: Score) -> tuple[Prediction, Prediction]:
    """The block rows' and the suffix rows' predictions from one scoring of ``logits`` [b, B (+ Ws), V] (the
    block rows' ids suppressed); without suffix rows the suffix's are x0 0, conf -inf."""
    parts = (("block", block),) + ((("suffix", suf),) if logits.shape[1] > block else ())
    p = score(fam.suppress(logits, rows=block), parts)
    if logits.shape[1] > block:
        return Prediction(p.x0[:, :block], p.conf[:, :block]), Prediction(p.x0[:, block:], p.conf[:, block:])
    b = logits.shape[0]
    return p, Prediction(jnp.zeros((b, suf), jnp.int32), jnp.full((b, suf), -jnp.inf, jnp.float32))


def step_layers(params, state: DecodeState, geo: Geometry, cfg: ModelConfig, pc: PolestarConfig, block: int,
                refresh: bool, cluster_rows: jax.Array, forced: Optional[tuple[jax.Array, jax.Array]],
                unroll: int | bool = 1, write_rows: Optional[jax.Array] = None,
                score: Optional[Score] = None) -> StepLayers:
    """The layer pass of a decode step: the block against the cache; with ``refresh`` the sparse refresh of
    the rows of the top-drift clusters runs in the same pass (for rows with ``cluster_rows`` [b]).
    ``write_rows`` [b] (default: every row): the rows whose block K/V the step writes into the cache.
    ``score`` (:data:`Score`): the outputs hold the logits' predictions (``pred``, ``pred_suf``) instead of
    the logits, scored once for the block and the suffix rows together (a block program's step: a branch
    between the refresh and the plain pass then returns no logits, split or zero-filled, at all)."""
    pol, b, n_layers = state.policy_state, state.x.shape[0], cfg.n_layers
    pre, suf = pc.prefix_rows(block), pc.suffix_rows(block)
    ctx = step_ctx(state, geo, cfg, pc, block, cluster_rows, write_rows)
    fam = ctx.fam
    h_blk0 = fam.embed(params, rows_at(state.x, geo.cs + jnp.arange(block)))
    dt = h_blk0.dtype
    carry0 = Carry(h_blk0, jnp.zeros((b, pre + suf, cfg.d_model), dt), jnp.zeros((b, pre + suf), bool),
                   jnp.zeros((b, cfg.n_heads, block, cfg.head_dim), dt),
                   jnp.zeros((b,) + state.k_cache.shape[2:], state.k_cache.dtype))
    if forced is None:
        forced = (jnp.zeros((n_layers, b, pc.n_clusters), bool), jnp.zeros((n_layers, b), bool))
    # the store enters the layer scan only when it is read (a step without refresh leaves it where it is): in
    # the scan's carry beside the K/V cache when its rows are written in place, else as the scan's inputs
    direct = refresh and store_in_place(pc, pol.hs.dtype)
    store = (pol.hs, pol.hs_scale) if refresh and not direct else ()
    # (the previous proxy attention rides in the carry too, each layer's replaced on a refresh: as the scan's
    # inputs and outputs it was held twice, 512 MiB each at LLaDA-8B's batch 32, and copied by a plain step)
    xs = LayerIn(params["blocks"], store, pol.labels, pol.centroids, pol.counts,
                 pol.n_clusters, None, forced[0], forced[1], jnp.arange(n_layers))
    def body(c, x, slot):  # the K/V cache (and the store) ride in the scan's carry (model.layer_scan)
        # the block rows' K/V (and a refresh's packet rows') written into the slot
        kv, st = CacheSlot(slot.buffers[0], slot.i), CacheSlot(slot.buffers[1], slot.i) if direct else None
        sp = CacheSlot(slot.buffers[2], slot.i)
        x = x._replace(s_prev=sp.layer())
        c, (outs, stats) = refresh_layer(ctx, c, x, dt, kv, st) if refresh else plain_layer(ctx, c, x, kv)
        if refresh:
            sp = sp.put_layer(outs.s_prev)
        return c, (outs._replace(k=None, v=None, s_prev=None), stats), \
            CacheSlot((outs.k.buffers, outs.v.buffers if direct else (), sp.buffers), slot.i)

    bufs = ((state.k_cache, state.v_cache), (pol.hs, pol.hs_scale) if direct else (), pol.s_prev)
    carry, (outs, stats), ((k_new, v_new), new_store, s_prev) = layer_scan(body, carry0, xs, bufs, unroll=unroll)
    hs, hs_scale = new_store if direct else outs.store if refresh else (pol.hs, pol.hs_scale)
    pred = pred_suf = None
    if refresh and suf:  # the refreshed suffix rows predict their own positions: one LM-head GEMM with the block's
        both = fam.lm_head(params, jnp.concatenate([fam.head_rows(carry.h_blk, 0, block), carry.pk_h[:, pre:]], 1), cfg)
        sel_suf = carry.pk_valid[:, pre:]
        if score is None:
            logits, logits_suf = fam.suppress(both[:, :block]), both[:, block:]
        else:
            logits = logits_suf = None
            pred, pred_suf = _scored(fam, both, block, suf, score)
    else:
        sel_suf = jnp.zeros((b, suf), bool)
        if score is None:
            logits = fam.head_at(params, carry.h_blk, cfg, 0, block)
            logits_suf = jnp.zeros(logits.shape[:1] + (suf,) + logits.shape[2:], jnp.float32)
        else:
            logits = logits_suf = None
            pred, pred_suf = _scored(fam, fam.lm_head(params, fam.head_rows(carry.h_blk, 0, block), cfg), block, suf,
                                     score)
    moved = jnp.where(cluster_rows[None, :], (stats.n_read + stats.n_fetch)[:, None], 0).astype(jnp.int32)
    out = StepForwardOut(k_new, v_new, hs, hs_scale, outs.centroids, s_prev, None, None, logits, logits_suf,
                         sel_suf, stats.scores, stats.selected, stats.own, stats.n_rows, moved, pred, pred_suf)
    return StepLayers(carry.h_blk, carry.q_blk, carry.k_rot, out)


def step_tail(params, state: DecodeState, cfg: ModelConfig, pc: PolestarConfig, block: int,
              lay: StepLayers) -> StepForwardOut:
    """The token drift of the last layer's block attention, after the layer pass (one copy in the program,
    whichever layer pass ran; the layer pass computed the block logits, with the suffix rows' in one LM-head
    GEMM when it refreshed)."""
    drift, p_blk = kl_drift(lay.q_blk, lay.k_rot, state.key_valid, state.policy_state.p_prev, mode="token",
                            backend=pc.kernels)
    return lay.out._replace(p_blk=p_blk, drift=drift)


def step_forward(params, state: DecodeState, geo: Geometry, cfg: ModelConfig, pc: PolestarConfig, block: int,
                 refresh: bool, cluster_rows: jax.Array, forced: Optional[tuple[jax.Array, jax.Array]],
                 unroll: int | bool = 1) -> StepForwardOut:
    """One decode-step forward of the block against the cache; with ``refresh`` the sparse refresh of
    the rows of the top-drift clusters runs in the same layer pass (for rows with ``cluster_rows`` [b]):
    :func:`step_layers`, then :func:`step_tail`."""
    lay = step_layers(params, state, geo, cfg, pc, block, refresh, cluster_rows, forced, unroll)
    return step_tail(params, state, cfg, pc, block, lay)


__all__ = ["StepForwardOut", "StepLayers", "step_forward", "step_layers", "step_tail", "tie_groups", "top_clusters",
           "patch_packet", "select_clusters", "fetch_selected", "refresh_rows", "plain_layer", "refresh_layer",
           "Carry", "LayerIn", "LayerStats"]
