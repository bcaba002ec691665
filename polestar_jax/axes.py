"""Declared mesh axes of the decode state's fields: the leaf every state module and the sharding read.

Every array field of a state pytree declares its axes once (:func:`axes`): which dimension is the batch
(mesh axis ``"data"``) and which may be split over the ``"model"`` axis. Row selection (:func:`select_rows`:
a finished row waits unchanged), the block program's per-row split and the sharding
(:mod:`polestar_jax.sharding`) read those declarations; nothing else knows where a field's batch axis is.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

#: Axes of a batch-leading field: [b, ...].
BATCH = ("data",)
#: Axes of a layer-major field: [N, b, ...].
LAYER_BATCH = (None, "data")
#: The name of the rows axis of the block program's per-row ``vmap`` (a running batch: each row at its own block).
ROWS = "rows"


def axes(spec: tuple = BATCH, select: bool | str = True, **kwargs):
    """A state field whose dimensions map to the mesh axes ``spec`` (``"data"`` marks the batch axis,
    ``"model"`` a dimension that may be split over the model axis, None a replicated one). ``select``: how
    :func:`select_rows` treats it: True, row by row; False, the new value as is (fields a step only writes
    for active rows); ``"start"``, row by row except after a decode step (``in_step``: a field the block
    start writes for every row, and a step only for its active rows)."""
    if not (isinstance(select, bool) or select == "start"):
        raise ValueError(f"select must be True, False or 'start', not {select!r}")
    return flax.struct.field(metadata={"axes": tuple(spec), "select": select}, **kwargs)


class Axes:
    """The declared mesh axes of one array leaf (an opaque pytree leaf)."""

    def __init__(self, spec: tuple, select: bool | str = True):
        self.spec, self.select = tuple(spec), select

    @property
    def batch(self) -> int:
        """Index of the batch dimension."""
        return self.spec.index("data")

    def __repr__(self):
        return f"Axes{self.spec}"


def axes_of(tree: Any) -> Any:
    """A pytree like ``tree`` (a state dataclass, or any pytree whose leaves lead with the batch, such as
    a Replay) with an :class:`Axes` in place of every array leaf."""
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        out = {}
        for f in dataclasses.fields(tree):
            v = getattr(tree, f.name)
            if v is None or not f.metadata.get("pytree_node", True):
                out[f.name] = v
            elif "axes" in f.metadata:
                out[f.name] = jax.tree.map(lambda _: Axes(f.metadata["axes"], f.metadata["select"]), v)
            else:
                out[f.name] = axes_of(v)
        return tree.replace(**out)
    return jax.tree.map(lambda leaf: Axes(BATCH[: min(1, len(getattr(leaf, "shape", ())))]), tree)


def select_rows(active: jax.Array, new: Any, old: Any, in_step: bool = False) -> Any:
    """Per batch row: ``new`` where ``active`` [b], else ``old`` (a finished row waits unchanged); fields
    declared ``select=False`` take ``new`` as is, and so do those declared ``select="start"`` after a decode
    step (``in_step``)."""

    def sel(n, o, ax: Axes):
        if ax.select is False or (in_step and ax.select == "start"):
            return n
        shape = [1] * n.ndim
        shape[ax.batch] = active.shape[0]
        return jnp.where(active.reshape(shape), n, o)

    return jax.tree.map(sel, new, old, axes_of(new))
