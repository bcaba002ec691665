"""Representation drift: the one signal Polestar uses twice.

* **Token drift** (Polestar-Commit): KL(P_t || P_prev) of the last layer's attention rows of the block
  tokens between consecutive forwards, probabilities clamped at 1e-12, clamped at 0 per head, averaged
  over heads.
* **Cluster drift** (Polestar-Cache): centroids act as proxy queries (attention-normed, projected by W_q,
  *no* RoPE) against the layer's *un-rotated* cached keys; KL(S || S_prev) with ``+1e-12`` inside the logs,
  clamped at 0 per head, averaged over heads. ``S_prev`` is the proxy attention of the last refresh (or of
  the block-start pass).

The decode step computes both KLs with the fused :func:`polestar_jax.kernels.kl_drift.kl_drift` (its
``kl_drift_reference`` is the same math in plain jnp); the block-start pass stores the proxy attention of
:func:`proxy_attention` as the first ``S_prev``. See ``docs/algorithm.md#token-drift`` and
``#cluster-drift``.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from polestar_jax.models.llada import LayerParams
from polestar_jax.config import ModelConfig

_NEG = -1e30


def proxy_queries(lp: LayerParams, centroids: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Centroids as proxy queries: attention-normed and projected by W_q, no RoPE.
    centroids [b, K, D] -> [b, H, K, hd]."""
    from polestar_jax.models.family import family_of

    return family_of(cfg).project_q(lp, centroids, cfg)


def proxy_inputs(lp: LayerParams, centroids: jax.Array, k_unrot: jax.Array, cfg: ModelConfig,
                 mode: str = "heads") -> tuple[jax.Array, jax.Array]:
    """The queries [b, H', K, hd] and keys [b, KV', L, hd] of the cluster proxy attention:
    ``mode="heads"`` (LLaDA) the projected centroids and the cached keys per head (H' = H, KV' = KV);
    ``"mean"`` (Dream) the queries averaged over the H heads and the keys over the KV heads (H' = KV' = 1),
    so one softmax per cluster."""
    q = proxy_queries(lp, centroids, cfg)
    if mode == "mean":
        return (jnp.mean(q.astype(jnp.float32), axis=1, keepdims=True).astype(q.dtype),
                jnp.mean(k_unrot.astype(jnp.float32), axis=1, keepdims=True).astype(k_unrot.dtype))
    return q, k_unrot


def proxy_attention(lp: LayerParams, centroids: jax.Array, k_unrot: jax.Array, cfg: ModelConfig,
                    key_valid: Optional[jax.Array], mode: str = "heads") -> jax.Array:
    """Attention of the centroids as queries against all cached keys.

    centroids [b, K, D]; k_unrot [b, KV, L, hd] (keys before RoPE); key_valid [b, L].
    Returns S [b, H', K, L] float32 (H' = H, or 1 for ``mode="mean"``: :func:`proxy_inputs`).
    """
    b, k, _ = centroids.shape
    q, k_unrot = proxy_inputs(lp, centroids, k_unrot, cfg, mode)
    kv, h = k_unrot.shape[1], q.shape[1]
    qg = q.reshape(b, kv, h // kv, k, cfg.head_dim)
    s = jnp.einsum("bkgtd,bkld->bkgtl", qg, k_unrot, preferred_element_type=jnp.float32)
    s = s / jnp.sqrt(jnp.float32(cfg.head_dim))
    if key_valid is not None:
        s = jnp.where(key_valid[:, None, None, None, :], s, _NEG)
    return jax.nn.softmax(s, axis=-1).reshape(b, h, k, -1)


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
