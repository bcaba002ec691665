"""Batch-wide decisions inside the per-row block program.

The block program (:func:`polestar_jax.decode.block.decode_block`) decodes every batch row on its own (a
``jax.vmap`` over rows named :data:`ROWS`), so each row can sit at its own block. A few decisions must stay
batch-wide so that XLA keeps a real branch instead of computing every branch for every row: whether any row
needs a full pass, a windowed pass or a refresh, and the widest refresh bucket any row needs. These helpers
reduce over the rows axis when it is bound, and over the given array alone when it is not (a policy
function called outside the block program, with a batch axis of its own).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from polestar_jax.axes import ROWS  # noqa: F401 (the rows axis of the block program's vmap; re-exported)


def batch_any(pred: jax.Array) -> jax.Array:
    """[] bool: any element of ``pred`` is True in any row of the running batch."""
    p = jnp.any(pred)
    try:
        return lax.psum(p.astype(jnp.int32), ROWS) > 0
    except NameError:  # not inside the block program's rows axis
        return p


def batch_max(x: jax.Array) -> jax.Array:
    """[] the largest element of ``x`` over every row of the running batch."""
    m = jnp.max(x)
    try:
        return lax.pmax(m, ROWS)
    except NameError:
        return m
