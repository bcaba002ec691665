"""Pallas kernels of Polestar, each beside a plain-jnp ``*_reference`` with the same signature.

* :func:`kl_drift`: attention probabilities of a few query rows against all keys fused with the KL to the
  previous probabilities (token drift with block queries, cluster drift with centroid proxy queries).
* :func:`gather_rows` / :func:`scatter_rows` / :func:`scatter_kv_rows`: refresh-row data movement
  (with int8 dequantisation), :func:`centroid_shift`: the centroid update of a refresh,
  :func:`quantize_rows` / :func:`dequantize_rows`.

Every wrapper takes ``backend=`` ("auto", "pallas", "interpret", "reference"; see :mod:`.backend`).
Import them from their modules (``polestar_jax.kernels.kl_drift``, ``.refresh``, ``.backend``).
"""
