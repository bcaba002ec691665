"""Compaction for Polestar's sparse refresh: the rows a refresh touches, at a static width.

A refresh step works, in every layer, on a *subset* of the ``R`` window rows (the packet of the previous
layer, then the rows of this layer's top-drift clusters), and the subset changes every layer. Shapes must be
static, so the subset is compacted to a fixed width: ``compact(mask, w)`` lists the selected rows first
(ascending), then padding. Each stage compiles a few widths -- ``0`` and ``ceil(i * R / q)`` for
``i = 1 .. q``, ``q = PolestarConfig.refresh_buckets`` (:func:`widths`) -- and :func:`by_width` runs the
smallest one that holds the largest count in the batch: width 0 does no row work and moves nothing, width
``R`` is a dense refresh. No row is ever dropped, so the result does not depend on ``q``; ``q`` trades
compile time (one branch per width) for fewer rows gathered, computed and moved between host and device.
The stages that read and write the hidden-state store compact only a store in host memory
(:func:`store_widths`).

Arrays: ``mask`` [b, R] bool; ``idx`` [b, w] int32 row numbers; ``valid`` [b, w] bool.
"""
from __future__ import annotations

from typing import Callable, Sequence, TypeVar

import jax
import jax.numpy as jnp
from jax import lax

from polestar_jax.decode.rows import batch_max

from polestar_jax.config import REFRESH_BUCKETS, PolestarConfig

T = TypeVar("T")

__all__ = ["widths", "store_widths", "complement_widths", "compact", "take_rows", "spread_rows", "chosen_width",
           "by_width"]


def widths(pc: PolestarConfig, n_rows: int) -> tuple[int, ...]:
    """The widths compiled for one refresh stage over ``n_rows`` window rows: 0, then ``ceil(i * n_rows / q)``
    for ``i = 1 .. q`` (``q = pc.refresh_buckets``), ascending and distinct; the last is ``n_rows``."""
    q = pc.refresh_buckets or REFRESH_BUCKETS  # (none: the default; the engine makes it concrete per platform)
    return tuple(sorted({0, n_rows} | {-(-n_rows * i // q) for i in range(1, q)}))


def store_widths(pc: PolestarConfig, n_rows: int, host: bool) -> tuple[int, ...]:
    """The widths compiled for the refresh stages that read and write the hidden-state store: :func:`widths`
    when the store is in host memory (``host``: each row moved costs a host<->device copy), else the one
    width ``n_rows``: reading or writing rows of a store in device memory costs about the same at any
    width, and one branch compiles instead of ``refresh_buckets + 1``."""
    return widths(pc, n_rows) if host else (n_rows,)


def complement_widths(ws: Sequence[int], n_rows: int) -> tuple[int, ...]:
    """The widths of a stage that reads what an earlier stage of a width ``w`` of ``ws`` left out (at most
    ``n_rows - w`` rows, so the two never exceed ``n_rows``): ``n_rows - w`` for each ``w``, and the widths
    of ``ws`` of at most ``n_rows - min(ws)`` (the most such a stage can need)."""
    most = n_rows - min(ws)
    return tuple(sorted({w for w in ws if w <= most} | {n_rows - w for w in ws}))


def compact(mask: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
    """The True positions of ``mask`` [b, R] in ascending order, then the others: idx [b, width] and valid
    [b, width] (``valid`` is False for padding; a row with more than ``width`` True entries would lose the
    last ones -- :func:`by_width` never picks such a width)."""
    r = mask.shape[1]
    pos = jnp.arange(r, dtype=jnp.int32)
    order = jnp.argsort(jnp.where(mask, pos, r + pos), axis=1)[:, :width].astype(jnp.int32)
    return order, jnp.take_along_axis(mask, order, axis=1)


def take_rows(a: jax.Array, idx: jax.Array, axis: int = 1) -> jax.Array:
    """``a`` [b, ..., R (at ``axis``), ...] gathered at ``idx`` [b, w] along ``axis``."""
    shape = [1] * a.ndim
    shape[0], shape[axis] = idx.shape
    return jnp.take_along_axis(a, idx.reshape(shape), axis=axis)


def spread_rows(rows: jax.Array, idx: jax.Array, valid: jax.Array, n_rows: int, axis: int = 1) -> jax.Array:
    """Inverse of :func:`take_rows` into zeros: [b, ..., n_rows, ...] with ``rows`` at ``idx`` where
    ``valid`` (other rows zero)."""
    moved = jnp.moveaxis(rows, axis, 1)
    out = jnp.zeros((moved.shape[0], n_rows) + moved.shape[2:], rows.dtype)
    bi = jnp.arange(idx.shape[0])[:, None]
    out = out.at[bi, jnp.where(valid, idx, n_rows)].set(moved, mode="drop")
    return jnp.moveaxis(out, 1, axis)


def _branch(counts: jax.Array, ws: Sequence[int]) -> jax.Array:
    """Index into ``ws`` of the smallest width holding ``max(counts)`` (int32 scalar)."""
    return jnp.sum(jnp.asarray(ws[:-1], jnp.int32) < batch_max(counts)).astype(jnp.int32)


def chosen_width(counts: jax.Array, ws: Sequence[int]) -> jax.Array:
    """The width :func:`by_width` runs for ``counts`` [b] (int32 scalar): the smallest of ``ws`` (ascending)
    that holds ``max(counts)``."""
    return jnp.asarray(ws, jnp.int32)[_branch(counts, ws)]


def by_width(counts: jax.Array, ws: Sequence[int], stage: Callable[[int], Callable[[], T]]) -> T:
    """Runs ``stage(w)()`` for the smallest width ``w`` of ``ws`` (ascending; the last must hold every count)
    that holds ``max(counts)`` ([b] selected rows per batch row); every branch is compiled, one runs."""
    if len(ws) == 1:
        return stage(ws[0])()
    return lax.switch(_branch(counts, ws), [stage(w) for w in ws])
