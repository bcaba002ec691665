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

from typing import Any, Optional

import jax
import jax.numpy as jnp

from polestar_jax.kernels.backend import dispatch
from polestar_jax.kernels.kl_drift import kl_drift, kl_drift_pallas, kl_terms
from polestar_jax.models import kv_quant
from polestar_jax.models.llada import LayerParams, attention_scores
from polestar_jax.config import ModelConfig


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
    if mode == "mean":  # (an int8 cache's keys: the head mean of the dequantized ones; scales differ per head)
        k_unrot = kv_quant.read(k_unrot)
        return (jnp.mean(q.astype(jnp.float32), axis=1, keepdims=True).astype(q.dtype),
                jnp.mean(k_unrot.astype(jnp.float32), axis=1, keepdims=True).astype(k_unrot.dtype))
    return q, k_unrot


def proxy_attention(lp: LayerParams, centroids: jax.Array, k_unrot: jax.Array, cfg: ModelConfig,
                    key_valid: Optional[jax.Array], mode: str = "heads") -> jax.Array:
    """Attention of the centroids as queries against all cached keys.

    centroids [b, K, D]; k_unrot [b, KV, L, hd] (keys before RoPE; an int8 cache's layer is read in the
    scores, :func:`polestar_jax.models.llada.attention_scores`); key_valid [b, L].
    Returns S [b, H', K, L] float32 (H' = H, or 1 for ``mode="mean"``: :func:`proxy_inputs`).
    """
    q, k_unrot = proxy_inputs(lp, centroids, k_unrot, cfg, mode)
    return proxy_probs(q, k_unrot, key_valid)


def proxy_probs(q: jax.Array, k: Any, key_valid: Optional[jax.Array]) -> jax.Array:
    """The softmax of :func:`~polestar_jax.models.llada.attention_scores`: [b, H, T, L] float32."""
    b, h, t, _ = q.shape
    return jax.nn.softmax(attention_scores(q, k, key_valid), axis=-1).reshape(b, h, t, -1)


def cluster_drift(q: jax.Array, k: Any, key_valid: Optional[jax.Array], s_prev: jax.Array,
                  backend: str) -> tuple[jax.Array, jax.Array]:
    """The cluster drift of the proxy queries ``q`` [b, H', K, hd] against the layer's un-rotated keys ``k``:
    :func:`polestar_jax.kernels.kl_drift.kl_drift` (``mode="cluster"``), whose keys may be an int8 cache's
    layer. Then the jnp path reads the int8 values in the scores (a key's scale factors out of its dot), and
    a kernel takes the layer's keys dequantized (one layer, its float operand). Returns (drift [b, K], the
    proxy attention [b, H', K, L])."""
    if not kv_quant.is_int8(k):
        return kl_drift(q, k, key_valid, s_prev, mode="cluster", backend=backend)

    def reference(q, k, key_valid, s_prev):
        p = proxy_probs(q, k, key_valid)
        kl = jnp.sum(kl_terms(p, s_prev.astype(jnp.float32), "cluster"), axis=-1)
        return jnp.mean(jnp.maximum(kl, 0.0), axis=1), p

    def pallas(flavor, interpret):
        return lambda q, k, key_valid, s_prev: kl_drift_pallas(q, kv_quant.read(k), key_valid, s_prev,
                                                              mode="cluster", flavor=flavor, interpret=interpret)

    return dispatch("kl_drift", backend, (q, k, key_valid, s_prev), reference=reference, pallas=pallas,
                    interpret_flavor="triton")


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
