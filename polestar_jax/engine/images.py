"""Image rows in the engine: how a batch of LLaDA-V prompts with images becomes ids every decoder runs.

A prompt with images reaches the engine as **local** ids: its text ids, and for its ``j``-th image row the id
``E + j`` (``E`` = the embedding's rows; :func:`prompt_with_images` makes them from ``<image>`` placeholders
and the images, through the tower, the projector and the splicing of :mod:`polestar_jax.models.llada_v`),
together with those rows, [R, D]. A batch of ``b`` rows at prompt slot ``S`` keeps one table of
``b * S`` rows in ``params["image_rows"]`` (which :func:`polestar_jax.models.llada_v.embed` reads): row
``r``'s image rows at ``r * S``, its local ids shifted by ``r * S`` (:func:`place`). A prompt cannot hold
more image rows than its slot, so the regions never overlap, the table's shape follows the state's (one
program per batch shape, text-only rows included), and a running batch's new row rewrites its own region
only (:class:`SlotTable`). Each row reads only its own rows: a row's tokens do not depend on the images of
the others.
"""
from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from polestar_jax.config import ModelConfig
from polestar_jax.errors import PolestarError


def has_vision(cfg: ModelConfig) -> bool:
    """Whether the model takes images (LLaDA-V)."""
    return getattr(cfg, "vision", None) is not None


def prompt_with_images(params: dict, cfg: ModelConfig, ids: Sequence[int],
                       images: Sequence[Any]) -> tuple[list[int], Optional[jax.Array]]:
    """``(local ids, rows [R, D] or None)`` of prompt ``ids`` whose ``IMAGE_TOKEN_INDEX`` placeholders take
    ``images`` (RGB PIL images) in order (module docstring); cut to ``cfg.vision.model_max_length``."""
    from polestar_jax.models import llada_v

    if not has_vision(cfg):
        raise PolestarError(f"this {cfg.family} model takes no images (LLaDA-V models do)")
    rows = [llada_v.encode_image(params, im, cfg) for im in images]
    (out,), with_rows = llada_v.with_image_rows({"wte": params["wte"]}, [ids], [rows], cfg)
    return out, with_rows.get("image_rows")


def image_counts(prompts: Sequence[Sequence[int]], images: Optional[Sequence[Optional[jax.Array]]]) -> list[int]:
    """Per prompt, the image rows its local ids may name (0 without images); a one-line error when
    ``images`` does not have one entry per prompt."""
    if images is None:
        return [0] * len(prompts)
    if len(images) != len(prompts):
        raise PolestarError(f"images has {len(images)} entries for {len(prompts)} prompts")
    return [0 if r is None else int(r.shape[0]) for r in images]


def place(ids: Sequence[int], row: int, width: int, embedding_rows: int) -> list[int]:
    """Local ids of the prompt in batch row ``row`` as the table's ids: image ids shifted to the row's region."""
    shift = row * width
    return [int(i) + shift if i >= embedding_rows else int(i) for i in ids]


def batch_table(params: dict, prompts: Sequence[Sequence[int]], images: Sequence[Optional[jax.Array]],
                width: int) -> tuple[list[list[int]], dict]:
    """A fixed batch's prompts placed (:func:`place`) and the parameters with its table [b * width, D]."""
    e, (d, dtype) = params["wte"].shape[0], (params["wte"].shape[1], params["wte"].dtype)
    if all(r is None for r in images):  # text only: an empty table of the batch's shape
        return [list(p) for p in prompts], {**params, "image_rows": jnp.zeros((len(prompts) * width, d), dtype)}
    parts = []
    for r in images:
        r = jnp.zeros((0, d), dtype) if r is None else r.astype(dtype)
        if r.shape[0] > width:
            raise PolestarError(f"a prompt has {r.shape[0]} image rows, more than its prompt slot {width}")
        parts.append(jnp.pad(r, ((0, width - r.shape[0]), (0, 0))))
    placed = [place(p, k, width, e) for k, p in enumerate(prompts)]
    return placed, {**params, "image_rows": jnp.concatenate(parts)}


@functools.partial(jax.jit, donate_argnums=0)
def _put(table: jax.Array, rows: jax.Array, start) -> jax.Array:
    return lax.dynamic_update_slice_in_dim(table, rows.astype(table.dtype), start, axis=0)


class SlotTable:
    """The image-row table of a running batch of ``size`` slots at prompt slot ``width``: slot ``s`` owns
    rows ``[s * width, (s + 1) * width)``; :meth:`insert` writes a new row's image rows there. On a device
    ``mesh`` the table is replicated on every device, like the embedding it extends."""

    def __init__(self, params: dict, size: int, width: int, mesh=None):
        self.width, self.embedding_rows = int(width), params["wte"].shape[0]
        self.table = jnp.zeros((int(size) * self.width, params["wte"].shape[1]), params["wte"].dtype)
        self._place = lambda a: a
        if mesh is not None:
            from jax.sharding import NamedSharding, PartitionSpec

            from polestar_jax import sharding

            replicated = NamedSharding(mesh, PartitionSpec())
            self._place = lambda a: sharding.shard(a, replicated)
            self.table = self._place(self.table)

    def params(self, params: dict) -> dict:
        """``params`` with the table (what the block program reads)."""
        return {**params, "image_rows": self.table}

    def insert(self, prompt: Sequence[int], rows: Optional[jax.Array], slot: int) -> list[int]:
        """Writes ``rows`` [R, D] into ``slot``'s region and returns ``prompt``'s ids placed there."""
        if rows is not None and rows.shape[0]:
            if rows.shape[0] > self.width:
                raise PolestarError(f"a prompt has {rows.shape[0]} image rows, more than the prompt slot {self.width}")
            self.table = _put(self.table, self._place(rows), jnp.int32(slot * self.width))
        return place(prompt, slot, self.width, self.embedding_rows)
