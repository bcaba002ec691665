"""Sharding over a ``jax.sharding.Mesh`` with axes ``data`` (batch) and ``model`` (tensor parallel).

Parameters: column-parallel q/k/v/gate/up (output features over ``model``), row-parallel attention-out and
down projections (input features over ``model``), vocab-parallel LM head, embedding split over features;
norms replicated. The decode state is sharded with the batch over ``data`` (K/V caches and Polestar's
proxy attention additionally over heads on ``model``). A dimension that the axis size does not divide is
replicated instead, so any mesh works for any model (at some cost). XLA's SPMD partitioner inserts the
collectives; the decode code itself is unchanged.

Multi-host: :func:`maybe_initialize_distributed` calls ``jax.distributed.initialize()`` when the usual
environment variables are set; nothing here assumes one process.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from polestar_jax.errors import PolestarError

_PARAM_SPECS = {
    "wte": (None, "model"),
    "lm_head": (None, "model"),
    "ln_f": (None,),
    "attn_norm": (None, None), "ff_norm": (None, None),
    "wq": (None, None, "model"), "wk": (None, None, "model"), "wv": (None, None, "model"),
    "wo": (None, "model", None),
    "w_gate": (None, None, "model"), "w_up": (None, None, "model"),
    "w_down": (None, "model", None),
}


def parse_mesh(spec: str) -> dict[str, int]:
    """``"data=2,model=4"`` -> ``{"data": 2, "model": 4}`` (raises :class:`PolestarError` when malformed)."""
    out: dict[str, int] = {}
    for part in spec.split(","):
        name, _, size = part.partition("=")
        name = name.strip()
        if name not in ("data", "model") or not size.strip().isdigit() or int(size) < 1:
            raise PolestarError(f"invalid --mesh {spec!r} (expected e.g. data=2,model=4)")
        out[name] = int(size)
    return out


def make_mesh(spec: str | dict[str, int]) -> Mesh:
    """A (data, model) mesh over the first data*model devices."""
    sizes = parse_mesh(spec) if isinstance(spec, str) else dict(spec)
    d, m = sizes.get("data", 1), sizes.get("model", 1)
    devices = jax.devices()
    if d * m > len(devices):
        raise PolestarError(f"mesh data={d},model={m} needs {d * m} devices, {len(devices)} available")
    return Mesh(np.asarray(devices[: d * m]).reshape(d, m), ("data", "model"))


def _fit(shape: tuple[int, ...], axes: tuple, mesh: Mesh) -> P:
    """PartitionSpec ``axes`` with every axis that does not divide its dimension dropped."""
    out = []
    for dim, ax in zip(shape, axes + (None,) * (len(shape) - len(axes))):
        out.append(ax if ax is not None and dim % mesh.shape[ax] == 0 else None)
    return P(*out)


def param_shardings(params: Any, mesh: Mesh) -> Any:
    """NamedShardings for the parameter pytree of :mod:`polestar_jax.model`."""

    def spec(path, leaf):
        name = str(getattr(path[-1], "key", path[-1]))
        return NamedSharding(mesh, _fit(leaf.shape, _PARAM_SPECS.get(name, ()), mesh))

    return jax.tree_util.tree_map_with_path(spec, params)


def _batch_spec(name: str, leaf, mesh: Mesh) -> P:
    from polestar_jax.polestar import _LAYER_MAJOR  # Polestar's per-layer fields [N, b, ...]

    layer_major = name in ("k_cache", "v_cache") + _LAYER_MAJOR
    if name in ("k_cache", "v_cache", "s_prev"):
        return _fit(leaf.shape, (None, "data", "model"), mesh)
    if name == "p_prev":
        return _fit(leaf.shape, ("data", "model"), mesh)
    if layer_major:
        return _fit(leaf.shape, (None, "data"), mesh)
    if leaf.ndim == 0:
        return P()
    return _fit(leaf.shape, ("data",), mesh)


def state_shardings(tree: Any, mesh: Mesh) -> Any:
    """NamedShardings for a DecodeState (or a Replay / any pytree whose leaves lead with the batch)."""

    def spec(path, leaf):
        names = [str(getattr(p, "name", getattr(p, "key", ""))) for p in path]
        return NamedSharding(mesh, _batch_spec(names[-1] if names else "", leaf, mesh))

    return jax.tree_util.tree_map_with_path(spec, tree)


def shard(tree: Any, shardings: Any) -> Any:
    return jax.device_put(tree, shardings)


def maybe_initialize_distributed() -> bool:
    """Calls ``jax.distributed.initialize()`` when a multi-process environment is configured
    (``JAX_COORDINATOR_ADDRESS`` or ``COORDINATOR_ADDRESS`` with process count/id). Returns whether it did."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS") or os.environ.get("COORDINATOR_ADDRESS"):
        try:
            jax.distributed.initialize()
            return True
        except RuntimeError:  # already initialised
            return False
    return False


def to_host(tree: Any) -> Any:
    """Fetches a (possibly multi-host) pytree to numpy on every process."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(tree, tiled=True)
    return jax.device_get(tree)


def mesh_or_none(spec: Optional[str]) -> Optional[Mesh]:
    return make_mesh(spec) if spec else None
