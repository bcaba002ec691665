"""Token and cluster drift on materialised probabilities: the plain formulas the fused kernel replaces
(docs/algorithm.md#token-drift, #cluster-drift), kept here as test references."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from polestar_jax.kernels.kl_drift import kl_terms


def _head_mean_kl(p: jax.Array, pp: jax.Array, mode: str) -> jax.Array:
    kl = jnp.sum(kl_terms(p.astype(jnp.float32), pp.astype(jnp.float32), mode), axis=-1)
    return jnp.mean(jnp.maximum(kl, 0.0), axis=1)


def token_drift(p_t: jax.Array, p_prev: jax.Array) -> jax.Array:
    """p_t, p_prev: [b, H, T, L] attention probabilities -> drift [b, T] (float32)."""
    return _head_mean_kl(p_t, p_prev, "token")


def cluster_drift(s: jax.Array, s_prev: jax.Array) -> jax.Array:
    """s, s_prev: [b, H, K, L] proxy attention -> per-cluster drift [b, K] (float32)."""
    return _head_mean_kl(s, s_prev, "cluster")
