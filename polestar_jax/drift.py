"""Representation drift: the one signal Polestar uses twice.

* **Token drift** (Polestar-Commit): KL(P_t || P_prev) of the last layer's attention rows of the block
  tokens between consecutive forwards, probabilities clamped at 1e-12, clamped at 0 per head, averaged
  over heads.
* **Cluster drift** (Polestar-Cache): centroids act as proxy queries (attention-normed, projected by W_q,
  *no* RoPE) against the layer's *un-rotated* cached keys; KL(S || S_prev) with ``+1e-12`` inside the logs,
  clamped at 0 per head, averaged over heads. ``S_prev`` is the proxy attention of the last refresh (or of
  the block-start pass).

The decode step calls the fused :func:`polestar_jax.kernels.kl_drift.kl_drift`; these functions are the same
math on materialised probabilities (the block-start pass and tests use them).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from polestar_jax import model as M
from polestar_jax.config import ModelConfig
from polestar_jax.kernels.kl_drift import kl_terms

_NEG = -1e30


def _head_mean_kl(p: jax.Array, pp: jax.Array, mode: str) -> jax.Array:
    kl = jnp.sum(kl_terms(p.astype(jnp.float32), pp.astype(jnp.float32), mode), axis=-1)
    return jnp.mean(jnp.maximum(kl, 0.0), axis=1)


def token_drift(p_t: jax.Array, p_prev: jax.Array) -> jax.Array:
    """p_t, p_prev: [b, H, T, L] attention probabilities -> drift [b, T] (float32)."""
    return _head_mean_kl(p_t, p_prev, "token")


def proxy_queries(lp: M.LayerParams, centroids: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Centroids as proxy queries: attention-normed and projected by W_q, no RoPE.
    centroids [b, K, D] -> [b, H, K, hd]."""
    xn = M.rms_norm(centroids, lp["attn_norm"], cfg.rms_norm_eps)
    b, k, _ = centroids.shape
    return (xn @ lp["wq"]).reshape(b, k, cfg.n_heads, cfg.head_dim).transpose(0, 2, 1, 3)


def proxy_attention(lp: M.LayerParams, centroids: jax.Array, k_unrot: jax.Array, cfg: ModelConfig,
                    key_valid: Optional[jax.Array]) -> jax.Array:
    """Attention of the centroids as queries against all cached keys.

    centroids [b, K, D]; k_unrot [b, KV, L, hd] (keys before RoPE); key_valid [b, L].
    Returns S [b, H, K, L] float32.
    """
    b, k, _ = centroids.shape
    q = proxy_queries(lp, centroids, cfg)
    kv = k_unrot.shape[1]
    qg = q.reshape(b, kv, cfg.n_heads // kv, k, cfg.head_dim)
    s = jnp.einsum("bkgtd,bkld->bkgtl", qg, k_unrot, preferred_element_type=jnp.float32)
    s = s / jnp.sqrt(jnp.float32(cfg.head_dim))
    if key_valid is not None:
        s = jnp.where(key_valid[:, None, None, None, :], s, _NEG)
    return jax.nn.softmax(s, axis=-1).reshape(b, cfg.n_heads, k, -1)


def cluster_drift(s: jax.Array, s_prev: jax.Array) -> jax.Array:
    """s, s_prev: [b, H, K, L] -> per-cluster drift [b, K] (float32)."""
    return _head_mean_kl(s, s_prev, "cluster")


def drift_delta(d: jax.Array, hist: jax.Array, fill: jax.Array) -> jax.Array:
    """Rise of the token drift over its recent history.

    d [b, T]; hist [b, n, T] (the last ``fill`` entries valid, oldest first); fill [b].
    Returns ``d - mean(valid history)`` or ``d`` when the history is empty.
    """
    n = hist.shape[1]
    valid = (jnp.arange(n)[None, :] >= n - fill[:, None])[..., None]
    mean = jnp.sum(jnp.where(valid, hist, 0.0), axis=1) / jnp.maximum(fill, 1)[:, None].astype(jnp.float32)
    return jnp.where(fill[:, None] > 0, d - mean, d)


def push_history(hist: jax.Array, fill: jax.Array, d: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Appends d [b, T] to the history [b, n, T] (dropping the oldest when full)."""
    hist = jnp.concatenate([hist[:, 1:], d[:, None].astype(hist.dtype)], axis=1)
    return hist, jnp.minimum(fill + 1, hist.shape[1])
