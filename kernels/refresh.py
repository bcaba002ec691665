"""Data movement of Polestar's sparse refresh: row gather (with int8 dequantisation), row scatter, and the
centroid shift.

In a refresh step every layer (see :func:`polestar_jax.decode.polestar.step.step_forward`)

1. gathers the packet rows' stored hidden states (``hs`` [b, R, D], possibly int8 + per-row scales when
   offloaded) -> :func:`gather_rows`;
2. recomputes the layer for them (the matmuls: left to XLA) and scatters the outputs into the next layer's
   hidden states and this layer's K/V cache rows -> :func:`scatter_rows` / :func:`scatter_kv_rows`;
3. moves every centroid by the change of its refreshed members -> :func:`centroid_shift` (= 
   :func:`centroid_shift_reference`).

Each function has a ``*_reference`` in plain jnp with the same signature, a ``backend=`` switch (see
:mod:`polestar_jax.kernels.backend`) and an ``interpret`` flag. Kernel flavours:

* ``"triton"`` (GPU): one program per (batch row, packet row, feature chunk); the row index is loaded in
  the kernel and the load / store is masked (row validity, feature padding to a power of two).
* ``"mosaic"`` (TPU): one program per batch row; the row indices (and the scatter's validity) are
  scalar-prefetched into SMEM. For 32-bit rows the source / destination stays in HBM in its natural
  layout: the gather starts one row DMA per packet entry into a VMEM buffer, awaits them all, then
  dequantises / masks the block; the scatter DMAs each valid row straight into the (aliased)
  destination. Packed rows (bf16, int8) are fractions of a TPU tile, which Mosaic cannot DMA alone: the
  gather reads the source block (all R rows, feature-blocked) into VMEM, widens it to float32 and copies
  the selected rows there (what the engine gathers is the whole store of R rows anyway); the packed
  scatter has no kernel on TPUs (:func:`mosaic_rows_exclude`: XLA's scatter instead).
* ``centroid_shift`` (both): one program per (batch row, feature chunk): one-hot [K, R] from the labels,
  two [K, R] x [R, d] products, the update. The triton flavour pads K, R and D to its blocks in the
  wrapper (labels -1, the rest 0) and slices the result.

Indices: ``idx`` [b, C] int32 row numbers, ``valid`` [b, C] bool. Gather clips indices into range
(invalid entries give zero rows); scatter drops invalid or out-of-range entries, and valid indices of one
batch row must be distinct (as for ``.at[].set``: the winner of a duplicate is unspecified).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.experimental.pallas import tpu as pltpu

from polestar_jax import compat
from polestar_jax.kernels.backend import dispatch, resolve_backend

COUNT_EPS = 1e-6  # as polestar_jax.decode.polestar.cluster.COUNT_EPS
_MAX_BLOCK_D = 1024  # triton feature chunk (power of two)


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, pl.next_power_of_2(max(int(n), 1)))


def _interp(flavor: str, interpret: bool):
    """The ``interpret`` argument of pallas_call: the TPU interpreter for mosaic kernels (it models SMEM,
    DMAs and semaphores), the generic one for triton kernels."""
    if not interpret:
        return False
    return pltpu.InterpretParams() if flavor == "mosaic" else True


# ------------------------------------------------------------------------------------- quantisation
def quantize_rows(h: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric per-row int8 quantisation of ``h`` [..., D]: ``scale = absmax / 127`` (float32, [...]),
    ``q = round(h / scale)`` clipped to [-127, 127] (all-zero rows: scale 0, q 0)."""
    hf = h.astype(jnp.float32)
    scale = jnp.max(jnp.abs(hf), axis=-1) / 127.0
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(hf / safe[..., None]), -127, 127).astype(jnp.int8)
    return q, scale


def dequantize_rows(q: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Inverse of :func:`quantize_rows`: ``q * scale`` (in float32), cast to ``dtype``."""
    return (q.astype(jnp.float32) * scales.astype(jnp.float32)[..., None]).astype(dtype)


def _compute_dtype(hs, scales, dtype):
    if dtype is not None:
        return jnp.dtype(dtype)
    if jnp.issubdtype(hs.dtype, jnp.integer):
        return jnp.dtype(scales.dtype) if scales is not None else jnp.dtype(jnp.float32)
    return jnp.dtype(hs.dtype)


def mosaic_rows_exclude(dtype) -> frozenset:
    """``{"tpu"}`` for a packed ``dst`` dtype (under 32 bits: bf16, f16, int8), else nothing: the
    platforms whose row scatter has no sensible form for it. A TPU lays an array's last two axes out in
    (8, 128) tiles of 32-bit words, so a bf16 / int8 row is half / a quarter of a sublane, and Mosaic DMAs
    only tile-aligned row windows of packed arrays ("Offsets along tiled dimensions must be aligned to
    tiles"). Writing single rows then means a read-modify-write of their tiles: one aligned-window DMA
    round trip per row (serialised, since rows may share a tile), or the whole destination through VMEM,
    L / C times the bytes for the K/V cache (L keys, C rows written). XLA's own scatter (the reference)
    writes those rows in place, so packed scatters use it on TPUs."""
    return frozenset({"tpu"}) if jnp.dtype(dtype).itemsize < 4 else frozenset()


# ------------------------------------------------------------------------------------------- gather
def gather_rows_reference(hs: jax.Array, idx: jax.Array, valid: jax.Array, scales: Optional[jax.Array] = None,
                          *, dtype=None, interpret: bool = False, backend: str = "reference",
                          flavor: str = "triton") -> jax.Array:
    """rows[b, c] = dequant(hs[b, clip(idx[b, c])]) where valid[b, c], else 0; [b, C, D] in the compute
    dtype (``dtype``, default: hs.dtype, or the scales' dtype for int8 ``hs``)."""
    del interpret, backend, flavor
    _check_gather(hs, idx, valid, scales)
    out_dt = _compute_dtype(hs, scales, dtype)
    ii = jnp.clip(idx, 0, hs.shape[1] - 1).astype(jnp.int32)
    rows = jnp.take_along_axis(hs, ii[..., None], axis=1)
    if scales is not None:
        rows = rows.astype(jnp.float32) * jnp.take_along_axis(scales, ii, axis=1).astype(jnp.float32)[..., None]
    return jnp.where(valid[..., None], rows.astype(out_dt), jnp.zeros((), out_dt))


def _check_gather(hs, idx, valid, scales):
    if hs.ndim != 3 or idx.ndim != 2 or idx.shape[0] != hs.shape[0] or valid.shape != idx.shape:
        raise ValueError(f"hs [b, R, D], idx / valid [b, C] expected, got {hs.shape}, {idx.shape}, {valid.shape}")
    if scales is not None and scales.shape != hs.shape[:2]:
        raise ValueError(f"scales must be {hs.shape[:2]}, got {scales.shape}")
    if jnp.issubdtype(hs.dtype, jnp.integer) and scales is None:
        raise ValueError("integer hs needs per-row scales")


def _gather_kernel_triton(idx_ref, valid_ref, hs_ref, *rest, n_rows, width, block_d, dequant):
    """idx / valid [C], hs [R, D], (scales [R, 1]), out [C, D]; program (b, c, d-chunk)."""
    if dequant:
        scale_ref, out_ref = rest
    else:
        (out_ref,) = rest
    c = pl.program_id(1)
    d0 = pl.program_id(2) * block_d
    r = jnp.clip(idx_ref[c], 0, n_rows - 1)
    ok = valid_ref[c] != 0
    d_ok = (d0 + jnp.arange(block_d)) < width
    row = plgpu.load(hs_ref.at[r, pl.ds(d0, block_d)], mask=d_ok, other=0)
    if dequant:
        row = row.astype(jnp.float32) * scale_ref[r, 0]
    row = jnp.where(ok, row.astype(out_ref.dtype), jnp.zeros((), out_ref.dtype))
    plgpu.store(out_ref.at[c, pl.ds(d0, block_d)], row, mask=d_ok)


def _gather_kernel_mosaic(idx_ref, hs_hbm, valid_ref, *rest, n_cols, dequant):
    """One batch row. Scalar prefetch idx [b * C] (SMEM); hs [b, R, D] stays in HBM; valid [C, 1] f32,
    (scales of the selected rows [C, 1] f32), out [C, D] (VMEM blocks); scratch buf [C, D] + a DMA
    semaphore. All C row DMAs are started, then awaited (same size: one semaphore), then the block is
    dequantised / masked with whole-block vector ops."""
    if dequant:
        scale_ref, out_ref, buf, sem = rest
    else:
        out_ref, buf, sem = rest
    i = pl.program_id(0)

    def copy(j):
        return pltpu.make_async_copy(hs_hbm.at[i, pl.ds(idx_ref[i * n_cols + j], 1)], buf.at[pl.ds(j, 1)], sem)

    def start(j, carry):
        copy(j).start()
        return carry

    def wait(j, carry):
        copy(j).wait()
        return carry

    lax.fori_loop(0, n_cols, start, 0)
    lax.fori_loop(0, n_cols, wait, 0)
    rows = buf[...]
    if dequant:
        rows = rows.astype(jnp.float32) * scale_ref[...]
    out_ref[...] = jnp.where(valid_ref[...] > 0, rows.astype(out_ref.dtype), jnp.zeros((), out_ref.dtype))


def _gather_pallas(hs, idx, valid, scales, *, dtype, flavor, interpret):
    b, r, d = hs.shape
    c = idx.shape[1]
    out_dt = _compute_dtype(hs, scales, dtype)
    dequant = scales is not None
    idx = jnp.clip(idx.astype(jnp.int32), 0, r - 1)
    vi = valid.astype(jnp.int32)
    if flavor == "triton":
        bd = min(_pow2(d, 16), _MAX_BLOCK_D)
        in_specs = [pl.BlockSpec((None, c), lambda i, j, k: (i, 0)),
                    pl.BlockSpec((None, c), lambda i, j, k: (i, 0)),
                    pl.BlockSpec((None, r, d), lambda i, j, k: (i, 0, 0))]
        args = [idx, vi, hs]
        if dequant:
            in_specs.append(pl.BlockSpec((None, r, 1), lambda i, j, k: (i, 0, 0)))
            args.append(scales.astype(jnp.float32)[..., None])
        kernel = functools.partial(_gather_kernel_triton, n_rows=r, width=d, block_d=bd, dequant=dequant)
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct((b, c, d), out_dt), grid=(b, c, pl.cdiv(d, bd)),
            in_specs=in_specs, out_specs=pl.BlockSpec((None, c, d), lambda i, j, k: (i, 0, 0)),
            compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
            interpret=_interp(flavor, interpret), name="gather_rows")(*args)
    if flavor != "mosaic":
        raise ValueError(f"unknown flavor {flavor!r}")
    vf = vi.astype(jnp.float32)[..., None]  # [b, C, 1]
    sel = jnp.take_along_axis(scales.astype(jnp.float32), idx, axis=1)[..., None] if dequant else None  # [b, C, 1]
    if jnp.dtype(hs.dtype).itemsize < 4:
        return _gather_mosaic_block(hs, idx, vf, sel, out_dt, interpret)
    # hs stays [b, R, D] in HBM (no relayout); the selected scales / validity are tiny [b, C, 1] blocks
    in_specs = [pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec((None, c, 1), lambda i, idx_ref: (i, 0, 0))]
    args = [hs, vf]
    if dequant:
        in_specs.append(pl.BlockSpec((None, c, 1), lambda i, idx_ref: (i, 0, 0)))
        args.append(sel)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(b,), in_specs=in_specs,
        out_specs=pl.BlockSpec((None, c, d), lambda i, idx_ref: (i, 0, 0)),
        scratch_shapes=[pltpu.VMEM((c, d), hs.dtype), pltpu.SemaphoreType.DMA(())])
    return pl.pallas_call(
        functools.partial(_gather_kernel_mosaic, n_cols=c, dequant=dequant),
        out_shape=jax.ShapeDtypeStruct((b, c, d), out_dt), grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=_interp(flavor, interpret), name="gather_rows",
    )(idx.reshape(-1), *args)


def _gather_kernel_mosaic_block(idx_ref, hs_ref, valid_ref, *rest, n_cols, dequant):
    """One (batch row, feature block) of a packed ``hs`` (bf16, int8). Scalar prefetch idx [b * C] (SMEM);
    hs [R, bd], valid [C, 1], (selected scales [C, 1]), out [C, bd] (VMEM blocks); scratch src [R, bd] and
    dst [C, bd] float32. A packed row is a fraction of a (8, 128) tile, so rows are not copied in the
    packed layout: the block is widened to float32 (exact for bf16 and int8), each selected row copied
    at its dynamic offset, then the block dequantised / masked / narrowed."""
    if dequant:
        scale_ref, out_ref, src, dst = rest
    else:
        out_ref, src, dst = rest
    i = pl.program_id(0)
    src[...] = hs_ref[...].astype(jnp.float32)

    def copy(j, carry):
        dst[pl.ds(j, 1), :] = src[pl.ds(idx_ref[i * n_cols + j], 1), :]
        return carry

    lax.fori_loop(0, n_cols, copy, 0)
    rows = dst[...]
    if dequant:
        rows = rows * scale_ref[...]
    out_ref[...] = jnp.where(valid_ref[...] > 0, rows.astype(out_ref.dtype), jnp.zeros((), out_ref.dtype))


_BLOCK_VMEM_BUDGET = 12 * 2**20  # of the 16 MiB default scoped VMEM


def _gather_block_d(r: int, c: int, d: int, in_size: int, out_size: int) -> int:
    """Feature block of the packed gather: all of D when D is not a multiple of 128 (a block's last axis
    must be 128-aligned or whole), else the widest multiple of 128 dividing D whose buffers (double-buffered
    in / out blocks, the two float32 scratches) fit :data:`_BLOCK_VMEM_BUDGET`."""
    if d % 128:
        return d
    per_lane = 2 * r * in_size + 2 * c * out_size + 4 * (r + c)
    return next((bd for bd in range(d, 127, -128) if d % bd == 0 and bd * per_lane <= _BLOCK_VMEM_BUDGET), 128)


def _gather_mosaic_block(hs, idx, vf, sel, out_dt, interpret):
    """The packed-``hs`` Mosaic gather (:func:`_gather_kernel_mosaic_block`): grid (b, D / bd); ``idx``
    [b, C] clipped, ``vf`` validity [b, C, 1] float32, ``sel`` selected scales [b, C, 1] or None."""
    b, r, d = hs.shape
    c = idx.shape[1]
    bd = _gather_block_d(r, c, d, jnp.dtype(hs.dtype).itemsize, jnp.dtype(out_dt).itemsize)
    in_specs = [pl.BlockSpec((None, r, bd), lambda i, j, idx_ref: (i, 0, j)),
                pl.BlockSpec((None, c, 1), lambda i, j, idx_ref: (i, 0, 0))]
    args = [hs, vf]
    if sel is not None:
        in_specs.append(pl.BlockSpec((None, c, 1), lambda i, j, idx_ref: (i, 0, 0)))
        args.append(sel)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(b, d // bd), in_specs=in_specs,
        out_specs=pl.BlockSpec((None, c, bd), lambda i, j, idx_ref: (i, 0, j)),
        scratch_shapes=[pltpu.VMEM((r, bd), jnp.float32), pltpu.VMEM((c, bd), jnp.float32)])
    return pl.pallas_call(
        functools.partial(_gather_kernel_mosaic_block, n_cols=c, dequant=sel is not None),
        out_shape=jax.ShapeDtypeStruct((b, c, d), out_dt), grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=_interp("mosaic", interpret), name="gather_rows",
    )(idx.reshape(-1), *args)


def gather_rows(hs: jax.Array, idx: jax.Array, valid: jax.Array, scales: Optional[jax.Array] = None, *,
                dtype=None, interpret: bool = False, backend: str = "auto", flavor: str = "triton") -> jax.Array:
    """Gathers rows ``idx`` [b, C] of ``hs`` [b, R, D] (float, or int8 with per-row ``scales`` [b, R]:
    dequantised as ``int8 * scale``): rows [b, C, D] in the compute dtype, zero where ``valid`` is False."""
    _check_gather(hs, idx, valid, scales)
    if interpret:
        backend = "interpret"
    ref = functools.partial(gather_rows_reference, dtype=dtype)
    pallas = lambda fl, it: functools.partial(_gather_pallas, dtype=dtype, flavor=fl, interpret=it)
    return dispatch("gather_rows", backend, (hs, idx, valid, scales), reference=ref, pallas=pallas,
                    interpret_flavor=flavor)


# ------------------------------------------------------------------------------------------ scatter
def scatter_rows_reference(dst: jax.Array, rows: jax.Array, idx: jax.Array, valid: jax.Array, *,
                           interpret: bool = False, backend: str = "reference", flavor: str = "triton") -> jax.Array:
    """``dst`` [b, L, ...] with ``rows`` [b, C, ...] written at ``idx`` [b, C] where ``valid`` [b, C]
    (invalid or out-of-range entries dropped)."""
    del interpret, backend, flavor
    _check_scatter(dst, rows, idx, valid)
    length = dst.shape[1]
    widx = jnp.where(valid & (idx >= 0), idx, length).astype(jnp.int32)
    bi = jnp.arange(dst.shape[0])[:, None]
    return dst.at[bi, widx].set(rows.astype(dst.dtype), mode="drop")


def _check_scatter(dst, rows, idx, valid):
    if (dst.ndim < 2 or rows.ndim != dst.ndim or rows.shape[0] != dst.shape[0] or rows.shape[2:] != dst.shape[2:]
            or idx.shape != rows.shape[:2] or valid.shape != idx.shape):
        raise ValueError(f"dst [b, L, ...], rows [b, C, ...], idx / valid [b, C] expected, got {dst.shape}, "
                         f"{rows.shape}, {idx.shape}, {valid.shape}")


def _scatter_kernel_triton(idx_ref, valid_ref, rows_ref, dst_ref, out_ref, *, length, width, block_d):
    """idx / valid [C], rows [C, F], dst / out [L, F] (aliased); program (b, c, f-chunk)."""
    del dst_ref  # aliased with out_ref: rows not written keep their values
    c = pl.program_id(1)
    d0 = pl.program_id(2) * block_d
    r = idx_ref[c]
    ok = (valid_ref[c] != 0) & (r >= 0) & (r < length)
    d_ok = (d0 + jnp.arange(block_d)) < width
    row = plgpu.load(rows_ref.at[c, pl.ds(d0, block_d)], mask=d_ok, other=0)
    plgpu.store(out_ref.at[jnp.clip(r, 0, length - 1), pl.ds(d0, block_d)], row.astype(out_ref.dtype),
                mask=d_ok & ok)


def _scatter_kernel_mosaic(idx_ref, valid_ref, rows_ref, dst_hbm, out_hbm, sem, *, length, n_cols):
    """One batch row. Scalar prefetch idx / valid [b * C]; rows block [1, C, F] (VMEM); dst / out [b, L, F]
    in HBM (aliased). Every valid row is DMA'd to its destination (all started, then all awaited); nothing
    else is touched."""
    del dst_hbm
    i = pl.program_id(0)

    def entry(j):
        r = idx_ref[i * n_cols + j]
        ok = (valid_ref[i * n_cols + j] != 0) & (r >= 0) & (r < length)
        dst = out_hbm.at[pl.ds(i, 1), pl.ds(jnp.minimum(jnp.maximum(r, 0), length - 1), 1)]
        return ok, pltpu.make_async_copy(rows_ref.at[:, pl.ds(j, 1)], dst, sem)

    def start(j, carry):
        ok, cp = entry(j)
        pl.when(ok)(cp.start)
        return carry

    def wait(j, carry):
        ok, cp = entry(j)
        pl.when(ok)(cp.wait)
        return carry

    lax.fori_loop(0, n_cols, start, 0)
    lax.fori_loop(0, n_cols, wait, 0)


def _scatter_pallas(dst, rows, idx, valid, *, flavor, interpret):
    shape = dst.shape
    b, length = shape[:2]
    c = rows.shape[1]
    f = 1
    for s in shape[2:]:
        f *= s
    d3 = dst.reshape(b, length, f)
    r3 = rows.astype(dst.dtype).reshape(b, c, f)
    idx = idx.astype(jnp.int32)
    vi = valid.astype(jnp.int32)
    if flavor == "triton":
        bd = min(_pow2(f, 16), _MAX_BLOCK_D)
        out = pl.pallas_call(
            functools.partial(_scatter_kernel_triton, length=length, width=f, block_d=bd),
            out_shape=jax.ShapeDtypeStruct((b, length, f), dst.dtype), grid=(b, c, pl.cdiv(f, bd)),
            in_specs=[pl.BlockSpec((None, c), lambda i, j, k: (i, 0)),
                      pl.BlockSpec((None, c), lambda i, j, k: (i, 0)),
                      pl.BlockSpec((None, c, f), lambda i, j, k: (i, 0, 0)),
                      pl.BlockSpec((None, length, f), lambda i, j, k: (i, 0, 0))],
            out_specs=pl.BlockSpec((None, length, f), lambda i, j, k: (i, 0, 0)),
            input_output_aliases={3: 0},
            compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
            interpret=_interp(flavor, interpret), name="scatter_rows",
        )(idx, vi, r3, d3)
        return out.reshape(shape)
    if flavor != "mosaic":
        raise ValueError(f"unknown flavor {flavor!r}")
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(b,),
        in_specs=[pl.BlockSpec((1, c, f), lambda i, idx_ref, valid_ref: (i, 0, 0)),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.SemaphoreType.DMA(())])
    out = pl.pallas_call(
        functools.partial(_scatter_kernel_mosaic, length=length, n_cols=c),
        out_shape=jax.ShapeDtypeStruct((b, length, f), dst.dtype), grid_spec=grid_spec,
        input_output_aliases={3: 0},  # operands: idx, valid (prefetch), rows, dst
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=_interp(flavor, interpret), name="scatter_rows",
    )(idx.reshape(-1), vi.reshape(-1), r3, d3)
    return out.reshape(shape)


def scatter_rows(dst: jax.Array, rows: jax.Array, idx: jax.Array, valid: jax.Array, *, interpret: bool = False,
                 backend: str = "auto", flavor: str = "triton") -> jax.Array:
    """``dst`` [b, L, ...] with ``rows`` [b, C, ...] written at ``idx`` [b, C] where ``valid`` (the other
    rows of ``dst`` are kept; in place when ``dst`` is donated). For the next layer's hidden states and,
    through :func:`scatter_kv_rows`, the K/V cache rows."""
    _check_scatter(dst, rows, idx, valid)
    if interpret:
        backend = "interpret"
    pallas = lambda fl, it: functools.partial(_scatter_pallas, flavor=fl, interpret=it)
    return dispatch("scatter_rows", backend, (dst, rows, idx, valid), reference=scatter_rows_reference,
                    pallas=pallas, interpret_flavor=flavor, exclude=mosaic_rows_exclude(dst.dtype))


def scatter_kv_rows(cache: jax.Array, rows: jax.Array, idx: jax.Array, valid: jax.Array, *,
                    interpret: bool = False, backend: str = "auto", flavor: str = "triton") -> jax.Array:
    """K/V cache layout: ``cache`` [b, KV, L, hd] with ``rows`` [b, KV, C, hd] written at positions ``idx``
    [b, C] where ``valid`` (invalid or out-of-range entries are dropped)."""
    b, kv, length, hd = cache.shape
    c = rows.shape[2]
    flat = lambda a: a.reshape((b * kv,) + a.shape[2:])
    rep = lambda a: jnp.broadcast_to(a[:, None], (b, kv, c)).reshape(b * kv, c)
    out = scatter_rows(flat(cache), flat(rows), rep(idx), rep(valid), interpret=interpret, backend=backend,
                       flavor=flavor)
    return out.reshape(cache.shape)


def scatter_is_reference(backend: str, dtype=None) -> bool:
    """Whether :func:`scatter_kv_rows` with ``backend`` runs its jnp reference in the program being traced
    (``auto`` on this process's platform where it has no scatter kernel, and not staged for several
    platforms): a caller may then write the rows itself, in place into a larger buffer (the stacked K/V
    cache: ``CacheSlot.scatter_rows``, the same rule), where the kernel needs the layer's cache copied out.
    A CPU process may be compiling ahead for a TPU or a GPU, whose kernels ``auto`` must then reach (the
    kernel follows the program's target), so there only ``reference`` writes in place."""
    platform = jax.default_backend()
    if compat.kernels_staged() or platform == "cpu":
        return backend == "reference"
    exclude = mosaic_rows_exclude(dtype) if dtype is not None else frozenset()
    if backend == "auto" and platform in exclude:
        return True
    return resolve_backend(backend, platform, kernel="scatter_rows") == "reference"


def scatter_kv_rows_reference(cache, rows, idx, valid, *, interpret=False, backend="reference", flavor="triton"):
    """Plain-jnp :func:`scatter_kv_rows`."""
    del interpret, backend, flavor
    length = cache.shape[2]
    widx = jnp.where(valid & (idx >= 0), idx, length).astype(jnp.int32)
    bi = jnp.arange(cache.shape[0])[:, None]
    return cache.at[bi, :, widx].set(rows.astype(cache.dtype).transpose(0, 2, 1, 3), mode="drop")


# ----------------------------------------------------------------------------------- centroid shift
def centroid_shift_reference(centroids: jax.Array, labels: jax.Array, counts: jax.Array, rows_mask: jax.Array,
                             h_old: jax.Array, h_new: jax.Array, *, interpret: bool = False,
                             backend: str = "reference", flavor: str = "triton") -> jax.Array:
    """``c_k += (sum_new - sum_old) / (count_k + 1e-6)`` over rows with ``rows_mask`` and label k, for
    count_k > 0 (the centroid update of a Polestar refresh).

    centroids [b, K, D]; labels [b, R] int; counts [b, K]; rows_mask [b, R] bool; h_old / h_new [b, R, D].
    """
    del interpret, backend, flavor
    k = centroids.shape[1]
    dt = centroids.dtype
    onehot = ((labels[..., None] == jnp.arange(k)) & rows_mask[..., None]).astype(dt)
    sum_new = jnp.einsum("brk,brd->bkd", onehot, h_new.astype(dt))
    sum_old = jnp.einsum("brk,brd->bkd", onehot, h_old.astype(dt))
    moved = centroids + (sum_new - sum_old) / (counts[..., None] + COUNT_EPS).astype(dt)
    return jnp.where((counts > 0)[..., None], moved, centroids)


def _shift_math(c, sn, so, cnt):
    """The update rounded to the centroids' dtype after every operation, as the reference computes it in
    that dtype; the arithmetic itself is float32 (exact emulation for bf16 / f16: f32 carries more than
    twice their precision, so rounding twice equals rounding once)."""
    dt = c.dtype
    rnd = lambda x: x.astype(dt).astype(jnp.float32)
    diff = rnd(rnd(sn) - rnd(so))
    moved = rnd(c.astype(jnp.float32) + rnd(diff / rnd(cnt + COUNT_EPS)))
    return jnp.where(cnt > 0, moved, c.astype(jnp.float32)).astype(dt)


def _shift_kernel_triton(lab_ref, cnt_ref, c_ref, ho_ref, hn_ref, out_ref, *, n_k, n_r, width, block_k, block_r,
                         block_d):
    """labels [1, R] (-1 = not refreshed), counts [K, 1], centroids / out [K, D], h_old / h_new [R, D];
    program (b, d-chunk)."""
    d0 = pl.program_id(1) * block_d
    k_ok = jnp.arange(block_k) < n_k
    r_ok = jnp.arange(block_r) < n_r
    d_ok = (d0 + jnp.arange(block_d)) < width
    lab = plgpu.load(lab_ref.at[pl.ds(0, 1), pl.ds(0, block_r)], mask=r_ok[None, :], other=-1)  # [1, Rp]
    onehot = (lab == jnp.arange(block_k)[:, None]).astype(c_ref.dtype)  # [Kp, Rp]
    hmask = r_ok[:, None] & d_ok[None, :]
    win = (pl.ds(0, block_r), pl.ds(d0, block_d))
    hn = plgpu.load(hn_ref.at[win], mask=hmask, other=0)
    ho = plgpu.load(ho_ref.at[win], mask=hmask, other=0)
    sn = plgpu.dot(onehot, hn, precision=lax.Precision.HIGHEST)
    so = plgpu.dot(onehot, ho, precision=lax.Precision.HIGHEST)
    cmask = k_ok[:, None] & d_ok[None, :]
    cwin = (pl.ds(0, block_k), pl.ds(d0, block_d))
    c = plgpu.load(c_ref.at[cwin], mask=cmask, other=0)
    cnt = plgpu.load(cnt_ref.at[pl.ds(0, block_k), pl.ds(0, 1)], mask=k_ok[:, None], other=0.0)
    plgpu.store(out_ref.at[cwin], _shift_math(c, sn, so, cnt), mask=cmask)


def _shift_kernel_mosaic(lab_ref, cnt_ref, c_ref, ho_ref, hn_ref, out_ref):
    """labels [1, R], counts [K, 1], centroids / out [K, bd], h_old / h_new [R, bd]."""
    k, r = c_ref.shape[0], ho_ref.shape[0]
    cl = lax.broadcasted_iota(jnp.int32, (k, r), 0)
    onehot = (lab_ref[...] == cl).astype(c_ref.dtype)  # [K, R]
    # (Mosaic takes a precision only for float32 operands; a one-hot times bf16 rows is exact in float32)
    prec = lax.Precision.HIGHEST if c_ref.dtype == jnp.float32 else lax.Precision.DEFAULT  # (None: the config default)
    sn = jnp.dot(onehot, hn_ref[...], preferred_element_type=jnp.float32, precision=prec)
    so = jnp.dot(onehot, ho_ref[...], preferred_element_type=jnp.float32, precision=prec)
    out_ref[...] = _shift_math(c_ref[...], sn, so, cnt_ref[...])


def _pad_to(x: jax.Array, shape: tuple[int, ...], value) -> jax.Array:
    """``x`` padded at the end of each axis to ``shape`` with ``value`` (``x`` itself when it has it)."""
    if tuple(x.shape) == tuple(shape):
        return x
    return jnp.pad(x, [(0, n - m) for m, n in zip(x.shape, shape)], constant_values=value)


def _mosaic_block_d(d: int) -> int:
    if d <= 2048:
        return d
    return next((c for c in (2048, 1024, 512, 256, 128) if d % c == 0), d)


#: Shared memory the Triton shift kernel's dot operands may take (the one-hot [Kp, Rp] and two row tiles
#: [Rp, bd], in the centroids' dtype): well under what one block may use on an A100 (163 KiB) or an H100 /
#: H200 (227 KiB), leaving room for Triton's own scratch.
_SHIFT_SMEM_BUDGET = 144 * 1024


def _shift_block_d(d: int, bk: int, br: int, itemsize: int) -> int:
    """The Triton shift kernel's feature block: up to 256 features, halved while its dot operands would
    exceed :data:`_SHIFT_SMEM_BUDGET` (float32 rows with R > 64 at 256 features asked for 264 KiB on an H200
    and failed to compile). Each output element sums over the rows only, so the block never changes a
    value."""
    bd = min(_pow2(d, 16), 256)
    while bd > 16 and (2 * br * bd + bk * br) * itemsize > _SHIFT_SMEM_BUDGET:
        bd //= 2
    return bd


def _shift_pallas(centroids, labels, counts, rows_mask, h_old, h_new, *, flavor, interpret):
    b, k, d = centroids.shape
    r = labels.shape[1]
    dt = centroids.dtype
    lab = jnp.where(rows_mask, labels, -1).astype(jnp.int32)[:, None, :]  # [b, 1, R]
    cnt = counts.astype(jnp.float32)[..., None]  # [b, K, 1]
    ho, hn = h_old.astype(dt), h_new.astype(dt)
    if flavor == "triton":
        bk, br = _pow2(k, 16), _pow2(r, 16)
        bd = _shift_block_d(d, bk, br, jnp.dtype(dt).itemsize)
        dp = pl.cdiv(d, bd) * bd
        # The kernel reads the label / count / centroid / row axes as static slices [0, block): those must
        # be in bounds (jax >= 0.12 checks static slices at trace time, and an export staged for every
        # platform traces this branch on CPU too), so the operands are padded to the blocks here (labels -1, the
        # rest 0: padded rows belong to no cluster, padded clusters have count 0 and are sliced off).
        lab = _pad_to(lab, (b, 1, br), -1)
        cnt = _pad_to(cnt, (b, bk, 1), 0)
        centroids = _pad_to(centroids, (b, bk, dp), 0)
        ho, hn = _pad_to(ho, (b, br, dp), 0), _pad_to(hn, (b, br, dp), 0)
        kernel = functools.partial(_shift_kernel_triton, n_k=k, n_r=r, width=d, block_k=bk, block_r=br,
                                   block_d=bd)
        grid = (b, dp // bd)
        specs = [pl.BlockSpec((None, 1, br), lambda i, j: (i, 0, 0)),
                 pl.BlockSpec((None, bk, 1), lambda i, j: (i, 0, 0)),
                 pl.BlockSpec((None, bk, dp), lambda i, j: (i, 0, 0)),
                 pl.BlockSpec((None, br, dp), lambda i, j: (i, 0, 0)),
                 pl.BlockSpec((None, br, dp), lambda i, j: (i, 0, 0))]
        out_spec = pl.BlockSpec((None, bk, dp), lambda i, j: (i, 0, 0))
        params = plgpu.CompilerParams(num_warps=4, num_stages=1)
        out_kd = (bk, dp)
    elif flavor == "mosaic":
        bd = _mosaic_block_d(d)
        kernel = _shift_kernel_mosaic
        grid = (b, d // bd)
        specs = [pl.BlockSpec((None, 1, r), lambda i, j: (i, 0, 0)),
                 pl.BlockSpec((None, k, 1), lambda i, j: (i, 0, 0)),
                 pl.BlockSpec((None, k, bd), lambda i, j: (i, 0, j)),
                 pl.BlockSpec((None, r, bd), lambda i, j: (i, 0, j)),
                 pl.BlockSpec((None, r, bd), lambda i, j: (i, 0, j))]
        out_spec = pl.BlockSpec((None, k, bd), lambda i, j: (i, 0, j))
        params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))
        out_kd = (k, d)
    else:
        raise ValueError(f"unknown flavor {flavor!r}")
    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((b, *out_kd), dt), grid=grid, in_specs=specs, out_specs=out_spec,
        compiler_params=params, interpret=_interp(flavor, interpret), name="centroid_shift",
    )(lab, cnt, centroids, ho, hn)
    return out if out_kd == (k, d) else out[:, :k, :d]


def centroid_shift(centroids: jax.Array, labels: jax.Array, counts: jax.Array, rows_mask: jax.Array,
                   h_old: jax.Array, h_new: jax.Array, *, interpret: bool = False, backend: str = "auto",
                   flavor: str = "triton") -> jax.Array:
    """Fused :func:`centroid_shift_reference`: the one-hot member sums of
    the old and new rows (two [K, R] x [R, D] products) and the update, per (batch row, feature chunk)."""
    if interpret:
        backend = "interpret"
    pallas = lambda fl, it: functools.partial(_shift_pallas, flavor=fl, interpret=it)
    return dispatch("centroid_shift", backend, (centroids, labels, counts, rows_mask, h_old, h_new),
                    reference=centroid_shift_reference, pallas=pallas, interpret_flavor=flavor)
