"""The Dream transformer (Qwen2 layout) as pure functions over a parameter pytree.

Dream-7B is a Qwen2 model trained as a diffusion LM. Per layer, pre-norm as LLaDA:

    x = embed[ids]
    for each layer:  x = x + Wo Attn(RoPE(Wq h + bq), RoPE(Wk h + bk), Wv h + bv),  h = RMSNorm(x)
                     x = x + down(silu(gate(RMSNorm(x))) * up(RMSNorm(x)))
    logits = RMSNorm(x) @ lm_head                      (untied)

Differences from :mod:`polestar_jax.model` (LLaDA): q/k/v carry biases (nothing else does), grouped KV heads
(``num_key_value_heads``; KV head ``j`` serves query heads ``j*G .. j*G+G-1``, as :func:`model.attention`
groups them), RMSNorm eps and RoPE theta from the config. RMSNorm (float32, cast back, then the weight),
rotate-half RoPE in float32, float32 attention softmax and the SwiGLU MLP are LLaDA's functions. The K/V
cache holds the un-rotated keys *with* their bias, ``[N, b, KV, L, hd]`` (the KV heads, not expanded).

The logit alignment (Dream predicts position ``p`` from row ``p-1`` of a forward's input span, the span's
first row used twice) is not part of the model: the family declares it (``Family.logit_shift = 1``) and
:meth:`polestar_jax.family.Family.head_at` applies it for every decoder.

Parameters: the LLaDA pytree (:mod:`polestar_jax.checkpoint`) plus ``blocks/bq`` [N, H*hd], ``blocks/bk`` and
``blocks/bv`` [N, KV*hd]; the HF Qwen2 tensor names map onto it in ``checkpoint._QWEN2_BLOCK_TENSORS``.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax

from polestar_jax import model as M
from polestar_jax.config import ModelConfig

embed = M.embed
lm_head = M.lm_head
Rope, Keys, LayerOut, ForwardOut = M.Rope, M.Keys, M.LayerOut, M.ForwardOut


def project_q(lp: M.LayerParams, h: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Input norm and biased query projection of rows ``h`` [b, T, D]: q [b, H, T, hd] (un-rotated)."""
    xn = M.rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps)
    return M._split_heads(xn @ lp["wq"] + lp["bq"], cfg.n_heads)


def project_kv(lp: M.LayerParams, h: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Biased key / value projections: k, v [b, KV, T, hd] (un-rotated, what the cache stores)."""
    xn = M.rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps)
    return (M._split_heads(xn @ lp["wk"] + lp["bk"], cfg.n_kv_heads),
            M._split_heads(xn @ lp["wv"] + lp["bv"], cfg.n_kv_heads))


def layer(
    lp: M.LayerParams,
    h: jax.Array,
    cfg: ModelConfig,
    q_rope: M.Rope,
    k_rope: M.Rope,
    key_valid: Optional[jax.Array],
    write: Optional[Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]] = None,
    keys: Optional[M.Keys] = None,
    return_probs: bool = False,
) -> M.LayerOut:
    """One Dream layer; the signature and contract of :func:`polestar_jax.model.layer` (keys given, or
    projected from ``h`` and placed by ``write``; attention over all L keys; output projection and MLP)."""
    if keys is None:
        k, v = project_kv(lp, h, cfg)
        if write is not None:
            k, v = write(k, v)
        keys = M.Keys(k, v, k_rope.rotate(k))
    q_rot = q_rope.rotate(project_q(lp, h, cfg))
    att = M.attention(q_rot, keys.k_rot, keys.v, key_valid, return_probs=return_probs)
    a, probs = att if return_probs else (att, None)
    return M.LayerOut(M.finish_layer(lp, h, a, cfg), keys, q_rot, probs)


def forward(
    params: M.Params,
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
) -> M.ForwardOut:
    """All layers; the signature and contract of :func:`polestar_jax.model.forward`."""
    q_rope, k_rope = M.Rope.at(q_pos, cfg), M.Rope.at(key_pos, cfg)

    def body(h, xs):
        lp, layer_cache = xs
        w = None if layer_cache is None else M.slice_write(layer_cache, start, write)
        out = layer(lp, h, cfg, q_rope, k_rope, key_valid, write=w)
        return out.h, ((out.keys.k, out.keys.v), h if collect_hidden else None)

    h, (kv, hidden) = lax.scan(body, embed(params, ids), (params["blocks"], cache), unroll=unroll)
    return M.ForwardOut(h, kv, hidden)


def init_params(cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.float32, std: float = 0.02) -> M.Params:
    """Random Dream parameters: LLaDA's random layout plus random q/k/v biases (tests, benchmarks)."""
    params = M.init_params(cfg, key, dtype, std)
    n, hq, hk = cfg.n_layers, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    kb = jax.random.split(jax.random.fold_in(key, 1), 3)
    bias = lambda k, w: (std * jax.random.normal(k, (n, w), jnp.float32)).astype(dtype)
    params["blocks"].update(bq=bias(kb[0], hq), bk=bias(kb[1], hk), bv=bias(kb[2], hk))
    return params
