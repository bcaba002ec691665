"""Pallas kernels of Polestar, each beside a plain-jnp ``*_reference`` with the same signature.

* :func:`kl_drift`: attention probabilities of a few query rows against all keys fused with the KL to the
  previous probabilities (token drift with block queries, cluster drift with centroid proxy queries).
* :func:`gather_rows` / :func:`scatter_rows` / :func:`scatter_kv_rows`: refresh-row data movement
  (with int8 dequantisation), :func:`centroid_shift`: the centroid update of a refresh,
  :func:`quantize_rows` / :func:`dequantize_rows`.

Every wrapper takes ``backend=`` ("auto", "pallas", "interpret", "reference"; see :mod:`.backend`).
"""
from polestar_jax.kernels.backend import KINDS, resolve_backend
from polestar_jax.kernels.kl_drift import kl_drift, kl_drift_reference
from polestar_jax.kernels.refresh import (centroid_shift, centroid_shift_reference, dequantize_rows, gather_rows,
                                          gather_rows_reference, quantize_rows, scatter_kv_rows,
                                          scatter_kv_rows_reference, scatter_rows, scatter_rows_reference)

__all__ = ["KINDS", "resolve_backend", "kl_drift", "kl_drift_reference", "gather_rows", "gather_rows_reference",
           "scatter_rows", "scatter_rows_reference", "scatter_kv_rows", "scatter_kv_rows_reference",
           "centroid_shift", "centroid_shift_reference", "quantize_rows", "dequantize_rows"]
