"""The LLaDA transformer as pure functions over a parameter pytree.

LLaDA (``block_type=llama``) is a pre-norm transformer with bidirectional attention:

    x = wte[ids]
    for each layer:  x = x + Attn(RMSNorm(x));  x = x + SwiGLU(RMSNorm(x))
    logits = RMSNorm(x) @ lm_head

RMSNorm is computed in float32 and cast back; RoPE is the "rotate-half" (NeoX) form, computed in float32;
attention has no causal mask (an optional key mask hides left padding); the LM head is untied.

Parameters (a nested dict; per-layer weights stacked on axis 0 so the layers run under ``lax.scan``;
linear weights are stored ``[in, out]``; with int8 weights each matmul weight is a
:class:`polestar_jax.models.quant.QTensor`, multiplied through :func:`~polestar_jax.models.quant.matmul`)::

    wte      [V, D]          blocks/attn_norm [N, D]     blocks/wq [N, D, H*hd]   blocks/wk [N, D, KV*hd]
    ln_f     [D]             blocks/ff_norm   [N, D]     blocks/wv [N, D, KV*hd]  blocks/wo [N, H*hd, D]
    lm_head  [D, V]          blocks/w_gate    [N, D, F]  blocks/w_up [N, D, F]    blocks/w_down [N, F, D]

The KV cache holds keys *before* RoPE (the PyTorch code's convention; Polestar's cluster drift reads them
so) or, with ``rotated_cache=True`` (the Fast-dLLM caches), *after* RoPE: rotated once where the rows are
written, so a cached step reads them as they are instead of rotating every cached key again. RoPE is
elementwise in each key and its position, so both give the same rotated keys (bit for bit in bfloat16; in
float32 XLA may contract the rotation's multiply-add differently in another fusion: the last bit, D46).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from polestar_jax.axes import ROWS
from polestar_jax.config import ModelConfig
from polestar_jax.models import kv_quant
from polestar_jax.models.quant import head as _head, matmul as mm, row_major_on_tpu, take_rows

Params = dict[str, Any]
LayerParams = dict[str, jax.Array]

_NEG = -1e30  # finite "minus infinity" for masked keys: keeps fully masked rows NaN-free


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as LLaDA computes it: normalise in float32, cast back to ``x.dtype``, then scale.

    x: [..., D]; weight: [D]. Returns [..., D] in ``x.dtype``.
    """
    xf = x.astype(jnp.float32)
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    y = (xf * lax.rsqrt(var + eps)).astype(x.dtype)
    return (weight * y).astype(x.dtype)


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables of rotate-half RoPE for integer ``positions`` [b, T]; returns two [b, T, hd] float32."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))  # [hd/2]
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [b, T, hd/2]
    ang = jnp.concatenate([freqs, freqs], axis=-1)  # [b, T, hd]
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(t: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates ``t`` [b, heads, T, hd] with tables [b, T, hd] (float32 math, result in ``t.dtype``)."""
    tf = t.astype(jnp.float32)
    half = t.shape[-1] // 2
    rot = jnp.concatenate([-tf[..., half:], tf[..., :half]], axis=-1)
    return (tf * cos[:, None] + rot * sin[:, None]).astype(t.dtype)


def split_heads(y: jax.Array, n: int) -> jax.Array:
    """Projected rows [b, T, n*hd] -> per head [b, n, T, hd]."""
    b, t, _ = y.shape
    return y.reshape(b, t, n, -1).transpose(0, 2, 1, 3)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, key_valid: Optional[jax.Array],
              return_probs: bool = False):
    """Bidirectional attention with rotated ``q`` [b, H, T, hd], ``k``/``v`` [b, KV, L, hd] (GQA when KV < H).

    ``key_valid`` [b, L] (bool) hides padded keys. Softmax in float32. Returns [b, H, T, hd] in q.dtype, and
    with ``return_probs`` also the attention probabilities [b, H, T, L] (float32). ``k`` / ``v`` may be an
    int8 cache's layer (:mod:`polestar_jax.models.kv_quant`): the exact path reads it, scales applied per key.
    A GPU's bf16 full pass takes cuDNN's fused attention; a TPU's pass without probabilities a KV head at a
    time where one head's float32 scores reach :data:`_HEAD_AT_A_TIME_BYTES` and each chip holds every head
    (:func:`attention_by_heads`).
    """
    if not return_probs and q.shape[2] * k.shape[2] * 4 >= _HEAD_AT_A_TIME_BYTES and _heads_on_each_device():
        # (a full pass's float32 scores of every head at once: 1 GiB at LLaDA-8B's batch 32 on a TPU, which
        # has no fused attention here; other targets as below)
        return lax.platform_dependent(q, k, v, key_valid, tpu=attention_by_heads,
                                      default=lambda q, k, v, kv_: _attention(q, k, v, kv_, False))
    return _attention(q, k, v, key_valid, return_probs)


#: the bytes of one head's float32 scores (T x L) from which a TPU's attention takes a KV head at a time
_HEAD_AT_A_TIME_BYTES = 1 << 20


def _heads_on_each_device() -> bool:
    """Whether the program being traced holds every head on each device: no mesh, or one whose ``model`` axis
    (the heads') is 1. A loop over heads split over ``model`` gathers each layer's K/V onto every device
    (v5e:2x2, ``bench/tpu_proxy.py``)."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.empty or dict(mesh.shape).get("model", 1) == 1


def attention_by_heads(q: jax.Array, k: Any, v: Any, key_valid: Optional[jax.Array]) -> jax.Array:
    """:func:`attention_exact` (no probabilities), equal values, a KV head (and its group of query heads) at a
    time in a loop, so that one group's float32 scores exist at once, not every head's."""
    b, h, t, hd = q.shape
    kv = jax.tree.leaves(k)[0].shape[1]
    qg = jnp.moveaxis(q.reshape(b, kv, h // kv, t, hd), 1, 0)  # [KV, b, g, T, hd]
    by_head = lambda x: jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0)[:, :, None], x)  # [KV, b, 1, L, ...]
    o = lax.map(lambda a: attention_exact(a[0], a[1], a[2], key_valid), (qg, by_head(k), by_head(v)))
    return jnp.moveaxis(o, 0, 1).reshape(b, h, t, hd)


def _attention(q: jax.Array, k: Any, v: Any, key_valid: Optional[jax.Array], return_probs: bool):
    if kv_quant.is_int8(k) or kv_quant.is_int8(v):
        return attention_exact(q, k, v, key_valid, return_probs)
    if not return_probs and q.dtype in (jnp.bfloat16, jnp.float16) and fused_pays(q, k) and cudnn_available():
        # a GPU program gets cuDNN's fused attention (no [T, L] score matrix in memory); every other target
        # (the CPU, a TPU) the exact path below. Float32 and the drift's probabilities always take the exact path.
        return lax.platform_dependent(q, k, v, key_valid, cuda=fused_attention,
                                      default=functools.partial(attention_exact, return_probs=False))
    return attention_exact(q, k, v, key_valid, return_probs)


def fused_pays(q: jax.Array, k: jax.Array) -> bool:
    """Whether the fused kernel moves fewer bytes than the exact path for queries ``q`` [b, H, T, hd] over keys
    ``k`` [b, KV, L, hd]: when the exact path's float32 scores (and their probabilities) of a key outweigh the
    key's K and V. A full pass (T = L) always; a cached step's block of queries not (LLaDA-8B: T < 128): there
    the exact path's GEMMs read a layer of the stacked cache in place, while the fused call takes its operands
    whole, so XLA copies the layer's K and V out first (4x their bytes, more than the scores)."""
    _, h, t, _ = q.shape
    _, kv, _, hd = k.shape
    return h * t * 4 >= 2 * kv * hd * k.dtype.itemsize


@functools.lru_cache(maxsize=1)
def cudnn_available() -> bool:
    """Whether this process can trace cuDNN's fused attention (a CUDA build of jaxlib with cuDNN found)."""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version

        check_cudnn_version()
        return True
    except Exception:  # noqa: BLE001 - no CUDA plugin, no cuDNN, or another JAX: the exact path
        return False


def attention_exact(q: jax.Array, k: jax.Array, v: jax.Array, key_valid: Optional[jax.Array],
                    return_probs: bool = False):
    """:func:`attention` as two einsums and a float32 softmax (every float32 program; the probabilities; an
    int8 cache: its values converted inside the einsums, the keys' scales on the scores, the values' on the
    probabilities, :func:`polestar_jax.models.kv_quant.operand`)."""
    b, h, t, hd = q.shape
    v, v_scale = kv_quant.operand(v, q.dtype)
    p = jax.nn.softmax(attention_scores(q, k, key_valid), axis=-1)
    pv = p if v_scale is None else p * v_scale[:, :, None, None, :]
    o = jnp.einsum("bkgtl,bkld->bkgtd", pv.astype(v.dtype), v,
                   preferred_element_type=jnp.float32).astype(q.dtype)
    o = o.reshape(b, h, t, hd)
    if return_probs:
        return o, p.reshape(b, h, t, -1)
    return o


def attention_scores(q: jax.Array, k: Any, key_valid: Optional[jax.Array]) -> jax.Array:
    """The scaled scores of queries ``q`` [b, H, T, hd] against keys ``k`` [b, KV, L, hd] per KV group:
    [b, KV, H // KV, T, L] float32, padded keys (``key_valid`` [b, L] False) at a finite minus infinity.
    ``k`` may be an int8 cache's layer: its values are converted inside the dot and its per-position scales
    multiply the scores (:func:`polestar_jax.models.kv_quant.operand`)."""
    b, h, t, hd = q.shape
    kv = k.shape[1]
    qg = q.reshape(b, kv, h // kv, t, hd)
    k, k_scale = kv_quant.operand(k, q.dtype)
    s = jnp.einsum("bkgtd,bkld->bkgtl", qg, k, preferred_element_type=jnp.float32)
    if k_scale is not None:
        s = s * k_scale[:, :, None, None, :]
    s = s / jnp.sqrt(jnp.float32(hd))
    if key_valid is not None:
        s = jnp.where(key_valid[:, None, None, None, :], s, _NEG)
    return s


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_valid: Optional[jax.Array],
                    implementation: str = "cudnn") -> jax.Array:
    """:func:`attention` through ``jax.nn.dot_product_attention`` (``implementation`` "cudnn": flash attention
    on a GPU, bf16 / fp16; "xla" anywhere, for tests): ``q`` [b, H, T, hd], ``k``/``v`` [b, KV, L, hd] (GQA
    as is), ``key_valid`` [b, L] -> [b, H, T, hd]."""
    return _fused_rows(implementation)(q, k, v, key_valid)


@functools.lru_cache(maxsize=None)
def _fused_rows(implementation: str):
    """:func:`fused_attention`'s call, whose ``vmap`` (a running batch's per-row block program) folds the
    mapped axis into the batch axis: one fused call over every row (JAX's own batching rule of the cuDNN call
    does not trace a [b, 1, T, L] mask; the rows' batch axes are contiguous, so the fold moves nothing)."""

    @jax.custom_batching.custom_vmap
    def fused(q, k, v, key_valid):
        # [b, 1, T, L]: cuDNN takes a mask only with both sequence lengths (a [b, 1, 1, L] one fails to trace
        # wherever T != L: every cached step)
        b, _, t, hd = q.shape
        mask = None if key_valid is None else jnp.broadcast_to(key_valid[:, None, None, :], (b, 1, t, k.shape[2]))
        if implementation == "cudnn":  # in the heads-first layout the cache has (a transpose copies each K/V)
            from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention

            return cudnn_attention(q, k, v, mask=mask, scale=1.0 / float(hd) ** 0.5,
                                   qkv_layout="BNTH")
        out = jax.nn.dot_product_attention(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3),
                                           v.transpose(0, 2, 1, 3), mask=mask, implementation=implementation)
        return out.transpose(0, 2, 1, 3)

    @fused.def_vmap
    def rows(n, batched, q, k, v, key_valid):
        # (a mapped argument has the mapped axis first; an unmapped one is the same for every row)
        lead = lambda a, on: a if on else jnp.broadcast_to(a, (n,) + a.shape)
        args = [lead(a, on) for a, on in zip((q, k, v), batched[:3])]
        if key_valid is not None:
            args.append(lead(key_valid, batched[3]))
        flat = [a.reshape((-1,) + a.shape[2:]) for a in args]
        out = fused(*flat, *(() if key_valid is not None else (None,)))
        return out.reshape((n, -1) + out.shape[1:]), True

    return fused


def project_qkv(lp: LayerParams, h: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Attention-norm and Q/K/V projections of rows ``h`` [b, T, D]: q [b, H, T, hd], k/v [b, KV, T, hd]
    (un-rotated)."""
    return (project_q(lp, h, cfg),) + project_kv(lp, h, cfg)


def project_q(lp: LayerParams, h: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The query part of :func:`project_qkv`: q [b, H, T, hd]."""
    xn = rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps)
    return split_heads(mm(xn, lp["wq"]), cfg.n_heads)


def project_kv(lp: LayerParams, h: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """The key / value part of :func:`project_qkv`: k, v [b, KV, T, hd] (un-rotated)."""
    xn = rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps)
    return split_heads(mm(xn, lp["wk"]), cfg.n_kv_heads), split_heads(mm(xn, lp["wv"]), cfg.n_kv_heads)


def swiglu(lp: LayerParams, xn: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The dense SwiGLU MLP of normed rows ``xn`` [b, T, D] -> [b, T, D]."""
    return mm(jax.nn.silu(mm(xn, lp["w_gate"])) * mm(xn, lp["w_up"]), lp["w_down"])


def finish_layer(lp: LayerParams, h: jax.Array, a: jax.Array, cfg: ModelConfig,
                 mlp: Optional[Callable[..., jax.Array]] = None) -> jax.Array:
    """Residual + output projection of the attention result ``a`` [b, H, T, hd], then the MLP block
    (``mlp(lp, xn, cfg)``, default :func:`swiglu`): returns the layer output [b, T, D] for input rows
    ``h`` [b, T, D]."""
    b_, _, t_, _ = a.shape
    a = a.transpose(0, 2, 1, 3).reshape(b_, t_, -1)
    h = h + mm(a, lp["wo"])
    xn = rms_norm(h, lp["ff_norm"], cfg.rms_norm_eps)
    return h + (mlp or swiglu)(lp, xn, cfg)


class Rope(NamedTuple):
    """cos / sin tables of rotate-half RoPE for some rows: [b, T, hd] each (:func:`rope_tables`)."""

    cos: jax.Array
    sin: jax.Array

    @classmethod
    def at(cls, positions: jax.Array, cfg: ModelConfig) -> "Rope":
        return cls(*rope_tables(positions, cfg.head_dim, cfg.rope_theta))

    def rotate(self, t: jax.Array) -> jax.Array:
        return apply_rope(t, self.cos, self.sin)


class Keys(NamedTuple):
    """A layer's keys and values over all L positions: ``k`` / ``v`` [b, KV, L, hd] (what the cache stores:
    un-rotated keys, or with ``rotated_cache`` the rotated ones) and the rotated keys ``k_rot`` the queries
    attend to."""

    k: jax.Array
    v: jax.Array
    k_rot: jax.Array


class LayerOut(NamedTuple):
    h: jax.Array  # [b, T, D] the layer output of the query rows
    keys: Keys  # the keys / values the rows attended to (after this layer's write)
    q_rot: jax.Array  # [b, H, T, hd] rotated queries
    probs: Optional[jax.Array]  # [b, H, T, L] attention probabilities (float32) when asked for


def layer(
    lp: LayerParams,
    h: jax.Array,
    cfg: ModelConfig,
    q_rope: Rope,
    k_rope: Rope,
    key_valid: Optional[jax.Array],
    write: Optional[Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]] = None,
    keys: Optional[Keys] = None,
    return_probs: bool = False,
    *,
    rotated_cache: bool = False,
    q_proj: Callable[..., jax.Array] = None,
    kv_proj: Callable[..., tuple] = None,
    mlp: Callable[..., jax.Array] = None,
) -> LayerOut:
    """THE transformer layer, for query rows ``h`` [b, T, D] at RoPE tables ``q_rope``; every pass runs it
    (full forward, cached steps, Polestar's block starts and refresh stages).

    Keys: given as ``keys`` (already written, e.g. by an earlier refresh stage), or projected from ``h``:
    without ``write`` the rows are the whole sequence (T == L); ``write(k, v)`` places the rows' fresh K/V
    [b, KV, T, hd] into the cache and returns the layer's full K/V [b, KV, L, hd] (a slice update, a row
    scatter, ...). Then the queries attend over all L keys (rotated with ``k_rope``) and the output
    projection and SwiGLU MLP finish the layer. ``rotated_cache``: the cache holds rotated keys (the rows'
    keys are rotated with their own tables ``q_rope`` before ``write``; without ``write``, with ``k_rope``),
    and the returned ``keys.k`` is ``keys.k_rot``. ``q_proj`` / ``kv_proj``: the family's query and key/value
    projections (default: LLaDA's :func:`project_q` / :func:`project_kv`; Dream adds biases); ``mlp``: its
    MLP block of the normed rows (default :func:`swiglu`; LLaDA-MoE's routed experts).
    """
    q_proj, kv_proj = q_proj or project_q, kv_proj or project_kv
    if keys is None:
        k, v = kv_proj(lp, h, cfg)
        if rotated_cache:
            k = (k_rope if write is None else q_rope).rotate(k)
        if write is not None:
            k, v = write(k, v)
        # (an int8 cache of un-rotated keys is dequantized before RoPE; rotated ones are read in the attention)
        keys = Keys(k, v, k if rotated_cache else k_rope.rotate(kv_quant.read(k)))
    q_rot = q_rope.rotate(q_proj(lp, h, cfg))
    att = attention(q_rot, keys.k_rot, keys.v, key_valid, return_probs=return_probs)
    a, probs = att if return_probs else (att, None)
    return LayerOut(finish_layer(lp, h, a, cfg, mlp), keys, q_rot, probs)


class CacheSlot(NamedTuple):
    """Every layer's K/V buffers (``buffers``: a pytree of [N, ...] arrays, the K/V cache [N, b, KV, L, hd])
    and the layer ``i`` a :func:`layer_scan` step is at.

    The buffers may be *shared by the rows* of a running batch's per-row program (a ``vmap`` over rows,
    :func:`polestar_jax.decode.block.decode_block`): not mapped, every row's entries on their batch axis
    (axis 1: the rows' own batches one after the other). Every read and write here takes the calling row's
    own entries (:func:`own_rows`, :func:`put_own`), so that inside the per-row loops the buffers keep their
    layer axis first; a mapped buffer has the rows axis first there, and a layer's slice is strided (copied
    before attention reads it). Outside a ``vmap`` (a fixed batch) these are the plain slices and updates."""

    buffers: Any
    i: jax.Array  # [] int32

    def layer(self) -> Any:
        """Layer ``i``'s buffers (each [...] without the layer axis)."""
        return jax.tree.map(lambda a: own_rows(lax.dynamic_index_in_dim(a, self.i, 0, keepdims=False)),
                            self.buffers)

    def put_layer(self, new: Any) -> "CacheSlot":
        """The slot with layer ``i``'s buffers replaced by ``new`` (whole)."""
        # (held row-major on a TPU: XLA:TPU laid the block start's int8 keys out sequence-minor, and the whole
        # stacked cache with them: a 2 GiB copy at LLaDA-8B's batch 32)
        return self._replace(buffers=jax.tree.map(
            lambda a, u: put_own(_put_layer, a, _row_major_int8(u.astype(a.dtype)), self.i), self.buffers,
            kv_quant.stored_like(self.buffers, new)))

    def rows(self, start: Any, t: int, axis: int) -> Any:
        """Entries ``[start, start + t)`` along ``axis`` (of a layer's buffer) of layer ``i``'s buffers."""
        return jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, start, t, axis=axis), self.layer())

    def put_rows(self, new: Any, start: Any, axis: int, keep: Optional[jax.Array] = None) -> "CacheSlot":
        """The slot with ``new`` (each [b, ..., T, ...], T along ``axis``; float rows, quantized here for an
        int8 buffer) written at ``[start, start + T)`` along ``axis`` of layer ``i``'s buffers where ``keep``
        (bool, broadcast to each buffer's rows, an int8 cache's [.., 1] scales included: [b, 1, T, 1] for the
        K/V; None: everywhere; the old entries elsewhere), in place: only the rows move (a whole-layer copy would move the layer's cache
        twice per layer). An int8 buffer of a fixed batch is written through whole tiles on a TPU
        (:func:`_put_rows_tiled`, where :func:`_tiled_write` says; equal values)."""
        new = kv_quant.stored_like(self.buffers, new)
        args = (self.buffers, new, self.i, jnp.asarray(start, jnp.int32), axis, keep)
        if _tiled_write(self.buffers, jax.tree.leaves(new)[0].shape[axis], args[3], axis):
            return self._replace(buffers=lax.platform_dependent(tpu=lambda: _put_tree_tiled(*args),
                                                                default=lambda: _put_tree(*args)))
        return self._replace(buffers=_put_tree(*args))

    def scatter_rows(self, new: Any, idx: jax.Array, valid: jax.Array, axis: int) -> "CacheSlot":
        """The slot with ``new``'s rows (each [b, ..., C, ...], C along ``axis``) written at positions ``idx``
        [b, C] along ``axis`` of layer ``i``'s buffers (each [b, ..., L, ...]) where ``valid``, in place
        (invalid or out-of-range positions are dropped: ``kernels.refresh.scatter_kv_rows_reference``'s
        rule): only the rows move, where a whole-layer copy would move the layer's cache twice."""
        return self._replace(buffers=jax.tree.map(lambda a, u: put_own(
            _scatter_rows, a, u.astype(a.dtype), self.i, idx, valid, axis=axis), self.buffers,
            kv_quant.stored_like(self.buffers, new)))


def _row_major_int8(u: jax.Array) -> jax.Array:
    """An int8 layer ``u`` [b, KV, L, hd] held row-major on a TPU (:func:`row_major_on_tpu`); others as they are."""
    return row_major_on_tpu(u) if u.dtype == jnp.int8 else u


def _put_layer(a, u, i, axis: int = 0):
    """Layer ``i`` of ``a`` [N, b, ...] replaced by ``u`` [b, ...]."""
    return lax.dynamic_update_index_in_dim(a, u, i, 0)


def _put_tree(buffers, new, i, start, axis: int, keep=None):
    """Every stacked buffer with its rows of ``new`` (stored form) written as :func:`_put_rows_kept` does."""
    return jax.tree.map(lambda a, u: _put_rows_kept(a, u, i, start, axis, keep), buffers, new)


def _put_tree_tiled(buffers, new, i, start, axis: int, keep=None):
    """:func:`_put_tree`, equal values, with the int8 buffers written through whole tiles
    (:func:`_put_rows_tiled`): a fixed batch's int8 write on a TPU."""
    return jax.tree.map(lambda a, u: _put_rows_tiled(a, u, i, start, axis, keep) if a.dtype == jnp.int8
                        else _put_rows_kept(a, u, i, start, axis, keep), buffers, new)


def _put_rows_kept(a, u, i, start, axis: int, keep=None):
    """``u`` (stored form) written at ``[start, start + T)`` along ``axis`` of layer ``i`` of ``a`` (the
    calling row's own entries of a shared buffer: :func:`put_own`) where ``keep``, the old rows elsewhere."""
    u = u.astype(a.dtype)
    if keep is not None:
        layer = own_rows(lax.dynamic_index_in_dim(a, i, 0, keepdims=False))
        u = jnp.where(keep, u, lax.dynamic_slice_in_dim(layer, start, u.shape[axis], axis))
    return put_own(_put_rows, a, u, i, start, axis=axis)


def _put_rows(a, u, i, start, axis: int):
    """``u`` [b, ..., T, ...] written at ``[start, start + T)`` along ``axis`` of layer ``i`` of ``a`` [N, b,
    ...]; a ``start`` per row ([b]: the rows of a shared buffer) makes it a row scatter."""
    if jnp.ndim(start) == 0:
        return _put_rows_slice(a, u, i, start, axis)
    pos = start[:, None] + jnp.arange(u.shape[axis], dtype=jnp.int32)
    return _scatter_rows(a, u, i, pos, jnp.ones(pos.shape, bool), axis)


def _put_rows_slice(a, u, i, start, axis: int):
    idx = [jnp.int32(0)] * a.ndim
    idx[0], idx[axis + 1] = i, start
    return lax.dynamic_update_slice(a, u[None], idx)


#: XLA:TPU tiles an int8 array by 32 positions of its second-minor axis (the K/V cache's sequence axis)
_INT8_TILE = 32


def _put_rows_tiled(a, u, i, start, axis: int, keep=None):
    """``u`` [b, ..., T, ...] written at ``[start, start + T)`` along ``axis`` of layer ``i`` of ``a`` [N, b,
    ...] where ``keep`` (broadcast to ``u``; None: everywhere), as a dynamic_update_slice would (its clamp of
    ``start``), for an int8 buffer on a TPU: the rows are merged into a window of whole tiles
    (:data:`_INT8_TILE` positions along ``axis``, read and written at a tile index), so no read or write lands
    at a position XLA cannot prove tile-aligned. Such reads and writes made XLA:TPU copy the whole stacked
    cache into (8, 128) tiles and back in every layer of every step (LLaDA-8B's Polestar program at batch 32 on
    one v5e chip: two 2 GiB copies among its temporaries, ``bench/tpu_proxy.py``)."""
    ax, c = axis + 1, _INT8_TILE
    s, t = a.shape[ax], u.shape[axis]
    n_w = min(-(-t // c) + 1, s // c)  # tiles in the window: room for t rows at any offset within a tile
    w = n_w * c
    start = jnp.clip(jnp.asarray(start, jnp.int32), 0, s - t)
    c0 = jnp.clip(start // c, 0, s // c - n_w)
    off = start - c0 * c  # in [0, w - t]
    tiled = a.reshape(a.shape[:ax] + (s // c, c) + a.shape[ax + 1:])
    at = [jnp.int32(0)] * tiled.ndim
    at[0], at[ax] = i, c0
    size = (1,) + tiled.shape[1:ax] + (n_w, c) + tiled.shape[ax + 2:]
    win = lax.dynamic_slice(tiled, at, size).reshape(size[:ax] + (w,) + size[ax + 2:])

    def place(x):  # x [1, ..., t, ...] -> [1, ..., w, ...], x's rows at [off, off + t), zeros elsewhere
        pad = [(0, 0)] * x.ndim
        pad[ax] = (w, w - t)
        return lax.dynamic_slice_in_dim(jnp.pad(x, pad), w - off, w, axis=ax)

    j = jnp.arange(w, dtype=jnp.int32) - off
    inside = ((j >= 0) & (j < t)).reshape([w if d == ax else 1 for d in range(win.ndim)])
    if keep is not None:
        inside = inside & place(jnp.broadcast_to(keep, u.shape)[None])
    new = jnp.where(inside, place(u[None].astype(a.dtype)), win).reshape(size)
    return lax.dynamic_update_slice(tiled, new, at).reshape(a.shape)


def _scatter_rows(a, u, i, idx, valid, axis: int):
    """``u``'s rows [b, ..., C, ...] written at positions ``idx`` [b, C] along ``axis`` of layer ``i`` of
    ``a`` [N, b, ..., L, ...] where ``valid`` (invalid or out-of-range positions dropped)."""
    length = a.shape[axis + 1]
    widx = jnp.where(valid & (idx >= 0), idx, length).astype(jnp.int32)
    at = (i, jnp.arange(a.shape[1])[:, None]) + (slice(None),) * (axis - 1) + (widx,)
    return a.at[at].set(jnp.moveaxis(u, axis, 1), mode="drop")


class _Chunk(NamedTuple):
    entries: jax.Array  # [n] int32: the shared buffers' entry of each row of the rows vmap (a batch of one)
    on: jax.Array  # [n] bool: the rows that take part (the others write nothing)
    total: int  # the shared buffers' batch size


_CHUNKS: list[_Chunk] = []


@contextlib.contextmanager
def chunk_entries(entries: jax.Array, on: jax.Array, total: int):
    """While a chunk of a running batch's rows is traced (the rows ``vmap`` over ``n`` of ``total`` rows,
    each with a batch of one: :func:`polestar_jax.decode.block.decode_block`'s compacted steps), the buffers
    the rows share ([N, total, ...], not mapped: the K/V cache) hold row ``r``'s entries at ``entries[r]``
    (``entries`` [n] distinct); a row that is not ``on`` ([n] or [n, 1] bool) writes nothing. The rows read
    their entries a row at a time and write them in place (:func:`own_rows`, :func:`put_own`): no copy of
    the chunk's cache, where gathering its rows copied every layer's cache of the chunk in and out."""
    on = jnp.reshape(on, (-1,))
    _CHUNKS.append(_Chunk(entries.astype(jnp.int32), on, total))
    try:
        yield
    finally:
        _CHUNKS.pop()


def _chunk() -> Optional[_Chunk]:
    return _CHUNKS[-1] if _CHUNKS and _rows_axis() is not None else None


def _gather_entries(a: jax.Array, entries: jax.Array) -> jax.Array:
    """``a[entries]`` [n, ...] a row at a time (dynamic slices: XLA:TPU lowers a gather of whole rows by
    copying the whole operand first)."""
    out = jnp.zeros((entries.shape[0],) + a.shape[1:], a.dtype)
    return lax.fori_loop(0, entries.shape[0], lambda j, o: lax.dynamic_update_index_in_dim(
        o, lax.dynamic_index_in_dim(a, entries[j], 0, keepdims=False), j, 0), out)


def _rows_axis() -> Optional[tuple[jax.Array, int]]:
    """(this row's index, the number of rows) of the rows ``vmap`` (:data:`polestar_jax.axes.ROWS`), or None
    outside it."""
    try:
        return lax.axis_index(ROWS), lax.axis_size(ROWS)
    except NameError:
        return None


def own_rows(a: jax.Array) -> jax.Array:
    """A layer's buffer [b, ...] as the calling row sees it: itself; under the rows ``vmap`` of a running
    batch (:data:`polestar_jax.axes.ROWS`) a buffer shared by the rows ([n * b, ...], not mapped) is split
    into the rows' own [b, ...] (a reshape: no data moves). See :class:`CacheSlot`."""
    rows = _rows_axis()
    chunk = _chunk()
    if chunk is not None:  # (a chunk of rows: a buffer of every row's entries is the shared one)
        return a if a.shape[0] != chunk.total else _own_entries(a, chunk.entries, rows[0])
    # (the block program's rows each hold a batch of one: a buffer of n entries is the rows' shared one)
    return a if rows is None or a.shape[0] != rows[1] else _own_rows(a, rows[0])


@jax.custom_batching.custom_vmap
def _own_entries(a, entries, row):
    return lax.dynamic_slice_in_dim(a, entries[row], 1, axis=0)


@_own_entries.def_vmap
def _own_entries_vmap(n, batched, a, entries, row):
    if batched[0] or batched[1]:  # (each row's own buffer or map: its own entry)
        return jax.vmap(lambda a, e, r: lax.dynamic_slice_in_dim(a, e[r], 1, axis=0),
                        in_axes=[0 if on else None for on in batched])(a, entries, row), True
    return _gather_entries(a, entries)[:, None], True


@jax.custom_batching.custom_vmap
def _own_rows(a, row):
    n = lax.axis_size(ROWS)  # (each row's value: its own entries; the vmap rule below gives them all at once)
    return lax.dynamic_index_in_dim(a.reshape((n, a.shape[0] // n) + a.shape[1:]), row, 0, keepdims=False)


@_own_rows.def_vmap
def _own_rows_vmap(n, batched, a, row):
    return (a if batched[0] else a.reshape((n, a.shape[0] // n) + a.shape[1:])), True


def _at_own(a: jax.Array, b: int, fn: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """``a`` [N, n * b, ...] shared by the rows with ``fn`` applied to the calling row's entries [N, b, ...]."""
    at = _rows_axis()[0] * b
    return lax.dynamic_update_slice_in_dim(a, fn(lax.dynamic_slice_in_dim(a, at, b, axis=1)), at, axis=1)


def put_own(write: Callable, a: jax.Array, u: jax.Array, i: jax.Array, *rows: jax.Array, axis: int = 0) -> jax.Array:
    """``write(a, u, i, *rows, axis=axis)``: ``a`` [N, b, ...] with the calling row's entries at layer ``i``
    written from ``u`` [b, ...] (``rows``: per-row arguments, [] or with a leading [b] axis). Under the rows
    ``vmap`` of a running batch a buffer shared by the rows ([N, n * b, ...], not mapped) takes every row's
    entries in one write and stays shared (the rows' arguments folded into its batch axis; a per-row scalar
    becomes one per entry). See :class:`CacheSlot`."""
    if not _shared(a, u.shape[0]):
        return write(a, u, i, *rows, axis=axis)
    chunk = _chunk()
    if chunk is not None:
        return _put_entries(write, axis)(a, u, i, chunk.entries, chunk.on, _rows_axis()[0], *rows)
    return _put_own(write, axis)(a, u, i, *rows)


def _shared(a: jax.Array, b: int) -> bool:
    """Whether ``a`` [N, B, ...] may be a buffer shared by the rows of the rows ``vmap``, each with a batch of
    ``b`` (with one row, whether it is or not is for the ``vmap`` rule to see)."""
    rows = _rows_axis()
    chunk = _chunk()
    if chunk is not None:
        return a.shape[1] == chunk.total
    return rows is not None and a.shape[1] == rows[1] * b


@functools.lru_cache(maxsize=None)
def _put_own(write: Callable, axis: int):
    plain = functools.partial(write, axis=axis)

    @jax.custom_batching.custom_vmap
    def put(a, u, i, *rows):  # (each row's value: its own entries written; the rule below writes them all)
        return _at_own(a, u.shape[0], lambda sub: plain(sub, u, i, *rows))

    @put.def_vmap
    def rule(n, batched, a, u, i, *rows):
        if batched[0] or batched[2]:  # a buffer of each row's own (or a layer per row): each row writes its own
            return jax.vmap(plain, in_axes=[0 if on else None for on in batched])(a, u, i, *rows), True
        lead = a.shape[1] // n  # each row's entries

        def fold(x, on):
            if not on:
                if jnp.ndim(x) == 0:  # the same for every row
                    return x
                x = jnp.broadcast_to(x, (n,) + jnp.shape(x))
            return jnp.repeat(x, lead) if x.ndim == 1 else x.reshape((n * x.shape[1],) + x.shape[2:])

        uf, rf = fold(u, batched[1]), [fold(x, on) for x, on in zip(rows, batched[3:])]
        if write is _put_layer or (write is _put_rows and jnp.ndim(rf[0]) == 0):  # (one slice update)
            return plain(a, uf, i, *rf), False
        return lax.platform_dependent(a, uf, i, *rf, tpu=functools.partial(_entry_by_entry, write, axis),
                                      default=plain), False

    return put


def _entry_by_entry(write: Callable, axis: int, a, u, i, *rows):
    """``write(a, u, i, *rows, axis=axis)`` of rows ``u`` [B, ...] at a per-entry position (``rows``: each
    with a leading [B] axis) into ``a`` [N, B, ...], an entry at a time in place (:func:`_row_update`): a
    TPU's form. A row scatter into the stacked buffer makes XLA:TPU copy the whole buffer into another layout
    and back around it (for the K/V cache: the sequence axis before the KV heads)."""
    one = _ROW_WRITES[write]
    return lax.fori_loop(0, u.shape[0], lambda e, a: one(
        a, lax.dynamic_slice_in_dim(u, e, 1), i, e, True, *[x[e] for x in rows], axis=axis), a)


@functools.lru_cache(maxsize=None)
def _put_entries(write: Callable, axis: int):
    """:func:`_put_own` for a chunk of rows (:func:`chunk_entries`): each row's entry written in place, a row
    at a time (a scatter over the rows would make XLA:TPU copy the whole buffer into another layout)."""
    one = _ROW_WRITES[write]

    @jax.custom_batching.custom_vmap
    def put(a, u, i, entries, on, row, *rows):  # (each row's value: its own entry written; the rule: all)
        return one(a, u, i, entries[row], on[row], *rows, axis=axis)

    @put.def_vmap
    def rule(n, batched, a, u, i, entries, on, row, *rows):
        if batched[0] or batched[2] or batched[3] or batched[4]:
            raise NotImplementedError("a chunk's shared buffer, layer and entries are the same for every row")
        us = u if batched[1] else jnp.broadcast_to(u, (n,) + u.shape)
        per = [x if b else None for x, b in zip(rows, batched[6:])]

        def body(r, a):
            args = [x if p is None else p[r] for x, p in zip(rows, per)]
            return one(a, us[r], i, entries[r], on[r], *args, axis=axis)

        return lax.fori_loop(0, n, body, a), False

    return put


def _row_update(a, i, entry, fn, axis: int = 0, at=None, length: Optional[int] = None):
    """``a`` [N, B, ...] with the window of layer ``i``, entry ``entry`` ([1, 1, ...]: the entry's whole layer,
    or ``length`` positions from ``at`` along ``axis`` of a layer's buffer) replaced by ``fn(window)``, in place."""
    start = [jnp.int32(0)] * a.ndim
    start[0], start[1] = i, entry
    size = [1, 1] + list(a.shape[2:])
    if at is not None:
        start[axis + 1], size[axis + 1] = jnp.reshape(at, ()), length
    return lax.dynamic_update_slice(a, fn(lax.dynamic_slice(a, start, size)), start)


def _row_put_layer(a, u, i, entry, on, axis: int = 0):
    return _row_update(a, i, entry, lambda cur: jnp.where(on, u[None].astype(a.dtype), cur))


def _row_put_rows(a, u, i, entry, on, start, axis: int):
    return _row_update(a, i, entry, lambda cur: jnp.where(on, u[None].astype(a.dtype), cur), axis, start,
                       u.shape[axis])


def _row_scatter_rows(a, u, i, entry, on, idx, valid, axis: int):
    return _row_update(a, i, entry, lambda cur: _scatter_rows(cur, u, 0, jnp.reshape(idx, (1, -1)),
                                                              jnp.reshape(valid, (1, -1)) & on, axis))


#: each write of :class:`CacheSlot` for one row's entry of a chunk's shared buffer (:func:`_put_entries`):
#: ``(a, u [b=1, ...], i, entry, on, *the write's per-row arguments, axis=)``
_ROW_WRITES = {_put_layer: _row_put_layer, _put_rows: _row_put_rows, _scatter_rows: _row_scatter_rows}


def where_own(pred: jax.Array, new: jax.Array, old: jax.Array) -> jax.Array:
    """Per batch row of stacked buffers ``new`` / ``old`` [N, b, ...]: ``new`` where ``pred`` [b], else ``old``;
    under the rows ``vmap`` of a running batch, buffers shared by the rows stay shared (see :class:`CacheSlot`;
    not for a chunk's rows, :func:`chunk_entries`, which write only through :func:`put_own`)."""
    if _chunk() is not None:
        raise NotImplementedError("where_own on a chunk's shared buffers: write them through put_own")
    return _where_own(pred, new, old) if _shared(new, pred.shape[0]) else _where_rows(pred, new, old)


def _where_rows(pred, new, old):
    return jnp.where(pred.reshape((1, -1) + (1,) * (new.ndim - 2)), new, old)


@jax.custom_batching.custom_vmap
def _where_own(pred, new, old):
    return _at_own(old, pred.shape[0], lambda sub: _where_rows(
        pred, lax.dynamic_slice_in_dim(new, _rows_axis()[0] * pred.shape[0], pred.shape[0], axis=1), sub))


@_where_own.def_vmap
def _where_own_vmap(n, batched, pred, new, old):
    if batched[1] or batched[2]:  # buffers of each row's own
        return jax.vmap(_where_rows, in_axes=[0 if on else None for on in batched])(pred, new, old), True
    flat = (pred if batched[0] else jnp.broadcast_to(pred, (n,) + pred.shape)).reshape(-1)
    return _where_rows(flat, new, old), False


class SlotWrite:
    """A :func:`layer` ``write`` into a :class:`CacheSlot` (see :func:`slice_write`); after the layer called it,
    ``slot`` is the slot with the rows written (what a :func:`layer_scan` body returns)."""

    def __init__(self, slot: CacheSlot, start: Any, mask: Optional[jax.Array]):
        self.slot, self.start, self.mask = slot, start, mask

    def __call__(self, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        keep = None if self.mask is None else self.mask[:, None, :, None]
        self.slot = self.slot.put_rows((k, v), self.start, axis=2, keep=keep)
        return self.slot.layer()


def _tiled_write(buffers: Any, t: int, start: Any, axis: int) -> bool:
    """Whether a write of ``t`` rows at ``start`` along ``axis`` (of a layer) into the stacked ``buffers``
    goes through whole tiles on a TPU (:func:`_put_rows_tiled`): int8 buffers whose second-minor axis is
    ``axis`` and holds whole tiles, a fixed batch (not the rows ``vmap`` of a running batch, whose writes go
    entry by entry), one start for every row."""
    q = [a for a in jax.tree.leaves(buffers) if a.dtype == jnp.int8]
    return (bool(q) and _rows_axis() is None and jnp.ndim(start) == 0
            and all(a.ndim - 2 == axis + 1 and a.shape[axis + 1] % _INT8_TILE == 0 and t <= a.shape[axis + 1]
                    for a in q))


def slice_write(cache: Any, start: Any, mask: Optional[jax.Array] = None):
    """A :func:`layer` ``write`` that puts the rows' K/V at ``[start, start + T)`` of ``cache`` (K, V)
    [b, KV, L, hd] (Fast-dLLM's ``replace_position``); where ``mask`` [b, T] is False the cached entry is
    kept. ``cache`` a :class:`CacheSlot` (inside :func:`layer_scan`): the rows are written into the stacked
    buffers in place and the writer's ``slot`` holds them (a :class:`SlotWrite`)."""
    if isinstance(cache, CacheSlot):
        return SlotWrite(cache, start, mask)

    def write(k, v):
        if mask is not None:
            t, w = k.shape[2], mask[:, None, :, None]
            k = jnp.where(w, k, lax.dynamic_slice_in_dim(cache[0], start, t, axis=2))
            v = jnp.where(w, v, lax.dynamic_slice_in_dim(cache[1], start, t, axis=2))
        return (lax.dynamic_update_slice_in_dim(cache[0], k, start, axis=2),
                lax.dynamic_update_slice_in_dim(cache[1], v, start, axis=2))

    return write


def embed(params: Params, ids: jax.Array) -> jax.Array:
    """Token embeddings: ids [b, T] int -> [b, T, D] (no scaling)."""
    return take_rows(params["wte"], ids)


def lm_head(params: Params, h: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final RMSNorm and untied head: [b, T, D] -> float32 logits [b, T, V]."""
    hn = rms_norm(h, params["ln_f"], cfg.rms_norm_eps)
    return _head(hn, params["lm_head"])


def layer_scan(body: Callable, carry: Any, xs: Any, buffers: Any, unroll: int | bool = 1):
    """``lax.scan`` over the layers (the leading axis of ``xs`` and of every ``buffers`` leaf, [N, ...]),
    where ``buffers`` (the K/V cache) ride in the carry and are updated in place:
    ``body(carry, x, slot) -> (carry, y, new)`` with ``slot`` a :class:`CacheSlot` (the buffers and the
    layer index) and ``new`` either the slot with its writes (:meth:`CacheSlot.put_rows`, a
    :class:`SlotWrite`'s ``slot``: only the written rows move) or the layer's new buffers (replaced whole).
    Returns ``(carry, ys, buffers)``.

    Passed as scan inputs and outputs instead, a vmap over rows (a running batch's per-row program,
    :func:`polestar_jax.decode.block.decode_block`) would move the cache's batch axis to 1 for the scan and back
    to 0 for the enclosing loops and branches: two transposes of the whole cache per forward. In the carry
    its batch axis stays where the loops keep it, and the cache is updated in place."""

    def step(c, x):
        inner, bufs, i = c
        slot = CacheSlot(bufs, i)
        inner, y, new = body(inner, x, slot)
        bufs = (new if isinstance(new, CacheSlot) else slot.put_layer(new)).buffers
        return (inner, bufs, i + 1), y

    (carry, buffers, _), ys = lax.scan(step, (carry, buffers, jnp.int32(0)), xs, unroll=unroll)
    return carry, ys, buffers


class ForwardOut(NamedTuple):
    """Output of :func:`forward`."""

    h: jax.Array  # [b, T, D] last layer output (before ln_f)
    kv: tuple[jax.Array, jax.Array]  # every layer's K/V after the write: [N, b, KV, L, hd] each
    hidden: Optional[jax.Array]  # [N, b, T, D] the input of every layer (when collect_hidden)


def forward(
    params: Params,
    ids: jax.Array,
    cfg: ModelConfig,
    q_pos: jax.Array,
    key_pos: jax.Array,
    key_valid: Optional[jax.Array] = None,
    cache: Optional[tuple[jax.Array, jax.Array]] = None,
    start: Any = 0,
    write: Optional[jax.Array] = None,
    collect_hidden: bool = False,
    unroll: int | bool = 1,
    *,
    rotated_cache: bool = False,
    layer_fn: Optional[Callable[..., LayerOut]] = None,
    into: Optional[tuple[jax.Array, jax.Array]] = None,
    embeds: Optional[jax.Array] = None,
) -> ForwardOut:
    """All layers (under ``lax.scan``, ``unroll`` as there; ``layer_fn``: the family's :func:`layer`) for the query tokens ``ids`` [b, T] at RoPE
    positions ``q_pos`` [b, T].

    ``key_pos`` [b, L]: RoPE positions of all keys; ``key_valid`` [b, L]: False for padding.
    ``cache``: stacked (K, V) [N, b, KV, L, hd] or None (then T == L and the keys are the queries' own).
    ``start``/``write``: where the rows' K/V go in the cache (see :func:`slice_write`).
    ``into``: without a ``cache``, buffers (K, V) [N, b, KV, L, hd] that take every layer's K/V (the
    state's cache: a full pass overwrites it in place); the returned ``kv`` is them.
    ``embeds``: the input rows [b, T, D] themselves instead of ``embed(params, ids)`` (LLaDA-V's spliced
    prompt rows; ``ids`` is then not read).
    ``rotated_cache``: ``cache`` holds rotated keys, and so do the returned ``kv`` (:func:`layer`).
    """
    q_rope, k_rope = Rope.at(q_pos, cfg), Rope.at(key_pos, cfg)
    h0 = embed(params, ids) if embeds is None else embeds

    def body(h, lp, slot):
        w = None if cache is None else slice_write(slot, start, write)
        out = (layer_fn or layer)(lp, h, cfg, q_rope, k_rope, key_valid, write=w, rotated_cache=rotated_cache)
        return out.h, (h if collect_hidden else None), (w.slot if w is not None else (out.keys.k, out.keys.v))

    buffers = cache if cache is not None else into
    if buffers is None:  # a plain forward: the K/V are the scan's outputs
        h, (kv, hidden) = lax.scan(lambda c, lp: (lambda o: (o[0], (o[2], o[1])))(body(c, lp, None)), h0,
                                   params["blocks"], unroll=unroll)
        return ForwardOut(h, kv, hidden)
    h, hidden, kv = layer_scan(body, h0, params["blocks"], buffers, unroll=unroll)
    return ForwardOut(h, kv, hidden)


def logits_full(params: Params, ids: jax.Array, cfg: ModelConfig,
                key_valid: Optional[jax.Array] = None) -> jax.Array:
    """Logits of a plain forward over the whole input ``ids`` [b, L] (positions 0..L-1): [b, L, V] float32."""
    b, length = ids.shape
    pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    out = forward(params, ids, cfg, pos, pos, key_valid)
    return lm_head(params, out.h, cfg)


def hidden_states(params: Params, ids: jax.Array, cfg: ModelConfig) -> jax.Array:
    """[N+1, b, L, D]: the input of every layer (0 = embeddings) and, last, the output of ``ln_f``."""
    b, length = ids.shape
    pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    out = forward(params, ids, cfg, pos, pos, None, collect_hidden=True)
    final = rms_norm(out.h, params["ln_f"], cfg.rms_norm_eps)
    return jnp.concatenate([out.hidden, final[None]], axis=0)


def init_params(cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.float32, std: float = 0.02) -> Params:
    """Random parameters in the layout above (for benchmarks and tests; not a trained model)."""
    d, n, f, v = cfg.d_model, cfg.n_layers, cfg.mlp_hidden_size, cfg.embedding_size
    hq, hk = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    ks = jax.random.split(key, 9)

    def nrm(k, shape, s=std):
        return (s * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

    return {
        "wte": nrm(ks[0], (v, d), 1.0),
        "blocks": {
            "attn_norm": jnp.ones((n, d), dtype), "ff_norm": jnp.ones((n, d), dtype),
            "wq": nrm(ks[1], (n, d, hq)), "wk": nrm(ks[2], (n, d, hk)), "wv": nrm(ks[3], (n, d, hk)),
            "wo": nrm(ks[4], (n, hq, d)), "w_gate": nrm(ks[5], (n, d, f)), "w_up": nrm(ks[6], (n, d, f)),
            "w_down": nrm(ks[7], (n, f, d)),
        },
        "ln_f": jnp.ones((d,), dtype),
        "lm_head": nrm(ks[8], (d, v)),
    }
