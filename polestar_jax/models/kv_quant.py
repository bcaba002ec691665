"""The int8 K/V cache (``DecodeConfig.kv_cache="int8"``): keys and values stored as int8 with one scale per
cached row and KV head.

A stacked cache [N, b, KV, L, hd] is a :class:`~polestar_jax.models.quant.QTensor` in place of the float
array: ``q`` int8 [N, b, KV, L, hd] and ``scale`` [N, b, KV, L, 1] in the model's float dtype, one per
(layer, batch row, KV head, position): symmetric absmax over ``hd`` (:func:`~polestar_jax.models.quant.quantize`
with ``axis=-1``), so no cached element moves by more than half its row's scale. Both arrays carry the
cache's declared axes (batch over ``data``, KV heads over ``model``), so they shard, select rows and split
for a running batch exactly as the float cache does.

Writes quantize the rows written (:func:`stored`, called by :class:`polestar_jax.models.llada.CacheSlot` and
:class:`~polestar_jax.models.llada.SlotWrite`): a full pass quantizes the layer it writes, a cached step only
its own rows. Reads happen inside the attention (:func:`polestar_jax.models.llada.attention_exact` through
:func:`operand`): a scale belongs to one key position, so it factors out of the dot over ``hd``::

    scores = (q . convert(k_q)) * k_scale            out = (p * v_scale) @ convert(v_q)

The int8 operands are converted inside the dots (exact in bfloat16; XLA fuses the convert into the GEMM's
operand on TPU and GPU), and the scales multiply the [T, L] scores and probabilities: no float copy of the
cache is made. A full pass attends to its own float keys and values (as with the float cache); the cached
steps read the int8 cache. Keys kept un-rotated (not the Fast-dLLM caches) are dequantized before RoPE.
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from polestar_jax.models.quant import QTensor, dequantize, is_qtensor, quantize


def empty(shape: tuple[int, ...], dtype: Any, mode: str = "float"):
    """An all-zero cache [..., hd] of ``mode`` ``"float"`` (an array of ``dtype``) or ``"int8"`` (a
    :class:`QTensor`: int8 values and zero scales [..., 1] of ``dtype``)."""
    if mode == "float":
        return jnp.zeros(shape, dtype)
    return QTensor(jnp.zeros(shape, jnp.int8), jnp.zeros(tuple(shape[:-1]) + (1,), dtype))


def stored(new: Any, like: Any) -> Any:
    """``new`` (rows [..., hd] to write) in the form the buffer ``like`` stores: quantized per row when
    ``like`` is int8 (a :class:`QTensor`; its scale's dtype), else as it is."""
    if not is_qtensor(like) or is_qtensor(new):
        return new
    return quantize(new.astype(like.scale.dtype), -1)


def stored_like(buffers: Any, new: Any) -> Any:
    """:func:`stored` over a pytree of buffers (a :class:`QTensor` is one buffer) and the rows ``new`` to
    write into them (the same structure, float arrays where the buffers are int8)."""
    return jax.tree.map(lambda like, u: stored(u, like), buffers, new, is_leaf=is_qtensor)


def is_int8(x: Any) -> bool:
    """Whether ``x`` (a layer's keys or values) is int8 (a :class:`QTensor`)."""
    return is_qtensor(x)


def operand(x: Any, dtype: Any) -> tuple[jax.Array, Optional[jax.Array]]:
    """A layer's keys or values ``x`` [b, KV, L, hd] as a dot operand: ``(x, None)`` for a float array (as it
    is); for an int8 one its values converted to ``dtype`` (fused into the dot) and its scales [b, KV, L]
    in float32, which the caller applies per key position."""
    if not is_qtensor(x):
        return x, None
    return x.q.astype(dtype), x.scale[..., 0].astype(jnp.float32)


def read(x: Any) -> jax.Array:
    """``x`` as a float array (an int8 cache dequantized in its scale's dtype; a float one as it is)."""
    return dequantize(x)
