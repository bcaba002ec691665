"""Weight-only int8 quantization: int8 matmul weights with one scale per output channel.

A quantized weight is a :class:`QTensor` in place of the float array in the parameter pytree: ``q`` int8 and
``scale`` in the model's float dtype, with the shape of ``q`` except size 1 on the reduced (input) axis, so
that ``W ~= q * scale``. Symmetric absmax per output channel::

    scale = max(|W|, axis=reduced) / 127       q = clip(round(W / scale), -127, 127)

so every element's error ``|W - q * scale|`` is at most ``scale / 2`` (:func:`quantize` rounds the stored
scale up when the float dtype rounds it down, so the bound holds for the scale that is stored).

What is quantized (:func:`quantize_params`, every family whose weights are dense matmuls): the attention
projections ``blocks/wq``, ``wk``, ``wv``, ``wo``, the MLP ``w_gate``, ``w_up``, ``w_down`` (LLaDA, Dream,
LLaDA-V's LM), LLaDA-MoE's experts ``e_gate``, ``e_up``, ``e_down`` (per expert and output channel), the LM
head ``lm_head`` [D, V] (per vocabulary column) and the embedding ``wte`` [V, D] (per row: the rows a token
reads). Norms, biases, LLaDA-MoE's router and LLaDA-V's vision tower and projector stay float.

The model code calls :func:`matmul`, :func:`head` and :func:`take_rows` where it multiplies by a weight or
reads embedding rows: for a float array they are exactly the float code (``x @ w``, the head's einsum,
``jnp.take``), so float models compute bit for bit what they did; for a :class:`QTensor` the int8 weight is
converted to the activation dtype inside the product (int8 values are exact in bfloat16), the product is
accumulated in float32 and scaled per output channel. The convert is an operand of the dot, which XLA fuses
into the GEMM on TPU and GPU: no float copy of the weights is made. LLaDA-MoE's experts go through
``ragged_dot``; they are dequantized per layer (:func:`dequantize`) inside the layer scan, so one layer's
experts at a time exist in float.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Union

import jax
import jax.numpy as jnp
from jax import lax

from polestar_jax import compat
from polestar_jax.errors import ConfigError

#: The weight storage modes a model loads with: ``float`` (as stored or cast with ``dtype``) or ``int8``.
WEIGHT_MODES = ("float", "int8")

#: Parameter names quantized per output column (linear weights stored [..., in, out]): reduced axis -2.
COLUMN_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "e_gate", "e_up", "e_down", "lm_head")
#: Parameter names quantized per row (the embedding table [V, D]): reduced axis -1.
ROW_WEIGHTS = ("wte",)

#: Sub-pytrees never quantized (LLaDA-V's vision tower and projector).
FLOAT_SUBTREES = ("vision", "projector")

_QMAX = 127


class QTensor(NamedTuple):
    """An int8 weight with its per-channel scale: ``q`` int8 [..., in, out] (or [V, D] for an embedding),
    ``scale`` [..., 1, out] (or [V, 1]) in the model's float dtype; ``W ~= q * scale``. A pytree, so it rides in
    the parameter pytree through ``lax.scan`` (the layer axis), sharding and ``jax.eval_shape``."""

    q: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's shape (``q``'s)."""
        return tuple(self.q.shape)

    @property
    def dtype(self):
        """The float dtype the weight computes in (its scale's)."""
        return self.scale.dtype

    @property
    def nbytes(self) -> int:
        return int(self.q.size) * 1 + int(self.scale.size) * jnp.dtype(self.scale.dtype).itemsize


Weight = Union[jax.Array, QTensor]


def is_qtensor(x: Any) -> bool:
    """Whether ``x`` is a :class:`QTensor` (an ``is_leaf`` for tree maps that treat it as one weight)."""
    return isinstance(x, QTensor)


def quantize(w: jax.Array, axis: int = -2) -> QTensor:
    """``w`` [...] (float) as int8 with one scale per slice along ``axis`` (the reduced, input axis: -2 for a
    linear weight [..., in, out], -1 for an embedding table [V, D]); the scale in ``w.dtype``, never rounded
    below the absmax / 127 (so ``|w - q * scale| <= scale / 2`` for every element). An all-zero channel gets
    scale 1 and zeros."""
    wf = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(wf), axis=axis, keepdims=True)
    exact = jnp.where(amax > 0, amax / _QMAX, 1.0)  # float32
    scale = exact.astype(w.dtype)
    # the stored scale must not be smaller than the exact one (else |w| / scale could exceed 127.5)
    scale = jnp.where(scale.astype(jnp.float32) < exact, jnp.nextafter(scale, jnp.asarray(jnp.inf, w.dtype)), scale)
    q = jnp.clip(jnp.round(wf / scale.astype(jnp.float32)), -_QMAX, _QMAX).astype(jnp.int8)
    return QTensor(q, scale)


#: :func:`quantize` compiled (one program per weight shape: a host array moves to the device leaf by leaf)
_quantize = jax.jit(quantize, static_argnums=1)


def dequantize(w: Weight, dtype: Any = None) -> jax.Array:
    """The float weight ``q * scale`` in ``dtype`` (default: the scale's); a float array is returned as is."""
    if not isinstance(w, QTensor):
        return w
    dtype = dtype or w.dtype
    return (w.q.astype(jnp.float32) * w.scale.astype(jnp.float32)).astype(dtype)


def matmul(x: jax.Array, w: Weight) -> jax.Array:
    """``x @ w`` for rows ``x`` [..., in] and a weight [in, out]: the float product for a float array, else
    ``(x @ q) * scale`` with ``q`` converted to ``x.dtype`` in the product, float32 accumulation, the result in
    ``x.dtype``. [..., out]."""
    if not isinstance(w, QTensor):
        return x @ row_major_on_tpu(w)
    y = jnp.matmul(x, row_major_on_tpu(w.q).astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * w.scale[..., 0, :].astype(jnp.float32)).astype(x.dtype)


def row_major_on_tpu(w: jax.Array) -> jax.Array:
    """``w`` (any array of 2 or more dims: a weight [..., in, out], an int8 K/V layer [b, KV, L, hd]) unchanged in
    value, shape and dtype, held in its row-major layout when the program is lowered for a TPU (a layout
    constraint; other targets, and arrays of fewer dims: ``w`` itself). XLA:TPU otherwise chooses a transposed layout
    for some products (those whose results it lays out sequence-minor, e.g. a running batch's per-row block
    start) and, the weight being a layer's slice of the stacked weights, hoists that transpose out of the
    layer loops as a copy of every layer's weight: LLaDA-8B's running batch on one v5e chip copied the stacked
    int8 ``wq``, ``wk``, ``wv`` (1.5 GiB) so (``bench/tpu_proxy.py``). An export
    (:func:`polestar_jax.compat.export`) carries no constraint: its custom call has no serialization
    guarantee."""
    if w.ndim < 2 or compat.kernels_staged():
        return w
    return lax.platform_dependent(w, tpu=_row_major, default=lambda a: a)


def _row_major(w: jax.Array) -> jax.Array:
    from jax.experimental.layout import Layout, with_layout_constraint

    return with_layout_constraint(w, Layout(tuple(range(w.ndim))))


def head(h: jax.Array, w: Weight) -> jax.Array:
    """The LM head's product of rows ``h`` [b, T, D] and ``w`` [D, V]: float32 logits [b, T, V]."""
    if not isinstance(w, QTensor):
        return jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32)
    y = jnp.einsum("btd,dv->btv", h, w.q.astype(h.dtype), preferred_element_type=jnp.float32)
    return y * w.scale[0].astype(jnp.float32)


def take_rows(table: Weight, ids: jax.Array) -> jax.Array:
    """Rows ``ids`` [...] of an embedding table [V, D] (``jnp.take`` along axis 0): [..., D] in the table's
    float dtype; a quantized table dequantizes only the rows read."""
    if not isinstance(table, QTensor):
        return jnp.take(table, ids, axis=0)
    q = jnp.take(table.q, ids, axis=0).astype(jnp.float32)
    return (q * jnp.take(table.scale, ids, axis=0).astype(jnp.float32)).astype(table.dtype)


def quantize_params(params: dict, mode: str = "int8") -> dict:
    """``params`` (a model family's pytree) with every matmul weight (:data:`COLUMN_WEIGHTS`,
    :data:`ROW_WEIGHTS`) as a :class:`QTensor` for ``mode`` ``"int8"``; ``"float"`` returns ``params``. Works on
    arrays and on ``jax.ShapeDtypeStruct`` leaves under ``jax.eval_shape``. Already quantized weights are kept.
    A one-line :class:`ConfigError` for an unknown mode."""
    check_mode(mode)
    if mode == "float":
        return params

    def walk(tree: Any, name: str = "") -> Any:
        if isinstance(tree, dict):  # (LLaDA-V's tower and projector stay float)
            return {k: v if k in FLOAT_SUBTREES else walk(v, k) for k, v in tree.items()}
        if isinstance(tree, QTensor) or not hasattr(tree, "dtype") or not jnp.issubdtype(tree.dtype, jnp.floating):
            return tree
        if name in COLUMN_WEIGHTS:
            return _quantize(tree, -2)
        if name in ROW_WEIGHTS:
            return _quantize(tree, -1)
        return tree

    return walk(params)


def check_mode(mode: Any) -> str:
    """``mode`` if it is one of :data:`WEIGHT_MODES`, else a one-line :class:`ConfigError`."""
    if mode not in WEIGHT_MODES:
        raise ConfigError(f"unknown weights mode {mode!r} (choose from {', '.join(WEIGHT_MODES)})")
    return mode


def weights_mode(params: dict) -> str:
    """``"int8"`` when ``params`` holds quantized weights, else ``"float"``."""
    return "int8" if any(is_qtensor(x) for x in jax.tree.leaves(params, is_leaf=is_qtensor)) else "float"


def float_dtype(params: dict):
    """The float dtype a parameter pytree computes in (its first leaf's, a :class:`QTensor`'s scale dtype)."""
    return jax.tree.leaves(params, is_leaf=is_qtensor)[0].dtype


def weight_bytes(params: dict) -> int:
    """Bytes of every parameter (int8 weights at one byte per value, plus their scales)."""
    return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))
