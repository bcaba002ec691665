"""Fused attention-probability drift: scores, softmax and KL to the previous probabilities in one kernel.

Polestar measures representation drift twice (see :mod:`polestar_jax.decode.polestar.drift`):

* token drift: the last layer's attention rows of the block tokens (``q`` = rotated queries of the block,
  ``k`` = rotated keys) against the rows of the previous forward; ``mode="token"`` clamps both
  probabilities at 1e-12 before the logs;
* cluster drift: the centroids as proxy queries (``q`` = projected centroids, no RoPE; ``k`` = un-rotated
  cached keys) against the proxy attention of the last refresh; ``mode="cluster"`` adds 1e-12 inside the
  logs.

For every batch row ``b`` and query row ``t``::

    p_new[b, h, t, :] = softmax_j(q[b, h, t] . k[b, h // G, j] / sqrt(hd))   (invalid keys: score -1e30)
    kl[b, h, t]       = max(0, sum_j p_new * (log(.) - log(.)))
    drift[b, t]       = mean_h kl[b, h, t]

Kernel: one program per (batch row, head, block of query rows). The clamp / epsilon is applied to the
*normalised* probability, so the normaliser must be known before any KL term: the program sweeps the keys
twice in chunks of ``block_l`` — a statistics sweep (online max and sum of the scores) and an emit sweep
(recomputed scores, ``p_new`` written, ``p_prev`` read, KL accumulated). ``p_prev`` and ``p_new`` (the
``[T, L]`` float32 tensors that dominate the traffic) are read / written exactly once; the keys (``[L, hd]``,
shared by the ``G`` heads of a group) are read twice. Nothing of size ``[T, L]`` is materialised besides
the output. The head mean (``[b, H, T]`` -> ``[b, T]``) is a tiny jnp reduction in the wrapper.

Two flavours of the same body:

* ``"triton"`` (GPU): full-extent blocks, the program offsets its rows itself; every load/store is masked,
  so ``L``, ``T`` and ``hd`` need not be multiples of (or even powers of two like) the block sizes (a head
  dim that is not a power of two >= 16 is zero-padded to one in the wrapper: its slice starts at 0).
* ``"mosaic"`` (TPU): BlockSpecs tile the query rows; the keys / probabilities of one row block stay in
  VMEM (full ``L``) and the sweeps walk them in ``block_l`` chunks (a multiple of 128) with a static tail
  chunk, so no padding or masking is needed.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.experimental.pallas import tpu as pltpu

from polestar_jax.kernels.backend import dispatch

TOKEN_EPS = 1e-12
CLUSTER_EPS = 1e-12
MASK_VALUE = -1e30  # score of an invalid key (as polestar_jax.models.llada / drift: keeps all-masked rows NaN-free)
MODES = ("token", "cluster")


# ------------------------------------------------------------------------------------------- reference
def kl_terms(p: jax.Array, pp: jax.Array, mode: str) -> jax.Array:
    """Elementwise KL terms of the new probabilities ``p`` against the previous ``pp`` (float32, same shape):
    "token": both clamped at 1e-12 before the logs; "cluster": logs of ``p + 1e-12``. The one definition of
    the drift math (used by the kernel body, :func:`kl_drift_reference` and ``tests/drift_refs.py``)."""
    if mode == "token":
        a = jnp.maximum(p, TOKEN_EPS)
        c = jnp.maximum(pp, TOKEN_EPS)
        return a * (jnp.log(a) - jnp.log(c))
    return p * (jnp.log(p + CLUSTER_EPS) - jnp.log(pp + CLUSTER_EPS))


def kl_drift_reference(q: jax.Array, k: jax.Array, key_valid: Optional[jax.Array], p_prev: jax.Array, *,
                       mode: str, interpret: bool = False, block_l: Optional[int] = None,
                       block_t: Optional[int] = None, backend: str = "reference",
                       flavor: str = "triton") -> tuple[jax.Array, jax.Array]:
    """Plain-jnp :func:`kl_drift` (same signature; the block / backend arguments are ignored).

    Scores and softmax exactly as :func:`polestar_jax.models.llada.attention` / :func:`polestar_jax.decode.polestar.drift.proxy_attention`
    compute them, KL as :func:`kl_terms` (``docs/algorithm.md#token-drift``, ``#cluster-drift``; the tests'
    ``tests/drift_refs.py`` applies the same formula to materialised probabilities).
    """
    del interpret, block_l, block_t, backend, flavor
    _check(q, k, key_valid, p_prev, mode)
    b, h, t, hd = q.shape
    kv = k.shape[1]
    qg = q.reshape(b, kv, h // kv, t, hd)
    s = jnp.einsum("bkgtd,bkld->bkgtl", qg, k, preferred_element_type=jnp.float32)
    s = s / jnp.sqrt(jnp.float32(hd))
    if key_valid is not None:
        s = jnp.where(key_valid[:, None, None, None, :], s, MASK_VALUE)
    p_new = jax.nn.softmax(s, axis=-1).reshape(b, h, t, -1)
    kl = jnp.sum(kl_terms(p_new, p_prev.astype(jnp.float32), mode), axis=-1)
    return jnp.mean(jnp.maximum(kl, 0.0), axis=1), p_new


def _check(q, k, key_valid, p_prev, mode):
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"q [b, H, T, hd] and k [b, KV, L, hd] expected, got {q.shape} and {k.shape}")
    b, h, t, hd = q.shape
    if k.shape[0] != b or k.shape[3] != hd or h % k.shape[1]:
        raise ValueError(f"incompatible q {q.shape} / k {k.shape} (H must be a multiple of KV)")
    if p_prev.shape != (b, h, t, k.shape[2]):
        raise ValueError(f"p_prev must be {(b, h, t, k.shape[2])}, got {p_prev.shape}")
    if key_valid is not None and key_valid.shape != (b, k.shape[2]):
        raise ValueError(f"key_valid must be {(b, k.shape[2])}, got {key_valid.shape}")


# ---------------------------------------------------------------------------------------------- kernel
def _dot_nt(a, b, triton: bool):
    """a [m, d] . b [n, d]^T -> [m, n] float32 (full f32 precision: no TF32 / bf16 passes for f32 inputs)."""
    if triton:
        return plgpu.dot(a, b, trans_b=True, precision=lax.Precision.HIGHEST)
    # Mosaic takes a precision only for float32 operands ("Bad lhs type" for bf16 with HIGHEST; bf16 products
    # are exact in the float32 accumulator anyway), and a bf16 lhs only in whole (16, 128) tiles: a row block
    # that is not a multiple of 16 is widened to float32 (exactly) and multiplied at full precision
    if a.dtype != jnp.float32 and a.shape[0] % 16:
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT  # (None: the config default)
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)


def _kl_drift_kernel(q_ref, k_ref, valid_ref, pprev_ref, kl_ref, pnew_ref, *, mode: str, flavor: str,
                     length: int, n_rows: int, head_dim: int, block_t: int, block_l: int, block_d: int):
    """One (batch row, head, row block).

    triton: q [T, hd], k [L, hd], valid [1, L], p_prev / p_new [T, L], kl [T, 1] (whole extents; this
            program owns rows ``t0 .. t0 + block_t``; loads and stores masked).
    mosaic: q [block_t, hd], k [L, hd], valid [1, L], p_prev / p_new [block_t, L], kl [block_t, 1].
    """
    scale = np.float32(np.sqrt(np.float32(head_dim)))
    masked = flavor == "triton"
    if masked:
        t0 = pl.program_id(2) * block_t
        rows = t0 + jnp.arange(block_t)
        row_ok = rows < n_rows
        d_ok = jnp.arange(block_d) < head_dim
        q = plgpu.load(q_ref.at[pl.ds(t0, block_t), pl.ds(0, block_d)],
                       mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        t0 = 0
        q = q_ref[...]

    def scores(start, size):
        """Masked scores [block_t, size] of the keys start .. start + size, and the in-range mask."""
        if masked:
            cols = start + jnp.arange(size)
            col_ok = cols < length
            kb = plgpu.load(k_ref.at[pl.ds(start, size), pl.ds(0, block_d)],
                            mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            vb = plgpu.load(valid_ref.at[pl.ds(0, 1), pl.ds(start, size)], mask=col_ok[None, :], other=0.0)
        else:
            col_ok = None
            kb = k_ref[pl.ds(start, size), :]
            vb = valid_ref[:, pl.ds(start, size)]
        s = _dot_nt(q, kb, masked) / scale
        s = jnp.where(vb > 0, s, MASK_VALUE)
        if masked:
            s = jnp.where(col_ok[None, :], s, -jnp.inf)  # padding beyond L: probability exactly 0
        return s, col_ok

    # key chunks -- triton: cdiv(L, block_l) chunks, masked; mosaic: L // block_l full chunks + a static tail
    if masked:
        n_full, tail = pl.cdiv(length, block_l), 0
    else:
        n_full, tail = length // block_l, length % block_l

    def sweep(body, carry):
        if n_full:
            def loop_body(j, c):
                start = j * block_l
                if not masked:
                    start = pl.multiple_of(start, block_l)
                return body(start, block_l, c)
            carry = lax.fori_loop(0, n_full, loop_body, carry)
        if tail:
            carry = body(n_full * block_l, tail, carry)
        return carry

    # sweep 1: row max and normaliser (online)
    def stats(start, size, carry):
        m, l = carry
        s, _ = scores(start, size)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        l = l * jnp.exp(m - m_new) + jnp.sum(jnp.exp(s - m_new), axis=1, keepdims=True)
        return m_new, l

    m0 = jnp.full((block_t, 1), -jnp.inf, jnp.float32)
    m, l = sweep(stats, (m0, jnp.zeros((block_t, 1), jnp.float32)))

    # sweep 2: probabilities out, KL against p_prev
    def emit(start, size, kl):
        s, col_ok = scores(start, size)
        p = jnp.exp(s - m) / l
        if masked:
            ok = row_ok[:, None] & col_ok[None, :]
            win = (pl.ds(t0, block_t), pl.ds(start, size))
            pp = plgpu.load(pprev_ref.at[win], mask=ok, other=0.0)
            plgpu.store(pnew_ref.at[win], p, mask=ok)
            terms = jnp.where(col_ok[None, :], kl_terms(p, pp, mode), 0.0)
        else:
            pp = pprev_ref[:, pl.ds(start, size)]
            pnew_ref[:, pl.ds(start, size)] = p
            terms = kl_terms(p, pp, mode)
        return kl + jnp.sum(terms, axis=1, keepdims=True)

    kl = jnp.maximum(sweep(emit, jnp.zeros((block_t, 1), jnp.float32)), 0.0)
    if masked:
        plgpu.store(kl_ref.at[pl.ds(t0, block_t), :], kl, mask=row_ok[:, None])
    else:
        kl_ref[...] = kl


# --------------------------------------------------------------------------------------- block sizes
def _pow2_at_least(n: int, lo: int) -> int:
    return max(lo, pl.next_power_of_2(max(int(n), 1)))


def _pad_last(x: jax.Array, size: int) -> jax.Array:
    """``x`` zero-padded at the end of its last axis to ``size`` (``x`` itself when it already has it)."""
    if x.shape[-1] == size:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def block_sizes(flavor: str, t: int, length: int, head_dim: int, block_t: Optional[int] = None,
                block_l: Optional[int] = None) -> tuple[int, int]:
    """(block_t, block_l) for a flavour.

    triton: powers of two >= 16 (``tl.dot`` minimum); ``block_t`` = rows rounded up, at most 64;
            ``block_l`` 64 for hd > 64 else 128 (keeps the [block_t, block_l] scores and the
            [block_l, hd] key tile in registers).
    mosaic: ``block_t`` = T when T <= 256 (a block equal to the full extent is always legal), else the
            largest multiple of 8 dividing T that is <= 256; ``block_l`` a multiple of 128 (lane-aligned
            dynamic slices), default 512, or the whole L when it is shorter.
    """
    if flavor == "triton":
        bt = _pow2_at_least(block_t or min(t, 64), 16)
        bl = _pow2_at_least(block_l or (64 if head_dim > 64 else 128), 16)
        return bt, bl
    if block_t is None:
        if t <= 256:
            bt = t
        else:
            bt = next((c for c in range(256, 7, -8) if t % c == 0), t)
    else:
        bt = int(block_t)
        if bt != t and (bt % 8 or t % bt):
            raise ValueError(f"mosaic block_t must equal T or be a multiple of 8 dividing T ({t}), got {bt}")
    bl = int(block_l or 512)
    bl = max(128, -(-bl // 128) * 128)
    return bt, min(bl, length)


_VMEM_DEFAULT = 16 * 2**20  # the smallest default scoped-VMEM limit of current TPUs
_VMEM_CAP = 60 * 2**20  # below the smallest physical VMEM of the chips the limit may be raised on


def _mosaic_vmem_limit(bt, length, hd, bl, q_dtype, k_dtype) -> Optional[int]:
    """Scoped-VMEM limit for the mosaic kernel: None (the compiler default) while the double-buffered
    blocks (q, k, valid, p_prev, p_new, kl) plus the chunk temporaries fit in 16 MiB, else 1.25x the
    estimate, capped at 60 MiB (beyond that pass a smaller ``block_t``)."""
    blocks = (bt * hd * jnp.dtype(q_dtype).itemsize + length * hd * jnp.dtype(k_dtype).itemsize
              + 4 * length + 2 * 4 * bt * length + 4 * bt)
    est = 2 * blocks + 6 * 4 * bt * bl
    if est <= _VMEM_DEFAULT * 3 // 4:
        return None
    return int(min(est * 5 // 4, _VMEM_CAP))


def kl_drift_pallas(q, k, key_valid, p_prev, *, mode: str, flavor: str, interpret, block_t=None, block_l=None):
    """The Pallas kernel of a flavour (``"triton"`` or ``"mosaic"``; ``interpret``: run by the interpreter) on
    the operands of :func:`kl_drift`, without its dispatch: for callers that build their own (the cluster
    drift over an int8 cache's layer, ``polestar_jax.decode.polestar.drift.cluster_drift``). Returns (drift
    [b, T], p_new [b, H, T, L])."""
    b, h, t, hd = q.shape
    kv, length = k.shape[1], k.shape[2]
    g = h // kv
    bt, bl = block_sizes(flavor, t, length, hd, block_t, block_l)
    if key_valid is None:
        valid = jnp.ones((b, 1, length), jnp.float32)
    else:
        valid = key_valid.astype(jnp.float32)[:, None, :]
    p_prev = p_prev.astype(jnp.float32)
    n_t = pl.cdiv(t, bt)
    grid = (b, h, n_t)
    out_shape = (jax.ShapeDtypeStruct((b, h, t, 1), jnp.float32),
                 jax.ShapeDtypeStruct((b, h, t, length), jnp.float32))
    bd = _pow2_at_least(hd, 16)
    kernel = functools.partial(_kl_drift_kernel, mode=mode, flavor=flavor, length=length, n_rows=t,
                               head_dim=hd, block_t=bt, block_l=bl, block_d=bd)
    if flavor == "triton":
        # The kernel reads the feature axis as one static slice [0, block_d): it must be in bounds (jax >= 0.12
        # checks static slices at trace time, for every platform branch), so q and k are zero-padded to
        # block_d (zero features add nothing to the scores; real head sizes are powers of two >= 16 and
        # are not copied). The row and key slices start at traced offsets and are masked as usual.
        q, k = _pad_last(q, bd), _pad_last(k, bd)
        in_specs = [pl.BlockSpec((None, None, t, bd), lambda i, j, r: (i, j, 0, 0)),
                    pl.BlockSpec((None, None, length, bd), lambda i, j, r: (i, lax.div(j, g), 0, 0)),
                    pl.BlockSpec((None, 1, length), lambda i, j, r: (i, 0, 0)),
                    pl.BlockSpec((None, None, t, length), lambda i, j, r: (i, j, 0, 0))]
        out_specs = (pl.BlockSpec((None, None, t, 1), lambda i, j, r: (i, j, 0, 0)),
                     pl.BlockSpec((None, None, t, length), lambda i, j, r: (i, j, 0, 0)))
        params = plgpu.CompilerParams(num_warps=4, num_stages=2)
    elif flavor == "mosaic":
        in_specs = [pl.BlockSpec((None, None, bt, hd), lambda i, j, r: (i, j, r, 0)),
                    pl.BlockSpec((None, None, length, hd), lambda i, j, r: (i, lax.div(j, g), 0, 0)),
                    pl.BlockSpec((None, 1, length), lambda i, j, r: (i, 0, 0)),
                    pl.BlockSpec((None, None, bt, length), lambda i, j, r: (i, j, r, 0))]
        out_specs = (pl.BlockSpec((None, None, bt, 1), lambda i, j, r: (i, j, r, 0)),
                     pl.BlockSpec((None, None, bt, length), lambda i, j, r: (i, j, r, 0)))
        params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel"),
                                      vmem_limit_bytes=_mosaic_vmem_limit(bt, length, hd, bl, q.dtype, k.dtype))
    else:
        raise ValueError(f"unknown flavor {flavor!r}")
    kl, p_new = pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
        compiler_params=params, interpret=interpret, name=f"kl_drift_{mode}",
    )(q, k, valid, p_prev)
    return jnp.mean(kl[..., 0], axis=1), p_new


def kl_drift(q: jax.Array, k: jax.Array, key_valid: Optional[jax.Array], p_prev: jax.Array, *, mode: str,
             interpret: bool = False, block_l: Optional[int] = None, block_t: Optional[int] = None,
             backend: str = "auto", flavor: str = "triton") -> tuple[jax.Array, jax.Array]:
    """Token / cluster drift of query rows against all keys, fused with the softmax.

    q [b, H, T, hd] query rows (rotated block queries for token drift; projected centroids for cluster
    drift); k [b, KV, L, hd] keys (H a multiple of KV, head h uses key head h // (H // KV)); key_valid [b, L]
    bool or None (False keys get probability 0); p_prev [b, H, T, L] float32 previous probabilities.
    ``mode``: "token" or "cluster".

    Returns ``(drift [b, T] float32, p_new [b, H, T, L] float32)``.

    ``backend``: see :mod:`polestar_jax.kernels.backend` ("auto": Triton on cuda, Mosaic on tpu, the
    reference elsewhere). ``interpret=True`` runs the Pallas kernel in the interpreter (= ``backend=
    "interpret"``), in the layout of ``flavor`` ("triton" or "mosaic"). ``block_t`` / ``block_l``: row and
    key chunk sizes (defaults and constraints: :func:`block_sizes`).
    """
    _check(q, k, key_valid, p_prev, mode)
    if interpret:
        backend = "interpret"

    def pallas(fl, interp):
        return functools.partial(kl_drift_pallas, mode=mode, flavor=fl, interpret=interp,
                                 block_t=block_t, block_l=block_l)

    ref = functools.partial(kl_drift_reference, mode=mode)
    return dispatch("kl_drift", backend, (q, k, key_valid, p_prev), reference=ref, pallas=pallas,
                    interpret_flavor=flavor)
