"""The Dream transformer (Qwen2 layout) as pure functions over a parameter pytree.

Dream-7B is a Qwen2 model trained as a diffusion LM. Per layer, pre-norm as LLaDA:

    x = embed[ids]
    for each layer:  x = x + Wo Attn(RoPE(Wq h + bq), RoPE(Wk h + bk), Wv h + bv),  h = RMSNorm(x)
                     x = x + down(silu(gate(RMSNorm(x))) * up(RMSNorm(x)))
    logits = RMSNorm(x) @ lm_head                      (untied)

Differences from :mod:`polestar_jax.models.llada` (LLaDA): q/k/v carry biases (nothing else does), grouped KV heads
(``num_key_value_heads``; KV head ``j`` serves query heads ``j*G .. j*G+G-1``, as :func:`llada.attention`
groups them), RMSNorm eps and RoPE theta from the config. RMSNorm (float32, cast back, then the weight),
rotate-half RoPE in float32, float32 attention softmax and the SwiGLU MLP are LLaDA's functions. The K/V
cache holds the un-rotated keys *with* their bias, ``[N, b, KV, L, hd]`` (the KV heads, not expanded).

The logit alignment (Dream predicts position ``p`` from row ``p-1`` of a forward's input span, the span's
first row used twice) is not part of the model: the family declares it (``Family.logit_shift = 1``) and
:meth:`polestar_jax.models.family.Family.head_at` applies it for every decoder.

Parameters: the LLaDA pytree (:mod:`polestar_jax.io.checkpoint`) plus ``blocks/bq`` [N, H*hd], ``blocks/bk`` and
``blocks/bv`` [N, KV*hd]; the HF Qwen2 tensor names map onto it in ``checkpoint._QWEN2_BLOCK_TENSORS``.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from polestar_jax.models import llada
from polestar_jax.config import ModelConfig

embed = llada.embed
lm_head = llada.lm_head
Rope, Keys, LayerOut, ForwardOut = llada.Rope, llada.Keys, llada.LayerOut, llada.ForwardOut


def project_q(lp: llada.LayerParams, h: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Input norm and biased query projection of rows ``h`` [b, T, D]: q [b, H, T, hd] (un-rotated)."""
    xn = llada.rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps)
    return llada.split_heads(llada.mm(xn, lp["wq"]) + lp["bq"], cfg.n_heads)


def project_kv(lp: llada.LayerParams, h: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Biased key / value projections: k, v [b, KV, T, hd] (un-rotated, what the cache stores)."""
    xn = llada.rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps)
    return (llada.split_heads(llada.mm(xn, lp["wk"]) + lp["bk"], cfg.n_kv_heads),
            llada.split_heads(llada.mm(xn, lp["wv"]) + lp["bv"], cfg.n_kv_heads))


#: One Dream layer: :func:`polestar_jax.models.llada.layer` with Dream's biased projections (same signature).
layer = functools.partial(llada.layer, q_proj=project_q, kv_proj=project_kv)
#: All layers: :func:`polestar_jax.models.llada.forward` over :data:`layer` (same signature).
forward = functools.partial(llada.forward, layer_fn=layer)


def init_params(cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.float32, std: float = 0.02) -> llada.Params:
    """Random Dream parameters: LLaDA's random layout plus random q/k/v biases (tests, benchmarks)."""
    params = llada.init_params(cfg, key, dtype, std)
    n, hq, hk = cfg.n_layers, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    kb = jax.random.split(jax.random.fold_in(key, 1), 3)
    bias = lambda k, w: (std * jax.random.normal(k, (n, w), jnp.float32)).astype(dtype)
    params["blocks"].update(bq=bias(kb[0], hq), bk=bias(kb[1], hk), bv=bias(kb[2], hk))
    return params
